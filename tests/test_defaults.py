"""The shipped defaults bound the refresh step (issue 26), and runs started under the old defaults resume.

Oracles: the paper's aligned schedule with exact SVD (`PAPER_REFRESH`, the defaults before: every layer
records its dense fp32 gradient on step 0 and every gap), the packing a fresh run makes
(`assign_refresh_phases`), and an uninterrupted run (a resumed run must equal it bit for bit).
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

from hf_galore_plugin import PRESETS, GaLoreConfig, after_step, create_optimizer, galore_layers, prepare_model, state_of
from hf_galore_plugin.checkpoint.state import apply_mutable_changes, compare_galore_config
from hf_galore_plugin.config import PAPER_REFRESH, kept_on_resume
from hf_galore_plugin.layers import assign_refresh_phases
from hf_galore_plugin.layers.schedule import StepTokens

# Six layers of different sizes (fp32 gradients 1536 to 16896 bytes), left and right bases.
SIZES = ((64, 33), (33, 25), (25, 96), (96, 44), (44, 32), (32, 12))
TARGETS = ["0", "2", "4", "6", "8", "10"]  # every linear (names are matched as suffixes)
GAP = 6


def _model(preset: str = "galore_adamw", **overrides) -> nn.Module:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for n_in, n_out in SIZES:
        modules += [nn.Linear(n_in, n_out), nn.Tanh()]
    config = GaLoreConfig.preset(preset, rank=4, update_proj_gap=GAP, target_modules=TARGETS, **overrides)
    return prepare_model(nn.Sequential(*modules[:-1]), config)


def _data(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 64, generator=gen) for _ in range(steps)]


def _run(model: nn.Module, optimizer, data) -> list[tuple[int, list[str]]]:
    """Train on `data`; per step: the refresh-record bytes held at the end of backward, the layers refreshed."""
    trace = []
    for x in data:
        model(x).square().mean().backward()
        recorded = sum(layer.recorded_nbytes() for _, layer in galore_layers(model))
        optimizer.step()
        trace.append((recorded, after_step(model, optimizer)["refreshed"]))
        optimizer.zero_grad()
    return trace


# ---------------------------------------------------------------------------------------------- defaults
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_records_at_most_one_layer_gradient_per_step(preset):
    # The bound: a refresh step holds no more than one layer's dense fp32 gradient (the default
    # budget) on top of a normal step, calibration included. The paper's schedule, the oracle of what
    # the default removes, holds every layer's gradient on step 0 and every gap.
    gradients = [4 * n_in * n_out for n_in, n_out in SIZES]
    steps = 2 * GAP + 1
    model = _model(preset)
    trace = _run(model, create_optimizer(model, lr=1e-2), _data(steps))
    assert 0 < max(recorded for recorded, _ in trace) <= max(gradients)
    for cycle in (range(GAP), range(GAP, 2 * GAP)):  # every layer calibrates, then refreshes, once per gap
        assert sorted(n for step in cycle for n in trace[step][1]) == sorted(TARGETS)

    paper = _model(preset, **PAPER_REFRESH)
    paper_trace = _run(paper, create_optimizer(paper, lr=1e-2), _data(steps))
    assert [recorded for recorded, _ in paper_trace] == [sum(gradients) if s % GAP == 0 else 0 for s in range(steps)]


def test_defaults_are_the_staggered_schedule_with_sketches_and_the_paper_refresh_differs():
    for preset in PRESETS:
        config = GaLoreConfig.preset(preset)
        assert (config.refresh_schedule, config.basis_method, config.refresh_budget_mb) == ("staggered", "sketch", None)
        paper = GaLoreConfig.preset(preset, **PAPER_REFRESH)
        assert (paper.refresh_schedule, paper.basis_method) == ("aligned", "svd")
    # the budget is a staggered setting: with the aligned schedule it is a contradiction, named as such
    with pytest.raises(ValueError, match="refresh_budget_mb=64 is invalid: it bounds the staggered schedule only"):
        GaLoreConfig(refresh_budget_mb=64, refresh_schedule="aligned")


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize(
    "saved, now, budget, kept",
    [
        # written under the old defaults, resumed under the new ones: a version's default, not a request
        ({"refresh_schedule": "aligned", "basis_method": "svd"}, {}, None,
         {"refresh_schedule": "aligned", "basis_method": "svd"}),
        # a value other than the new default is a request: it takes effect
        ({"refresh_schedule": "aligned", "basis_method": "svd"}, {"basis_method": "randomized"}, None,
         {"refresh_schedule": "aligned"}),
        # a budget exists only for the staggered schedule: asking for one asks for staggered
        ({"refresh_schedule": "aligned", "basis_method": "svd"}, {}, 1.0, {"basis_method": "svd"}),
        # saved explicitly at a non-paper value: changing it is a request like any other
        ({"refresh_schedule": "staggered", "basis_method": "randomized"}, {}, None, {}),
    ],
)  # fmt: skip
def test_kept_on_resume_keeps_only_what_a_changed_default_moved(saved, now, budget, kept):
    extra = {"refresh_budget_mb": budget} if budget is not None else {}
    current = GaLoreConfig(**now, **extra)
    changed = compare_galore_config({**GaLoreConfig().to_dict(), **saved}, current, where="test")
    assert kept_on_resume(changed, current) == kept


def _checkpoint(model: nn.Module, optimizer) -> dict:
    buffer = io.BytesIO()
    config = state_of(model).config.to_dict()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": config}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resume(saved: dict, **overrides):
    model = _model(**overrides)
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.01)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    # what every resume path of the Trainer integration does after loading galore_state.pt
    changed = compare_galore_config(saved["config"], state_of(model).config, where="checkpoint-9")
    apply_mutable_changes(model, changed, where="checkpoint-9")
    return model, optimizer


def test_resume_of_a_run_started_under_the_old_defaults_continues_as_it_started(caplog):
    data = _data(20)
    model = _model(**PAPER_REFRESH)
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.01)
    trace = _run(model, optimizer, data)
    uninterrupted = model.state_dict()

    model = _model(**PAPER_REFRESH)
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.01)
    _run(model, optimizer, data[:9])
    saved = _checkpoint(model, optimizer)
    with caplog.at_level(logging.WARNING, logger="hf_galore_plugin.api"):
        model, optimizer = _resume(saved)  # today's defaults: staggered, sketch
    assert "refresh_schedule='aligned', basis_method='svd', the defaults before the bounded refresh" in caplog.text
    assert "take effect" not in caplog.text  # nothing else changed
    assert (state_of(model).config.refresh_schedule, state_of(model).config.basis_method) == ("aligned", "svd")
    resumed_trace = _run(model, optimizer, data[9:])
    assert resumed_trace == trace[9:]  # every layer refreshes at step 12 and 18, with its dense gradient
    resumed = model.state_dict()
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def test_resume_that_asks_for_the_staggered_schedule_repacks_the_saved_phases(caplog):
    model = _model(**PAPER_REFRESH)
    optimizer = create_optimizer(model, lr=1e-2)
    _run(model, optimizer, _data(9))
    saved = _checkpoint(model, optimizer)
    budget = 20_000 / 2**20
    with caplog.at_level(logging.WARNING, logger="hf_galore_plugin.api"):
        model, optimizer = _resume(saved, basis_method="svd", refresh_budget_mb=budget)
    assert "refresh_schedule 'aligned' -> 'staggered'" in caplog.text and "take effect" in caplog.text
    # what a new run packs at its first training forward: 16 fp32 rows
    fresh = _model(basis_method="svd", refresh_budget_mb=budget)
    assign_refresh_phases([layer for _, layer in galore_layers(fresh)], StepTokens(tokens=16, itemsize=4))
    # each layer (last refreshed at step 6) refreshes once in the next gap, on its own phase step
    trace = _run(model, optimizer, _data(GAP + 3))  # steps 9 .. 17; the first forward packs the phases
    phases = {name: int(layer.galore_phase) for name, layer in galore_layers(model)}
    assert phases == {name: int(layer.galore_phase) for name, layer in galore_layers(fresh)}
    assert len(set(phases.values())) > 1
    for name, phase in phases.items():
        assert [9 + i for i, (_, names) in enumerate(trace) if name in names] == [12 + phase], (name, phase)
    assert max(recorded for recorded, _ in trace) <= int(budget * 2**20)
