"""The fused 8-bit blockwise AdamW step: its torch implementation, its CPU fast paths, and the
`torch.ops.hf_galore.adamw8bit_step` custom op that dispatches to it or to the Triton kernel.

State layout and code book: `hf_galore_plugin.quant.dynamic` (8-bit codes + one fp32 absmax per
block, dynamic map). The op's CPU implementation is `adamw8bit_step_torch`, its CUDA
implementation the Triton kernel (`hf_galore_plugin.kernels.adamw8bit`) through
`adamw8bit_step_triton`; `hf_galore_plugin.utils.KERNEL_DISPATCH` holds the exceptions (the torch
step on CUDA, the Triton kernel on CPU under its interpreter). The fake registration mutates in
place and allocates nothing, as the kernel does, so the op traces under FakeTensorMode.

Error feedback (optional): the quantization residual r = x - dequant(quant(x)) of each moment
is kept in 8 bits too (signed dynamic codes + its own fp32 block absmax) and added back when
the state is read next step. Both moments get one: with beta2 = 0.999 the second moment moves
0.1% a step, less than half a code step (0.35%..3.5% relative in the top decade), so without a
residual it sticks to its code and that, not the first moment, dominates the error. Measured on
the 64x128 least-squares problem of tests/test_optim.py (500 steps, lr 1e-3): no feedback 5.7%,
first-moment residual only 5.6%, second-moment only 0.62%, both 0.03% relative weight deviation
from fp32 AdamW. Cost: 1 byte + 4/block_size per value per moment.

CPU speed: the torch step is one function over (blocks, block_size) tiles. With fp32 contiguous
parameter and gradient it runs as C++ at every size (adamw8bit_cpu.cpp, built once with torch's
cpp_extension; one call and no parallel region below 256K values, so the many small tensors of a
model, norms and biases, cost microseconds rather than the ~40 torch operations of the eager
step); otherwise, on tensors of at least `COMPILE_MIN_NUMEL` values, through `torch.compile`
(inductor emits one vectorized C++ loop nest instead of ~40 passes over memory). Both are bit-identical to the eager function (tests/test_optim.py
checks it); where a build fails (no C++ compiler, an unsupported torch) the next one runs and one
warning says why; `HF_GALORE_COMPILE=0` turns compilation off.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from typing import Any

import torch

from hf_galore_plugin.quant.dynamic import (
    LOOKUP_BASE,
    LOOKUP_BUCKETS,
    LOOKUP_SHIFT,
    SIGNED_OFFSET,
    code_lookup_table,
    dequantize_dynamic_blockwise,
    dynamic_code_book,
    lookup_index,
    quantize_dynamic_blockwise,
)
from hf_galore_plugin.utils import KERNEL_DISPATCH, use_triton

logger = logging.getLogger(__name__)

__all__ = [
    "adam_step_scalars",
    "second_moment_floor",
    "quantize_moment",
    "dequantize_moment",
    "adamw8bit_step_torch",
    "adamw8bit_step_triton",
    "adamw8bit_step",
    "adamw8bit_step_multi",
    "COMPILE_MIN_NUMEL",
]


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
    value = dequantize_dynamic_blockwise(codes, scales, block_size=block_size)
    if residual_codes is not None:
        value = value + dequantize_dynamic_blockwise(residual_codes, residual_scales, block_size=block_size)
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
    quantize_dynamic_blockwise(value, signed=signed, block_size=block_size, codes_out=codes, scales_out=scales)
    if residual_codes is not None:
        residual = value - dequantize_dynamic_blockwise(codes, scales, block_size=block_size)
        quantize_dynamic_blockwise(
            residual, signed=True, block_size=block_size, codes_out=residual_codes, scales_out=residual_scales
        )


# Order of the per-step scalars in the fp32 tensor `_step_blocks` receives.
_SCALARS = (
    "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
    "step_size", "bias_correction2_sqrt", "sq_floor", "eps",
)  # fmt: skip
# Below this many values the torch.compile'd call's fixed cost (~0.1 ms of guards and launch) is not
# worth it; the C++ step has no such cost and runs at every size.
COMPILE_MIN_NUMEL = 1 << 16


def _dequantize_tile(codes: torch.Tensor, scales: torch.Tensor, book: torch.Tensor, signed: bool) -> torch.Tensor:
    index = codes.long() + SIGNED_OFFSET if signed else codes.long()
    return book[index] * scales.unsqueeze(1)


def _quantize_tile(
    value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, book, table, midpoints, signed: bool
) -> torch.Tensor:
    """Store (rows, width) fp32 `value` rowwise as codes + absmax scales; returns the stored values."""
    absmax = value.abs().amax(dim=1)
    normalized = value / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)
    index = lookup_index(normalized, table, midpoints)
    codes.copy_(index - SIGNED_OFFSET if signed else index)
    scales.copy_(absmax)
    return book[index] * absmax.unsqueeze(1)


def _step_blocks(
    param, grad, m_codes, m_scales, v_codes, v_scales, mr_codes, mr_scales, vr_codes, vr_scales,
    scalars, signed_book, signed_table, signed_mid, unsigned_book, unsigned_table, unsigned_mid, compiled=False,
):  # fmt: skip
    """The 8-bit AdamW step on (rows, width) tiles, one quantization block per row, all in place.

    Scales are 1-D (rows,); residual arguments are all None without error feedback; `scalars` is the
    fp32 tensor of `_SCALARS`. Every product and sum is a separate fp32 operation (no fused
    multiply-add) and the square root is correctly rounded, as in the Triton kernel (`sqrt_rn`).
    `compiled`: inductor's fp32 sqrt is the correctly rounded vector instruction; eager torch's CPU
    fp32 sqrt is not (measured: 1 ulp off on ~20% of values), so eager takes it in fp64 and rounds
    once, which gives the correctly rounded fp32 root (fp64 has more than 2 * 24 + 2 bits)."""
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, sq_floor, eps = scalars.unbind()
    g = grad.float()
    exp_avg = _dequantize_tile(m_codes, m_scales, signed_book, True)
    exp_avg_sq = _dequantize_tile(v_codes, v_scales, unsigned_book, False)
    if mr_codes is not None:
        exp_avg = exp_avg + _dequantize_tile(mr_codes, mr_scales, signed_book, True)
        exp_avg_sq = exp_avg_sq + _dequantize_tile(vr_codes, vr_scales, signed_book, True)
    # A residual-corrected v can dip a hair below 0 where v itself is ~0; sqrt needs >= 0.
    exp_avg_sq = exp_avg_sq.clamp_min(0.0)
    # A second moment stored as 0 next to a first moment that is not: the coordinate's statistics fell
    # below the code map's resolution. Its momentum is dropped with it (see second_moment_floor).
    exp_avg = torch.where(exp_avg_sq > 0, exp_avg, 0.0)
    exp_avg = beta1 * exp_avg + one_minus_beta1 * g
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * (g * g)
    exp_avg_sq = torch.maximum(exp_avg_sq, sq_floor * (exp_avg * exp_avg))
    root = exp_avg_sq.sqrt() if compiled else exp_avg_sq.double().sqrt().float()
    denom = root / bc2_sqrt + eps
    param.copy_(param.float() * decay - step_size * (exp_avg / denom))
    m_stored = _quantize_tile(exp_avg, m_codes, m_scales, signed_book, signed_table, signed_mid, True)
    v_stored = _quantize_tile(exp_avg_sq, v_codes, v_scales, unsigned_book, unsigned_table, unsigned_mid, False)
    if mr_codes is not None:
        _quantize_tile(exp_avg - m_stored, mr_codes, mr_scales, signed_book, signed_table, signed_mid, True)
        _quantize_tile(exp_avg_sq - v_stored, vr_codes, vr_scales, signed_book, signed_table, signed_mid, True)


_compiled_step_blocks = None
_compile_failure: str | None = None
_cpp_extension = None
_cpp_failure: str | None = None
_CPP_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adamw8bit_cpu.cpp")


@functools.lru_cache(maxsize=None)
def _packed_lookup_table(signed: bool) -> torch.Tensor:
    """int32 [2 * LOOKUP_BUCKETS] for the C++ step: first | threshold << 8 per bucket, where first is
    `code_lookup_table`'s entry and `midpoints[first] < y` equals z(y) > threshold, z(y) being the low
    LOOKUP_SHIFT bits of y's pattern, complemented for negative y. This holds because a bucket holds
    at most one midpoint, and one inside y's bucket shares every higher bit with y; where the bucket
    holds none, midpoints[first] is above every y of it and threshold = 2**LOOKUP_SHIFT - 1 is never
    exceeded. One table read per value instead of two dependent ones."""
    table, padded = code_lookup_table(signed=signed)
    first = table.long()
    mid = padded[first]
    bits = mid.view(torch.int32).long()
    key = ((bits & 0x7FFFFFFF) >> LOOKUP_SHIFT) - LOOKUP_BASE
    key = key.clamp(0, LOOKUP_BUCKETS - 1) + torch.where(bits < 0, LOOKUP_BUCKETS, 0)
    low_mask = (1 << LOOKUP_SHIFT) - 1
    negative = torch.arange(2 * LOOKUP_BUCKETS) >= LOOKUP_BUCKETS
    inside = torch.isfinite(mid) & (key == torch.arange(2 * LOOKUP_BUCKETS))
    low = bits & low_mask
    threshold = torch.where(inside, torch.where(negative, low ^ low_mask, low), low_mask)
    return (first | (threshold << 8)).to(torch.int32)


def _code_tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """What every implementation of the step reads: per book (signed, then unsigned) its 256 code
    values, the nearest-code bucket table and the padded midpoints (all cached per device)."""
    return (
        dynamic_code_book(signed=True, device=device)[0], *code_lookup_table(signed=True, device=device),
        dynamic_code_book(signed=False, device=device)[0], *code_lookup_table(signed=False, device=device),
    )  # fmt: skip


def _scalar_row(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> list[float]:
    """The step's scalars in the order `_step_blocks` and the C++ step read them (`_SCALARS`)."""
    scalars = adam_step_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    scalars["eps"] = eps
    return [scalars[k] for k in _SCALARS]


