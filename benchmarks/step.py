"""Training-step time of the plugin's presets relative to torch AdamW, measured side by side.

    python benchmarks/step.py            # Llama ~60M (hidden 512, 8 layers, vocab 32000), 2 x 128 tokens
    python benchmarks/step.py --quick    # a small Llama, for CI (well under a minute)
    python benchmarks/step.py --speed-targets  # the step-time targets: hidden 1024, 4 layers, vocab 30000, 4 x 256
                                         # tokens, ranks 256/128/64 (hidden/4, /8, /16) vs fused AdamW, 2 threads
    python benchmarks/step.py ... --profile galore_adamw --measure-gap 1000
                                         # + a torch.profiler table of 2 ordinary steps of that method

One process holds the baseline model (torch AdamW) and, one rank at a time, three identically
initialised models with the presets at that rank; their steps run interleaved (the order rotates
every round), so a busy machine slows all of them alike, and each preset's ratio is to the baseline's
median over the same rounds. A step is forward + backward + optimizer.step() (+ after_step for ours)
+ zero_grad(). The models are built with a short measurement gap so that basis refreshes happen
inside the timed window; they are reported separately, and the amortised time per step at the
training gap (--gap, GaLore paper: 200) is median ordinary step + phases x (median refresh step -
median ordinary step) / gap, with `phases` the refresh steps per gap: under the default staggered
schedule each of them refreshes one phase of the layers (1 under refresh_schedule='aligned').
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

import hf_galore_plugin as hgp
from _models import SHAPES, build_llama, preset_names

REPO = pathlib.Path(__file__).resolve().parent.parent
OURS = preset_names()
SIZES = ("60m", "h1024", "quick")  # shapes of _models.SHAPES this benchmark runs


def refreshes(model: torch.nn.Module) -> int:
    return sum(int(b) for name, b in model.named_buffers() if name.endswith("galore_num_refreshes"))


class Runner:
    """One model and its optimizer; `step()` times one full training step."""

    def __init__(self, method: str, size: str, args: argparse.Namespace, rank: Optional[int] = None) -> None:
        self.method = method
        self.name = method if rank is None or method not in OURS else f"{method} (rank {rank})"
        rank = rank or args.rank
        self.model = build_llama(size, seed=0, device=args.device, dtype=args.dtype)
        if method == "adamw_torch":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        elif method == "adamw_fused":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        else:
            config = hgp.GaLoreConfig.preset(method, rank=rank, update_proj_gap=args.measure_gap)
            hgp.prepare_model(self.model, config)
            self.optimizer = hgp.create_optimizer(self.model, lr=1e-3)
        self.ordinary: list[float] = []
        self.refresh: list[float] = []

    @property
    def phases(self) -> int:
        """Refresh steps per gap (staggered phases): read after the first training step, which packs them."""
        phases = [int(layer.galore_phase) for _, layer in hgp.galore_layers(self.model)] if self.method in OURS else []
        return max(phases, default=0) + 1

    def step(self, tokens: torch.Tensor) -> tuple[float, bool]:
        before = refreshes(self.model)
        sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
        sync()
        started = time.perf_counter()
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        if self.method in OURS:
            hgp.after_step(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - started, refreshes(self.model) != before


def profile(runner: Runner, tokens: torch.Tensor, steps: int = 2) -> str:
    """torch.profiler table (top 25 ops by self CPU time) of `steps` steps of `runner`, saying how many refreshed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    refreshed = 0
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            refreshed += runner.step(tokens)[1]
    head = f"{steps} steps, {refreshed} with a basis refresh (raise --measure-gap to profile ordinary steps only)"
    return head + "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def run(args: argparse.Namespace, partial: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    size = args.size
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, SHAPES[size]["vocab_size"], (args.batch, args.seq_len), generator=generator).to(args.device)
        for _ in range(4)
    ]
    # One rank: rows keep the plain method names; several: "method (rank r)".
    several = len(args.ranks) > 1
    baseline = Runner(args.baseline, size, args)
    baseline.step(batches[0])  # AdamW's lazy state creation; not timed
    rows, profiles = {}, {}
    # One group per rank: the baseline (kept alive) and the three presets at that rank, stepped interleaved
    # with the order rotating every round. Each preset's ratio is to the baseline's median over the same
    # rounds; holding one rank's presets at a time keeps the peak memory at four models.
    for rank in args.ranks:
        baseline.ordinary = []
        runners = [baseline] + [Runner(m, size, args, rank if several else None) for m in OURS]
        for runner in runners[1:]:
            runner.step(batches[0])  # calibration step (first basis); not timed
        for round_index in range(args.steps):
            shift = round_index % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                seconds, refreshed = runner.step(batches[round_index % len(batches)])
                (runner.refresh if refreshed else runner.ordinary).append(seconds)
        reference = median(baseline.ordinary)
        group_rows = {baseline.name: baseline.ordinary}
        for runner in runners[1:]:
            if runner.method == args.profile and rank == args.ranks[0]:
                profiles[runner.name] = profile(runner, batches[0])
            rows[runner.name] = summary(runner.ordinary, runner.refresh, reference, args.gap, runner.phases)
        rows.setdefault(baseline.name, {"samples": []})["samples"] += group_rows[baseline.name]
        del runners
        gc.collect()
        if partial is not None:  # a long run leaves the finished rank groups behind if it is stopped
            samples = rows[baseline.name]["samples"]
            done = {baseline.name: summary(samples, [], median(samples), args.gap)}
            done.update((name, row) for name, row in rows.items() if name != baseline.name)
            partial(result(args, done, profiles))
    if args.profile == baseline.method:
        profiles[baseline.name] = profile(baseline, batches[0])
    # The baseline's row pools its steps of every group; each preset row names its own group's median.
    samples = rows.pop(baseline.name)["samples"]
    rows = {baseline.name: summary(samples, [], median(samples), args.gap), **rows}
    del baseline
    gc.collect()
    return result(args, rows, profiles)


