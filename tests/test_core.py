"""Core GaLore layer, refresh and optimizer wiring, against a dense reference and torch AdamW."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_galore_plugin import (
    GaLoreConfig,
    GaLoreLinear,
    after_step,
    create_optimizer,
    galore_layers,
    merge_and_unload,
    merged_state_dict,
    prepare_model,
    state_of,
)

from hf_galore_plugin.config import PAPER_REFRESH
from hf_galore_plugin.layers import function

from _reference import DenseGaLore


def _batches(n_in, n_out, steps, *, batch=32, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(n_out, n_in, generator=gen)
    for _ in range(steps):
        x = torch.randn(batch, n_in, generator=gen)
        yield x.to(dtype), (x @ target.T).to(dtype)


def _single_linear(n_in, n_out, *, bias=False, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, n_out, bias=bias)).to(dtype)


def _train(model, optimizer, batches, *, on_step=None):
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step:
            on_step()
    return losses


# ---------------------------------------------------------------------------------------------- layer math
@pytest.mark.parametrize("tokens", [6, 1032, 6555])
@pytest.mark.parametrize("scale", [0.25, 0.3])
@pytest.mark.parametrize("weight_storage", ["as_loaded", "int8"])
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20)])
def test_forward_and_gradients_match_dense_linear(proj_type, shape, weight_storage, scale, tokens):
    """The layer against nn.Linear holding its effective weight: output, dX, dbias and dB = scale P^T G Q.
    A quantized W0 takes the hand-written backward (`WrittenOutLinear`) at every size, a plain one from
    WRITTEN_OUT_MIN_VALUES activation values (6555 tokens here) and autograd's ops below; from 1032 tokens (at
    least FORM_MIN_TOKENS, more than either side) the quantized layer forms W = alpha W0 + scale P B Q^T in the
    dequantized W0 for the forward and dX, with 6 it goes through the branch. The scale lives in the stored
    basis: exactly for a power of two, rounded once into the basis for 0.3."""
    m, n = shape
    torch.manual_seed(0)
    dense = nn.Linear(n, m)
    config = GaLoreConfig(rank=4, proj_type=proj_type, weight_storage=weight_storage, scale=scale)
    model = prepare_model(nn.Sequential(nn.Linear(n, m)), config)
    if weight_storage == "as_loaded":
        model[0].load_state_dict(
            {**model[0].state_dict(), "weight": dense.weight.detach(), "bias": dense.bias.detach()}
        )
    else:
        model[0].load_state_dict({**model[0].state_dict(), "bias": dense.bias.detach()})
    layer = model[0]
    # a non-trivial state: random orthonormal bases, random factor, decayed base
    for side in ("left", "right"):
        if layer.basis(side) is not None:
            dim = m if side == "left" else n
            layer._set_basis(side, torch.linalg.qr(torch.randn(dim, 4))[0])
    with torch.no_grad():
        layer.galore_factor.normal_()
        layer.scale_base(0.9)
        eff = layer.effective_weight()
        dense.weight.copy_(eff)
    x = torch.randn(3, tokens // 3, n, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_(True)
    y, y_dense = layer(x), dense(x_dense)
    written_out = weight_storage != "as_loaded" or tokens * max(shape) >= function.WRITTEN_OUT_MIN_VALUES
    assert (type(y.grad_fn).__name__ == "WrittenOutLinearBackward") == written_out
    torch.testing.assert_close(y, y_dense, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_dense.backward(dy)
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-5, atol=1e-5)
    # dbias and dB sum over the tokens, in another order than the reference's: fp32 rounding grows with the count
    summed = 1e-5 * max(1.0, tokens / 1032)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=summed, atol=summed)
    # dL/dB = scale * P^T G Q, the projected full gradient
    p, q = layer.basis("left"), layer.basis("right")
    projected = dense.weight.grad
    if p is not None:
        projected = p.T @ projected
    if q is not None:
        projected = projected @ q
    torch.testing.assert_close(layer.galore_factor.grad, layer.config.scale * projected, rtol=summed, atol=summed)
    assert layer.weight is None or layer.weight.grad is None  # the W0 weight-gradient GEMM is skipped


@pytest.mark.parametrize("tokens", [6, 8192], ids=["autograd_ops", "one_node"])
def test_a_w0_view_that_requires_a_gradient_gets_none(tokens):
    """An engine may hand a layer its frozen W0 as a view of a parameter that requires a gradient (FSDP1 with
    use_orig_params: a view of the unit's flat parameter, which holds the factor too). The layer detaches it, on
    either path, so no gradient (and no weight-gradient GEMM) reaches the flat parameter, and the output and dX are
    those of the plain W0."""
    torch.manual_seed(0)
    m, n, r = 24, 16, 4
    flat = torch.randn(m * n + m * r, requires_grad=True)
    weight, factor = flat[: m * n].view(m, n), flat[m * n :].view(m, r)
    q = torch.linalg.qr(torch.randn(n, r))[0]
    x = torch.randn(tokens, n, requires_grad=True)
    y = function.galore_linear(x, factor, None, weight, None, None, q, 0.9, 1.0)
    y.backward(torch.ones_like(y))
    assert flat.grad[: m * n].abs().sum() == 0 and flat.grad[m * n :].abs().sum() > 0
    x_dense = x.detach().requires_grad_(True)
    dense = x_dense @ (0.9 * weight.detach() + factor.detach() @ q.T).T
    dense.backward(torch.ones_like(dense))
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-5, atol=1e-5)


def test_quantized_layer_output_is_its_own_tensor_for_autograd():
    """A quantized-W0 layer takes an input of shape (..., n) whole: its output comes from the layer's own autograd
    node (no view nodes for the leading dimensions), and a caller may modify it in place, as an nn.Linear's."""
    torch.manual_seed(0)
    model = prepare_model(nn.Sequential(nn.Linear(16, 24)), GaLoreConfig(rank=4, weight_storage="int8"))
    layer = model[0]
    with torch.no_grad():
        layer.galore_factor.normal_()
    x = torch.randn(2, 3, 16, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "WrittenOutLinearBackward" and y.shape == (2, 3, 24)
    y.mul_(2.0)
    y.sum().backward()
    flat = x.detach().reshape(6, 16).requires_grad_(True)
    (layer(flat) * 2.0).sum().backward()
    torch.testing.assert_close(x.grad.reshape(6, 16), flat.grad)


@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_refresh_leaves_effective_weight_unchanged(proj_type):
    model = prepare_model(_single_linear(16, 24), GaLoreConfig(rank=4, proj_type=proj_type, update_proj_gap=2))
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.1)
    layer = model[0]
    batches = list(_batches(16, 24, 6))
    for i, (x, y) in enumerate(batches):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        before = layer.effective_weight().clone()
        due = layer.refresh_due
        after_step(model, optimizer)
        optimizer.zero_grad()
        if due and i > 0:
            assert float(layer.galore_factor.abs().max()) == 0.0  # folded
            torch.testing.assert_close(layer.effective_weight(), before, rtol=1e-6, atol=1e-7)
    assert int(layer.galore_num_refreshes) == 3  # steps 0 (calibration), 2, 4


# ---------------------------------------------------------------------------------------------- oracles
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20)])
@pytest.mark.parametrize("moment_handling", ["keep", "project", "reset"])
def test_matches_dense_reference_galore(proj_type, shape, moment_handling):
    m, n = shape
    # The reference is the paper's algorithm: every refresh an exact SVD of the dense gradient.
    config = GaLoreConfig(
        rank=4, proj_type=proj_type, update_proj_gap=3, scale=0.25, moment_handling=moment_handling, **PAPER_REFRESH
    )
    model = prepare_model(_single_linear(n, m), config)
    initial = model[0].effective_weight().double().clone()
    reference = DenseGaLore(model[0].weight, config, lr=1e-2, weight_decay=0.1)
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.1)
    steps = 13  # refreshes at 0 (calibration), 3, 6, 9, 12
    for x, y in _batches(n, m, steps):
        w = reference.w.float().requires_grad_(True)
        torch.nn.functional.mse_loss(x @ w.T, y).backward()
        reference.step(w.grad)
    _train(model, optimizer, _batches(n, m, steps))
    assert int(model[0].galore_num_refreshes) == 5
    ours = model[0].effective_weight().double()
    rel = float((ours - reference.w).norm() / reference.w.norm())
    assert rel < 1e-5, f"relative deviation from the dense reference {rel:.2e}"
    # The match above means something only if training moved the weight far more than the tolerance:
    # 12 Adam steps of lr 1e-2 move it by ~10% of its norm.
    moved = float((ours - initial).norm() / initial.norm())
    assert moved > 1e-2, f"training moved the weight by {moved:.2e} of its norm only"


