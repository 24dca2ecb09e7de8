"""Run by tests/test_galore_muon.py and tests/test_galore_adafactor.py: galore_muon / galore_adafactor under FSDP1
(FSDP1 with ``use_orig_params=True``, ENGINE=fsdp1, 2 gloo ranks) or in one process (ENGINE=single),
with sharded_galore.py's batches and loop, on MODEL=blocks (sharded_galore.py's model, one unit per Block: the
factor comes first in its unit's flat parameter, so rank 0 holds every factor whole and rank 1 none of them) or
MODEL=one_unit (Block(16, 33), Block(33, 16), Linear(16, 8) as one unit: rank 1 holds none of the first factor
(33 x 4, first in the flat parameter), the second (4 x 33) is cut between the ranks inside its second row).

Writes to argv[1] (rank 0): the loss trajectory and merged weights (as sharded_galore.py), the optimizer state
bytes rank 0 holds (``state_nbytes``), and under FSDP1 the fragment of every registered view on every rank
(name, shape, start, stop). With RESUME_AT=k a second model trains k steps, its optimizer's state goes through a
checkpoint (CHECKPOINT=plain: ``optimizer.state_dict()`` per rank through torch.save / torch.load(weights_only=True);
full / sharded: ``FullyShardedDataParallel.optim_state_dict`` under that state dict type, then
``optim_state_dict_to_load``) into a new optimizer, which trains to the end: its merged weights are written too
("resumed"), to equal the straight run's.
"""

import contextlib
import io
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from _teardown import shut_down

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.append(str(Path(__file__).resolve().parent))
from _engines import wrap_for_engine  # noqa: E402
from sharded_galore import ACCUMULATION, LR, SCALE, WEIGHT_DECAY, Block, batches, build_model, join  # noqa: E402

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, merged_state_dict, prepare_model  # noqa: E402
from hf_galore_plugin.engines.fragments import fragments_of  # noqa: E402

ENGINE = os.environ["ENGINE"]
PRESET = os.environ["PRESET"]
RESUME_AT = int(os.environ.get("RESUME_AT", 0))
CHECKPOINT = os.environ.get("CHECKPOINT", "plain")


MODEL = os.environ.get("MODEL", "one_unit")


def one_unit_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(16, 33), Block(33, 16), nn.Linear(16, 8))
    config = GaLoreConfig.preset(
        PRESET, scale=float(SCALE), rank=4, update_proj_gap=10, proj_type=os.environ.get("PROJ_TYPE", "std"),
        target_modules=["0.proj", "1.proj"], moment_handling=os.environ.get("MOMENT_HANDLING", "keep"),
    )  # fmt: skip
    return prepare_model(model, config)


def prepared(engine: str):
    if MODEL == "blocks":
        model = build_model(PRESET, os.environ.get("PROJ_TYPE", "std"))
        model, forward = wrap_for_engine(model, engine, block_class=Block)
    else:
        # FSDP1: the whole model as one unit (block_class None)
        model, forward = wrap_for_engine(one_unit_model(), engine)
    return model, forward, create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)


def train(model, forward, optimizer, steps, losses: list, world: int) -> None:
    for micro_batches in steps:
        total = torch.zeros(())
        for xm, ym in micro_batches:
            loss = nn.functional.mse_loss(forward(xm), ym) / ACCUMULATION
            loss.backward()
            total += loss.detach()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))


def merged(model) -> dict:
    whole = contextlib.nullcontext()
    if ENGINE == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        whole = FullyShardedDataParallel.summon_full_params(model, writeback=False)
    with whole:
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in merged_state_dict(model).items()}


def checkpointed(model, optimizer, fresh):
    """`optimizer`'s state through a checkpoint (CHECKPOINT) into the new optimizer `fresh`."""
    buffer = io.BytesIO()
    if CHECKPOINT == "plain":
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    kind = {"full": StateDictType.FULL_STATE_DICT, "sharded": StateDictType.SHARDED_STATE_DICT}[CHECKPOINT]
    # Test-only: the full optimizer state dict's default offload_to_cpu=True returns, for parameters already on
    # the CPU, views of one gather buffer that the next state key overwrites (every key would read the last
    # one's values, a plain AdamW's too, torch 2.13); on a GPU the offload copies.
    from torch.distributed.fsdp import FullOptimStateDictConfig

    # Not rank0_only (accelerate's choice for FULL_STATE_DICT): torch's rank-0-only load calls .cpu() on every state
    # value, which fails for any state that is not a tensor (an int step, the statistics' lists).
    optim_config = FullOptimStateDictConfig(offload_to_cpu=False) if CHECKPOINT == "full" else None
    with FSDP.state_dict_type(model, kind, optim_state_dict_config=optim_config):
        saved = FSDP.optim_state_dict(model, optimizer)
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)  # a sharded one holds ShardedTensors
        fresh.load_state_dict(FSDP.optim_state_dict_to_load(model, fresh, loaded))


def main(out: str) -> None:
    distributed, rank, world = join(ENGINE)
    model, forward, optimizer = prepared(ENGINE)
    layout = [
        (name.replace("_fsdp_wrapped_module.", ""), tuple(f.shape), f.start, f.stop)
        for name, param in model.named_parameters()
        for f in fragments_of(param) or ()
    ]
    losses: list = []
    train(model, forward, optimizer, batches(rank, world), losses, world)
    result = {"losses": losses, "weights": merged(model), "state_nbytes": optimizer.state_nbytes()}
    if RESUME_AT:
        model2, forward2, optimizer2 = prepared(ENGINE)
        steps = batches(rank, world)
        first = [next(steps) for _ in range(RESUME_AT)]
        train(model2, forward2, optimizer2, first, [], world)
        fresh = create_optimizer(model2, lr=LR, weight_decay=WEIGHT_DECAY)
        checkpointed(model2, optimizer2, fresh)
        train(model2, forward2, fresh, steps, [], world)
        result["resumed"] = merged(model2)
    layouts = [None] * world
    if distributed:
        dist.all_gather_object(layouts, layout)
    result["layouts"] = layouts
    if rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
