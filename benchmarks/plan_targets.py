"""Peak memory of whole runs against the memory targets (docs/benchmarks/memory.md, "Whole-run peaks vs targets"):
the planner's normal-step and refresh-step peaks for Llama-2-7B and Llama-3-8B (seq 2048) and
Llama-3-70B (seq 4096), batch 1, gradient checkpointing, bf16, GaLore rank 256, every baseline, our
presets with their defaults and with the paper's refresh (aligned schedule, exact SVD: the defaults
before issue 26), and `qgalore_adamw_8bit` with the memory options stacked (NF4 W0, offloaded state).

    python benchmarks/plan_targets.py --out outputs/plan_targets   # plan_targets.json + plan_targets.md
    python benchmarks/plan_targets.py --out outputs/plan_targets --only llama-2-7b --methods galore_adamw,galore_adamw_8bit,qgalore_adamw_8bit

One `hf_galore_plugin.plan.estimate` call per (model, option set); results are cached in the JSON
(delete it to re-run) and the table is rewritten after every call, so an interrupted run resumes.
`--methods` restricts the "defaults" rows (the baselines do not depend on our defaults).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from hf_galore_plugin import PRESETS  # noqa: E402
from hf_galore_plugin.config import PAPER_REFRESH  # noqa: E402
from hf_galore_plugin.plan import METHODS, estimate  # noqa: E402

GIB, GB = 2**30, 1e9
MODELS = {"llama-2-7b": 2048, "llama-3-8b": 2048, "llama-3-70b": 4096}
# The targets for the best option set (GB, peak of a whole run: the larger of the two steps).
TARGETS_GB = {"llama-2-7b": 9.0, "llama-3-8b": 12.0, "llama-3-70b": 80.0}
PAPER = ",".join(f"{key}={value}" for key, value in PAPER_REFRESH.items())
# (label, optim_args, methods): our presets run with their defaults (staggered refresh, sketches).
OPTION_SETS = [
    ("defaults", "", METHODS),
    ("paper refresh (aligned, svd)", PAPER, tuple(PRESETS)),
    ("nf4", "weight_storage=nf4", ("qgalore_adamw_8bit",)),
    ("nf4 + svd", "weight_storage=nf4,basis_method=svd", ("qgalore_adamw_8bit",)),
    ("nf4 + offload", "weight_storage=nf4,state_offload=cpu", ("qgalore_adamw_8bit",)),
]


def _parse(text: str) -> dict:
    return dict(item.split("=", 1) for item in text.split(",")) if text else {}


def table(results: dict) -> str:
    lines = [
        "| model (seq) | method | options | normal-step peak GB | refresh-step peak GB | run peak GB | run / normal "
        "| target GB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, r in results.items():
        model, label = key.split("|")
        for method, m in r["methods"].items():
            run = max(m["peak_bytes"], m["refresh_peak_bytes"])
            target = f"{TARGETS_GB[model]:g}" if label.startswith("nf4") else ""
            lines.append(
                f"| {model} ({MODELS[model]}) | {method} | {label} | {m['peak_bytes'] / GB:.2f} | "
                f"{m['refresh_peak_bytes'] / GB:.2f} | {run / GB:.2f} | {run / m['peak_bytes']:.3f} | {target} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", help="comma-separated model names to run")
    parser.add_argument("--methods", help="comma-separated methods of the 'defaults' rows (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "plan_targets.json"
    results = json.loads(cache.read_text()) if cache.exists() else {}
    for model, seq_len in MODELS.items():
        if args.only and model not in args.only.split(","):
            continue
        for label, optim_args, methods in OPTION_SETS:
            key = f"{model}|{label}"
            if key in results:
                continue
            if args.methods and label == "defaults":
                methods = tuple(args.methods.split(","))
            start = time.perf_counter()
            print(f"planning {model}, {label} ...", flush=True)
            plan = estimate(model=model, methods=methods, seq_len=seq_len, batch_size=1, gradient_checkpointing=True,
                            dtype="bf16", rank=256, optim_args=_parse(optim_args))  # fmt: skip
            plan["seconds"] = round(time.perf_counter() - start, 1)
            results[key] = plan
            cache.write_text(json.dumps(results, indent=1))
            (args.out / "plan_targets.md").write_text(table(results) + "\n")
            print(f"  {plan['seconds']} s", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
