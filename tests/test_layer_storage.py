"""The layer's storage objects and its checkpoint format.

Oracles: state dicts written by the code before the layer became a package (tests/fixtures/layer_states.pt,
built by tests/_layer_states.py at commit f2c4212), with the outputs and the refresh that code computed
from them; for StoredTensor, the quant library's own quantize/dequantize and a dense error measure.
"""

from __future__ import annotations

import math

import pytest
import torch
from _layer_states import BATCH, CASES, IN_FEATURES, LR, OUT_FEATURES, PATH, RANK, batch, build, train_step
from _tolerances import EPS32, assert_close_up_to_rounding, bf16_step, dot_tolerance, singular_vector_tolerance
from torch import nn

import hf_galore_plugin.quant as hq
from hf_galore_plugin.layers import StoredTensor
from hf_galore_plugin.projection import subspace_similarity

FIXTURE = torch.load(PATH, weights_only=False)


def test_the_fixture_covers_every_storage_setting():
    assert set(FIXTURE) == set(CASES)
    settings = {
        (o.get("weight_storage", "as_loaded"), o.get("basis_storage", "as_computed")) for o, _ in CASES.values()
    }
    assert settings == {(w, b) for w in ("as_loaded", "int8", "nf4") for b in ("as_computed", "int8", "int4")}


# The fixture was computed on another machine: what the refresh computes from it agrees up to the rounding
# of the operations between the loaded state and the refreshed one (tests/_tolerances.py). Their fp32 dot
# products, by length: the forward (x W0^T; x Q C^T P^T through each basis and the factor; two sums) ...
FORWARD_DOTS = IN_FEATURES + 2 * RANK + 2
# ... then the gradients (of W over the batch; of the factor through each side), AdamW's elementwise ops,
# and the fold W0 + scale P C Q^T (each basis, one sum).
STEP_DOTS = FORWARD_DOTS + BATCH + OUT_FEATURES + IN_FEATURES + 8 + 2 * RANK + 1
# A bf16 model's forward also rounds its 8 intermediate results to bf16 (W0's GEMM, the multiplier, the
# three low-rank GEMMs, the scale, the two sums), and its backward rounds dy to bf16.
BF16_FORWARD_ROUNDINGS = 8


def _forward_rounding(dtype: torch.dtype) -> float:
    """Bound of one machine's forward error, relative to _forward_magnitude."""
    return FORWARD_DOTS * EPS32 + (BF16_FORWARD_ROUNDINGS * torch.finfo(dtype).eps if dtype != torch.float32 else 0)


def _forward_magnitude(layer, x: torch.Tensor) -> torch.Tensor:
    """|x| (alpha |W0| + scale |P| |C| |Q|^T)^T + |b|: what the rounding errors of the forward's products
    scale with (the output itself can be smaller where terms cancel)."""
    magnitude = layer.galore_factor.detach().float().abs()
    left, right = layer.basis("left", torch.float32), layer.basis("right", torch.float32)
    if right is not None:
        magnitude = magnitude @ right.abs().mT
    if left is not None:
        magnitude = left.abs() @ magnitude
    weight = layer.base_weight(torch.float32).abs() * layer.base_multiplier.abs() + layer.scale * magnitude
    return x.float().abs() @ weight.mT + layer.bias.detach().float().abs()


def _record(dy: torch.Tensor, x: torch.Tensor, side: str, omega=None) -> torch.Tensor:
    """A side's refresh record as the layer forms it: G = dy^T x (G^T for 'right'), or with a test matrix
    the sketch dy^T (x Omega) ('left') or x^T (dy Omega) ('right')."""
    if omega is None:
        return dy.mT @ x if side == "left" else x.mT @ dy
    return dy.mT @ (x @ omega) if side == "left" else x.mT @ (dy @ omega)


