"""Optimizer-step time of the plugin's presets relative to torch AdamW, measured side by side.

    python benchmarks/step.py            # Llama ~60M (hidden 512, 8 layers, vocab 32000), 2 x 128 tokens
    python benchmarks/step.py --quick    # a small Llama, for CI
    python benchmarks/step.py --size h1024 --batch 4 --seq-len 256 --ranks 256 128 64 --baseline adamw_fused
                                         # issue 13: hidden 1024, 4 layers, vocab 30000, ranks hidden/4, /8, /16
    python benchmarks/step.py ... --profile galore_adamw --measure-gap 1000
                                         # + a torch.profiler table of 2 ordinary steps of that method

One process holds four identically initialised models (torch AdamW and the three presets) and runs
their steps interleaved (the order rotates every round), so a busy machine slows all of them alike.
A step is forward + backward + optimizer.step() (+ after_step for ours) + zero_grad(). The models
are built with a short measurement gap so that basis refreshes happen inside the timed window; they
are reported separately, and the amortised time per step at the training gap (--gap, GaLore
paper: 200) is median ordinary step + (median refresh step - median ordinary step) / gap.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Optional

import torch

import hf_galore_plugin as hgp

REPO = pathlib.Path(__file__).resolve().parent.parent
OURS = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")
SIZES = {
    "60m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=32000),
    "h1024": dict(
        hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, num_attention_heads=16, vocab_size=30000
    ),
    "quick": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=2, vocab_size=2000),
}


def build(size: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def refreshes(model: torch.nn.Module) -> int:
    return sum(int(b) for name, b in model.named_buffers() if name.endswith("galore_num_refreshes"))


class Runner:
    """One model and its optimizer; `step()` times one full training step."""

    def __init__(self, method: str, size: str, args: argparse.Namespace, rank: Optional[int] = None) -> None:
        self.method = method
        self.name = method if rank is None or method not in OURS else f"{method} (rank {rank})"
        rank = rank or args.rank
        self.model = build(size, args.device, args.dtype)
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
    """torch.profiler table (top 25 ops by self CPU time) of `steps` ordinary steps of `runner`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step(tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = args.size
    runners = [Runner(args.baseline, size, args)]
    # One rank: rows keep the plain method names; several: "method (rank r)".
    several = len(args.ranks) > 1
    runners += [Runner(m, size, args, rank if several else None) for rank in args.ranks for m in OURS]
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, SIZES[size]["vocab_size"], (args.batch, args.seq_len), generator=generator).to(args.device)
        for _ in range(4)
    ]
    # Step 0: AdamW's lazy state creation and our calibration step (first basis); not timed.
    for runner in runners:
        runner.step(batches[0])
    for round_index in range(args.steps):
        shift = round_index % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            seconds, refreshed = runner.step(batches[round_index % len(batches)])
            (runner.refresh if refreshed else runner.ordinary).append(seconds)
    profiles = {}
    for runner in runners:
        if runner.method == args.profile:
            profiles[runner.name] = profile(runner, batches[0])
    reference = median(runners[0].ordinary)
    rows = {}
    for runner in runners:
        ordinary, refresh = median(runner.ordinary), median(runner.refresh)
        amortized = ordinary + ((refresh - ordinary) / args.gap if refresh is not None else 0.0)
        rows[runner.name] = {
            "median_step_s": ordinary,
            "ordinary_steps": len(runner.ordinary),
            "median_refresh_step_s": refresh,
            "refresh_steps": len(runner.refresh),
            "amortized_step_s": amortized,
            "ratio_vs_adamw": ordinary / reference,
            "amortized_ratio_vs_adamw": amortized / reference,
        }
    del runners
    gc.collect()
    return {
        "size": size,
        "config": SIZES[size],
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


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Optimizer-step time vs torch AdamW",
        "",
        f"Llama {result['size']} {result['config']}, batch {result['batch']} x {result['seq_len']} tokens, "
        f"rank {result['rank']}, {result['dtype']} on {result['device']} ({result['threads']} threads); "
        f"{result['rounds']} interleaved rounds after one untimed step.",
        "",
        f"Baseline: {result['baseline']}.",
        "",
        f"| method | median step ms | ratio vs AdamW | refresh step ms (n) | amortised ms at gap {result['gap']} "
        "| amortised ratio |",
        "|---|---|---|---|---|---|",
    ]
    for method, row in result["rows"].items():
        refresh = f"{row['median_refresh_step_s'] * 1e3:.0f} ({row['refresh_steps']})" if row["refresh_steps"] else "-"
        lines.append(
            f"| {method} | {row['median_step_s'] * 1e3:.0f} ({row['ordinary_steps']} steps) | "
            f"{row['ratio_vs_adamw']:.2f}x | {refresh} | {row['amortized_step_s'] * 1e3:.0f} | "
            f"{row['amortized_ratio_vs_adamw']:.2f}x |"
        )
    for name, table in result.get("profiles", {}).items():
        lines += ["", f"Profile of {name} (2 ordinary steps, top ops by self CPU time):", "", "```", table, "```"]
    lines += ["", __doc__.split("\n\n", 2)[2].strip()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small Llama, 2 x 64 tokens (CI smoke run)")
    parser.add_argument("--steps", type=int, default=12, help="timed rounds (one step of every method each)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 128; --quick: 64)")
    parser.add_argument("--rank", type=int, help="GaLore rank (default hidden/4: 128; --quick: 32)")
    parser.add_argument("--gap", type=int, default=200, help="training refresh gap the refresh cost is spread over")
    parser.add_argument(
        "--measure-gap", type=int, default=4, help="refresh gap while measuring, so refreshes fall in the window"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--size", choices=tuple(SIZES), help="model (default 60m; --quick: quick)")
    parser.add_argument("--ranks", type=int, nargs="+", help="GaLore ranks, each with all three presets")
    parser.add_argument("--baseline", choices=("adamw_torch", "adamw_fused"), default="adamw_torch",
                        help="reference optimizer: torch AdamW's default (foreach) or fused=True")  # fmt: skip
    parser.add_argument("--profile", choices=OURS + ("adamw_torch", "adamw_fused"), help="profile this method")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "outputs" / "benchmarks")
    args = parser.parse_args(argv)
    size = args.size = args.size or ("quick" if args.quick else "60m")
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    args.rank = args.rank or SIZES[size]["hidden_size"] // 4
    args.ranks = args.ranks or [args.rank]
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)

    result = run(args)
    text = report(result)
    print(text)
    (args.out / "step.md").write_text(text + "\n")
    (args.out / "step.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out / 'step.md'}\nwrote {args.out / 'step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
