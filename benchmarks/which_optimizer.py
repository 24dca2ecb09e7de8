"""README / docs/benchmarks/memory.md "Which optimizer for which model and GPU": for each model, the planner's peak of one
training step (seq 2048, batch 1, gradient checkpointing, bf16, GaLore rank 256, LoRA rank 64) of every method
it knows, and which of them fit a 24, 48 and 80 GB GPU (the larger of the normal and the refresh-step peak).

    python benchmarks/which_optimizer.py --out outputs/which      # writes which_<model>.json and which.md

Each model is one ``hf_galore_plugin.plan.estimate`` call (the same as ``python -m hf_galore_plugin.plan --model
MODEL --seq-len 2048 --gradient-checkpointing --json``); existing JSON files are reused (delete them to re-run).
A method fits when its peak is at most the GPU's size in 10^9 bytes; nothing is reserved for the CUDA context
or fragmentation, so a method within a few percent of a size needs a check on the GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from hf_galore_plugin.plan import METHODS, estimate  # noqa: E402

MODELS = ("llama-2-7b", "llama-3-8b", "llama-3-70b")
# The low-memory settings of qgalore_adamw_8bit (docs/guides/lora-qlora.md): label -> optim_args. The
# default bounded refresh (staggered, sketch) is spelled out so that the rows keep their meaning if it changes.
RECIPE = "weight_storage=nf4,refresh_schedule=staggered,basis_method=sketch"
VARIANTS = {
    "qgalore_adamw_8bit low-memory": RECIPE,
    "qgalore_adamw_8bit low-memory offloaded": RECIPE + ",state_offload=cpu",
}
GPUS_GB = (24, 48, 80)
# what each method trains: the table's reader chooses between full-rank, low-rank-update and adapter methods
KIND = {
    "adamw_torch": "full", "adamw_8bit": "full", "adamw_torchao_8bit": "full", "adamw_torchao_4bit": "full",
    "flash_adamw": "full", "galore_torch": "full (low-rank state)", "apollo_adamw": "full (low-rank state)",
    "galore_adamw": "full (low-rank state)", "galore_adamw_8bit": "full (low-rank state)",
    "qgalore_adamw_8bit": "full (low-rank state)", "lora": "adapters", "qlora": "adapters",
    **{label: "full (low-rank state)" for label in VARIANTS},
}  # fmt: skip


def peak(entry: dict) -> int:
    return max(entry["peak_bytes"], entry["refresh_peak_bytes"])


def table(plans: dict[str, dict]) -> str:
    """One row per model and method, the peak in GB and a mark per GPU size it fits."""
    lines = [
        "| model | method | trains | peak GB | " + " | ".join(f"{g} GB" for g in GPUS_GB) + " | state counted |",
        "|---|---|---|---|" + "---|" * len(GPUS_GB) + "---|",
    ]
    for model, plan in plans.items():
        for name, entry in sorted(plan["methods"].items(), key=lambda item: peak(item[1])):
            fits = ["yes" if peak(entry) <= g * 10**9 else "" for g in GPUS_GB]
            how = "traced" if entry["traced"] else "layout"
            if entry.get("host_state_bytes"):
                how += f"; state in host memory: {entry['host_state_bytes'] / 1e9:.1f} GB"
            lines.append(
                f"| {model} | {name} | {KIND.get(name, '?')} | {peak(entry) / 1e9:.1f} | "
                + " | ".join(fits)
                + f" | {how} |"
            )
    return "\n".join(lines)


def summary(plans: dict[str, dict]) -> str:
    """Per model and GPU: the full-rank methods that fit, with their peak in GB (smallest first)."""
    lines = ["| model | " + " | ".join(f"{g} GB" for g in GPUS_GB) + " |", "|---|" + "---|" * len(GPUS_GB)]
    for model, plan in plans.items():
        cells = []
        for g in GPUS_GB:
            fitting = [
                name
                for name, entry in sorted(plan["methods"].items(), key=lambda item: peak(item[1]))
                if peak(entry) <= g * 10**9 and KIND.get(name, "").startswith("full")
            ]
            cells.append(
                ", ".join(f"{name} {peak(plan['methods'][name]) / 1e9:.1f}" for name in fitting) or "none (full-rank)"
            )
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated planner model names")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plans = {}
    for model in [m for m in args.models.split(",") if m]:
        path = args.out / f"which_{model}.json"
        if not path.exists():
            start = time.perf_counter()
            plan = estimate(model=model, methods=METHODS, seq_len=2048, gradient_checkpointing=True)
            plan["seconds"] = round(time.perf_counter() - start, 1)
            path.write_text(json.dumps(plan, indent=1))
        plans[model] = json.loads(path.read_text())
        for index, (label, optim_args) in enumerate(VARIANTS.items()):
            path = args.out / f"which_{model}_variant{index}.json"
            if not path.exists():
                start = time.perf_counter()
                plan = estimate(
                    model=model, methods=["qgalore_adamw_8bit"], seq_len=2048, gradient_checkpointing=True,
                    optim_args=optim_args,
                )  # fmt: skip
                plan["seconds"] = round(time.perf_counter() - start, 1)
                path.write_text(json.dumps(plan, indent=1))
            plans[model]["methods"][label] = json.loads(path.read_text())["methods"]["qgalore_adamw_8bit"]
    legend = "".join(f"\n- {label}: optim_args={optim_args}" for label, optim_args in VARIANTS.items())
    text = (
        table(plans)
        + "\n\nFull-rank methods that fit, smallest peak first:\n\n"
        + summary(plans)
        + "\n"
        + legend
        + "\n"
    )
    (args.out / "which.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
