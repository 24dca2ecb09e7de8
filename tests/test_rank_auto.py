"""rank_allocation='auto' end to end: spectra measured at calibration against the dense gradient, the
allocation within the budget and bounds, the change of rank at the next refresh (effective weight unchanged,
optimizer state restarted), exact resume across it, merged reload, the Trainer's report, refusals."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hf_galore_plugin as hgp
from hf_galore_plugin import api
from hf_galore_plugin.integrations.optim_args import parse_optim_args
from hf_galore_plugin.layers import rank as layer_rank
from hf_galore_plugin.projection import basis_from_sketch
from hf_galore_plugin.ranks import LayerSpectrum, allocate_ranks, captured_share

VOCAB, HIDDEN = 48, 64
TARGETS = ["blocks.0", "blocks.1", "blocks.2", "up"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.head = nn.Linear(2 * HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(torch.relu(self.up(h)))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _config(**overrides) -> hgp.GaLoreConfig:
    settings = dict(rank=8, rank_allocation="auto", update_proj_gap=4, refresh_schedule="aligned",
                    target_modules=TARGETS, seed=3)  # fmt: skip
    return hgp.GaLoreConfig(**{**settings, **overrides})


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (4, 12), generator=g)
    # a learnable target (the next id of a fixed permutation), so gradients have structure
    return ids, (ids * 7 + 3) % VOCAB


def _train(model, opt, steps, *, start=0, before_after_step=None):
    losses = []
    for step in range(start, start + steps):
        ids, target = _batch(step)
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if before_after_step is not None:
            before_after_step(step)
        hgp.after_step(model, opt)
        losses.append(loss.item())
    return losses


def _prepared(config=None, seed=0):
    model = hgp.prepare_model(_net(seed), config or _config())
    return model, hgp.create_optimizer(model, lr=3e-3)


def _ranks(model) -> dict[str, int]:
    return {name: layer.right_rank or layer.left_rank for name, layer in hgp.galore_layers(model)}


def test_rank_auto_spells_allocation_at_the_default_rank():
    assert hgp.GaLoreConfig(rank="auto") == hgp.GaLoreConfig(rank=128, rank_allocation="auto")
    assert parse_optim_args("rank=auto,rank_budget=512MiB,rank_max=64") == {
        "rank": "auto", "rank_budget": "512MiB", "rank_max": 64}  # fmt: skip


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(rank="adaptive"), "rank"),
        (dict(rank_allocation="uniform", rank_budget=1000), "rank_budget"),
        (dict(rank_allocation="uniform", rank_max=16), "rank_max"),
        (dict(rank_budget="12 parsecs"), "rank_budget"),
        (dict(rank_budget=0), "rank_budget"),
        (dict(rank_min=9, rank_max=4), "rank_max"),
        (dict(rank_min=0), "rank_min"),
        (dict(rank_allocation="spectral"), "rank_allocation"),
        (dict(rank_allocation="ranks.txt"), "rank_allocation"),
        (dict(rank_allocation="ranks.json", rank_max=8), "rank_max"),
        (dict(proj_type="full"), "rank_allocation"),
        (dict(residual=True), "rank_allocation"),
    ],
)
def test_bad_settings_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"GaLoreConfig.{field}="):
        _config(**overrides)


def test_svd_spectrum_is_the_dense_gradients():
    """Oracle: the spectrum a dense ('svd') calibration keeps is the squared singular values of the layer's
    gradient, computed here from a plain copy of the model on the same batch."""
    plain = _net()
    model, opt = _prepared(_config(basis_method="svd"))
    ids, target = _batch(0)
    nn.functional.cross_entropy(plain(ids).reshape(-1, VOCAB), target.reshape(-1)).backward()
    _train(model, opt, 1)
    for name, layer in hgp.galore_layers(model):
        weight = plain.get_submodule(name).weight.grad
        expected = torch.linalg.svdvals(weight).square()
        high = layer._adaptive.high
        torch.testing.assert_close(layer.galore_spectrum, expected[:high], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(layer.galore_spectrum_total, weight.square().sum(), rtol=1e-4, atol=1e-9)


def test_sketched_spectra_allocate_as_the_exact_ones():
    """The default calibration sketches the gradient (k = rank_max + oversampling columns); its singular values
    overstate the top of the spectrum (a k-column sketch concentrates the energy), for every layer alike. What
    matters is the split: the ranks allocated from the sketched spectra capture, measured on the exact
    spectra of the dense gradients, within 0.02 per layer of what the exact spectra's allocation captures."""
    plain = _net()
    model, opt = _prepared()
    ids, target = _batch(0)
    nn.functional.cross_entropy(plain(ids).reshape(-1, VOCAB), target.reshape(-1)).backward()
    _train(model, opt, 1)
    layers = hgp.galore_layers(model)
    exact, sketched = {}, {}
    for name, layer in layers:
        values = torch.linalg.svdvals(plain.get_submodule(name).weight.grad).square()
        state = layer._adaptive
        exact[name] = LayerSpectrum(
            values[: state.high].tolist(), float(values.sum()), state.cost, state.low, state.high
        )
        sketched[name] = api._spectra([(name, layer)])[name]
        # the sketch's whole energy is an unbiased estimate of the gradient's (E ||G^T Omega||^2 = k ||G||^2)
        assert abs(sketched[name].total / exact[name].total - 1) < 0.35, name
    budget = api.rank_budget(layers)
    from_sketch = allocate_ranks(sketched, budget)
    from_exact = allocate_ranks(exact, budget)
    captured = sum(captured_share(exact[n], r) for n, r in from_sketch.items())
    best = sum(captured_share(exact[n], r) for n, r in from_exact.items())
    assert captured >= best - 0.02 * len(layers)
    assert from_sketch == {name: layer._adaptive.target for name, layer in layers}


