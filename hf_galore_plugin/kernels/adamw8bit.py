"""Triton kernel of the fused 8-bit blockwise AdamW step and its launcher.

The math and the state layout are `hf_galore_plugin.optim.adamw8bit`'s (its torch step is this
kernel's test oracle); the code books, lookup tables and step scalars come from the caller,
so this module imports nothing of the package but triton and torch. Every product and sum is a
separate fp32 operation (launches turn off fused multiply-adds) and the square root is correctly
rounded (`sqrt_rn`), so the kernel reproduces the torch step bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["launch_adamw8bit_step"]

# Values per Triton program: ROWS = _TILE_VALUES // block_size blocks as one [ROWS, BLOCK] tile, so a
# 256-value block does not leave a GPU program 1 KB of work (and the interpreter runs few programs).
_TILE_VALUES = 2048


@triton.jit
def _load_moment(codes_ptr, scales_ptr, book_ptr, rows, row_mask, offsets, mask, SIGNED: tl.constexpr):
    index = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.int32)
    if SIGNED:
        index = index + 128
    scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
    return tl.load(book_ptr + index) * scale[:, None]


@triton.jit
def _store_moment(
    value, codes_ptr, scales_ptr, table_ptr, mid_ptr, rows, row_mask, offsets, mask, SIGNED: tl.constexpr,
    LOOKUP_SHIFT: tl.constexpr, LOOKUP_BASE: tl.constexpr, LOOKUP_BUCKETS: tl.constexpr,
):  # fmt: skip
    """Quantize each row (block) of the tile to the nearest code; returns (code-book index, row absmax).

    The caller dequantizes from these registers: reading the scale back from memory right after
    this store would race on a GPU (threads of one program are not ordered without a barrier)."""
    absmax = tl.max(tl.where(mask, tl.abs(value), 0.0), axis=1)
    normalized = tl.div_rn(value, tl.where(absmax > 0.0, absmax, 1.0)[:, None])
    # index = #(midpoints < normalized) from the bucket table (quant.dynamic.nearest_code_index).
    bits = normalized.to(tl.int32, bitcast=True)
    key = ((bits & 0x7FFFFFFF) >> LOOKUP_SHIFT) - LOOKUP_BASE
    key = tl.minimum(tl.maximum(key, 0), LOOKUP_BUCKETS - 1) + tl.where(bits < 0, LOOKUP_BUCKETS, 0)
    first = tl.load(table_ptr + key)
    index = first + (tl.load(mid_ptr + first) < normalized).to(tl.int32)
    if SIGNED:
        tl.store(codes_ptr + offsets, (index - 128).to(tl.int8), mask=mask)
    else:
        tl.store(codes_ptr + offsets, index.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + rows, absmax, mask=row_mask)
    return index, absmax


@triton.jit
def _adamw8bit_step_kernel(
    param_ptr,
    grad_ptr,
    m_codes_ptr,
    m_scales_ptr,
    v_codes_ptr,
    v_scales_ptr,
    mr_codes_ptr,
    mr_scales_ptr,
    vr_codes_ptr,
    vr_scales_ptr,
    signed_book_ptr,
    signed_table_ptr,
    signed_mid_ptr,
    unsigned_book_ptr,
    unsigned_table_ptr,
    unsigned_mid_ptr,
    n_elements,
    n_blocks,
    decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    sq_floor,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ERROR_FEEDBACK: tl.constexpr,
    LOOKUP_SHIFT: tl.constexpr,
    LOOKUP_BASE: tl.constexpr,
    LOOKUP_BUCKETS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_blocks
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK).to(tl.int64)[None, :]
    mask = offsets < n_elements

    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = _load_moment(m_codes_ptr, m_scales_ptr, signed_book_ptr, rows, row_mask, offsets, mask, True)
    v = _load_moment(v_codes_ptr, v_scales_ptr, unsigned_book_ptr, rows, row_mask, offsets, mask, False)
    if ERROR_FEEDBACK:
        m += _load_moment(mr_codes_ptr, mr_scales_ptr, signed_book_ptr, rows, row_mask, offsets, mask, True)
        v += _load_moment(vr_codes_ptr, vr_scales_ptr, signed_book_ptr, rows, row_mask, offsets, mask, True)
    v = tl.maximum(v, 0.0)
    m = tl.where(v > 0.0, m, 0.0)

    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    v = tl.maximum(v, sq_floor * (m * m))
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p * decay - step_size * tl.div_rn(m, denom)
    tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)

    m_index, m_absmax = _store_moment(
        m,
        m_codes_ptr,
        m_scales_ptr,
        signed_table_ptr,
        signed_mid_ptr,
        rows,
        row_mask,
        offsets,
        mask,
        True,
        LOOKUP_SHIFT,
        LOOKUP_BASE,
        LOOKUP_BUCKETS,
    )
    v_index, v_absmax = _store_moment(
        v,
        v_codes_ptr,
        v_scales_ptr,
        unsigned_table_ptr,
        unsigned_mid_ptr,
        rows,
        row_mask,
        offsets,
        mask,
        False,
        LOOKUP_SHIFT,
        LOOKUP_BASE,
        LOOKUP_BUCKETS,
    )
    if ERROR_FEEDBACK:
        m_stored = tl.load(signed_book_ptr + m_index) * m_absmax[:, None]
        v_stored = tl.load(unsigned_book_ptr + v_index) * v_absmax[:, None]
        _store_moment(
            m - m_stored, mr_codes_ptr, mr_scales_ptr, signed_table_ptr, signed_mid_ptr,
            rows, row_mask, offsets, mask, True, LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS,
        )  # fmt: skip
        _store_moment(
            v - v_stored, vr_codes_ptr, vr_scales_ptr, signed_table_ptr, signed_mid_ptr,
            rows, row_mask, offsets, mask, True, LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS,
        )  # fmt: skip


def launch_adamw8bit_step(
    tensors: Sequence[torch.Tensor],
    *,
    scalars: Sequence[float],
    tables: Sequence[torch.Tensor],
    lookup: tuple[int, int, int],
    block_size: int,
) -> None:
    """One 8-bit AdamW step in place, one program per `_TILE_VALUES // block_size` blocks.

    `tensors`: parameter, gradient and the parameter's 4 state tensors, or 8 with error feedback, in the
    order of `optim.adamw8bit.TENSOR_ARGS` (flat, as `optim.adamw8bit.adamw8bit_step_torch` takes them);
    `scalars`: the nine of `optim.adamw8bit.AdamW8bitHyper.scalars`, in the kernel's argument order;
    `tables`: (signed book, signed lookup table, signed padded midpoints, and the same three unsigned) on
    the parameter's device; `lookup`: (LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS) of `quant.dynamic`, which
    built the tables.
    """
    param = tensors[0]
    n = param.numel()
    if n == 0:
        return
    error_feedback = len(tensors) > 6
    # Without error feedback the residual pointers are never read (ERROR_FEEDBACK is constexpr
    # False); any valid tensor fills the argument slots.
    residuals = tensors[6:] if error_feedback else (tensors[2], tensors[3]) * 2
    n_blocks = triton.cdiv(n, block_size)
    rows = max(1, _TILE_VALUES // block_size)
    grid = (triton.cdiv(n_blocks, rows),)
    _adamw8bit_step_kernel[grid](
        *tensors[:6], *residuals, *tables, n, n_blocks, *scalars,
        BLOCK=block_size, ROWS=rows, ERROR_FEEDBACK=error_feedback,
        LOOKUP_SHIFT=lookup[0], LOOKUP_BASE=lookup[1], LOOKUP_BUCKETS=lookup[2],
        num_warps=8 if rows * block_size >= 2048 else 4,
        enable_fp_fusion=False,  # no fused multiply-adds: the torch step rounds every product and sum
    )  # fmt: skip
