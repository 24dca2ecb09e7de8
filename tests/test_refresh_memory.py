"""Refresh with bounded memory: staggered refresh phases and streaming gradient sketches.

Oracles: the paper's aligned schedule (bit-identical when every phase is 0), the dense layer gradient
(sketch == G Omega), torch.linalg.svd (the sketch's basis spans the top singular subspace), an
uninterrupted run (resume) and one process (2 DDP ranks).
"""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import pytest
import torch
from _tolerances import assert_close_up_to_rounding, dot_tolerance

from hf_galore_plugin.engines import collectives
from torch import nn

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, prepare_model
from hf_galore_plugin.config import PAPER_REFRESH
from hf_galore_plugin.integrations.optim_args import parse_optim_args
from hf_galore_plugin.layers import assign_refresh_phases
from hf_galore_plugin.layers.schedule import StepTokens
from hf_galore_plugin.projection import basis_from_sketch, subspace_similarity

from distributed._launch import run_one_process, run_two_ranks

# Layers of different sizes (dense fp32 gradients 8448, 13200, 4800, 16896, 3072 bytes), 'std' sides
# on both sides: 33x64 and 96x44 keep a right basis, 25x33, 32x96 and 12x64 a left one.
SIZES = ((64, 33), (33, 25), (25, 96), (96, 44), (44, 32), (32, 12))
TARGETS = ["0", "2", "4", "6", "8", "10"]  # every linear but the last


def _model(**config) -> nn.Module:
    torch.manual_seed(0)
    modules = []
    for n_in, n_out in SIZES:
        modules += [nn.Linear(n_in, n_out), nn.Tanh()]
    model = nn.Sequential(*modules[:-1])
    # Each test names the schedule and basis method it is about; the rest is the paper's refresh.
    config = {**PAPER_REFRESH, **config}
    return prepare_model(model, GaLoreConfig(rank=4, update_proj_gap=6, target_modules=TARGETS, **config))


def _data(steps: int, micro: int = 1):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen)
        y = torch.sin(x[:, :12])
        yield list(zip(x.chunk(micro), y.chunk(micro)))


