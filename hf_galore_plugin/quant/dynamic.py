"""Blockwise dynamic-map quantization: the 8-bit state of `hf_galore_plugin.optim.AdamW`.

Layout (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", ICLR): each block of
`block_size` consecutive values of a flat tensor is stored as 8-bit codes plus one fp32 absmax scale;
a code indexes a 256-entry code book of values in [-1, 1] (signed, int8 codes) or [0, 1] (unsigned,
uint8 codes). The weight and basis schemes of `quant.ops` (symmetric, asymmetric, uniform, NF4) are
grids; this map is not, so it has its own pair of functions here, named apart from `quantize_blockwise`.

Code book: dynamic ("tree") quantization, the paper's choice, built here from our own
construction. Value = 10**-e * f: a decade exponent e and a linear fraction f in (0.1, 1]
whose resolution shrinks as e grows (fewer fraction bits are left once the exponent's
indicator bits are spent). Unsigned: e = 0..7 with 128, 64, ..., 1 fraction levels (255
values + exact 0); signed: e = 0..6 with 64, ..., 1 levels per sign (127 + 127 + exact 0) and
the one spare code holding -1e-7. Each decade's top level is the next decade's bottom edge, so
the values are dense from 1e-7 (unsigned) / 1e-6 (signed) up to exactly 1.0 (the block's
absmax element is stored exactly).
Why not a linear map: Adam's second moment spans many decades inside one block (v ~ g**2;
gradients 100x apart give v 1e4 apart). A linear uint8 map rounds every v below absmax/510 to
0, and then m / (sqrt(v) + eps) becomes m / 1e-8 for those values. Measured on the 64x128
least-squares problem of tests/test_optim.py (500 steps, lr 1e-3 / 1e-2), replacing only the
second-moment map by a linear one gives 35% / 35% relative weight deviation from fp32 AdamW
(weights up to 10x larger than fp32's), the dynamic map 5.7% / 0.30%, bitsandbytes' AdamW8bit
5.7% / 0.59%.

Nearest-code search: index = #(midpoints < y) over the 255 fp32 midpoints between neighbouring
code values, found without a search by a table over y's fp32 bit pattern (`nearest_code_index`):
the sign, the exponent and the top 8 mantissa bits of y pick a bucket of y values; the table holds
c = #(midpoints < smallest y of the bucket), and as no bucket holds more than one midpoint (asserted
when the table is built: buckets are <= 2**-8 relative wide, code values >= 0.7% apart),
index = c + (midpoints[c] < y), exactly. The optimizer's torch step, its C++ form and
the Triton kernel all use this rule (the kernel receives these tables and `LOOKUP_*` constants), so
they give identical codes wherever y itself rounds identically.
"""

from __future__ import annotations

import functools

import torch

from ..codes import table_cache

__all__ = [
    "CODE_BOOK_SIZE",
    "SIGNED_OFFSET",
    "LOOKUP_SHIFT",
    "LOOKUP_BASE",
    "LOOKUP_BUCKETS",
    "dynamic_code_book",
    "code_lookup_table",
    "lookup_index",
    "nearest_code_index",
    "quantize_dynamic_blockwise",
    "dequantize_dynamic_blockwise",
]

CODE_BOOK_SIZE = 256
# int8 code c of the signed book is index c + 128, so code 0 is the exact zero.
SIGNED_OFFSET = 128


@functools.lru_cache(maxsize=None)
def _dynamic_values(signed: bool) -> tuple[float, ...]:
    magnitude_bits = 6 if signed else 7  # one bit of the 8 goes to the sign when signed
    magnitudes = []
    for exponent in range(magnitude_bits + 1):
        levels = 2 ** (magnitude_bits - exponent)
        decade = 10.0**-exponent
        magnitudes += [decade * (0.1 + 0.9 * (j + 1) / levels) for j in range(levels)]
    values = [0.0] + magnitudes
    if signed:
        values += [-v for v in magnitudes] + [-1e-7]
    return tuple(sorted(values))


