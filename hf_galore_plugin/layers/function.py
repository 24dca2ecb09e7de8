"""The per-step code of a GaLore layer: its forward, written so that autograd derives the backward.

    y = alpha * x W0^T + x Q (scale B)^T P^T + bias      (P, Q: the bases, each left out where there is none)

Everything here runs on every training step of every layer, so it is written in launches and in host
work, the two fixed costs a GPU waits for:

- The forward is the thin GEMMs of the low-rank branch and one ``addmm`` that forms ``alpha * x W0^T``
  and adds the branch (no pass over the activations for alpha, scale or the sum); scale is applied to
  the small factor B instead (``scale * B``, r x m values, not N x m).
- The backward is autograd's own (C++, no Python per layer): W0 does not require a gradient, so the
  weight GEMM of W0 is skipped and no m x n tensor is formed; dB = scale * (dy P)^T (x Q) comes from the
  branch's GEMMs, and ``x Q`` (N x r) is what autograd saves for it.
- A quantized W0 goes through :class:`DequantizedBaseLinear`, whose backward dequantizes W0 again
  rather than keeping the m x n copy from the forward (which would cost what quantizing saved).

Rounding: ``scale * B`` is rounded once in B's dtype (exact for the power-of-two scales of the presets),
and alpha and the addition of the branch happen inside the GEMM; the result stays within the dense
reference's tolerances (tests/test_core.py, tests/test_layer_function.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["DequantizedBaseLinear", "galore_linear"]

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


class DequantizedBaseLinear(torch.autograd.Function):
    """``h + alpha * x W0^T`` for a W0 stored quantized: `read(dtype)` dequantizes it, in the forward and
    again in the backward. `x`: N x n, `h`: N x m (the low-rank branch, which fixes the compute dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: torch.Tensor, read: Callable[[torch.dtype], torch.Tensor], alpha: float):
        dtype = h.dtype
        base = read(dtype)
        y = torch.addmm(h, x.to(dtype), base.mT, alpha=alpha)
        del base  # freed here, one layer at a time
        ctx.read, ctx.alpha = read, alpha
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            base = ctx.read(dy.dtype)
            grad_x = torch.addmm(_zero(dy), dy, base, beta=0, alpha=ctx.alpha)
        return grad_x, dy, None, None


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
) -> torch.Tensor:
    """One GaLore layer's output for input `x` (..., n).

    `factor` is B (trainable); `weight` is W0 when it is a plain tensor (None: stored quantized, read with
    `read_weight(dtype)`); the bases `p` (m x r) and `q` (n x r) are in the compute dtype, or None;
    `alpha` and `scale` are Python floats (`alpha` a 0-d tensor in traced code). `record`, given on a step that records a refresh, is called
    with (dy, x) as 2-D tensors when the output's gradient arrives.
    """
    x2 = x.reshape(-1, x.shape[-1])
    h = x2 if q is None else x2 @ q
    scaled = (factor * scale).mT
    if p is not None:
        h, last = h @ scaled, p.mT
    else:
        last = scaled
    # The bias enters the branch's last GEMM (in the compute dtype under autocast, as in nn.Linear).
    h = h @ last if bias is None else torch.addmm(bias, h, last)
    if isinstance(alpha, torch.Tensor):
        # Traced (torch.compile): the multiplier as a tensor, a graph input rather than a constant to
        # specialise on; the compiler fuses the scaling.
        base = weight if weight is not None else read_weight(h.dtype)
        y = torch.addmm(h, x2 * alpha.to(x2.dtype), base.mT)
    elif weight is not None:
        y = torch.addmm(h, x2, weight.mT, alpha=alpha)
    else:
        y = DequantizedBaseLinear.apply(x2, h, read_weight, alpha)
    if record is not None and y.requires_grad:
        y.register_hook(lambda dy: record(dy, x2))
    return y.reshape(*x.shape[:-1], y.shape[-1])