def test_full_rank_basis_reproduces_torch_adamw():
    # rank >= the projected side: the subspace is the whole space and GaLore is AdamW on W (scale 1).
    # prepare_model refuses to target such a layer (nothing is projected); the identity basis is still the one a
    # two-sided basis (proj_type='full') keeps on a side the rank covers, so the layer is built directly.
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(8, 24, bias=True))
    model = nn.Sequential(nn.Linear(8, 24, bias=True))
    model.load_state_dict(dense.state_dict())
    model[0] = GaLoreLinear(model[0], GaLoreConfig(rank=8, scale=1.0))
    assert model[0].right_identity
    ours = create_optimizer(model, lr=3e-3, weight_decay=0.05)
    theirs = torch.optim.AdamW(dense.parameters(), lr=3e-3, weight_decay=0.05)
    for x, y in _batches(8, 24, 30):
        for mod, opt in ((model, ours), (dense, theirs)):
            torch.nn.functional.mse_loss(mod(x), y).backward()
            opt.step()
            opt.zero_grad()
        after_step(model, ours)
    torch.testing.assert_close(model[0].effective_weight(), dense[0].weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[0].bias, dense[0].bias, rtol=1e-5, atol=1e-6)


def test_calibration_step_only_decays_then_adam_starts():
    model = prepare_model(_single_linear(16, 24), GaLoreConfig(rank=4, update_proj_gap=5))
    w0 = model[0].weight.detach().clone()
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.1)
    _train(model, optimizer, _batches(16, 24, 1))
    torch.testing.assert_close(model[0].effective_weight(), w0 * (1 - 1e-2 * 0.1))
    assert model[0].calibrated and not optimizer.state.get(model[0].galore_factor)