def _cpp_books() -> tuple[torch.Tensor, ...]:
    """The C++ step's tables: per book its code values and packed bucket table."""
    books = _code_tables(torch.device("cpu"))
    return books[0], _packed_lookup_table(True), books[3], _packed_lookup_table(False)


def _cpp_applies(param: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        param.is_cpu
        and param.dtype == torch.float32
        and grad.dtype == torch.float32
        and param.is_contiguous()
        and grad.is_contiguous()
    )


def _is_traced(*tensors: torch.Tensor) -> bool:
    """True under a dispatch mode (FakeTensorMode, the planner's byte tracker) or for fake/meta
    tensors: a compiled step would either see no data or hide its work from the mode."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if _get_current_dispatch_mode_stack():
        return True
    return any(t.device.type == "meta" or is_fake(t) for t in tensors)


def _compile_enabled() -> bool:
    return os.environ.get("HF_GALORE_COMPILE", "1") != "0"


def _warn_fallback(what: str, failure: str, fallback: str) -> None:
    warnings.warn(
        f"hf_galore_plugin: {what} of the 8-bit AdamW step failed ({failure}); using {fallback} (same "
        "results, slower). Set HF_GALORE_COMPILE=0 to skip every compilation attempt.",
        RuntimeWarning,
        stacklevel=4,
    )


# Seconds a C++ build may take before one log line says what the wait is.
BUILD_NOTICE_SECONDS = 5.0


def _log_build_notice() -> None:
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    logger.warning(
        "hf_galore_plugin: building the CPU 8-bit AdamW step (adamw8bit_cpu.cpp) once for this machine; "
        "this takes one to three minutes and is cached under %s. Set HF_GALORE_COMPILE=0 to skip it "
        "(slower steps).",
        root,
    )


def _run_cpp(*args) -> bool:
    """Run the C++ step (adamw8bit_cpu.cpp, built once with torch's cpp_extension) on lists of
    tensors (one entry per parameter); False (after one warning) where it cannot be built."""
    global _cpp_extension, _cpp_failure
    if _cpp_failure is not None:
        return False
    try:
        if _cpp_extension is None:
            from torch.utils.cpp_extension import load

            # The source's lookup constants must be the ones the tables were built with.
            assert (LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS) == (15, (127 - 32) << 8, 33 << 8)
            # A first build takes a minute or more on a small machine, a cached one about a second:
            # say what the wait is only when it is long.
            notice = threading.Timer(BUILD_NOTICE_SECONDS, _log_build_notice)
            notice.daemon = True
            notice.start()
            try:
                _cpp_extension = load(
                    name="hf_galore_adamw8bit_cpu",
                    sources=[_CPP_SOURCE],
                    # -march=native: the build is cached per machine (TORCH_EXTENSIONS_DIR) and runs
                    # where it was built; vector division and sqrt round exactly as scalar ones.
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            finally:
                notice.cancel()
        _cpp_extension.adamw8bit_step_cpu(*args)
        return True
    except Exception as error:  # no compiler, no ninja, a failed build
        _cpp_failure = f"{type(error).__name__}: {error}".splitlines()[0]
        _warn_fallback("the C++ build", _cpp_failure, "the torch.compile'd twin")
        return False


def _run_compiled(*args) -> bool:
    """Run `_step_blocks` compiled; False (after one warning) where compilation is unavailable."""
    global _compiled_step_blocks, _compile_failure
    if _compile_failure is not None:
        return False
    try:
        if _compiled_step_blocks is None:
            # dynamic: one graph for every size; fullgraph: a graph break would silently cost the speed.
            # Every gather index is in range by construction (codes + 128 and uint8 codes in [0, 255],
            # bucket keys clamped, table entries in [0, 255] of 256 padded midpoints), so inductor's
            # per-element bounds checks, which halve the speed (measured), are left out.
            _compiled_step_blocks = torch.compile(
                _step_blocks, dynamic=True, fullgraph=True, options={"assert_indirect_indexing": False}
            )
        _compiled_step_blocks(*args, compiled=True)
        return True
    except Exception as error:  # compilation errors surface at the first call
        _compile_failure = f"{type(error).__name__}: {error}".splitlines()[0]
        _warn_fallback("torch.compile", _compile_failure, "the eager torch step")
        return False


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
    backend: str | None = None,
) -> None:
    """One AdamW step on flat contiguous tensors with 8-bit blockwise moments, all in place.

    `param` (any float dtype) and `grad` are 1-D of n values; codes are int8 (first moment) /
    uint8 (second moment) of n values; scales are fp32 of ceil(n / block_size) blocks. The
    residual tensors are all None (no error feedback) or all given (int8 codes + fp32 scales).
    Math is fp32; the parameter is written back in its own dtype.

    `backend`: "eager" (torch ops), "inductor" (`torch.compile` of the same function on the full
    blocks), "cpp" (adamw8bit_cpu.cpp: fp32 CPU param and grad only), or None: "cpp" where it
    applies (any n), else "inductor" for n >= COMPILE_MIN_NUMEL, else "eager";
    a backend that cannot be built falls back to the next one with one warning. All three give
    bit-identical results on finite values (tests/test_optim.py).
    """
    if backend not in (None, "eager", "inductor", "cpp"):
        raise ValueError(f"adamw8bit_step_torch: backend={backend!r}; use None, 'eager', 'inductor' or 'cpp'")
    n = param.numel()
    if n == 0:
        return
    device = param.device
    scalars = torch.tensor(_scalar_row(step, lr, beta1, beta2, eps, weight_decay), dtype=torch.float32, device=device)
    books = _code_tables(device)
    flat = (
        param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        exp_avg_residual_codes, exp_avg_residual_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
    )  # fmt: skip
    if backend is None:
        # Fake and meta tensors (the memory planner's trace) have no data to hand to a compiled step,
        # and a failed build under them would disable the compiled steps for the real ones.
        compiled = _compile_enabled() and not _is_traced(param, grad)
        if compiled and _cpp_applies(param, grad):
            backend = "cpp"
        else:
            backend = "inductor" if compiled and n >= COMPILE_MIN_NUMEL else "eager"
    if backend == "cpp":
        if not _cpp_applies(param, grad):
            raise ValueError("adamw8bit_step_torch: backend='cpp' needs fp32 contiguous CPU param and grad")
        if _run_cpp(*([t] if t is not None else [] for t in flat), scalars.view(1, -1), *_cpp_books(), block_size):
            return
        backend = "inductor" if n >= COMPILE_MIN_NUMEL else "eager"
    full = n // block_size
    # Blocks are independent: full blocks as one (full, block_size) tile, the partial last block as (1, rest).
    for rows, begin, end in ((full, 0, full * block_size), (1, full * block_size, n)):
        if end <= begin:
            continue
        width = (end - begin) // rows
        first_block = begin // block_size
        tiles = [
            None if t is None
            else t[first_block:first_block + rows] if i % 2 == 1 and i > 1
            else t[begin:end].view(rows, width)
            for i, t in enumerate(flat)
        ]  # fmt: skip
        if backend == "inductor" and rows > 1 and _run_compiled(*tiles, scalars, *books):
            continue
        _step_blocks(*tiles, scalars, *books)


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
    """The Triton kernel with the signature and semantics of `adamw8bit_step_torch` (CUDA tensors, or
    CPU tensors under TRITON_INTERPRET=1)."""
    from hf_galore_plugin.kernels.adamw8bit import launch_adamw8bit_step

    scalars = adam_step_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    scalars["eps"] = eps
    tables = _code_tables(param.device)
    launch_adamw8bit_step(
        param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        exp_avg_residual_codes, exp_avg_residual_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
        scalars=scalars, tables=tables, lookup=(LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS), block_size=block_size,
    )  # fmt: skip


_MUTATED = (
    "param", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales",
    "exp_avg_residual_codes", "exp_avg_residual_scales", "exp_avg_sq_residual_codes", "exp_avg_sq_residual_scales",
)  # fmt: skip


@torch.library.custom_op("hf_galore::adamw8bit_step", mutates_args=_MUTATED)
def _adamw8bit_step_op(
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
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    block_size: int,
) -> None:
    """Default (CPU) implementation: the torch step; the Triton kernel under the interpreter setting."""
    step_fn = adamw8bit_step_triton if use_triton(param) else adamw8bit_step_torch
    step_fn(
        param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        exp_avg_residual_codes, exp_avg_residual_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, block_size=block_size,
    )  # fmt: skip


@_adamw8bit_step_op.register_kernel("cuda")
def _adamw8bit_step_cuda(
    param, grad, m_codes, m_scales, v_codes, v_scales, mr_codes, mr_scales, vr_codes, vr_scales,
    step, lr, beta1, beta2, eps, weight_decay, block_size,
):  # fmt: skip
    """CUDA implementation: the Triton kernel; the torch step when Triton is disabled or missing."""
    step_fn = adamw8bit_step_triton if use_triton(param) else adamw8bit_step_torch
    step_fn(
        param, grad, m_codes, m_scales, v_codes, v_scales, mr_codes, mr_scales, vr_codes, vr_scales,
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, block_size=block_size,
    )  # fmt: skip


@_adamw8bit_step_op.register_fake
def _adamw8bit_step_fake(*args) -> None:
    """Every tensor is updated in place and nothing is allocated (the kernel works in registers)."""


def adamw8bit_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    exp_avg_residual_codes: torch.Tensor | None = None,
    exp_avg_residual_scales: torch.Tensor | None = None,
    exp_avg_sq_residual_codes: torch.Tensor | None = None,
    exp_avg_sq_residual_scales: torch.Tensor | None = None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    block_size: int,
) -> None:
    """One 8-bit AdamW step in place (see `adamw8bit_step_torch` for the tensors) through
    `torch.ops.hf_galore.adamw8bit_step`; with `KERNEL_DISPATCH.inline_twins` the torch step runs
    as plain torch code instead (the memory planner's CPU trace)."""
    residuals = (exp_avg_residual_codes, exp_avg_residual_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales)
    if any(r is None for r in residuals) and any(r is not None for r in residuals):
        raise ValueError(
            "adamw8bit_step: the four residual tensors (error feedback) must be all given or all None,"
            f" got {['given' if r is not None else None for r in residuals]}"
        )
    tensors = (param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales, *residuals)
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, block_size=block_size)
    if KERNEL_DISPATCH.inline_twins:
        adamw8bit_step_torch(*tensors, **hyper)
        return
    torch.ops.hf_galore.adamw8bit_step(*tensors, **hyper)


def _step_each(
    lists: tuple[list[torch.Tensor], ...], steps: list[int], hyper: dict[str, Any], *, twins: bool = False
) -> None:
    """`adamw8bit_step_multi` one parameter at a time: the Triton kernel where it applies, else the torch
    step (always the torch step with `twins`), each on 1-D views."""
    residuals = bool(lists[6])
    for i, step in enumerate(steps):
        tensors = [lst[i].view(-1) for lst in lists[:6]] + [lst[i].view(-1) if residuals else None for lst in lists[6:]]
        step_fn = adamw8bit_step_triton if not twins and use_triton(tensors[0]) else adamw8bit_step_torch
        step_fn(*tensors, step=step, **hyper)


def _adamw8bit_step_multi_impl(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg_codes: list[torch.Tensor],
    exp_avg_scales: list[torch.Tensor],
    exp_avg_sq_codes: list[torch.Tensor],
    exp_avg_sq_scales: list[torch.Tensor],
    exp_avg_residual_codes: list[torch.Tensor],
    exp_avg_residual_scales: list[torch.Tensor],
    exp_avg_sq_residual_codes: list[torch.Tensor],
    exp_avg_sq_residual_scales: list[torch.Tensor],
    steps: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    block_size: int,
) -> None:
    """The op's kernel on every device: the parameters that take the C++ step in one C++ call, the others
    one at a time."""
    lists = (
        params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        exp_avg_residual_codes, exp_avg_residual_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
    )  # fmt: skip
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, block_size=block_size)
    # One list is all real or all fake tensors: the first pair tells. The Triton kernel keeps the
    # parameters it applies to (CUDA; the CPU under TRITON_INTERPRET=1), as for one parameter.
    chosen: list[int] = []
    if params and _compile_enabled() and not _is_traced(params[0], grads[0]):
        # Whether Triton takes a CPU tensor is a setting, the same for every one: asked once.
        triton_on_cpu = None
        for i, (param, grad) in enumerate(zip(params, grads)):
            if _cpp_applies(param, grad):
                if triton_on_cpu is None:
                    triton_on_cpu = use_triton(param)
                if not triton_on_cpu:
                    chosen.append(i)
    count = len(params)
    if chosen:
        rows = {step: _scalar_row(step, lr, beta1, beta2, eps, weight_decay) for step in {steps[i] for i in chosen}}
        if len(rows) == 1:  # every parameter at one step count: one row, repeated
            (row,) = rows.values()
            scalars = torch.tensor(row, dtype=torch.float32).expand(len(chosen), -1).contiguous()
        else:
            scalars = torch.tensor([rows[steps[i]] for i in chosen], dtype=torch.float32)
        picked = lists if len(chosen) == count else _pick(lists, chosen)
        if _run_cpp(*picked, scalars, *_cpp_books(), block_size):
            if len(chosen) == count:
                return
            rest = sorted(set(range(count)) - set(chosen))
            _step_each(_pick(lists, rest), [steps[i] for i in rest], hyper)
            return
    _step_each(lists, steps, hyper)


