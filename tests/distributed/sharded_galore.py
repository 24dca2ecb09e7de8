"""Run by tests/test_distributed_fsdp.py and tests/test_distributed_deepspeed.py: GaLore under a
data-parallel or sharding engine (ENGINE=ddp | fsdp2 | fsdp1 (use_orig_params) | zero1 | zero2 | zero3) on 2 gloo ranks, or in one process
(ENGINE=single), over the same global batch with gradient accumulation 2.

Checks on every refresh that all ranks hold the same bases, and writes the loss trajectory, the
merged weights (gathered to full tensors) and per-layer base multipliers of rank 0 to argv[1].
"""

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from _teardown import shut_down

# Appended, not prepended: the benchmark scripts' names (step, memory, ...) must not shadow anything.
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _engines import wrap_for_engine  # noqa: E402

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, merged_state_dict, prepare_model
from hf_galore_plugin.layers.linear import COUNTER_NAMES

STEPS = int(os.environ.get("STEPS", 30))
# WRITTEN_OUT_MIN_VALUES: the activation count from which a plain-W0 layer runs as one autograd node (0: every
# layer, whose calls here are far below the default); the run counts the node's calls as "written_out".
NODE_CALLS = [0]
if "WRITTEN_OUT_MIN_VALUES" in os.environ:
    from hf_galore_plugin.layers import function

    function.WRITTEN_OUT_MIN_VALUES = int(os.environ["WRITTEN_OUT_MIN_VALUES"])
    _apply = function.WrittenOutLinear.apply

    def _counted(*args):
        NODE_CALLS[0] += 1
        return _apply(*args)

    function.WrittenOutLinear.apply = _counted
GLOBAL_BATCH, ACCUMULATION, WEIGHT_DECAY = 16, 2, 0.01
# SCALE: 0.25 (one scale for every layer) or 'auto' (each layer's sqrt(projected side / rank), about 2-3 here).
# The weight tolerances of the engine comparisons are counted at the step size of scale 0.25 and lr 1e-2, so a
# run at 'auto' takes lr 1e-3: its projected layers step about as far (1e-3 x 2-3 against 1e-2 x 0.25); at lr 1e-2
# they would move ~10x further per step, and the reduction-order differences with them.
SCALE = os.environ.get("SCALE", "0.25")
LR = float(os.environ.get("LR", 1e-3 if SCALE == "auto" else 1e-2))


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


