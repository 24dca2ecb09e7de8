"""Run by tests/test_distributed.py under torchrun (gloo, 2 processes) and in one process.

Trains a tiny model with GaLore under DDP over a fixed global batch (gradient accumulation 2),
checks on every refresh that all ranks hold the same basis, and writes the loss trajectory and
the merged weights of rank 0 to OUT (argv[1]).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, merged_state_dict, prepare_model

STEPS, GLOBAL_BATCH, ACCUMULATION = 30, 16, 2


def main(out: str) -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 24), nn.GELU(), nn.Linear(24, 8))
    preset = os.environ.get("PRESET", "galore_adamw")
    model = prepare_model(model, GaLoreConfig.preset(preset, rank=4, update_proj_gap=10, target_modules=["0", "2"]))
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.01)
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    gen = torch.Generator().manual_seed(1)
    losses, refreshes = [], 0
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
        y = torch.sin(x[:, :8] * 2)
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        xs, ys = x[local].chunk(ACCUMULATION), y[local].chunk(ACCUMULATION)
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            context = ddp.no_sync() if distributed and i < ACCUMULATION - 1 else torch.enable_grad()
            with context:
                loss = nn.functional.mse_loss(ddp(xm), ym) / ACCUMULATION
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
            for _, layer in galore_layers(model):
                basis = layer.basis("right") if layer.basis("right") is not None else layer.basis("left")
                if distributed:
                    gathered = [torch.empty_like(basis) for _ in range(world)]
                    dist.all_gather(gathered, basis.contiguous())
                    assert all(torch.equal(gathered[0], g) for g in gathered), f"bases differ at step {step}"
    if rank == 0:
        torch.save({"losses": losses, "refreshes": refreshes, "weights": merged_state_dict(model)}, out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
