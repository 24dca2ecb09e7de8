"""The DeepSpeed training loop of sharded_galore.py and the engine it builds (zero_engine, also zero_resume.py's)."""

import os
import sys

import deepspeed
import deepspeed.comm.torch  # noqa: F401  (loads the module patched below)
import torch
import torch.distributed as dist
from torch import nn

from hf_galore_plugin import after_step, create_optimizer, merged_state_dict
from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

from sharded_galore import ACCUMULATION, GLOBAL_BATCH, LR, WEIGHT_DECAY, check_bases_identical

# Test-only: the shared-memory comm op is compiled with g++ on first use (~50 s, 2.5 min on 2 busy
# cores); gloo does not need it. Through sys.modules: the attribute `deepspeed.comm.torch` is the real
# torch package (deepspeed/comm/__init__.py imports torch after its .torch submodule).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def zero_engine(model: nn.Module, stage: int, world: int):
    """A DeepSpeed engine of ZeRO `stage` over `model` with the plugin's optimizer, at sharded_galore.py's batch
    and accumulation (no clipping)."""
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // ACCUMULATION,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    optimizer = create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_deepspeed(model: nn.Module, stage: int, batches, world: int):
    engine = zero_engine(model, stage, world)
    galore_optimizer = DeepSpeedGaLoreOptimizer(engine)
    if os.environ.get("NO_MASTER_SYNC") == "1":
        galore_optimizer.param_changed = lambda param: None  # the bug the tests must catch: a stale master
    losses, refreshes = [], 0
    for step, micro_batches in enumerate(batches):
        total = torch.zeros(())
        for xm, ym in micro_batches:
            loss = nn.functional.mse_loss(engine(xm), ym)
            engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.detach() / ACCUMULATION
        event = after_step(model, galore_optimizer)
        dist.all_reduce(total)
        losses.append(float(total / world))
        if event["refreshed"]:
            refreshes += 1
            check_bases_identical(model, world, step)
    # ZeRO-3 partitions every parameter: gather them all (a tiny model) to merge.
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in merged_state_dict(model).items()}
    return losses, refreshes, weights
