"""Error feedback for quantized state: the part of a value that quantization dropped is kept
and added back before the next quantization, so rounding errors do not accumulate over steps
(the residual of step t is re-offered at step t+1; Seide et al. 2014, 1-bit SGD; Karimireddy et
al. 2019, "Error Feedback Fixes SignSGD").
"""

from __future__ import annotations

import torch

from .tensor import QuantizedTensor, quantize

__all__ = ["quantize_with_error_feedback"]


@torch.no_grad()
def quantize_with_error_feedback(
    x: torch.Tensor, residual: torch.Tensor | None, **quantize_kwargs
) -> tuple[QuantizedTensor, torch.Tensor]:
    """Quantize `x + residual`; return the quantized tensor and the new residual.

    new_residual = (x + residual) - dequantize(quantize(x + residual)), computed in fp32 and
    returned in the dtype of the given residual (fp32 when `residual` is None, the first step).
    `quantize_kwargs` are those of `quantize` (scheme, bits, block_size, ...). The sum is
    quantized in fp32, so the dequantized result comes back as fp32; a block whose residual
    carries a NaN stays NaN (nothing silently resets it).
    """
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; pass the"
            " residual returned for this same tensor (or None on the first step)"
        )
    target = x.float() if residual is None else x.float() + residual.float()
    qt = quantize(target, **quantize_kwargs)
    new_residual = target - qt.dequantize(torch.float32)
    return qt, new_residual.to(torch.float32 if residual is None else residual.dtype)