def _run(model, optimizer, data, *, on_backward=None):
    """Train; returns per step (recorded bytes held at the end of backward, names refreshed)."""
    trace = []
    for micro_batches in data:
        for x, y in micro_batches:
            (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
        recorded = sum(layer.recorded_nbytes() for _, layer in galore_layers(model))
        if on_backward is not None:
            on_backward()
        optimizer.step()
        event = after_step(model, optimizer)
        optimizer.zero_grad()
        trace.append((recorded, event["refreshed"]))
    return trace


def _state(model, optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---------------------------------------------------------------------------------------------- staggered
@pytest.mark.parametrize("budget_mb, lazy", [(None, False), (20_000 / 2**20, False), (None, True)])
def test_staggered_layers_refresh_once_per_gap_at_their_phase_within_the_budget(budget_mb, lazy):
    # lazy: every refresh agrees (threshold 0), so the gap grows 6 -> 12 -> 24, clipped to 20
    extra = {"lazy_refresh": True, "lazy_window": 1, "cos_threshold": 0.0, "max_proj_gap": 20} if lazy else {}
    model = _model(refresh_schedule="staggered", refresh_budget_mb=budget_mb, **extra)
    layers = dict(galore_layers(model))
    assert all(layer.pending_phase_packing is not None for layer in layers.values())  # packed at the first forward
    steps = 60
    trace = _run(model, create_optimizer(model, lr=1e-2), _data(steps))
    assert all(layer.pending_phase_packing is None for layer in layers.values())

    # What a layer holds on its refresh step: its record (the dense fp32 gradient: PAPER_REFRESH) and its
    # input x of 16 fp32 rows, kept for the record until its backward.
    costs = {name: 4 * layer.out_features * layer.in_features + 16 * layer.in_features * 4
             for name, layer in layers.items()}  # fmt: skip
    largest_gradient = max(4 * layer.out_features * layer.in_features for layer in layers.values())
    # the budget (default: the largest layer's gradient), raised to the largest layer's hold
    capacity = max(int(budget_mb * 2**20) if budget_mb else largest_gradient, *costs.values())
    phases = {name: int(layer.galore_phase) for name, layer in layers.items()}
    per_phase = [sum(c for n, c in costs.items() if phases[n] == p) for p in range(max(phases.values()) + 1)]
    assert all(0 < load <= capacity for load in per_phase)
    assert len(per_phase) == -(-sum(costs.values()) // capacity)  # no more phases than the bytes need
    assert 1 < len(per_phase) < len(layers)
    records = {name: layer.refresh_record_nbytes() for name, layer in layers.items()}
    assert max(recorded for recorded, _ in trace) <= capacity < sum(costs.values())
    gap = 6
    for name in layers:
        refreshed_at = [step for step, (_, names) in enumerate(trace) if name in names]
        # calibration at the phase, then only steps of the same phase
        assert refreshed_at[0] == phases[name]
        assert all((s - phases[name]) % gap == 0 for s in refreshed_at)
        if lazy:  # a gap of 20 waits for the layer's next phase step: 24 steps, so no phase ever collides
            assert [b - a for a, b in zip(refreshed_at, refreshed_at[1:])] == [6, 12, 24]
        else:  # exactly once per gap
            assert refreshed_at == list(range(phases[name], steps, gap))
    for recorded, names in trace:
        assert recorded == sum(records[n] for n in names)


def test_aligned_schedule_records_every_layer_at_once():
    # The memory the staggered schedule removes: the paper's refresh step holds every layer's gradient.
    model = _model()
    layers = galore_layers(model)
    assert {int(layer.galore_phase) for _, layer in layers} == {0}
    trace = _run(model, create_optimizer(model, lr=1e-2), _data(13))
    total = sum(layer.refresh_record_nbytes() for _, layer in layers)
    assert [recorded for recorded, _ in trace] == [total if step % 6 == 0 else 0 for step in range(13)]


@pytest.mark.parametrize("lazy", [False, True])
def test_staggered_with_all_phases_zero_is_bit_identical_to_aligned(lazy):
    extra = {"lazy_refresh": True, "lazy_window": 1, "cos_threshold": 0.5} if lazy else {}
    results = []
    for schedule in ("aligned", "staggered", "staggered_zero"):
        model = _model(refresh_schedule="aligned" if schedule == "aligned" else "staggered", **extra)
        if schedule == "staggered_zero":
            for _, layer in galore_layers(model):
                layer.galore_phase.fill_(0)
                layer.sync_counters()
        optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.01)
        _run(model, optimizer, _data(40))
        results.append(model.state_dict())
    aligned, staggered, zero = results
    assert aligned.keys() == zero.keys()
    for key in aligned:
        assert torch.equal(aligned[key], zero[key]), key
    assert not all(torch.equal(aligned[k], staggered[k]) for k in aligned)  # the phases do change the run


def test_phase_packing_over_more_layers_than_gap_steps_warns_and_balances():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)])
    config = GaLoreConfig(rank=2, update_proj_gap=2, refresh_schedule="staggered", refresh_budget_mb=1e-6)
    with pytest.warns(UserWarning, match="do not fit update_proj_gap=2 phases"):
        prepare_model(model, config)
    assert sorted(int(layer.galore_phase) for _, layer in galore_layers(model)) == [0, 0, 0, 1, 1]
    assert assign_refresh_phases([]) == []


def test_config_fields_validate_and_parse_from_optim_args():
    parsed = parse_optim_args("refresh_schedule=staggered,refresh_budget_mb=64,basis_method=sketch")
    assert parsed == {"refresh_schedule": "staggered", "refresh_budget_mb": 64.0, "basis_method": "sketch"}
    GaLoreConfig(**parsed)
    with pytest.raises(ValueError, match=r"refresh_schedule='rolling' is invalid: choose one of \['aligned'"):
        GaLoreConfig(refresh_schedule="rolling")
    with pytest.raises(ValueError, match="refresh_budget_mb=64 is invalid: it bounds the staggered schedule only"):
        GaLoreConfig(refresh_budget_mb=64, refresh_schedule="aligned")
    with pytest.raises(ValueError, match="refresh_budget_mb=0 is invalid: use a positive number"):
        GaLoreConfig(refresh_schedule="staggered", refresh_budget_mb=0)
    with pytest.raises(TypeError, match="refresh_budget_mb must be a number"):
        GaLoreConfig(refresh_schedule="staggered", refresh_budget_mb="64")


