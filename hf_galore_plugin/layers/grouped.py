"""The per-step code of a :class:`~.experts.GaLoreExpertStack`: E GaLore layers over rows sorted by expert, in
grouped GEMMs sized by a tensor of offsets, never by host ints.

    y[rows of e] = alpha * x_e W0_e^T + x_e Q_e B_e^T P_e^T        (e = 0 .. E-1)

The rows `x` (S x n) are sorted by expert; ``offs`` (E, int32) holds the cumulative row counts, so expert e
owns rows ``offs[e-1]:offs[e]`` and rows from ``offs[-1]`` on belong to no expert. Every GEMM of the layer
is one grouped GEMM (``torch._grouped_mm``): ``(S x k) . (E x k x n)`` per expert's rows, and for the
gradients of the factor and the refresh record the 2-D form ``(k x S) . (S x n) -> (E x k x n)``, which
sums each expert's rows (an expert without rows gets zeros). No shape depends on the routing, so a
compiled model traces the dispatch into its graph (no break, no recompile per step) and no step reads a
routed count to the host.

torch's ``_grouped_mm`` is wrapped in two custom ops (``hf_galore::grouped_mm``, ``hf_galore::grouped_mm_t``):
its own meta function accepts bf16 only (the CUDA fast path), so a traced fp32 model would fail on fake
tensors; the ops register shape functions for every float dtype and the gradient of ``grouped_mm``. The
kernel needs every operand's leading stride to be a multiple of 16 bytes: an operand without (a rank that
is not a multiple of 16 bytes' values) is copied into a padded buffer first. A dtype the kernel lacks
(float64) runs a loop over the experts, which reads the offsets to the host. On CUDA, torch's kernel is a
grouped GEMM for bf16 on recent GPUs and otherwise torch's own loop over the experts, which copies the
offsets to the host (not run here).

Rows past ``offs[-1]`` (slots routed to no local expert) are left unwritten by the kernel: the caller masks
them at the input and at the output (:meth:`~.experts.GaLoreExperts.forward`), and every sum over rows
here (factor gradient, record) stops at ``offs[-1]``.

The refresh record: eagerly a hook on the output; compiled, the pair of ops ``grouped_record_tap`` /
``grouped_record_gradient`` (the grouped form of :mod:`.function`'s ``record_tap``, which also carries the
offsets), whose eager body asks the stack whether it is due.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from .function import frozen_base, recorder

__all__ = ["grouped_galore", "grouped_mm", "grouped_mm_t", "offsets_of"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def offsets_of(counts: list[int], device: torch.device) -> torch.Tensor:
    """The int32 cumulative row counts of experts receiving `counts[e]` rows each."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` (a matrix or a stack of them) if the grouped kernel takes its strides (one of the last two 1, the
    other and the batch stride multiples of 16 bytes), else a copy with its rows padded to 16 bytes."""
    align = 16 // t.element_size()
    strides = t.stride()
    inner = (strides[-1] == 1 and strides[-2] % align == 0) or (strides[-2] == 1 and strides[-1] % align == 0)
    if inner and (t.dim() == 2 or strides[0] % align == 0):
        return t
    cols = t.shape[-1]
    padded = t.new_empty(*t.shape[:-1], -(-cols // align) * align)[..., :cols]
    return padded.copy_(t)


def _loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, weight_form: bool) -> torch.Tensor:
    """The grouped GEMM as a loop over the experts (a dtype the kernel lacks): reads the offsets to the host."""
    bounds = [0, *offs.tolist()]
    if weight_form:  # (k x S) . (S x n) -> (E x k x n)
        return torch.stack([a[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]] for e in range(len(offs))])
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for e in range(len(offs)):
        out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ b[e]
    return out


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, weight_form: bool) -> torch.Tensor:
    """torch's grouped kernel on operands it takes (:func:`_aligned`), or the loop for a dtype it lacks."""
    if a.dtype not in _KERNEL_DTYPES or a.dtype != b.dtype:
        return _loop(a, b, offs, weight_form=weight_form)
    out = torch._grouped_mm(_aligned(a), _aligned(b), offs=offs)
    return out if out.is_contiguous() else out.contiguous()  # a narrow output comes back padded


