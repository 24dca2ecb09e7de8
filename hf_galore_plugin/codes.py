"""The storage layout of quantized codes, shared by the torch twins (:mod:`hf_galore_plugin.quant`)
and the Triton kernels (:mod:`hf_galore_plugin.kernels`): code dtypes, code levels, 4-bit packing,
and the code books of the grid schemes (the NF4 normal-float values and the uniform grid).

It imports nothing from the package, so the kernels and the quantization library both build on it
without importing each other.

NF4 (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", section 3 and
appendix E): 8 positive and 7 negative quantiles of N(0, 1), normalized to [-1, 1], plus an
exact 0 so that zero padding and zero weights stay exact. The probability range is clipped at
`offset = 1 - (1/32 + 1/30) / 2 = 0.9677083`, the mean of the two choices that keep the
extreme quantiles finite for 16 (asymmetric) and 15 (symmetric) levels.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "NF4_VALUES",
    "nf4_values",
    "uniform_values",
    "grid_table",
    "code_dtype",
    "packed_numel",
    "code_levels",
    "nibble_offset",
]

_NF4_OFFSET = 1.0 - 0.5 * (1.0 / 32.0 + 1.0 / 30.0)


def nf4_values() -> torch.Tensor:
    """The 16 NF4 values, ascending, fp32, computed from the normal quantile function."""
    positive = torch.special.ndtri(torch.linspace(_NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(_NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative])
    values = values / values.abs().max()
    return values.sort().values.to(torch.float32)


NF4_VALUES = nf4_values()


def uniform_values(bits: int) -> torch.Tensor:
    """`2**bits` evenly spaced points on [-1, 1] (fp32), the code book of the uniform scheme."""
    levels = 2**bits - 1
    return torch.arange(levels + 1, dtype=torch.float32) * (2.0 / levels) - 1.0


def table_cache(build):
    """``functools.lru_cache`` for a constant lookup table built from its arguments: the build runs outside
    any fake-tensor mode and with the CPU as default device, whatever is active at the first call (the
    memory planner traces under fake tensors and the meta device), so every cached table is a real tensor
    on the device the build names (a later real step never reads a fake or meta table).

    Traced code (torch.compile) builds the table in its graph instead, a few hundred values: leaving the
    fake-tensor mode inside a trace is a graph break, and a break in a layer's forward multiplies its
    graphs per layer (the read of a 4-bit basis or an NF4 W0 goes through these tables)."""
    return _TableCache(build)


class _TableCache:
    """:func:`table_cache`'s wrapper: callable as the build, with ``cache_clear()``."""

    def __init__(self, build) -> None:
        functools.update_wrapper(self, build)
        self._build = build
        self._cached = functools.lru_cache(maxsize=None)(self._build_real)

    def _build_real(self, *args):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.device("cpu"):
            return self._build(*args)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self._build(*args)
        return self._cached(*args)

    def cache_clear(self) -> None:
        self._cached.cache_clear()


@table_cache
def grid_table(device: torch.device) -> torch.Tensor:
    """NF4 values followed by the 15 midpoints between neighbours (31 fp32 values).

    Nearest-value search is `code = #(midpoints < y)`; the kernels and the torch twin both read
    this table so their comparisons see bit-identical thresholds. Cached per device (read-only).
    """
    midpoints = (NF4_VALUES[1:] + NF4_VALUES[:-1]) * 0.5
    return torch.cat([NF4_VALUES, midpoints]).to(device)


def code_dtype(scheme: str, bits: int) -> torch.dtype:
    return torch.int8 if scheme == "symmetric" and bits == 8 else torch.uint8


def packed_numel(numel: int, bits: int) -> int:
    """Number of stored code elements for `numel` values."""
    return (numel + 1) // 2 if bits == 4 else numel


def code_levels(scheme: str, bits: int) -> int:
    """Largest code magnitude: qmax for symmetric, number of steps otherwise."""
    return 2 ** (bits - 1) - 1 if scheme == "symmetric" else 2**bits - 1


def nibble_offset(scheme: str, bits: int) -> int:
    return 8 if scheme == "symmetric" and bits == 4 else 0