# ---------------------------------------------------------------------------------------------- kept inputs
# A recording layer keeps its whole input x from its forward to its backward (an ordinary step keeps x Q), so
# the staggered phases are packed by records and inputs, at the tokens of the first training forward.
def test_phases_are_packed_at_the_first_training_forward_with_its_tokens():
    model = _model(refresh_schedule="staggered")
    layers = [layer for _, layer in galore_layers(model)]
    provisional = [layer.counter("galore_phase") for layer in layers]
    oracle = copy.deepcopy(model)  # the explicit packing of the same layers with the forward's size
    expected = assign_refresh_phases([layer for _, layer in galore_layers(oracle)], StepTokens(tokens=40, itemsize=4))
    assert expected != provisional  # the inputs change the packing here: the check below is not vacuous
    model.eval()
    model(torch.randn(3, 64))  # evaluation: not the training step's batch
    model.train()
    assert [layer.counter("galore_phase") for layer in layers] == provisional
    assert all(layer.pending_phase_packing is not None for layer in layers)

    model(torch.randn(5, 8, 64))  # 40 tokens, fp32
    assert [layer.counter("galore_phase") for layer in layers] == expected
    assert all(layer.pending_phase_packing is None for layer in layers)
    model(torch.randn(2, 64))  # a later forward of another size changes nothing
    assert [layer.counter("galore_phase") for layer in layers] == expected


def test_refresh_tokens_packs_at_preparation_as_the_first_forward_would():
    measured = _model(refresh_schedule="staggered")
    measured(torch.randn(24, 64))
    given = _model(refresh_schedule="staggered", refresh_tokens=24)
    assert all(layer.pending_phase_packing is None for _, layer in galore_layers(given))
    phases = [layer.counter("galore_phase") for _, layer in galore_layers(given)]
    assert phases == [layer.counter("galore_phase") for _, layer in galore_layers(measured)]
    given(torch.randn(200, 64))  # the setting stands, whatever the batch
    assert [layer.counter("galore_phase") for _, layer in galore_layers(given)] == phases


def test_data_parallel_ranks_pack_with_the_largest_first_batch(monkeypatch):
    # Each rank's first batch may be padded to another length; the phases (which pair the ranks' refresh
    # collectives) must be the same on every rank: the largest token count of all ranks.
    model = _model(refresh_schedule="staggered")
    oracle = copy.deepcopy(model)
    expected = assign_refresh_phases([layer for _, layer in galore_layers(oracle)], StepTokens(tokens=64, itemsize=4))
    reduced = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(
        torch.distributed, "all_reduce", lambda t, op=None: reduced.append((int(t), op)) or t.fill_(max(int(t), 64))
    )
    model(torch.randn(16, 64))
    assert reduced == [(16, torch.distributed.ReduceOp.MAX)]
    assert [layer.counter("galore_phase") for _, layer in galore_layers(model)] == expected


def test_loaded_phases_stand_whatever_the_first_batch_of_the_resumed_run():
    # A resumed run refreshes on the steps of the run it continues (bit-identical resume), even if its first
    # batch has another size than the saving run's first batch.
    model = _model(refresh_schedule="staggered")
    _run(model, create_optimizer(model, lr=1e-2), _data(2))  # packed at 16 tokens
    saved = {name: layer.counter("galore_phase") for name, layer in galore_layers(model)}
    resumed = _model(refresh_schedule="staggered")
    resumed.load_state_dict(model.state_dict())
    assert all(layer.pending_phase_packing is None for _, layer in galore_layers(resumed))
    resumed(torch.randn(200, 64))
    assert {name: layer.counter("galore_phase") for name, layer in galore_layers(resumed)} == saved
    fresh = _model(refresh_schedule="staggered")
    fresh(torch.randn(200, 64))
    assert {name: layer.counter("galore_phase") for name, layer in galore_layers(fresh)} != saved  # not vacuous


