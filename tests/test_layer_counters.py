"""The layers' schedule counters: host copies that spare the step driver a device sync per layer.

Oracle for "no sync": a TorchDispatchMode counting ``aten._local_scalar_dense`` (what ``int(tensor)`` /
``.item()`` dispatch to: on a GPU, a device-to-host copy that stalls the stream) in each part of a
training step. Oracle for the copies' values: the buffers themselves, and a freshly built layer loaded
with the same state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hf_galore_plugin as hgp
from hf_galore_plugin import GaLoreConfig
from hf_galore_plugin.layers.linear import COUNTER_NAMES

from conftest import build_tiny_llama, torch_round_trip

PRESETS = ["galore_adamw", "qgalore_adamw_8bit"]


class ScalarReads(TorchDispatchMode):
    """Counts Python scalar reads of tensors (``aten._local_scalar_dense``, ``aten.item``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.item):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _config(preset: str, **overrides) -> GaLoreConfig:
    return GaLoreConfig.preset(preset, rank=8, **overrides)


def _reads_per_part(decoder_layers: int, preset: str, steps: int) -> tuple[int, list[dict[str, int]]]:
    """(GaLore layers, scalar reads of forward, backward, optimizer.step and after_step in each of `steps`
    ordinary steps) of a tiny Llama. The gap is beyond the run: after the calibration steps (one per
    staggered phase, traced too but not returned) no layer refreshes."""
    model = build_tiny_llama(num_hidden_layers=decoder_layers)
    # refresh_tokens: the phases packed at preparation for the run's 2 x 16 tokens (known before the first step)
    hgp.prepare_model(model, _config(preset, update_proj_gap=100, refresh_tokens=32))
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    phases = 1 + max(layer.counter("galore_phase") for _, layer in hgp.galore_layers(model))
    parts = []
    for _ in range(phases + steps):
        reads = {}
        with ScalarReads() as mode:
            loss = model(input_ids=ids, labels=ids).loss
        reads["forward"] = mode.count
        with ScalarReads() as mode:
            loss.backward()
        reads["backward"] = mode.count
        with ScalarReads() as mode:
            optimizer.step()
        reads["optimizer"] = mode.count
        with ScalarReads() as mode:
            hgp.after_step(model, optimizer)
        reads["after_step"] = mode.count
        optimizer.zero_grad(set_to_none=True)
        parts.append(reads)
    return len(hgp.galore_layers(model)), parts[phases:]


@pytest.mark.parametrize("preset", PRESETS)
def test_normal_steps_read_no_counter_and_do_not_grow_with_layers(preset):
    # The calibration steps are refreshes, which sync (basis, similarity): left out by _reads_per_part.
    (few, small), (many, large) = (_reads_per_part(n, preset, steps=3) for n in (2, 4))
    assert (few, many) == (14, 28)
    for step in range(3):
        for reads in (small[step], large[step]):
            assert reads["forward"] == reads["backward"] == reads["after_step"] == 0, (step, reads)
        # The 8-bit optimizer reads the step counters of its 8-bit-state parameters (here the embedding and
        # the head), host scalars (no device sync): the same count for 14 and 28 GaLore layers.
        assert small[step]["optimizer"] == large[step]["optimizer"], (step, small[step], large[step])


def _trained_layer(config: GaLoreConfig, steps: int, *, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = hgp.prepare_model(nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 16)), config)
    optimizer = hgp.create_optimizer(model, lr=1e-2, weight_decay=0.01)
    _train(model, optimizer, steps, seed=seed)
    return model, optimizer


def _train(model, optimizer, steps: int, *, seed: int) -> list[list[bool]]:
    """`steps` steps of a regression; returns each step's refresh_due of every layer (before the step)."""
    return _train_from(model, optimizer, start=0, stop=steps, seed=seed)


def _counters_from_buffers(layer) -> dict[str, int]:
    saved = layer.state_dict()  # the buffers as a checkpoint holds them
    return {name: int(saved[name]) for name in COUNTER_NAMES}


