"""The least an eager PyTorch GaLore layer can do per step: the reference rows ("floors") of
`step_overhead.py`.

A floor layer keeps W0 frozen, a right basis Q (n x r, the scale folded in) and trains B (m x r), and its
step is nothing but the tensor work that such a layer cannot avoid, with no checks, counters, refresh,
autocast or engine support:

- `floor_lowrank`: W0 a plain fp32 buffer. Forward ``addmm((x Q) B^T, x, W0^T)`` in autograd's own ops,
  so the backward is autograd's (C++): dB from the saved ``x Q``, dX from W0 and the branch.
- `floor_quantized`: W0 stored as int8 codes with one fp32 multiplier per 256 values, Q as packed 4-bit
  codes with one per 64 (the qgalore preset's layout). W0 must not be kept across the step (keeping the
  m x n copy for the backward costs what quantizing saved), so the layer is one Python autograd function
  that reads W0 in the forward and again in the backward; Q is read once per step. A read is the fewest
  torch ops the layout allows: int8 W0 one multiply; packed 4-bit Q an index conversion, a 256 x 2
  byte-table lookup and a multiply.

Every layer uses the right basis (in each GaLore layer of ours the basis is on the smaller side; at the
benchmark's shapes the GEMMs cost microseconds either way). The optimizer of a floor model is torch's
fused AdamW over all trainable tensors (B, embeddings, norms, head). The quantized codes are made once at
build time with the package's quantizer; a step never calls the package.
"""

from __future__ import annotations

from typing import Any

import torch

W0_BLOCK, BASIS_BLOCK = 256, 64  # the qgalore_adamw_8bit preset's group sizes


class _QuantizedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, b: torch.Tensor, q: torch.Tensor, layer: "FloorLinear") -> torch.Tensor:
        t = x @ q
        y = torch.addmm(t @ b.mT, x, layer.read_weight().mT)
        ctx.save_for_backward(t, b, q)
        ctx.layer = layer
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        t, b, q = ctx.saved_tensors
        grad_b = dy.mT @ t
        grad_x = torch.addmm((dy @ b) @ q.mT, dy, ctx.layer.read_weight())
        return grad_x, grad_b, None, None


class FloorLinear(torch.nn.Module):
    """A minimal GaLore layer replacing `linear` (see the module docstring); `quantized` picks the layout."""

    def __init__(self, linear: torch.nn.Linear, rank: int, scale: float, quantized: bool) -> None:
        super().__init__()
        from hf_galore_plugin.quant import functional
        from hf_galore_plugin.quant.ops import quantize_blockwise

        if linear.bias is not None:
            raise ValueError("the floor layers model bias-free projections (Llama's)")
        weight = linear.weight.detach().to(torch.float32)
        self.shape = tuple(weight.shape)
        out_features, in_features = self.shape
        q, _ = torch.linalg.qr(torch.randn(in_features, rank, generator=torch.Generator().manual_seed(0)))
        q = (q * scale).to(weight.device)
        self.b = torch.nn.Parameter(torch.zeros(out_features, rank, device=weight.device))
        self.quantized = quantized
        if not quantized:
            self.register_buffer("w0", weight)
            self.register_buffer("q", q.contiguous())
            return
        codes, scales, _ = quantize_blockwise(weight, scheme="symmetric", bits=8, block_size=W0_BLOCK)
        self.register_buffer("w0_codes", codes.view(-1, W0_BLOCK))
        self.register_buffer("w0_multiplier", functional.block_multiplier(scales, scheme="symmetric", bits=8)[:, None])
        codes, scales, _ = quantize_blockwise(q, scheme="symmetric", bits=4, block_size=BASIS_BLOCK)
        self.register_buffer("q_codes", codes)
        self.register_buffer("q_multiplier", functional.block_multiplier(scales, scheme="symmetric", bits=4)[:, None])
        self.register_buffer("byte_table", functional._byte_table("symmetric", weight.device).clone())
        self.q_shape = (in_features, rank)

    def read_weight(self) -> torch.Tensor:
        return (self.w0_codes * self.w0_multiplier).view(self.shape)

    def read_basis(self) -> torch.Tensor:
        values = torch.index_select(self.byte_table, 0, self.q_codes.long()).view(-1, BASIS_BLOCK)
        return values.mul_(self.q_multiplier).view(self.q_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.quantized:
            y = _QuantizedLayer.apply(x2, self.b, self.read_basis(), self)
        else:
            y = torch.addmm((x2 @ self.q) @ self.b.mT, x2, self.w0.mT)
        return y.view(*x.shape[:-1], y.shape[-1])


def install(model: torch.nn.Module, *, rank: int, scale: float, quantized: bool) -> int:
    """Replace every linear map of the decoder layers (not the head) by a FloorLinear; return their count."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, FloorLinear(module, rank, scale, quantized))
    return len(targets)