class _Decompositions(TorchDispatchMode):
    """Logs the input shape of every SVD and symmetric eigendecomposition dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_linalg_svd", "_linalg_eigh", "linalg_eigvalsh"):
            self.calls.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def test_calibration_spectrum_from_the_whole_sketch_and_basis_as_uniform(monkeypatch):
    """Cost rule of an 'auto' calibration: its record is rank_max + oversampling wide (24 columns here) for the
    spectrum, which comes from the eigenvalues of that sketch's 24 x 24 Gram matrix (oracle: svdvals of the
    sketch); the basis comes from the first rank + oversampling (16) columns, by the same SVD of the same
    width as a uniform calibration's, so no decomposition of the tall wide sketch runs."""
    records = {}
    measure = layer_rank.measure_spectrum

    def keep(layer, record):
        if layer._adaptive is not None:
            records[id(layer)] = record[layer._adaptive.side].clone()
        measure(layer, record)

    monkeypatch.setattr(layer_rank, "measure_spectrum", keep)
    calls = {}
    for allocation in ("uniform", "auto"):
        model, opt = _prepared(_config(rank_allocation=allocation))
        with _Decompositions() as log:
            _train(model, opt, 1)
        calls[allocation] = log.calls
    svds = [call for call in calls["auto"] if call[0] == "_linalg_svd"]
    assert svds == calls["uniform"] == [("_linalg_svd", (64, 16))] * len(TARGETS)
    assert [call for call in calls["auto"] if call not in svds] == [("_linalg_eigh", (24, 24))] * len(TARGETS)
    for _, layer in hgp.galore_layers(model):
        sketch = records[id(layer)]
        assert sketch.shape == (64, 24)
        expected = torch.linalg.svdvals(sketch).square() / 24
        torch.testing.assert_close(layer.galore_spectrum, expected[:16], rtol=1e-4, atol=1e-6 * float(expected[0]))
        torch.testing.assert_close(layer.galore_spectrum_total, sketch.square().sum() / 24, rtol=1e-5, atol=0)
        torch.testing.assert_close(layer.basis("right"), basis_from_sketch(sketch[:, :16], rank=8), rtol=0, atol=1e-6)


