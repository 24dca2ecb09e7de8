"""`QuantizedTensor`: codes + block scales + metadata, and the `quantize` entry point.

A plain class (not a tensor subclass): layers and optimizers keep its `to_state()` tensors as
buffers or state, and pickling goes through `__reduce_ex__` to a module-level rebuild function
from tensors and plain values, which `torch.load(weights_only=True)` accepts once this module
has registered it with `torch.serialization.add_safe_globals` (done at import).

Double quantization (Dettmers et al. 2023, QLoRA, section 3 "Double Quantization"): the fp32
block scales minus their mean are quantized to symmetric int8 in blocks of 256, keeping the mean
(one fp32) and one fp32 absmax per 256 scales. NF4 with 64-value blocks then costs
4 + 8/64 + 32/(64*256) = 4.127 bits per value instead of 4 + 32/64 = 4.5. QLoRA uses an 8-bit
dynamic (non-linear) code book for the scales; linear int8 is used here, which keeps the
scale error below 1/127 of the spread of the scales. Nested codes are rounded up (to the
smallest code whose scale is >= the block's), and the data codes are computed against these
*dequantized* scales, so what is stored is self-consistent: no value is clamped, round-to-nearest
errors stay within half a step of the stored scale, and stochastic rounding stays unbiased.
A NaN scale (a block with a non-finite value) is kept as the reserved int8 code -128.
"""

from __future__ import annotations

import math

import torch

from . import functional
from .ops import dequantize_blockwise, quantize_blockwise, blockwise_stats

__all__ = ["QuantizedTensor", "quantize", "dequantize"]

_NESTED_BLOCK = 256
_NESTED_NAN_CODE = -128
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def _double_quantize_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nested int8 codes, fp32 absmax per 256 scales, fp32 mean) of the block scales."""
    invalid = torch.isnan(scales)
    count = (~invalid).sum().clamp_min(1)
    offset = torch.where(invalid, 0.0, scales).sum() / count
    centered = torch.where(invalid, 0.0, scales - offset)
    codes, nested_scales, _ = quantize_blockwise(centered, scheme="symmetric", bits=8, block_size=_NESTED_BLOCK)
    codes = torch.where(invalid, _NESTED_NAN_CODE, codes)
    # Round up where rounding to nearest landed below the true scale, so that no value of the
    # block has to be clamped (clamping cost 8-bit asymmetric codes ~40% more max error on N(0,1)).
    too_small = (_dequantize_scales(codes, nested_scales, offset) < scales) & (codes < 127)
    return codes + too_small.to(codes.dtype), nested_scales, offset


def _dequantize_scales(codes: torch.Tensor, nested_scales: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    scales = dequantize_blockwise(
        codes,
        nested_scales,
        None,
        scheme="symmetric",
        bits=8,
        block_size=_NESTED_BLOCK,
        numel=codes.numel(),
        dtype=torch.float32,
    )
    return torch.where(codes == _NESTED_NAN_CODE, math.nan, (scales + offset).clamp_min(0.0))


class QuantizedTensor:
    """A blockwise-quantized tensor. Build it with `quantize`; undo it with `.dequantize()`.

    Tensors: `codes` (int8/uint8; 4-bit codes packed two per byte), and either `scales` (fp32,
    one per block) or, with double quantization, `nested_codes` (int8), `nested_scales` (fp32,
    one per 256 blocks) and `nested_offset` (fp32 scalar); `zero_points` (fp32 block minima)
    for the asymmetric scheme. Metadata: shape, dtype, scheme, bits, block_size, double_quant.
    """

    def __init__(
        self,
        *,
        codes: torch.Tensor,
        scales: torch.Tensor | None,
        zero_points: torch.Tensor | None,
        nested_codes: torch.Tensor | None,
        nested_scales: torch.Tensor | None,
        nested_offset: torch.Tensor | None,
        shape: torch.Size,
        dtype: torch.dtype,
        scheme: str,
        bits: int,
        block_size: int,
        double_quant: bool,
    ):
        self.codes = codes
        self.scales = scales
        self.zero_points = zero_points
        self.nested_codes = nested_codes
        self.nested_scales = nested_scales
        self.nested_offset = nested_offset
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.scheme = scheme
        self.bits = bits
        self.block_size = block_size
        self.double_quant = double_quant

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Exact storage: codes + scales (or nested codes, nested scales, offset) + zero points."""
        return sum(t.nbytes for t in self.to_state()[0].values())

    def block_scales(self) -> torch.Tensor:
        """The fp32 scale of every block (dequantized from the nested codes under double quant)."""
        if self.double_quant:
            assert self.nested_codes is not None and self.nested_scales is not None and self.nested_offset is not None
            return _dequantize_scales(self.nested_codes, self.nested_scales, self.nested_offset)
        assert self.scales is not None, "a tensor without double quantization holds its scales"
        return self.scales

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The approximated tensor, in `dtype` (default: the dtype it was quantized from)."""
        flat = dequantize_blockwise(
            self.codes,
            self.block_scales(),
            self.zero_points,
            scheme=self.scheme,
            bits=self.bits,
            block_size=self.block_size,
            numel=self.numel(),
            dtype=dtype or self.dtype,
        )
        return flat.view(self.shape)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        tensors, meta = self.to_state()
        return QuantizedTensor.from_state({k: t.to(device) for k, t in tensors.items()}, meta)

    def to_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, plain metadata); `QuantizedTensor.from_state` rebuilds it exactly."""
        names = ["codes"]
        names += ["nested_codes", "nested_scales", "nested_offset"] if self.double_quant else ["scales"]
        names += ["zero_points"] if self.zero_points is not None else []
        meta = {
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "scheme": self.scheme,
            "bits": self.bits,
            "block_size": self.block_size,
            "double_quant": self.double_quant,
        }
        return {name: getattr(self, name) for name in names}, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict) -> "QuantizedTensor":
        missing = {"shape", "dtype", "scheme", "bits", "block_size", "double_quant"} - set(meta)
        if missing:
            raise ValueError(f"quantized-tensor metadata lacks {sorted(missing)}; pass the dict from to_state()")
        functional.check_quant_args(scheme=meta["scheme"], bits=meta["bits"], block_size=meta["block_size"])
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"unknown dtype {meta['dtype']!r} in metadata; expected one of {sorted(_DTYPES)}")
        double_quant = bool(meta["double_quant"])
        required = ["codes"] + (["nested_codes", "nested_scales", "nested_offset"] if double_quant else ["scales"])
        required += ["zero_points"] if meta["scheme"] == "asymmetric" else []
        absent = [name for name in required if name not in tensors]
        if absent:
            raise ValueError(f"quantized-tensor state lacks tensors {absent}; pass the dict from to_state()")
        numel = math.prod(meta["shape"])
        if tensors["codes"].numel() != functional.packed_numel(numel, meta["bits"]):
            raise ValueError(
                f"codes hold {tensors['codes'].numel()} elements but shape {meta['shape']} at"
                f" {meta['bits']} bits needs {functional.packed_numel(numel, meta['bits'])}"
            )
        return cls(
            codes=tensors["codes"],
            scales=tensors.get("scales"),
            zero_points=tensors.get("zero_points"),
            nested_codes=tensors.get("nested_codes"),
            nested_scales=tensors.get("nested_scales"),
            nested_offset=tensors.get("nested_offset"),
            shape=torch.Size(meta["shape"]),
            dtype=_DTYPES[meta["dtype"]],
            scheme=meta["scheme"],
            bits=meta["bits"],
            block_size=meta["block_size"],
            double_quant=double_quant,
        )

    def __reduce_ex__(self, protocol):
        return rebuild_quantized_tensor, self.to_state()

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, scheme={self.scheme!r},"
            f" bits={self.bits}, block_size={self.block_size}, double_quant={self.double_quant},"
            f" nbytes={self.nbytes}, device={self.device})"
        )