def _record_error(layer, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """side -> how far this machine's refresh record of the step on `x` may be from the exact one, in
    Frobenius norm: each entry is a product of |dy|, |x| (and |Omega|) times the rounding of its dot
    products, and dy = d mean(y^2)/dy = 2 y / y.numel() carries the forward's. Called before the step, on
    the layer that records (the sketch's Omega depends on the step)."""
    dtype = layer.weight_dtype
    dy = 2 * y.float() / y.numel()
    dy_error = (2 / y.numel()) * _forward_rounding(dtype) * _forward_magnitude(layer, x)
    if dtype != torch.float32:
        dy_error = dy_error + torch.finfo(dtype).eps * dy.abs()
    errors = {}
    for side, _ in layer._basis_sides():
        omega = layer.sketch_test_matrix(side).abs() if layer.config.basis_method == "sketch" else None
        x_abs = x.float().abs()
        # dot products over the batch, and for a sketch the product with Omega first (x Omega, dy Omega)
        length = BATCH if omega is None else BATCH + {"left": IN_FEATURES, "right": OUT_FEATURES}[side]
        bound = length * EPS32 * _record(dy.abs(), x_abs, side, omega) + _record(dy_error, x_abs, side, omega)
        errors[side] = float(bound.norm())
    return errors


def _with_folded_scale(state: dict[str, torch.Tensor], layer) -> dict[str, torch.Tensor]:
    """`state`, written before the layer folded its scale into a stored basis, as the layer saves it now: the
    folded side's basis times the scale (a plain basis' values; a quantized one's block scales, its codes
    unchanged), and ``galore_folded_scale`` recording it. Exact for the fixture's power-of-two scale."""
    scale = layer.scale
    assert math.log2(scale).is_integer()
    prefix = f"galore_basis_{layer._folded_side}"
    converted = dict(state)
    for key, value in state.items():
        if key in (prefix, prefix + "_scales"):
            converted[key] = value * scale
    converted["galore_folded_scale"] = torch.tensor(scale)
    return converted


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_written_by_the_old_layer_loads_to_the_same_keys_and_numbers(name):
    layer, optimizer = build(name)
    old = {key: _with_folded_scale(FIXTURE[name][key], layer) for key in ("state_dict", "after_refresh")}
    old = {**FIXTURE[name], **old}
    # The same key names as before, for this storage setting (and the multiplier of the folded basis), before
    # and after a load of that state.
    assert set(layer.state_dict()) == set(old["state_dict"])
    layer.load_state_dict(old["state_dict"], strict=True)
    loaded = layer.state_dict()
    assert set(loaded) == set(old["state_dict"])
    for key, value in old["state_dict"].items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, equal_nan=True, msg=key)  # a copy: bit for bit
    dtype = layer.weight_dtype
    # A bf16 model's W0, bias and bases are bf16 roundings of values that differ by the bounds below: one
    # bf16 step apart where a value lands near a rounding threshold on one machine only.
    step = bf16_step if dtype == torch.bfloat16 else (lambda value: 0.0)
    x = batch(99, dtype)
    with torch.no_grad():
        output = layer(x)
    atol = 2 * _forward_rounding(dtype) * _forward_magnitude(layer, x)
    assert_close_up_to_rounding(output, old["output"], atol=atol, step=step(old["output"]), msg="output")

    # What the old code computed from this state: a refresh step (fold into the stored W0, new stored
    # bases, stochastic rounding from the restored counter, lazy gap, moment reset or transport).
    optimizer.load_state_dict(old["optimizer"])
    replaced_bases = {side: layer.basis(side, torch.float32) for side, _ in layer._basis_sides()}
    x = batch(2, dtype)
    with torch.no_grad():
        record_error = _record_error(layer, x, layer(x))
    record = train_step(layer, optimizer, 2)
    record = record if isinstance(record, dict) else {"left": record, "right": record.mT}
    # Each new basis column: from an SVD of the record, which is rounded as above (tests/_tolerances.py).
    column_atol = {
        side: singular_vector_tolerance(
            record[side], RANK, rounding=record_error[side] / float(torch.linalg.matrix_norm(record[side], 2))
        )
        for side in replaced_bases
    }

    after = layer.state_dict()
    assert set(after) == set(old["after_refresh"])
    stores = {s.name: s for s in (layer._weight_store, *layer._bases.values()) if s is not None and s.quantized}
    for key, value in old["after_refresh"].items():
        got = after[key]
        if key.endswith("_codes"):  # quantization codes: rounded from the values checked beside them
            meta = stores[key.removesuffix("_codes")].meta
            numel = math.prod(meta["shape"])
            codes = [hq.unpack_int4(c, numel=numel) if meta["bits"] == 4 else c for c in (got, value)]
            assert_close_up_to_rounding(codes[0].int(), codes[1].int(), atol=0, step=1, msg=key)
        elif not value.is_floating_point():  # counters: integer logic, equal
            assert torch.equal(got, value), key
        elif key == "galore_last_similarity":
            continue  # checked below, against the bases it was computed from
        elif key.startswith("galore_basis_"):  # a plain basis (columns), or the block absmax of one
            side = key.removeprefix("galore_basis_").removesuffix("_scales")
            atol = column_atol[side] if key.endswith(side) else column_atol[side].max()
            assert_close_up_to_rounding(got, value, atol=atol, step=step(value), msg=key)
        else:  # W0, its block scales, bias, factor, multiplier: |a||b| of the products ~ the largest entry
            atol = dot_tolerance(value.float().abs().max(), STEP_DOTS)
            if dtype == torch.bfloat16 and key in ("bias", "galore_factor"):
                # A bf16 model's forward rounds differently from the code that wrote the fixture (alpha and the
                # low-rank branch inside one GEMM, tests/test_core.py bounds it), and AdamW divides the
                # gradient by its own magnitude: a gradient moved by bf16 rounding moves the stepped value by
                # up to the step size, lr.
                atol = max(atol, torch.tensor(LR))
            assert_close_up_to_rounding(got, value, atol=atol, step=step(value), msg=key)

    # The old code's numbers from the bases it stored (the fixture's), recomputed here from them: apart
    # from ours by the difference of the stored bases, measured, and the rounding of the measure itself.
    fixture_layer, _ = build(name)
    fixture_layer.load_state_dict(old["after_refresh"])
    stored = {side: layer.basis(side, torch.float32) for side in replaced_bases}
    fixture_stored = {side: fixture_layer.basis(side, torch.float32) for side in replaced_bases}

    def similarity(bases):
        return sum(subspace_similarity(replaced_bases[s], bases[s]) for s in bases) / len(bases)

    # (sums of d x r products of unit columns, then of r^2 squares)
    measure_atol = dot_tolerance(1.0, max(b.shape[0] for b in stored.values()) + RANK**2)
    similarity_atol = abs(similarity(stored) - similarity(fixture_stored)) + measure_atol
    got, expected = float(after["galore_last_similarity"]), float(old["after_refresh"]["galore_last_similarity"])
    assert abs(got - expected) <= similarity_atol, ("galore_last_similarity", got, expected, similarity_atol)

    # Relative RMS error of each quantization, |q - v| / |v|: apart by at most (|q - q'| + 2 |v - v'|) / |v|
    # (triangle inequality), |q - q'| measured between the stored tensors, |v - v'| bounded as above.
    errors, expected_errors = layer.quantization_error(), old["quantization_error"]
    assert set(errors) == set(expected_errors)
    for key, error in errors.items():
        if key == "weight":
            ours, theirs = layer.base_weight(torch.float32), fixture_layer.base_weight(torch.float32)
            value_error = float(dot_tolerance(ours.abs().max(), STEP_DOTS)) * ours.numel() ** 0.5
        else:
            side = key.removeprefix("basis_")
            ours, theirs = stored[side], fixture_stored[side]
            value_error = float(column_atol[side].norm())
        value_norm = float(ours.norm()) / (1 + error)  # |v| >= |q| - |q - v| = |q| - error |v|
        atol = (float((ours - theirs).norm()) + 2 * value_error) / value_norm + measure_atol
        assert abs(error - expected_errors[key]) <= atol, (key, error, expected_errors[key], atol)


