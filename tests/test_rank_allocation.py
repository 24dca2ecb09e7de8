"""The rank allocator (hf_galore_plugin.ranks) against exhaustive search on small spectra."""

from __future__ import annotations

import itertools
import random

import pytest

from hf_galore_plugin.ranks import LayerSpectrum, allocate_ranks, budget_values, captured_share


def _spectrum(rng: random.Random, max_rank: int, cost: int, min_rank: int = 1) -> LayerSpectrum:
    # A decaying spectrum with a random rate and random size: layers differ in how low-rank they are.
    decay = rng.uniform(0.3, 0.95)
    size = 10 ** rng.uniform(-3, 3)
    energies = [size * decay**i * rng.uniform(0.8, 1.0) for i in range(max_rank + 4)]
    energies.sort(reverse=True)
    total = sum(energies) * rng.uniform(1.0, 1.5)  # the tail beyond the measured values
    return LayerSpectrum(energies=energies, total=total, cost=cost, min_rank=min_rank, max_rank=max_rank)


def _brute_force(layers: dict[str, LayerSpectrum], budget: int) -> tuple[float, dict[str, int]]:
    names = sorted(layers)
    best = (-1.0, {})
    for ranks in itertools.product(*(range(layers[n].min_rank, layers[n].max_rank + 1) for n in names)):
        if sum(layers[n].cost * r for n, r in zip(names, ranks)) > budget:
            continue
        value = sum(captured_share(layers[n], r) for n, r in zip(names, ranks))
        if value > best[0]:
            best = (value, dict(zip(names, ranks)))
    return best


def _value(layers: dict[str, LayerSpectrum], ranks: dict[str, int]) -> float:
    return sum(captured_share(layers[n], r) for n, r in ranks.items())


@pytest.mark.parametrize("seed", range(12))
def test_equal_costs_reach_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    layers = {f"l{i}": _spectrum(rng, max_rank=6, cost=4, min_rank=rng.randint(1, 2)) for i in range(4)}
    budget = rng.randint(sum(s.cost * s.min_rank for s in layers.values()), 4 * 6 * 4)
    ranks = allocate_ranks(layers, budget)
    best, _ = _brute_force(layers, budget)
    assert sum(layers[n].cost * r for n, r in ranks.items()) <= budget
    assert _value(layers, ranks) == pytest.approx(best, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_unequal_costs_within_one_rank_step_of_the_optimum(seed):
    rng = random.Random(100 + seed)
    layers = {f"l{i}": _spectrum(rng, max_rank=5, cost=rng.choice([2, 3, 5, 8])) for i in range(4)}
    budget = rng.randint(sum(s.cost for s in layers.values()), sum(s.cost * 5 for s in layers.values()))
    ranks = allocate_ranks(layers, budget)
    best, _ = _brute_force(layers, budget)
    assert sum(layers[n].cost * r for n, r in ranks.items()) <= budget
    largest_step = max(s.gain(r) for s in layers.values() for r in range(s.min_rank + 1, s.max_rank + 1))
    assert _value(layers, ranks) >= best - largest_step - 1e-12
    assert _value(layers, ranks) <= best + 1e-12


def test_bounds_and_budget_are_respected_exactly():
    rng = random.Random(7)
    layers = {f"l{i}": _spectrum(rng, max_rank=8, cost=3, min_rank=2) for i in range(5)}
    # a budget that fits every layer's maximum: every layer at its maximum, nothing more
    assert allocate_ranks(layers, 10**6) == {n: 8 for n in layers}
    # exactly the minimum: every layer at its minimum
    assert allocate_ranks(layers, 5 * 3 * 2) == {n: 2 for n in layers}
    budget = 5 * 3 * 5
    ranks = allocate_ranks(layers, budget)
    assert sum(3 * r for r in ranks.values()) == budget  # equal costs: the whole budget is spent
    assert all(2 <= r <= 8 for r in ranks.values())


def test_a_layer_with_a_flat_spectrum_gets_more_rank_than_a_low_rank_one():
    flat = LayerSpectrum(energies=[1.0] * 16, total=16.0, cost=1, min_rank=1, max_rank=16)
    steep = LayerSpectrum(energies=[2.0**-i for i in range(16)], total=2.0, cost=1, min_rank=1, max_rank=16)
    ranks = allocate_ranks({"flat": flat, "steep": steep}, 16)
    assert ranks["flat"] > ranks["steep"]


def test_gradient_size_does_not_decide_the_split():
    """Shares, not energies: scaling one layer's gradient by 1000 leaves the allocation as it was."""
    rng = random.Random(3)
    layers = {f"l{i}": _spectrum(rng, max_rank=6, cost=2) for i in range(3)}
    loud = dict(layers)
    s = layers["l0"]
    loud["l0"] = LayerSpectrum([e * 1000 for e in s.energies], s.total * 1000, s.cost, s.min_rank, s.max_rank)
    assert allocate_ranks(loud, 20) == allocate_ranks(layers, 20)


def test_budget_below_the_minimums_is_refused_with_the_shortfall():
    layers = {"a": LayerSpectrum([1.0] * 4, 4.0, cost=10, min_rank=2, max_rank=4)}
    with pytest.raises(ValueError, match="below the 20 values"):
        allocate_ranks(layers, 19)


def test_a_layer_without_gradient_stays_at_its_minimum():
    zero = LayerSpectrum([0.0] * 4, 0.0, cost=1, min_rank=1, max_rank=4)
    some = LayerSpectrum([1.0, 0.5, 0.25, 0.1], 2.0, cost=1, min_rank=1, max_rank=4)
    assert allocate_ranks({"zero": zero, "some": some}, 5) == {"zero": 1, "some": 4}


@pytest.mark.parametrize(
    "budget, values",
    [(1000, 1000), ("1KiB", 512), ("1.5MB", 750_000), (" 2 GiB ", 2**30), ("4kb", 2000)],
)
def test_budget_values(budget, values):
    assert budget_values(budget, element_size=2) == values


@pytest.mark.parametrize("budget", ["12", "1TB", "MiB", True])
def test_budget_values_refuses_what_it_cannot_read(budget):
    with pytest.raises(ValueError, match="rank_budget"):
        budget_values(budget, element_size=2)
