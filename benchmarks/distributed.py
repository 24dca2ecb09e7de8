"""Distributed benchmark: per engine and optimizer, training-state memory per rank, step time against
``adamw_torch`` under the same engine, and the bytes collectives move per normal step and per refresh.

    python benchmarks/distributed.py --out outputs/distributed          # 6 engines x 5 setups
    python benchmarks/distributed.py --quick                             # ~3 min: DDP, FSDP2, ZeRO-2; AdamW vs galore_adamw

Each (engine, setup) runs benchmarks/_distributed_worker.py under torchrun with 2 gloo ranks on CPU
(on a GPU machine the same engines would use NCCL; this script measures the CPU path). Engines: DDP,
FSDP1 (use_orig_params), FSDP2 (fully_shard per decoder layer), DeepSpeed ZeRO-1/2/3. Setups: torch
AdamW (dense), our three presets (exact SVD refresh), and galore_adamw with the randomized range
finder, whose refresh all-reduces sketches instead of layer gradients. See the worker's docstring
for what is counted and how.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_distributed_worker.py"
ENGINES = ("ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")
SETUPS = (
    ("adamw_torch", ""),
    ("galore_adamw", "svd"),
    ("galore_adamw", "randomized"),
    ("galore_adamw_8bit", "svd"),
    ("qgalore_adamw_8bit", "svd"),
)
MB = 1e6


def run_job(engine: str, method: str, basis: str, args, out_dir: Path) -> dict:
    out = out_dir / f"{engine}_{method}_{basis or 'dense'}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        ENGINE=engine,
        METHOD=method,
        BASIS=basis or "svd",
        STEPS=str(args.steps),
        GAP=str(args.gap),
        HIDDEN=str(args.hidden),
        LAYERS=str(args.layers),
        RANK_R=str(args.rank),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(out),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{engine} / {method} / {basis} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarize(run: dict) -> dict:
    records = run["records"][1:]  # step 0: first-touch allocations and the calibration refresh
    normal = [r for r in records if not r["refreshed"]]
    refresh = [r for r in run["records"] if r["refreshed"]]

    def median_bytes(rows, key):
        kinds = sorted({k for r in rows for k in r[key]})
        return {k: statistics.median(r[key].get(k, 0) for r in rows) for k in kinds}

    step_bytes = median_bytes(normal, "step_bytes")
    refresh_bytes = median_bytes(refresh, "refresh_bytes") if refresh else {}
    refresh_steps_after_calibration = [r for r in records if r["refreshed"]]
    return {
        "engine": run["engine"],
        "method": run["method"],
        "basis": run["basis"],
        "step_bytes": step_bytes,
        "step_bytes_total": sum(step_bytes.values()),
        "refresh_bytes": refresh_bytes,
        "refresh_bytes_total": sum(refresh_bytes.values()),
        "refreshes": len(refresh),
        "step_seconds": statistics.median(r["seconds"] for r in normal),
        "refresh_step_seconds": (
            statistics.median(r["seconds"] for r in refresh_steps_after_calibration)
            if refresh_steps_after_calibration
            else None
        ),
        "live_tensor_bytes": max(run["live_tensor_bytes_per_rank"]),
        "peak_rss_bytes": max(run["peak_rss_bytes_per_rank"]),
        "model_parameters": run["model_parameters"],
    }


def _kinds(table: dict) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast/other": "BC"}
    parts = [f"{short.get(k, k)} {v / MB:.2f}" for k, v in sorted(table.items()) if v]
    return ", ".join(parts) if parts else "0"


def report(rows: list[dict], args) -> str:
    lines = [
        f"2 gloo ranks on CPU; Llama hidden {args.hidden}, {args.layers} layers, vocabulary 1024 "
        f"({rows[0]['model_parameters'] / 1e6:.2f}M parameters), micro-batch 4 x 64 tokens per rank, {args.steps} "
        f"steps, GaLore rank {args.rank}, gap {args.gap} (all linear layers of the decoder). MB = 1e6 bytes, "
        "per rank. AR all-reduce, AG all-gather, RS reduce-scatter, BC broadcast (payload: reduced tensor, "
        "gathered output, input to scatter). 'MB exchanged per refresh': what after_step (the basis refresh) "
        "moves on a refresh step.",
        "",
        "| engine | method | refresh basis | MB moved per normal step (by kind) | vs AdamW | MB exchanged per refresh "
        "| live tensors MB per rank | vs AdamW | peak RSS MB | step time vs AdamW | refresh step vs AdamW step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["engine"]: r for r in rows if r["method"] == "adamw_torch"}
    for r in rows:
        b = base.get(r["engine"])
        dense = r["method"] == "adamw_torch"
        ratio = lambda x, y: f"{x / y:.2f}x" if y else "n/a"  # noqa: E731
        refresh = "-" if dense else f"{r['refresh_bytes_total'] / MB:.2f} ({_kinds(r['refresh_bytes'])})"
        lines.append(
            f"| {r['engine']} | {r['method']} | {r['basis'] or '-'} | {r['step_bytes_total'] / MB:.2f} ({_kinds(r['step_bytes'])}) "
            f"| {ratio(r['step_bytes_total'], b['step_bytes_total']) if b else 'n/a'} "
            f"| {refresh} "
            f"| {r['live_tensor_bytes'] / MB:.1f} | {ratio(r['live_tensor_bytes'], b['live_tensor_bytes']) if b else 'n/a'} "
            f"| {r['peak_rss_bytes'] / MB:.0f} | {ratio(r['step_seconds'], b['step_seconds']) if b else 'n/a'} "
            f"| {ratio(r['refresh_step_seconds'], b['step_seconds']) if b and r['refresh_step_seconds'] else '-'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in ENGINES if any(r["engine"] == e for r in rows)]
    setups = []
    for r in rows:
        key = (r["method"], r["basis"])
        if key not in setups:
            setups.append(key)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(setups)
    for i, (method, basis) in enumerate(setups):
        label = method + (f" ({basis})" if basis and basis != "svd" else "")
        by_engine = {r["engine"]: r for r in rows if (r["method"], r["basis"]) == (method, basis)}
        xs = [j + i * width for j in range(len(engines))]
        axes[0].bar(
            xs, [by_engine[e]["step_bytes_total"] / MB if e in by_engine else 0 for e in engines], width, label=label
        )
        axes[1].bar(
            xs, [by_engine[e]["live_tensor_bytes"] / MB if e in by_engine else 0 for e in engines], width, label=label
        )
    for ax, title in zip(axes, ("MB moved by collectives per normal step, per rank", "live tensor MB per rank")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(engines))], engines)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/distributed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="DDP, FSDP2, ZeRO-2; AdamW and galore_adamw (+ randomized refresh on DDP); tiny model",
    )
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gap", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    args = parser.parse_args()
    if args.quick:
        args.engines, args.hidden, args.layers, args.rank, args.steps, args.gap = "ddp,fsdp2,zero2", 128, 2, 8, 6, 3
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    out_dir = Path(args.out)
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)

    rows, started = [], time.time()
    jobs = [(e, m, b) for e in engines for m, b in SETUPS]
    if args.quick:  # dense vs galore_adamw everywhere, the sketch refresh under DDP only
        jobs = [
            (e, m, b) for e, m, b in jobs if m == "adamw_torch" or (m == "galore_adamw" and (b == "svd" or e == "ddp"))
        ]
    for index, (engine, method, basis) in enumerate(jobs, 1):
        t0 = time.time()
        print(f"[{index}/{len(jobs)}] {engine} {method} {basis or ''} ...", end=" ", flush=True)
        rows.append(summarize(run_job(engine, method, basis, args, out_dir / "runs")))
        print(f"{time.time() - t0:.0f} s", flush=True)
    table = report(rows, args)
    (out_dir / "distributed.md").write_text(table + "\n")
    (out_dir / "distributed.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, out_dir / "distributed.png")
    print(table)
    print(
        f"\n{len(jobs)} runs in {time.time() - started:.0f} s; wrote {out_dir}/distributed.md, distributed.json, distributed.png"
    )


if __name__ == "__main__":
    main()
