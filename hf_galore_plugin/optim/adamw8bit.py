"""The fused 8-bit blockwise AdamW step: the custom op `torch.ops.hf_galore.adamw8bit_step`, its
argument list (declared once here: `STATE_KEYS`, `RESIDUAL_KEYS`, `AdamW8bitHyper`), its torch
implementation and its dispatch.

State layout and code book: `hf_galore_plugin.quant.dynamic` (8-bit codes + one fp32 absmax per
block, dynamic map). The op takes lists, one entry per parameter, so `AdamW` makes one call per group
of 8-bit parameters. Three implementations, bit-identical on finite values:
- `adamw8bit_step_torch`: torch operations over (blocks, block_size) tiles. The oracle of the two
  others, and the CPU step wherever the C++ one is not built or not applicable (a bf16 parameter),
  and where the memory planner traces the step (`KERNEL_DISPATCH.inline_twins`).
- the C++ step (`optim.adamw8bit_cpu`, `adamw8bit_cpu.cpp`): fp32 contiguous CPU parameters, the whole
  list in one call; 20-80x faster than the torch step (a small model's tensors to one tensor of 16M
  values), so it is worth a build, which takes minutes and therefore runs ahead of time
  (`python -m hf_galore_plugin.optim.build_cpu`), never inside a step. docs/benchmarks/step-time.md ("The 8-bit step's CPU implementations") has the numbers.
- the Triton kernel (`kernels.adamw8bit`): CUDA tensors, and CPU tensors under Triton's interpreter
  (the kernel tests). `hf_galore_plugin.utils.KERNEL_DISPATCH` holds the exceptions (the torch step on
  CUDA; the Triton kernel on CPU).
The fake registration mutates in place and allocates nothing, as the kernels do, so the op traces
under FakeTensorMode and torch.compile.

Error feedback (optional): the quantization residual r = x - dequant(quant(x)) of each moment
is kept in 8 bits too (signed dynamic codes + its own fp32 block absmax) and added back when
the state is read next step. Both moments get one: with beta2 = 0.999 the second moment moves
0.1% a step, less than half a code step (0.35%..3.5% relative in the top decade), so without a
residual it sticks to its code and that, not the first moment, dominates the error. Measured on
the 64x128 least-squares problem of tests/test_optim.py (500 steps, lr 1e-3): no feedback 5.7%,
first-moment residual only 5.6%, second-moment only 0.62%, both 0.03% relative weight deviation
from fp32 AdamW. Cost: 1 byte + 4/block_size per value per moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, get_type_hints

import torch

from hf_galore_plugin.optim import adamw8bit_cpu
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

__all__ = [
    "STATE_KEYS",
    "RESIDUAL_KEYS",
    "AdamW8bitHyper",
    "second_moment_floor",
    "quantize_moment",
    "dequantize_moment",
    "adamw8bit_step_torch",
    "adamw8bit_step_triton",
    "adamw8bit_step",
    "adamw8bit_step_multi",
]

# A parameter's 8-bit state tensors in the op's argument order: codes and block scales of both moments,
# then (error feedback only) those of their quantization residuals. These are also `AdamW`'s state keys.
STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
RESIDUAL_KEYS = (
    "exp_avg_residual_codes", "exp_avg_residual_scales", "exp_avg_sq_residual_codes", "exp_avg_sq_residual_scales",
)  # fmt: skip
# The op's tensor arguments, one list each: parameters, gradients (only read), then the state lists.
TENSOR_ARGS = ("params", "grads", *STATE_KEYS, *RESIDUAL_KEYS)


class AdamW8bitHyper(NamedTuple):
    """The options of one 8-bit AdamW step, the same for every parameter of a call (the op's arguments
    after the tensors and the step counts, in this order; the op's schema is built from these fields)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    block_size: int

    def scalars(self, step: int) -> list[float]:
        """The nine fp32 scalars every implementation reads at step count `step`, computed once in float64
        on the host (both implementations receive the same Python floats, so bias correction agrees at
        any step count): decay, beta1, 1 - beta1, beta2, 1 - beta2, step size, sqrt of the second
        bias correction, `second_moment_floor`, eps."""
        beta1, beta2 = self.beta1, self.beta2
        return [
            1.0 - self.lr * self.weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
            self.lr / (1.0 - beta1**step), (1.0 - beta2**step) ** 0.5,
            second_moment_floor(beta1=beta1, beta2=beta2), self.eps,
        ]  # fmt: skip


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
    residual: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    block_size: int,
) -> torch.Tensor:
    """fp32 flat moment from its codes, plus its error-feedback residual (codes, scales) when one is kept."""
    value = dequantize_dynamic_blockwise(codes, scales, block_size=block_size)
    if residual is not None:
        value = value + dequantize_dynamic_blockwise(*residual, block_size=block_size)
    return value


