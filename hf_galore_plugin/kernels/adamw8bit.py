"""Fused 8-bit blockwise AdamW step: one Triton kernel and its torch twin.

State layout (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", ICLR):
each block of `block_size` consecutive values of a flat moment tensor is stored as 8-bit codes
plus one fp32 absmax scale; a code indexes a 256-entry code book of values in [-1, 1]
(first moment, signed, int8 codes) or [0, 1] (second moment, unsigned, uint8 codes).

Code book: dynamic ("tree") quantization, the paper's choice, built here from our own
construction. Value = 10**-e * f: a decade exponent e and a linear fraction f in (0.1, 1]
whose resolution shrinks as e grows (fewer fraction bits are left once the exponent's
indicator bits are spent). Unsigned: e = 0..7 with 128, 64, ..., 1 fraction levels (255
values + exact 0); signed: e = 0..6 with 64, ..., 1 levels per sign (127 + 127 + exact 0) and
the one spare code holding -1e-7. Each decade's top level is the next decade's bottom edge, so
the values are dense from 1e-7 (unsigned) / 1e-6 (signed) up to exactly 1.0 (the block's
absmax element is stored exactly).
Why not a linear map: Adam's second moment spans many decades inside one block (v ~ g**2;
gradients 100x apart give v 1e4 apart). A linear uint8 map rounds every v below absmax/510 to
0, and then m / (sqrt(v) + eps) becomes m / 1e-8 for those values. Measured on the 64x128
least-squares problem of tests/test_optim.py (500 steps, lr 1e-3 / 1e-2), replacing only the
second-moment map by a linear one gives 35% / 35% relative weight deviation from fp32 AdamW
(weights up to 10x larger than fp32's), the dynamic map 5.7% / 0.30%, bitsandbytes' AdamW8bit
5.7% / 0.59%.

Error feedback (optional): the quantization residual r = x - dequant(quant(x)) of each moment
is kept in 8 bits too (signed dynamic codes + its own fp32 block absmax) and added back when
the state is read next step. Both moments get one: with beta2 = 0.999 the second moment moves
0.1% a step, less than half a code step (0.35%..3.5% relative in the top decade), so without a
residual it sticks to its code and that, not the first moment, dominates the error. Same
problem, lr 1e-3: no feedback 5.7%, first-moment residual only 5.6%, second-moment only 0.62%,
both 0.03% deviation from fp32. Cost: 1 byte + 4/block_size per value per moment.

Nearest-code search is `index = #(midpoints < y)` over the 255 midpoints between neighbouring
code values; both the kernel (branchless binary search, 8 gathers) and the twin
(`torch.searchsorted`) compare the same fp32 midpoints, so they give identical codes except
where rounding of y itself differs.
"""

from __future__ import annotations

import functools

import torch

from hf_galore_plugin.utils import is_triton_available, use_triton

__all__ = [
    "dynamic_code_book",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_moment",
    "dequantize_moment",
    "adam_step_scalars",
    "adamw8bit_step_torch",
    "adamw8bit_step_triton",
    "adamw8bit_step",
]

CODE_BOOK_SIZE = 256
# int8 code c of the signed book is index c + 128, so code 0 is the exact zero.
_SIGNED_OFFSET = 128


@functools.lru_cache(maxsize=None)
def _dynamic_values(signed: bool) -> tuple[float, ...]:
    magnitude_bits = 6 if signed else 7  # one bit of the 8 goes to the sign when signed
    magnitudes = []
    for exponent in range(magnitude_bits + 1):
        levels = 2 ** (magnitude_bits - exponent)
        decade = 10.0**-exponent
        magnitudes += [decade * (0.1 + 0.9 * (j + 1) / levels) for j in range(levels)]
    values = [0.0] + magnitudes
    if signed:
        values += [-v for v in magnitudes] + [-1e-7]
    return tuple(sorted(values))


