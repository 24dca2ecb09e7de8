"""Exact training-state bytes of AdamW, 8-bit AdamW, galore-torch and the plugin's three presets.

    python benchmarks/memory.py            # Llama ~350M measured on CPU (3 steps each) + 7B on the meta device
    python benchmarks/memory.py --quick    # a small Llama instead of 350M (seconds), 7B as always

Training state = every parameter and buffer of the model (frozen and int8 weights included), the
gradients, every optimizer-state tensor (moments, 8-bit codes and scales, error-feedback residuals),
and the projection bases (a buffer of ours; galore-torch keeps it in its optimizer state). Activations
are not counted: they depend on batch and sequence, not on the method.

~350M: the model is built in fp32 on the CPU and trained 3 steps on 1 x 64 random tokens; the bytes
are read after the third optimizer.step(), before zero_grad(), so the gradients are there.
7B: nothing is allocated. The bf16 model is built on the meta device; the plugin's prepare_model and
its AdamW's own state initialisation run on meta tensors (int8 quantization included), so those bytes
come from the same code as a real run. The baselines' state is computed from their state layouts
(torch AdamW: two moments in the parameter's dtype; bitsandbytes AdamW8bit: uint8 codes, one fp32
absmax per 256 values, a 256-entry fp32 code map per moment, fp32 state below 4096 values;
galore-torch: moments of the projected gradient and the basis, in the parameter's dtype). The same
formulas are checked against the measured small/350M run, where every method really runs.

transformers' own ``optim="galore_adamw"`` builds galore_torch.GaLoreAdamW with the same groups, so
its bytes are the galore-torch row.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import sys
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

import hf_galore_plugin as hgp
from _models import SHAPES, build_llama, preset_names, tensor_bytes, training_state_bytes

REPO = pathlib.Path(__file__).resolve().parent.parent
OURS = preset_names()
METHODS = ("adamw_torch", "adamw_8bit_bnb", "galore_torch", *OURS)
PARTS = ("weights", "grads", "optimizer_state", "error_feedback", "bases")
# Targets (rank 256): Q-GaLore 8-bit at most 30% of AdamW at 350M and at most 11 GB at 7B; our
# fp32-state GaLore below galore-torch at both sizes.
QGALORE_FRACTION_TARGET = 0.30
QGALORE_7B_TARGET_BYTES = 11e9

BNB_BLOCK, BNB_MIN_8BIT = 256, 4096  # bitsandbytes AdamW8bit defaults (blockwise, min_8bit_size)


def galore_targets(model: nn.Module, rank: int) -> list[nn.Linear]:
    """The layers GaLore trains: the plugin's default selection (every nn.Linear but the head, smaller
    side > rank), used for galore-torch too so both project the same weights."""
    from hf_galore_plugin.inject import select_targets

    selected, _ = select_targets(model, hgp.GaLoreConfig(rank=rank))
    return [module for _, module in selected]


# ---------------------------------------------------------------------- optimizers
def build_optimizer(method: str, model: nn.Module, rank: int):
    """(model, optimizer) for `method`; ours replace the model's layers first."""
    lr = 1e-3
    if method == "adamw_torch":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if method == "adamw_8bit_bnb":
        import bitsandbytes as bnb

        return model, bnb.optim.AdamW8bit(model.parameters(), lr=lr)
    if method == "galore_torch":
        from galore_torch import GaLoreAdamW

        lowrank = {id(m.weight) for m in galore_targets(model, rank)}
        groups = [
            {"params": [p for p in model.parameters() if id(p) not in lowrank]},
            {
                "params": [p for p in model.parameters() if id(p) in lowrank],
                "rank": rank,
                "update_proj_gap": 200,
                "scale": 0.25,
                "proj_type": "std",
            },
        ]
        return model, GaLoreAdamW(groups, lr=lr)
    hgp.prepare_model(model, hgp.GaLoreConfig.preset(method, rank=rank, update_proj_gap=200))
    return model, hgp.create_optimizer(model, lr=lr)


