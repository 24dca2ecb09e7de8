"""One AdamW step over one fp32 parameter, and over a group of many small ones, for every state
format, side by side in one process.

    python benchmarks/optimizer_speed.py --out outputs/optimizer_speed    # 1M, 16M, 64M values; 1000 x 4K
    python benchmarks/optimizer_speed.py --quick --out outputs/optimizer_speed    # 256K; 64 x 4K, for CI

Rows: torch.optim.AdamW fused and foreach (fp32 state), ours with fp32 state, 8-bit state and 8-bit
state with error feedback (hf_galore_plugin.optim.AdamW), bitsandbytes' AdamW8bit (its CPU backend,
when importable), and, at sizes up to --eager-max values, our 8-bit step as torch operations (what runs
where the C++ step is not built). The C++ step is built (or its cached build loaded) before the runs.
Every optimizer owns an identically initialised parameter and sees the same gradient; after --warmup
steps, the
optimizers step in rounds whose order rotates, so a busy machine slows all of them alike; the median
of --repeats steps is reported. Threads: --threads (default 2, the project's CPU machine). The
group rows (--group COUNT VALUES: one parameter group of COUNT parameters of VALUES values each, a
model's norms, biases and small factors) show the per-parameter cost of each optimizer's step.

GB/s counts the bytes a step must move at least: read parameter, gradient and state, write
parameter and state (fp32 state 28 B per value; 8-bit 16 B + 16 B per block; with error feedback
20 B + 32 B per block). Writes OUT/optimizer_speed.md and OUT/optimizer_speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hf_galore_plugin.optim import AdamW, adamw8bit_cpu  # noqa: E402
from hf_galore_plugin.utils import KERNEL_DISPATCH  # noqa: E402

BLOCK = 256
FULL_SIZES = (1 << 20, 1 << 24, 1 << 26)
QUICK_SIZES = (1 << 18,)
FULL_GROUP, QUICK_GROUP = (1000, 4096), (64, 4096)


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
    "ours_8bit_eager": "ours, 8-bit state, torch step (no C++ build)",
    "bnb_adamw8bit": "bitsandbytes `AdamW8bit` (CPU backend)",
}


def make_optimizer(method: str, params: list[torch.nn.Parameter]):
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if method == "torch_fused":
        return torch.optim.AdamW(params, **hyper, fused=True)
    if method == "torch_foreach":
        return torch.optim.AdamW(params, **hyper, foreach=True)
    if method == "ours_fp32":
        return AdamW(params, **hyper)
    if method in ("ours_8bit", "ours_8bit_eager"):
        return AdamW(params, **hyper, state_bits=8, block_size=BLOCK)
    if method == "ours_8bit_ef":
        return AdamW(params, **hyper, state_bits=8, block_size=BLOCK, error_feedback=True)
    if method == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **hyper)
    raise ValueError(f"unknown method {method!r}")


@contextlib.contextmanager
def torch_step_only(method: str):
    """The 8-bit step as torch operations for the eager row (the route of a machine without the C++ build)."""
    if method != "ours_8bit_eager":
        yield
        return
    KERNEL_DISPATCH.inline_twins = True
    try:
        yield
    finally:
        KERNEL_DISPATCH.inline_twins = False


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # ImportError or a broken native library: the row is left out and said so
        return False
    return True


def measure(n: int, methods: list[str], *, warmup: int, repeats: int, count: int = 1) -> list[dict]:
    """Rows for `count` parameters of `n` values each, in one group per optimizer."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(count * n, generator=g)
    grads = [torch.randn(count * n, generator=g) * 1e-2 for _ in range(2)]
    runners = []
    for method in methods:
        params = [torch.nn.Parameter(part.clone()) for part in start.split(n)]
        param = torch.nn.Parameter(start.clone())  # the parameters' values, gathered after the steps
        runners.append({"method": method, "params": params, "param": param,
                        "opt": make_optimizer(method, params), "times": []})  # fmt: skip
    total = warmup + repeats
    for step in range(total):
        order = runners[step % len(runners) :] + runners[: step % len(runners)]
        for r in order:
            for p, grad in zip(r["params"], grads[step % 2].split(n)):
                p.grad = grad
            with torch_step_only(r["method"]):
                t0 = time.perf_counter()
                r["opt"].step()
                elapsed = time.perf_counter() - t0
            if step >= warmup:
                r["times"].append(elapsed)
    for r in runners:
        with torch.no_grad():
            r["param"].copy_(torch.cat([p.detach() for p in r["params"]]))
    fused = next(r for r in runners if r["method"] == "torch_fused")
    fused_s = statistics.median(fused["times"])
    rows = []
    for r in runners:
        seconds = statistics.median(r["times"])
        moved = count * bytes_per_step(r["method"], n)
        diff = (r["param"].detach() - fused["param"].detach()).abs().max().item()
        rows.append({
            "method": r["method"], "numel": n, "tensors": count, "steps": total, "seconds": seconds, "bytes": moved,
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
        count = r.get("tensors", 1)
        values = f"{r['numel'] / 2**20:g}M" if count == 1 else f"{count} x {r['numel'] / 2**10:g}K"
        lines.append(f"| {LABELS[r['method']]} | {values} | {step} | {r['gb_per_s']:.1f} | {r['vs_fused']:.2f}x |")
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
    parser.add_argument(
        "--group", type=int, nargs=2, metavar=("COUNT", "VALUES"),
        help="the group rows' parameter count and values per parameter (default 1000 4096; --quick 64 4096;"
        " 0 0 leaves them out)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        adamw8bit_cpu.build()
        cpp_failure = None
    except Exception as error:  # no compiler: the 8-bit rows run the torch step, and the record says so
        cpp_failure = f"{type(error).__name__}: {error}".splitlines()[0]
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (3 if args.quick else 5)
    with_bnb = bnb_available()
    count, values = args.group or (QUICK_GROUP if args.quick else FULL_GROUP)
    if count < 0 or values < 0 or (count == 0) != (values == 0):
        parser.error(f"--group {count} {values}: give a positive count and size, or 0 0 for no group rows")
    rows = []
    for n, tensors in [(n, 1) for n in sizes] + ([(values, count)] if count else []):
        methods = ["torch_fused", "torch_foreach", "ours_fp32", "ours_8bit", "ours_8bit_ef"]
        methods += ["bnb_adamw8bit"] if with_bnb else []
        methods += ["ours_8bit_eager"] if n * tensors <= args.eager_max else []
        new_rows = measure(n, methods, warmup=args.warmup, repeats=repeats, count=tensors)
        rows += new_rows
        print(table(new_rows), flush=True)
    backend = "torch" if cpp_failure else "cpp"  # which 8-bit step the ours_8bit rows ran
    meta = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": args.threads,
        "repeats": repeats, "warmup": args.warmup, "bitsandbytes": with_bnb,
        "eight_bit_backend": backend, "cpp_failure": cpp_failure,
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