def test_allocation_respects_budget_and_bounds_and_is_taken_at_the_next_refresh():
    model, opt = _prepared(_config(rank_min=3, rank_max=14))
    layers = hgp.galore_layers(model)
    uniform = sum(layer.galore_factor.numel() for _, layer in layers)
    assert api.rank_budget(layers) == uniform
    _train(model, opt, 1)  # calibration: every layer measures, the driver allocates
    targets = {name: layer._adaptive.target for name, layer in layers}
    assert all(3 <= r <= 14 for r in targets.values())
    assert sum(layer._adaptive.cost * targets[name] for name, layer in layers) <= uniform
    assert len(set(targets.values())) > 1, "the layers' spectra differ: so do their ranks"
    assert set(_ranks(model).values()) == {8}, "the ranks change at the next refresh, not at the allocation"
    _train(model, opt, 4, start=1)  # step 4 refreshes
    assert _ranks(model) == targets
    assert sum(layer.galore_factor.numel() for _, layer in layers) <= uniform
    rows = {row["layer"]: row for row in hgp.rank_report(model)}
    assert {name: row["rank"] for name, row in rows.items()} == targets
    assert sum(row["factor_values"] for row in rows.values()) <= uniform


def test_explicit_budget_in_bytes():
    model, opt = _prepared(_config(rank_budget="4KiB"))  # 1024 fp32 values
    # the layers start within the budget too: at the one rank whose values fit (1024 // (3 x 64 + 128) = 3)
    assert set(_ranks(model).values()) == {3}
    assert sum(layer.galore_factor.numel() for _, layer in hgp.galore_layers(model)) <= 1024
    _train(model, opt, 1)
    layers = hgp.galore_layers(model)
    spent = sum(layer._adaptive.cost * layer._adaptive.target for _, layer in layers)
    assert 1024 - 128 < spent <= 1024
    # four layers at rank_min (2): 3 x 64 x 2 + 128 x 2 = 640 values: a smaller budget is refused before training
    model = hgp.prepare_model(_net(), _config(rank_budget=600))
    with pytest.raises(ValueError, match="below the 640 values"):
        hgp.create_optimizer(model, lr=1e-3)


def test_resize_keeps_the_effective_weight_and_restarts_the_state():
    model, opt = _prepared()
    layers = dict(hgp.galore_layers(model))
    _train(model, opt, 4)
    before = {}

    def snapshot(step):
        if step == 4:
            before.update({name: layer.effective_weight().clone() for name, layer in layers.items()})

    _train(model, opt, 1, start=4, before_after_step=snapshot)
    changed = [name for name, layer in layers.items() if layer.galore_factor.shape[1] != 8]
    assert changed
    for name, layer in layers.items():
        torch.testing.assert_close(layer.effective_weight(), before[name], rtol=0, atol=1e-6)
        if name in changed:
            assert not opt.state[layer.galore_factor], "a factor of a new shape starts without optimizer state"
            assert torch.count_nonzero(layer.galore_factor) == 0
    # each adaptive factor has its own group, whose eps follows the layer's scale (eps * scale: galore_param_groups)
    base = next(group["eps"] for group in opt.param_groups if not group.get("galore"))
    for name, layer in layers.items():
        (group,) = [g for g in opt.param_groups if any(p is layer.galore_factor for p in g["params"])]
        assert group["galore_layers"] == [name]
        assert group["eps"] == pytest.approx(base * layer.scale, rel=1e-12)
    _train(model, opt, 2, start=5)  # trains on at the new shapes
    assert all(layer.galore_factor.abs().sum() > 0 for layer in layers.values())


@pytest.mark.parametrize("stop", [2, 6], ids=["allocated-not-taken", "after-the-change"])
def test_resume_is_bit_exact(stop):
    model, opt = _prepared()
    reference = _train(model, opt, 10)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt = _prepared()
    first = _train(model, opt, stop)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    resumed, resumed_opt = _prepared(seed=5)  # a new run: other weights, uniform shapes, until the load
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    assert _ranks(resumed) == _ranks(model)
    rest = _train(resumed, resumed_opt, 10 - stop, start=stop)
    assert first + rest == reference
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_merged_weights_reload_into_the_plain_model():
    model, opt = _prepared()
    _train(model, opt, 6)
    plain = _net(seed=9)
    plain.load_state_dict(hgp.merged_state_dict(model))
    ids, _ = _batch(99)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_uniform_rank_is_unchanged():
    """Without 'auto' nothing is measured or allocated, and the record is as wide as before."""
    model, opt = _prepared(_config(rank_allocation="uniform"))
    _train(model, opt, 6)
    assert set(_ranks(model).values()) == {8}
    assert all(layer._adaptive is None for _, layer in hgp.galore_layers(model))
    assert all("galore_spectrum" not in layer.state_dict() for _, layer in hgp.galore_layers(model))
    assert hgp.rank_report(model) == []


