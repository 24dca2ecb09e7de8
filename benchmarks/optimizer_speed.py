"""One AdamW step over one fp32 parameter, for every state format, side by side in one process.

    python benchmarks/optimizer_speed.py --out outputs/optimizer_speed            # 1M, 16M, 64M values
    python benchmarks/optimizer_speed.py --quick --out outputs/optimizer_speed    # 256K values, for CI

Rows: torch.optim.AdamW fused and foreach (fp32 state), ours with fp32 state, 8-bit state and 8-bit
state with error feedback (hf_galore_plugin.optim.AdamW), bitsandbytes' AdamW8bit (its CPU backend,
when importable), and, at sizes up to --eager-max values, our 8-bit step with compilation off
(HF_GALORE_COMPILE=0, the eager torch twin). Every optimizer owns an identically initialised
parameter and sees the same gradient; after --warmup steps (compilation happens there), the
optimizers step in rounds whose order rotates, so a busy machine slows all of them alike; the median
of --repeats steps is reported. Threads: --threads (default 2, the project's CPU machine).

GB/s counts the bytes a step must move at least: read parameter, gradient and state, write
parameter and state (fp32 state 28 B per value; 8-bit 16 B + 16 B per block; with error feedback
20 B + 32 B per block). Writes OUT/optimizer_speed.md and OUT/optimizer_speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hf_galore_plugin.optim import adamw8bit  # noqa: E402
from hf_galore_plugin.optim import AdamW  # noqa: E402

BLOCK = 256
FULL_SIZES = (1 << 20, 1 << 24, 1 << 26)
QUICK_SIZES = (1 << 18,)


def bytes_per_step(method: str, n: int) -> int:
    blocks = -(-n // BLOCK)
    if method in ("ours_8bit", "ours_8bit_eager", "bnb_adamw8bit"):
        return 16 * n + 16 * blocks  # p r/w 8, g 4, two 1-byte codes r/w 4; two fp32 scales r/w
    if method == "ours_8bit_ef":
        return 20 * n + 32 * blocks  # + two 1-byte residual codes r/w, two more scales
    return 28 * n  # p r/w 8, g 4, two fp32 moments r/w 16


LABELS = {
    "torch_fused": "`torch.optim.AdamW(fused=True)`",
    "torch_foreach": "`torch.optim.AdamW(foreach=True)`",
    "ours_fp32": "ours, fp32 state",
    "ours_8bit": "ours, 8-bit state",
    "ours_8bit_ef": "ours, 8-bit state + error feedback",
    "ours_8bit_eager": "ours, 8-bit state, eager twin (`HF_GALORE_COMPILE=0`)",
    "bnb_adamw8bit": "bitsandbytes `AdamW8bit` (CPU backend)",
}


def make_optimizer(method: str, param: torch.nn.Parameter):
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if method == "torch_fused":
        return torch.optim.AdamW([param], **hyper, fused=True)
    if method == "torch_foreach":
        return torch.optim.AdamW([param], **hyper, foreach=True)
    if method == "ours_fp32":
        return AdamW([param], **hyper)
    if method in ("ours_8bit", "ours_8bit_eager"):
        return AdamW([param], **hyper, state_bits=8, block_size=BLOCK)
    if method == "ours_8bit_ef":
        return AdamW([param], **hyper, state_bits=8, block_size=BLOCK, error_feedback=True)
    if method == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit([param], **hyper)
    raise ValueError(f"unknown method {method!r}")


@contextlib.contextmanager
def compile_off(method: str):
    if method != "ours_8bit_eager":
        yield
        return
    previous = os.environ.get("HF_GALORE_COMPILE")
    os.environ["HF_GALORE_COMPILE"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_GALORE_COMPILE"]
        else:
            os.environ["HF_GALORE_COMPILE"] = previous


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # ImportError or a broken native library: the row is left out and said so
        return False
    return True


def measure(n: int, methods: list[str], *, warmup: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 1e-2 for _ in range(2)]
    runners = []
    for method in methods:
        param = torch.nn.Parameter(start.clone())
        runners.append({"method": method, "param": param, "opt": make_optimizer(method, param), "times": []})
    total = warmup + repeats
    for step in range(total):
        order = runners[step % len(runners) :] + runners[: step % len(runners)]
        for r in order:
            r["param"].grad = grads[step % 2]
            with compile_off(r["method"]):
                t0 = time.perf_counter()
                r["opt"].step()
                elapsed = time.perf_counter() - t0
            if step >= warmup:
                r["times"].append(elapsed)
    fused = next(r for r in runners if r["method"] == "torch_fused")
    fused_s = statistics.median(fused["times"])
    rows = []
    for r in runners:
        seconds = statistics.median(r["times"])
        moved = bytes_per_step(r["method"], n)
        diff = (r["param"].detach() - fused["param"].detach()).abs().max().item()
        rows.append({
            "method": r["method"], "numel": n, "steps": total, "seconds": seconds, "bytes": moved,
            "gb_per_s": moved / seconds / 1e9, "vs_fused": seconds / fused_s,
            "max_abs_diff_vs_fused": diff, "bit_identical_to_fused": bool(torch.equal(r["param"], fused["param"])),
            "param_sha1": hashlib.sha1(r["param"].detach().numpy().tobytes()).hexdigest(),
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| optimizer | values | step (median) | GB/s (min. bytes) | vs fused AdamW |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["seconds"] * 1e3
        step = f"{ms:.2f} ms" if ms < 10 else f"{ms:,.0f} ms"
        lines.append(
            f"| {LABELS[r['method']]} | {r['numel'] / 2**20:g}M | {step} | {r['gb_per_s']:.1f} | {r['vs_fused']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs/optimizer_speed"))
    parser.add_argument("--quick", action="store_true", help="one size of 256K values, 3 timed steps")
    parser.add_argument("--sizes", type=int, nargs="+", help="values per parameter (default 1M 16M 64M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (default 5, --quick 3)")
    parser.add_argument("--eager-max", type=int, default=1 << 20, help="largest size with the eager 8-bit row")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (3 if args.quick else 5)
    with_bnb = bnb_available()
    rows = []
    for n in sizes:
        methods = ["torch_fused", "torch_foreach", "ours_fp32", "ours_8bit", "ours_8bit_ef"]
        methods += ["bnb_adamw8bit"] if with_bnb else []
        methods += ["ours_8bit_eager"] if n <= args.eager_max else []
        rows += measure(n, methods, warmup=args.warmup, repeats=repeats)
        print(table([r for r in rows if r["numel"] == n]), flush=True)
    # Which 8-bit step ran: the C++ build first, the torch.compile'd twin where it cannot be built.
    if adamw8bit._cpp_extension is not None and adamw8bit._cpp_failure is None:
        backend = "cpp"
    elif adamw8bit._compiled_step_blocks is not None and adamw8bit._compile_failure is None:
        backend = "inductor"
    else:
        backend = "eager"
    meta = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": args.threads,
        "repeats": repeats, "warmup": args.warmup, "bitsandbytes": with_bnb,
        "eight_bit_backend": backend, "cpp_failure": adamw8bit._cpp_failure,
        "compile_failure": adamw8bit._compile_failure,
        "command": "python benchmarks/optimizer_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    note = "" if with_bnb else "\n\nbitsandbytes is not importable here: its row is left out."
    (args.out / "optimizer_speed.md").write_text(
        f"{meta['command']} ({meta['date']}, torch {meta['torch']}, {args.threads} threads, median of "
        f"{repeats} steps after {args.warmup} warm-up steps)\n\n{table(rows)}{note}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