def rebuild_quantized_tensor(tensors: dict[str, torch.Tensor], meta: dict) -> QuantizedTensor:
    """Unpickling entry point (allow-listed for `torch.load(weights_only=True)`)."""
    return QuantizedTensor.from_state(tensors, meta)


torch.serialization.add_safe_globals([rebuild_quantized_tensor])


def _uniform_randoms(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One fp32 uniform [0, 1) per element, drawn on the generator's device, then moved to x's."""
    device = generator.device if generator is not None else x.device
    return torch.rand(x.numel(), generator=generator, device=device, dtype=torch.float32).to(x.device)


def quantize(
    x: torch.Tensor,
    *,
    scheme: str,
    bits: int,
    block_size: int | None = None,
    double_quant: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Quantize `x` blockwise over its flattened values.

    scheme: "symmetric" (absmax, int8/int4), "asymmetric" (min/max, uint8/uint4), "uniform"
    (2**bits points on [-1, 1]) or "nf4" (bits=4). block_size: a power of two in 32..4096
    (default 64 at 4 bits, 256 at 8 bits). double_quant: quantize the block scales to 8 bits.
    stochastic: unbiased stochastic rounding with randoms drawn from `generator` (the global
    RNG when None; a given generator makes the codes reproducible and is ignored otherwise).
    A block holding NaN or Inf dequantizes to all NaN.
    """
    functional.check_float_tensor(x)
    if block_size is None:
        block_size = functional.default_block_size(bits)
    functional.check_quant_args(scheme=scheme, bits=bits, block_size=block_size)
    randoms = _uniform_randoms(x, generator) if stochastic else None
    nested_codes: torch.Tensor | None = None
    nested_scales: torch.Tensor | None = None
    nested_offset: torch.Tensor | None = None
    scales: torch.Tensor | None
    if double_quant:
        scales, zero_points = blockwise_stats(x, scheme=scheme, bits=bits, block_size=block_size)
        nested_codes, nested_scales, nested_offset = _double_quantize_scales(scales)
        codes, _, _ = quantize_blockwise(
            x,
            scheme=scheme,
            bits=bits,
            block_size=block_size,
            randoms=randoms,
            scales=_dequantize_scales(nested_codes, nested_scales, nested_offset),
            zero_points=zero_points,
        )
        scales = None
    else:
        codes, scales, zero_points = quantize_blockwise(
            x, scheme=scheme, bits=bits, block_size=block_size, randoms=randoms
        )
    return QuantizedTensor(
        codes=codes,
        scales=scales,
        zero_points=zero_points,
        nested_codes=nested_codes,
        nested_scales=nested_scales,
        nested_offset=nested_offset,
        shape=x.shape,
        dtype=x.dtype,
        scheme=scheme,
        bits=bits,
        block_size=block_size,
        double_quant=bool(double_quant),
    )


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Functional form of `qt.dequantize(dtype)`."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize takes a QuantizedTensor (from quantize), got {type(qt).__name__}")
    return qt.dequantize(dtype)
