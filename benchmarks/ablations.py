"""An ablation for every default: each shipped default of `qgalore_adamw_8bit` against its alternatives,
one field changed at a time, 3 seeds each, on the quality grid's tiny pre-training task.

    python benchmarks/ablations.py --out outputs/ablations            # all rows, 3 seeds (about 50 min, 1 core)
    python benchmarks/ablations.py --rows default,nf4 --seeds 1       # a subset
    python benchmarks/ablations.py --from-runs outputs/ablations/runs.jsonl --out outputs/ablations   # report only

Every row trains the quality grid's 1.07M-parameter Llama (benchmarks/quality.py, size tiny: 200 steps of
8 x 128 tokens, rank 32, gap 50, scale 0.25) at one learning rate, 0.03: the best rate of every GaLore
row of the quality grid. The Trainer integration's `lr_scale` (and its recovery) is applied to the GaLore
groups as GaLoreCallback applies it, so the default row is what `optim="qgalore_adamw_8bit"` trains.
Runs already in OUT/runs.jsonl are not repeated, so an interrupted ablation resumes where it stopped.
Reported per row: held-out loss mean ± sample std over the seeds, its difference to the default row, and
whether that difference exceeds the two rows' seed noise (|diff| > std_default + std_row); the number of
basis computations (all layers, calibration included) and the seconds spent in the step driver (basis
refreshes and folds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any, Optional

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common  # noqa: E402  (sets HF_GALORE_PLUGIN_NO_TAKEOVER=1 before anything imports the plugin)
import quality  # noqa: E402

LR = 0.03
SEEDS = (0, 1, 2)
BASE = "qgalore_adamw_8bit"

# name -> (question it answers, GaLoreConfig overrides of the preset). The default row changes nothing; the
# refresh rows name both refresh settings, so they mean the same whatever the defaults are (the refresh table of
# docs/benchmarks/refresh.md was measured when the paper's refresh, now the refresh_paper row, was the default).
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "default": (
        "shipped qgalore_adamw_8bit (lr_scale 0.85, lazy refresh, keep moments, staggered refresh with sketches, "
        "INT4 basis, INT8 W0, 8-bit state)",
        {},
    ),
    "lr_scale_1": ("lr_scale 1.0 instead of 0.85", {"lr_scale": 1.0}),
    "lr_recovery": ("lr_scale 0.85 recovering to 1.0 over the first 10% of training", {"lr_recovery_fraction": 0.1}),
    "lazy_off": ("lazy refresh off (gap 50: too few refreshes for lazy growth to act)", {"lazy_refresh": False}),
    "gap10": ("gap 10 (20 refreshes), lazy refresh on", {"update_proj_gap": 10}),
    "gap10_lazy_off": ("gap 10, lazy refresh off", {"update_proj_gap": 10, "lazy_refresh": False}),
    "gap40": ("gap 40 (5 refreshes)", {"update_proj_gap": 40}),
    "gap100": ("gap 100 (2 refreshes)", {"update_proj_gap": 100}),
    "moments_project": ("moment_handling project", {"moment_handling": "project"}),
    "moments_reset": ("moment_handling reset", {"moment_handling": "reset"}),
    "randomized": ("basis_method randomized (range finder, 1 power iteration)", {"basis_method": "randomized"}),
    "basis_fp32": ("basis stored unquantized", {"basis_storage": "as_computed"}),
    "basis_int8": ("basis stored INT8", {"basis_storage": "int8"}),
    "w0_unquantized": ("W0 kept as loaded (fp32 here)", {"weight_storage": "as_loaded"}),
    "w0_nf4": ("W0 stored NF4 (block 64)", {"weight_storage": "nf4"}),
    "state_fp32": ("fp32 optimizer state", {"state_bits": 32}),
    "state_8bit_ef": ("8-bit state with error feedback", {"error_feedback": True}),
    "refresh_paper": (
        "the paper's refresh: aligned, exact SVD",
        {"refresh_schedule": "aligned", "basis_method": "svd"},
    ),
    "refresh_staggered": (
        "staggered refresh phases, budget one layer's fp32 gradient, exact SVD",
        {"refresh_schedule": "staggered", "basis_method": "svd"},
    ),
    "refresh_sketch": (
        "aligned, streaming sketch basis (single pass, oversampling 8)",
        {"refresh_schedule": "aligned", "basis_method": "sketch"},
    ),
    "refresh_staggered_sketch": (
        "staggered phases + streaming sketch (the default since issue 26)",
        {"refresh_schedule": "staggered", "basis_method": "sketch"},
    ),
    "galore_head": (
        "the output head projected too (GaLore lm_head: 1024 x 128 here, rank 32; untied, as at 128k vocabularies)",
        {"target_modules": quality.TARGETS + "|lm_head"},
    ),
}


def jobs_for(rows: list[str], seeds: int, base: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {**base, "method": BASE, "lr": LR, "seed": seed, "row": row, "galore_overrides": ROWS[row][1],
         "apply_lr_scale": True}
        for seed in SEEDS[:seeds]
        for row in rows
    ]  # fmt: skip


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    return {**quality.run_one(job), "row": job["row"]}


def describe(result: dict[str, Any]) -> str:
    held = "diverged" if result["diverged"] else f"held-out {result['heldout_loss']:.4f}"
    return f"  {result['row']:<16} seed {result['seed']}  {held}  refreshes {result['refreshes']}  ({result['train_seconds']:.0f} s)"


def summarize(results: list[dict[str, Any]], rows: list[str]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        runs = sorted((r for r in results if r["row"] == row), key=lambda r: r["seed"])
        finished = [r for r in runs if not r["diverged"]]
        losses = [r["heldout_loss"] for r in finished]
        mean, spread = _common.mean_spread(losses) if losses else (None, None)
        out.append(
            {
                "row": row,
                "question": ROWS[row][0],
                "overrides": ROWS[row][1],
                "seeds": [r["seed"] for r in runs],
                "diverged": len(runs) - len(finished),
                "losses": losses,
                "mean": mean,
                "std": spread,
                "refreshes": [r["refreshes"] for r in runs],
                "driver_seconds": sum(r["step_driver_seconds"] for r in runs) / len(runs) if runs else None,
                "train_seconds": sum(r["train_seconds"] for r in runs) / len(runs) if runs else None,
            }
        )
    return out


def markdown(summary: list[dict[str, Any]]) -> str:
    default = next((s for s in summary if s["row"] == "default" and s["mean"] is not None), None)
    lines = [
        "| row | change from the shipped default | held-out loss (mean ± std, seeds) | vs default | beyond seed noise "
        "| basis computations per run | s in step driver per run | s per run |",
        "|" + "---|" * 8,
    ]
    for s in summary:
        if s["mean"] is None:
            lines.append(f"| {s['row']} | {s['question']} | not run or all diverged | | | | | |")
            continue
        loss = f"{_common.format_mean_spread(s['losses'], 4)} ({len(s['losses'])})"
        versus = noise = ""
        if default is not None and s["row"] != "default":
            diff = s["mean"] - default["mean"]
            versus = f"{diff:+.4f} ({diff / default['mean']:+.2%})"
            if len(s["losses"]) < 2 or len(default["losses"]) < 2:
                noise = "n/a (1 seed)"
            elif abs(diff) > default["std"] + s["std"]:
                noise = "yes: worse" if diff > 0 else "yes: better"
            else:
                noise = "no"
        refreshes = "/".join(str(r) for r in sorted(set(s["refreshes"])))
        lines.append(
            f"| {s['row']} | {s['question']} | {loss} | {versus} | {noise} | {refreshes} "
            f"| {s['driver_seconds']:.1f} | {s['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds per row (default 3)")
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (processes; default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--steps", type=int, help="override the 200 optimizer steps (smoke runs)")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "outputs" / "ablations")
    parser.add_argument("--from-runs", type=pathlib.Path, help="only write the report from a runs.jsonl")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row(s) {unknown}; choose from {','.join(ROWS)}")
    if not 1 <= args.seeds <= len(SEEDS):
        parser.error(f"--seeds must be between 1 and {len(SEEDS)}, got {args.seeds}")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    started = time.perf_counter()
    size = quality.SIZES["tiny"]
    if args.steps is not None:
        size = dataclasses.replace(size, steps=args.steps)
    if args.from_runs is None:
        data_path = args.out / "tokens.pt"
        quality.prepare_data(size, data_path)
        base = {"size": dataclasses.asdict(size), "data": str(data_path), "device": "cpu", "threads": args.threads}
        done = set()
        if log.exists():
            done = {(r["row"], r["seed"]) for r in map(json.loads, log.read_text().splitlines()) if r.get("row")}
        todo = [j for j in jobs_for(rows, args.seeds, base) if (j["row"], j["seed"]) not in done]
        print(f"{len(todo)} run(s) to do, {len(done)} already in {log}", flush=True)
        _common.run_jobs(run_one, todo, args.jobs, log, describe)
        data_path.unlink()
    source = args.from_runs or log
    results = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    results = [r for r in results if r.get("row") in ROWS]
    text = markdown(summarize(results, rows))
    header = (
        f"Ablations of `{BASE}` at lr {LR} (size tiny, {size.steps} steps), {time.strftime('%Y-%m-%d')}; "
        f"report written in {time.perf_counter() - started:.0f} s.\n\n"
    )
    (args.out / "ablations.md").write_text(header + text)
    print(header + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