@functools.lru_cache(maxsize=None)
def _code_book_cached(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(_dynamic_values(signed), dtype=torch.float64)
    midpoints = (values[1:] + values[:-1]) * 0.5
    return values.to(torch.float32).to(device), midpoints.to(torch.float32).to(device)


def dynamic_code_book(*, signed: bool, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(values, midpoints): the 256 ascending fp32 code values and the 255 midpoints between them."""
    return _code_book_cached(signed, torch.device(device))


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """View `flat` as (n_blocks, block_size), zero-padding the last block (padding never wins absmax)."""
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def quantize_blockwise(
    values: torch.Tensor, *, signed: bool, block_size: int, codes_out: torch.Tensor, scales_out: torch.Tensor
) -> None:
    """Write the nearest-code quantization of flat fp32 `values` into `codes_out` and `scales_out`."""
    n = values.numel()
    _, midpoints = dynamic_code_book(signed=signed, device=values.device)
    blocks = _blocks(values.float(), block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    index = torch.searchsorted(midpoints, normalized.reshape(-1))[:n]
    if signed:
        codes_out.copy_((index - _SIGNED_OFFSET).to(torch.int8))
    else:
        codes_out.copy_(index.to(torch.uint8))
    scales_out.copy_(absmax.view(-1))


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """fp32 flat values of flat `codes` (int8: signed book, uint8: unsigned book) and block `scales`."""
    signed = codes.dtype == torch.int8
    book, _ = dynamic_code_book(signed=signed, device=codes.device)
    index = codes.long() + _SIGNED_OFFSET if signed else codes.long()
    n = codes.numel()
    values = book[index]
    pad = -n % block_size
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return (values.view(-1, block_size) * scales.view(-1, 1)).view(-1)[:n]


def adam_step_scalars(*, step: int, lr: float, beta1: float, beta2: float, weight_decay: float) -> dict[str, float]:
    """The per-step scalars of decoupled-weight-decay Adam, computed once in float64 on the host.

    Both implementations receive the same Python floats (rounded once to fp32 at the call), so
    bias correction agrees between kernel and twin at any step count.
    """
    return {
        "decay": 1.0 - lr * weight_decay,
        "beta1": beta1,
        "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "step_size": lr / (1.0 - beta1**step),
        "bias_correction2_sqrt": (1.0 - beta2**step) ** 0.5,
        "sq_floor": second_moment_floor(beta1=beta1, beta2=beta2),
    }


def second_moment_floor(*, beta1: float, beta2: float) -> float:
    """k such that exact Adam moments always satisfy v >= k * m^2 (0 when no such bound exists).

    With m = sum_i (1-b1) b1^(t-i) g_i and v = sum_i (1-b2) b2^(t-i) g_i^2, Cauchy-Schwarz gives
    m^2 <= C v with C = (1-b1)^2 / ((1-b2) (1 - b1^2/b2)) when b1^2 < b2 (C = 52.9 for 0.9/0.999).
    8-bit blockwise state can store a small v as 0 next to a large value in its block while the
    first moment survives (its code map reaches 1e-6 of the block's absmax, the second moment's 1e-7
    of a squared scale); m / (0 + eps) then moves a weight by ~1e4 x lr per step (measured: a weight
    seen once with g = 1e-4 next to one with g = 1 moved by 166 instead of 0.006 in 60 steps).
    Raising the stored v to k m^2 never changes an exact Adam step and bounds that one by sqrt(C);
    dropping the momentum of a coordinate whose stored v is 0 then stops it (the same weight moves
    by 0.0006 instead of 0.08 with the floor alone; bitsandbytes' AdamW8bit: 0.0006).
    """
    if beta1 * beta1 >= beta2 or beta1 >= 1.0:
        return 0.0
    return (1.0 - beta2) * (1.0 - beta1 * beta1 / beta2) / (1.0 - beta1) ** 2


def dequantize_moment(
    codes: torch.Tensor,
    scales: torch.Tensor,
    residual_codes: torch.Tensor | None,
    residual_scales: torch.Tensor | None,
    *,
    block_size: int,
) -> torch.Tensor:
    """fp32 flat moment from its codes, plus its error-feedback residual when one is kept."""
    value = dequantize_blockwise(codes, scales, block_size=block_size)
    if residual_codes is not None:
        value = value + dequantize_blockwise(residual_codes, residual_scales, block_size=block_size)
    return value


def quantize_moment(
    value: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    residual_codes: torch.Tensor | None,
    residual_scales: torch.Tensor | None,
    *,
    block_size: int,
) -> None:
    """Store flat fp32 `value` as codes + scales, and its quantization residual when one is kept."""
    signed = codes.dtype == torch.int8
    quantize_blockwise(value, signed=signed, block_size=block_size, codes_out=codes, scales_out=scales)
    if residual_codes is not None:
        residual = value - dequantize_blockwise(codes, scales, block_size=block_size)
        quantize_blockwise(
            residual, signed=True, block_size=block_size, codes_out=residual_codes, scales_out=residual_scales
        )


def adamw8bit_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    exp_avg_residual_codes: torch.Tensor | None,
    exp_avg_residual_scales: torch.Tensor | None,
    exp_avg_sq_residual_codes: torch.Tensor | None,
    exp_avg_sq_residual_scales: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    block_size: int,
) -> None:
    """One AdamW step on flat contiguous tensors with 8-bit blockwise moments, all in place.

    `param` (any float dtype) and `grad` are 1-D of n values; codes are int8 (first moment) /
    uint8 (second moment) of n values; scales are fp32 of ceil(n / block_size) blocks. The
    residual tensors are all None (no error feedback) or all given (int8 codes + fp32 scales).
    Math is fp32; the parameter is written back in its own dtype.
    """
    s = adam_step_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    g = grad.float()
    exp_avg = dequantize_moment(
        exp_avg_codes, exp_avg_scales, exp_avg_residual_codes, exp_avg_residual_scales, block_size=block_size
    )
    exp_avg_sq = dequantize_moment(
        exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
        block_size=block_size,
    )
    # A residual-corrected v can dip a hair below 0 where v itself is ~0; sqrt needs >= 0.
    exp_avg_sq = exp_avg_sq.clamp_min(0.0)
    # A second moment stored as 0 next to a first moment that is not: the coordinate's statistics fell
    # below the code map's resolution. Its momentum is dropped with it (see second_moment_floor).
    exp_avg = torch.where(exp_avg_sq > 0, exp_avg, 0.0)
    exp_avg = s["beta1"] * exp_avg + s["one_minus_beta1"] * g
    exp_avg_sq = s["beta2"] * exp_avg_sq + s["one_minus_beta2"] * (g * g)
    exp_avg_sq = torch.maximum(exp_avg_sq, s["sq_floor"] * (exp_avg * exp_avg))
    denom = exp_avg_sq.sqrt() / s["bias_correction2_sqrt"] + eps
    updated = param.float() * s["decay"] - s["step_size"] * (exp_avg / denom)
    param.copy_(updated)
    quantize_moment(
        exp_avg, exp_avg_codes, exp_avg_scales, exp_avg_residual_codes, exp_avg_residual_scales, block_size=block_size
    )
    quantize_moment(
        exp_avg_sq, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
        block_size=block_size,
    )


if is_triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_moment(codes_ptr, scales_ptr, book_ptr, block, offsets, mask, SIGNED: tl.constexpr):
        index = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.int32)
        if SIGNED:
            index = index + 128
        return tl.load(book_ptr + index) * tl.load(scales_ptr + block)

    @triton.jit
    def _store_moment(value, codes_ptr, scales_ptr, midpoints_ptr, block, offsets, mask, SIGNED: tl.constexpr):
        """Quantize one block to the nearest code; returns (code-book index, block absmax).

        The caller dequantizes from these registers: reading the scale back from memory right after
        this store would race on a GPU (threads of one program are not ordered without a barrier)."""
        absmax = tl.max(tl.where(mask, tl.abs(value), 0.0), axis=0)
        normalized = tl.div_rn(value, tl.where(absmax > 0.0, absmax, 1.0))
        # Branchless lower bound over the 255 sorted midpoints: index = #(midpoints < normalized).
        index = tl.zeros(value.shape, dtype=tl.int32)
        for bit in tl.static_range(7, -1, -1):
            probe = tl.load(midpoints_ptr + index + ((1 << bit) - 1))
            index = tl.where(normalized > probe, index + (1 << bit), index)
        if SIGNED:
            tl.store(codes_ptr + offsets, (index - 128).to(tl.int8), mask=mask)
        else:
            tl.store(codes_ptr + offsets, index.to(tl.uint8), mask=mask)
        tl.store(scales_ptr + block, absmax)
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
        signed_mid_ptr,
        unsigned_book_ptr,
        unsigned_mid_ptr,
        n_elements,
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
        ERROR_FEEDBACK: tl.constexpr,
    ):
        block = tl.program_id(0).to(tl.int64)
        offsets = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offsets < n_elements

        p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m = _load_moment(m_codes_ptr, m_scales_ptr, signed_book_ptr, block, offsets, mask, True)
        v = _load_moment(v_codes_ptr, v_scales_ptr, unsigned_book_ptr, block, offsets, mask, False)
        if ERROR_FEEDBACK:
            m += _load_moment(mr_codes_ptr, mr_scales_ptr, signed_book_ptr, block, offsets, mask, True)
            v += _load_moment(vr_codes_ptr, vr_scales_ptr, signed_book_ptr, block, offsets, mask, True)
        v = tl.maximum(v, 0.0)
        m = tl.where(v > 0.0, m, 0.0)

        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * (g * g)
        v = tl.maximum(v, sq_floor * (m * m))
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p * decay - step_size * tl.div_rn(m, denom)
        tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)

        m_index, m_absmax = _store_moment(m, m_codes_ptr, m_scales_ptr, signed_mid_ptr, block, offsets, mask, True)
        v_index, v_absmax = _store_moment(v, v_codes_ptr, v_scales_ptr, unsigned_mid_ptr, block, offsets, mask, False)
        if ERROR_FEEDBACK:
            m_stored = tl.load(signed_book_ptr + m_index) * m_absmax
            v_stored = tl.load(unsigned_book_ptr + v_index) * v_absmax
            _store_moment(m - m_stored, mr_codes_ptr, mr_scales_ptr, signed_mid_ptr, block, offsets, mask, True)
            _store_moment(v - v_stored, vr_codes_ptr, vr_scales_ptr, signed_mid_ptr, block, offsets, mask, True)


def adamw8bit_step_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    exp_avg_residual_codes: torch.Tensor | None,
    exp_avg_residual_scales: torch.Tensor | None,
    exp_avg_sq_residual_codes: torch.Tensor | None,
    exp_avg_sq_residual_scales: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    block_size: int,
) -> None:
    """Triton launcher with the signature and semantics of `adamw8bit_step_torch`: one program per block."""
    n = param.numel()
    if n == 0:
        return
    s = adam_step_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    signed_book, signed_mid = dynamic_code_book(signed=True, device=param.device)
    unsigned_book, unsigned_mid = dynamic_code_book(signed=False, device=param.device)
    error_feedback = exp_avg_residual_codes is not None
    # Without error feedback the residual pointers are never read (ERROR_FEEDBACK is constexpr
    # False); any valid tensor fills the argument slots.
    mr_codes = exp_avg_residual_codes if error_feedback else exp_avg_codes
    mr_scales = exp_avg_residual_scales if error_feedback else exp_avg_scales
    vr_codes = exp_avg_sq_residual_codes if error_feedback else exp_avg_codes
    vr_scales = exp_avg_sq_residual_scales if error_feedback else exp_avg_scales
    grid = (triton.cdiv(n, block_size),)
    _adamw8bit_step_kernel[grid](
        param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        mr_codes, mr_scales, vr_codes, vr_scales,
        signed_book, signed_mid, unsigned_book, unsigned_mid,
        n, s["decay"], s["beta1"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"],
        s["step_size"], s["bias_correction2_sqrt"], s["sq_floor"], eps,
        BLOCK=block_size, ERROR_FEEDBACK=error_feedback,
        enable_fp_fusion=False,  # no fused multiply-adds: the twin rounds every product and sum
    )  # fmt: skip


def adamw8bit_step(*args, **kwargs) -> None:
    """Dispatch: the Triton kernel on CUDA (and under TRITON_INTERPRET=1), the torch twin otherwise."""
    param = args[0] if args else kwargs["param"]
    if use_triton(param):
        adamw8bit_step_triton(*args, **kwargs)
    else:
        adamw8bit_step_torch(*args, **kwargs)