def quantize_moment(
    value: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    residual: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    block_size: int,
) -> None:
    """Store flat fp32 `value` as codes + scales, and its quantization residual in `residual` (codes,
    scales) when one is kept."""
    signed = codes.dtype == torch.int8
    quantize_dynamic_blockwise(value, signed=signed, block_size=block_size, codes_out=codes, scales_out=scales)
    if residual is not None:
        error = value - dequantize_dynamic_blockwise(codes, scales, block_size=block_size)
        quantize_dynamic_blockwise(
            error, signed=True, block_size=block_size, codes_out=residual[0], scales_out=residual[1]
        )


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


def _step_blocks(tiles: Sequence[torch.Tensor], scalars: torch.Tensor, books: Sequence[torch.Tensor]) -> None:
    """The 8-bit AdamW step on (rows, width) tiles, one quantization block per row, all in place.

    `tiles`: one parameter's tensors in the op's order (`TENSOR_ARGS`), 6, or 10 with the residuals of
    error feedback; scales are 1-D (rows,); `books`: `_code_tables`; `scalars` is the
    fp32 tensor of `AdamW8bitHyper.scalars`. Every product and sum is a separate fp32 operation (no fused
    multiply-add) and the square root is correctly rounded, as in the Triton kernel (`sqrt_rn`) and the
    C++ step: torch's CPU fp32 sqrt is not (measured: 1 ulp off on ~20% of values), so the root is taken
    in fp64 and rounded once, which gives the correctly rounded fp32 root (fp64 has more than 2 * 24 + 2
    bits)."""
    param, grad, m_codes, m_scales, v_codes, v_scales = tiles[:6]
    residuals = tiles[6:]
    signed_book, signed_table, signed_mid, unsigned_book, unsigned_table, unsigned_mid = books
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, sq_floor, eps = scalars.unbind()
    g = grad.float()
    exp_avg = _dequantize_tile(m_codes, m_scales, signed_book, True)
    exp_avg_sq = _dequantize_tile(v_codes, v_scales, unsigned_book, False)
    if residuals:
        mr_codes, mr_scales, vr_codes, vr_scales = residuals
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
    root = exp_avg_sq.double().sqrt().float()
    denom = root / bc2_sqrt + eps
    param.copy_(param.float() * decay - step_size * (exp_avg / denom))
    m_stored = _quantize_tile(exp_avg, m_codes, m_scales, signed_book, signed_table, signed_mid, True)
    v_stored = _quantize_tile(exp_avg_sq, v_codes, v_scales, unsigned_book, unsigned_table, unsigned_mid, False)
    if residuals:
        _quantize_tile(exp_avg - m_stored, mr_codes, mr_scales, signed_book, signed_table, signed_mid, True)
        _quantize_tile(exp_avg_sq - v_stored, vr_codes, vr_scales, signed_book, signed_table, signed_mid, True)


def _code_tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """What the torch step and the Triton kernel read: per book (signed, then unsigned) its 256 code
    values, the nearest-code bucket table and the padded midpoints (all cached per device)."""
    return (
        dynamic_code_book(signed=True, device=device)[0], *code_lookup_table(signed=True, device=device),
        dynamic_code_book(signed=False, device=device)[0], *code_lookup_table(signed=False, device=device),
    )  # fmt: skip


