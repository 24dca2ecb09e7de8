"""The planner tables of docs/benchmarks/memory.md ("Peak memory (planner)"): peak of one training step at seq 2048,
batch 1, gradient checkpointing, bf16, for Llama-2-7B, Llama-3-8B and Llama-3-70B, every method, GaLore
rank 256 (and rank 128 for 7B/8B: GaLore methods only, the others do not depend on the rank).

    python benchmarks/plan_tables.py --out outputs/plan        # writes plan_<model>_r<rank>.json and plan.md
    python benchmarks/plan_tables.py --out outputs/plan_presets --methods galore_adamw,galore_adamw_8bit,qgalore_adamw_8bit

Each (model, rank) is one `hf_galore_plugin.plan.estimate` call; its wall time is recorded in the JSON.
Existing JSON files are reused (delete them to re-run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from hf_galore_plugin import PRESETS  # noqa: E402
from hf_galore_plugin.plan import METHODS, estimate  # noqa: E402
from hf_galore_plugin.plan.__main__ import format_table  # noqa: E402

GALORE = ("galore_torch", *PRESETS)
RUNS = [("llama-3-70b", 256, METHODS), ("llama-2-7b", 256, METHODS), ("llama-3-8b", 256, METHODS),
        ("llama-2-7b", 128, GALORE), ("llama-3-8b", 128, GALORE)]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", help="comma-separated model names to run")
    parser.add_argument("--methods", help="comma-separated methods to plan (default: every method of the table)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tables = []
    for model, rank, methods in RUNS:
        if args.only and model not in args.only.split(","):
            continue
        path = args.out / f"plan_{model}_r{rank}.json"
        if path.exists():
            plan = json.loads(path.read_text())
        else:
            start = time.perf_counter()
            if args.methods:
                methods = tuple(m for m in args.methods.split(",") if m in methods)
            plan = estimate(model=model, methods=methods, seq_len=2048, batch_size=1, gradient_checkpointing=True,
                            dtype="bf16", rank=rank)  # fmt: skip
            plan["seconds"] = round(time.perf_counter() - start, 1)
            path.write_text(json.dumps(plan, indent=1))
        tables.append(format_table(plan) + f"\n\n(planner wall time: {plan['seconds']} s)\n")
        print(tables[-1], flush=True)
        (args.out / "plan.md").write_text("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
