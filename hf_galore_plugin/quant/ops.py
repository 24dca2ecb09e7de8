"""The blockwise quantization ops: custom ops `torch.ops.hf_galore.*` and their Python entry points.

Each op is registered with `torch.library` (namespace `hf_galore`) with one implementation for every
device, which runs the Triton launcher (`kernels.quant.*_triton`, imported only when it runs, so
importing `hf_galore_plugin.quant` never imports triton) where `utils.use_triton` says so (CUDA
tensors) and the torch twin (`quant.functional.*_torch`) otherwise, and a fake registration that
gives the output shapes and dtypes, so the ops trace under FakeTensorMode and torch.compile.
`hf_galore_plugin.utils.KERNEL_DISPATCH` holds the exceptions (twins on CUDA with
HF_GALORE_DISABLE_TRITON=1, kernels on CPU under TRITON_INTERPRET=1).

The entry points below validate their arguments, then call the op; they run under
`torch.no_grad()`: quantizing a parameter must not keep an autograd graph alive in its stored
scales. Optional outputs of the ops (zero points, scales that were given) are 0-element tensors
in the op schema and None (or the given tensors) at the entry points.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_galore_plugin.utils import KERNEL_DISPATCH, use_triton

from . import functional

__all__ = ["blockwise_stats", "quantize_blockwise", "dequantize_blockwise", "dequantize_stored"]


def _kernels():
    from hf_galore_plugin.kernels import quant as kernels

    return kernels


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32) if t is None else t


# ---------------------------------------------------------------- blockwise_stats
@torch.library.custom_op("hf_galore::blockwise_stats", mutates_args=())
def _blockwise_stats_op(x: torch.Tensor, scheme: str, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zero points or a 0-element tensor)."""
    stats = _kernels().blockwise_stats_triton if use_triton(x) else functional.blockwise_stats_torch
    scales, zero_points = stats(x, scheme=scheme, bits=bits, block_size=block_size)
    return scales, _or_empty(zero_points, scales)


@_blockwise_stats_op.register_fake
def _blockwise_stats_fake(x, scheme, bits, block_size):
    scales = x.new_empty(_num_blocks(x.numel(), block_size), dtype=torch.float32)
    return scales, scales.new_empty(scales.numel() if scheme == "asymmetric" else 0)


# ---------------------------------------------------------------- quantize_blockwise
@torch.library.custom_op("hf_galore::quantize_blockwise", mutates_args=())
def _quantize_blockwise_op(
    x: torch.Tensor,
    scheme: str,
    bits: int,
    block_size: int,
    randoms: torch.Tensor | None,
    scales: torch.Tensor | None,
    zero_points: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, zero points); scales and zero points are 0-element tensors where they were
    given (an output may not alias an input) or where the scheme has none."""
    quantize = _kernels().quantize_blockwise_triton if use_triton(x) else functional.quantize_blockwise_torch
    return _quantize_outputs(quantize, x, scheme, bits, block_size, randoms, scales, zero_points)


def _quantize_outputs(quantize, x, scheme, bits, block_size, randoms, scales, zero_points):
    codes, new_scales, new_zero_points = quantize(
        x, scheme=scheme, bits=bits, block_size=block_size, randoms=randoms, scales=scales, zero_points=zero_points
    )
    if scales is not None:
        return codes, codes.new_empty(0, dtype=torch.float32), codes.new_empty(0, dtype=torch.float32)
    return codes, new_scales, _or_empty(new_zero_points, new_scales)


@_quantize_blockwise_op.register_fake
def _quantize_blockwise_fake(x, scheme, bits, block_size, randoms, scales, zero_points):
    codes = x.new_empty(functional.packed_numel(x.numel(), bits), dtype=functional.code_dtype(scheme, bits))
    if scales is not None:
        return codes, x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=torch.float32)
    new_scales, new_zero_points = _blockwise_stats_fake(x, scheme, bits, block_size)
    return codes, new_scales, new_zero_points


# ---------------------------------------------------------------- dequantize_blockwise
@torch.library.custom_op("hf_galore::dequantize_blockwise", mutates_args=())
def _dequantize_blockwise_op(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    scheme: str,
    bits: int,
    block_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Flat tensor of `numel` values in `dtype`."""
    dequantize = _kernels().dequantize_blockwise_triton if use_triton(codes) else functional.dequantize_blockwise_torch
    return dequantize(
        codes, scales, zero_points, scheme=scheme, bits=bits, block_size=block_size, numel=numel, dtype=dtype
    )


@_dequantize_blockwise_op.register_fake
def _dequantize_blockwise_fake(codes, scales, zero_points, scheme, bits, block_size, numel, dtype):
    return codes.new_empty(numel, dtype=dtype)


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
    if KERNEL_DISPATCH.inline_twins:
        return functional.blockwise_stats_torch(x, scheme=scheme, bits=bits, block_size=block_size)
    scales, zero_points = torch.ops.hf_galore.blockwise_stats(x, scheme, bits, block_size)
    return scales, zero_points if scheme == "asymmetric" else None


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
    if KERNEL_DISPATCH.inline_twins:
        return functional.quantize_blockwise_torch(
            x, scheme=scheme, bits=bits, block_size=block_size, randoms=randoms, scales=scales, zero_points=zero_points
        )
    codes, new_scales, new_zero_points = torch.ops.hf_galore.quantize_blockwise(
        x, scheme, bits, block_size, randoms, scales, zero_points
    )
    if scales is not None:
        return codes, scales, zero_points
    return codes, new_scales, new_zero_points if scheme == "asymmetric" else None


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
    if KERNEL_DISPATCH.inline_twins:
        return functional.dequantize_blockwise_torch(
            codes, scales, zero_points, scheme=scheme, bits=bits, block_size=block_size, numel=numel, dtype=dtype
        )
    return torch.ops.hf_galore.dequantize_blockwise(codes, scales, zero_points, scheme, bits, block_size, numel, dtype)


def dequantize_stored(
    codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, **layout: Any
) -> torch.Tensor:
    """:func:`dequantize_blockwise` for tensors this package quantized itself (a layer's W0 and bases, read
    in every forward and backward); `layout` is its keyword arguments (scheme, bits, block_size, numel,
    dtype), forwarded as given. No argument checks, and in eager mode the implementation is called
    directly, without the custom op's Python dispatch (tens of microseconds a call, more than the CPU work
    of a small tensor). Compiled code traces the torch twin, which the compiler fuses into the ops around
    it (the op is opaque to it); other traced code (the planner's fake tensors) goes through the op, as it
    does through the checked entry point."""
    if torch.compiler.is_compiling():
        return functional.dequantize_blockwise_torch(codes, scales, zero_points, **layout)
    fake = is_fake(codes)
    if fake and not KERNEL_DISPATCH.inline_twins:
        return torch.ops.hf_galore.dequantize_blockwise(codes, scales, zero_points, **layout)
    if not fake and use_triton(codes):
        return _kernels().dequantize_blockwise_triton(codes, scales, zero_points, **layout)
    return functional.dequantize_blockwise_torch(codes, scales, zero_points, **layout)