def _layer_with_state(scale: float, basis_storage: str, proj_type: str = "std") -> nn.Module:
    """A GaLore layer (24 x 16) with random orthonormal bases and a random factor."""
    from hf_galore_plugin import GaLoreConfig
    from hf_galore_plugin.layers import GaLoreLinear

    torch.manual_seed(0)
    config = GaLoreConfig(rank=RANK, scale=scale, basis_storage=basis_storage, proj_type=proj_type)
    layer = GaLoreLinear(nn.Linear(IN_FEATURES, OUT_FEATURES), config, layer_index=0)
    for side, dim in (("left", OUT_FEATURES), ("right", IN_FEATURES)):
        if layer._bases.get(side) is not None:
            layer._set_basis(side, torch.linalg.qr(torch.randn(dim, RANK))[0])
    with torch.no_grad():
        layer.galore_factor.normal_()
    return layer


@pytest.mark.parametrize("proj_type", ["std", "full"])
@pytest.mark.parametrize("basis_storage", ["as_computed", "int4"])
@pytest.mark.parametrize("saved_scale", [0.5, 0.3])
def test_a_basis_saved_under_another_scale_loads_as_the_same_basis(saved_scale, basis_storage, proj_type):
    """The stored basis carries the scale (``galore_folded_scale`` records it): a state saved under scale s
    loads into a layer of scale 0.25 as the same orthonormal bases and factor, the stored basis now carrying
    0.25, and the layer computes nn.Linear's output for W0 + 0.25 P B Q^T (the dense oracle)."""
    saved = _layer_with_state(saved_scale, basis_storage, proj_type)
    state = saved.state_dict()
    assert float(state["galore_folded_scale"]) == float(torch.tensor(saved_scale))  # as fp32 holds it
    layer = _layer_with_state(0.25, basis_storage, proj_type)
    with torch.no_grad():
        layer.galore_factor.zero_()
    layer.load_state_dict(state, strict=True)
    assert float(layer.state_dict()["galore_folded_scale"]) == 0.25
    # 0.5 -> 0.25 is a power of two: bit for bit; 0.3 -> 0.25 rounds once (fp32 values near 1/sqrt(dim))
    tol = 0.0 if saved_scale == 0.5 else 4 * torch.finfo(torch.float32).eps
    for side in ("left", "right"):
        if layer._bases.get(side) is not None:
            torch.testing.assert_close(layer.basis(side), saved.basis(side), rtol=0, atol=tol, msg=side)
    dense = nn.Linear(IN_FEATURES, OUT_FEATURES)
    with torch.no_grad():
        delta = layer.galore_factor.detach()
        if layer.basis("right") is not None:
            delta = delta @ saved.basis("right").mT
        if layer.basis("left") is not None:
            delta = saved.basis("left") @ delta
        dense.weight.copy_(saved.weight + 0.25 * delta)
        dense.bias.copy_(saved.bias)
    x = batch(5, torch.float32)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("basis_storage", ["as_computed", "int4"])
