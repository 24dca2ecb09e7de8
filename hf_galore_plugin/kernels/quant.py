"""Triton kernels of the blockwise quantization ops, with launchers that have the signatures of
their torch twins in `hf_galore_plugin.quant.functional` (`*_triton` <-> `*_torch`).

Each program handles `ROWS` consecutive quantization blocks as one [ROWS, BLOCK] tile (4096
values, 16 KB of fp32 per program), so a 64-value NF4 block does not leave a GPU program with
256 bytes of work, and the Triton interpreter runs few programs. 4-bit codes are produced and
consumed two per byte by loading the even and the odd elements of each block as two tiles.

The math mirrors the twin operation for operation (same fp32 expressions, same order, divisions
correctly rounded with `tl.div_rn` as torch's tensor division is), so the interpreter reproduces
the twin's codes exactly; launches turn off fused multiply-adds so compiled code rounds as the twin does.
Round-half-to-even is `(v + 1.5*2**23) - 1.5*2**23` (exact for |v| < 2**22; codes are < 256):
libdevice's rint has no interpreter implementation in Triton 3.9. Stochastic rounding reads
caller-made uniform randoms (see the twin's module docstring). Launchers skip empty inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codes import code_dtype, code_levels, grid_table, nibble_offset, packed_numel

__all__ = ["blockwise_stats_triton", "quantize_blockwise_triton", "dequantize_blockwise_triton"]

_SCHEME_IDS = {"symmetric": 0, "asymmetric": 1, "uniform": 2, "nf4": 3}
_TILE_VALUES = 4096
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23; a jit function reads only constexpr globals


@triton.jit
def _tile_offsets(pid, numel, num_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr, STRIDE: tl.constexpr):
    """Block ids of this program and the flat offsets of every STRIDE-th value of each block."""
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK // STRIDE).to(tl.int64)
    offsets = rows[:, None] * BLOCK + STRIDE * cols[None, :]
    return rows, rows < num_blocks, offsets, offsets < numel


@triton.jit
def _partial_stats(x, mask):
    """Per-row absmax, min, max over the finite masked values, and the count of non-finite ones."""
    finite = (x - x) == 0.0
    valid = mask & finite
    absmax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=1)
    low = tl.min(tl.where(valid, x, float("inf")), axis=1)
    high = tl.max(tl.where(valid, x, -float("inf")), axis=1)
    nonfinite = tl.sum((mask & ~finite).to(tl.int32), axis=1)
    return absmax, low, high, nonfinite


@triton.jit
def _finish_stats(absmax, low, high, nonfinite, levels, ASYMMETRIC: tl.constexpr):
    """(scale, zero point) per block; NaN scale for a block with a non-finite value."""
    bad = nonfinite > 0
    if ASYMMETRIC:
        scale = tl.div_rn(high - low, levels.to(tl.float32))
        # a block wider than the float32 range (same formulas as quant.functional)
        wide = tl.div_rn(high, levels.to(tl.float32)) - tl.div_rn(low, levels.to(tl.float32))
        scale = tl.where((scale - scale) == 0.0, scale, wide)
        zero = tl.where(bad, 0.0, low)
    else:
        scale = absmax
        zero = tl.zeros_like(absmax)
    return tl.where(bad, float("nan"), scale), zero


@triton.jit
def _multiplier(scale, levels, SCHEME: tl.constexpr):
    """Per-block factor taking a value to code units; 0 for a zero or NaN scale."""
    if SCHEME == 0:
        numerator = levels.to(tl.float32)
    elif SCHEME == 2:
        numerator = 0.5 * levels
    else:
        numerator = 1.0
    return tl.where(scale > 0.0, tl.div_rn(numerator + tl.zeros_like(scale), scale), 0.0)


@triton.jit
def _encode(x, u, mult, zero, table_ptr, levels, SCHEME: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Codes (int32, before the nibble offset) of a [ROWS, COLS] tile of fp32 values."""
    x = tl.where((x - x) == 0.0, x, 0.0)
    if SCHEME == 3:
        y = x * mult[:, None]
        code = tl.zeros(y.shape, dtype=tl.int32)
        if STOCHASTIC:
            for j in tl.static_range(1, 15):
                code += (y >= tl.load(table_ptr + j)).to(tl.int32)
            low = tl.load(table_ptr + code)
            high = tl.load(table_ptr + code + 1)
            code += (u < tl.div_rn(y - low, high - low)).to(tl.int32)
        else:
            for j in tl.static_range(16, 31):
                code += (y > tl.load(table_ptr + j)).to(tl.int32)
    else:
        if SCHEME == 0:
            v = x * mult[:, None]
        elif SCHEME == 1:
            v = (x - zero[:, None]) * mult[:, None]
            v = tl.where((v - v) == 0.0, v, x * mult[:, None] - zero[:, None] * mult[:, None])
        else:
            v = x * mult[:, None] + 0.5 * levels
        if STOCHASTIC:
            r = tl.floor(v + u)
        else:
            r = (v + _ROUND_MAGIC) - _ROUND_MAGIC
        if SCHEME == 0:
            r = tl.maximum(r, -levels)
        else:
            r = tl.maximum(r, 0.0)
        code = tl.minimum(r, levels).to(tl.int32)
    return code