# A tiny Llama without activation checkpointing, 2 x 16 tokens a step, rank 8, update_proj_gap 4, sketches (the
# defaults): 14 layers whose sketches (8 KiB each) all fit the default budget (the largest layer's fp32
# gradient, 4 x 128 x 344 bytes), but whose kept inputs do not.
KEPT_LLAMA = dict(
    hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
KEPT_BATCH, KEPT_SEQ, KEPT_GAP, KEPT_STEPS = 2, 16, 4, 8
KEPT_BUDGET = 4 * 128 * 344


@pytest.fixture(scope="module")
def llama_step_peaks():
    """Per step of a tiny Llama run (the first 8): (layers that record, peak live tensor bytes)."""
    from conftest import build_tiny_llama

    from hf_galore_plugin.plan.tracker import LiveBytes

    model = prepare_model(build_tiny_llama(seed=0, **KEPT_LLAMA), GaLoreConfig(rank=8, update_proj_gap=KEPT_GAP))
    layers = [layer for _, layer in galore_layers(model)]
    optimizer = create_optimizer(model, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    steps = []
    with LiveBytes() as tracker:
        for _ in range(KEPT_STEPS):
            ids = torch.randint(0, KEPT_LLAMA["vocab_size"], (KEPT_BATCH, KEPT_SEQ), generator=gen)
            tracker.reset_peak()
            loss = model(input_ids=ids, labels=ids).loss
            recording = sum(layer.refresh_due for layer in layers)  # after the forward, which packed the phases
            loss.backward()
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            # A loop that keeps the loss (to log it) keeps its graph, and with it what a recording layer's
            # hook holds (its input), through the optimizer step and the refresh: the case where inputs and
            # records are alive together.
            del loss
            steps.append((recording, tracker.peak))
    return steps


def test_refresh_step_peak_within_ordinary_step_peak_plus_budget(llama_step_peaks):
    # Oracle: the live tensor bytes of the ordinary step 7 (every state exists, no layer records).
    recording = [count for count, _ in llama_step_peaks]
    assert recording[-1] == 0 and sum(recording) == 2 * 14  # calibrations, then one refresh each
    ordinary = llama_step_peaks[-1][1]
    over = [peak - ordinary for count, peak in llama_step_peaks if count > 0]
    assert max(over) <= KEPT_BUDGET, (over, KEPT_BUDGET)
    assert max(over) > KEPT_BUDGET / 4  # a refresh step does hold measurably more than an ordinary one


def test_planned_refresh_step_holds_at_least_the_measured_one(llama_step_peaks):
    # The planner's refresh step over its normal step, for the same model, tokens and settings, against the
    # measured run's refresh steps over its ordinary one: the plan may not promise less than a run holds.
    from transformers import LlamaConfig

    from hf_galore_plugin.plan.trace import Settings, trace_method

    settings = Settings(seq_len=KEPT_SEQ, batch_size=KEPT_BATCH, dtype=torch.float32, gradient_checkpointing=False,
                        device="cpu", rank=8, lora_rank=8, optim_args={"update_proj_gap": KEPT_GAP})  # fmt: skip
    plan = trace_method(LlamaConfig(**KEPT_LLAMA), "galore_adamw", settings)
    planned = plan.refresh.peak_bytes - plan.normal.peak_bytes
    ordinary = llama_step_peaks[-1][1]
    measured = max(peak - ordinary for count, peak in llama_step_peaks if count > 0)
    assert measured <= planned <= KEPT_BUDGET, (measured, planned, KEPT_BUDGET)


# ---------------------------------------------------------------------------------------------- sketch
def _recording_layer(m, n, proj_type, **config):
    torch.manual_seed(0)
    config = GaLoreConfig(rank=3, proj_type=proj_type, basis_method="sketch", **config)
    model = prepare_model(nn.Sequential(nn.Linear(n, m, bias=False)), config)
    return model[0]


@pytest.mark.parametrize("proj_type, shape", [("full", (40, 24)), ("std", (24, 40)), ("std", (40, 24))])
def test_sketch_equals_dense_gradient_times_test_matrix(proj_type, shape):
    m, n = shape
    layer = _recording_layer(m, n, proj_type)
    assert layer.refresh_due
    x = torch.randn(5, 7, n)
    dy = torch.randn(5, 7, m)
    layer(x).backward(dy)
    dense = dy.reshape(-1, m).mT.double() @ x.reshape(-1, n).double()  # G = dL/dW, in fp64
    sides = [s for s in ("left", "right") if layer.basis(s) is not None]
    assert sorted(layer._pending_grad) == sides
    for side in sides:
        omega = layer.sketch_test_matrix(side)
        expected = dense @ omega.double() if side == "left" else dense.mT @ omega.double()
        # fp32 products of length n (x Omega) or m (dy Omega), then 35 (the rows): each entry within
        # length * eps * (|dy|^T |x| |Omega|) of the fp64 one (tests/_tolerances.py; one side fp32 only)
        magnitude = _sketch(dy.reshape(-1, m).abs(), x.reshape(-1, n).abs(), omega.abs(), side)
        length = (n if side == "left" else m) + 35
        atol = dot_tolerance(magnitude, length) / 2
        assert_close_up_to_rounding(layer._pending_grad[side].double(), expected, atol=atol.double(), msg=side)
    k = 3 + 8
    dims = {"left": m, "right": n}
    assert layer.recorded_nbytes() == layer.refresh_record_nbytes() == sum(4 * k * dims[s] for s in sides)
    assert layer.recorded_nbytes() < 4 * m * n or proj_type == "full"


def _sketch(dy: torch.Tensor, x: torch.Tensor, omega: torch.Tensor, side: str) -> torch.Tensor:
    """The sketch of G = dy^T x as the layer forms it: dy^T (x Omega) (left), x^T (dy Omega) (right)."""
    return dy.mT @ (x @ omega) if side == "left" else x.mT @ (dy @ omega)


def test_sketch_accumulates_exactly_over_micro_batches():
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(12, 40, generator=gen), torch.randn(12, 24, generator=gen)
    sketches = []
    for chunks in (1, 2):
        layer = _recording_layer(24, 40, "full")
        for xs, dys in zip(x.chunk(chunks), dy.chunk(chunks)):
            layer(xs).backward(dys)
        sketches.append(layer._pending_grad)
    for side in ("left", "right"):
        # The same test matrix for both halves, so the sums differ from one batch's by fp32 rounding only:
        # products of length 40 (x Omega) or 24 (dy Omega), then 12 rows in one sum or two (tests/_tolerances.py).
        magnitude = _sketch(dy.abs(), x.abs(), layer.sketch_test_matrix(side).abs(), side)
        atol = dot_tolerance(magnitude, (40 if side == "left" else 24) + 12 + 1)
        assert_close_up_to_rounding(sketches[1][side], sketches[0][side], atol=atol, msg=side)


@pytest.mark.parametrize("proj_type, shape", [("std", (96, 40)), ("std", (40, 96)), ("full", (64, 48))])
def test_sketch_basis_spans_top_singular_subspace(proj_type, shape):
    m, n = shape
    gen = torch.Generator().manual_seed(3)
    rank = 3
    u = torch.linalg.qr(torch.randn(m, rank, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(n, rank, generator=gen))[0]
    grad = u @ torch.diag(torch.tensor([10.0, 7.0, 5.0])) @ v.mT + 0.01 * torch.randn(m, n, generator=gen)
    layer = _recording_layer(m, n, proj_type)
    # x = I and dy = G^T make the layer gradient dy^T x exactly G
    layer(torch.eye(n)).backward(grad.mT.contiguous())
    layer.after_optimizer_step()
    u_svd, _, vh_svd = torch.linalg.svd(grad)
    exact = {"left": u_svd[:, :rank], "right": vh_svd[:rank].mT}
    checked = 0
    for side in ("left", "right"):
        basis = layer.basis(side, torch.float32)
        if basis is None:
            continue
        torch.testing.assert_close(basis.mT @ basis, torch.eye(rank), atol=1e-5, rtol=0)
        # noise of Frobenius norm ~0.6 against sigma_3 = 5, one pass with k = rank + 8: measured 0.998-0.9997
        assert subspace_similarity(basis, exact[side]) > 0.99
        checked += 1
    assert checked == (2 if proj_type == "full" else 1)
    # A random subspace of the same size would score rank / dim: the check is not vacuous.
    random_basis = torch.linalg.qr(torch.randn(m, rank, generator=gen))[0]
    assert subspace_similarity(random_basis, exact["left"]) < 0.3


def test_basis_from_sketch_rejects_bad_input():
    from hf_galore_plugin.projection import BasisError

    with pytest.raises(BasisError, match="1 non-finite"):
        basis_from_sketch(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), rank=1)
    with pytest.raises(ValueError, match="rank 3 exceeds the sketch's 2 columns"):
        basis_from_sketch(torch.randn(5, 2), rank=3)


def test_sketch_refresh_under_data_parallelism_all_reduces_sketches_only(monkeypatch):
    import hf_galore_plugin.layers.refresh as layers_module

    sent = []
    monkeypatch.setattr(layers_module, "_world_size", lambda: 2)
    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: sent.append(tuple(t.shape)) or t.mul_(2))
    layer = _recording_layer(64, 48, "full", update_proj_gap=2)
    optimizer = create_optimizer(nn.Sequential(layer), config=layer.config, lr=1e-2)
    for _ in range(3):
        layer(torch.randn(8, 48)).square().mean().backward()
        optimizer.step()
        layer.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    k = 3 + 8
    assert sent == [(64, k), (48, k)] * 2  # steps 0 and 2; never the 64 x 48 gradient
    assert layer.sketch_exchange_numel() == (64 + 48) * k


def test_sketch_gradient_accumulation_equals_full_batch():
    results = []
    for micro in (1, 2):
        model = _model(refresh_schedule="staggered", basis_method="sketch", refresh_budget_mb=2000 / 2**20)
        _run(model, create_optimizer(model, lr=1e-2), _data(14, micro))
        results.append(model.state_dict())
    # Half batches sum in another order (fp32, ~1e-7 relative); the small SVD of a sketch whose singular
    # values lie close together magnifies that to ~1e-4 in a basis (measured 9e-5 at most here).
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=1e-3, atol=1e-4, msg=key, equal_nan=True)


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize(
    "config",
    [
        {"refresh_schedule": "staggered"},
        {"refresh_schedule": "staggered", "basis_method": "sketch", "refresh_budget_mb": 2000 / 2**20},
        {"basis_method": "sketch", "lazy_refresh": True, "lazy_window": 1, "cos_threshold": 0.3},
        {"refresh_schedule": "staggered", "lazy_refresh": True, "lazy_window": 1, "cos_threshold": 0.3},
    ],
)  # fmt: skip
def test_resume_mid_gap_is_bit_identical(config):
    def build():
        model = _model(**config)
        return model, create_optimizer(model, lr=1e-2, weight_decay=0.01)

    data = list(_data(30, micro=2))
    model, optimizer = build()
    trace = _run(model, optimizer, data)
    uninterrupted = model.state_dict()

    model, optimizer = build()
    _run(model, optimizer, data[:9])  # mid-gap: some layers have refreshed at steps 6-8, others not yet
    saved = _state(model, optimizer)
    model, optimizer = build()
    with torch.no_grad():
        for _, layer in galore_layers(model):  # what the checkpoint must restore
            layer.galore_phase.fill_(99)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    _run(model, optimizer, data[9:])
    resumed = model.state_dict()
    assert sum(len(names) for _, names in trace[9:]) >= 6
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), key


