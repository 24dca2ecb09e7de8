"""Per-layer ranks under one budget (``GaLoreConfig.rank_allocation='auto'``).

Each targeted layer measures the spectrum of its calibration gradient (the singular values of the record its
first refresh sketches). The budget is a number of factor values (a rank-r factor of a layer whose basis
projects the side n holds r * m values, m the side it keeps: the layer's *cost* per unit of rank). The
allocation maximises the total share of gradient energy the layers' subspaces capture,

    sum over layers of  sum_{i <= r_l} s_{l,i}^2 / E_l        (E_l: the layer's whole gradient energy)

subject to sum_l cost_l * r_l <= budget and min_l <= r_l <= max_l. Each layer counts its own share, so that a
layer with a large gradient does not take the budget from the others (the gradients of a network differ in
norm by orders of magnitude across depth; the subspace of each must capture its own update). The shares are
concave in the rank (singular values sorted descending), so adding one rank at a time to the layer with the
largest gain per value is optimal when every layer has the same cost (an exchange argument), and within one
rank step of the optimum otherwise (the greedy fractional-knapsack bound); `tests/test_rank_allocation.py`
checks both against exhaustive search.

An expert stack (``experts=True``) is one "layer" here with one rank for its E experts: its energies are the
experts' squared singular values summed index by index and its total the stack's whole gradient energy, so its
share at rank r is the energy its experts' top-r subspaces capture together (still concave: a sum of sorted
sequences is sorted), and its cost is E x (an expert's kept side) values per unit of rank
(:mod:`hf_galore_plugin.layers.rank`).

AdaRankGrad (arXiv 2410.17881) and WeLore (arXiv 2407.11239) choose per-layer ranks from the same measure,
the share of the gradient's energy a rank captures.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections.abc import Mapping, Sequence
from typing import Union

__all__ = ["LayerSpectrum", "allocate_ranks", "budget_values", "captured_share"]


@dataclasses.dataclass(frozen=True)
class LayerSpectrum:
    """What the allocator knows of one layer: the squared singular values of its calibration gradient,
    largest first (as many as the largest rank it may get), its whole energy, the factor values one unit of
    rank costs, and its rank bounds."""

    energies: Sequence[float]
    total: float
    cost: int
    min_rank: int
    max_rank: int
    # gain(i) for every i, computed once: the allocation and the report read each many times
    _gains: list[float] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cost < 1:
            raise ValueError(f"a layer's cost per unit of rank is a positive number of values, got {self.cost}")
        if not 1 <= self.min_rank <= self.max_rank:
            raise ValueError(f"rank bounds must satisfy 1 <= min <= max, got [{self.min_rank}, {self.max_rank}]")
        if len(self.energies) < self.max_rank:
            raise ValueError(
                f"a spectrum of {len(self.energies)} values cannot rank up to {self.max_rank}: measure at least "
                "max_rank singular values"
            )
        total = float(self.total)
        gains = [0.0] * len(self.energies)
        if total > 0:  # a direction of negative, NaN or infinite energy adds nothing
            gains = [value / total if 0.0 < value < math.inf else 0.0 for value in map(float, self.energies)]
        object.__setattr__(self, "_gains", gains)

    def gain(self, rank: int) -> float:
        """The share of the layer's energy the `rank`-th direction adds (0 for a layer without a gradient)."""
        return self._gains[rank - 1]


def captured_share(spectrum: LayerSpectrum, rank: int) -> float:
    """The share of the layer's gradient energy its top-`rank` subspace captures (within [0, 1])."""
    return min(1.0, sum(spectrum._gains[:rank]))


def allocate_ranks(layers: Mapping[str, LayerSpectrum], budget: int) -> dict[str, int]:
    """Ranks within each layer's bounds whose total cost is at most `budget` and whose summed captured share is
    as large as the greedy rule reaches (module docstring). Every layer gets at least its ``min_rank``; a
    budget below the sum of those is an error that names the shortfall."""
    ranks = {name: spectrum.min_rank for name, spectrum in layers.items()}
    spent = sum(spectrum.cost * spectrum.min_rank for spectrum in layers.values())
    if spent > budget:
        raise ValueError(
            f"rank budget {budget} values is below the {spent} values every layer's minimum rank needs; raise "
            "rank_budget or lower rank_min"
        )
    # Max-heap of (gain per value of the next unit of rank, name); ties go to the name, so the result does not
    # depend on the mapping's order.
    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        spectrum = layers[name]
        rank = ranks[name]
        if rank < spectrum.max_rank:
            heapq.heappush(heap, (-spectrum.gain(rank + 1) / spectrum.cost, name))

    for name in sorted(layers):
        push(name)
    while heap:
        _, name = heapq.heappop(heap)
        cost = layers[name].cost
        if spent + cost > budget:
            continue  # this layer's next unit does not fit; a cheaper layer's may
        ranks[name] += 1
        spent += cost
        push(name)
    return ranks


_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmg]i?b)\s*$", re.IGNORECASE)


def budget_values(budget: Union[int, str], *, element_size: int) -> int:
    """A rank budget as a number of factor values: an int is one already, a size with a unit ('512MiB', '1.5GB')
    is bytes of factors of `element_size` bytes each."""
    if isinstance(budget, bool):
        raise ValueError(f"rank_budget={budget!r}: use a number of factor values or a size such as '512MiB'")
    if isinstance(budget, int):
        return budget
    match = _SIZE.match(budget)
    if match is None:
        raise ValueError(
            f"rank_budget={budget!r} is neither a number of factor values nor a size with a unit (KB, MB, GB, KiB, "
            "MiB, GiB), e.g. rank_budget='512MiB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()]) // element_size
