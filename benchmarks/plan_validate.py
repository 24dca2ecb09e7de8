"""Planner validation (docs/benchmarks/planner-accuracy.md "Planner validation"): the planned peak of one training step vs the
real CPU step, for Llama-shaped models of about 5M, 30M, 100M and 350M parameters.

    python benchmarks/plan_validate.py --out outputs/plan_validate           # every size (CPU minutes)
    python benchmarks/plan_validate.py --quick                               # 5M only (the test runs this)

Per (model, dtype, method), three numbers:

- planned: ``scaled_trace`` under fake tensors (what ``python -m hf_galore_plugin.plan`` runs, including
  the extrapolation from 4 and 5 decoder layers when the model is deeper), device="cpu" semantics;
- measured live: the same steps on real tensors (``trace_method(..., fake=False)``), counted by the same
  accounting (tracker.LiveBytes);
- RSS delta: the process's resident-set high-water mark over the steps minus its resident set just before
  the first step (model built, prepared, optimizer made), an independent check that does not use the
  tracker's bookkeeping. Each real run is a fresh subprocess (nothing cached from an earlier run); the
  high-water mark is reset with /proc/self/clear_refs "5" and read from /proc/self/status VmHWM (the row
  says "clear_refs"); where the kernel refuses the reset, ru_maxrss is used and the row says "ru_maxrss"
  (then the delta is only meaningful when the step's peak exceeds everything before it). Each real run is
  repeated `--repeats` times: the spread of the RSS delta is its noise.

The RSS delta is compared with the live bytes the step adds (measured peak minus the live bytes at the
baseline), since the baseline already holds the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _models import llama_config, preset_names  # noqa: E402

# name: (shape in _models.SHAPES, batch); batch 2 for the two small ones, 1 for the large ones.
MODELS = {
    "5M": ("validate-5m", 2),
    "30M": ("validate-30m", 2),
    "100M": ("validate-100m", 1),
    "350M": ("validate-350m", 1),
}
METHODS = ("adamw_torch", *preset_names())
DTYPES = ("fp32", "bf16")
SEQ_LEN = 256
RANK = 64


def _config(name: str):
    return llama_config(MODELS[name][0])


def _settings(name: str, dtype: str):
    from hf_galore_plugin.plan.trace import DTYPES as TORCH_DTYPES, Settings

    return Settings(seq_len=SEQ_LEN, batch_size=MODELS[name][1], dtype=TORCH_DTYPES[dtype],
                    gradient_checkpointing=True, device="cpu", rank=RANK, lora_rank=8, optim_args={})  # fmt: skip


def _step_peak(trace) -> int:
    """The largest live bytes of any traced step (what one process's high-water mark covers)."""
    return max(trace.step_peak(i).peak_bytes for i in range(len(trace.steps)))


# ---------------------------------------------------------------------- the real run (one subprocess)
def _status_kb(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_hwm() -> bool:
    """Reset the resident-set high-water mark (Linux >= 4.0); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # The reset took effect when the mark is back at the current RSS. Both come from one read of the status file;
    # the kernel's RSS counters are per-CPU approximations (off by up to a few hundred KiB between two reads), so
    # the test allows 4 MiB, far below any peak this benchmark measures.
    fields = dict(
        line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmHWM"].split()[0]) <= int(fields["VmRSS"].split()[0]) + 4096


def worker(name: str, dtype: str, method: str) -> dict:
    """One real CPU run of `method` (steps as in the plan), with the live-bytes and RSS measurements."""
    import gc

    import torch

    import hf_galore_plugin.plan.trace as trace

    torch.set_num_threads(1)  # the machine is shared; one thread also keeps per-thread buffers out of RSS
    seen: dict = {}

    class Recording(trace.LiveBytes):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            seen["tracker"] = self

    original_setup = trace._setup

    def setup(method_name, model, settings):
        out = original_setup(method_name, model, settings)
        gc.collect()
        seen["base_live"] = seen["tracker"].total
        seen["hwm_reset"] = _reset_hwm()
        seen["base_rss_kb"] = _status_kb("VmRSS")
        seen["base_maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return out

    trace.LiveBytes = Recording
    trace._setup = setup
    start = time.perf_counter()
    real = trace.trace_method(_config(name), method, _settings(name, dtype), fake=False)
    seconds = time.perf_counter() - start
    if seen["hwm_reset"]:
        rss_delta = (_status_kb("VmHWM") - seen["base_rss_kb"]) * 1024
        how = "clear_refs"
    else:
        rss_delta = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - seen["base_rss_kb"]) * 1024
        how = "ru_maxrss"
    return {
        "measured_peak": _step_peak(real),
        "measured_normal": real.normal.peak_bytes,
        "measured_refresh": real.refresh.peak_bytes,
        "base_live": seen["base_live"],
        "rss_delta": rss_delta,
        "rss_method": how,
        "seconds": seconds,
    }


def _real_runs(name: str, dtype: str, method: str, repeats: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    runs = []
    for _ in range(repeats):
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", name, dtype, method],
            env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"real run {name} {dtype} {method} failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


# ---------------------------------------------------------------------- the table
def validate(models=("5M",), dtypes=DTYPES, methods=METHODS, repeats: int = 3) -> list[dict]:
    """One row per (model, dtype, method): planned vs measured live bytes vs RSS delta."""
    from hf_galore_plugin.plan.trace import scaled_trace

    rows = []
    for name in models:
        for dtype in dtypes:
            for method in methods:
                start = time.perf_counter()
                plan = scaled_trace(_config(name), method, _settings(name, dtype))
                plan_seconds = time.perf_counter() - start
                runs = _real_runs(name, dtype, method, repeats)
                first = runs[0]
                for key in ("measured_peak", "measured_normal", "measured_refresh", "base_live"):
                    values = {r[key] for r in runs}
                    if len(values) != 1:
                        raise RuntimeError(f"{name} {dtype} {method}: live bytes {key} differ between runs: {values}")
                step_live = first["measured_peak"] - first["base_live"]
                rss = [r["rss_delta"] for r in runs]
                rows.append({
                    "model": name, "params": _params(name), "dtype": dtype, "method": method,
                    "planned_peak": _step_peak(plan), "planned_normal": plan.normal.peak_bytes,
                    "planned_refresh": plan.refresh.peak_bytes,
                    "measured_peak": first["measured_peak"], "measured_normal": first["measured_normal"],
                    "measured_refresh": first["measured_refresh"], "base_live": first["base_live"],
                    "step_live": step_live, "rss_delta": rss, "rss_method": sorted({r["rss_method"] for r in runs}),
                    "plan_over_live": _step_peak(plan) / first["measured_peak"],
                    "rss_over_step_live": [r / step_live for r in rss],
                    "plan_seconds": plan_seconds, "real_seconds": [r["seconds"] for r in runs],
                })  # fmt: skip
                print(_row(rows[-1]), flush=True)
    return rows


def _params(name: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(name))
    return sum(p.numel() for p in model.parameters())


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


HEADER = ("| model | dtype | method | planned MiB | measured live MiB | plan / live | step adds (live) MiB "
          "| RSS delta MiB (min-max of runs) | RSS / step live (min-max) |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def _row(r: dict) -> str:
    rss, ratio = r["rss_delta"], r["rss_over_step_live"]
    return (f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['dtype']} | {r['method']} | {_mib(r['planned_peak'])} "
            f"| {_mib(r['measured_peak'])} | {r['plan_over_live']:.4f} | {_mib(r['step_live'])} "
            f"| {_mib(min(rss))}-{_mib(max(rss))} | {min(ratio):.2f}-{max(ratio):.2f} |")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5M only")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3, help="real runs per row (the RSS noise)")
    parser.add_argument("--out", default=None, help="folder for plan_validate.json and plan_validate.md")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "DTYPE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    models = ["5M"] if args.quick else args.models.split(",")
    for value, known, what in ((models, MODELS, "--models"), (args.dtypes.split(","), DTYPES, "--dtypes"),
                               (args.methods.split(","), METHODS, "--methods")):  # fmt: skip
        bad = [v for v in value if v not in known]
        if bad:
            parser.error(f"{what}: unknown {bad}; choose from {list(known)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    print(HEADER, flush=True)
    rows = validate(models, args.dtypes.split(","), args.methods.split(","), args.repeats)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan_validate.json").write_text(json.dumps(rows, indent=1))
        (out / "plan_validate.md").write_text(HEADER + "\n" + "\n".join(_row(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
