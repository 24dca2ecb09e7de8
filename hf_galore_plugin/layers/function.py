"""The per-step code of a GaLore layer: its forward and, for a quantized W0, its backward.

    y = alpha * x W0^T + scale * x Q B^T P^T + bias      (P, Q: the bases, each left out where there is none)

Everything here runs on every training step of every layer, so it is written in launches and in host
work, the two fixed costs a GPU waits for:

- The scale is not applied here: the layer folds it into one stored basis (``scale * Q``, see
  :mod:`.linear`) and passes ``scale=1``; only a layer without a stored basis (identity sides) passes its
  scale, which then multiplies the small factor B (r x m values, not N x m).
- :class:`WrittenOutLinear`, the whole layer as one autograd node with a written-out backward: alpha
  and scale are the GEMMs' ``alpha``/``beta``, the branch's last GEMM adds its product into the output of
  the W0 GEMM in place (forward: y; backward: dX), so no N x m or N x n temporary is written and read
  again for a sum, and ``x Q`` is saved from the forward. A W0 stored quantized always takes it: its
  backward dequantizes W0 again rather than keeping the m x n copy from the forward (which would cost
  what quantizing saved), and from FORM_MIN_TOKENS tokens, where they outnumber what it costs
  (:func:`_form`: counted multiply-adds), the forward and dX go through W = alpha W0 + scale P B Q^T formed
  in the dequantized copy (one ``addmm_`` into a temporary that exists anyway, then one GEMM over the
  tokens) instead of the branch's GEMMs over the tokens.
- W0 as loaded takes the node from WRITTEN_OUT_MIN_VALUES activation values per call (tokens times the
  larger side), where the passes it saves outweigh its Python; below that, autograd's own ops (C++, no
  Python per layer): the thin GEMMs of the branch and one ``addmm`` that forms ``alpha * x W0^T`` and adds
  the branch, the backward derived. Either way W0 gets no gradient (one an engine hands over as a view of a
  parameter that requires a gradient is detached), so the weight GEMM of W0 is skipped and no m x n tensor is formed, and a plain W0 is read as it is, never formed into (the copy
  forming needs costs more than the fold saves: docs/benchmarks/step-time.md).

Rounding: a scale folded into a basis is exact for the presets' power-of-two scales and rounded once into
the basis otherwise; the GEMMs' ``alpha``/``beta`` round inside the GEMM; a formed W is rounded once into
the compute dtype, as a dense layer's weight is. The results stay within the dense reference's
tolerances (tests/test_core.py, ``test_forward_and_gradients_match_dense_linear``: both paths, both
forms, scales 0.25 and 0.3).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.checkpoint import checkpoint

__all__ = ["WrittenOutLinear", "frozen_base", "galore_linear", "recorder", "register_recorder"]

# The ``input`` of an addmm with beta=0: BLAS ignores it, broadcasting needs only a 0-d tensor. One per
# (device, dtype), made once, so a GEMM scaled by alpha allocates no zeros.
_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zero(like: torch.Tensor) -> torch.Tensor:
    key = (like.device, like.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        # Always a real tensor, even when the first call runs under a fake-tensor mode (the memory planner's
        # trace): a cached fake zero would turn every later real result fake.
        with unset_fake_temporarily():
            zero = _ZEROS[key] = torch.zeros((), device=like.device, dtype=like.dtype)
    return zero


# ---------------------------------------------------------------------- the refresh record, compiled
# Eager code records a refresh step's gradient with a hook on the layer's output, registered only on the layers
# that are due. Compiled code cannot do either: a hook traced into the graph takes the record (a Python
# side effect, a random generator for the sketch) with it, and a Python "is this layer due" read in the
# forward is a guard, so every phase of the staggered schedule (a different set of due layers) would be a
# graph of its own. So in a compiled forward the record is two opaque ops, the same in every layer and on
# every record step: ``record_tap`` (forward: a copy of the branch's output h, saving x) and, in its
# backward, ``record_gradient`` (dL/dh, which is the layer's dy, passed through as a copy) whose eager body
# asks the layer whether it is due and records (dy, x) if so. The only guarded value is the layer's
# ``compiled_record`` flag, which the step driver sets alike on every layer of a model (True on the steps
# where any of them records): two graphs for the whole run, whatever the number of layers and phases. The
# copies and the saved x are paid on record steps only (amortized over update_proj_gap). The ops find the
# layer by a process-wide integer id (an int is a constant in the graph; a module is not an op argument).
_RECORDERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_RECORDER_IDS = itertools.count()


def register_recorder(layer: Any) -> int:
    """An id under which the compiled record ops find `layer` (held weakly); `layer` implements
    ``observe_traced_input(part, x)`` and ``record_traced(part, dy, x)``."""
    key = next(_RECORDER_IDS)
    _RECORDERS[key] = layer
    return key


def recorder(key: int) -> Any:
    """The layer registered under `key` (None once it is gone): for record ops of other layer kinds."""
    return _RECORDERS.get(key)


@torch.library.custom_op("hf_galore::record_tap", mutates_args=())
def record_tap(h: torch.Tensor, x: torch.Tensor, layer: int, part: int) -> torch.Tensor:
    """Identity on `h` (a copy: an op's output may not alias its input); its backward records (dy, x). The
    layer sees `x` first (``observe_traced_input``: the phases packed at the first training forward)."""
    target = _RECORDERS.get(layer)
    if target is not None:
        target.observe_traced_input(part, x)
    return h.clone()


@record_tap.register_fake
def _record_tap_fake(h: torch.Tensor, x: torch.Tensor, layer: int, part: int) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("hf_galore::record_gradient", mutates_args=())
def record_gradient(dy: torch.Tensor, x: torch.Tensor, layer: int, part: int) -> torch.Tensor:
    """Hand (dy, x) to layer `layer`'s record if the layer is due (`part`: its expert, -1 for a linear layer);
    returns dy (a copy, so the op has an output the backward uses and no compiler drops the call)."""
    target = _RECORDERS.get(layer)
    if target is not None:
        target.record_traced(part, dy, x)
    return dy.clone()


@record_gradient.register_fake
def _record_gradient_fake(dy: torch.Tensor, x: torch.Tensor, layer: int, part: int) -> torch.Tensor:
    return torch.empty_like(dy)


def _record_tap_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, x, ctx.layer, ctx.part = inputs
    ctx.save_for_backward(x)


def _record_tap_backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
    (x,) = ctx.saved_tensors
    return torch.ops.hf_galore.record_gradient(grad, x, ctx.layer, ctx.part), None, None, None


record_tap.register_autograd(_record_tap_backward, setup_context=_record_tap_setup)


class WrittenOutLinear(torch.autograd.Function):
    """The whole layer, ``bias + alpha * x W0^T + scale * x Q B^T P^T``, as one autograd node.

    W0: a plain `weight`, saved for the backward as autograd's own GEMM would save it and cast to `dtype` in
    each pass where it differs; or, `weight` None, quantized: `read(dtype)` dequantizes a copy, in the forward
    and again in the backward (never kept across the step). alpha and scale
    are the ``alpha``/``beta`` of the GEMMs (no pass over activations, no ``scale * B``), ``x Q`` is saved
    from the forward, and the branch's last GEMM adds into the W0 GEMM's output in place. Forward: ``x Q``,
    the W0 GEMM (with the bias), the branch's GEMMs, the last accumulating; backward: dB, the W0 GEMM for
    dX, the branch back into it. With many tokens a quantized W0's passes instead form W in the dequantized
    copy (nothing else holds it) and make one GEMM over the tokens with it.

    `x`: (..., n), flattened to N x n inside, so the leading dimensions cost no autograd view nodes (the
    output is (..., m), made with ``_unsafe_view``: a tensor of its own for autograd, so a caller may modify
    it in place); `p` (m x r), `q` (n x r): the bases in `dtype` (the compute dtype), or None; `factor`,
    `x` and `bias` are cast to `dtype` inside, their gradients returned in their own dtypes.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: torch.Tensor, bias: Optional[torch.Tensor],
                weight: Optional[torch.Tensor], read: Callable[[torch.dtype], torch.Tensor],
                p: Optional[torch.Tensor], q: Optional[torch.Tensor], alpha: float, scale: float,
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        xc = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if xc.dtype != dtype:
            xc = xc.to(dtype)
        b = factor if factor.dtype == dtype else factor.to(dtype)
        t = xc if q is None else xc @ q
        bias_c = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        if weight is None and xc.shape[0] >= FORM_MIN_TOKENS and _form(xc.shape[0], b.shape, p, q, backward=False):
            # Many tokens: the branch's GEMMs over them cost more than folding B into the dequantized W0.
            formed = _effective_into(read(dtype), b, p, q, alpha, scale)
            y = xc @ formed.mT if bias_c is None else torch.addmm(bias_c, xc, formed.mT)
            del formed
        else:
            if p is None:
                u, last = t, b.mT
            else:
                u, last = t @ b.mT, p.mT
            base = _base(weight, read, dtype)
            if bias_c is None:
                y = xc @ base.mT
                y.addmm_(u, last, beta=alpha, alpha=scale)
            else:
                y = torch.addmm(bias_c, xc, base.mT, alpha=alpha)
                y.addmm_(u, last, alpha=scale)
            del base  # a dequantized copy is freed here, one layer at a time
        ctx.save_for_backward(t, b, p, q, weight)
        ctx.read, ctx.alpha, ctx.scale = read, alpha, scale
        ctx.dtypes = (x.dtype, factor.dtype, None if bias is None else bias.dtype)
        ctx.x_shape = x.shape
        return y if x.dim() == 2 else torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        t, b, p, q, weight = ctx.saved_tensors
        x_dtype, factor_dtype, bias_dtype = ctx.dtypes
        needs_x, needs_factor, needs_bias = ctx.needs_input_grad[:3]
        if dy.dim() != 2:
            dy = dy.reshape(-1, dy.shape[-1])
        if dy.dtype != t.dtype:
            dy = dy.to(t.dtype)
        du = dy if p is None else dy @ p  # the gradient of x Q B^T (unscaled: scale goes into the GEMMs)
        grad_x = grad_factor = grad_bias = None
        scale = ctx.scale
        if needs_factor:
            grad_factor = du.mT @ t if scale == 1.0 else torch.addmm(_zero(du), du.mT, t, beta=0, alpha=scale)
            if grad_factor.dtype != factor_dtype:
                grad_factor = grad_factor.to(factor_dtype)
        if needs_x:
            base = _base(weight, ctx.read, dy.dtype)
            if weight is None and dy.shape[0] >= FORM_MIN_TOKENS and _form(dy.shape[0], b.shape, p, q, backward=True):
                grad_x = dy @ _effective_into(base, b, p, q, ctx.alpha, scale)
            else:
                grad_x = dy @ base
                if q is None:
                    grad_x.addmm_(du, b, beta=ctx.alpha, alpha=scale)
                else:
                    grad_x.addmm_(du @ b, q.mT, beta=ctx.alpha, alpha=scale)
            del base
            if grad_x.dtype != x_dtype:
                grad_x = grad_x.to(x_dtype)
            if len(ctx.x_shape) != 2:
                grad_x = grad_x.view(ctx.x_shape)
        if needs_bias:
            grad_bias = dy.sum(0)
            if grad_bias.dtype != bias_dtype:
                grad_bias = grad_bias.to(bias_dtype)
        return grad_x, grad_factor, grad_bias, None, None, None, None, None, None, None


# A plain W0 takes WrittenOutLinear from this many activation values per call (tokens x the larger of the layer's
# two sides); below it autograd's ops. The node saves passes over activations (the sums of the two terms of y and
# of dX as separate tensors) and costs its Python per layer: with it every layer of the tiny Llama at 1 x 32 tokens
# made the step 7% slower (~18 us a layer), while from 1024 tokens (its MLP layers above this count) the step is
# 2-3% faster than with autograd's ops (`benchmarks/step_overhead.py --autograd`, docs/benchmarks/step-time.md).
WRITTEN_OUT_MIN_VALUES = 1 << 17

# Below this many tokens per call the branch is kept: the fold would save a few percent of the layer's small
# GEMMs, and one formulation for every small batch keeps runs that split a batch differently (data-parallel
# ranks against one process, the engine comparisons) on the same rounding.
FORM_MIN_TOKENS = 1024


def _form(
    tokens: int, factor: torch.Size, p: Optional[torch.Tensor], q: Optional[torch.Tensor], *, backward: bool
) -> bool:
    """Whether the forward's ``x W^T`` (or, `backward`, dX = dy W) goes through W = alpha W0 + scale P B Q^T
    formed in the dequantized W0 rather than through the low-rank branch, by the multiply-adds of the GEMMs
    that differ (``x Q`` and ``dy P``, needed for dB, are computed either way). B is (r_p or m) x (r_q or n).
    Callers test ``tokens >= FORM_MIN_TOKENS`` first, so a small call does not enter this function.
    """
    rows, cols = factor
    m = rows if p is None else p.shape[0]
    n = cols if q is None else q.shape[0]
    fold = (0 if p is None else m * rows * cols) + (0 if q is None else m * cols * n)  # P B, then @ Q^T
    if backward:  # (dy P) B over the tokens, then @ Q^T
        branch = tokens * rows * cols + (0 if q is None else tokens * cols * n)
    else:  # (x Q) B^T over the tokens, then @ P^T
        branch = tokens * cols * rows + (0 if p is None else tokens * rows * m)
    return fold < branch


def _effective_into(
    base: torch.Tensor, b: torch.Tensor, p: Optional[torch.Tensor], q: Optional[torch.Tensor], alpha, scale: float
) -> torch.Tensor:
    """alpha * base + scale * P B Q^T (m x n, in base's dtype), written into `base`, a fresh dequantized copy of
    W0 that nothing else holds. Rounded once into the compute dtype, as a dense layer's weight is."""
    if q is not None:
        return base.addmm_(b if p is None else p @ b, q.mT, beta=alpha, alpha=scale)
    if p is not None:
        return base.addmm_(p, b, beta=alpha, alpha=scale)
    if alpha != 1.0:
        base.mul_(alpha)
    return base.add_(b, alpha=scale)


def galore_linear(
    x: torch.Tensor,
    factor: torch.Tensor,
    bias: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    read_weight: Callable[[torch.dtype], torch.Tensor],
    p: Optional[torch.Tensor],
    q: Optional[torch.Tensor],
    alpha: float | torch.Tensor,
    scale: float,
    record: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
    residual: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
    traced_record: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """One GaLore layer's output for input `x` (..., n).

    `factor` is B (trainable); `weight` is W0 when it is a plain tensor (None: stored quantized, read with
    `read_weight(dtype)`); the bases `p` (m x r) and `q` (n x r) are in the compute dtype, or None;
    `alpha` and `scale` are Python floats (`alpha` a 0-d tensor in traced code). `record`, given on a step that records a refresh, is called
    with (dy, x) as 2-D tensors when the output's gradient arrives. `residual` (residual mode) is called with
    the same once the node that reads W0 has run its backward (a post hook of that node), so it may write W0.
    `traced_record` (compiled code, on a step where the model records): (recorder id, part) for the record ops.
    """
    weight = frozen_base(weight, traced=isinstance(alpha, torch.Tensor))
    if not isinstance(alpha, torch.Tensor) and (
        weight is None or x.numel() // x.shape[-1] * max(weight.shape) >= WRITTEN_OUT_MIN_VALUES
    ):
        dtype = (p if p is not None else q if q is not None else x).dtype
        if p is None and q is None and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        y = WrittenOutLinear.apply(x, factor, bias, weight, read_weight, p, q, alpha, scale, dtype)
        if record is not None and y.requires_grad:
            y.register_hook(lambda dy: record(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])))
        if residual is not None and y.requires_grad:
            _after_backward(y, residual, x.reshape(-1, x.shape[-1]))
        return y
    x2 = x.reshape(-1, x.shape[-1])
    h = x2 if q is None else x2 @ q
    # scale is 1 where the layer folded it into a stored basis (every layer with one): no multiply at all.
    scaled = factor.mT if scale == 1.0 else (factor * scale).mT
    if p is not None:
        h, last = h @ scaled, p.mT
    else:
        last = scaled
    # The bias enters the branch's last GEMM (in the compute dtype under autocast, as in nn.Linear).
    h = h @ last if bias is None else torch.addmm(bias, h, last)
    if traced_record is not None and h.requires_grad:
        h = record_tap(h, x2, *traced_record)  # dL/dh is dy: the addmm below adds h as it is
    if isinstance(alpha, torch.Tensor):
        # Traced (torch.compile): the multiplier as a tensor, a graph input rather than a constant to
        # specialise on; the compiler fuses the scaling. A quantized W0 is read inside a checkpointed region,
        # so the backward reads it again from its codes (as WrittenOutLinear does eagerly): otherwise the
        # compiler saves every layer's dequantized m x n copy from the forward to the backward, the memory
        # that quantizing W0 saves (tests/test_compile.py counts what the graph saves).
        base = weight if weight is not None else checkpoint(read_weight, h.dtype, use_reentrant=False)
        y = torch.addmm(h, x2 * alpha.to(x2.dtype), base.mT)
    else:
        assert weight is not None
        y = torch.addmm(h, x2, weight.mT, alpha=alpha)
    if record is not None and y.requires_grad:
        y.register_hook(lambda dy: record(dy, x2))
    if residual is not None and y.requires_grad:
        _after_backward(y, residual, x2)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def frozen_base(weight: Optional[torch.Tensor], *, traced: bool) -> Optional[torch.Tensor]:
    """A plain W0 as a GEMM of the layer reads it: without autograd history.

    W0 is frozen, but an engine may hand it over as a view of a parameter that requires a gradient (FSDP1 with
    use_orig_params: a view of the unit's flat parameter, which holds the factor too): autograd would then run the
    weight-gradient GEMM of W0 that GaLore skips, and the engine would reduce its result for nothing. Traced code
    (`traced`) detaches without asking: reading requires_grad would be one more Dynamo guard per layer."""
    if weight is not None and (traced or weight.requires_grad):
        return weight.detach()
    return weight


def _base(
    weight: Optional[torch.Tensor], read: Callable[[torch.dtype], torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """W0 in `dtype` for one pass of WrittenOutLinear: a plain `weight` itself, or cast where its dtype differs (as
    autocast casts a weight for each GEMM); `weight` None: `read(dtype)`, a dequantized copy."""
    if weight is None:
        return read(dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


def _after_backward(y: torch.Tensor, residual: Callable[[torch.Tensor, torch.Tensor], None], x2: torch.Tensor) -> None:
    """Call ``residual(dy, x2)`` (dy 2-D) after the backward of the node that made `y`: the one node that reads
    W0, so W0 may change once it has run (before, autograd would find a saved W0 modified, and dX would see the
    new W0)."""
    node = y.grad_fn
    assert node is not None

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        dy = grad_outputs[0]
        residual(dy.reshape(-1, dy.shape[-1]), x2)

    node.register_hook(hook)
