"""Run by tests/test_zero_inner_optimizers.py on 2 gloo ranks: sharded_galore.py's model and batches under DeepSpeed
ZeRO (ENGINE=zero1 | zero2 | zero3, PRESET), saved with ``engine.save_checkpoint`` (and the GaLore layers' state,
as the Trainer saves galore_state.pt) after SAVE_AT steps and trained on to STEPS; then a second engine over a
fresh model loads that checkpoint and trains the same steps. Writes to argv[1] both runs' losses after SAVE_AT
and final merged weights (rank 0).

LOAD_FIRST=1: the second engine loads the checkpoint before DeepSpeedGaLoreOptimizer registers its fragments (as
the Trainer does: DeepSpeed's resume runs before on_train_begin); else the adapter is built first.
"""

import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from _deepspeed_loop import zero_engine  # also skips DeepSpeed's shared-memory op build (gloo needs none)
from _teardown import shut_down
from sharded_galore import ACCUMULATION, batches, build_model

from hf_galore_plugin import after_step, merged_state_dict
from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer
from hf_galore_plugin.integrations.distributed import gathered_galore_state_dict, load_gathered_galore_state_dict

SAVE_AT = int(os.environ.get("SAVE_AT", 15))


def train(engine, model: nn.Module, galore_optimizer, steps) -> list[float]:
    losses = []
    for micro_batches in steps:
        total = torch.zeros(())
        for xm, ym in micro_batches:
            loss = nn.functional.mse_loss(engine(xm), ym)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / ACCUMULATION
        after_step(model, galore_optimizer)
        dist.all_reduce(total)
        losses.append(float(total / dist.get_world_size()))
    return losses


def final_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in merged_state_dict(model).items()}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = int(os.environ["ENGINE"][-1])
    preset = os.environ.get("PRESET", "galore_muon")
    steps = list(batches(rank, world))
    folder = os.path.join(os.path.dirname(out), "checkpoint")

    model = build_model(preset, "std")
    engine = zero_engine(model, stage, world)
    galore_optimizer = DeepSpeedGaLoreOptimizer(engine)
    train(engine, model, galore_optimizer, steps[:SAVE_AT])
    engine.save_checkpoint(folder, tag="saved")
    galore_state = gathered_galore_state_dict(model)
    losses = train(engine, model, galore_optimizer, steps[SAVE_AT:])
    weights = final_weights(model)

    resumed_model = build_model(preset, "std")
    resumed_engine = zero_engine(resumed_model, stage, world)
    load_first = os.environ.get("LOAD_FIRST") == "1"
    if not load_first:
        resumed_optimizer = DeepSpeedGaLoreOptimizer(resumed_engine)
    resumed_engine.load_checkpoint(folder, tag="saved")
    load_gathered_galore_state_dict(resumed_model, galore_state)
    if load_first:
        resumed_optimizer = DeepSpeedGaLoreOptimizer(resumed_engine)
    resumed_losses = train(resumed_engine, resumed_model, resumed_optimizer, steps[SAVE_AT:])
    resumed_weights = final_weights(resumed_model)
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "weights": weights,
                "resumed_losses": resumed_losses,
                "resumed_weights": resumed_weights,
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