def adamw8bit_step_torch(
    param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], *, step: int, hyper: AdamW8bitHyper
) -> None:
    """One AdamW step on flat contiguous tensors with 8-bit blockwise moments, all in place, as torch ops.

    `param` (any float dtype) and `grad` are 1-D of n values; `state` holds the tensors of `STATE_KEYS`
    (and of `RESIDUAL_KEYS` with error feedback): codes are int8 (first moment, residuals) / uint8
    (second moment) of n values, scales fp32 of ceil(n / block_size) blocks. Math is fp32; the
    parameter is written back in its own dtype.
    """
    n = param.numel()
    if n == 0:
        return
    block_size = hyper.block_size
    device = param.device
    scalars = torch.tensor(hyper.scalars(step), dtype=torch.float32, device=device)
    books = _code_tables(device)
    flat = (param, grad, *state)
    full = n // block_size
    # Blocks are independent: full blocks as one (full, block_size) tile, the partial last block as (1, rest).
    for rows, begin, end in ((full, 0, full * block_size), (1, full * block_size, n)):
        if end <= begin:
            continue
        width = (end - begin) // rows
        first_block = begin // block_size
        tiles = [
            t[first_block:first_block + rows] if i % 2 == 1 and i > 1 else t[begin:end].view(rows, width)
            for i, t in enumerate(flat)
        ]  # fmt: skip
        _step_blocks(tiles, scalars, books)


def adamw8bit_step_triton(
    param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], *, step: int, hyper: AdamW8bitHyper
) -> None:
    """The Triton kernel with the arguments and semantics of `adamw8bit_step_torch` (CUDA tensors, or
    CPU tensors under TRITON_INTERPRET=1)."""
    from hf_galore_plugin.kernels.adamw8bit import launch_adamw8bit_step

    launch_adamw8bit_step(
        (param, grad, *state), scalars=hyper.scalars(step), tables=_code_tables(param.device),
        lookup=(LOOKUP_SHIFT, LOOKUP_BASE, LOOKUP_BUCKETS), block_size=hyper.block_size,
    )  # fmt: skip


def _cpp_applies(param: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        param.dtype == torch.float32 and grad.dtype == torch.float32 and param.is_contiguous() and grad.is_contiguous()
    )


def _step_each(
    lists: Sequence[list[torch.Tensor]], steps: Sequence[int], hyper: AdamW8bitHyper, *, twins: bool = False
) -> None:
    """The op one parameter at a time: the Triton kernel where it applies, else the torch step (always the
    torch step with `twins`), each on 1-D views."""
    width = len(TENSOR_ARGS) if lists[6] else 6
    for i, step in enumerate(steps):
        param, grad, *state = (lst[i].view(-1) for lst in lists[:width])
        step_fn = adamw8bit_step_triton if not twins and use_triton(param) else adamw8bit_step_torch
        step_fn(param, grad, state, step=step, hyper=hyper)


def _pick(lists: Sequence[list[torch.Tensor]], indices: Sequence[int]) -> tuple[list[torch.Tensor], ...]:
    """Entries `indices` of each list (empty lists, the absent residuals, stay empty)."""
    return tuple([lst[i] for i in indices] if lst else [] for lst in lists)


def _step_kernel(*args: Any) -> None:
    """The op's kernel on every device (arguments in schema order): on the CPU, the parameters the C++
    step takes in one C++ call where it is built, the others one at a time."""
    lists: tuple[list[torch.Tensor], ...] = args[: len(TENSOR_ARGS)]
    steps: list[int] = args[len(TENSOR_ARGS)]
    hyper = AdamW8bitHyper(*args[len(TENSOR_ARGS) + 1 :])
    params, grads = lists[0], lists[1]
    count = len(params)
    # One list is on one device (fake tensors never reach this kernel: FakeTensorMode answers with the
    # fake registration, and meta tensors are not on the CPU).
    on_cpu = count > 0 and params[0].device.type == "cpu" and not use_triton(params[0])
    module = adamw8bit_cpu.load_built() if on_cpu else None
    chosen = [i for i in range(count) if _cpp_applies(params[i], grads[i])] if module is not None else []
    if module is None or not chosen:
        _step_each(lists, steps, hyper)
        return
    rows = {step: hyper.scalars(step) for step in {steps[i] for i in chosen}}
    if len(rows) == 1:  # every parameter at one step count: one row, repeated
        (row,) = rows.values()
        scalars = torch.tensor(row, dtype=torch.float32).expand(len(chosen), -1).contiguous()
    else:
        scalars = torch.tensor([rows[steps[i]] for i in chosen], dtype=torch.float32)
    adamw8bit_cpu.run(module, lists if len(chosen) == count else _pick(lists, chosen), scalars, hyper.block_size)
    if len(chosen) < count:
        rest = sorted(set(range(count)) - set(chosen))
        _step_each(_pick(lists, rest), [steps[i] for i in rest], hyper)


