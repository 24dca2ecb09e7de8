"""The fixed cost of a training step: CPU time of one thread, dispatched aten ops and device syncs, per method.

    python benchmarks/step_overhead.py            # tiny Llama (hidden 64, 4 layers: 28 GaLore layers), 1 x 32 tokens
    python benchmarks/step_overhead.py --quick    # fewer rounds (CI smoke run)
    python benchmarks/step_overhead.py --size h1024 --rank 256 --batch 4 --seq-len 256 --threads 2
    python benchmarks/step_overhead.py --compile --gap 10  # each method eager and torch.compile(model)d from
                                                  # step 0 (refreshes every 10 steps), side by side
    python benchmarks/step_overhead.py --device cuda   # on a GPU: CPU time = the host work the GPU waits for
    python benchmarks/step_overhead.py --residual # each preset also with residual=True (Fira), side by side
    python benchmarks/step_overhead.py --autograd # each preset also with a plain W0 through autograd's ops at any size

At small shapes a step is dominated by per-op, per-layer host work (Python, the dispatcher, kernel
launches); on a GPU that host work is what the device waits for. Three measures that do not move with
the load of a shared machine:

- CPU time of the thread running the step (`time.thread_time`, torch on one thread by default), median
  over rounds in which every method runs one step, the order rotating every round, each method's ratio
  to fused AdamW over the same rounds;
- aten ops dispatched per step that do work (counted with a TorchDispatchMode; views and metadata ops,
  which launch nothing on a device, are not counted), in total and per GaLore layer beyond nn.Linear's;
- device syncs per step: ops that read a tensor's value to the host (`_local_scalar_dense`, `item`,
  `nonzero`, `is_nonzero`, `equal`).

Every step is an ordinary one (no basis refresh): the models are built with a refresh gap longer than
the run and stepped through their calibration before the timed rounds. With `--gap N` the layers refresh
every N steps during the rounds too, all on the same step (refresh_schedule='aligned': one record step per
gap, so the medians stay those of ordinary steps). With `--compile` every method also runs as `<method> compiled`: ``torch.compile(model)``
(inductor) before its first step, so calibration and refreshes run compiled, with the graphs and graph
breaks Dynamo compiled during its run (a model of the same structure as an earlier row reuses that row's
graphs; a recompile-limit hit is an error) and its ratio to its own eager row; the optimizer step and
after_step stay eager for every method alike. tests/test_compile.py counts a whole run's graphs alone.

Two reference rows, `floor_lowrank` and `floor_quantized` (benchmarks/_floor.py), are the least an eager
PyTorch GaLore layer can do per step, plain and with the qgalore preset's quantized storage (the tensor
work only, torch's fused AdamW): what a preset costs beyond them is its own overhead, and a target below
them is out of reach without fusing kernels or compiling.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = pathlib.Path(__file__).resolve().parent.parent
OURS = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")
# The least an eager layer of each kind can do per step (benchmarks/_floor.py): how far each preset is from it.
FLOORS = ("floor_lowrank", "floor_quantized")
METHODS = ("adamw_fused", "galore_torch", *OURS, *FLOORS)
# --residual: a row "<preset>+residual" after each preset's, the preset with GaLoreConfig.residual=True.
RESIDUAL = "+residual"
# --autograd: a row "<preset>+autograd" after each preset's, its plain-W0 layers through autograd's own ops at every
# size (hf_galore_plugin.layers.function.WRITTEN_OUT_MIN_VALUES raised past any call for that row's steps), so the
# one-node layer that larger calls take is compared with the derived backward side by side.
AUTOGRAD = "+autograd"
PHASES = ("forward", "backward", "optimizer", "after_step")
# --compile: a row "<method> compiled" after each method's, the same method through torch.compile(model).
COMPILED = " compiled"
# The tiny Llama of the overhead table: 4 decoder layers of 7 linear maps each.
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512)  # fmt: skip

SYNC_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal")
)
# Ops that only make or describe tensor metadata (no kernel on a device): not counted as work.
METADATA_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "sym_size", "sym_stride",
        "sym_numel", "sym_storage_offset", "is_same_size", "_unsafe_view", "_has_compatible_shallow_copy_type", "set_",
        "_to_copy_meta", "resize_", "_reshape_alias", "result_type",
    )
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


def _is_view(func: Any) -> bool:
    """An op whose outputs alias an input without writing it (view, reshape-as-view, transpose, ...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: `work` (not views, not metadata), `syncs` (host reads of
    device values, see SYNC_OPS) and `names` (a Counter of the counted ops' names)."""

    def __init__(self) -> None:
        super().__init__()
        self.work = 0
        self.syncs = 0
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            self.syncs += 1
        if packet not in METADATA_OPS and not _is_view(func):
            self.work += 1
            self.names[str(packet).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def build_model(size: dict[str, int], *, seed: int = 0) -> torch.nn.Module:
    from _models import build_llama

    return build_llama(size, seed=seed)


class Runner:
    """One model, its optimizer and one full training step (forward, backward, optimizer step, after_step
    for ours, zero_grad)."""

    def __init__(
        self, method: str, size: dict[str, int], rank: int, device: str = "cpu", *, gap: int = 10**6,
        compiled: bool = False,
    ) -> None:  # fmt: skip
        import hf_galore_plugin as hgp

        self.method = method + COMPILED if compiled else method
        self.graphs = self.breaks = 0  # Dynamo's, over this runner's steps (compiled runners)
        self.gap = gap
        residual = method.endswith(RESIDUAL)
        self.autograd = method.endswith(AUTOGRAD)
        for suffix, flag in ((RESIDUAL, residual), (AUTOGRAD, self.autograd)):
            if flag:
                method = method[: -len(suffix)]
                if method not in OURS:
                    raise ValueError(f"{method}{suffix}: a setting of {', '.join(OURS)}")
        self.model = build_model(size).to(device)
        self.after: Callable[[], None] = lambda: None
        params = list(self.model.parameters())
        if method == "adamw_fused":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
        elif method == "galore_torch":
            from galore_torch import GaLoreAdamW

            matrices = [m.weight for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)]
            matrices = [p for p in matrices if p is not self.model.lm_head.weight]
            ids = {id(p) for p in matrices}
            groups = [
                {"params": [p for p in params if id(p) not in ids]},
                {"params": matrices, "rank": rank, "update_proj_gap": gap, "scale": 0.25, "proj_type": "std"},
            ]
            self.optimizer = GaLoreAdamW(groups, lr=1e-3)
        elif method in FLOORS:
            from _floor import install

            install(self.model, rank=rank, scale=0.25, quantized=method == "floor_quantized")
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        elif method in OURS:
            # --gap: the aligned schedule, one record step per gap (staggered at this shape, the 28 layers' records
            # and kept inputs fill every step of a short gap, and no step would be an ordinary one)
            schedule = {"refresh_schedule": "aligned"} if gap < 10**6 else {}
            config = hgp.GaLoreConfig.preset(method, rank=rank, update_proj_gap=gap, residual=residual, **schedule)
            hgp.prepare_model(self.model, config)
            self.optimizer = hgp.create_optimizer(self.model, lr=1e-3)
            model, optimizer = self.model, self.optimizer
            self.after = lambda: hgp.after_step(model, optimizer)
        else:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        # Compiled before the first step (calibration and refreshes run compiled too).
        self.forward: Callable[..., Any] = torch.compile(self.model) if compiled else self.model
        self.compiled = compiled
        self.galore_layers = sum(type(m).__name__ in ("GaLoreLinear", "FloorLinear") for m in self.model.modules())
        self.linear_layers = sum(isinstance(m, torch.nn.Linear) for m in self.model.modules())

    def calibrate(self, tokens: torch.Tensor) -> None:
        """Step until every GaLore layer has its first basis and its optimizer state again: under the staggered
        default a layer calibrates at the step of its phase, so the counted and timed steps would otherwise
        include calibrations or the first step after one (which, with the residual, has no ratio to apply yet)."""
        from hf_galore_plugin.layers import GaLoreLinear

        layers = [m for m in self.model.modules() if isinstance(m, GaLoreLinear)]
        for _ in range(1000):
            # With a short --gap some layer may be due at every step: then calibrated is enough.
            if all(layer.calibrated and (self.gap < 10**6 or not layer.refresh_due) for layer in layers):
                # One more step: a calibration resets the factor's optimizer state, which the next step
                # allocates again (3 ops per layer of the last phase: not an ordinary step's cost).
                self.step(tokens)
                return
            self.step(tokens)
        raise RuntimeError(f"{self.method}: layers not calibrated after 1000 steps")

    def step(self, tokens: torch.Tensor) -> tuple[float, ...]:
        """One training step; returns the thread CPU time of its phases (forward, backward, optimizer step,
        after_step and zero_grad)."""
        if self.compiled:
            from torch._dynamo.utils import counters

            graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        from hf_galore_plugin.layers import function

        threshold = function.WRITTEN_OUT_MIN_VALUES
        if self.autograd:
            function.WRITTEN_OUT_MIN_VALUES = sys.maxsize
        try:
            t0 = time.thread_time()
            loss = self.forward(input_ids=tokens, labels=tokens).loss
            t1 = time.thread_time()
            loss.backward()
            t2 = time.thread_time()
        finally:
            function.WRITTEN_OUT_MIN_VALUES = threshold
        self.optimizer.step()
        t3 = time.thread_time()
        self.after()
        self.optimizer.zero_grad(set_to_none=True)
        phases = t1 - t0, t2 - t1, t3 - t2, time.thread_time() - t3
        if self.compiled:
            self.graphs += counters["stats"]["unique_graphs"] - graphs
            self.breaks += sum(counters["graph_break"].values()) - breaks
        return phases


def _quantized_w0(preset: str) -> bool:
    """Whether `preset` stores W0 quantized (its layers always take the one-node layer: no '+autograd' row)."""
    import hf_galore_plugin as hgp

    return hgp.GaLoreConfig.preset(preset).weight_storage != "as_loaded"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    size = dict(TINY)
    if args.size == "h1024":
        size = dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=16, vocab_size=30000)  # fmt: skip
    if args.vocab:
        size["vocab_size"] = args.vocab
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("step_overhead.py --device cuda: no CUDA device is visible to torch; use --device cpu")
    tokens = torch.randint(
        0, size["vocab_size"], (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)
    ).to(args.device)
    # On a GPU the thread's CPU time is the host work of the step (the kernels run asynchronously; a step
    # with no sync never waits for them); the wall time includes the device's work (synchronized after
    # each step, outside the CPU-time window).
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    methods = [
        m
        for method in args.methods
        for m in (
            (method, *(method + suffix for suffix, on in ((RESIDUAL, args.residual), (AUTOGRAD, args.autograd)) if on))
            if method in OURS
            else (method,)
        )
        if not (m.endswith(AUTOGRAD) and _quantized_w0(method))
    ]
    runners = [
        Runner(method, size, args.rank, args.device, gap=args.gap, compiled=compiled)
        for method in methods
        for compiled in ((False, True) if args.compile else (False,))
    ]
    for runner in runners:  # calibration (the first basis of every layer) and warm-up
        for _ in range(3):
            runner.step(tokens)
        runner.calibrate(tokens)
    counts = {}
    for runner in runners:
        if runner.compiled:
            continue  # compiled code runs inductor's kernels, not aten ops: ops and syncs are the eager row's
        with OpCount() as mode:
            runner.step(tokens)
        counts[runner.method] = mode
    times: dict[str, list[float]] = {r.method: [] for r in runners}
    wall: dict[str, list[float]] = {r.method: [] for r in runners}
    phases: dict[str, list[tuple[float, ...]]] = {r.method: [] for r in runners}
    for round_ in range(args.rounds):
        shift = round_ % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            synchronize()
            t0, w0 = time.thread_time(), time.perf_counter()
            phases[runner.method].append(runner.step(tokens))
            times[runner.method].append(time.thread_time() - t0)
            synchronize()
            wall[runner.method].append(time.perf_counter() - w0)
    base = runners[0].method
    rows = {}
    linear_work = None
    for runner in runners:
        mode = counts.get(runner.method)
        rows[runner.method] = {
            "cpu_ms": 1e3 * statistics.median(times[runner.method]),
            "wall_ms": 1e3 * statistics.median(wall[runner.method]),
            # median of each phase over the rounds (they need not add up to the step's median)
            "phases_ms": dict(zip(PHASES, (1e3 * statistics.median(c) for c in zip(*phases[runner.method])))),
            "ops": None if mode is None else mode.work,
            "syncs": None if mode is None else mode.syncs,
            "galore_layers": runner.galore_layers,
            "top_ops": None if mode is None else dict(mode.names.most_common(12)),
            # compiled runners: the graphs and breaks Dynamo compiled during their steps (Dynamo reuses a graph
            # for a model of the same structure: a later identical model adds none), and the ratio to the eager row
            "graphs": runner.graphs if runner.compiled else None,
            "graph_breaks": runner.breaks if runner.compiled else None,
        }
        if runner.method == base:
            linear_work = mode.work if mode is not None else None
    for method, row in rows.items():
        row["vs_base_cpu"] = row["cpu_ms"] / rows[base]["cpu_ms"]
        row["vs_base_wall"] = row["wall_ms"] / rows[base]["wall_ms"]
        eager = rows.get(method[: -len(COMPILED)]) if method.endswith(COMPILED) else None
        row["vs_eager_cpu"] = None if eager is None else row["cpu_ms"] / eager["cpu_ms"]
        layers = row["galore_layers"]
        usable = layers and row["ops"] is not None and linear_work is not None
        row["extra_ops_per_layer"] = (row["ops"] - linear_work) / layers if usable else None
    return {
        "size": size, "rank": args.rank, "batch": args.batch, "seq_len": args.seq_len, "threads": args.threads,
        "device": args.device,
        "rounds": args.rounds, "baseline": base, "torch": torch.__version__, "rows": rows,
        "compile": args.compile, "gap": args.gap,
    }  # fmt: skip


def report(result: dict[str, Any]) -> str:
    size = result["size"]
    lines = [
        f"hidden {size['hidden_size']}, {size['num_hidden_layers']} layers, vocab {size['vocab_size']}, rank "
        f"{result['rank']}, batch {result['batch']} x {result['seq_len']}, {result['threads']} thread(s), "
        f"{result['rounds']} interleaved rounds, {result['device']}, torch {result['torch']}; ratios to "
        f"{result['baseline']}",
    ]
    if result.get("gap", 10**6) < 10**6:
        lines.append(f"refresh gap {result['gap']}: rounds include refresh steps (the medians are ordinary steps')")
    compiled = result["compile"]
    if compiled:
        lines.append(
            f"`<method>{COMPILED}`: torch.compile(model) (inductor) before step 0; new graphs and breaks: Dynamo's, "
            "compiled during its run (a model of the same structure reuses the graphs an earlier row compiled); "
            "a recompile-limit hit would have stopped the run; ops and syncs: the eager row's"
        )
    more = " new graphs | graph breaks | vs own eager (CPU) |" if compiled else ""
    lines += [
        "",
        "| method | step, CPU ms | vs base (CPU) | vs base (wall) | aten ops / step | extra ops / GaLore layer "
        "| syncs / step |" + more,
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 if compiled else 0),
    ]
    for method, row in result["rows"].items():
        extra = "" if row["extra_ops_per_layer"] is None else f"{row['extra_ops_per_layer']:.1f}"
        cells = [
            f"`{method}`", f"{row['cpu_ms']:.1f}", f"{row['vs_base_cpu']:.2f}x", f"{row['vs_base_wall']:.2f}x",
            "" if row["ops"] is None else str(row["ops"]), extra, "" if row["syncs"] is None else str(row["syncs"]),
        ]  # fmt: skip
        if compiled:
            mine = row.get("vs_eager_cpu")
            cells += [
                "" if row.get("graphs") is None else str(row["graphs"]),
                "" if row.get("graph_breaks") is None else str(row["graph_breaks"]),
                "" if mine is None else f"{mine:.2f}x",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU ms of the thread by phase (median over the rounds; after_step includes zero_grad):",
        "",
        "| method | " + " | ".join(PHASES) + " |",
        "|---|" + "---:|" * len(PHASES),
    ]
    for method, row in result["rows"].items():
        lines.append(f"| `{method}` | " + " | ".join(f"{row['phases_ms'][p]:.2f}" for p in PHASES) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds (CI smoke run)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="methods, the first is the baseline of the ratios (default: all, fused AdamW first)")  # fmt: skip
    parser.add_argument("--size", choices=("tiny", "h1024"), default="tiny")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the size's)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the models run; on cuda the CPU time is the host work of a step")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--compile", action="store_true",
                        help="also run each method through torch.compile(model) (inductor) from its first step, "
                             "as '<method> compiled'")  # fmt: skip
    parser.add_argument("--gap", type=int, default=10**6,
                        help="update_proj_gap of every GaLore method (default: longer than the run, no refreshes)")  # fmt: skip
    parser.add_argument("--residual", action="store_true",
                        help="also run each of our presets with residual=True (Fira's residual), as '<preset>+residual'")  # fmt: skip
    parser.add_argument("--autograd", action="store_true",
                        help="also run each of our presets with a plain W0 through autograd's own ops at every size (not "
                             "the one-node layer of larger calls), as '<preset>+autograd'")  # fmt: skip
    parser.add_argument("--out", type=pathlib.Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 5
    if args.gap < 1:
        parser.error(f"--gap {args.gap}: a refresh gap is at least 1 step")
    # Compiled from step 0: hitting Dynamo's recompile limit (graphs multiplying per refresh phase) is an error,
    # not a silent fall back to eager frames.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        result = measure(args)
    text = report(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
