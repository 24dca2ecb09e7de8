"""The per-step code of a GaLore layer: its autograd function and the low-rank matmuls.

    y = alpha * x W0^T + scale * lowrank(x) + bias,   lowrank(x) = x Q B^T P^T (P, Q: the bases, if any)

The backward skips the weight GEMM of the frozen W0 and computes only dX and dB = scale * P^T G Q,
right-to-left so that no m x n tensor is formed; on a refresh step it also hands dy and x to the
layer's recorder. Everything here runs on every training step: it reads the layer's tensors
directly (``base_weight``, ``basis``, ``base_multiplier``) and adds no Python layers of its own.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["GaLoreLinearFunction", "lowrank_backward_factor", "lowrank_backward_input", "lowrank_forward"]


def lowrank_forward(
    x: torch.Tensor, factor: torch.Tensor, p: Optional[torch.Tensor], q: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """scale * x Q B^T P^T (each basis left out where it is None)."""
    h = x if q is None else x @ q
    h = h @ factor.to(x.dtype).mT
    if p is not None:
        h = h @ p.mT
    return h * scale


def lowrank_backward_input(
    dy: torch.Tensor, factor: torch.Tensor, p: Optional[torch.Tensor], q: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """The low-rank branch's part of dX: scale * dy P B Q^T."""
    h = dy if p is None else dy @ p
    h = h @ factor.to(dy.dtype)
    if q is not None:
        h = h @ q.mT
    return h * scale


def lowrank_backward_factor(
    dy: torch.Tensor,
    x: torch.Tensor,
    p: Optional[torch.Tensor],
    q: Optional[torch.Tensor],
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """dB = scale * P^T G Q in `dtype` with G = dy^T x, evaluated right-to-left so no m x n tensor is formed
    (dy: N x m, x: N x n)."""
    a = dy if p is None else dy @ p  # (N, r_left or m)
    b = x if q is None else x @ q  # (N, r_right or n)
    return (a.mT @ b).to(dtype) * scale


class GaLoreLinearFunction(torch.autograd.Function):
    """y = alpha * x W0^T + scale * lowrank(x) + bias, with the W0 weight-gradient GEMM skipped.

    `layer` is the :class:`~hf_galore_plugin.layers.GaLoreLinear` whose tensors these are.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: torch.Tensor, bias: Optional[torch.Tensor], layer: Any):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Mixed precision: compute in the autocast dtype, as nn.Linear would; backward (which runs
            # outside autocast) then sees the same dtype.
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return GaLoreLinearFunction._forward(ctx, x, factor, bias, layer)

    @staticmethod
    def _forward(ctx, x, factor, bias, layer):
        base = layer.base_weight(x.dtype)
        y = F.linear(x, base)
        del base  # a dequantized int8/NF4 copy is freed here, one layer at a time
        y = y * layer.base_multiplier.to(y.dtype)
        y = y + lowrank_forward(
            x, factor, layer.basis("left", x.dtype), layer.basis("right", x.dtype), layer.config.scale
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        # Read here, as a Python bool kept up to date outside the step, so torch.compile traces the
        # backward without a tensor-to-Python sync (the flag cannot change between forward and backward).
        ctx.record = layer.refresh_due
        ctx.save_for_backward(x, factor)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, factor = ctx.saved_tensors
        layer = ctx.layer
        grad_x = grad_factor = grad_bias = None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        scale = layer.config.scale
        # The bases are read (dequantized, for INT4/INT8 storage) once for both low-rank terms, and freed
        # before W0 is: no basis copy is alive next to the W0 copy, and the W0 term is formed in place so
        # that W0, the low-rank term and dX are the most that is alive at once.
        p, q = layer.basis("left", dy.dtype), layer.basis("right", dy.dtype)
        if ctx.needs_input_grad[1]:
            grad_factor = lowrank_backward_factor(dy, x2, p, q, scale, layer.galore_factor.dtype)
        if ctx.needs_input_grad[0]:
            lowrank = lowrank_backward_input(grad_out, factor, p, q, scale)
            del p, q
            base = layer.base_weight(grad_out.dtype)
            grad_x = grad_out @ base
            del base
            grad_x.mul_(layer.base_multiplier.to(grad_out.dtype))
            grad_x.add_(lowrank)
            del lowrank
        else:
            del p, q
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(0)
        if ctx.record:
            layer._record_gradient(dy, x2)
        return grad_x, grad_factor, grad_bias, None