@torch.library.custom_op("hf_galore::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of `a` (S x k) times `b[e]` (k x n): S x n. Rows from ``offs[-1]`` on are
    not written (any value)."""
    return _grouped(a, b, offs, weight_form=False)


@grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("hf_galore::grouped_mm_t", mutates_args=())
def grouped_mm_t(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per expert e, columns ``offs[e-1]:offs[e]`` of `a` (k x S) times the same rows of `b` (S x n): E x k x n
    (zeros for an expert without rows; columns and rows from ``offs[-1]`` on are not read)."""
    return _grouped(a, b, offs, weight_form=True)


@grouped_mm_t.register_fake
def _grouped_mm_t_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, offs = inputs
    # Only what a gradient needs: W0 and the bases need none, so their GEMMs keep only `b` (a view of W0).
    ctx.save_for_backward(a if b.requires_grad else None, b if a.requires_grad else None, offs)
    ctx.b_transposed = b.stride(-2) == 1 and b.stride(-1) != 1  # B^T of a factor: its gradient in that layout


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
    a, b, offs = ctx.saved_tensors
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.hf_galore.grouped_mm(grad, b.mT, offs)
    if ctx.needs_input_grad[1]:
        if ctx.b_transposed:
            grad_b = torch.ops.hf_galore.grouped_mm_t(grad.mT, a, offs).mT
        else:
            grad_b = torch.ops.hf_galore.grouped_mm_t(a.mT, grad, offs)
    return grad_a, grad_b, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


# ---------------------------------------------------------------------- the refresh record, compiled
@torch.library.custom_op("hf_galore::grouped_record_tap", mutates_args=())
def grouped_record_tap(h: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, layer: int) -> torch.Tensor:
    """Identity on `h` (a copy); its backward hands (dy, x, offs) to stack `layer`'s record. The stack sees
    `x` first (``observe_traced_input``: the phases packed at the first training forward)."""
    target = recorder(layer)
    if target is not None:
        target.observe_traced_input(-1, x)
    return h.clone()


@grouped_record_tap.register_fake
def _grouped_record_tap_fake(h: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("hf_galore::grouped_record_gradient", mutates_args=())
def grouped_record_gradient(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, layer: int) -> torch.Tensor:
    """Hand (dy, x, offs) to stack `layer`'s record if it is due; returns dy (a copy)."""
    target = recorder(layer)
    if target is not None:
        target.record_traced_grouped(dy, x, offs)
    return dy.clone()


@grouped_record_gradient.register_fake
def _grouped_record_gradient_fake(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(dy)


def _tap_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, x, offs, ctx.layer = inputs
    ctx.save_for_backward(x, offs)


def _tap_backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
    x, offs = ctx.saved_tensors
    return torch.ops.hf_galore.grouped_record_gradient(grad, x, offs, ctx.layer), None, None, None


grouped_record_tap.register_autograd(_tap_backward, setup_context=_tap_setup)


# ---------------------------------------------------------------------- the stack's forward
# A stack's W0 stored quantized is dequantized whole (one grouped GEMM, no host read of the offsets) while its
# dequantized copy is at most this many bytes; a larger stack is dequantized a few experts at a time, each group
# of experts' GEMM on its own rows, at the cost of one host read of the offsets per forward and backward. The
# whole copy would be a transient the size of the unquantized stack (Qwen3-30B-A3B's gate_up_proj: 0.8 GB in
# bf16), which quantizing W0 is there to avoid; the loop keeps it at the size of a linear layer's.
READ_BUDGET_BYTES = 64 * 2**20


class _QuantizedBase(torch.autograd.Function):
    """alpha-free ``x_e W0_e^T`` for a W0 stored quantized, eagerly: `read(dtype)` dequantizes the stack, and
    `read_expert(e, dtype)` expert e's slice, in the forward and again in the backward (no dequantized copy is
    kept across the step, as :class:`~.function.WrittenOutLinear` does for a linear layer); the whole stack
    at once up to READ_BUDGET_BYTES, else experts in groups within it."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, read: Callable, read_expert: Callable, shape: torch.Size, offs: torch.Tensor
    ):
        ctx.read, ctx.read_expert, ctx.shape = read, read_expert, shape
        ctx.save_for_backward(offs)
        return _quantized_base(x, read, read_expert, shape, offs, transpose=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (offs,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _quantized_base(grad, ctx.read, ctx.read_expert, ctx.shape, offs, transpose=False)
        return grad_x, None, None, None, None


def _quantized_base(
    x: torch.Tensor, read: Callable, read_expert: Callable, shape: torch.Size, offs: torch.Tensor, *, transpose: bool
) -> torch.Tensor:
    """``x_e W0_e^T`` (`transpose`) or ``x_e W0_e`` for rows `x` sorted by expert, W0 (E x m x n, `shape`) read in
    x's dtype within READ_BUDGET_BYTES (see there)."""
    experts = int(shape[0])
    per_expert = math.prod(shape[1:]) * x.element_size()
    group = max(1, READ_BUDGET_BYTES // per_expert)
    if group >= experts:
        weight = read(x.dtype)
        return grouped_mm(x, weight.mT if transpose else weight, offs)
    out = x.new_zeros(x.shape[0], int(shape[1] if transpose else shape[2]))
    if is_fake(offs):
        # Shapes only (the memory planner): the rows are taken as spread evenly over the experts.
        bounds = [min(x.shape[0], x.shape[0] * (e + 1) // experts) for e in range(experts)]
    else:
        bounds = offs.tolist()  # one host read: each group of experts' GEMM is sized by its rows
    for first in range(0, experts, group):
        last = min(first + group, experts)
        start = bounds[first - 1] if first else 0
        stop = bounds[last - 1]
        if stop == start:
            continue
        weight = torch.stack([read_expert(e, x.dtype) for e in range(first, last)])
        local = torch.tensor(bounds[first:last], dtype=offs.dtype, device=offs.device) - start
        out[start:stop] = grouped_mm(x[start:stop], weight.mT if transpose else weight, local)
        del weight
    return out


def grouped_galore(
    x: torch.Tensor,
    offs: torch.Tensor,
    factor: torch.Tensor,
    weight: Optional[torch.Tensor],
    read_weight: Callable[[torch.dtype], torch.Tensor],
    read_expert: Optional[Callable[[int, torch.dtype], torch.Tensor]],
    p: Optional[torch.Tensor],
    q: Optional[torch.Tensor],
    alpha: float | torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    record: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None,
    traced_record: Optional[int] = None,
) -> torch.Tensor:
    """The stack's output for rows `x` (S x n) sorted by expert, `offs` their int32 cumulative counts.

    `factor` (E x m x r, E x r x n, or E x m x n without bases) is trainable; `weight` is W0 (E x m x n) when
    plain (None: read with `read_weight(dtype)`); `p` (E x m x r) and `q` (E x n x r) are the bases in `dtype`
    (the compute dtype), or None; `alpha` a float (eager) or a 0-d tensor (traced); `scale` 1 where a stored
    basis carries it. `record`, on an eager step that records, is called with (dy, x, offs) once the output's
    gradient arrives; `traced_record` (compiled, on record steps) is the stack's recorder id for the record ops.
    """
    weight = frozen_base(weight, traced=isinstance(alpha, torch.Tensor))
    xc = x if x.dtype == dtype else x.to(dtype)
    b = factor if factor.dtype == dtype else factor.to(dtype)
    if scale != 1.0:
        b = b * scale
    h = xc if q is None else grouped_mm(xc, q, offs)
    h = grouped_mm(h, b.mT, offs)
    if p is not None:
        h = grouped_mm(h, p.mT, offs)
    if traced_record is not None and h.requires_grad:
        h = grouped_record_tap(h, xc, offs, traced_record)  # dL/dh is dy: W0's term is added to h as it is
    if isinstance(alpha, torch.Tensor):
        # Traced: a quantized W0 is read inside a checkpointed region, so the compiler reads it again from its
        # codes in the backward instead of saving the dequantized stack (as galore_linear does).
        base = weight if weight is not None else checkpoint(read_weight, dtype, use_reentrant=False)
        y = torch.addcmul(h, grouped_mm(xc, base.to(dtype).mT, offs), alpha.to(dtype))
    elif weight is None:
        assert read_expert is not None, "a W0 stored quantized is read by expert too"
        shape = torch.Size((factor.shape[0], h.shape[-1], xc.shape[-1]))
        y = torch.add(h, _QuantizedBase.apply(xc, read_weight, read_expert, shape, offs), alpha=alpha)
    else:
        y = torch.add(h, grouped_mm(xc, (weight if weight.dtype == dtype else weight.to(dtype)).mT, offs), alpha=alpha)
    if record is not None and y.requires_grad:
        y.register_hook(lambda dy: record(dy, xc, offs))
    return y