def test_a_state_reloaded_under_its_own_scale_is_bit_for_bit(basis_storage):
    """0.3 is not a power of two and fp32 holds it rounded: reloading under the same scale converts nothing."""
    state = _layer_with_state(0.3, basis_storage).state_dict()
    layer = _layer_with_state(0.3, basis_storage)
    with torch.no_grad():
        layer.galore_factor.zero_()
    layer.load_state_dict(state, strict=True)
    for key, value in layer.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, equal_nan=True, msg=key)


@pytest.mark.parametrize("value", [0.0, -0.25, float("nan"), float("inf")])
def test_a_damaged_folded_scale_is_refused_naming_it(value):
    state = _layer_with_state(0.25, "as_computed").state_dict()
    state["galore_folded_scale"] = torch.tensor(value)
    with pytest.raises(ValueError, match="galore_folded_scale"):
        _layer_with_state(0.25, "as_computed").load_state_dict(state)


@pytest.mark.parametrize("strict", [True, False])
def test_a_basis_without_its_folded_scale_is_refused_naming_it(strict):
    """A state that holds the folded basis but not the multiplier it carries cannot be read (the basis would be
    taken at the wrong scale): refused, strict or not."""
    state = _layer_with_state(0.25, "as_computed").state_dict()
    del state["galore_folded_scale"]
    with pytest.raises(ValueError, match="galore_folded_scale is missing"):
        _layer_with_state(0.25, "as_computed").load_state_dict(state, strict=strict)


@pytest.mark.parametrize("storage, group_size", [("int8", 32), ("int4", 32), ("nf4", 64)])
def test_stored_tensor_quantized_matches_the_quant_library(storage, group_size):
    scheme, bits = {"int8": ("symmetric", 8), "int4": ("symmetric", 4), "nf4": ("nf4", 4)}[storage]
    module = nn.Module()
    value = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    store = StoredTensor(module, "w_q", storage, group_size=group_size)
    store.store(value)

    expected = hq.quantize(value, scheme=scheme, bits=bits, block_size=group_size)
    tensors, meta = expected.to_state()
    assert set(dict(module.named_buffers())) == {f"w_q_{part}" for part in tensors}
    for part, tensor in tensors.items():
        assert torch.equal(module.get_buffer(f"w_q_{part}"), tensor), part
    assert store.meta == meta
    assert torch.equal(store.value(torch.float32), expected.dequantize(torch.float32))
    assert store.value(torch.bfloat16).dtype == torch.bfloat16
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    approx = expected.dequantize(torch.float64)
    dense_error = float((approx - value.double()).norm() / value.double().norm())
    # The store measures with fp32 differences and squares (one rounding of u = eps/2 each, the sums in
    # fp64): |q - v|^2 within 3u, |v|^2 within u, their root ratio within 2u = eps of the fp64 measure.
    assert store.error == pytest.approx(dense_error, rel=EPS32)

    # A second store of the same shape writes into the same buffer tensors (engines hold references).
    codes = module.get_buffer("w_q_codes")
    store.store(2 * value)
    assert module.get_buffer("w_q_codes") is codes
    assert torch.equal(
        store.value(torch.float32),
        hq.quantize(2 * value, scheme=scheme, bits=bits, block_size=group_size).dequantize(torch.float32),
    )


