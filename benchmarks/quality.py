"""Pre-training quality: held-out loss of a small Llama trained from scratch with each method.

    python benchmarks/quality.py                  # CPU default (size "tiny"): the full grid, ~40 min on 2 cores
    python benchmarks/quality.py --quick          # smoke run: every method once, ~1 minute
    python benchmarks/quality.py --size 20m       # the issue's sizes, for a GPU (also: 50m)
    python benchmarks/quality.py --size tiny-moe  # the mixture-of-experts grid (below), ~20 min on 2 cores

Methods (same initial weights per seed, same batches in the same order, weight decay 0, Adam eps
1e-8, gradient clipping 1.0, linear warmup over 10% of the steps then cosine decay to 10%):
torch AdamW; bitsandbytes AdamW8bit; galore-torch GaLoreAdamW; transformers' built-in
`optim="galore_adamw"` (its own dispatch to galore-torch, reached with HF_GALORE_PLUGIN_NO_TAKEOVER=1);
ours (plain API) galore_adamw, galore_adamw_8bit, qgalore_adamw_8bit; peft LoRA rank 8; LoRA at the
rank whose adapters hold as many values as our GaLore factors; QLoRA-style: that LoRA on a frozen
NF4 base (hf_galore_plugin.quant, block 64, double quantization).

Protocol: each method's documented learning rate times (1/3, 1, 3) at seed 0; the best (lowest
held-out loss) then also runs at seeds 1 and 2; the table reports mean ± sample std over the 3
seeds. Held-out loss: mean token cross-entropy over a play never trained on (The Tempest).

Extending a finished grid upward (when a best rate sits at the top of its grid):

    python benchmarks/quality.py --extend-from outputs/quality/runs.jsonl --lr-multipliers 10,30 --out outputs/quality_ext

reads the finished runs, runs each method's documented rate times every multiplier at seed 0 (lowest
first; a multiplier is skipped once a lower one of the list lost to the method's best so far), then
the missing seeds at every method's best rate; old and new runs together go to --out's runs.jsonl.

Mixture of experts (--size tiny-moe; --quick --size tiny-moe for its smoke run): a Qwen3-MoE of the
same width (8 experts of intermediate 48, top 2, every layer sparse; _models.MOE_SHAPES) on the same
data and protocol. Its default methods: AdamW; `galore_adamw` with the experts left to plain AdamW
state (experts=False, the default); and `galore_adamw_experts_r<R>`, the same preset with the fused
experts projected (experts=True) at expert_rank R, for R in EXPERT_RANKS. The report's last table
applies the rule that chooses GaLoreConfig.expert_rank (EXPERT_RANK_RULE).

Written to --out (default outputs/quality): quality.md, quality.json, quality_curves.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys
import time
from typing import Any, Optional

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

import _common  # noqa: E402  (sets HF_GALORE_PLUGIN_NO_TAKEOVER=1 before anything imports the plugin)
import _models  # noqa: E402
import torch  # noqa: E402

METHODS = (
    "adamw", "adamw_galore_rates", "bnb_adamw8bit", "galore_torch", "transformers_galore",
    "galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit", "lora_r8", "lora_matched", "qlora_nf4",
    "galore_adamw_auto", "galore_adamw_8bit_auto", "qgalore_adamw_8bit_auto", "galore_adamw_residual_auto",
    "galore_adamw_rank_auto", "galore_adamw_rank_auto_075",
)  # fmt: skip

# Documented peak learning rates for pre-training.
# - adamw, bnb_adamw8bit: 1e-3, the full-rank baseline of the GaLore paper's LLaMA 60M-1B runs.
# - galore (all four implementations): 1e-2 with scale 0.25, the GaLore paper's pre-training setting
#   (weights move at about lr * scale = 2.5e-3 per unit of normalised update).
# - adamw_galore_rates: AdamW at a GaLore run's per-group rates (projected matrices at lr * scale, the
#   rest at lr), so its documented lr is GaLore's.
# - <preset>_auto: our preset as a user switching from AdamW runs it: scale='auto' (each layer's
#   sqrt(projected side / rank)), lr_scale 0.85 on the GaLore groups as the Trainer applies it, and AdamW's
#   documented rate, which the drop-in rule says carries over unchanged. galore_adamw_residual_auto is
#   galore_adamw_auto with residual=True (Fira's residual: the gradient outside the subspace applied to W0).
# - LoRA, QLoRA: 1e-3. Neither paper documents a rate for pre-training from scratch; this is the
#   full-rank rate, which the GaLore paper's low-rank baselines start from. The sweep covers 3e-3.
# - galore_adamw_rank_auto*, galore_adamw_r<R>: galore_adamw's (dynamic rank below).
DOCUMENTED_LR = {
    "adamw": 1e-3, "adamw_galore_rates": 1e-2, "bnb_adamw8bit": 1e-3, "galore_torch": 1e-2, "transformers_galore": 1e-2,
    "galore_adamw": 1e-2, "galore_adamw_8bit": 1e-2, "qgalore_adamw_8bit": 1e-2,
    "lora_r8": 1e-3, "lora_matched": 1e-3, "qlora_nf4": 1e-3,
    "galore_adamw_auto": 1e-3, "galore_adamw_8bit_auto": 1e-3, "qgalore_adamw_8bit_auto": 1e-3,
    "galore_adamw_residual_auto": 1e-3,
}  # fmt: skip
# `<preset>_auto` names whose preset is a preset with GaLoreConfig fields changed.
AUTO_VARIANTS = {"galore_adamw_residual": ("galore_adamw", {"residual": True})}
AUTO_SUFFIX = "_auto"
# Experts projected: `<preset>_experts_r<R>` is the preset with experts=True, expert_rank=R (MoE sizes).
EXPERT_PRESETS = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")
EXPERT_RANKS = (1, 2, 4, 8)
EXPERT_METHODS = tuple(f"{p}_experts_r{r}" for p in EXPERT_PRESETS for r in EXPERT_RANKS)
DOCUMENTED_LR.update({m: DOCUMENTED_LR[m.split("_experts_r")[0]] for m in EXPERT_METHODS})
# The control of the experts-unprojected row: `galore_adamw` with the plain 3-D experts stepped at lr x scale,
# the rate at which a projected expert's weight moves, instead of the full lr (which a run's one lr must
# share with the embeddings and head), so that the comparison is of the projection, not of the rate.
EXPERT_CONTROL = "galore_adamw_dense_experts_scaled"
DOCUMENTED_LR[EXPERT_CONTROL] = DOCUMENTED_LR["galore_adamw"]
# Dynamic rank (issue 39): `galore_adamw_rank_auto` is galore_adamw with rank_allocation='auto' at the size's
# rank (each layer's rank from its calibration gradient; budget: the factor values of that uniform rank, bounds
# [rank // 4, 2 * rank]); `galore_adamw_rank_auto_075` starts at 0.75 x the rank with the same bounds, so its
# budget (and its state before the allocation) is 0.75 x the uniform rank's factor values (exact while every
# projected side is at least the rank). A `_r<R>` suffix (`galore_adamw_r16`, `galore_adamw_rank_auto_r16`)
# puts rank R in place of the size's.
RANK_VARIANT = re.compile(r"galore_adamw(?P<auto>_rank_auto(?P<b075>_075)?)?(?:_r(?P<rank>\d+))?")
RANK_BUDGET_075 = 0.75
RANK_METHODS = ("galore_adamw_rank_auto", "galore_adamw_rank_auto_075")
RANK_PAIR_RANK = 16  # the second uniform / auto pair at tiny (hidden 128 / 8; the size's rank 32 is hidden / 4)
RANK_PAIR_METHODS = tuple(f"{m}_r{RANK_PAIR_RANK}" for m in ("galore_adamw",) + RANK_METHODS)
DOCUMENTED_LR.update({m: DOCUMENTED_LR["galore_adamw"] for m in RANK_METHODS + RANK_PAIR_METHODS})
ALL_METHODS = METHODS + EXPERT_METHODS + (EXPERT_CONTROL,) + RANK_PAIR_METHODS
MOE_METHODS = ("adamw", "galore_adamw", EXPERT_CONTROL) + tuple(f"galore_adamw_experts_r{r}" for r in EXPERT_RANKS)
# How the grid chooses GaLoreConfig.expert_rank: the smallest expert rank whose held-out loss (mean over
# the seeds, each method at its best rate) is within this fraction of the same preset with the experts
# unprojected (the quality target for projected experts).
EXPERT_RANK_RULE = 0.01
LR_FACTORS = (1 / 3, 1.0, 3.0)
GALORE_SCALE = 0.25  # the GaLore paper's pre-training scale
SEEDS = (0, 1, 2)
TARGETS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
EXTRA_TRAINABLE = r"embed_tokens|lm_head|norm"


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    rank: int  # GaLore rank: hidden / 4, the paper's ratio (128 at hidden 512)
    gap: int
    moe_shape: str = ""  # a name in _models.MOE_SHAPES: a Qwen3-MoE of that shape instead of a Llama
    intermediate_kind: str = "intermediate"

    @property
    def moe(self) -> bool:
        return bool(self.moe_shape)

    @classmethod
    def of(cls, shape: str, **training: int) -> "Size":
        """The Llama shape `shape` of _models.SHAPES (its vocab_size is the tokenizer's target) with the
        training settings."""
        if shape in _models.MOE_SHAPES:
            m = _models.MOE_SHAPES[shape]
            return cls(hidden=m["hidden_size"], layers=m["num_hidden_layers"], heads=m["num_attention_heads"],
                       intermediate=m["moe_intermediate_size"], vocab_size=m["vocab_size"], moe_shape=shape,
                       intermediate_kind=f"{m['num_experts']} experts (top {m['num_experts_per_tok']}) of intermediate",
                       **training)  # fmt: skip
        s = _models.SHAPES[shape]
        if s.get("num_key_value_heads", s["num_attention_heads"]) != s["num_attention_heads"]:
            raise ValueError(f"shape {shape!r} groups its queries; quality.py's sizes have one KV head per head")
        return cls(hidden=s["hidden_size"], layers=s["num_hidden_layers"], heads=s["num_attention_heads"],
                   intermediate=s["intermediate_size"], vocab_size=s["vocab_size"], **training)  # fmt: skip

    def llama_shape(self, vocab_size: int) -> dict[str, int]:
        """The LlamaConfig fields of this size with the tokenizer's `vocab_size` (no grouped queries)."""
        return dict(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.heads)  # fmt: skip


SIZES = {
    # ~1.1M parameters (0.8M in the targeted linear layers), 200 steps of 8 x 128 tokens (0.2M tokens):
    # about 0.3 s a step with one thread on the shared 2-core machine, so the 50 runs take ~40 minutes.
    "tiny": Size.of("tiny-h128", seq_len=128, batch_size=8, steps=200, rank=32, gap=50),
    # --quick: the smoke test.
    "quick": Size.of("tiny-h64", seq_len=64, batch_size=8, steps=30, rank=16, gap=10),
    # The sizes, for a GPU: ~17M and ~46M parameters, sequence 256, 2000 steps of 32 sequences
    # (16M tokens: about 25 passes over the 2 MB of training text).
    "20m": Size.of("20m", seq_len=256, batch_size=32, steps=2000, rank=96, gap=200),
    "50m": Size.of("50m", seq_len=256, batch_size=32, steps=2000, rank=128, gap=200),
    # Mixture of experts: tiny's width, data and steps (~1.1M parameters, 53% of them in the experts).
    "tiny-moe": Size.of("tiny-moe-h128", seq_len=128, batch_size=8, steps=200, rank=32, gap=50),
    "quick-moe": Size.of("tiny-moe-h64", seq_len=64, batch_size=8, steps=30, rank=16, gap=10),
}


# ---------------------------------------------------------------------- data and model
def prepare_data(size: Size, path: pathlib.Path) -> dict[str, Any]:
    """Tokenize the shipped text once (examples/demo.py's BPE, trained on the training plays)."""
    import demo  # examples/demo.py: its tokenizer and blocks, so both benchmarks see the same tokens

    train_text = demo.TRAIN_TEXT.read_text(encoding="ascii")
    tokenizer = demo.train_tokenizer(train_text, size.vocab_size)
    data = {
        "vocab_size": len(tokenizer),
        "train": demo.token_blocks(tokenizer, train_text, size.seq_len),
        "heldout": demo.token_blocks(tokenizer, demo.HELDOUT_TEXT.read_text(encoding="ascii"), size.seq_len),
    }
    torch.save(data, path)
    return data


_DATA: dict[str, Any] = {}


def load_data(path: str) -> dict[str, Any]:
    if path not in _DATA:
        _DATA[path] = torch.load(path, weights_only=True)
    return _DATA[path]


def build_model(size: Size, vocab_size: int, seed: int, device: torch.device):
    # seed: the same initial weights for every method of a seed
    if size.moe:
        return _models.build_qwen3_moe(size.moe_shape, seed=seed, device=device, vocab_size=vocab_size,
                                       max_position_embeddings=size.seq_len)  # fmt: skip
    return _models.build_llama(size.llama_shape(vocab_size), seed=seed, device=device,
                               max_position_embeddings=size.seq_len)  # fmt: skip


def batch_order(n_blocks: int, size: Size, seed: int) -> torch.Tensor:
    """Block indices of every step: shuffled passes over the training blocks, the same for every method."""
    generator = torch.Generator().manual_seed(1000 + seed)
    needed = size.steps * size.batch_size
    passes = [torch.randperm(n_blocks, generator=generator) for _ in range(math.ceil(needed / n_blocks))]
    return torch.cat(passes)[:needed].view(size.steps, size.batch_size)


@torch.no_grad()
def heldout_loss(model, blocks: torch.Tensor, batch_size: int, device: torch.device) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size].to(device)
        total += model(input_ids=ids, labels=ids).loss.item() * len(ids)
        count += len(ids)
    model.train()
    return total / count