def _op_schema() -> str:
    """`adamw8bit_step(Tensor(a0!)[] params, Tensor[] grads, ..., SymInt[] steps, float lr, ...) -> ()`: the
    tensor lists of `TENSOR_ARGS` (every one but the gradients written), the step counts, `AdamW8bitHyper`."""
    tensors = [f"Tensor{'' if name == 'grads' else f'(a{i}!)'}[] {name}" for i, name in enumerate(TENSOR_ARGS)]
    kinds = {float: "float", int: "SymInt"}
    options = [f"{kinds[kind]} {name}" for name, kind in get_type_hints(AdamW8bitHyper).items()]
    return f"adamw8bit_step({', '.join(tensors)}, SymInt[] steps, {', '.join(options)}) -> ()"


# The op is declared with torch.library.Library, not the custom_op decorator: custom_op wraps each call in
# a Python autograd function and a Python ADInplaceOrView kernel that walk every tensor of every list
# (measured on one CPU thread: 0.25 ms per call plus ~11 us per parameter, more than the C++ step of a
# small model's whole group), and infers its schema from a Python signature, which would repeat the
# argument list. The schema, the kernel on every device and the fake registration are those custom_op
# would make; one ADInplaceOrView kernel bumps the version counters of the mutated tensors, as every
# in-place op does.
_LIB = torch.library.Library("hf_galore", "FRAGMENT")
_LIB.define(_op_schema())
_LIB.impl("adamw8bit_step", _step_kernel, "CompositeExplicitAutograd")
_OP = torch.ops.hf_galore.adamw8bit_step.default


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    try:
        torch.autograd.graph.increment_version(tensors)  # one call for the list where torch takes a list
    except TypeError:  # torch versions that take one tensor
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)


def _step_inplace(keyset: Any, *args: Any) -> None:
    """ADInplaceOrView kernel: bump the version of every tensor the step writes (first, as custom_op does,
    so a step that fails halfway still marks them), then run the kernel."""
    written = (args[i] for i, name in enumerate(TENSOR_ARGS) if name != "grads")
    _increment_versions([t for tensors in written for t in tensors])
    _OP.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)


_LIB.impl("adamw8bit_step", _step_inplace, "ADInplaceOrView", with_keyset=True)


@torch.library.register_fake("hf_galore::adamw8bit_step", lib=_LIB)
def _step_fake(*args: Any) -> None:
    """Every tensor is updated in place and nothing is allocated (the kernels work in registers)."""


def adamw8bit_step_multi(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    *,
    steps: list[int],
    hyper: AdamW8bitHyper,
) -> None:
    """One 8-bit AdamW step in place for many parameters of one device: `states[i]` holds parameter i's
    tensors of `STATE_KEYS` (4) or, with error feedback for every parameter of the call, of `STATE_KEYS`
    and `RESIDUAL_KEYS` (8), `steps[i]` its step count. Every tensor is contiguous, of any shape
    (parameter, gradient and codes of one parameter hold the same number of values; scales are 1-D).
    One call of `torch.ops.hf_galore.adamw8bit_step`; per parameter the results are bit-identical to
    `adamw8bit_step_torch`'s on the flattened tensors. With `KERNEL_DISPATCH.inline_twins` the torch step
    runs as plain torch code instead (the memory planner's CPU trace)."""
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
    columns = [list(column) for column in zip(*states)] if states else [[] for _ in STATE_KEYS]
    # The kernels read state tensors as flat memory (the torch step views them 1-D).
    if not all(t is not None and t.is_contiguous() for column in columns for t in column):
        if any(t is None for column in columns for t in column):
            raise ValueError(
                "adamw8bit_step_multi: a state tuple holds None; give the 4 tensors of STATE_KEYS, or 8 with"
                " the residuals of error feedback (all of them)"
            )
        raise ValueError("adamw8bit_step_multi: every state tensor must be contiguous; pass t.contiguous()")
    columns += [[] for _ in range(len(TENSOR_ARGS) - 2 - len(columns))]
    if KERNEL_DISPATCH.inline_twins:
        _step_each((params, grads, *columns), steps, hyper, twins=True)
        return
    if count:
        _OP(params, grads, *columns, steps, *hyper)


def adamw8bit_step(
    param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], *, step: int, hyper: AdamW8bitHyper
) -> None:
    """`adamw8bit_step_multi` for one parameter (contiguous tensors of any shape)."""
    adamw8bit_step_multi([param], [grad], [state], steps=[step], hyper=hyper)
