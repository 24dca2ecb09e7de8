"""Peak memory at large vocabularies (docs/benchmarks/memory.md, "Large vocabularies: the loss and the head"): the
planner's normal-step and refresh-step peaks of `qgalore_adamw_8bit` for Llama-3-8B (128k vocabulary) and
Qwen2.5-7B (152k) at seq 2048 and 4096, batch 1, gradient checkpointing, bf16, rank 256, NF4 W0, staggered
refresh, streaming sketches, then each loss/head option: the chunked loss, a GaLore output head, both,
Liger-Kernel's fused linear cross-entropy (`TrainingArguments(use_liger_kernel=True)`, planner flag
`--liger-kernel`) and, for comparison, offloaded optimizer state.

    python benchmarks/plan_vocab.py --out outputs/plan_vocab   # plan_vocab.json + plan_vocab.md

One `hf_galore_plugin.plan.estimate` call per (model, seq, option set); results are cached in the JSON
(delete it to re-run) and the table is rewritten after every call, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from hf_galore_plugin.plan import estimate  # noqa: E402

GB = 1e9
MODELS = ("llama-3-8b", "qwen2.5-7b")
SEQ_LENS = (2048, 4096)
METHOD = "qgalore_adamw_8bit"
BASE = "weight_storage=nf4,refresh_schedule=staggered,basis_method=sketch"
# A GaLore head: every decoder projection (what the default targets at these shapes) and lm_head.
HEAD = "target_modules=.*(_proj|lm_head)"
# (label, optim_args, Liger's fused linear cross-entropy)
OPTION_SETS = [
    ("nf4 + staggered + sketch", BASE, False),
    ("+ chunked loss", f"{BASE},chunked_loss=true", False),
    ("+ GaLore head", f"{BASE},{HEAD}", False),
    ("+ chunked loss + GaLore head", f"{BASE},chunked_loss=true,{HEAD}", False),
    ("+ Liger fused loss (plain head)", BASE, True),
    ("+ offload (no chunked loss)", f"{BASE},state_offload=cpu", False),
]


def table(results: dict) -> str:
    lines = [
        "| model (seq) | options | normal-step peak GB | refresh-step peak GB | run peak GB | of it: optimizer state GB "
        "| activations GB | other GB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = [f"{m}|{q}|{label}" for q in SEQ_LENS for m in MODELS for label, _, _ in OPTION_SETS]
    for key in sorted(results, key=lambda k: order.index(k) if k in order else len(order)):
        plan = results[key]
        model, seq, label = key.split("|")
        m = plan["methods"][METHOD]
        run = max(m["peak_bytes"], m["refresh_peak_bytes"])
        at = m["parts"] if m["peak_bytes"] >= m["refresh_peak_bytes"] else m["refresh_parts"]
        lines.append(
            f"| {model} ({seq}) | {label} | {m['peak_bytes'] / GB:.2f} | {m['refresh_peak_bytes'] / GB:.2f} | "
            f"{run / GB:.2f} | {at['optimizer_state'] / GB:.2f} | {at['activations'] / GB:.2f} | {at['other'] / GB:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", help="comma-separated model names to run")
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "plan_vocab.json"
    results = json.loads(cache.read_text()) if cache.exists() else {}
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for model in MODELS:
            if args.only and model not in args.only.split(","):
                continue
            for label, optim_args, liger in OPTION_SETS:
                key = f"{model}|{seq_len}|{label}"
                if key in results:
                    continue
                start = time.perf_counter()
                print(f"planning {model} seq {seq_len}, {label} ...", flush=True)
                plan = estimate(model=model, methods=[METHOD], seq_len=seq_len, batch_size=1, gradient_checkpointing=True,
                                dtype="bf16", rank=256, optim_args=optim_args, liger=liger)  # fmt: skip
                plan["seconds"] = round(time.perf_counter() - start, 1)
                results[key] = plan
                cache.write_text(json.dumps(results, indent=1))
                (args.out / "plan_vocab.md").write_text(table(results) + "\n")
                print(f"  {plan['seconds']} s", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