def build_model(preset: str, proj_type: str) -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes shard unevenly over 2 ranks: 33 rows (right basis, 33x16) -> 17 + 16; 25 rows (left
    # basis, 25x33) -> 13 + 12; the left factors have 4 rows -> 2 + 2.
    model = nn.Sequential(Block(16, 33), Block(33, 25), Block(25, 12), nn.Linear(12, 8))
    config = GaLoreConfig.preset(
        preset,
        scale=SCALE if SCALE == "auto" else float(SCALE),
        rank=4,
        update_proj_gap=10,
        proj_type=proj_type,
        target_modules=["0.proj", "1.proj", "2.proj"],
        basis_method=os.environ.get("BASIS_METHOD", "svd"),
        # randomized: k = rank, so every layer's sketches (k (m + n) x 2 values) are smaller than its
        # gradient and the data-parallel refresh exchanges sketches (see sketch_exchange_numel)
        oversampling=0,
        moment_handling=os.environ.get("MOMENT_HANDLING", "keep"),
        refresh_schedule=os.environ.get("REFRESH_SCHEDULE", "aligned"),
        refresh_budget_mb=float(os.environ["REFRESH_BUDGET_MB"]) if "REFRESH_BUDGET_MB" in os.environ else None,
        # staggered: the phases at one rank's rows of the 2-rank runs' forwards in every run (measured, the
        # one-process oracle's forwards of twice the rows would pack other phases)
        refresh_tokens=GLOBAL_BATCH // ACCUMULATION // 2 if os.environ.get("REFRESH_SCHEDULE") == "staggered" else None,
        state_offload=os.environ.get("STATE_OFFLOAD", "none"),
        residual=os.environ.get("RESIDUAL") == "1",
    )
    return prepare_model(model, config)


def batches(rank: int, world: int):
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
        y = torch.sin(x[:, :8] * 2)
        if os.environ.get("RESIDUAL") == "1":
            # The residual moves W0 after each micro-batch: the ranks' k-th micro-batches together must be the one
            # process's k-th, so that both runs take the same micro-steps.
            micro = GLOBAL_BATCH // ACCUMULATION
            share = micro // world
            parts = [slice(k * micro + rank * share, k * micro + (rank + 1) * share) for k in range(ACCUMULATION)]
            yield [(x[part], y[part]) for part in parts]
            continue
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        yield list(zip(x[local].chunk(ACCUMULATION), y[local].chunk(ACCUMULATION)))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_bases_identical(model: nn.Module, world: int, step: int) -> None:
    for name, layer in galore_layers(model):
        for side in ("left", "right"):
            basis = layer.basis(side)
            if basis is None or world == 1:
                continue
            gathered = [torch.empty_like(basis) for _ in range(world)]
            dist.all_gather(gathered, basis.contiguous())
            assert all(torch.equal(gathered[0], g) for g in gathered), f"{name} {side} basis differs at step {step}"


def join(engine_name: str) -> tuple[bool, int, int]:
    """(distributed, rank, world) of this process, joined to the gloo group under any engine but 'single'."""
    distributed = engine_name != "single"
    # An engine writing a counter buffer behind a layer's back (DDP's buffer broadcast) must not change it.
    warnings.filterwarnings("error", message=".*written without sync_counters")
    if distributed:
        dist.init_process_group("gloo")
    return distributed, (dist.get_rank() if distributed else 0), (dist.get_world_size() if distributed else 1)


def main(out: str) -> None:
    engine_name = os.environ["ENGINE"]
    distributed, rank, world = join(engine_name)
    model = build_model(os.environ.get("PRESET", "galore_adamw"), os.environ.get("PROJ_TYPE", "std"))
    if os.environ.get("BASIS_METHOD") == "randomized":
        assert all(l.sketch_exchange_numel() < l.out_features * l.in_features for _, l in galore_layers(model))

    if engine_name.startswith("zero"):
        from _deepspeed_loop import train_deepspeed

        losses, refreshes, weights = train_deepspeed(model, int(engine_name[-1]), batches(rank, world), world)
    else:
        model, forward = wrap_for_engine(
            model, engine_name, block_class=Block, use_orig_params=os.environ.get("USE_ORIG_PARAMS", "1") == "1"
        )
        optimizer = create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
        if os.environ.get("FAKE_STEP") == "1":
            # What FSDP2/DCP checkpointing does to an optimizer without state: a zero-gradient step at lr 0.
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            get_optimizer_state_dict(model, optimizer)
            assert all(l.alpha == 1.0 for _, l in galore_layers(model))
            assert all(l.counter("galore_step") == 0 for _, l in galore_layers(model))
        losses, refreshes = [], 0
        for step, micro_batches in enumerate(batches(rank, world)):
            total = torch.zeros(())
            for i, (xm, ym) in enumerate(micro_batches):
                last = i == ACCUMULATION - 1
                if engine_name == "fsdp2":
                    model.set_requires_gradient_sync(last)
                sync = forward.no_sync() if engine_name == "ddp" and not last else contextlib.nullcontext()
                with sync:
                    loss = nn.functional.mse_loss(forward(xm), ym) / ACCUMULATION
                    loss.backward()
                total += loss.detach()
            optimizer.step()
            event = after_step(model, optimizer)
            optimizer.zero_grad()
            if distributed:
                dist.all_reduce(total)
                total /= world
            losses.append(float(total))
            if event["refreshed"]:
                refreshes += 1
                check_bases_identical(model, world, step)

        whole = contextlib.nullcontext()
        if engine_name == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            whole = FullyShardedDataParallel.summon_full_params(model, writeback=False)
        with whole:
            weights = {k: full(v).detach().clone() for k, v in merged_state_dict(model).items()}
        del forward  # DDP's reducer, released before the process group goes
        if os.environ.get("STATE_NUMEL_OUT") and rank == 0:
            # The optimizer state this rank holds (local shards of DTensors): a sharding engine keeps part of it.
            state_numel = sum(
                (v.to_local() if hasattr(v, "to_local") else v).numel()
                for state in optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
            torch.save(state_numel, os.environ["STATE_NUMEL_OUT"])
    multipliers = {name.replace("_fsdp_wrapped_module.", ""): layer.alpha for name, layer in galore_layers(model)}
    scales = {name.replace("_fsdp_wrapped_module.", ""): layer.scale for name, layer in galore_layers(model)}
    for name, layer in galore_layers(model):
        saved = layer.state_dict()  # what a checkpoint holds
        buffers = {counter: int(saved[counter]) for counter in COUNTER_NAMES}
        assert {counter: layer.counter(counter) for counter in COUNTER_NAMES} == buffers, (rank, name, buffers)
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "refreshes": refreshes,
                "weights": weights,
                "multipliers": multipliers,
                "scales": scales,
                "written_out": NODE_CALLS[0],
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1])
    shut_down()