# ---------------------------------------------------------------------- one run
def rank_fields(method: str, size_rank: int) -> Optional[dict[str, Any]]:
    """GaLoreConfig fields of a dynamic-rank or other-rank galore_adamw method (RANK_VARIANT), with "rank" the
    starting rank; None for every other method."""
    match = RANK_VARIANT.fullmatch(method)
    if match is None or not (match["auto"] or match["rank"]):
        return None
    rank = int(match["rank"] or size_rank)
    if not match["auto"]:
        return {"rank": rank}
    start = rank
    if match["b075"]:
        start = round(RANK_BUDGET_075 * rank)
        if start != RANK_BUDGET_075 * rank:
            raise ValueError(f"{method}: {RANK_BUDGET_075} x rank {rank} is not a whole rank")
    return {"rank": start, "rank_allocation": "auto", "rank_min": max(1, rank // 4), "rank_max": 2 * rank}


def is_rank_variant(method: str) -> bool:
    match = RANK_VARIANT.fullmatch(method)
    return match is not None and bool(match["auto"] or match["rank"])


def scale_auto(method: str) -> bool:
    """`<preset>_auto`: the preset at scale 'auto' with the Trainer's lr_scale (not `galore_adamw_rank_auto`)."""
    return method.endswith(AUTO_SUFFIX) and not is_rank_variant(method)


def resolve_method(method: str) -> tuple[str, dict[str, Any]]:
    """(the _common method that trains `method`, its GaLoreConfig overrides): `<preset>_experts_r<R>` is
    `<preset>` with experts=True, expert_rank=R; `<preset>_auto` is `<preset>` (at scale "auto"), an
    AUTO_VARIANTS name its preset with the fields it sets (residual=True); every other name is itself without
    overrides."""
    if method == EXPERT_CONTROL or is_rank_variant(method):
        return "galore_adamw", {}
    if scale_auto(method):
        preset = method[: -len(AUTO_SUFFIX)]
        return AUTO_VARIANTS.get(preset, (preset, {}))
    match = re.fullmatch(r"(.+)_experts_r(\d+)", method)
    if match is None:
        return method, {}
    return match.group(1), {"experts": True, "expert_rank": int(match.group(2))}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train one (method, lr, seed) and return its losses and training-state bytes."""
    torch.set_num_threads(job["threads"])
    size = Size(**job["size"])
    device = torch.device(job["device"])
    data = load_data(job["data"])
    model = build_model(size, data["vocab_size"], job["seed"], device)
    method, method_overrides = resolve_method(job["method"])
    rank_overrides = rank_fields(job["method"], size.rank) or {}
    galore_rank = rank_overrides.pop("rank", size.rank)
    setup = _common.MethodSetup(
        targets_regex=TARGETS, extra_trainable=EXTRA_TRAINABLE, galore_rank=galore_rank, galore_gap=size.gap,
        galore_scale="auto" if scale_auto(job["method"]) else GALORE_SCALE, lora_rank=8, lora_matched_rank=_common.matched_lora_rank(model, TARGETS, size.rank),
        galore_overrides=tuple(sorted({**job.get("galore_overrides", {}), **method_overrides, **rank_overrides}.items())),
        # The control: the plain expert parameters (named ...mlp.experts.gate_up_proj / down_proj) at lr x scale.
        **({"head_regex": r"\.experts\.", "head_lr": job["lr"] * GALORE_SCALE} if job["method"] == EXPERT_CONTROL else {}),
    )  # fmt: skip
    started = time.perf_counter()
    model, optimizer, after_step = _common.setup_method(method, model, setup, lr=job["lr"])
    schedule = _common.warmup_cosine(size.steps)
    lambdas = [schedule] * len(optimizer.param_groups)
    from hf_galore_plugin import state_of

    galore_state = state_of(model)
    galore_config = galore_state.config if galore_state is not None else None
    apply_lr_scale = bool(job.get("apply_lr_scale")) or scale_auto(job["method"])
    if apply_lr_scale and galore_config is not None:
        # The Trainer integration's lr_scale (and its recovery) on the GaLore groups, as GaLoreCallback applies it.
        def scaled(step: int) -> float:
            return schedule(step) * _common.galore_lr_multiplier(galore_config, step, size.steps)

        lambdas = [scaled if g.get("galore") else schedule for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    refresh_seconds = 0.0
    trainable = [p for p in model.parameters() if p.requires_grad]
    order = batch_order(len(data["train"]), size, job["seed"])
    losses, state_bytes, diverged = [], {}, False
    for step in range(size.steps):
        ids = data["train"][order[step]].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        tick = time.perf_counter()
        after_step()
        refresh_seconds += time.perf_counter() - tick
        if step == size.steps - 1:
            state_bytes = _models.training_state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            diverged = True
            break
    train_seconds = time.perf_counter() - started
    heldout = None if diverged else heldout_loss(model, data["heldout"], size.batch_size, device)
    if heldout is not None and not math.isfinite(heldout):
        heldout, diverged = None, True
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "method": job["method"],
        "lr": job["lr"],
        "seed": job["seed"],
        "note": _common.method_note(method, setup)
        + (
            ", experts unprojected"
            if size.moe and method in _common.OURS and "expert_rank" not in method_overrides
            else ""
        )
        + (f" at lr x {GALORE_SCALE}" if job["method"] == EXPERT_CONTROL else ""),
        "trainable_params": sum(p.numel() for p in trainable),
        "train_losses": losses,
        "first_train_loss": losses[0],
        "final_train_loss": sum(tail) / len(tail),
        "heldout_loss": heldout,
        "diverged": diverged,
        "state_bytes": state_bytes,
        "state_bytes_total": sum(state_bytes.values()) if state_bytes else None,
        "train_seconds": train_seconds,
        "step_driver_seconds": refresh_seconds,  # time in after_step: basis refreshes and folds
        "refreshes": _refresh_count(model),
        **_rank_record(model, size.rank),
        "galore_overrides": job.get("galore_overrides", {}),
        "apply_lr_scale": apply_lr_scale,
    }


def _refresh_count(model) -> Optional[int]:
    """Basis computations over all GaLore layers (the first, calibration basis included); None without GaLore."""
    from hf_galore_plugin.layers import GaLoreLinear

    layers = [m for m in model.modules() if isinstance(m, GaLoreLinear)]
    return sum(int(m.galore_num_refreshes) for m in layers) if layers else None


RANK_ROW_KEYS = ("layer", "index", "rank", "current_rank", "start_rank", "share", "share_at_start", "factor_values")
RANK_RUN_KEYS = ("factor_values", "factor_bytes", "rank_budget_values", "uniform_budget_values", "rank_rows")


def _rank_record(model, size_rank: int) -> dict[str, Any]:
    """The run's factor values at the end (all GaLore layers; for rank_allocation='auto' the ranks it took), the
    budget (auto: what the allocator spent against; uniform: the factor values themselves), the uniform budget
    of the size's rank, and rank_report's per-layer rows (auto only)."""
    from hf_galore_plugin import rank_report
    from hf_galore_plugin.api import rank_budget
    from hf_galore_plugin.layers import GaLoreLinear

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GaLoreLinear)]
    if not layers:
        return {}
    values = sum(m.galore_factor.numel() for _, m in layers)
    kept = [max(m.galore_factor.shape) for _, m in layers]  # the side a one-sided factor keeps
    rows = rank_report(model)
    adaptive = any(m._adaptive is not None for _, m in layers)
    return {
        "factor_values": values,
        "factor_bytes": sum(m.galore_factor.numel() * m.galore_factor.element_size() for _, m in layers),
        "rank_budget_values": rank_budget(layers) if adaptive else values,
        "uniform_budget_values": sum(k * size_rank for k in kept),
        "layer_ranks": [min(m.galore_factor.shape) for _, m in layers],
        "rank_rows": [{key: row[key] for key in RANK_ROW_KEYS} for row in rows],
    }


def describe(result: dict[str, Any]) -> str:
    held = "diverged" if result["diverged"] else f"held-out {result['heldout_loss']:.4f}"
    return (
        f"  {result['method']:<20} lr {result['lr']:<8.3g} seed {result['seed']}  first {result['first_train_loss']:.3f}"
        f"  final {result['final_train_loss']:.3f}  {held}  ({result['train_seconds']:.0f} s)"
    )


def run_jobs(jobs: list[dict[str, Any]], workers: int, log: pathlib.Path) -> list[dict[str, Any]]:
    return _common.run_jobs(run_one, jobs, workers, log, describe)


# ---------------------------------------------------------------------- report
def summarize(results: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    rows = []
    for method in methods:
        sweep = sorted((r for r in results if r["method"] == method and r["seed"] == SEEDS[0]), key=lambda r: r["lr"])
        finished = [r for r in sweep if not r["diverged"]]
        if not finished:
            rows.append({"method": method, "sweep": sweep, "best_lr": None})
            continue
        best = min(finished, key=lambda r: r["heldout_loss"])
        seeds = sorted((r for r in results if r["method"] == method and r["lr"] == best["lr"]), key=lambda r: r["seed"])
        heldout = [r["heldout_loss"] for r in seeds if not r["diverged"]]
        mean, spread = _common.mean_spread(heldout)
        rows.append(
            {
                "method": method,
                "note": best["note"],
                "best_lr": best["lr"],
                "best_at_grid_edge": len(sweep) > 1 and best["lr"] in (sweep[0]["lr"], sweep[-1]["lr"]),
                "sweep": [{"lr": r["lr"], "heldout_loss": r["heldout_loss"]} for r in sweep],
                "seeds": [r["seed"] for r in seeds],
                "heldout_losses": heldout,
                "heldout_mean": mean,
                "heldout_spread": spread,
                **_common.best_rate_fields(best, seeds),
                **{key: best[key] for key in RANK_RUN_KEYS if key in best},
                "layer_ranks": [r.get("layer_ranks") for r in seeds],
            }
        )
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["method"]: r for r in rows if r.get("best_lr") is not None}
    checks = []

    def rel(a: str, b: str) -> float:
        return (by[a]["heldout_mean"] - by[b]["heldout_mean"]) / by[b]["heldout_mean"]

    if "galore_adamw" in by and "galore_torch" in by:
        gap = rel("galore_adamw", "galore_torch")
        checks.append({"target": "ours galore_adamw within 1% of galore-torch GaLoreAdamW (held-out loss)",
                       "measured": f"{gap:+.2%}", "met": abs(gap) <= 0.01})  # fmt: skip
    if "qgalore_adamw_8bit" in by and "adamw" in by:
        gap = rel("qgalore_adamw_8bit", "adamw")
        checks.append({"target": "qgalore_adamw_8bit within 2% of AdamW (held-out loss)",
                       "measured": f"{gap:+.2%}", "met": gap <= 0.02})  # fmt: skip
    for method in (m for m in by if "expert_rank" in resolve_method(m)[1]):
        preset, overrides = resolve_method(method)
        if preset in by:
            gap = rel(method, preset)
            checks.append({"target": f"{method} (experts projected, expert_rank {overrides['expert_rank']}) within "
                                     f"{EXPERT_RANK_RULE:.0%} of {preset} with experts unprojected (held-out loss)",
                           "measured": f"{gap:+.2%}", "met": gap <= EXPERT_RANK_RULE})  # fmt: skip
    for method, uniform in rank_pairs(by):
        a, u = by[method], by[uniform]
        fraction = a["rank_budget_values"] / u["factor_values"]
        noise = max(a["heldout_spread"], u["heldout_spread"])
        diff = a["heldout_mean"] - u["heldout_mean"]
        if fraction > RANK_BUDGET_075 + 1e-9:  # the same budget: not worse, and better by more than the seed spread
            target, met = f"{method} <= {uniform} held-out loss at the same factor budget ({fraction:.2f}x)", diff <= 0
            checks.append({"target": target, "measured": f"{diff:+.4f} (seed spread {noise:.4f})", "met": met})
            checks.append({"target": f"{method} better than {uniform} by more than the seed spread",
                           "measured": f"{diff:+.4f} vs {noise:.4f}", "met": -diff > noise})  # fmt: skip
        else:  # equal within noise (the larger of the two seed spreads) at <= 0.75x the budget
            checks.append({"target": f"{method} ({fraction:.2f}x the factor budget) equal to {uniform} within the seed spread or better",
                           "measured": f"{diff:+.4f} (seed spread {noise:.4f})", "met": diff <= noise})  # fmt: skip
    for other in ("lora_r8", "lora_matched", "qlora_nf4"):
        if "qgalore_adamw_8bit" in by and other in by:
            q, o = by["qgalore_adamw_8bit"], by[other]
            better = q["heldout_mean"] < o["heldout_mean"]
            memory_ok = q["state_bytes_total"] <= o["state_bytes_total"]
            checks.append(
                {
                    "target": f"qgalore_adamw_8bit better than {other} at equal or lower training-state memory",
                    "measured": f"loss {q['heldout_mean']:.4f} vs {o['heldout_mean']:.4f}; "
                    f"memory {_common.mb(q['state_bytes_total'])} MB vs {_common.mb(o['state_bytes_total'])} MB",
                    "met": better and memory_ok,
                }
            )
    return checks


def rank_pairs(by: dict[str, Any]) -> list[tuple[str, str]]:
    """(dynamic-rank method, the uniform galore_adamw at its rank) for each pair present in `by`."""
    pairs = []
    for method in by:
        match = RANK_VARIANT.fullmatch(method)
        if match is not None and match["auto"]:
            uniform = f"galore_adamw_r{match['rank']}" if match["rank"] else "galore_adamw"
            if uniform in by:
                pairs.append((method, uniform))
    return pairs


def rank_table(rows: list[dict[str, Any]]) -> str:
    """The dynamic-rank table: uniform and rank_allocation='auto' rows with their factor budget and ranks."""
    import statistics

    chosen = [r for r in rows if r.get("best_lr") is not None and r.get("factor_values") and is_rank_variant(r["method"])
              or r["method"] == "galore_adamw" and r.get("best_lr") is not None]  # fmt: skip
    if not any(is_rank_variant(r["method"]) for r in chosen):
        return ""
    lines = ["| method | budget: factor values (MiB fp32) | vs uniform rank's | best lr | held-out loss (mean ± std, seeds) "
             "| ranks min / median / max (seed 0) | ranks over the seeds |", "|" + "---|" * 7]  # fmt: skip
    for r in chosen:
        budget = r["rank_budget_values"]
        ranks0 = r["layer_ranks"][0]
        every = [k for ranks in r["layer_ranks"] if ranks for k in ranks]
        lines.append(
            f"| {r['method']} | {budget:,} ({budget * 4 / 2**20:.2f}) | {budget / r['uniform_budget_values']:.2f}x "
            f"| {r['best_lr']:.2g} | {_common.format_mean_spread(r['heldout_losses'], 4)} ({len(r['heldout_losses'])}) "
            f"| {min(ranks0)} / {statistics.median(ranks0):g} / {max(ranks0)} "
            f"| {min(every)} / {statistics.median(every):g} / {max(every)} |"
        )
    return "\n".join(lines) + "\n"


def plot_ranks(rows: list[dict[str, Any]], path: pathlib.Path) -> bool:
    """Rank per layer by depth of each rank_allocation='auto' method (its best rate, seed 0), the uniform ranks
    dashed. False when no such row has ranks."""
    autos = [r for r in rows if r.get("rank_rows")]
    if not autos:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def depth(row: dict[str, Any]) -> int:  # the decoder layer (model.layers.<i>.), else the GaLore layer index
        match = re.search(r"layers\.(\d+)\.", row["layer"])
        return int(match.group(1)) if match else row["index"]

    fig, axes = plt.subplots(len(autos), 1, figsize=(9, 2.6 * len(autos)), squeeze=False)
    for ax, r in zip(axes[:, 0], autos):
        layers = r["rank_rows"]
        kinds = list(dict.fromkeys(row["layer"].rsplit(".", 1)[-1] for row in layers))
        for kind in kinds:
            mine = [row for row in layers if row["layer"].rsplit(".", 1)[-1] == kind]
            ax.plot([depth(row) for row in mine], [row["rank"] for row in mine], marker="o", ms=4, label=kind)
        ax.axhline(layers[0]["start_rank"], color="grey", lw=0.8, ls="--", label="starting rank")
        ax.set_title(
            f"{r['method']} (lr {r['best_lr']:.2g}, seed 0): {r['rank_budget_values']:,} factor values", fontsize=9
        )
        ax.set_ylabel("rank")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1, 0].set_xlabel("decoder layer (depth)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def expert_rank_choice(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per preset with projected-expert rows: the smallest expert rank within EXPERT_RANK_RULE of the preset
    with the experts unprojected (None when no rank is), and every rank's measured difference."""
    by = {r["method"]: r for r in rows if r.get("best_lr") is not None}
    choices = []
    for preset in EXPERT_PRESETS:
        if preset not in by:
            continue
        ranks = sorted(
            (resolve_method(m)[1]["expert_rank"], m)
            for m in by
            if resolve_method(m)[0] == preset and "expert_rank" in resolve_method(m)[1]
        )
        if not ranks:
            continue
        # The reference: the better of the unprojected rows (the preset itself; for galore_adamw also the
        # control with the experts at lr x scale).
        references = [m for m in (preset, EXPERT_CONTROL if preset == "galore_adamw" else None) if m in by]
        reference = min(references, key=lambda m: by[m]["heldout_mean"])
        base = by[reference]["heldout_mean"]
        gaps = {rank: by[m]["heldout_mean"] / base - 1 for rank, m in ranks}
        within = [rank for rank, gap in gaps.items() if gap <= EXPERT_RANK_RULE]
        choices.append({"preset": preset, "reference": reference, "unprojected": base, "gaps": gaps,
                        "chosen": min(within) if within else None})  # fmt: skip
    return choices


def markdown(rows: list[dict[str, Any]], checks: list[dict[str, Any]], header: str) -> str:
    reference = next((r for r in rows if r["method"] == "adamw" and r.get("best_lr")), None)
    lines = [
        header,
        "",
        "| method | setting | lr sweep (seed 0 held-out loss) | best lr | held-out loss (mean ± std, seeds) "
        "| vs AdamW | final train loss | trainable params | training-state MB (weights / grads / optimizer / bases) "
        "| s per run |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        sweep = _common.sweep_cell(r["sweep"], "heldout_loss")
        if r.get("best_lr") is None:
            lines.append(f"| {r['method']} | | {sweep} | all diverged | | | | | | |")
            continue
        parts = r["state_bytes"]
        versus = f"{r['heldout_mean'] / reference['heldout_mean'] - 1:+.2%}" if reference else "n/a"
        edge = " (grid edge)" if r["best_at_grid_edge"] else ""
        lines.append(
            f"| {r['method']} | {r['note']} | {sweep} | {r['best_lr']:.2g}{edge} "
            f"| {_common.format_mean_spread(r['heldout_losses'], 4)} ({len(r['heldout_losses'])}) | {versus} "
            f"| {r['final_train_mean']:.3f} | {r['trainable_params']:,} | {_common.mb(r['state_bytes_total'])} "
            f"({_common.mb(parts['weights'])} / {_common.mb(parts['grads'])} / {_common.mb(parts['optimizer_state'])} "
            f"/ {_common.mb(parts['bases'])}) | {r['seconds_per_run']:.0f} |"
        )
    for choice in expert_rank_choice(rows):
        gaps = ", ".join(f"r{rank}: {gap:+.2%}" for rank, gap in choice["gaps"].items())
        chosen = f"expert_rank {choice['chosen']}" if choice["chosen"] is not None else "none of the ranks"
        lines += ["", f"Expert rank by the rule (the smallest within {EXPERT_RANK_RULE:.0%} of the better experts-unprojected "
                  f"row, here {choice['reference']}, held-out {choice['unprojected']:.4f}): {chosen} (held-out loss vs it: {gaps})."]  # fmt: skip
    ranks = rank_table(rows)
    if ranks:
        lines += ["", "Dynamic rank (rank_allocation='auto'): each method at its best lr.", "", ranks.rstrip("\n")]
    if checks:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {c['target']} | {c['measured']} | {'yes' if c['met'] else 'no'} |" for c in checks]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model and token budget (default: tiny)")
    parser.add_argument("--quick", action="store_true", help="smoke run: size 'quick', documented lr only, one seed")
    parser.add_argument("--steps", type=int, help="override the size's optimizer steps")
    _common.add_grid_arguments(parser, methods=METHODS, seeds=SEEDS, jobs=2, out=HERE.parent / "outputs" / "quality")
    parser.set_defaults(methods=None)  # the size's methods: METHODS, or MOE_METHODS for a mixture of experts
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.seeds, args.no_sweep, args.jobs = ("quick-moe" if SIZES[args.size].moe else "quick", 1, True, 1)
    moe = SIZES[args.size].moe
    if args.methods is None:
        args.methods = list(MOE_METHODS if moe else METHODS)
    _common.check_grid_arguments(parser, args, methods=ALL_METHODS, seeds=SEEDS)
    if not moe and any("expert_rank" in resolve_method(m)[1] for m in args.methods):
        parser.error(f"--methods: the *_experts_r* methods project a mixture of experts' experts; size {args.size!r} "
                     f"is a Llama without experts: use --size tiny-moe (or quick-moe)")  # fmt: skip
    args.config = SIZES[args.size] if args.steps is None else dataclasses.replace(SIZES[args.size], steps=args.steps)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    size: Size = args.config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.from_runs:
        results = [json.loads(line) for line in args.from_runs.read_text().splitlines() if line.strip()]
        vocab = size.vocab_size
        params = sum(p.numel() for p in build_model(size, vocab, 0, torch.device("cpu")).parameters())
        factors = (1.0,) if args.no_sweep else LR_FACTORS
        write_report(args, results, params, device, vocab, time.perf_counter() - started, factors)
        return 0
    data_path = args.out / "tokens.pt"
    data = prepare_data(size, data_path)
    params = sum(p.numel() for p in build_model(size, data["vocab_size"], 0, torch.device("cpu")).parameters())
    print(
        f"size {args.size}: {params / 1e6:.2f}M parameters, {size.steps} steps of {size.batch_size} x {size.seq_len} "
        f"tokens ({size.steps * size.batch_size * size.seq_len / 1e6:.2f}M tokens); {len(data['train'])} training and "
        f"{len(data['heldout'])} held-out blocks; device {device}",
        flush=True,
    )
    base = {"size": dataclasses.asdict(size), "data": str(data_path), "device": device, "threads": args.threads}
    factors = (1.0,) if args.no_sweep else LR_FACTORS
    if args.extend_from:
        results = _common.extend_runs(
            extend_from=args.extend_from,
            out=args.out,
            methods=args.methods,
            documented_lr=DOCUMENTED_LR,
            multipliers=args.lr_multipliers,
            base=base,
            first_seed=SEEDS[0],
            other_seeds=SEEDS[1 : args.seeds],
            run=lambda jobs: run_jobs(jobs, args.jobs, args.out / "runs.jsonl"),
            summarize=summarize,
        )
        write_report(args, results, params, device, data["vocab_size"], time.perf_counter() - started, factors)
        data_path.unlink()
        return 0
    # Every method's documented rate first, then the other rates: a run cut short still compares all methods.
    sweep_jobs = [
        {**base, "method": m, "lr": DOCUMENTED_LR[m] * f, "seed": SEEDS[0]}
        for f in sorted(factors, key=lambda f: f != 1.0)
        for m in args.methods
    ]
    results = _common.run_grid(
        sweep_jobs,
        out=args.out,
        base=base,
        other_seeds=SEEDS[1 : args.seeds],
        methods=args.methods,
        run=lambda jobs, log: run_jobs(jobs, args.jobs, log),
        summarize=summarize,
    )
    write_report(args, results, params, device, data["vocab_size"], time.perf_counter() - started, factors)
    data_path.unlink()
    return 0


def write_report(
    args: argparse.Namespace, results: list[dict[str, Any]], params: int, device: str, vocab_size: int,
    seconds: float, factors: tuple[float, ...],
) -> None:  # fmt: skip
    size: Size = args.config
    methods = [m for m in args.methods if any(r["method"] == m for r in results)]
    rows = summarize(results, methods)
    checks = check_targets(rows)
    by_method = {r["method"]: r for r in rows}

    def grid_done(method: str) -> bool:
        lrs = [r["lr"] for r in results if r["method"] == method and r["seed"] == SEEDS[0]]
        return all(any(_common.same_lr(lr, DOCUMENTED_LR[method] * f) for lr in lrs) for f in factors)

    complete = all(
        by_method.get(m, {}).get("best_lr") is not None and grid_done(m) and len(by_method[m]["seeds"]) >= args.seeds
        for m in args.methods
    )
    run_minutes = sum(r["train_seconds"] for r in results) / 60
    header = (
        f"Size `{args.size}`: {params / 1e6:.2f}M-parameter {'Qwen3-MoE' if size.moe else 'Llama'} (hidden {size.hidden}, "
        f"{size.layers} layers, {size.intermediate_kind} {size.intermediate}, BPE vocabulary {vocab_size}), {size.steps} steps of "
        f"{size.batch_size} x {size.seq_len} tokens, device {device}, {args.threads} thread(s) per run, "
        f"{args.jobs} run(s) in parallel; {len(results)} runs ({run_minutes:.1f} min of training in all); "
        f"this invocation's wall time {seconds / 60:.1f} min."
    )
    if args.extend_from:
        header += (
            f" Grid extended from {args.extend_from} at the documented rate times "
            f"{', '.join(f'{f:g}' for f in args.lr_multipliers)} (seed 0), then the missing seeds at the best rate."
        )
    if not complete:
        header += (
            " **Partial grid** (reported from the runs that finished): a method's lr sweep or its extra seeds "
            "may be missing; the seeds column says how many runs each mean is over."
        )
    table = markdown(rows, checks, header)
    (args.out / "quality.md").write_text(f"# Quality (pre-training)\n\n{table}")
    summary = {
        "size_name": args.size,
        "size": dataclasses.asdict(size),
        "parameters": params,
        "device": device,
        "wall_seconds": seconds,
        "complete": complete,
        "documented_lr": {m: DOCUMENTED_LR[m] for m in args.methods},
        "lr_factors": list(factors),
        "extended_from": str(args.extend_from) if args.extend_from else None,
        "lr_multipliers": args.lr_multipliers,
        "methods": rows,
        "targets": checks,
        "expert_rank_choice": expert_rank_choice(rows),
        "runs": results,
    }
    (args.out / "quality.json").write_text(json.dumps(summary, indent=1))
    finished = [r for r in rows if r.get("best_lr") is not None]
    _common.plot_curves(
        {r["method"]: r["train_losses_seed0"] for r in finished},
        {r["method"]: r["heldout_mean"] for r in finished},
        args.out / "quality_curves.png",
        title=f"Pre-training a {params / 1e6:.1f}M {'Qwen3-MoE' if size.moe else 'Llama'} on Shakespeare (best lr, seed 0)",
        ylabel="training loss, EMA 0.9 (x: mean held-out loss)",
    )
    names = ["quality.md", "quality.json", "quality_curves.png"]
    if plot_ranks(rows, args.out / "quality_ranks.png"):
        names.append("quality_ranks.png")
    print("\n" + table)
    for name in names:
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    sys.exit(main())