@pytest.mark.parametrize("storage", ["int8", "int4", "nf4"])
def test_stored_tensor_reads_the_scales_written_outside_store(storage):
    # The eager read keeps each block's multiplier between reads; writes that bypass store() (load_state_dict
    # copies into the buffers, module.to() and engines replace them) must show in the next read. Oracle: the
    # quant library's dequantization of the buffers as they are.
    module = nn.Module()
    gen = torch.Generator().manual_seed(2)
    store = StoredTensor(module, "w_q", storage, group_size=32)
    store.store(torch.randn(16, 8, generator=gen))

    def library_value() -> torch.Tensor:
        return store.load().dequantize(torch.float32)

    assert torch.equal(store.value(torch.float32), library_value())
    other = nn.Module()
    StoredTensor(other, "w_q", storage, group_size=32).store(3 * torch.randn(16, 8, generator=gen))
    module.load_state_dict(other.state_dict())  # in place: same tensors, new version
    assert torch.equal(store.value(torch.float32), library_value())
    module._apply(lambda t: t.clone())  # new tensors
    module.get_buffer("w_q_scales").mul_(2)
    assert torch.equal(store.value(torch.float32), library_value())
    assert torch.equal(store.value(torch.bfloat16), library_value().to(torch.bfloat16))


def test_stored_tensor_stochastic_rounding_uses_the_given_generator():
    module = nn.Module()
    value = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    store = StoredTensor(module, "w_q", "int8", group_size=64)
    store.store(value, generator=torch.Generator().manual_seed(7))
    expected = hq.quantize(
        value, scheme="symmetric", bits=8, block_size=64, stochastic=True, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(module.get_buffer("w_q_codes"), expected.to_state()[0]["codes"])
    nearest = hq.quantize(value, scheme="symmetric", bits=8, block_size=64)
    assert not torch.equal(module.get_buffer("w_q_codes"), nearest.to_state()[0]["codes"])


def test_stored_tensor_plain_casts_and_keeps_the_buffer():
    module = nn.Module()
    store = StoredTensor(module, "basis", "as_computed", dtype=torch.bfloat16)
    value = torch.randn(6, 2)
    store.store(value)
    buffer = module.get_buffer("basis")
    assert buffer.dtype == torch.bfloat16 and torch.equal(buffer, value.to(torch.bfloat16))
    store.store(value + 1)
    assert module.get_buffer("basis") is buffer  # in place
    assert torch.equal(store.value(torch.float32), (value + 1).to(torch.bfloat16).float())
    assert store.nbytes() == 6 * 2 * 2 and store.error is None
    with pytest.raises(TypeError, match="'basis' is stored plain"):
        store.load()


def test_stored_tensor_refuses_an_unknown_storage_naming_it():
    with pytest.raises(ValueError, match=r"storage 'int3' of 'w'.*as_computed.*int8"):
        StoredTensor(nn.Module(), "w", "int3", group_size=64)
    with pytest.raises(ValueError, match="'int8' of 'w' needs a group_size"):
        StoredTensor(nn.Module(), "w", "int8")


@pytest.mark.parametrize("copy_kind", ["deepcopy", "pickle"])
def test_a_copied_layer_reads_its_own_buffers(copy_kind, tmp_path):
    # The storage objects hold their module: a copy (copy.deepcopy, torch.save of the whole module) must
    # point at the copy, so writing one layer's W0 or basis never changes the other's.
    import copy

    layer, _ = build("int8-int4")
    if copy_kind == "deepcopy":
        twin = copy.deepcopy(layer)
    else:
        torch.save(layer, tmp_path / "layer.pt")
        twin = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert twin._weight_store.module is twin and all(s.module is twin for s in twin._bases.values())
    before = layer.base_weight(torch.float32).clone(), layer.basis("left", torch.float32).clone()
    twin._set_basis("left", torch.linalg.qr(torch.randn(24, 4))[0])
    twin._store_weight(torch.randn(24, 16))
    assert torch.equal(layer.base_weight(torch.float32), before[0])
    assert torch.equal(layer.basis("left", torch.float32), before[1])
    assert not torch.equal(twin.base_weight(torch.float32), before[0])
    assert not torch.equal(twin.basis("left", torch.float32), before[1])
