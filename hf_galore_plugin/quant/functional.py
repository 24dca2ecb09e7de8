"""Stateless blockwise quantization math in plain torch: the torch twins of the Triton kernels.

Every function here has a Triton launcher of the same name with `_triton` instead of `_torch`
in `hf_galore_plugin.kernels.quant`; the twin is the CPU path and the kernels' test oracle,
so both compute with the same fp32 operations in the same order.

Layout: the input is flattened and cut into blocks of `block_size` values (the last block may
be partial). One fp32 scale per block (plus an fp32 zero point for "asymmetric"). Codes:

- symmetric, absmax:  code = round(x * qmax / absmax), qmax = 2**(bits-1) - 1, x ~ code * absmax / qmax
- asymmetric, min/max: code = round((x - min) / step), step = (max - min) / (2**bits - 1),
  x ~ code * step + min. The zero point is stored as the fp32 block minimum rather than an
  integer, so the error stays below half a step everywhere (an integer zero point can cost a
  full step at the range ends).
- uniform: 2**bits evenly spaced points on [-1, 1] after absmax normalization; code = index.
- nf4: nearest of the 16 NF4 values after absmax normalization; code = index.

8-bit codes are int8 (symmetric) or uint8; 4-bit codes are packed two per uint8 byte, the
element with the even index in the low nibble (symmetric 4-bit codes are stored offset by +8,
i.e. -7..7 -> 1..15). Padding past the last element is a zero nibble.

Rounding: deterministic rounding is round-half-to-even. Stochastic rounding takes a tensor of
uniform random numbers in [0, 1), one per element, made by the caller with a torch generator
(`code = floor(v + u)`; for NF4 the upper of the two neighbouring grid values is chosen with
probability proportional to the distance from the lower one), so it is unbiased and the kernel
and the twin give identical codes for the same random tensor.

Finite input gives finite output in every scheme: an asymmetric block whose range exceeds the
float32 maximum computes its step, codes and values in halves that cannot overflow.

Non-finite input: a block holding a NaN or +-Inf gets a NaN scale and dequantizes to all NaN
(no host synchronization is needed to detect it, and no finite garbage comes out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..codes import code_dtype, code_levels, grid_table, nibble_offset, packed_numel, table_cache

__all__ = [
    "SCHEMES",
    "block_multiplier",
    "dequantize_whole_blocks",
    "whole_blocks",
    "check_quant_args",
    "check_float_tensor",
    "default_block_size",
    "code_dtype",
    "packed_numel",
    "code_levels",
    "nibble_offset",
    "pack_int4",
    "unpack_int4",
    "SCHEME_BITS",
    "blockwise_stats_torch",
    "quantize_blockwise_torch",
    "dequantize_blockwise_torch",
]

SCHEMES = ("symmetric", "asymmetric", "uniform", "nf4")
_SUPPORTED_BITS = {"symmetric": (4, 8), "asymmetric": (4, 8), "uniform": (4, 8), "nf4": (4,)}
# Every (scheme, bits) pair `quantize` accepts, 8-bit first.
SCHEME_BITS = tuple((scheme, bits) for scheme in SCHEMES for bits in sorted(_SUPPORTED_BITS[scheme], reverse=True))
_MIN_BLOCK, _MAX_BLOCK = 32, 4096
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_block_size(bits: int) -> int:
    """64 values per block at 4 bits, 256 at 8 bits (QLoRA's and bitsandbytes' defaults)."""
    return 64 if bits == 4 else 256


def check_quant_args(*, scheme: str, bits: int, block_size: int) -> None:
    """Raise a ValueError/TypeError naming the bad value and the fix."""
    if scheme not in _SUPPORTED_BITS:
        raise ValueError(f"unknown quantization scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    supported = _SUPPORTED_BITS[scheme]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in supported:
        raise ValueError(f"bits={bits!r} is not supported by scheme {scheme!r}; use bits in {supported}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {block_size!r} ({type(block_size).__name__})")
    if not (_MIN_BLOCK <= block_size <= _MAX_BLOCK) or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size} must be a power of two between {_MIN_BLOCK} and {_MAX_BLOCK}"
            f" (e.g. {default_block_size(bits)})"
        )


def check_float_tensor(x: torch.Tensor, *, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; quantization takes float32, bfloat16 or float16 input"
            f" (cast it first, e.g. {name}.float())"
        )


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes of even length, each < 16 -> bytes (even index in the low nibble)."""
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 values in [0, 15] two per byte; an odd count is padded with a zero nibble."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"pack_int4 takes a uint8 tensor of values in [0, 15], got {got}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_int4 got a value {int(codes.max())} > 15; 4-bit codes must lie in [0, 15]")
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return _pack_nibbles(flat)