def test_gradient_accumulation_equals_full_batch():
    results = []
    for micro in (1, 2):
        model = prepare_model(_single_linear(16, 24), GaLoreConfig(rank=4, update_proj_gap=2))
        optimizer = create_optimizer(model, lr=1e-2)
        for x, y in _batches(16, 24, 5):
            for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                (torch.nn.functional.mse_loss(model(xs), ys) / micro).backward()
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()
        results.append(model[0].effective_weight())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("basis_method", ["svd", "sketch"])
def test_basis_failure_keeps_old_basis_and_training_goes_on(basis_method):
    model = prepare_model(_single_linear(16, 24), GaLoreConfig(rank=4, update_proj_gap=1, basis_method=basis_method))
    optimizer = create_optimizer(model, lr=1e-2)
    _train(model, optimizer, _batches(16, 24, 2))
    layer = model[0]
    basis = layer.basis("right").clone()
    x, y = next(_batches(16, 24, 1, seed=3))
    torch.nn.functional.mse_loss(model(x), y).backward()
    # the record a refresh computes its basis from: the dense gradient, or the right side's sketch
    record = layer._pending_grad if basis_method == "svd" else layer._pending_grad["right"]
    record[0, 0] = float("nan")
    optimizer.step()
    with pytest.warns(UserWarning, match="refresh failed"):
        after_step(model, optimizer)
    torch.testing.assert_close(layer.basis("right"), basis)
    losses = _train(model, optimizer, _batches(16, 24, 3, seed=4))
    assert all(math.isfinite(v) for v in losses)


def _fake_two_rank_run(monkeypatch, config, n_in, n_out, fake_world: bool):
    # A fake 2-rank world whose ranks hold identical gradients (all_reduce sums two equal copies).
    import hf_galore_plugin.engines.collectives as collectives
    import hf_galore_plugin.layers.refresh as layers_module

    model = prepare_model(_single_linear(n_in, n_out), config)
    optimizer = create_optimizer(model, lr=1e-2)
    sent = []
    if fake_world:
        # the layer decides sketches vs gradient with its world size; all_reduce_mean divides by it
        monkeypatch.setattr(layers_module, "_world_size", lambda: 2)
        monkeypatch.setattr(collectives, "world_size", lambda: 2)
        monkeypatch.setattr(
            torch.distributed, "all_reduce", lambda t, *a, **k: sent.append(tuple(t.shape)) or t.mul_(2)
        )
    _train(model, optimizer, _batches(n_in, n_out, 5))
    monkeypatch.undo()
    return model[0], sent