def test_refused_across_processes(monkeypatch):
    monkeypatch.setattr(api, "world_size", lambda: 2)
    with pytest.raises(ValueError, match="rank_allocation='auto' runs in one process"):
        hgp.prepare_model(_net(), _config())


def test_report_and_plot(tmp_path):
    model, opt = _prepared()
    assert hgp.save_rank_report(model, str(tmp_path)) is None  # nothing measured yet
    _train(model, opt, 1)
    path = hgp.save_rank_report(model, str(tmp_path))
    rows = json.loads(open(path).read())
    assert [row["layer"] for row in rows] == TARGETS
    assert all(0 < row["share"] <= 1 and row["factor_bytes"] == 4 * row["factor_values"] for row in rows)
    pytest.importorskip("matplotlib")
    assert os.path.getsize(tmp_path / "galore_ranks.png") > 1000


def test_trainer_allocates_and_writes_the_report(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer

    from conftest import build_tiny_llama, token_data, training_args

    args = training_args(tmp_path, optim="galore_adamw",
                         optim_args="rank=8,rank_allocation=auto,rank_min=2,rank_max=24,update_proj_gap=2", max_steps=5)  # fmt: skip
    model = build_tiny_llama()
    trainer = Trainer(model=model, args=args, train_dataset=token_data())
    trainer.train()
    rows = json.loads((tmp_path / "galore_ranks.json").read_text())
    assert rows and all(2 <= row["rank"] <= 24 for row in rows)
    ranks = {name: layer.right_rank or layer.left_rank for name, layer in hgp.galore_layers(trainer.model)}
    assert {row["layer"]: row["rank"] for row in rows} == {name: ranks[name] for name in (r["layer"] for r in rows)}


def test_ranks_from_the_report_of_an_auto_run_fixed_from_the_start(tmp_path):
    """rank_allocation=<galore_ranks.json>: an 'auto' run's ranks, built at construction (what the engines run)."""
    model, opt = _prepared()
    _train(model, opt, 1)
    path = hgp.save_rank_report(model, str(tmp_path))
    chosen = {name: layer._adaptive.target for name, layer in hgp.galore_layers(model)}
    fixed, fixed_opt = _prepared(_config(rank_allocation=path))
    assert _ranks(fixed) == chosen
    assert all(layer._adaptive is None for _, layer in hgp.galore_layers(fixed))
    _train(fixed, fixed_opt, 5)
    assert _ranks(fixed) == chosen


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"blocks.0": 4}', r"missing \['blocks.1', 'blocks.2', 'up'\]"),
        ('{"blocks.0": 4, "blocks.1": 4, "blocks.2": 4, "up": 4, "head": 4}', r"not targeted here \['head'\]"),
        ('{"blocks.0": 0, "blocks.1": 4, "blocks.2": 4, "up": 4}', "positive int rank"),
        ("[1, 2]", "positive int rank"),
        ("not json", "not a JSON file"),
    ],
)
def test_a_ranks_file_that_does_not_fit_is_refused(tmp_path, content, message):
    path = tmp_path / "ranks.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        hgp.prepare_model(_net(), _config(rank_allocation=str(path)))
    with pytest.raises(ValueError, match="cannot read"):
        hgp.prepare_model(_net(), _config(rank_allocation=str(tmp_path / "absent.json")))