@table_cache
def _code_book_cached(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(_dynamic_values(signed), dtype=torch.float64)
    midpoints = (values[1:] + values[:-1]) * 0.5
    return values.to(torch.float32).to(device), midpoints.to(torch.float32).to(device)


def dynamic_code_book(*, signed: bool, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(values, midpoints): the 256 ascending fp32 code values and the 255 midpoints between them."""
    return _code_book_cached(signed, torch.device(device))


# Bucket of y: sign, exponent and the top LOOKUP_MANTISSA_BITS mantissa bits of its fp32 pattern.
# |y| below 2**LOOKUP_MIN_EXPONENT shares the first bucket (the smallest midpoint, 5e-8 ~ 2**-24.3,
# is far above it), |y| >= 2 the last (normalized values are in [-1, 1]).
LOOKUP_MANTISSA_BITS = 8
LOOKUP_MIN_EXPONENT = -32
LOOKUP_SHIFT = 23 - LOOKUP_MANTISSA_BITS
LOOKUP_BASE = (127 + LOOKUP_MIN_EXPONENT) << LOOKUP_MANTISSA_BITS
LOOKUP_BUCKETS = (1 - LOOKUP_MIN_EXPONENT) << LOOKUP_MANTISSA_BITS  # per sign


@table_cache
def _code_lookup_cached(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    _, midpoints = _code_book_cached(signed, torch.device("cpu"))
    keys = torch.arange(LOOKUP_BUCKETS, dtype=torch.int64) + LOOKUP_BASE
    first = (keys << LOOKUP_SHIFT).to(torch.int32).view(torch.float32)  # smallest |y| of each bucket
    last = (((keys + 1) << LOOKUP_SHIFT) - 1).to(torch.int32).view(torch.float32)  # largest |y|
    first[0] = 0.0  # the first bucket also holds every smaller |y|
    # Positive buckets span y in [first, last], negative ones y in [-last, -first].
    lowest, highest = torch.cat([first, -last]), torch.cat([last, -first])
    table = torch.searchsorted(midpoints, lowest)  # #(midpoints < lowest y)
    extra = torch.searchsorted(midpoints, highest) - table
    if int(extra.max()) > 1:  # a property of the code book; guards against a future book change
        raise AssertionError(f"code lookup: a bucket holds {int(extra.max())} midpoints; use more mantissa bits")
    padded = torch.cat([midpoints, torch.tensor([float("inf")])])  # midpoints[255] = inf: never below y
    return table.to(torch.int32).to(device), padded.to(device)


def code_lookup_table(*, signed: bool, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(table, padded midpoints) of `nearest_code_index`: int32 [2 * LOOKUP_BUCKETS] (positive y's
    buckets, then negative y's) and the 255 fp32 midpoints followed by +inf."""
    return _code_lookup_cached(signed, torch.device(device))


def lookup_index(normalized: torch.Tensor, table: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """int64 #(midpoints < y) for fp32 `normalized`, through the bucket table (NaN gives 0 or 255)."""
    bits = normalized.view(torch.int32)
    key = ((bits & 0x7FFFFFFF) >> LOOKUP_SHIFT) - LOOKUP_BASE
    key = key.clamp(0, LOOKUP_BUCKETS - 1) + torch.where(bits < 0, LOOKUP_BUCKETS, 0)
    first = table[key.long()].long()
    return first + (midpoints[first] < normalized).long()


def nearest_code_index(normalized: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """Code-book index (0..255) of the nearest code value to each fp32 value: #(midpoints < value)."""
    table, midpoints = code_lookup_table(signed=signed, device=normalized.device)
    return lookup_index(normalized.float().contiguous(), table, midpoints)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """View `flat` as (n_blocks, block_size), zero-padding the last block (padding never wins absmax)."""
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def quantize_dynamic_blockwise(
    values: torch.Tensor, *, signed: bool, block_size: int, codes_out: torch.Tensor, scales_out: torch.Tensor
) -> None:
    """Write the nearest-code quantization of flat fp32 `values` into `codes_out` and `scales_out`."""
    n = values.numel()
    blocks = _blocks(values.float(), block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    index = nearest_code_index(normalized.reshape(-1), signed=signed)[:n]
    if signed:
        codes_out.copy_((index - SIGNED_OFFSET).to(torch.int8))
    else:
        codes_out.copy_(index.to(torch.uint8))
    scales_out.copy_(absmax.view(-1))


def dequantize_dynamic_blockwise(codes: torch.Tensor, scales: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """fp32 flat values of flat `codes` (int8: signed book, uint8: unsigned book) and block `scales`."""
    signed = codes.dtype == torch.int8
    book, _ = dynamic_code_book(signed=signed, device=codes.device)
    index = codes.long() + SIGNED_OFFSET if signed else codes.long()
    n = codes.numel()
    values = book[index]
    pad = -n % block_size
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return (values.view(-1, block_size) * scales.view(-1, 1)).view(-1)[:n]