# ---------------------------------------------------------------------------------------------- engines
@pytest.mark.distributed
@pytest.mark.parametrize(
    "engine, basis_method, schedule",
    [
        ("ddp", "sketch", "staggered"),
        ("ddp", "svd", "staggered"),
        ("fsdp2", "sketch", "staggered"),
        ("fsdp1", "sketch", "staggered"),
        # ZeRO resets a late-calibrated factor's moments but not its group's shared step counter, so only
        # the aligned schedule can equal one process there; the sketch's reduction is what is checked.
        ("zero2", "sketch", "aligned"),
    ],
)
def test_engines_two_ranks_match_single_process(tmp_path, engine, basis_method, schedule):
    from distributed._launch import assert_matches

    env = {"PRESET": "galore_adamw", "PROJ_TYPE": "std", "BASIS_METHOD": basis_method, "REFRESH_SCHEDULE": schedule}
    if schedule == "staggered":
        env["REFRESH_BUDGET_MB"] = "0.0001"  # below every layer's record: each of the 3 layers has its own phase
    single = run_one_process(tmp_path / "single.pt", ENGINE="single", **env)
    assert single.returncode == 0, single.stderr[-4000:]
    multi = run_two_ranks(tmp_path / "multi.pt", ENGINE=engine, **env)
    assert multi.returncode == 0, multi.stderr[-4000:]
    single_result = torch.load(tmp_path / "single.pt", weights_only=True)
    assert_matches(single_result, torch.load(tmp_path / "multi.pt", weights_only=True))
    # staggered: 3 phases x steps {p, p + 10, p + 20}; aligned: steps 0, 10, 20
    assert single_result["refreshes"] == (9 if schedule == "staggered" else 3)


