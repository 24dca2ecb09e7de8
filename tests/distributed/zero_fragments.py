"""Run by tests/test_zero_inner_optimizers.py on 2 gloo ranks: the fragments DeepSpeedGaLoreOptimizer registers on
ZeRO's flat fp32 partitions (ZERO_STAGE=1 | 2 | 3) against the factors' values.

Every trainable parameter's fp32 master is set to distinct values (its element index plus 1000 times its index
among the parameters), so a fragment at a wrong offset or over wrong elements reads other values. Checks, on each
rank, that every registered fragment's local elements are the parameter's elements [start, stop), and writes
every rank's fragments (gathered) to argv[1]: "params" (name -> shape), "ranks" (per rank, per flat, its fragments
as (name, shape, start, stop, offset, flat numel, whether the flat is a GaLore group's)). Options (environment): RANK_ (the GaLore rank, 3 by default: factors of 99 and 75 elements,
which ZeRO's alignment pads), ROUND_ROBIN=1 (ZeRO-1/2's round-robin parameter order), ALIGN=1 (ZeRO-1/2's
parameter alignment: padding between parameters), SUB_GROUP_SIZE (ZeRO-3: several sub-groups per group),
PRESET (galore_adamw by default: the mapping needs no other optimizer), BREAK=offset | skip (the bugs the test must
catch: every fragment one element late, the last fragment of each flat left out).
"""

import os
import sys

import deepspeed
import deepspeed.comm.torch  # noqa: F401  (loads the module patched below)
import torch
import torch.distributed as dist
from torch import nn

from _teardown import shut_down
from sharded_galore import Block

from hf_galore_plugin import GaLoreConfig, create_optimizer, galore_layers, prepare_model
from hf_galore_plugin.engines import deepspeed as galore_deepspeed
from hf_galore_plugin.engines.fragments import Fragment, fragments_of, set_fragments

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # as _deepspeed_loop.py: gloo needs no shm op


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(16, 33), Block(33, 25), Block(25, 12), nn.Linear(12, 8))
    config = GaLoreConfig.preset(
        os.environ.get("PRESET", "galore_adamw"),
        scale=0.25,
        rank=int(os.environ.get("RANK_", 3)),
        update_proj_gap=10,
        proj_type="std",
        target_modules=["0.proj", "1.proj", "2.proj"],
    )
    return prepare_model(model, config)


def break_registration() -> None:
    """The bugs the mapping test must catch (BREAK=offset | skip), in the registration itself."""
    register, mode = galore_deepspeed.register_zero_fragments, os.environ.get("BREAK")
    if not mode:
        return

    def broken(zero_optimizer, model):
        registered = register(zero_optimizer, model)
        for flat, _ in registered:
            fragments = list(fragments_of(flat))
            if mode == "offset":
                fragments = [
                    Fragment(f.shape, f.start, f.stop, min(f.offset + 1, flat.numel() - f.numel), f.group, f.name)
                    for f in fragments
                ]
            elif mode == "skip":
                fragments = fragments[:-1]
            set_fragments(flat, fragments)
        return registered

    galore_deepspeed.register_zero_fragments = broken


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = int(os.environ["ZERO_STAGE"])
    model = build_model()
    zero = {"stage": stage}
    if os.environ.get("ROUND_ROBIN") == "1":
        zero["round_robin_gradients"] = True
    if os.environ.get("ALIGN") == "1":
        zero["parameter_alignment"] = True
    if os.environ.get("SUB_GROUP_SIZE"):
        zero["sub_group_size"] = int(os.environ["SUB_GROUP_SIZE"])
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=create_optimizer(model, lr=1e-2), config=config)
    break_registration()
    galore_optimizer = galore_deepspeed.DeepSpeedGaLoreOptimizer(engine)

    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    expected = {}
    for index, (name, param) in enumerate(params):
        shape = tuple(getattr(param, "ds_shape", param.shape))
        value = torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + 1000.0 * (index + 1)
        if stage == 3:
            # DeepSpeed's own partitioning of a whole parameter (its safe_set_full_fp32_param refuses a parameter
            # whose elements do not divide among the ranks), then its copy of the model's partitions into the master
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value.view(shape))
        else:
            deepspeed.utils.safe_set_full_fp32_param(param, value.view(shape))
        expected[name] = value
    if stage == 3:
        engine.optimizer.refresh_fp32_params()

    flats = []
    for flat, members in galore_optimizer.registered_flats:
        fragments = fragments_of(flat)
        assert fragments is not None
        for fragment in fragments:
            got = fragment.local(flat)
            want = expected[fragment.name][fragment.start : fragment.stop]
            assert torch.equal(got, want), (rank, fragment, got[:8], want[:8])
        galore = any(p is layer.galore_factor for p in members for _, layer in galore_layers(model))
        flats.append([(f.name, tuple(f.shape), f.start, f.stop, f.offset, flat.numel(), galore) for f in fragments])
    gathered = [None] * world
    dist.all_gather_object(gathered, flats)
    if rank == 0:
        shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in params}
        torch.save({"params": shapes, "ranks": gathered}, out)


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
