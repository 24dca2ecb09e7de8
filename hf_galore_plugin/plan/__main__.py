"""python -m hf_galore_plugin.plan: peak memory of one training step per method (see the package docstring)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import time
from typing import Optional

from . import ENGINES, GPU_SIZES_GB, METHODS, MODEL_NAMES, PlanError, estimate

_PARTS = ("weights", "grads", "optimizer_state", "bases", "activations", "other")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(plan: dict) -> str:
    """A markdown table: one row per method, GiB, with the parts of the normal-step peak."""
    s = plan["settings"]
    lines = [
        f"{plan['model']}: {plan['params'] / 1e9:.2f}B parameters, seq {s['seq_len']}, batch {s['batch_size']}, "
        f"{s['dtype']}, gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, rank {s['rank']}"
        + (f", {s['world_size']} x {s['engine']} (per rank)" if s["world_size"] > 1 else "")
        + (", Liger fused linear cross-entropy" if s.get("liger") else ""),
        "",
        "| method | peak GiB | refresh-step peak GiB | weights | grads | optimizer state | bases | activations | other "
        "| fits (GB) | traced |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in plan["methods"].items():
        parts = " | ".join(_gib(m["parts"][k]) for k in _PARTS)
        fits = ", ".join(str(g) for g in m["fits_gpus_gb"]) or "none"
        lines.append(f"| {name} | {_gib(m['peak_bytes'])} | {_gib(m['refresh_peak_bytes'])} | {parts} | {fits} "
                     f"| {'yes' if m['traced'] else 'layout'} |")  # fmt: skip
    return "\n".join(lines)


def format_details(plan: dict) -> str:
    lines = []
    for name, m in plan["methods"].items():
        lines.append(f"{name}: peak in {m['peak_phase']}, refresh-step peak in {m['refresh_peak_phase']}; "
                     + "; ".join(m["notes"]))  # fmt: skip
        for t in m["largest_tensors"][:3]:
            lines.append(
                f"    {t['part']:>15} {_gib(t['bytes'])} GiB {t['dtype']} {tuple(t['shape'])} (made in {t['made_in']})"
            )
    lines.append(f"per rank: {plan['settings']['per_rank_rule']}")
    return "\n".join(lines)


def plot(plan: dict, path: str) -> None:
    """A stacked bar per method (parts of the normal-step peak) with the refresh-step peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(plan["methods"])
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.5))
    bottom = [0.0] * len(names)
    for part in _PARTS:
        values = [plan["methods"][n]["parts"][part] / 2**30 for n in names]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    refresh = [plan["methods"][n]["refresh_peak_bytes"] / 2**30 for n in names]
    ax.scatter(names, refresh, marker="_", s=600, color="black", label="refresh-step peak", zorder=3)
    for g in GPU_SIZES_GB:
        if g * 1e9 / 2**30 < 1.3 * max(max(bottom), max(refresh)):
            ax.axhline(g * 1e9 / 2**30, color="grey", lw=0.6, ls="--")
            ax.text(len(names) - 0.5, g * 1e9 / 2**30, f"{g} GB", va="bottom", ha="right", fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan['model']}: peak of one training step")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_problem(path: str) -> Optional[str]:
    """Why a chart cannot be written to `path` (None: it can), checked before the trace that precedes it."""
    target = pathlib.Path(path)
    folder = target.parent
    if target.is_dir():
        return f"{path!r} is a folder; give a file name, e.g. {str(target / 'plan.png')!r}"
    if not folder.exists():
        return f"folder {str(folder)!r} does not exist; create it, or give a file in an existing folder"
    if not folder.is_dir():
        return f"{str(folder)!r} is not a folder; give a file in an existing folder"
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; pip install matplotlib, or drop --plot"
    return None


def _error(message: str) -> int:
    # argparse's convention for bad input: one line on stderr, exit status 2; never a traceback.
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_galore_plugin.plan", description=__doc__)
    parser.add_argument("--model", help=f"a known shape: {', '.join(MODEL_NAMES)}")
    parser.add_argument("--config", help="a transformers config.json (file or folder); no weights needed")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, any of {', '.join(METHODS)}")
    parser.add_argument(
        "--optim-args", default="", help="GaLoreConfig overrides for our presets, e.g. rank=256,weight_storage=nf4"
    )
    parser.add_argument("--rank", type=int, default=256, help="GaLore rank (ours and galore_torch)")
    parser.add_argument("--lora-rank", type=int, default=64, help="LoRA / QLoRA rank (every decoder linear layer)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (the dtype the model is trained in)")
    parser.add_argument("--world-size", type=int, default=1, help="processes (GPUs) of the run")
    parser.add_argument(
        "--engine", help=f"with --world-size N > 1: one of {', '.join(ENGINES)} (per-rank bytes; default ddp)"
    )
    parser.add_argument(
        "--device", default="cuda", help="cuda: the code paths of a GPU run (default); cpu: of a CPU run"
    )
    parser.add_argument(
        "--liger-kernel", action="store_true",
        help="the loss of TrainingArguments(use_liger_kernel=True): Liger's fused linear cross-entropy",
    )  # fmt: skip
    parser.add_argument("--full-trace", action="store_true", help="trace every layer instead of scaling from 4 and 5")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of the peaks to this file")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    problem = _plot_problem(args.plot) if args.plot else None
    if problem is not None:
        return _error(f"--plot: {problem}")
    start = time.perf_counter()
    try:
        plan = estimate(
            model=args.model, config=args.config, methods=methods, seq_len=args.seq_len, batch_size=args.batch_size,
            gradient_checkpointing=args.gradient_checkpointing, dtype=args.dtype, rank=args.rank,
            lora_rank=args.lora_rank, optim_args=args.optim_args, world_size=args.world_size, engine=args.engine,
            device=args.device, full_trace=args.full_trace, liger=args.liger_kernel,
        )  # fmt: skip
    except PlanError as exc:
        return _error(str(exc))
    plan["seconds"] = round(time.perf_counter() - start, 1)
    if args.plot:
        try:
            plot(plan, args.plot)
        except OSError as exc:
            return _error(f"--plot: cannot write {args.plot!r} ({exc}); give a writable file")
    if args.json:
        print(json.dumps(plan))
    else:
        print(format_table(plan))
        print()
        print(format_details(plan))
        print(f"({plan['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
