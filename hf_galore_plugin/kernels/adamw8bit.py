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

Nearest-code search: index = #(midpoints < y) over the 255 fp32 midpoints between neighbouring
code values, found without a search by a table over y's fp32 bit pattern (`nearest_code_index`):
the sign, the exponent and the top 8 mantissa bits of y pick a bucket of y values; the table holds
c = #(midpoints < smallest y of the bucket), and as no bucket holds more than one midpoint (asserted
when the table is built: buckets are <= 2**-8 relative wide, code values >= 0.7% apart),
index = c + (midpoints[c] < y), exactly. The twin, its compiled form and the Triton kernel all use
this rule, so they give identical codes wherever y itself rounds identically.

CPU speed: the twin is one function over (blocks, block_size) tiles; on tensors of at least
`COMPILE_MIN_NUMEL` values it runs through `torch.compile` (inductor emits one vectorized C++ loop
nest instead of ~40 passes over memory). The compiled form is bit-identical to the eager one
(tests/test_optim.py checks it); where compilation fails (no C++ compiler, an unsupported torch) the
eager twin runs and one warning says why; `HF_GALORE_COMPILE=0` turns compilation off.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from hf_galore_plugin.utils import is_triton_available, use_triton

__all__ = [
    "dynamic_code_book",
    "code_lookup_table",
    "nearest_code_index",
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


# Bucket of y: sign, exponent and the top LOOKUP_MANTISSA_BITS mantissa bits of its fp32 pattern.
# |y| below 2**LOOKUP_MIN_EXPONENT shares the first bucket (the smallest midpoint, 5e-8 ~ 2**-24.3,
# is far above it), |y| >= 2 the last (normalized values are in [-1, 1]).
LOOKUP_MANTISSA_BITS = 8
LOOKUP_MIN_EXPONENT = -32
LOOKUP_SHIFT = 23 - LOOKUP_MANTISSA_BITS
LOOKUP_BASE = (127 + LOOKUP_MIN_EXPONENT) << LOOKUP_MANTISSA_BITS
LOOKUP_BUCKETS = (1 - LOOKUP_MIN_EXPONENT) << LOOKUP_MANTISSA_BITS  # per sign


@functools.lru_cache(maxsize=None)
def _code_lookup_cached(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    _, midpoints = _code_book_cached(signed, torch.device("cpu"))
    keys = torch.arange(LOOKUP_BUCKETS, dtype=torch.int64) + LOOKUP_BASE
    first = (keys << LOOKUP_SHIFT).to(torch.int32).view(torch.float32)  # smallest |y| of each bucket
    last = (((keys + 1) << LOOKUP_SHIFT) - 1).to(torch.int32).view(torch.float32)  # largest |y|
    first[0] = 0.0  # the first bucket also holds every smaller |y|
    # Positive buckets span y in [first, last], negative ones y in [-last, -first].
    lowest, highest = torch.cat([first, -last]), torch.cat([last, -first])
    table = torch.searchsorted(midpoints, lowest)  # #(midpoints < lowest y)
    extra = torch.searchsorted(midpoints, highest) - table
    if int(extra.max()) > 1:  # a property of the code book; guards against a future book change
        raise AssertionError(f"code lookup: a bucket holds {int(extra.max())} midpoints; use more mantissa bits")
    padded = torch.cat([midpoints, torch.tensor([float("inf")])])  # midpoints[255] = inf: never below y
    return table.to(torch.int32).to(device), padded.to(device)


def code_lookup_table(*, signed: bool, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(table, padded midpoints) of `nearest_code_index`: int32 [2 * LOOKUP_BUCKETS] (positive y's
    buckets, then negative y's) and the 255 fp32 midpoints followed by +inf."""
    return _code_lookup_cached(signed, torch.device(device))


def _lookup_index(normalized: torch.Tensor, table: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """int64 #(midpoints < y) for fp32 `normalized`, through the bucket table (NaN gives 0 or 255)."""
    bits = normalized.view(torch.int32)
    key = ((bits & 0x7FFFFFFF) >> LOOKUP_SHIFT) - LOOKUP_BASE
    key = key.clamp(0, LOOKUP_BUCKETS - 1) + torch.where(bits < 0, LOOKUP_BUCKETS, 0)
    first = table[key.long()].long()
    return first + (midpoints[first] < normalized).long()


def nearest_code_index(normalized: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """Code-book index (0..255) of the nearest code value to each fp32 value: #(midpoints < value)."""
    table, midpoints = code_lookup_table(signed=signed, device=normalized.device)
    return _lookup_index(normalized.float().contiguous(), table, midpoints)


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
    blocks = _blocks(values.float(), block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    index = nearest_code_index(normalized.reshape(-1), signed=signed)[:n]
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


# Order of the per-step scalars in the fp32 tensor `_step_blocks` receives.
_SCALARS = (
    "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
    "step_size", "bias_correction2_sqrt", "sq_floor", "eps",
)  # fmt: skip
# Below this many values the compiled call's fixed cost (~0.1 ms of guards and launch) is not worth it.
COMPILE_MIN_NUMEL = 1 << 16


def _dequantize_tile(codes: torch.Tensor, scales: torch.Tensor, book: torch.Tensor, signed: bool) -> torch.Tensor:
    index = codes.long() + _SIGNED_OFFSET if signed else codes.long()
    return book[index] * scales.unsqueeze(1)


def _quantize_tile(
    value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, book, table, midpoints, signed: bool
) -> torch.Tensor:
    """Store (rows, width) fp32 `value` rowwise as codes + absmax scales; returns the stored values."""
    absmax = value.abs().amax(dim=1)
    normalized = value / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)
    index = _lookup_index(normalized, table, midpoints)
    codes.copy_(index - _SIGNED_OFFSET if signed else index)
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


def _cpp_applies(param: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        param.device.type == "cpu"
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


def _run_cpp(*args) -> bool:
    """Run the C++ step (adamw8bit_cpu.cpp, built once with torch's cpp_extension); False (after one
    warning) where it cannot be built."""
    global _cpp_extension, _cpp_failure
    if _cpp_failure is not None:
        return False
    try:
        if _cpp_extension is None:
            from torch.utils.cpp_extension import load

            # The source's lookup constants must be the ones the tables were built with.
            assert (LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS) == (15, (127 - 32) << 8, 33 << 8)
            _cpp_extension = load(
                name="hf_galore_adamw8bit_cpu",
                sources=[_CPP_SOURCE],
                # -march=native: the build is cached per machine (TORCH_EXTENSIONS_DIR) and runs where
                # it was built; vector gathers, division and sqrt round exactly as scalar ones.
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
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
    applies and n >= COMPILE_MIN_NUMEL, else "inductor" for n >= COMPILE_MIN_NUMEL, else "eager";
    a backend that cannot be built falls back to the next one with one warning. All three give
    bit-identical results on finite values (tests/test_optim.py).
    """
    if backend not in (None, "eager", "inductor", "cpp"):
        raise ValueError(f"adamw8bit_step_torch: backend={backend!r}; use None, 'eager', 'inductor' or 'cpp'")
    n = param.numel()
    if n == 0:
        return
    s = adam_step_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    s["eps"] = eps
    device = param.device
    scalars = torch.tensor([s[k] for k in _SCALARS], dtype=torch.float32, device=device)
    books = (
        *(dynamic_code_book(signed=True, device=device)[:1]), *code_lookup_table(signed=True, device=device),
        *(dynamic_code_book(signed=False, device=device)[:1]), *code_lookup_table(signed=False, device=device),
    )  # fmt: skip
    flat = (
        param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        exp_avg_residual_codes, exp_avg_residual_scales, exp_avg_sq_residual_codes, exp_avg_sq_residual_scales,
    )  # fmt: skip
    if backend is None:
        # Fake and meta tensors (the memory planner's trace) have no data to hand to a compiled step,
        # and a failed build under them would disable the compiled steps for the real ones.
        big = n >= COMPILE_MIN_NUMEL and _compile_enabled() and not _is_traced(param, grad)
        backend = ("cpp" if _cpp_applies(param, grad) else "inductor") if big else "eager"
    if backend == "cpp":
        if not _cpp_applies(param, grad):
            raise ValueError("adamw8bit_step_torch: backend='cpp' needs fp32 contiguous CPU param and grad")
        cpp_books = (books[0], _packed_lookup_table(True), books[3], _packed_lookup_table(False))
        if _run_cpp(*flat, scalars, *cpp_books, block_size):
            return
        backend = "inductor"
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


# Values per Triton program: ROWS = _TILE_VALUES // block_size blocks as one [ROWS, BLOCK] tile, so a
# 256-value block does not leave a GPU program 1 KB of work (and the interpreter runs few programs).
_TILE_VALUES = 2048

if is_triton_available():
    import triton
    import triton.language as tl

    _LOOKUP_SHIFT = tl.constexpr(LOOKUP_SHIFT)  # a jit function reads only constexpr globals
    _LOOKUP_BASE = tl.constexpr(LOOKUP_BASE)
    _LOOKUP_BUCKETS = tl.constexpr(LOOKUP_BUCKETS)

    @triton.jit
    def _load_moment(codes_ptr, scales_ptr, book_ptr, rows, row_mask, offsets, mask, SIGNED: tl.constexpr):
        index = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.int32)
        if SIGNED:
            index = index + 128
        scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
        return tl.load(book_ptr + index) * scale[:, None]

    @triton.jit
    def _store_moment(
        value, codes_ptr, scales_ptr, table_ptr, mid_ptr, rows, row_mask, offsets, mask, SIGNED: tl.constexpr
    ):
        """Quantize each row (block) of the tile to the nearest code; returns (code-book index, row absmax).

        The caller dequantizes from these registers: reading the scale back from memory right after
        this store would race on a GPU (threads of one program are not ordered without a barrier)."""
        absmax = tl.max(tl.where(mask, tl.abs(value), 0.0), axis=1)
        normalized = tl.div_rn(value, tl.where(absmax > 0.0, absmax, 1.0)[:, None])
        # index = #(midpoints < normalized) from the bucket table (see nearest_code_index): 2 gathers.
        bits = normalized.to(tl.int32, bitcast=True)
        key = ((bits & 0x7FFFFFFF) >> _LOOKUP_SHIFT) - _LOOKUP_BASE
        key = tl.minimum(tl.maximum(key, 0), _LOOKUP_BUCKETS - 1) + tl.where(bits < 0, _LOOKUP_BUCKETS, 0)
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
            m, m_codes_ptr, m_scales_ptr, signed_table_ptr, signed_mid_ptr, rows, row_mask, offsets, mask, True
        )
        v_index, v_absmax = _store_moment(
            v, v_codes_ptr, v_scales_ptr, unsigned_table_ptr, unsigned_mid_ptr, rows, row_mask, offsets, mask, False
        )
        if ERROR_FEEDBACK:
            m_stored = tl.load(signed_book_ptr + m_index) * m_absmax[:, None]
            v_stored = tl.load(unsigned_book_ptr + v_index) * v_absmax[:, None]
            _store_moment(
                m - m_stored, mr_codes_ptr, mr_scales_ptr, signed_table_ptr, signed_mid_ptr,
                rows, row_mask, offsets, mask, True,
            )  # fmt: skip
            _store_moment(
                v - v_stored, vr_codes_ptr, vr_scales_ptr, signed_table_ptr, signed_mid_ptr,
                rows, row_mask, offsets, mask, True,
            )  # fmt: skip


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
    """Triton launcher with the signature and semantics of `adamw8bit_step_torch`: one program per
    `_TILE_VALUES // block_size` blocks."""
    n = param.numel()
    if n == 0:
        return
    s = adam_step_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    device = param.device
    signed_book, _ = dynamic_code_book(signed=True, device=device)
    unsigned_book, _ = dynamic_code_book(signed=False, device=device)
    signed_table, signed_mid = code_lookup_table(signed=True, device=device)
    unsigned_table, unsigned_mid = code_lookup_table(signed=False, device=device)
    error_feedback = exp_avg_residual_codes is not None
    # Without error feedback the residual pointers are never read (ERROR_FEEDBACK is constexpr
    # False); any valid tensor fills the argument slots.
    mr_codes = exp_avg_residual_codes if error_feedback else exp_avg_codes
    mr_scales = exp_avg_residual_scales if error_feedback else exp_avg_scales
    vr_codes = exp_avg_sq_residual_codes if error_feedback else exp_avg_codes
    vr_scales = exp_avg_sq_residual_scales if error_feedback else exp_avg_scales
    n_blocks = triton.cdiv(n, block_size)
    rows = max(1, _TILE_VALUES // block_size)
    grid = (triton.cdiv(n_blocks, rows),)
    _adamw8bit_step_kernel[grid](
        param, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
        mr_codes, mr_scales, vr_codes, vr_scales,
        signed_book, signed_table, signed_mid, unsigned_book, unsigned_table, unsigned_mid,
        n, n_blocks, s["decay"], s["beta1"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"],
        s["step_size"], s["bias_correction2_sqrt"], s["sq_floor"], eps,
        BLOCK=block_size, ROWS=rows, ERROR_FEEDBACK=error_feedback,
        num_warps=8 if rows * block_size >= 2048 else 4,
        enable_fp_fusion=False,  # no fused multiply-adds: the twin rounds every product and sum
    )  # fmt: skip


def adamw8bit_step(*args, **kwargs) -> None:
    """Dispatch: the Triton kernel on CUDA (and under TRITON_INTERPRET=1), the torch twin otherwise."""
    param = args[0] if args else kwargs["param"]
    if use_triton(param):
        adamw8bit_step_triton(*args, **kwargs)
    else:
        adamw8bit_step_torch(*args, **kwargs)