@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_randomized_refresh_under_data_parallelism_all_reduces_sketches_only(monkeypatch, proj_type):
    # The refresh must reduce only (m + n) x k sketches, never the 128 x 96 gradient, and find the same
    # bases as one process. tests/test_distributed.py checks the averaging itself with 2 real ranks.
    config = GaLoreConfig(rank=4, update_proj_gap=2, basis_method="randomized", proj_type=proj_type)
    single, _ = _fake_two_rank_run(monkeypatch, config, 96, 128, fake_world=False)
    layer, sent = _fake_two_rank_run(monkeypatch, config, 96, 128, fake_world=True)
    sides = [s for s in ("left", "right") if layer.basis(s) is not None]
    assert len(sides) == (2 if proj_type == "full" else 1)
    k = 4 + config.oversampling
    # 3 refreshes (steps 0, 2, 4) x sides x (sketch + 2 per power iteration + final projection)
    assert len(sent) == 3 * len(sides) * (2 + 2 * config.power_iterations)
    assert all(k in shape and max(shape) <= 128 for shape in sent), sent
    assert sum(a * b for a, b in sent) == 3 * layer.sketch_exchange_numel() < 3 * 128 * 96
    for side in sides:
        torch.testing.assert_close(layer.basis(side), single.basis(side), rtol=0, atol=1e-6)


def test_randomized_refresh_reduces_the_gradient_when_sketches_would_be_larger(monkeypatch):
    # rank 16 of a 48 x 40 layer: k = 24 and 24 x 88 x 2 sketch values > 1920 gradient values
    config = GaLoreConfig(rank=16, update_proj_gap=2, basis_method="randomized")
    layer, sent = _fake_two_rank_run(monkeypatch, config, 40, 48, fake_world=True)
    assert layer.sketch_exchange_numel() > 48 * 40
    assert sent == [(48, 40)] * 3


def test_lazy_refresh_grows_gap_when_subspace_is_stable():
    config = GaLoreConfig(
        rank=2, update_proj_gap=1, lazy_refresh=True, lazy_window=2, cos_threshold=0.4, max_proj_gap=4
    )
    model = prepare_model(_single_linear(16, 24), config)
    optimizer = create_optimizer(model, lr=1e-3)
    # the same batch every step: the gradient's top subspace barely moves, similarity ~1
    x, y = next(_batches(16, 24, 1))
    gaps = []
    for _ in range(14):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
        gaps.append(int(model[0].galore_gap))
    assert gaps[0] == 1 and max(gaps) == 4 and gaps == sorted(gaps)
    assert float(model[0].galore_last_similarity) > 0.4


# ---------------------------------------------------------------------------------------------- targets
class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.block = nn.ModuleDict({"q_proj": nn.Linear(32, 32), "up": nn.Linear(32, 64), "tiny": nn.Linear(32, 4)})
        self.norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = self.block["q_proj"](h) + self.block["up"](h)[..., :32] + self.block["tiny"](h).sum(-1, keepdim=True)
        return self.lm_head(self.norm(h))


def test_default_targets_skip_head_small_and_non_linear_layers():
    model = prepare_model(_TinyLM(), GaLoreConfig(rank=8))
    names = [n for n, _ in galore_layers(model)]
    assert names == ["block.q_proj", "block.up"]
    assert state_of(model).report.skipped == {"block.tiny": "smaller side <= rank 8", "lm_head": "output head"}
    assert isinstance(model.embed, nn.Embedding) and isinstance(model.norm, nn.LayerNorm)


