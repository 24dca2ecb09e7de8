"""The layer's storage objects and its checkpoint format.

Oracles: state dicts written by the code before the layer became a package (tests/fixtures/layer_states.pt,
built by tests/_layer_states.py at commit f2c4212), with the outputs and the refresh that code computed
from them; for StoredTensor, the quant library's own quantize/dequantize and a dense error measure.
"""

from __future__ import annotations

import pytest
import torch
from _layer_states import CASES, PATH, batch, build, train_step
from torch import nn

import hf_galore_plugin.quant as hq
from hf_galore_plugin.layers import StoredTensor

FIXTURE = torch.load(PATH, weights_only=False)


def test_the_fixture_covers_every_storage_setting():
    assert set(FIXTURE) == set(CASES)
    settings = {
        (o.get("weight_storage", "as_loaded"), o.get("basis_storage", "as_computed")) for o, _ in CASES.values()
    }
    assert settings == {(w, b) for w in ("as_loaded", "int8", "nf4") for b in ("as_computed", "int8", "int4")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_written_by_the_old_layer_loads_to_the_same_keys_and_numbers(name):
    old = FIXTURE[name]
    layer, optimizer = build(name)
    # The same key names as before, for this storage setting, before and after a load.
    assert set(layer.state_dict()) == set(old["state_dict"])
    layer.load_state_dict(old["state_dict"], strict=True)
    loaded = layer.state_dict()
    assert set(loaded) == set(old["state_dict"])
    for key, value in old["state_dict"].items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, equal_nan=True, msg=key)  # bit for bit
    with torch.no_grad():
        torch.testing.assert_close(layer(batch(99, layer.weight_dtype)), old["output"], rtol=1e-5, atol=1e-6)

    # What the old code computed from this state: a refresh step (fold into the stored W0, new stored
    # bases, stochastic rounding from the restored counter, lazy gap, moment reset or transport).
    optimizer.load_state_dict(old["optimizer"])
    train_step(layer, optimizer, 2)
    after = layer.state_dict()
    assert set(after) == set(old["after_refresh"])
    for key, value in old["after_refresh"].items():
        if value.is_floating_point():  # fp32 tolerances also for bf16 W0: one bf16 rounding step fails it
            torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6, equal_nan=True, msg=key)
        else:  # counters and quantization codes: computed by the same float ops, so equal
            assert torch.equal(after[key], value), key
    assert layer.quantization_error() == pytest.approx(old["quantization_error"], rel=1e-6)


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
    assert store.error == pytest.approx(dense_error, rel=1e-9)

    # A second store of the same shape writes into the same buffer tensors (engines hold references).
    codes = module.get_buffer("w_q_codes")
    store.store(2 * value)
    assert module.get_buffer("w_q_codes") is codes
    assert torch.equal(
        store.value(torch.float32),
        hq.quantize(2 * value, scheme=scheme, bits=bits, block_size=group_size).dequantize(torch.float32),
    )


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
