"""Run by tests/test_experts.py: a tiny Qwen3-MoE with GaLore experts (galore_adamw, experts=True) under an
engine on 2 gloo ranks (ENGINE=ddp | fsdp1 | fsdp2 | zero2 | zero3) or in one process (ENGINE=single), over the same
global batch: each rank takes half of it. SCHEDULE=default keeps the package's refresh defaults (staggered
phases, sketch bases); SCHEDULE=paper sets PAPER_REFRESH (aligned, exact SVD). Checks on every refresh that
all ranks hold the same bases, and writes the losses, the merged weights and the experts' GaLore state
(bases, counters; gathered to whole tensors) of rank 0 to argv[1].

The loss is the mean over tokens of equal-length sequences, so the mean of the two ranks' losses (what the
engines' gradient averaging computes) is the single process's loss. A refresh averages each expert's recorded
gradient (or sketch) over the ranks; an expert counts as routed to when any rank sent it tokens.

Adam's eps is 1e-2 (the factors' gradient elements are ~1e-3 here), not 1e-8. With eps = 1e-8 the first step
after a moment reset is lr * g / (|g| + eps), the sign of g for every element above 1e-8: a factor element
whose gradient is smaller than the two-halves-vs-one-batch rounding difference moves by +lr in one run and
-lr in the other. Measured with eps = 1e-8 (8 steps, default schedule, moment_handling='reset'): expert
weights 7.7e-5 apart, one factor element 0.0167 apart after step 7 (its gradient 4.8e-8, the runs'
gradients 8.7e-8 apart); with every expert left to plain AdamW, the embedding rows are 7.7e-4 apart. With
eps = 1e-3 the step still multiplies a gradient difference by lr / eps = 10 (embedding and attention
weights up to 1.7e-6 apart). At 1e-2 the step is close to linear in small gradients, so what is compared is
the engines' arithmetic, not Adam's sign function; the expert weights still move by up to 4.9e-4 in 8 steps
(the test checks > 1e-4, against the 1e-6 it compares them within).
"""

import contextlib
import os
import sys
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist

from _teardown import shut_down

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # appended: shadows nothing
from _engines import wrap_for_engine  # noqa: E402
from sharded_galore import check_bases_identical, full, join  # noqa: E402
from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, merged_state_dict  # noqa: E402
from hf_galore_plugin import prepare_model  # noqa: E402
from hf_galore_plugin.config import PAPER_REFRESH  # noqa: E402
from hf_galore_plugin.layers.experts import GaLoreExpertStack  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

# Under SCHEDULE=paper: refreshes at steps 0, 3 and 6. Under the default: the 4 expert stacks and 8 attention
# layers in 3 staggered phases, each layer calibrated at its phase (0, 1 or 2) and refreshed 3 steps later.
STEPS, LR, EPS = 8, 1e-2, 1e-2
# SPARSE=1: 7 experts, top-1 routing, 2 sequences of 4 tokens a step (one per rank): experts get no tokens
# in a refresh step (they keep their basis and moments) or tokens on one rank only (the ranks must agree
# that they were routed to); FSDP2 cuts the 7 experts 4 + 3.
SPARSE = os.environ.get("SPARSE") == "1"
GLOBAL_BATCH, SEQ, EXPERTS, TOP_K = (2, 4, 7, 1) if SPARSE else (4, 16, 4, 2)


