"""What one basis refresh costs at Llama-2-7B shapes, against the same layer's ordinary step.

    python benchmarks/refresh_cost.py                  # one 4096 x 11008 layer (down_proj), rank 256, 4 x 1024 tokens
    python benchmarks/refresh_cost.py --rank 1024      # the GaLore paper's 7B rank
    python benchmarks/refresh_cost.py --quick          # 64 x 176, 2 x 16 tokens (tests/test_benchmarks_cli.py)

One GaLore layer (``galore_adamw``: fp32 W0 and state, gap 200) per ``basis_method`` steps through
its calibration (step 0: a refresh of the layer, recording what the new basis needs in the backward
and computing it after the optimizer step) and one ordinary step. CPU time of the calling thread
(``time.thread_time``; torch on one thread, so every kernel, LAPACK's included, runs on it; the
process CPU time is printed next to it as a check), for:

- forward + backward: the ordinary step's (dX, dB; no weight-gradient GEMM), and the refresh step's
  extra (the dense fp32 gradient G = dy^T x, one m x n x N GEMM; or the streaming sketch: thin GEMMs);
- after_step: the basis (exact SVD of G; randomized range finder: 2 + 2 x power_iterations products
  with G, a QR each and an SVD of k x n; sketch: an SVD of the k x d sketch) plus the fold of the
  factor into W0 (m x n, the same in every method);
- the reference: the same weight as a dense ``nn.Linear`` (forward + backward with the weight gradient)
  and torch's fused AdamW step on it (what AdamW pays every step).

"amortized" spreads the refresh step's extra over the gap: (refresh step - ordinary step) / gap, as a
share of the ordinary step. Writes refresh_cost.json and refresh_cost.md to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hf_galore_plugin as hgp  # noqa: E402

METHODS = ("svd", "randomized", "sketch")


class Timer:
    """Thread and process CPU seconds and wall seconds of each call of `measure`."""

    def measure(self, fn: Callable[[], Any]) -> dict[str, float]:
        wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
        fn()
        return {
            "thread_s": time.thread_time() - thread,
            "process_s": time.process_time() - process,
            "wall_s": time.perf_counter() - wall,
        }


class OneLayer(nn.Module):
    """A single nn.Linear under a name the default targets select (not an output head)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq_len, args.in_features, generator=generator)
    dy = torch.randn(args.batch, args.seq_len, args.out_features, generator=generator) / args.out_features**0.5
    return x, dy


def dense_reference(args: argparse.Namespace, timer: Timer) -> dict[str, Any]:
    torch.manual_seed(0)
    model = OneLayer(args.out_features, args.in_features)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, dy = _inputs(args)
    x.requires_grad_(True)  # a layer inside a model also computes dX

    def forward_backward() -> None:
        model(x).backward(dy)

    rows = {"forward_backward": timer.measure(forward_backward)}
    optimizer.step()  # state created here; the timed step below is an ordinary one
    rows["adamw_step"] = timer.measure(optimizer.step)
    return rows


def galore_layer(args: argparse.Namespace, method: str, timer: Timer) -> dict[str, Any]:
    torch.manual_seed(0)
    model = OneLayer(args.out_features, args.in_features)
    config = hgp.GaLoreConfig.preset("galore_adamw", rank=args.rank, update_proj_gap=args.gap, basis_method=method)
    hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    layer = model.proj
    x, dy = _inputs(args)
    x.requires_grad_(True)
    steps = []
    for _ in range(2):  # step 0: calibration (a refresh of this layer); step 1: an ordinary step
        due = layer.refresh_due

        def forward_backward() -> None:
            model(x).backward(dy)

        row = {"refresh": due, "forward_backward": timer.measure(forward_backward)}
        row["optimizer_step"] = timer.measure(optimizer.step)
        row["after_step"] = timer.measure(lambda: hgp.after_step(model, optimizer))
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        steps.append(row)
    refresh, ordinary = steps
    assert refresh["refresh"] and not ordinary["refresh"], "step 0 must refresh and step 1 must not"
    # The fold (W0 += scale * lowrank(B), the same m x n work in every method) timed on its own, so the
    # basis computation is after_step minus it.
    from hf_galore_plugin.layers.refresh import fold_factor_into_base

    with torch.no_grad():  # as in a refresh (layers/refresh.py runs under no_grad)
        fold = timer.measure(lambda: fold_factor_into_base(layer, optimizer))
    return {"refresh_step": refresh, "ordinary_step": ordinary, "fold": fold}


def total(row: dict[str, Any], key: str = "thread_s") -> float:
    return sum(row[part][key] for part in ("forward_backward", "optimizer_step", "after_step"))


def report(result: dict[str, Any]) -> str:
    a = result["args"]
    dense = result["dense"]
    dense_fb = dense["forward_backward"]["thread_s"]
    lines = [
        f"# Refresh cost of one {a['out_features']} x {a['in_features']} layer (rank {a['rank']}, "
        f"{a['batch']} x {a['seq_len']} tokens, gap {a['gap']})",
        "",
        f"CPU seconds of the calling thread, torch on {result['threads']} thread(s) ({result['machine']}); "
        "in brackets the process CPU seconds (equal when everything ran on the one thread).",
        "",
        f"Dense nn.Linear, same weight: forward + backward {dense_fb:.2f} s "
        f"({dense['forward_backward']['process_s']:.2f}); fused AdamW step {dense['adamw_step']['thread_s']:.3f} s.",
        "",
        "| basis_method | ordinary step s (fwd+bwd) | refresh step s (process) | record: extra fwd+bwd s "
        "| basis s | fold s | refresh extra s | extra / dense fwd+bwd | amortized over the gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in result["methods"].items():
        o, r = row["ordinary_step"], row["refresh_step"]
        record = r["forward_backward"]["thread_s"] - o["forward_backward"]["thread_s"]
        fold = row["fold"]["thread_s"]
        basis = r["after_step"]["thread_s"] - fold
        extra = total(r) - total(o)
        lines.append(
            f"| {method} | {total(o):.2f} ({o['forward_backward']['thread_s']:.2f}) | {total(r):.2f} "
            f"({total(r, 'process_s'):.2f}) | {record:.2f} | {basis:.2f} | {fold:.2f} | {extra:.2f} "
            f"| {extra / dense_fb:.2f}x | {100 * extra / a['gap'] / total(o):.2f}% of an ordinary step |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-features", type=int, default=4096, help="m (Llama-2-7B down_proj: 4096)")
    parser.add_argument("--in-features", type=int, default=11008, help="n (Llama-2-7B down_proj: 11008)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--gap", type=int, default=200, help="update_proj_gap the refresh is amortized over")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated basis methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="64 x 176 layer, 2 x 16 tokens, rank 8")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "outputs" / "refresh_cost")
    args = parser.parse_args(argv)
    if args.quick:
        args.out_features, args.in_features, args.batch, args.seq_len, args.rank = 64, 176, 2, 16, 8
    torch.set_num_threads(args.threads)
    timer = Timer()
    import platform

    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "dense": dense_reference(args, timer),
        "methods": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for method in args.methods.split(","):
        print(f"{method} ...", flush=True)
        result["methods"][method] = galore_layer(args, method, timer)
        (args.out / "refresh_cost.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (args.out / "refresh_cost.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
