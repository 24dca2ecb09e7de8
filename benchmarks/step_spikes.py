"""The slowest training step of a whole refresh cycle against the ordinary step, per preset (issue 26).

    python benchmarks/step_spikes.py                       # tiny Llama (quality grid: 28 GaLore layers), gap 200
    python benchmarks/step_spikes.py --size 60m --batch 2 --seq-len 128
    python benchmarks/step_spikes.py --quick               # 2-layer Llama, gap 8 (tests/test_benchmarks_cli.py)

Each preset runs with its shipped defaults and, for comparison, with the paper's aligned schedule and
exact SVD (``refresh_schedule="aligned", basis_method="svd"``, the defaults before issue 26), for
``gap + phases + 4`` steps, so that every layer's calibration (step 0 under aligned; steps 0 .. phases-1
under staggered: the phases apply to calibration too) and its first refresh with optimizer state (step
gap, or gap + phase) fall inside the run. A step is forward + backward + ``optimizer.step()`` +
``after_step`` + ``zero_grad()``, timed as CPU time of the calling thread (``time.thread_time``, torch
on one thread), which a busy shared machine changes far less than wall time. Reported per row: the
median ordinary step (no layer refreshed), the worst step and its ratio to that median (the target:
at most 2x), and the worst calibration step and worst refresh step apart, with how many layers each
refreshed. Writes step_spikes.json and step_spikes.md to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Optional

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import hf_galore_plugin as hgp  # noqa: E402
from hf_galore_plugin.integrations.optim_args import parse_optim_args  # noqa: E402
from _models import SHAPES, build_llama, preset_names  # noqa: E402

PAPER_SCHEDULE = "refresh_schedule=aligned,basis_method=svd"


def run_row(preset: str, overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    model = build_llama(args.size, seed=0)
    config = hgp.GaLoreConfig.preset(preset, rank=args.rank, update_proj_gap=args.gap, **overrides)
    hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    phases = [int(layer.galore_phase) for _, layer in hgp.galore_layers(model)]
    count = max(phases) + 1
    generator = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.size]["vocab_size"]
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len), generator=generator) for _ in range(4)]
    steps = []
    for step in range(args.gap + count + 4):
        tokens = batches[step % len(batches)]
        started = time.thread_time()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        refreshed = len(hgp.after_step(model, optimizer)["refreshed"])
        optimizer.zero_grad(set_to_none=True)
        steps.append({"step": step, "thread_s": time.thread_time() - started, "refreshed": refreshed})
    ordinary = [s["thread_s"] for s in steps if not s["refreshed"]]
    median = statistics.median(ordinary)
    worst = max(steps, key=lambda s: s["thread_s"])

    def worst_of(kind: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
        return max(kind, key=lambda s: s["thread_s"]) if kind else None

    calibration = [s for s in steps if s["refreshed"] and s["step"] < args.gap]
    refresh = [s for s in steps if s["refreshed"] and s["step"] >= args.gap]
    return {
        "preset": preset,
        "overrides": overrides,
        "config": {k: getattr(config, k) for k in ("refresh_schedule", "basis_method", "refresh_budget_mb")},
        "layers": len(phases),
        "phases": count,
        "max_layers_per_phase": max(phases.count(p) for p in set(phases)),
        "median_ordinary_s": median,
        "ordinary_steps": len(ordinary),
        "worst": worst,
        "worst_ratio": worst["thread_s"] / median,
        "worst_calibration": worst_of(calibration),
        "worst_refresh": worst_of(refresh),
        "steps": steps,
    }


def report(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"# Worst step vs median ordinary step (Llama {a['size']} {SHAPES[a['size']]}, batch {a['batch']} x "
        f"{a['seq_len']}, rank {a['rank']}, gap {a['gap']})",
        "",
        f"CPU time of the stepping thread, torch on {result['threads']} thread(s); {result['when']}.",
        "",
        "| preset | schedule, basis | phases (most layers in one) | median ordinary step ms (n) "
        "| worst calibration step ms (layers) | worst refresh step ms (layers) | worst step / median |",
        "|---|---|---|---:|---:|---:|---:|",
    ]

    def cell(s: Optional[dict[str, Any]]) -> str:
        return "-" if s is None else f"{s['thread_s'] * 1e3:.0f} (step {s['step']}: {s['refreshed']})"

    for row in result["rows"]:
        c = row["config"]
        label = f"{c['refresh_schedule']}, {c['basis_method']}" + ("" if row["overrides"] else " (defaults)")
        lines.append(
            f"| {row['preset']} | {label} | {row['phases']} ({row['max_layers_per_phase']}) "
            f"| {row['median_ordinary_s'] * 1e3:.0f} ({row['ordinary_steps']}) | {cell(row['worst_calibration'])} "
            f"| {cell(row['worst_refresh'])} | {row['worst_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny-h128")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, help="GaLore rank (default hidden / 4)")
    parser.add_argument("--gap", type=int, default=200, help="update_proj_gap")
    parser.add_argument("--presets", default=",".join(preset_names()))
    parser.add_argument(
        "--variants",
        default=f"defaults;{PAPER_SCHEDULE}",
        help="';'-separated rows per preset: 'defaults' or optim_args-style overrides (k=v,k=v)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="size quick, batch 2 x 32, gap 8")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "outputs" / "step_spikes")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.batch, args.seq_len, args.gap = "quick", 2, 32, 8
    args.rank = args.rank or SHAPES[args.size]["hidden_size"] // 4
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "threads": torch.get_num_threads(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }
    for preset in args.presets.split(","):
        for variant in args.variants.split(";"):
            overrides = {} if variant == "defaults" else parse_optim_args(variant)
            print(f"{preset} {variant} ...", flush=True)
            result["rows"].append(run_row(preset, overrides, args))
            (args.out / "step_spikes.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (args.out / "step_spikes.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