def _pick(lists: tuple[list[torch.Tensor], ...], indices) -> tuple[list[torch.Tensor], ...]:
    """Entries `indices` of each list (empty lists, the absent residuals, stay empty)."""
    return tuple([lst[i] for i in indices] if lst else [] for lst in lists)


# The multi-tensor step is declared with torch.library.Library, not the custom_op decorator: custom_op
# wraps each call in a Python autograd function and a Python ADInplaceOrView kernel that walk every
# tensor of every list (measured on one CPU thread: 0.25 ms per call plus ~11 us per parameter, more
# than the C++ step of a small model's whole group). The schema, the kernel on every device and the fake
# registration are those custom_op would make; one ADInplaceOrView kernel bumps the version counters
# of the mutated tensors, as every in-place op does.
_LIB = torch.library.Library("hf_galore", "FRAGMENT")
_MULTI_SCHEMA = (
    "adamw8bit_step_multi(Tensor(a0!)[] params, Tensor[] grads, Tensor(a2!)[] exp_avg_codes, "
    "Tensor(a3!)[] exp_avg_scales, Tensor(a4!)[] exp_avg_sq_codes, Tensor(a5!)[] exp_avg_sq_scales, "
    "Tensor(a6!)[] exp_avg_residual_codes, Tensor(a7!)[] exp_avg_residual_scales, "
    "Tensor(a8!)[] exp_avg_sq_residual_codes, Tensor(a9!)[] exp_avg_sq_residual_scales, SymInt[] steps, "
    "float lr, float beta1, float beta2, float eps, float weight_decay, SymInt block_size) -> ()"
)
_LIB.define(_MULTI_SCHEMA)
_LIB.impl("adamw8bit_step_multi", _adamw8bit_step_multi_impl, "CompositeExplicitAutograd")
_MULTI_OP = torch.ops.hf_galore.adamw8bit_step_multi.default


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    try:
        torch.autograd.graph.increment_version(tensors)  # one call for the list where torch takes a list
    except TypeError:  # torch versions that take one tensor
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)