@table_cache
def _byte_table(scheme: str, device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: the values of the low and the high nibble of every byte before the block scale
    (symmetric int4: code - 8; NF4: the code book's value). Cached per device (read-only)."""
    nibbles = torch.arange(256)
    pairs = torch.stack([nibbles & 15, nibbles >> 4], dim=1)
    if scheme == "symmetric":
        table = pairs.to(torch.float32) - float(nibble_offset("symmetric", 4))
    else:
        table = grid_table(torch.device("cpu"))[pairs]
    return table.to(device)


def unpack_int4(packed: torch.Tensor, *, numel: int) -> torch.Tensor:
    """Inverse of `pack_int4`: `numel` uint8 codes from `ceil(numel / 2)` bytes."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"unpack_int4 takes the uint8 tensor made by pack_int4, got {got}")
    if packed.numel() != (numel + 1) // 2:
        raise ValueError(
            f"packed 4-bit tensor has {packed.numel()} bytes but numel={numel} needs"
            f" {(numel + 1) // 2} (two codes per byte); pass the numel it was packed from"
        )
    flat = packed.reshape(-1)
    codes = torch.stack([flat & 15, flat >> 4], dim=1).reshape(-1)
    return codes[:numel]


def _as_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """fp32 (num_blocks, block_size) view of the flattened input.

    A partial last block is padded by repeating the last value, which leaves the block's
    absmax/min/max unchanged; padded codes are zeroed afterwards.
    """
    flat = x.reshape(-1).float()
    numel = flat.numel()
    pad = -numel % block_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, block_size), numel


def blockwise_stats_torch(
    x: torch.Tensor, *, scheme: str, bits: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-block fp32 scales (absmax, or the step for "asymmetric") and zero points (block min).

    A block with a non-finite value gets a NaN scale (its zero point is 0).
    """
    blocks, _ = _as_blocks(x, block_size)
    nonfinite = ~torch.isfinite(blocks).all(dim=1)
    if scheme == "asymmetric":
        low, high = blocks.amin(dim=1), blocks.amax(dim=1)
        levels = float(code_levels(scheme, bits))
        scales = (high - low) / levels
        # A finite block whose range exceeds the float32 maximum: high - low overflows, each half does not.
        scales = torch.where(torch.isfinite(scales), scales, high / levels - low / levels)
        zero_points = torch.where(nonfinite, 0.0, low)
    else:
        scales, zero_points = blocks.abs().amax(dim=1), None
    return torch.where(nonfinite, math.nan, scales), zero_points


def quantize_blockwise_torch(
    x: torch.Tensor,
    *,
    scheme: str,
    bits: int,
    block_size: int,
    randoms: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    zero_points: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize `x` blockwise -> (codes, scales, zero_points or None).

    `randoms` (fp32 uniform [0, 1), `x.numel()` values) switches on stochastic rounding.
    `scales`/`zero_points`, when given, are used instead of the block statistics of `x` (double
    quantization encodes against the dequantized scales); values beyond the given range clamp.
    """
    if scales is None:
        scales, zero_points = blockwise_stats_torch(x, scheme=scheme, bits=bits, block_size=block_size)
    blocks, numel = _as_blocks(x, block_size)
    blocks = torch.where(torch.isfinite(blocks), blocks, 0.0)
    levels = code_levels(scheme, bits)
    # torch.div(number, tensor) divides exactly (IEEE round to nearest), like the kernels'
    # tl.div_rn; `number / tensor` would multiply by a reciprocal and move some codes at ties.
    numerator = {"symmetric": float(levels), "uniform": 0.5 * levels}.get(scheme, 1.0)
    # A zero or NaN scale gives factor 0: such blocks encode every value as v = 0 (+ offset).
    factor = torch.where(scales > 0, torch.div(numerator, scales), 0.0)[:, None]
    # v: the value in code units (for nf4: normalized to [-1, 1], searched in the grid below)
    if scheme == "asymmetric":
        assert zero_points is not None, "the asymmetric scheme has a zero point per block"
        v = (blocks - zero_points[:, None]) * factor
        # x - min overflows in a block wider than the float32 range; x*f - min*f does not
        v = torch.where(torch.isfinite(v), v, blocks * factor - zero_points[:, None] * factor)
    else:
        v = blocks * factor
    if scheme == "uniform":
        v = v + 0.5 * levels
    u = None if randoms is None else _as_blocks(randoms, block_size)[0]
    if scheme == "nf4":
        table = grid_table(x.device)
        if u is None:
            codes = torch.bucketize(v, table[16:])
        else:
            lower = torch.bucketize(v, table[1:15], right=True)
            low, high = table[lower], table[lower + 1]
            codes = lower + (u < (v - low) / (high - low)).to(lower.dtype)
    else:
        codes = torch.round(v) if u is None else torch.floor(v + u)
        codes = codes.clamp(-levels if scheme == "symmetric" else 0, levels)
    codes = codes.to(torch.int32) + nibble_offset(scheme, bits)
    codes = codes.reshape(-1)
    if bits == 4:
        codes[numel:] = 0
        codes = _pack_nibbles(codes.to(torch.uint8))[: packed_numel(numel, bits)]
    else:
        codes = codes[:numel].to(code_dtype(scheme, bits))
    return codes, scales, zero_points


def whole_blocks(*, scheme: str, bits: int, block_size: int, numel: int) -> bool:
    """Whether :func:`dequantize_whole_blocks` decodes this tensor: whole blocks of a scheme the layers
    store (int8 W0, int4 bases, NF4 W0)."""
    return numel % block_size == 0 and (scheme, bits) in (("symmetric", 8), ("symmetric", 4), ("nf4", 4))


def block_multiplier(scales: torch.Tensor, *, scheme: str, bits: int) -> torch.Tensor:
    """What a block's code values are multiplied by (fp32, one per block): absmax / levels for the
    symmetric schemes, absmax for NF4 (whose code book spans [-1, 1]). A tensor read many times between
    writes (a layer's W0 and bases) can keep it and pass it to :func:`dequantize_whole_blocks`."""
    return scales / float(code_levels(scheme, bits)) if scheme == "symmetric" else scales


def dequantize_whole_blocks(
    codes: torch.Tensor,
    multiplier: torch.Tensor,
    *,
    scheme: str,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    shape: Sequence[int] = (-1,),
) -> torch.Tensor:
    """The values of `codes` (see :func:`whole_blocks`) in `dtype`, viewed as `shape` (default flat), equal to
    the general path's. `multiplier` is :func:`block_multiplier`'s as a column (blocks x 1), the form a reader
    keeps.

    A layer reads its W0 in every forward and backward and its basis in every forward, so this is the fewest
    passes the layout allows: an int8 block times the fp32 multiplier promotes to fp32 inside the multiply,
    whose result is rounded once into `dtype` as it is stored (as ``.to(dtype)`` of the fp32 product would);
    a 4-bit byte first looks up its two values (low nibble first) in a 256 x 2 table, and an fp32 result is
    then scaled in place in that fresh lookup."""
    if bits == 8:
        blocks = codes.view(-1, block_size)
    else:
        blocks = torch.index_select(_byte_table(scheme, codes.device), 0, codes.long()).view(-1, block_size)
    if dtype != torch.float32:
        out = torch.empty(blocks.shape, dtype=dtype, device=blocks.device)
        return torch.mul(blocks, multiplier, out=out).view(shape)
    if blocks.dtype == torch.float32:
        return blocks.mul_(multiplier).view(shape)
    if blocks.device.type == "cpu" and blocks.numel() >= _TWO_PASS_NUMEL:
        return blocks.to(torch.float32).mul_(multiplier).view(shape)
    return (blocks * multiplier).view(shape)


# From this many values on, an int8 block is converted to fp32 and then scaled in place (two vectorized
# passes) rather than promoted inside one multiply, whose mixed-dtype loop is not vectorized on the CPU:
# 1.7x faster at 2.8M values, equal below ~16K values (measured, one thread; docs/benchmarks/step-time.md).
_TWO_PASS_NUMEL = 1 << 16


def dequantize_blockwise_torch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    *,
    scheme: str,
    bits: int,
    block_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of `quantize_blockwise_torch`: a flat tensor of `numel` values in `dtype`."""
    if whole_blocks(scheme=scheme, bits=bits, block_size=block_size, numel=numel):
        multiplier = block_multiplier(scales, scheme=scheme, bits=bits)[:, None]
        return dequantize_whole_blocks(codes, multiplier, bits=bits, scheme=scheme, block_size=block_size, dtype=dtype)
    values = unpack_int4(codes, numel=numel) if bits == 4 else codes[:numel]
    values = values.to(torch.float32)
    # Each skipped step below is a full pass over the tensor (an int8 W0 is dequantized in every forward
    # and backward): subtracting a zero offset and padding a whole number of blocks change no value.
    offset = nibble_offset(scheme, bits)
    if offset:
        values = values - float(offset)
    pad = -numel % block_size
    blocks = (torch.nn.functional.pad(values, (0, pad)) if pad else values).reshape(-1, block_size)
    levels = code_levels(scheme, bits)
    if scheme == "symmetric":
        out = blocks * (scales / float(levels))[:, None]
    elif scheme == "asymmetric":
        assert zero_points is not None, "the asymmetric scheme has a zero point per block"
        out = blocks * scales[:, None] + zero_points[:, None]
        # code * step can exceed the float32 maximum in a block wider than the float32 range: halve, add, double
        half = (blocks * (scales * 0.5)[:, None] + (zero_points * 0.5)[:, None]) * 2.0
        out = torch.where(torch.isfinite(out) | torch.isnan(scales)[:, None], out, half)
    elif scheme == "uniform":
        out = (blocks * (2.0 / levels) - 1.0) * scales[:, None]
    else:
        out = grid_table(codes.device)[blocks.long()] * scales[:, None]
    return out.reshape(-1)[:numel].to(dtype)
