"""The blockwise ops, dispatched to the Triton kernel or to the torch twin.

`hf_galore_plugin.utils.use_triton` decides (CUDA tensors, or CPU under TRITON_INTERPRET=1);
the kernels module is imported only on that path, so importing `hf_galore_plugin.quant`
never imports triton. The ops run under `torch.no_grad()`: quantizing a parameter must not keep
an autograd graph alive in its stored scales.
"""

from __future__ import annotations

import torch

from hf_galore_plugin.utils import use_triton

from . import functional

__all__ = ["blockwise_stats", "quantize_blockwise", "dequantize_blockwise"]


def _implementation(name: str, tensor: torch.Tensor):
    if use_triton(tensor):
        from hf_galore_plugin.kernels import quant as kernels

        return getattr(kernels, f"{name}_triton")
    return getattr(functional, f"{name}_torch")


def _check_block_tensors(scales, zero_points, *, scheme, numel, block_size):
    num_blocks = -(-numel // block_size)
    if scales.numel() != num_blocks:
        raise ValueError(
            f"scales hold {scales.numel()} values but {numel} values in blocks of {block_size}"
            f" need {num_blocks} (one per block)"
        )
    if scheme == "asymmetric" and (zero_points is None or zero_points.numel() != num_blocks):
        raise ValueError(f"the asymmetric scheme needs zero_points with {num_blocks} values (one per block)")


@torch.no_grad()
def blockwise_stats(
    x: torch.Tensor, *, scheme: str, bits: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-block fp32 scales and zero points (see `functional.blockwise_stats_torch`)."""
    functional.check_float_tensor(x)
    functional.check_quant_args(scheme=scheme, bits=bits, block_size=block_size)
    return _implementation("blockwise_stats", x)(x, scheme=scheme, bits=bits, block_size=block_size)


@torch.no_grad()
def quantize_blockwise(
    x: torch.Tensor,
    *,
    scheme: str,
    bits: int,
    block_size: int,
    randoms: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    zero_points: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, zero points) of `x` (see `functional.quantize_blockwise_torch`)."""
    functional.check_float_tensor(x)
    functional.check_quant_args(scheme=scheme, bits=bits, block_size=block_size)
    if randoms is not None and (randoms.dtype != torch.float32 or randoms.numel() != x.numel()):
        raise ValueError(
            f"randoms must be float32 with one value per element of x ({x.numel()}), got"
            f" {randoms.dtype} with {randoms.numel()} values; make it with torch.rand(x.numel())"
        )
    if scales is not None:
        _check_block_tensors(scales, zero_points, scheme=scheme, numel=x.numel(), block_size=block_size)
    return _implementation("quantize_blockwise", x)(
        x,
        scheme=scheme,
        bits=bits,
        block_size=block_size,
        randoms=randoms,
        scales=scales,
        zero_points=zero_points,
    )


@torch.no_grad()
def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    *,
    scheme: str,
    bits: int,
    block_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Flat tensor of `numel` values in `dtype` (see `functional.dequantize_blockwise_torch`)."""
    functional.check_quant_args(scheme=scheme, bits=bits, block_size=block_size)
    expected = functional.packed_numel(numel, bits)
    if codes.numel() != expected:
        raise ValueError(
            f"codes hold {codes.numel()} elements but {numel} values at {bits} bits need"
            f" {expected}{' (two 4-bit codes per byte)' if bits == 4 else ''}"
        )
    _check_block_tensors(scales, zero_points, scheme=scheme, numel=numel, block_size=block_size)
    return _implementation("dequantize_blockwise", codes)(
        codes,
        scales,
        zero_points,
        scheme=scheme,
        bits=bits,
        block_size=block_size,
        numel=numel,
        dtype=dtype,
    )