def result(args: argparse.Namespace, rows: dict[str, Any], profiles: dict[str, str]) -> dict[str, Any]:
    return {
        "size": args.size,
        "config": SHAPES[args.size],
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rank": args.rank,
        "ranks": args.ranks,
        "baseline": args.baseline,
        "profiles": profiles,
        "measure_gap": args.measure_gap,
        "gap": args.gap,
        "rounds": args.steps,
        "device": str(args.device),
        "dtype": str(args.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def summary(ordinary: list[float], refresh: list[float], reference: float, gap: int, phases: int = 1) -> dict[str, Any]:
    """One row: the median and spread of the ordinary steps, the refresh steps apart, ratios to `reference`.
    `phases` refresh steps fall in every gap (staggered schedule), each costing the median refresh step."""
    if not ordinary:
        raise SystemExit(
            f"every timed step refreshed a basis ({phases} staggered phases): raise --measure-gap above the "
            "phases and --steps so that ordinary steps are timed too"
        )
    middle, refresh_middle = median(ordinary), median(refresh)
    amortized = middle + (phases * (refresh_middle - middle) / gap if refresh_middle is not None else 0.0)
    return {
        "median_step_s": middle,
        "min_step_s": min(ordinary),
        "max_step_s": max(ordinary),
        "ordinary_steps": len(ordinary),
        "step_samples_s": list(ordinary),
        "median_refresh_step_s": refresh_middle,
        "refresh_steps": len(refresh),
        "baseline_step_s": reference,
        "amortized_step_s": amortized,
        "ratio_vs_adamw": middle / reference,
        "amortized_ratio_vs_adamw": amortized / reference,
        "phases": phases,
    }


def report(result: dict[str, Any]) -> str:
    ranks = ", ".join(str(r) for r in result["ranks"])
    baseline = result["baseline"]
    lines = [
        f"# Training-step time vs torch AdamW ({baseline})",
        "",
        f"Llama {result['size']} {result['config']}, batch {result['batch']} x {result['seq_len']} tokens, "
        f"rank {ranks}, {result['dtype']} on {result['device']} ({result['threads']} threads); "
        f"{result['rounds']} interleaved rounds per rank after one untimed step, refresh gap while measuring "
        f"{result['measure_gap']}.",
        "",
        f"Normal step: median of the steps without a basis refresh (min-max, count); ratio: to {baseline}'s "
        "median over the same rounds. Refresh steps are reported apart and left out of the normal-step median.",
        "",
        f"| method | normal step ms (min-max, n) | {baseline} ms, same rounds | ratio vs {baseline} "
        f"| refresh step ms (n) | amortised ms at gap {result['gap']} | amortised ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, row in result["rows"].items():
        refresh = f"{row['median_refresh_step_s'] * 1e3:.0f} ({row['refresh_steps']})" if row["refresh_steps"] else "-"
        lines.append(
            f"| {method} | {row['median_step_s'] * 1e3:.0f} ({row['min_step_s'] * 1e3:.0f}-"
            f"{row['max_step_s'] * 1e3:.0f}, {row['ordinary_steps']}) | {row['baseline_step_s'] * 1e3:.0f} | "
            f"{row['ratio_vs_adamw']:.2f}x | {refresh} | {row['amortized_step_s'] * 1e3:.0f} | "
            f"{row['amortized_ratio_vs_adamw']:.2f}x |"
        )
    for name, table in result.get("profiles", {}).items():
        lines += ["", f"Profile of {name} (top ops by self CPU time):", "", "```", table, "```"]
    lines += ["", __doc__.split("\n\n", 2)[2].strip()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small Llama, 2 x 64 tokens (CI smoke run)")
    parser.add_argument(
        "--speed-targets",
        action="store_true",
        help="the step-time targets' setting: --size h1024 --batch 4 --seq-len 256 --ranks 256 128 64 --baseline adamw_fused "
        "--threads 2 --steps 10 --measure-gap 5 (explicit options still win)",
    )
    parser.add_argument("--steps", type=int, default=12, help="timed rounds (one step of every method each)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 128; --quick: 64)")
    parser.add_argument("--rank", type=int, help="GaLore rank (default hidden/4: 128; --quick: 32)")
    parser.add_argument("--gap", type=int, default=200, help="training refresh gap the refresh cost is spread over")
    parser.add_argument(
        "--measure-gap", type=int, default=4, help="refresh gap while measuring, so refreshes fall in the window"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--size", choices=SIZES, help="model (default 60m; --quick: quick)")
    parser.add_argument("--ranks", type=int, nargs="+", help="GaLore ranks, each with all three presets")
    parser.add_argument("--baseline", choices=("adamw_torch", "adamw_fused"), default="adamw_torch",
                        help="reference optimizer: torch AdamW's default (foreach) or fused=True")  # fmt: skip
    parser.add_argument("--profile", choices=OURS + ("adamw_torch", "adamw_fused"),
                        help="profile this method (at the first of --ranks)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "outputs" / "benchmarks")
    args = parser.parse_args(argv)
    if args.speed_targets:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        if "--rank" in given:
            given.add("--ranks")
        for option, value in (("--size", "h1024"), ("--batch", 4), ("--seq-len", 256), ("--ranks", [256, 128, 64]),
                              ("--baseline", "adamw_fused"), ("--threads", 2), ("--steps", 10),
                              ("--measure-gap", 5)):  # fmt: skip
            if option not in given:
                setattr(args, option[2:].replace("-", "_"), value)
    size = args.size = args.size or ("quick" if args.quick else "60m")
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    args.rank = args.rank or SHAPES[size]["hidden_size"] // 4
    args.ranks = args.ranks or [args.rank]
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)

    def write(done: dict[str, Any]) -> str:
        text = report(done)
        (args.out / "step.md").write_text(text + "\n")
        (args.out / "step.json").write_text(json.dumps(done, indent=2))
        return text

    print(write(run(args, partial=write if len(args.ranks) > 1 else None)))
    print(f"\nwrote {args.out / 'step.md'}\nwrote {args.out / 'step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