@triton.jit
def _decode(code, scale, zero, table_ptr, levels, SCHEME: tl.constexpr):
    """fp32 values of a [ROWS, COLS] tile of int32 codes (nibble offset already removed)."""
    c = code.to(tl.float32)
    if SCHEME == 0:
        out = c * tl.div_rn(scale, levels.to(tl.float32))[:, None]
    elif SCHEME == 1:
        out = c * scale[:, None] + zero[:, None]
        half = (c * (scale * 0.5)[:, None] + (zero * 0.5)[:, None]) * 2.0
        out = tl.where(((out - out) == 0.0) | (scale != scale)[:, None], out, half)
    elif SCHEME == 2:
        out = (c * tl.div_rn(2.0, levels.to(tl.float32)) - 1.0) * scale[:, None]
    else:
        out = tl.load(table_ptr + code) * scale[:, None]
    return out


@triton.jit
def _blockwise_stats_kernel(
    x_ptr,
    scales_ptr,
    zeros_ptr,
    numel,
    num_blocks,
    levels,
    ASYMMETRIC: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows, row_mask, offsets, mask = _tile_offsets(pid, numel, num_blocks, BLOCK, ROWS, 1)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    absmax, low, high, nonfinite = _partial_stats(x, mask)
    scale, zero = _finish_stats(absmax, low, high, nonfinite, levels, ASYMMETRIC)
    tl.store(scales_ptr + rows, scale, mask=row_mask)
    if ASYMMETRIC:
        tl.store(zeros_ptr + rows, zero, mask=row_mask)


@triton.jit
def _quantize_blockwise_kernel(
    x_ptr,
    randoms_ptr,
    scales_in_ptr,
    zeros_in_ptr,
    table_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    numel,
    num_blocks,
    levels,
    nibble_offset,
    SCHEME: tl.constexpr,
    PACKED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALES_GIVEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows, row_mask, offs_a, mask_a = _tile_offsets(pid, numel, num_blocks, BLOCK, ROWS, 1 + PACKED)
    xa = tl.load(x_ptr + offs_a, mask=mask_a, other=0.0).to(tl.float32)
    if PACKED:
        offs_b = offs_a + 1
        mask_b = offs_b < numel
        xb = tl.load(x_ptr + offs_b, mask=mask_b, other=0.0).to(tl.float32)
    if SCALES_GIVEN:
        scale = tl.load(scales_in_ptr + rows, mask=row_mask, other=0.0)
        zero = tl.zeros_like(scale)
        if SCHEME == 1:
            zero = tl.load(zeros_in_ptr + rows, mask=row_mask, other=0.0)
    else:
        absmax, low, high, nonfinite = _partial_stats(xa, mask_a)
        if PACKED:
            absmax_b, low_b, high_b, nonfinite_b = _partial_stats(xb, mask_b)
            absmax = tl.maximum(absmax, absmax_b)
            low = tl.minimum(low, low_b)
            high = tl.maximum(high, high_b)
            nonfinite += nonfinite_b
        scale, zero = _finish_stats(absmax, low, high, nonfinite, levels, SCHEME == 1)
        tl.store(scales_ptr + rows, scale, mask=row_mask)
        if SCHEME == 1:
            tl.store(zeros_ptr + rows, zero, mask=row_mask)
    mult = _multiplier(scale, levels, SCHEME)
    ua = xa
    if STOCHASTIC:
        ua = tl.load(randoms_ptr + offs_a, mask=mask_a, other=0.0)
    code = _encode(xa, ua, mult, zero, table_ptr, levels, SCHEME, STOCHASTIC) + nibble_offset
    if PACKED:
        ub = xb
        if STOCHASTIC:
            ub = tl.load(randoms_ptr + offs_b, mask=mask_b, other=0.0)
        code_b = _encode(xb, ub, mult, zero, table_ptr, levels, SCHEME, STOCHASTIC) + nibble_offset
        code = code | (tl.where(mask_b, code_b, 0) << 4)
        tl.store(codes_ptr + offs_a // 2, code.to(tl.uint8), mask=mask_a)
    else:
        tl.store(codes_ptr + offs_a, code.to(codes_ptr.dtype.element_ty), mask=mask_a)


@triton.jit
def _dequantize_blockwise_kernel(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    table_ptr,
    out_ptr,
    numel,
    num_blocks,
    levels,
    nibble_offset,
    SCHEME: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows, row_mask, offs_a, mask_a = _tile_offsets(pid, numel, num_blocks, BLOCK, ROWS, 1 + PACKED)
    scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
    zero = tl.zeros_like(scale)
    if SCHEME == 1:
        zero = tl.load(zeros_ptr + rows, mask=row_mask, other=0.0)
    out_ty = out_ptr.dtype.element_ty
    if PACKED:
        byte = tl.load(codes_ptr + offs_a // 2, mask=mask_a, other=0).to(tl.int32)
        out_a = _decode((byte & 15) - nibble_offset, scale, zero, table_ptr, levels, SCHEME)
        out_b = _decode((byte >> 4) - nibble_offset, scale, zero, table_ptr, levels, SCHEME)
        tl.store(out_ptr + offs_a, out_a.to(out_ty), mask=mask_a)
        tl.store(out_ptr + offs_a + 1, out_b.to(out_ty), mask=(offs_a + 1) < numel)
    else:
        code = tl.load(codes_ptr + offs_a, mask=mask_a, other=0).to(tl.int32)
        out = _decode(code - nibble_offset, scale, zero, table_ptr, levels, SCHEME)
        tl.store(out_ptr + offs_a, out.to(out_ty), mask=mask_a)


def _launch_shape(numel: int, block_size: int) -> tuple[int, int, tuple[int]]:
    num_blocks = -(-numel // block_size)
    rows = max(1, _TILE_VALUES // block_size)
    return num_blocks, rows, (triton.cdiv(num_blocks, rows),)


def blockwise_stats_triton(
    x: torch.Tensor, *, scheme: str, bits: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of `blockwise_stats_torch`."""
    x = x.reshape(-1).contiguous()
    num_blocks, rows, grid = _launch_shape(x.numel(), block_size)
    scales = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
    zeros = torch.empty_like(scales) if scheme == "asymmetric" else None
    if num_blocks:
        _blockwise_stats_kernel[grid](
            x,
            scales,
            scales if zeros is None else zeros,
            x.numel(),
            num_blocks,
            code_levels(scheme, bits),
            ASYMMETRIC=scheme == "asymmetric",
            BLOCK=block_size,
            ROWS=rows,
            enable_fp_fusion=False,
        )
    return scales, zeros


def quantize_blockwise_triton(
    x: torch.Tensor,
    *,
    scheme: str,
    bits: int,
    block_size: int,
    randoms: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    zero_points: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of `quantize_blockwise_torch`."""
    x = x.reshape(-1).contiguous()
    numel = x.numel()
    num_blocks, rows, grid = _launch_shape(numel, block_size)
    codes = torch.empty(packed_numel(numel, bits), dtype=code_dtype(scheme, bits), device=x.device)
    scales_given = scales is not None
    if scales is None:
        scales = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
        zero_points = torch.empty_like(scales) if scheme == "asymmetric" else None
    if num_blocks:
        scales = scales.contiguous()
        zeros = scales if zero_points is None else zero_points.contiguous()
        _quantize_blockwise_kernel[grid](
            x,
            x if randoms is None else randoms.reshape(-1).contiguous(),
            scales,
            zeros,
            grid_table(x.device),
            codes,
            scales,
            zeros,
            numel,
            num_blocks,
            code_levels(scheme, bits),
            nibble_offset(scheme, bits),
            SCHEME=_SCHEME_IDS[scheme],
            PACKED=bits == 4,
            STOCHASTIC=randoms is not None,
            SCALES_GIVEN=scales_given,
            BLOCK=block_size,
            ROWS=rows,
            enable_fp_fusion=False,
        )
    return codes, scales, zero_points


def dequantize_blockwise_triton(
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
    """Triton twin of `dequantize_blockwise_torch`."""
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    num_blocks, rows, grid = _launch_shape(numel, block_size)
    if num_blocks:
        scales = scales.contiguous()
        _dequantize_blockwise_kernel[grid](
            codes.contiguous(),
            scales,
            scales if zero_points is None else zero_points.contiguous(),
            grid_table(codes.device),
            out,
            numel,
            num_blocks,
            code_levels(scheme, bits),
            nibble_offset(scheme, bits),
            SCHEME=_SCHEME_IDS[scheme],
            PACKED=bits == 4,
            BLOCK=block_size,
            ROWS=rows,
            enable_fp_fusion=False,
        )
    return out
