"""Optimizers the planner counts by their documented state layout, for competitors that are not installed here
(or cannot run under fake tensors): the model, activations and gradients are still traced, and the optimizer
state is allocated tensor by tensor as the method stores it. The step itself moves each parameter in place
(``p -= lr * grad``): the real methods' steps are fused kernels whose temporaries are not modelled.

Layouts (bytes per parameter value on top of the weight and its gradient, both in the training dtype):

- ``adamw_torchao_8bit``: torchao ``AdamW8bit`` (``torchao.optim``): two uint8 moments per value and one
  fp32 scale per 256-value block for a tensor of at least 4096 values whose size the block divides; any
  other tensor keeps both moments dense in its own dtype. 2 + 8/256 bytes.
- ``adamw_torchao_4bit``: torchao ``AdamW4bit``: the same rule with two 4-bit moments (packed two per byte)
  and one fp32 scale per 128-value block. 1 + 8/128 bytes.
- ``flash_adamw``: FlashOptim's AdamW (Gonzalez Ortiz et al., 2026, arXiv:2602.23349): the weight kept in
  16 bits with an int8 correction of the fp32 master value (master-weight splitting), both moments in 8 bits
  after companding, with one 16-bit scale per group of 32 values each (the group size is our reading of the
  paper; its table gives 7 bytes per parameter with 16-bit gradients, 5 with gradient release). 3 + 4/32
  bytes. Gradient release (the step runs in each parameter's gradient hook) is reported as a second peak
  without the gradients (``gradient_release_peak_bytes``).
- ``apollo_adamw``: APOLLO (Zhu et al., 2024, arXiv:2412.05270) as transformers' ``optim="apollo_adamw"``
  builds it (``apollo_torch.APOLLOAdamW``, projection "random", the planner's ``--rank``): for every decoder
  linear weight, two moments of the projected gradient (its larger side x rank) and the projection matrix
  (rank x its smaller side), in the gradient's dtype; every other parameter two dense moments. The gradient
  of every weight is dense, as in galore-torch.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

__all__ = ["LAYOUT_METHODS", "LayoutAdamW", "layout_optimizer"]

LAYOUT_METHODS = ("adamw_torchao_8bit", "adamw_torchao_4bit", "flash_adamw", "apollo_adamw")

Spec = list[tuple[tuple[int, ...], torch.dtype]]  # the state tensors of one parameter: (shape, dtype) each


class LayoutAdamW(torch.optim.Optimizer):
    """Allocates each parameter's state as `layout(param)` says at its first step, then moves it in place."""

    def __init__(self, params: Iterable, layout: Callable[[torch.Tensor], Spec], lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.layout = layout

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    for index, (shape, dtype) in enumerate(self.layout(p)):
                        state[f"buffer{index}"] = torch.zeros(shape, dtype=dtype, device=p.device)
                p.add_(p.grad, alpha=-group["lr"])
        return None


def _blockwise(bits: int, block: int) -> Callable[[torch.Tensor], Spec]:
    def layout(p: torch.Tensor) -> Spec:
        n = p.numel()
        if n >= 4096 and n % block == 0:
            codes = ((math.ceil(n * bits / 8),), torch.uint8)
            scales = ((n // block,), torch.float32)
            return [codes, scales, codes, scales]
        return [(tuple(p.shape), p.dtype)] * 2

    return layout


def _flash(p: torch.Tensor) -> Spec:
    n = p.numel()
    groups = math.ceil(n / 32)
    return [
        ((n,), torch.int8),  # master-weight correction
        ((n,), torch.int8),  # first moment
        ((groups,), torch.float16),
        ((n,), torch.uint8),  # second moment
        ((groups,), torch.float16),
    ]


def _apollo(targets: set[int], rank: int) -> Callable[[torch.Tensor], Spec]:
    def layout(p: torch.Tensor) -> Spec:
        if id(p) not in targets or p.dim() != 2:
            return [(tuple(p.shape), p.dtype)] * 2
        rows, cols = p.shape
        r = min(rank, rows, cols)
        # galore-torch's projector rule, which APOLLO's follows: the smaller side is projected
        projected = (rows, r) if rows >= cols else (r, cols)
        return [(projected, p.dtype), (projected, p.dtype), ((r, min(rows, cols)), p.dtype)]

    return layout


def layout_optimizer(method: str, params: list, *, lr: float, targets: set[int], rank: int) -> tuple[LayoutAdamW, str]:
    """The layout optimizer of `method` over `params` and the planner's note for it; `targets`: ids of the
    weights a low-rank method projects (the decoder's linear layers)."""
    if method == "adamw_torchao_8bit":
        return LayoutAdamW(params, _blockwise(8, 256), lr), "torchao AdamW8bit layout (2 B/value + fp32 scale per 256)"
    if method == "adamw_torchao_4bit":
        return LayoutAdamW(params, _blockwise(4, 128), lr), "torchao AdamW4bit layout (1 B/value + fp32 scale per 128)"
    if method == "flash_adamw":
        return (
            LayoutAdamW(params, _flash, lr),
            "FlashOptim AdamW layout (int8 weight correction, 8-bit moments, fp16 scale per 32; 7 B/param with 16-bit "
            "gradients, gradient_release_peak_bytes without them)",
        )
    if method == "apollo_adamw":
        return (
            LayoutAdamW(params, _apollo(targets, rank), lr),
            f"APOLLO layout (apollo_torch.APOLLOAdamW via transformers, rank {rank} random projection on the decoder's "
            "linear layers, dense gradients every step)",
        )
    raise ValueError(f"no state layout for method {method!r}; layouts: {', '.join(LAYOUT_METHODS)}")
