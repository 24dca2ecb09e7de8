"""The 8-bit AdamW step's CPU implementations side by side: per-step CPU time and first-step cost.

    python benchmarks/adamw8bit_cpu.py --out outputs/adamw8bit_cpu             # tiny Llama list + 4096 x 4096
    python benchmarks/adamw8bit_cpu.py --quick --out outputs/adamw8bit_cpu     # small list, no cold builds

Implementations, each stepping the same tensors through `optim.functional.adamw_steps_8bit` (the call
`AdamW` makes per group):
- torch: `adamw8bit_step_torch`, torch operations (`KERNEL_DISPATCH.inline_twins`);
- C++: `adamw8bit_cpu.cpp`, the whole list in one call (built ahead with `optim.build_cpu`);
- inductor: the torch step's block function through `torch.compile(dynamic=True)`, compiled here (the
  package does not ship this form; the row says what it would cost and give);
- Triton interpreter: the Triton kernel run by Triton's CPU interpreter (how the kernel tests run it),
  on lists up to --interpreter-max values.

Tensor lists: every tensor `AdamW` gives 8-bit state to in a `qgalore_adamw_8bit` Llama (--model, a
`_models.SHAPES` name, GaLore rank hidden / 4: embeddings, head and the GaLore factors; norms stay
fp32 below min_8bit_numel),
and one 4096 x 4096 parameter. Per-step time: `time.thread_time` of the calling thread with
torch.set_num_threads(1), median of --repeats rounds in which every implementation steps once, the order
rotating. First-step cost: the C++ build in a fresh TORCH_EXTENSIONS_DIR (a subprocess: wall time and its
CPU time) and the first compiled call in a fresh inductor cache (wall and CPU time of this process and its
compile workers); for torch and the interpreter, their first call. Writes OUT/adamw8bit_cpu.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

# Cold caches for the first-step costs, and the Triton kernels importable in the interpreter; both are
# read when torch / triton first need them, so they are set before anything imports them.
_CACHE = tempfile.mkdtemp(prefix="adamw8bit_cpu_bench_")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from hf_galore_plugin.optim import adamw8bit, adamw8bit_cpu  # noqa: E402
from hf_galore_plugin.optim.functional import adamw_steps_8bit  # noqa: E402
from hf_galore_plugin.utils import KERNEL_DISPATCH, is_triton_available  # noqa: E402

IMPLEMENTATIONS = ("torch", "cpp", "inductor", "triton_interpreter")
LABELS = {
    "torch": "torch ops (`adamw8bit_step_torch`)",
    "cpp": "C++ (`adamw8bit_cpu.cpp`, built ahead)",
    "inductor": "`torch.compile` (inductor) of the torch step",
    "triton_interpreter": "Triton kernel, interpreter",
}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (inductor's compile workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def llama_list(shape: str) -> tuple[list, list, list, list]:
    """(params, grads, states, steps) of every 8-bit parameter of a prepared `shape` Llama after one step."""
    import _models

    import hf_galore_plugin as hgp

    model = _models.build_llama(shape, seed=0)
    rank = model.config.hidden_size // 4  # the preset's 128 is above a tiny model's widths
    hgp.prepare_model(model, hgp.GaLoreConfig.preset("qgalore_adamw_8bit", rank=rank, update_proj_gap=10**6))
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
    optimizer.step()  # creates the state
    picked = [(p, s) for p, s in optimizer.state.items() if "exp_avg_codes" in s]
    return [p.detach() for p, _ in picked], [p.grad for p, _ in picked], [s for _, s in picked], [2] * len(picked)


def square_list(side: int) -> tuple[list, list, list, list]:
    generator = torch.Generator().manual_seed(1)
    param = torch.randn(side, side, generator=generator)
    blocks = -(-param.numel() // 256)
    state = {
        "exp_avg_codes": torch.zeros(side, side, dtype=torch.int8),
        "exp_avg_scales": torch.zeros(blocks),
        "exp_avg_sq_codes": torch.zeros(side, side, dtype=torch.uint8),
        "exp_avg_sq_scales": torch.zeros(blocks),
    }
    return [param], [torch.randn(side, side, generator=generator) * 1e-2], [state], [1]


class Runner:
    """Steps a list with one implementation (the dispatch setting and the torch step's block function)."""

    def __init__(self) -> None:
        self.eager_blocks = adamw8bit._step_blocks
        self.compiled_blocks = None

    def step(self, impl: str, lists: tuple[list, list, list, list]) -> None:
        params, grads, states, steps = lists
        KERNEL_DISPATCH.inline_twins = impl in ("torch", "inductor")
        KERNEL_DISPATCH.triton_on_cpu = impl == "triton_interpreter"
        if impl == "inductor":
            if self.compiled_blocks is None:
                # As the package compiled it before: one dynamic graph, no per-element index checks.
                self.compiled_blocks = torch.compile(
                    self.eager_blocks, dynamic=True, fullgraph=True, options={"assert_indirect_indexing": False}
                )
            adamw8bit._step_blocks = self.compiled_blocks
        try:
            hyper = adamw8bit.AdamW8bitHyper(
                lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, block_size=256
            )
            adamw_steps_8bit(params, grads, states, steps, hyper=hyper)
        finally:
            adamw8bit._step_blocks = self.eager_blocks
            KERNEL_DISPATCH.inline_twins = False
            KERNEL_DISPATCH.triton_on_cpu = False


def cold_build_seconds() -> tuple[float, float]:
    """(wall, CPU) seconds of `python -m hf_galore_plugin.optim.build_cpu` in a fresh extension folder."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.path.join(_CACHE, "torch_extensions")}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_galore_plugin.optim.build_cpu"], env=env, check=True, capture_output=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/adamw8bit_cpu")
    parser.add_argument("--quick", action="store_true", help="the tiny-h64 list and 1024 x 1024; no cold C++ build")
    parser.add_argument("--model", default=None, help="Llama shape of the list (default tiny-h128; --quick tiny-h64)")
    parser.add_argument("--side", type=int, default=None, help="side of the square parameter (default 4096)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; --quick 2)")
    parser.add_argument("--interpreter-max", type=int, default=1 << 20, help="largest list for the interpreter")
    parser.add_argument("--no-cold-build", action="store_true", help="skip the C++ build in a fresh folder")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or ("tiny-h64" if args.quick else "tiny-h128")
    side = args.side or (1024 if args.quick else 4096)
    repeats = args.repeats or (2 if args.quick else 5)
    cases = {f"{model} Llama, qgalore_adamw_8bit": llama_list(model), f"{side} x {side}": square_list(side)}
    sizes = {name: sum(p.numel() for p in lists[0]) for name, lists in cases.items()}
    counts = {name: len(lists[0]) for name, lists in cases.items()}

    first: dict[str, dict[str, float]] = {}
    if not (args.quick or args.no_cold_build):
        wall, cpu = cold_build_seconds()
        first["cpp"] = {"wall_s": wall, "cpu_s": cpu, "what": "build in a fresh folder"}
    adamw8bit_cpu.build()  # this machine's build (cached after its first time)
    adamw8bit_cpu._loaded, adamw8bit_cpu._looked_up = None, False
    load_start = time.perf_counter()
    if adamw8bit_cpu.load_built() is None:
        raise RuntimeError("the C++ step was built but does not load")
    load_s = time.perf_counter() - load_start
    first.setdefault("cpp", {"wall_s": load_s, "cpu_s": float("nan"), "what": "load of a cached build"})

    implementations = [i for i in IMPLEMENTATIONS if i != "triton_interpreter" or is_triton_available()]
    runner = Runner()
    smallest = min(cases, key=lambda name: sizes[name])
    for impl in implementations:  # first call on the smallest list: compiles, builds tables, JITs
        wall0, cpu0 = time.perf_counter(), _cpu_seconds()
        runner.step(impl, cases[smallest])
        entry = {"wall_s": time.perf_counter() - wall0, "cpu_s": _cpu_seconds() - cpu0, "what": "first call"}
        if impl == "inductor":
            # The other list's shapes recompile once more (dynamic shapes specialise 1-row tiles etc.).
            for name in cases:
                if name != smallest:
                    w, c = time.perf_counter(), _cpu_seconds()
                    runner.step(impl, cases[name])
                    entry["wall_s"] += time.perf_counter() - w
                    entry["cpu_s"] += _cpu_seconds() - c
            entry["what"] = "first calls: compile (fresh cache)"
        first.setdefault(impl, entry)

    times: dict[str, dict[str, list[float]]] = {name: {i: [] for i in implementations} for name in cases}
    for round_ in range(repeats):
        order = implementations[round_ % len(implementations) :] + implementations[: round_ % len(implementations)]
        for name, lists in cases.items():
            for impl in order:
                if impl == "triton_interpreter" and sizes[name] > args.interpreter_max:
                    continue
                start = time.thread_time()
                runner.step(impl, lists)
                times[name][impl].append(time.thread_time() - start)

    medians = {name: {i: statistics.median(t) if t else None for i, t in per.items()} for name, per in times.items()}
    header = "| implementation | " + " | ".join(f"{n} ({counts[n]} tensors, {sizes[n]:,} values)" for n in cases)
    lines = [
        f"{header} | first step |",
        "|---|" + "---:|" * (len(cases) + 1),
    ]
    for impl in implementations:
        cells = []
        for name in cases:
            value, cpp = medians[name][impl], medians[name]["cpp"]
            cells.append("not run" if value is None else f"{value * 1e3:,.1f} ms ({value / cpp:.1f}x C++)")
        f = first[impl]
        cost = f"{f['wall_s']:.1f} s wall" + ("" if f["cpu_s"] != f["cpu_s"] else f", {f['cpu_s']:.1f} s CPU")
        lines.append(f"| {LABELS[impl]} | " + " | ".join(cells) + f" | {cost} ({f['what']}) |")
    if first["cpp"]["what"] != "load of a cached build":
        lines.append(f"\nC++: a cached build loads in {load_s * 1e3:.1f} ms (what a training process pays).")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adamw8bit_cpu.md").write_text(table + "\n")
    record = {"medians_s": medians, "first_step": first, "sizes": sizes, "counts": counts, "repeats": repeats}
    (out / "adamw8bit_cpu.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