def measured_run(method: str, size: str, rank: int, steps: int = 3) -> dict[str, Any]:
    """Build the fp32 model on the CPU, train `steps` steps on 1 x 64 tokens (more until every GaLore layer has
    optimizer state), count the bytes."""
    model = build_llama(size, seed=0, init_device="cpu", dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model, optimizer = build_optimizer(method, model, rank)
    tokens = torch.randint(0, SHAPES[size]["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    step = 0
    while step < steps:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        if method in OURS:
            hgp.after_step(model, optimizer)
            if step == 0:
                # The staggered phases are packed at the first training step; a layer holds optimizer state
                # from the step after its calibration (its phase), so count once every layer has stepped.
                last_phase = max(int(layer.galore_phase) for _, layer in hgp.galore_layers(model))
                steps = max(steps, last_phase + 2)
        if step + 1 < steps:
            optimizer.zero_grad(set_to_none=True)
        step += 1
    parts = training_state_bytes(model, optimizer, error_feedback_apart=True)
    del model, optimizer
    gc.collect()
    return {"parts": parts, "params": params, "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------------- without allocating
def _like_bytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def baseline_state_bytes(method: str, model: nn.Module, rank: int) -> dict[str, int]:
    """The baselines' bytes from their state layouts (see the module docstring); `model` may be on meta."""
    params = list(model.parameters())
    weights, grads = tensor_bytes(params) + tensor_bytes(model.buffers()), tensor_bytes(params)
    optimizer_state = bases = 0
    if method == "adamw_torch":
        optimizer_state = sum(2 * _like_bytes(p.shape, p.dtype) + 4 for p in params)  # + fp32 step tensor
    elif method == "adamw_8bit_bnb":
        for p in params:
            if p.numel() < BNB_MIN_8BIT:
                optimizer_state += 2 * _like_bytes(p.shape, torch.float32)
            else:  # codes (uint8), absmax (fp32 per block), qmap (256 x fp32), per moment
                optimizer_state += 2 * (p.numel() + 4 * math.ceil(p.numel() / BNB_BLOCK) + 4 * 256)
    elif method == "galore_torch":
        lowrank = {id(m.weight) for m in galore_targets(model, rank)}
        for p in params:
            if id(p) not in lowrank:
                optimizer_state += 2 * _like_bytes(p.shape, p.dtype)
                continue
            m, n = p.shape
            r = min(rank, m, n)
            projected = (m, r) if m >= n else (r, n)  # 'std': right basis (r x n) when m >= n, else left (m x r)
            optimizer_state += 2 * _like_bytes(projected, p.dtype)
            bases += _like_bytes((r, n) if m >= n else (m, r), p.dtype)
    else:
        raise ValueError(method)
    return {"weights": weights, "grads": grads, "optimizer_state": optimizer_state, "error_feedback": 0, "bases": bases}


def ours_state_bytes(method: str, model: nn.Module, rank: int) -> dict[str, int]:
    """prepare_model + our AdamW's state initialisation on `model` (meta tensors: nothing allocated)."""
    hgp.prepare_model(model, hgp.GaLoreConfig.preset(method, rank=rank, update_proj_gap=200))
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer._init_state(p, group)
    parts = training_state_bytes(model, optimizer, error_feedback_apart=True)
    # On meta there is no backward: every trainable parameter gets a gradient of its own shape and dtype.
    parts["grads"] = tensor_bytes(p for p in model.parameters() if p.requires_grad)
    return parts


def computed_run(method: str, size: str, rank: int, dtype: torch.dtype) -> dict[str, Any]:
    started = time.perf_counter()
    model = build_llama(size, seed=0, init_device="meta", dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    if method in OURS:
        parts = ours_state_bytes(method, model, rank)
    else:
        parts = baseline_state_bytes(method, model, rank)
    return {"parts": parts, "params": params, "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------------- report
def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def table(title: str, rows: dict[str, dict[str, Any]]) -> str:
    reference = rows["adamw_torch"]["total"]
    lines = [
        f"### {title}",
        "",
        "| method | weights GB | grads GB | optimizer state GB | error feedback GB | bases GB | total GB | bytes/param | vs AdamW |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, row in rows.items():
        p = row["parts"]
        lines.append(
            f"| {method} | {' | '.join(gb(p[k]) for k in PARTS)} | **{gb(row['total'])}** | "
            f"{row['total'] / row['params']:.2f} | {row['total'] / reference:.1%} |"
        )
    return "\n".join(lines)


def checks(small: dict[str, dict[str, Any]], big: dict[str, dict[str, Any]], small_name: str) -> list[tuple[str, bool]]:
    q_small = small["qgalore_adamw_8bit"]["total"] / small["adamw_torch"]["total"]
    if small_name == "350m":
        fraction = (
            f"350M: qgalore_adamw_8bit = {q_small:.1%} of AdamW (target <= {QGALORE_FRACTION_TARGET:.0%})",
            q_small <= QGALORE_FRACTION_TARGET,
        )
    else:  # the small model's embeddings (trained by plain 8-bit AdamW) are too large a share for the target
        fraction = (
            f"{small_name}: qgalore_adamw_8bit = {q_small:.1%} of AdamW (< 100%; the 30% target is for 350M)",
            q_small < 1,
        )
    return [
        fraction,
        (
            f"7B: qgalore_adamw_8bit = {gb(big['qgalore_adamw_8bit']['total'])} GB "
            f"(target <= {gb(QGALORE_7B_TARGET_BYTES)} GB)",
            big["qgalore_adamw_8bit"]["total"] <= QGALORE_7B_TARGET_BYTES,
        ),
        *(
            (
                f"{name}: galore_adamw {gb(rows['galore_adamw']['total'])} GB < galore-torch "
                f"{gb(rows['galore_torch']['total'])} GB",
                rows["galore_adamw"]["total"] < rows["galore_torch"]["total"],
            )
            for name, rows in ((small_name, small), ("7B", big))
        ),
    ]


def plot(results: dict[str, dict[str, dict[str, Any]]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(results)
    for i, (label, rows) in enumerate(results.items()):
        values = [rows[m]["total"] / rows[m]["params"] for m in METHODS]
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(METHODS))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(METHODS)), METHODS, rotation=20)
    ax.set_ylabel("training-state bytes per model parameter")
    ax.set_title("Weights + gradients + optimizer state + bases (rank 256)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(label: str, runner: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rows = {}
    for method in METHODS:
        row = runner(method)
        row["total"] = sum(row["parts"].values())
        rows[method] = row
        print(f"  {label} {method:>20}: {gb(row['total'])} GB ({row['seconds']:.1f} s)", flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small Llama instead of ~350M (CI smoke run)")
    parser.add_argument(
        "--rank", type=int, default=256, help="GaLore rank (default 256; --quick: 32 for the small model)"
    )
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "outputs" / "benchmarks")
    args = parser.parse_args(argv)
    small = "quick" if args.quick else "350m"
    small_rank = 32 if args.quick and args.rank == 256 else args.rank
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"measuring {small} (fp32, CPU, 3 steps of 1 x 64 tokens), rank {small_rank}", flush=True)
    measured = run_all(small, lambda m: measured_run(m, small, small_rank))
    # The layout formulas used at 7B, applied to the measured size, must give the measured bytes.
    formula_errors = {}
    for method in METHODS:
        computed = computed_run(method, small, small_rank, torch.float32)["parts"]
        if computed != measured[method]["parts"]:
            formula_errors[method] = {"computed": computed, "measured": measured[method]["parts"]}
    print(f"computing 7b (bf16, meta device), rank {args.rank}", flush=True)
    big = run_all("7b", lambda m: computed_run(m, "7b", args.rank, torch.bfloat16))

    small_title = f"Llama {small} ({measured['adamw_torch']['params'] / 1e6:.0f}M params, fp32), rank {small_rank}: measured after 3 steps"
    big_title = f"Llama 7B ({big['adamw_torch']['params'] / 1e9:.2f}B params, bf16), rank {args.rank}: computed on the meta device"
    results = [(text, ok) for text, ok in checks(measured, big, small)]
    report = "\n\n".join(
        [
            "# Training-state memory",
            table(small_title, measured),
            table(big_title, big),
            "### Targets\n\n" + "\n".join(f"- [{'x' if ok else ' '}] {text}" for text, ok in results),
            "Formula check (7B method applied to the measured size): "
            + ("all methods match the measured bytes exactly." if not formula_errors else f"MISMATCH {formula_errors}"),
            "GB = 1e9 bytes. " + __doc__.split("\n\n", 2)[2].strip(),
        ]
    )
    print("\n" + report + "\n")
    (args.out / "memory.md").write_text(report + "\n")
    summary = {
        "small_size": small,
        "rank": {"small": small_rank, "7b": args.rank},
        "measured": measured,
        "7b": big,
        "targets": [{"check": text, "met": ok} for text, ok in results],
        "formula_errors": formula_errors,
    }
    (args.out / "memory.json").write_text(json.dumps(summary, indent=2))
    plot({f"{small} (measured, fp32)": measured, "7B (meta, bf16)": big}, args.out / "memory_bytes_per_param.png")
    for name in ("memory.md", "memory.json", "memory_bytes_per_param.png"):
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