def test_a_copy_of_a_prepared_model_is_prepared_and_trains_as_the_original():
    # copy.deepcopy (EMA copies, model_init caches) keeps the GaLore layers; the package must take the copy
    # as prepared with the same config. Oracle: the original, stepped the same way.
    import copy

    torch.manual_seed(0)
    model = prepare_model(_TinyLM(), GaLoreConfig(rank=8, update_proj_gap=2))
    twin = copy.deepcopy(model)
    state = state_of(twin)
    assert state is not None and state.model is twin and state.config == state_of(model).config
    assert state.report is None and state_of(twin) is state
    tokens = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    for net in (model, twin):
        optimizer = create_optimizer(net, lr=1e-2)
        for _ in range(3):
            net(tokens).sum().backward()
            optimizer.step()
            after_step(net, optimizer)
            optimizer.zero_grad()
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name


def test_state_of_finds_the_prepared_model_and_writes_no_attribute_on_user_objects():
    # The oracle is the objects' own attribute dicts before the package touched them: preparing, building
    # the optimizer, stepping and merging add no entry to the model's, the optimizer's or a parameter's.
    model = _TinyLM()
    model_attrs, embed_param_attrs = set(vars(model)), set(vars(model.embed.weight))
    config = GaLoreConfig(rank=8, update_proj_gap=2)
    assert state_of(model) is None
    assert prepare_model(model, config) is model
    state = state_of(model)
    assert state is not None and state.model is model and state.config == config
    assert state.report.targeted == ["block.q_proj", "block.up"]

    class Wrapper(nn.Module):  # as DDP / DeepSpeed hold the prepared model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert state_of(Wrapper(model)) is state and state_of(nn.Sequential(Wrapper(model))) is state
    optimizer = create_optimizer(model, lr=1e-3)
    optimizer_attrs = set(vars(optimizer))
    for _ in range(3):
        model(torch.randint(0, 50, (2, 5))).sum().backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    assert set(vars(model)) == model_attrs and set(vars(model.embed.weight)) == embed_param_attrs
    assert set(vars(optimizer)) == optimizer_attrs
    factors = [layer.galore_factor for _, layer in galore_layers(model)]
    merge_and_unload(model)
    assert state_of(model) is None and set(vars(model)) == model_attrs
    assert all(not vars(factor) for factor in factors)
    with pytest.raises(RuntimeError, match=r"after merge_and_unload"):
        optimizer.step()


def test_explicit_targets_regex_and_list():
    assert [n for n, _ in galore_layers(prepare_model(_TinyLM(), GaLoreConfig(rank=8, target_modules=r".*\.up")))] == [
        "block.up"
    ]
    assert [n for n, _ in galore_layers(prepare_model(_TinyLM(), GaLoreConfig(rank=8, target_modules=["q_proj"])))] == [
        "block.q_proj"
    ]


def test_target_errors_name_the_fix():
    with pytest.raises(ValueError, match="matched no trainable nn.Linear"):
        prepare_model(_TinyLM(), GaLoreConfig(rank=8, target_modules=["does_not_exist"]))
    with pytest.raises(ValueError, match="Lower `rank`"):
        prepare_model(_TinyLM(), GaLoreConfig(rank=64))
    # a target the rank does not project trains as AdamW and is named in a warning (tests/test_misuse.py)
    frozen = _TinyLM().requires_grad_(False)
    with pytest.raises(ValueError, match="no nn.Linear layer"):
        prepare_model(frozen, GaLoreConfig(rank=8))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("rank", 0, "positive rank"),
        ("update_proj_gap", 0, "positive number of steps"),
        ("proj_type", "diagonal", "choose one of"),
        ("state_bits", 4, "use 32"),
        ("scale", -1.0, "positive float"),
        ("state_block_size", 100, "power of two"),
        ("cos_threshold", 1.5, r"\[0, 1\]"),
    ],
)
def test_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        GaLoreConfig(**{field: value})


def test_preset_names_and_overrides():
    q = GaLoreConfig.preset("qgalore_adamw_8bit", rank=64)
    assert (q.rank, q.state_bits, q.weight_storage, q.basis_storage, q.lazy_refresh) == (64, 8, "int8", "int4", True)
    assert GaLoreConfig.preset("galore_adamw_8bit").state_bits == 8
    with pytest.raises(ValueError, match="unknown preset"):
        GaLoreConfig.preset("adam")