def _zero_adapter(model: nn.Module):
    """DeepSpeedGaLoreOptimizer over a stand-in ZeRO-2 engine whose client optimizer is a plain SGD."""
    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    client = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = SimpleNamespace(
        zero_optimization_stage=lambda: 2, module=model, optimizer=SimpleNamespace(optimizer=client)
    )
    return DeepSpeedGaLoreOptimizer(engine)


@pytest.mark.parametrize("state_bits", [8, 32])
@pytest.mark.parametrize("moment_handling, raises", [("keep", False), ("reset", True)])
def test_zero_refuses_only_staggered_resets_of_8bit_moments_at_construction(state_bits, moment_handling, raises):
    # ZeRO cannot reset one factor's 8-bit moments inside a flat partition, where they share blocks with
    # other factors: a staggered moment_handling='reset' would fail at the first refresh, many steps in,
    # so the adapter refuses it up front. Late calibrations need no reset (the next test) and pass.
    model = _model(refresh_schedule="staggered", state_bits=state_bits, moment_handling=moment_handling)
    assert len({int(layer.galore_phase) for _, layer in galore_layers(model)}) > 1
    if raises and state_bits == 8:
        with pytest.raises(
            NotImplementedError, match="moment_handling='keep', refresh_schedule='aligned' or state_bits=32"
        ):
            _zero_adapter(model)
    else:
        _zero_adapter(model)