def build():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        decoder_sparse_step=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    # paper: aligned + exact SVD; aligned: aligned + the default sketch; default: staggered + sketch.
    # default: the staggered phases at one rank's tokens of the 2-rank runs in every run (measured, the one-process
    # oracle's forward of the whole batch would pack other phases).
    default = {"refresh_tokens": GLOBAL_BATCH * SEQ // 2}
    schedule = {"paper": PAPER_REFRESH, "aligned": {"refresh_schedule": "aligned"}, "default": default}[
        os.environ["SCHEDULE"]
    ]
    # RANKS_FILE: per-layer ranks fixed from the start (rank_allocation=<galore_ranks.json>), expert stacks included.
    ranks = {"rank_allocation": os.environ["RANKS_FILE"]} if os.environ.get("RANKS_FILE") else {}
    # scale 0.25: the comparisons' tolerances are counted at its step size (see sharded_galore.py)
    galore = GaLoreConfig.preset(
        os.environ["PRESET"], scale=0.25, rank=2 if SPARSE else 8, expert_rank=4, experts=True, update_proj_gap=3,
        moment_handling=os.environ["MOMENT_HANDLING"], proj_type=os.environ.get("PROJ_TYPE", "std"), **schedule,
        **ranks,
    )  # fmt: skip
    return prepare_model(model, galore)


def batches(rank: int, world: int):
    for step in range(STEPS):
        ids = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        yield ids.chunk(world)[rank]


def train_torch(model, engine: str, rank: int, world: int):
    import transformers

    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer
    model, forward = wrap_for_engine(model, engine, block_class=block if engine.startswith("fsdp") else None)
    if engine == "fsdp2":  # the expert stacks' factors (and a plain W0) are sharded on the expert dimension
        stacks = [m for m in model.modules() if isinstance(m, GaLoreExpertStack)]
        assert stacks and all(m.galore_factor.placements == (Shard(0),) for m in stacks)
    optimizer = create_optimizer(model, lr=LR, weight_decay=0.01, eps=EPS)
    losses, refreshes = [], 0
    for part in batches(rank, world):
        loss = forward(input_ids=part, labels=part).loss
        loss.backward()
        optimizer.step()
        refreshes += bool(after_step(model, optimizer)["refreshed"])
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    del forward  # DDP's reducer, released before the process group goes
    return losses, refreshes, model


def train_deepspeed(model, stage: int, rank: int, world: int):
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (loads the module patched below)

    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    # Test-only: the shared-memory comm op is compiled with g++ on first use; gloo does not need it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    optimizer = create_optimizer(model, lr=LR, weight_decay=0.01, eps=EPS)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    galore_optimizer = DeepSpeedGaLoreOptimizer(engine)
    losses, refreshes = [], 0
    for part in batches(rank, world):
        loss = engine(input_ids=part, labels=part).loss
        engine.backward(loss)
        engine.step()
        refreshes += bool(after_step(model, galore_optimizer)["refreshed"])
        losses.append(loss.detach().clone())
    return losses, refreshes


def main(out: str) -> None:
    engine = os.environ["ENGINE"]
    distributed, rank, world = join(engine)
    model = build()
    start = {k: v.detach().clone() for k, v in merged_state_dict(model).items() if ".experts." in k}
    if engine.startswith("zero"):
        losses, refreshes = train_deepspeed(model, int(engine[-1]), rank, world)
    else:
        losses, refreshes, wrapped = train_torch(model, engine, rank, world)
    check_bases_identical(model, world, STEPS)
    if distributed:
        for total in losses:
            dist.all_reduce(total)
            total /= world
    context: Any = contextlib.nullcontext()
    if engine == "fsdp1":  # FSDP1 holds flat shards between steps: whole parameters to merge
        from torch.distributed.fsdp import FullyShardedDataParallel

        context = FullyShardedDataParallel.summon_full_params(wrapped, writeback=False)
    elif engine == "zero3":  # ZeRO-3 partitions every parameter: gather them all (a tiny model) to merge.
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with context:
        weights = {k: full(v).detach().clone() for k, v in merged_state_dict(model).items()}
        # The experts' own state: bases, counters, per-expert refresh counts.
        experts = {k: full(v).detach().clone() for k, v in model.state_dict().items() if ".experts." in k}
    if rank == 0:
        moved = max(float((weights[k] - v).abs().max()) for k, v in start.items())
        result = dict(
            losses=[float(x) for x in losses], weights=weights, experts=experts, refreshes=refreshes, moved=moved
        )
        torch.save(result, out)
    shut_down()


if __name__ == "__main__":
    main(sys.argv[1])