# ---------------------------------------------------------------------------------------------- merge
@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_merge_and_unload_gives_plain_linear_with_same_outputs(preset):
    model = prepare_model(_TinyLM(), GaLoreConfig.preset(preset, rank=8, update_proj_gap=2))
    optimizer = create_optimizer(model, lr=1e-2)
    ids = torch.randint(0, 50, (4, 6))
    for _ in range(4):
        model(ids).logsumexp(-1).mean().backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    with torch.no_grad():
        expected = model(ids)
    state = merged_state_dict(model)
    merge_and_unload(model)
    assert not any(isinstance(m, GaLoreLinear) for m in model.modules())
    assert state_of(model) is None
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    fresh = _TinyLM()
    fresh.load_state_dict(state)  # plain keys only: loads into the unmodified architecture
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), expected, rtol=1e-5, atol=1e-5)


def test_int8_base_and_int4_basis_are_small_and_close():
    torch.manual_seed(0)
    linear = nn.Linear(256, 512)
    model = prepare_model(nn.Sequential(linear), GaLoreConfig.preset("qgalore_adamw_8bit", rank=16))
    layer = model[0]
    nbytes = layer.state_nbytes()
    assert nbytes["weight"] < 0.3 * linear.weight.numel() * 4  # 1 byte + a scale per 256 values vs fp32
    rel = float((layer.base_weight(torch.float32) - linear.weight).norm() / linear.weight.norm())
    assert rel < 0.01  # int8 absmax in blocks of 256: ~0.4% RMS for Gaussian-like weights


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("preset", ["galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"])
def test_resume_is_bit_exact(preset, round_trip):
    config = GaLoreConfig.preset(preset, rank=8, update_proj_gap=3, lazy_window=1, max_proj_gap=12)

    def build():
        torch.manual_seed(0)
        model = prepare_model(_TinyLM(), config)
        return model, create_optimizer(model, lr=1e-2, weight_decay=0.01)

    data = [torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(i)) for i in range(30)]

    def run(model, optimizer, batches):
        for ids in batches:
            model(ids).logsumexp(-1).mean().backward()
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()

    model, optimizer = build()
    run(model, optimizer, data)
    uninterrupted = model.state_dict()

    model, optimizer = build()
    run(model, optimizer, data[:10])
    saved = round_trip({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    model, optimizer = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    run(model, optimizer, data[10:])
    resumed = model.state_dict()
    assert int(galore_layers(model)[0][1].galore_num_refreshes) >= 3
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def test_peft_modules_to_save_head_is_not_targeted(tiny_llama):
    import peft

    base = tiny_llama(
        seed=None,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head", "down_proj"]),
    )
    prepare_model(model, GaLoreConfig(rank=8))
    names = [n for n, _ in galore_layers(model)]
    assert not any("lm_head" in n for n in names)
    assert any(n.endswith("down_proj.modules_to_save.default") for n in names)
    assert not any("lora_" in n or "base_layer" in n for n in names)


def test_quantization_error_is_reported_for_int8_base_and_int4_basis():
    model = prepare_model(_single_linear(64, 128), GaLoreConfig.preset("qgalore_adamw_8bit", rank=8, update_proj_gap=2))
    optimizer = create_optimizer(model, lr=1e-2)
    _train(model, optimizer, _batches(64, 128, 3))
    errors = model[0].quantization_error()
    # int8 absmax per 256 values: ~0.5% RMS on Gaussian-like weights; int4 per 64: ~10% on a basis
    assert 0 < errors["weight"] < 0.02 and 0.01 < errors["basis_right"] < 0.3
    from hf_galore_plugin import galore_stats

    stats = galore_stats(model, optimizer)
    assert stats["galore/weight_quant_error"] == pytest.approx(errors["weight"])


def test_layer_compiles_without_graph_breaks_in_forward():
    model = prepare_model(_single_linear(16, 24), GaLoreConfig(rank=4, update_proj_gap=2))
    optimizer = create_optimizer(model, lr=1e-2)
    _train(model, optimizer, _batches(16, 24, 1))  # calibrated: the flag is a plain bool now
    explanation = torch._dynamo.explain(model)(torch.randn(4, 16))
    assert explanation.graph_break_count == 0, explanation.break_reasons