def test_zero_late_calibration_zeroes_nothing_and_warns_of_the_shared_step_counter(monkeypatch):
    # A layer's factor only had zero gradients before its calibration (zero basis), so its moments are
    # exactly zero: the adapter must not try to zero them (impossible for 8-bit state in a flat partition)
    # and must still say that the group's step counter runs on. A later partial reset must zero them.
    model = _model(refresh_schedule="staggered", state_bits=8)
    adapter = _zero_adapter(model)
    zeroed = []
    monkeypatch.setattr(adapter, "_zero_moments_of", lambda param: zeroed.append(param))
    layers = [layer for _, layer in galore_layers(model)]
    late = next(layer for layer in layers if int(layer.galore_phase) > 0)
    adapter.reset_state(late.galore_factor)  # as _install_bases does, before the refresh counts itself
    group = {"galore": True, "galore_layers": [name for name, _ in galore_layers(model)], "params": [object()]}
    with pytest.warns(UserWarning, match="shared step counter .* is not reset"):
        adapter._apply_pending_resets(SimpleNamespace(param_groups=[group], state={}), (), {})
    assert zeroed == [] and not adapter._pending_resets

    late._add_counter("galore_num_refreshes")  # calibrated: a reset now concerns moments that moved
    adapter.reset_state(late.galore_factor)
    adapter._apply_pending_resets(SimpleNamespace(param_groups=[group], state={}), (), {})
    assert zeroed == [late.galore_factor]