def _adamw8bit_step_multi_inplace(keyset, params, grads, *rest) -> None:
    """ADInplaceOrView kernel: bump the version of every tensor the step writes (first, as custom_op does,
    so a step that fails halfway still marks them), then run the kernel."""
    _increment_versions([t for tensors in (params, *rest[:8]) for t in tensors])
    _MULTI_OP.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, params, grads, *rest)


_LIB.impl("adamw8bit_step_multi", _adamw8bit_step_multi_inplace, "ADInplaceOrView", with_keyset=True)


@torch.library.register_fake("hf_galore::adamw8bit_step_multi", lib=_LIB)
def _adamw8bit_step_multi_fake(*args) -> None:
    """Every tensor is updated in place and nothing is allocated."""


def adamw8bit_step_multi(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[tuple[torch.Tensor, ...]],
    *,
    steps: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    block_size: int,
) -> None:
    """`adamw8bit_step` for many parameters of one device at once: `states[i]` holds parameter i's
    four state tensors (codes and scales of both moments) or eight (with the residuals of error
    feedback, then for every parameter), `steps[i]` its step count. Every tensor is contiguous, of any
    shape (parameter, gradient and codes of one parameter hold the same number of values; scales are
    1-D). One call of `torch.ops.hf_galore.adamw8bit_step_multi`, which on the CPU steps every block of
    the list in one C++ call: per parameter the results are bit-identical to `adamw8bit_step`'s on the
    flattened tensors."""
    count = len(params)
    if not (len(grads) == len(states) == len(steps) == count):
        raise ValueError(
            f"adamw8bit_step_multi: {count} params, {len(grads)} grads, {len(states)} states and {len(steps)}"
            " steps; give one of each per parameter"
        )
    widths = {len(state) for state in states}
    if not widths <= {4} and not widths <= {8}:
        raise ValueError(
            f"adamw8bit_step_multi: state tuples of {sorted(widths)} tensors; give 4 (no error feedback) or 8"
            " (with the residuals) for every parameter of one call"
        )
    columns = [list(column) for column in zip(*states)] if states else [[] for _ in range(4)]
    # The kernels read state tensors as flat memory (the torch step views them 1-D).
    if not all(t.is_contiguous() for column in columns for t in column):
        raise ValueError("adamw8bit_step_multi: every state tensor must be contiguous; pass t.contiguous()")
    columns += [[] for _ in range(8 - len(columns))]
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, block_size=block_size)
    if KERNEL_DISPATCH.inline_twins:
        _step_each((params, grads, *columns), steps, hyper, twins=True)
        return
    if count:
        torch.ops.hf_galore.adamw8bit_step_multi(params, grads, *columns, steps, **hyper)
