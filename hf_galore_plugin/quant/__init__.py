"""Blockwise quantization of the QLoRA family: symmetric and asymmetric int8/int4, uniform grids,
NF4, double quantization of the scales, stochastic rounding and error feedback.

`quantize(x, scheme=..., bits=...)` returns a `QuantizedTensor`; the stateless ops below it run
a Triton kernel on CUDA (and on CPU under TRITON_INTERPRET=1) and their torch twin otherwise.
Importing this package does not import triton.
"""

from ..codes import NF4_VALUES, nf4_values, uniform_values
from .error_feedback import quantize_with_error_feedback
from .functional import (
    SCHEME_BITS,
    SCHEMES,
    blockwise_stats_torch,
    default_block_size,
    dequantize_blockwise_torch,
    pack_int4,
    quantize_blockwise_torch,
    unpack_int4,
)
from .ops import blockwise_stats, dequantize_blockwise, quantize_blockwise
from .tensor import QuantizedTensor, dequantize, quantize, rebuild_quantized_tensor

__all__ = [
    "NF4_VALUES",
    "SCHEMES",
    "SCHEME_BITS",
    "QuantizedTensor",
    "quantize",
    "dequantize",
    "quantize_with_error_feedback",
    "quantize_blockwise",
    "dequantize_blockwise",
    "blockwise_stats",
    "quantize_blockwise_torch",
    "dequantize_blockwise_torch",
    "blockwise_stats_torch",
    "pack_int4",
    "unpack_int4",
    "default_block_size",
    "nf4_values",
    "uniform_values",
    "rebuild_quantized_tensor",
]
