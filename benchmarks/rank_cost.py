"""What rank_allocation='auto' costs per step: the calibration and an ordinary step, uniform rank vs auto.

    python benchmarks/rank_cost.py                 # quality.py's tiny Llama (hidden 128), rank 32, 8 x 128 tokens
    python benchmarks/rank_cost.py --shape h1024 --rank 128 --batch 4 --seq-len 256 --schedules aligned --gap 3 --reps 2
    python benchmarks/rank_cost.py --quick         # tiny-h64, 2 x 16 tokens, 2 repetitions (tests/test_benchmarks_cli.py)

The same model (one seed, random tokens) trains 2 x `gap` steps under ``galore_adamw`` (fp32 state, scale 0.25)
with a uniform rank and with ``rank_allocation='auto'`` at that rank (budget: the uniform rank's factor values),
for both refresh schedules (``--schedules``): ``aligned`` (every layer calibrates at step 0: the calibration step)
and ``staggered`` (the default: the layers calibrate in phases over the first steps, as many layers a step as
refresh_budget_mb of records and kept inputs allows, so the calibration is the window of those steps, summed;
`gap` must exceed the phases, 16 at the default shape). Under 'auto' a calibration records a sketch of
rank_max + oversampling columns instead of rank + oversampling, takes the spectrum from the whole sketch (the
eigenvalues of its Gram matrix), computes the basis from its first rank + oversampling columns as a uniform
calibration does and, once every layer has measured, allocates the ranks (one host sync); the layers take their
ranks at their next refresh (step `gap` on), after which an ordinary step runs at the allocated ranks (the same
total of factor values).

CPU time of the calling thread (``time.thread_time``, torch on one thread) of forward + backward, optimizer.step
and after_step, per step. Repetitions interleave the configurations (uniform, auto, uniform, auto, ...), each a
fresh model; a first untimed repetition warms up. Reported, each the median over the repetitions:
- calibration: its steps summed (step 0 aligned; the phases' steps staggered), and their after_step part (the
  refresh: basis, spectrum, allocation);
- calibration extra: that sum minus as many ordinary steps (what calibrating adds);
- first gap: steps 0 .. gap - 1 summed (the calibration and the ordinary steps after it: the same count of
  steps in both configurations);
- ordinary step: the mean of the ordinary steps before `gap` (at the starting rank) and after the second
  refresh window (at the allocated ranks).
Writes rank_cost.json and rank_cost.md to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Optional

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _models  # noqa: E402
import torch  # noqa: E402

TARGETS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"  # quality.py's
CONFIGS = ("uniform", "auto")
SCHEDULES = ("aligned", "staggered")


def run_once(args: argparse.Namespace, allocation: str, schedule: str) -> dict[str, Any]:
    """Train 2 x gap steps from the seed-0 model; per step the thread CPU seconds of each part and what refreshed."""
    import hf_galore_plugin as hgp
    from hf_galore_plugin.api import refreshes_due

    model = _models.build_llama(args.shape, seed=0, max_position_embeddings=args.seq_len)
    config = hgp.GaLoreConfig.preset(
        "galore_adamw", rank=args.rank, update_proj_gap=args.gap, scale=0.25, target_modules=TARGETS,
        refresh_schedule=schedule, **({"rank_allocation": "auto"} if allocation == "auto" else {}),
    )  # fmt: skip
    model = hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-2, weight_decay=0.0)
    vocab = _models.SHAPES[args.shape]["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    batches = torch.randint(0, vocab, (2 * args.gap, args.batch, args.seq_len), generator=generator)
    steps = []
    for step, ids in enumerate(batches):
        due = refreshes_due(model)
        t0 = time.thread_time()
        model(input_ids=ids, labels=ids).loss.backward()
        t1 = time.thread_time()
        optimizer.step()
        t2 = time.thread_time()
        refreshed = len(hgp.after_step(model, optimizer)["refreshed"])
        t3 = time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        steps.append({"step": step, "due": due, "refreshed": refreshed, "forward_backward": t1 - t0,
                      "optimizer_step": t2 - t1, "after_step": t3 - t2, "total": t3 - t0})  # fmt: skip
    ranks = sorted(min(m.galore_factor.shape) for _, m in hgp.galore_layers(model))
    return {"steps": steps, "ranks": ranks}


def summarize_run(run: dict[str, Any], gap: int) -> dict[str, float]:
    steps = run["steps"]
    window = [s for s in steps if s["step"] < gap and s["refreshed"]]  # the calibration: every layer's first refresh
    ordinary = [s for s in steps if not s["due"] and not s["refreshed"]]
    before = [s["total"] for s in ordinary if window[-1]["step"] < s["step"] < gap]
    if not before:
        raise SystemExit(
            f"the calibration fills steps 0..{gap - 1} (as many staggered phases as the gap): no ordinary step to "
            "compare with; raise --gap above the number of phases"
        )
    second = max(s["step"] for s in steps if s["refreshed"])
    after = [s["total"] for s in ordinary if s["step"] > second]
    calibration = sum(s["total"] for s in window)
    return {
        "calibration_steps": len(window),
        "calibration": calibration,
        "calibration_after_step": sum(s["after_step"] for s in window),
        # what the calibration adds to its steps (their count times the ordinary step subtracted)
        "calibration_extra": calibration - len(window) * statistics.fmean(before),
        "first_gap": sum(s["total"] for s in steps if s["step"] < gap),  # steps 0 .. gap - 1, all of them
        "ordinary_before": statistics.fmean(before),
        "ordinary_after": statistics.fmean(after),
    }


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"Thread CPU seconds (torch on {result['threads']} thread), shape {a['shape']}, rank {a['rank']}, "
        f"{a['batch']} x {a['seq_len']} tokens, gap {a['gap']}; median of {a['reps']} interleaved repetitions "
        f"({result['machine']}).",
        "",
        "| schedule | config | calibration s (steps) | of it after_step s | calibration extra s | first gap s "
        "| ordinary step s (before ranks taken) | ordinary step s (at the allocated ranks) | ranks min / median / max |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for schedule, by in result["medians"].items():
        for config in CONFIGS:
            m = by[config]
            ranks = result["ranks"][schedule][config]
            lines.append(
                f"| {schedule} | {config} | {m['calibration']:.4f} ({m['calibration_steps']:g}) "
                f"| {m['calibration_after_step']:.4f} | {m['calibration_extra']:.4f} | {m['first_gap']:.3f} "
                f"| {m['ordinary_before']:.4f} | {m['ordinary_after']:.4f} "
                f"| {ranks[0]} / {statistics.median(ranks):g} / {ranks[-1]} |"
            )
        u, x = by["uniform"], by["auto"]
        lines.append(
            f"| {schedule} | auto / uniform | {x['calibration'] / u['calibration']:.3f}x "
            f"| {x['calibration_after_step'] / u['calibration_after_step']:.3f}x "
            f"| {x['calibration_extra'] / u['calibration_extra']:.3f}x | {x['first_gap'] / u['first_gap']:.3f}x "
            f"| {x['ordinary_before'] / u['ordinary_before']:.3f}x | {x['ordinary_after'] / u['ordinary_after']:.3f}x | |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny-h128", choices=sorted(_models.SHAPES), help="a _models.SHAPES name")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--gap", type=int, default=24, help="update_proj_gap (> the 16 staggered phases)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions of each configuration (median)")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        choices=SCHEDULES,
        help="refresh schedules to time (aligned alone: a large shape in fewer steps)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny-h64, rank 16, 2 x 16 tokens, 2 repetitions")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "outputs" / "rank_cost")
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.rank, args.batch, args.seq_len, args.reps = "tiny-h64", 16, 2, 16, 2
    torch.set_num_threads(1)
    import logging

    logging.getLogger("hf_galore_plugin").setLevel(logging.ERROR)  # the allocation's summary line, once a run
    schedules = [s for s in SCHEDULES if s in args.schedules]
    runs: dict[str, dict[str, list]] = {s: {c: [] for c in CONFIGS} for s in schedules}
    ranks: dict[str, dict[str, list]] = {s: {} for s in schedules}
    for rep in range(args.reps + 1):  # repetition 0 warms up, untimed
        for schedule in schedules:
            for config in CONFIGS:
                run = run_once(args, config, schedule)
                ranks[schedule][config] = run["ranks"]
                if rep:
                    runs[schedule][config].append(summarize_run(run, args.gap))
        print(f"repetition {rep}{' (warm-up)' if rep == 0 else ''} done", flush=True)
    medians = {
        s: {c: {k: statistics.median(r[k] for r in runs[s][c]) for k in runs[s][c][0]} for c in CONFIGS}
        for s in schedules
    }
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "medians": medians,
        "ranks": ranks,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rank_cost.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "rank_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