# Lazy refresh with a window of 1 grows the gap at every agreeing refresh: every counter moves.
SCHEDULES = {
    "aligned_lazy": dict(update_proj_gap=2, lazy_refresh=True, lazy_window=1, cos_threshold=0.0, max_proj_gap=16),
    "staggered": dict(update_proj_gap=3, refresh_schedule="staggered", refresh_budget_mb=1e-6),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("preset", PRESETS)
def test_load_state_dict_replaces_the_host_counters(preset, schedule):
    config = _config(preset, **SCHEDULES[schedule])
    source, _ = _trained_layer(config, 11, seed=0)
    saved = torch_round_trip(source.state_dict())
    # A layer with other counters (trained on other data, fewer steps) and a fresh one load the same state.
    used, used_optimizer = _trained_layer(config, 4, seed=1)
    fresh, fresh_optimizer = _trained_layer(config, 0, seed=2)
    before = [_counters_from_buffers(layer) for _, layer in hgp.galore_layers(used)]
    assert before != [_counters_from_buffers(layer) for _, layer in hgp.galore_layers(source)]
    for model in (used, fresh):
        model.load_state_dict(saved)
    for (_, a), (_, b), (_, s) in zip(hgp.galore_layers(used), hgp.galore_layers(fresh), hgp.galore_layers(source)):
        assert {name: a.counter(name) for name in COUNTER_NAMES} == _counters_from_buffers(s)
        assert {name: b.counter(name) for name in COUNTER_NAMES} == _counters_from_buffers(s)
        assert (a.refresh_due, a.calibrated) == (b.refresh_due, b.calibrated) == (s.refresh_due, s.calibrated)
    # The same optimizer state on both, then the same schedule decisions and weights, step by step.
    state = used_optimizer.state_dict()
    used_optimizer.load_state_dict(torch_round_trip(state))  # each its own copy: a loaded state is not copied
    fresh_optimizer.load_state_dict(torch_round_trip(state))
    due_used, due_fresh = (_train(m, o, 9, seed=3) for m, o in ((used, used_optimizer), (fresh, fresh_optimizer)))
    assert due_used == due_fresh
    assert any(any(step) for step in due_used[1:])  # refreshes happen after the load
    for key, value in fresh.state_dict().items():
        assert torch.equal(used.state_dict()[key], value), key


@pytest.mark.parametrize("loader", ["load_state_dict", "load_galore_state_dict"])
@pytest.mark.parametrize("preset", PRESETS)
def test_resume_into_a_used_model_is_bit_identical_to_the_uninterrupted_run(preset, loader):
    config = _config(preset, update_proj_gap=3, lazy_refresh=True, lazy_window=1, cos_threshold=0.0)

    def build(seed):
        torch.manual_seed(seed)
        model = hgp.prepare_model(nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 16)), config)
        return model, hgp.create_optimizer(model, lr=1e-2, weight_decay=0.01)

    model, optimizer = build(0)
    uninterrupted = _train(model, optimizer, 14, seed=0)
    expected = model.state_dict()

    model, optimizer = build(0)
    first = _train(model, optimizer, 7, seed=0)
    # Every parameter of this model is in a GaLore layer: galore_state_dict is the whole model.
    state = model.state_dict() if loader == "load_state_dict" else hgp.galore_state_dict(model)
    saved = torch_round_trip({"model": state, "optimizer": optimizer.state_dict()})
    # A model that trained elsewhere (its counters differ from the saved ones) resumes the saved run.
    resumed_model, resumed_optimizer = build(5)
    _train(resumed_model, resumed_optimizer, 5, seed=5)
    if loader == "load_state_dict":
        resumed_model.load_state_dict(saved["model"])
    else:
        hgp.load_galore_state_dict(resumed_model, saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    rest = _train_from(resumed_model, resumed_optimizer, start=7, stop=14, seed=0)
    assert first + rest == uninterrupted
    for key, value in expected.items():
        assert torch.equal(resumed_model.state_dict()[key], value), key


def _train_from(model, optimizer, *, start: int, stop: int, seed: int) -> list[list[bool]]:
    """Steps start..stop-1 of :func:`_train`'s data stream for `seed`."""
    gen = torch.Generator().manual_seed(1000 + seed)
    target = torch.randn(16, 24, generator=gen)
    for _ in range(start):
        torch.randn(8, 24, generator=gen)
    due = []
    for _ in range(start, stop):
        due.append([layer.refresh_due for _, layer in hgp.galore_layers(model)])
        x = torch.randn(8, 24, generator=gen)
        torch.nn.functional.mse_loss(model(x), x @ target.T).backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    return due


def test_sync_counters_takes_a_direct_buffer_write():
    config = _config("galore_adamw", update_proj_gap=4, refresh_schedule="aligned")
    model, optimizer = _trained_layer(config, 3, seed=0)  # step 3: refreshed at 0, next at 4
    layer = model[0]
    assert not layer.refresh_due
    with torch.no_grad():
        layer.galore_step.fill_(4)
    assert not layer.refresh_due  # the host copy still says step 3
    layer.sync_counters()
    assert layer.counter("galore_step") == 4 and layer.refresh_due


def test_a_refresh_adopts_and_reports_an_unsynced_buffer_write():
    config = _config("galore_adamw", update_proj_gap=2)
    model, optimizer = _trained_layer(config, 2, seed=0)  # step 2: a refresh is due
    layer = model[0]
    assert layer.refresh_due
    with torch.no_grad():
        layer.galore_rng_counter.fill_(40)
    before = layer.counter("galore_rng_counter")
    with pytest.warns(
        RuntimeWarning, match=rf"written without sync_counters\(\) \(galore_rng_counter {before} -> 40\)"
    ):
        _train(model, optimizer, 1, seed=0)
    # neither the sketch (a stream of its own) nor the exact SVD draws from it
    assert layer.counter("galore_rng_counter") == int(layer.galore_rng_counter) == 40


def test_counter_names_an_unknown_counter():
    layer = hgp.prepare_model(nn.Sequential(nn.Linear(8, 8)), GaLoreConfig(rank=2))[0]
    assert layer.counter("galore_gap") == int(layer.galore_gap)
    with pytest.raises(ValueError, match=r"'galore_steps' is not a GaLore counter; the counters are galore_step"):
        layer.counter("galore_steps")


def test_a_counter_of_another_shape_is_refused_at_load():
    layer = hgp.prepare_model(nn.Sequential(nn.Linear(8, 8)), GaLoreConfig(rank=2))[0]
    state = {**layer.state_dict(), "galore_step": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"counter buffer 'galore_step' is of shape \(2,\), a counter holds one value"):
        layer.load_state_dict(state)