def test_planner_plans_auto_at_its_budget(tmp_path):
    """The planner traces rank_allocation='auto' at the starting ranks (the budget's total) with the calibration's
    wider sketches, and says so; its ordinary step holds what uniform's holds (same factor values)."""
    pytest.importorskip("transformers")
    from hf_galore_plugin.plan import estimate

    config = tmp_path / "config.json"
    from conftest import TINY_LLAMA
    from transformers import LlamaConfig

    config.write_text(json.dumps({**LlamaConfig(**TINY_LLAMA).to_dict(), "vocab_size": 512}))
    common = dict(config=str(config), methods=["galore_adamw"], rank=8, seq_len=32, device="cpu")
    auto = estimate(**common, optim_args="rank_allocation=auto")["methods"]["galore_adamw"]
    uniform = estimate(**common)["methods"]["galore_adamw"]
    assert any("rank_allocation='auto': planned at the starting rank 8" in note for note in auto["notes"])
    # the same factors and optimizer state; plus each of the 14 layers' spectrum (rank_max 16 fp32 values), its
    # total (fp32) and its target rank (int64)
    assert auto["peak_bytes"] - uniform["peak_bytes"] == 14 * (16 * 4 + 4 + 8)
    # calibration records up to rank_max: every layer's at once under the aligned schedule (staggered, the wider
    # records also pack into other phases, whose peaks are not ordered)
    aligned = {
        "auto": estimate(**common, optim_args="rank_allocation=auto,refresh_schedule=aligned"),
        "uniform": estimate(**common, optim_args="refresh_schedule=aligned"),
    }
    refresh = {name: run["methods"]["galore_adamw"]["refresh_peak_bytes"] for name, run in aligned.items()}
    assert refresh["auto"] > refresh["uniform"]
    # an explicit budget: the layers start at the rank whose values it holds (640 values per unit of rank in each
    # decoder layer: q, k, v, o 64 each, gate and up 128 each, down 128; 16000 // 1280 = 12), and are planned there
    larger = estimate(**common, optim_args="rank_allocation=auto,rank_budget=16000")["methods"]["galore_adamw"]
    assert any("planned at the starting rank 12 (15,360 factor values" in note for note in larger["notes"])
    assert larger["peak_bytes"] > auto["peak_bytes"]


def test_trainer_resume_across_the_change_of_rank_is_bit_exact(tmp_path):
    """galore_state.pt carries the spectra, the targets and the factors at their ranks: a resume from a
    checkpoint taken after the layers took their ranks continues exactly."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    from conftest import build_tiny_llama, logged_losses, token_data, training_args

    def run(output_dir, resume=None):
        args = training_args(output_dir, optim="galore_adamw", max_steps=8, save_strategy="steps", save_steps=4,
                             optim_args="rank=8,rank_allocation=auto,rank_min=2,rank_max=24,update_proj_gap=2")  # fmt: skip
        trainer = Trainer(model=build_tiny_llama(), args=args, train_dataset=token_data())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    ranks = {name: layer.right_rank or layer.left_rank for name, layer in hgp.galore_layers(full.model)}
    assert len(set(ranks.values())) > 1
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-4"))
    assert logged_losses(resumed) == logged_losses(full)
    full_state, resumed_state = full.model.state_dict(), resumed.model.state_dict()
    assert full_state.keys() == resumed_state.keys()
    for key in full_state:
        assert torch.equal(full_state[key], resumed_state[key]), key


@pytest.mark.parametrize(
    "preset, extra",
    [
        ("qgalore_adamw_8bit", {}),  # 8-bit state, INT8 W0, INT4 bases: the resize stores quantized zero bases
        ("galore_adafactor", {}),  # factored second moment; its (eps1, eps2) follows the scale
        ("galore_muon", {}),
        ("galore_adamw", {"basis_method": "randomized"}),  # a dense record: the exact spectrum
        ("galore_adamw", {"moment_handling": "project"}),
        ("galore_adamw", {"state_offload": "cpu"}),
    ],
)
def test_every_preset_takes_its_ranks_and_resumes_exactly(preset, extra):
    config = hgp.GaLoreConfig.preset(preset, **{**dict(rank=8, rank_allocation="auto", update_proj_gap=4,
                                                       refresh_schedule="aligned", target_modules=TARGETS), **extra})  # fmt: skip
    model = hgp.prepare_model(_net(), config)
    opt = hgp.create_optimizer(model, lr=3e-3)
    _train(model, opt, 6)
    assert {name: layer._adaptive.target for name, layer in hgp.galore_layers(model)} == _ranks(model)
    assert set(_ranks(model).values()) != {8}
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = hgp.prepare_model(_net(seed=4), config)
    resumed_opt = hgp.create_optimizer(resumed, lr=3e-3)
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    assert _train(resumed, resumed_opt, 4, start=6) == _train(model, opt, 4, start=6)
