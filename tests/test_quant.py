"""Blockwise quantization: the torch twins against a per-block reference written here, against
bitsandbytes, and the QuantizedTensor contract (bounds, nbytes, state, pickling, errors).

The Triton kernels are compared with these twins in test_quant_triton.py; here every public op
is forced onto its torch twin, also on a CUDA machine.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import use_torch_twins

import hf_galore_plugin.quant as hq

CONFIGS = list(hq.SCHEME_BITS)
SHAPES = [(1,), (100,), (4097,), (33, 65), (3, 5, 70)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# NF4 as published in the QLoRA paper's appendix and bitsandbytes' `create_normal_map`
# (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs").
PUBLISHED_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    use_torch_twins(monkeypatch)


def _randn(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _levels(scheme, bits):
    return 2 ** (bits - 1) - 1 if scheme == "symmetric" else 2**bits - 1


def _max_step(scheme, bits):
    """Largest gap between neighbouring code values, in units of the block scale."""
    if scheme == "nf4":
        return float((hq.NF4_VALUES[1:] - hq.NF4_VALUES[:-1]).max())
    if scheme == "uniform":
        return 2.0 / _levels(scheme, bits)
    if scheme == "symmetric":
        return 1.0 / _levels(scheme, bits)
    return 1.0  # asymmetric: the stored scale is the step itself


def _reference_codes(x, scheme, bits, block_size):
    """Per-block loop in float64: (codes as signed ints, distance of each value to a rounding tie)."""
    flat = x.reshape(-1).double()
    codes, tie_distance = [], []
    grid = hq.NF4_VALUES.double()
    for start in range(0, flat.numel(), block_size):
        block = flat[start : start + block_size]
        if scheme == "nf4":
            y = block / block.abs().max() if block.abs().max() > 0 else block * 0
            codes.append((y[:, None] - grid[None, :]).abs().argmin(dim=1))
            mids = (grid[1:] + grid[:-1]) / 2
            tie_distance.append((y[:, None] - mids[None, :]).abs().min(dim=1).values)
            continue
        levels = _levels(scheme, bits)
        if scheme == "asymmetric":
            step = (block.max() - block.min()) / levels
            v = (block - block.min()) / step if step > 0 else block * 0
        else:
            absmax = block.abs().max()
            y = block / absmax if absmax > 0 else block * 0
            v = y * levels if scheme == "symmetric" else (y + 1) * levels / 2
        codes.append(torch.round(v).long())
        tie_distance.append(((v - v.floor()) - 0.5).abs())
    return torch.cat(codes), torch.cat(tie_distance)


def _signed_codes(qt):
    numel = qt.numel()
    codes = hq.unpack_int4(qt.codes, numel=numel) if qt.bits == 4 else qt.codes
    offset = 8 if (qt.scheme, qt.bits) == ("symmetric", 4) else 0
    return codes.long() - offset


def test_nf4_values_match_published_table():
    assert hq.NF4_VALUES.dtype == torch.float32 and hq.NF4_VALUES.shape == (16,)
    torch.testing.assert_close(hq.NF4_VALUES, torch.tensor(PUBLISHED_NF4), rtol=0, atol=1e-6)
    assert bool((hq.NF4_VALUES[1:] > hq.NF4_VALUES[:-1]).all())
    assert hq.NF4_VALUES[7].item() == 0.0


def test_uniform_values_are_evenly_spaced_on_unit_interval():
    for bits in (4, 8):
        values = hq.uniform_values(bits)
        torch.testing.assert_close(values, torch.linspace(-1, 1, 2**bits), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("shape", [(1,), (100,), (4097,)])
@pytest.mark.parametrize("block_size", [32, 256])
def test_codes_match_per_block_reference(scheme, bits, shape, block_size):
    x = _randn(shape, torch.float32)
    qt = hq.quantize(x, scheme=scheme, bits=bits, block_size=block_size)
    expected, tie_distance = _reference_codes(x, scheme, bits, block_size)
    differ = _signed_codes(qt) != expected
    # fp32 (twin) and fp64 (reference) may only disagree where the value sits on a tie.
    assert bool((tie_distance[differ] < 1e-4).all()), f"{int(differ.sum())} codes differ off ties"
    assert int(differ.sum()) <= max(1, x.numel() // 500)


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_round_trip_error_within_half_step(scheme, bits, shape, dtype, double_quant):
    x = _randn(shape, dtype)
    qt = hq.quantize(x, scheme=scheme, bits=bits, double_quant=double_quant)
    out = qt.dequantize()
    assert out.shape == x.shape and out.dtype == dtype
    block = qt.block_size
    flat = x.reshape(-1).float()
    pad = -flat.numel() % block
    error = torch.nn.functional.pad((qt.dequantize(torch.float32).reshape(-1) - flat), (0, pad))
    half_step = 0.5 * _max_step(scheme, bits) * qt.block_scales()
    block_absmax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, block).amax(dim=1)
    # The fp32 arithmetic of quantize + dequantize adds a few fp32 ulps of the block's values.
    bound = half_step + 4 * torch.finfo(torch.float32).eps * block_absmax
    assert bool((error.view(-1, block).abs().amax(dim=1) <= bound).all())
    # The result in the input dtype adds that dtype's rounding: half an ulp of the value.
    tolerance = float(half_step.max()) + torch.finfo(dtype).eps * float(flat.abs().max())
    assert float((out.float() - x.float()).abs().max()) <= tolerance


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("double_quant", [False, True])
def test_stochastic_rounding_is_unbiased(scheme, bits, double_quant):
    # 512 identical copies of two blocks: every copy has the same block scales, so the copies
    # are independent draws of the stochastic rounding of the same values.
    draws, block_size = 512, 64
    base = _randn((2 * block_size,), torch.float32, seed=3)
    x = base.repeat(draws)
    qt = hq.quantize(
        x,
        scheme=scheme,
        bits=bits,
        block_size=block_size,
        double_quant=double_quant,
        stochastic=True,
        generator=torch.Generator().manual_seed(7),
    )
    samples = qt.dequantize().view(draws, -1)
    step = _max_step(scheme, bits) * qt.block_scales()[:2].repeat_interleave(block_size)
    # A rounding between neighbours `step` apart has standard deviation <= step / 2, so the mean
    # of `draws` samples is within 6 standard errors (false alarm < 1e-8 per value).
    bound = 6 * (step / 2) / math.sqrt(draws)
    assert bool(((samples.mean(dim=0) - base).abs() <= bound).all())
    assert bool(((samples - base).abs() <= step * (1 + 1e-5)).all())
    # Averaged over all values the remaining deviation is a small fraction of a step.
    assert float((samples.mean(dim=0) - base).abs().mean()) < float(step.mean()) / 20


@pytest.mark.parametrize("scheme,bits", CONFIGS)
def test_stochastic_rounding_reproducible_with_generator(scheme, bits):
    x = _randn((1000,), torch.bfloat16)

    def codes(seed):
        generator = torch.Generator().manual_seed(seed)
        return hq.quantize(x, scheme=scheme, bits=bits, stochastic=True, generator=generator).codes

    assert torch.equal(codes(11), codes(11))
    assert not torch.equal(codes(11), codes(12))


def _expected_nbytes(numel, scheme, bits, block_size, double_quant):
    blocks = -(-numel // block_size)
    code_bytes = -(-numel // 2) if bits == 4 else numel
    scale_bytes = blocks + 4 * -(-blocks // 256) + 4 if double_quant else 4 * blocks
    zero_bytes = 4 * blocks if scheme == "asymmetric" else 0
    return code_bytes + scale_bytes + zero_bytes


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("numel", [1, 63, 4097, 70000])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nbytes_is_exact(scheme, bits, numel, double_quant):
    qt = hq.quantize(torch.randn(numel), scheme=scheme, bits=bits, double_quant=double_quant)
    assert qt.nbytes == _expected_nbytes(numel, scheme, bits, qt.block_size, double_quant)


def test_nf4_double_quant_costs_4_127_bits_per_value():
    numel = 64 * 256 * 64  # 4096 nested blocks: the scalar mean is negligible
    x = torch.randn(numel)
    with_dq = hq.quantize(x, scheme="nf4", bits=4, double_quant=True)
    without = hq.quantize(x, scheme="nf4", bits=4)
    assert with_dq.nbytes * 8 / numel == pytest.approx(4.127, abs=5e-4)
    assert without.nbytes * 8 / numel == pytest.approx(4.5, abs=1e-9)


def test_default_block_sizes():
    assert hq.quantize(torch.randn(10), scheme="nf4", bits=4).block_size == 64
    assert hq.quantize(torch.randn(10), scheme="symmetric", bits=8).block_size == 256


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("double_quant", [False, True])
def test_state_round_trip_is_exact(scheme, bits, double_quant):
    x = _randn((7, 300), torch.bfloat16)
    qt = hq.quantize(x, scheme=scheme, bits=bits, double_quant=double_quant)
    tensors, meta = qt.to_state()
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert all(isinstance(v, (int, str, bool, list)) for v in meta.values())
    back = hq.QuantizedTensor.from_state(tensors, meta)
    again_tensors, again_meta = back.to_state()
    assert again_meta == meta and again_tensors.keys() == tensors.keys()
    assert all(torch.equal(again_tensors[k], tensors[k]) for k in tensors)
    assert torch.equal(back.dequantize(), qt.dequantize())
    assert (back.shape, back.dtype, back.scheme, back.bits, back.block_size) == (
        qt.shape,
        qt.dtype,
        qt.scheme,
        qt.bits,
        qt.block_size,
    )


def test_torch_save_load_weights_only_in_process(tmp_path):
    qt = hq.quantize(_randn((5, 70), torch.float16), scheme="asymmetric", bits=4, double_quant=True)
    path = tmp_path / "qt.pt"
    torch.save({"state": {"exp_avg": qt}, "step": 3}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 3
    assert torch.equal(loaded["state"]["exp_avg"].dequantize(), qt.dequantize())


def test_torch_load_weights_only_in_fresh_process(tmp_path, python_subprocess):
    x = _randn((3, 4, 70), torch.bfloat16)
    alone = hq.quantize(x, scheme="nf4", bits=4, double_quant=True)
    module = torch.nn.Linear(4, 2)
    state_dict = dict(module.state_dict(), **{"weight_q": hq.quantize(x, scheme="symmetric", bits=8)})
    torch.save(alone, tmp_path / "alone.pt")
    torch.save(state_dict, tmp_path / "state.pt")
    torch.save({"alone": alone.dequantize(), "weight_q": state_dict["weight_q"].dequantize()}, tmp_path / "expected.pt")
    result = python_subprocess(
        f"""
        import sys, torch
        import hf_galore_plugin.quant
        assert "triton" not in sys.modules, "importing the quant package must not import triton"
        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        alone = torch.load({str(tmp_path / "alone.pt")!r}, weights_only=True)
        state = torch.load({str(tmp_path / "state.pt")!r}, weights_only=True)
        assert torch.equal(alone.dequantize(), expected["alone"])
        assert torch.equal(state["weight_q"].dequantize(), expected["weight_q"])
        assert set(state) == {{"weight", "bias", "weight_q"}}
        print("ok")
        """,
        env={"HF_GALORE_DISABLE_TRITON": "1"},
    )
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("double_quant", [False, True])
def test_non_finite_block_dequantizes_to_nan(scheme, bits, double_quant):
    x = _randn((4 * 64,), torch.float32)
    x[70] = math.nan
    x[200] = -math.inf
    qt = hq.quantize(x, scheme=scheme, bits=bits, block_size=64, double_quant=double_quant)
    out = qt.dequantize().view(4, 64)
    assert bool(out[1].isnan().all()) and bool(out[3].isnan().all())
    assert bool(torch.isfinite(out[[0, 2]]).all())
    clean = hq.quantize(x.view(4, 64)[[0, 2]].reshape(-1), scheme=scheme, bits=bits, block_size=64)
    # Healthy blocks are unaffected by their NaN neighbours (without nested scales: exactly).
    if not double_quant:
        assert torch.equal(out[[0, 2]].reshape(-1), clean.dequantize())


@pytest.mark.parametrize("scheme,bits", CONFIGS)
def test_empty_and_single_element(scheme, bits):
    for double_quant in (False, True):
        empty = hq.quantize(torch.empty(0, 3), scheme=scheme, bits=bits, double_quant=double_quant)
        assert empty.dequantize().shape == (0, 3)
        one = hq.quantize(torch.tensor([-2.5]), scheme=scheme, bits=bits, double_quant=double_quant)
        # A lone value is its block's absmax (or min): every scheme represents it exactly.
        assert one.dequantize().item() == pytest.approx(-2.5, rel=1e-6)


@pytest.mark.parametrize("scheme,bits", CONFIGS)
def test_zero_and_constant_blocks(scheme, bits):
    x = torch.zeros(3, 64)
    x[1] = 0.75
    out = hq.quantize(x, scheme=scheme, bits=bits, block_size=64).dequantize()
    # uniform has no exact 0 on its grid, but a zero block has scale 0 and so dequantizes to 0.
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])
    torch.testing.assert_close(out[1], x[1], rtol=1e-6, atol=0)


def test_quantizing_a_parameter_keeps_no_autograd_graph():
    weight = torch.nn.Parameter(torch.randn(8, 64))
    qt = hq.quantize(weight, scheme="symmetric", bits=8, double_quant=False)
    assert not qt.scales.requires_grad and qt.scales.grad_fn is None
    assert qt.dequantize().grad_fn is None


def test_block_tensor_errors():
    x = torch.randn(100)
    codes, scales, _ = hq.quantize_blockwise(x, scheme="asymmetric", bits=8, block_size=64)
    with pytest.raises(ValueError, match=r"scales hold 1 values but 100 values in blocks of 64 need 2"):
        hq.quantize_blockwise(x, scheme="symmetric", bits=8, block_size=64, scales=scales[:1])
    with pytest.raises(ValueError, match=r"asymmetric scheme needs zero_points with 2 values"):
        hq.dequantize_blockwise(
            codes, scales, None, scheme="asymmetric", bits=8, block_size=64, numel=100, dtype=torch.float32
        )
    with pytest.raises(ValueError, match=r"randoms must be float32 with one value per element of x \(100\)"):
        hq.quantize_blockwise(x, scheme="nf4", bits=4, block_size=64, randoms=torch.rand(99))


def test_pack_unpack_int4_round_trip():
    codes = torch.randint(0, 16, (9,), dtype=torch.uint8)
    packed = hq.pack_int4(codes)
    assert packed.shape == (5,) and int(packed[-1]) >> 4 == 0  # odd count: zero padding nibble
    assert int(packed[0]) == int(codes[0]) | (int(codes[1]) << 4)  # even index in the low nibble
    assert torch.equal(hq.unpack_int4(packed, numel=9), codes)


def test_pack_unpack_errors():
    with pytest.raises(ValueError, match=r"packed 4-bit tensor has 5 bytes but numel=12 needs 6"):
        hq.unpack_int4(torch.zeros(5, dtype=torch.uint8), numel=12)
    with pytest.raises(TypeError, match="uint8"):
        hq.pack_int4(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"value 16 > 15"):
        hq.pack_int4(torch.tensor([1, 16], dtype=torch.uint8))
    codes, scales, _ = hq.quantize_blockwise(torch.randn(100), scheme="nf4", bits=4, block_size=64)
    with pytest.raises(ValueError, match=r"codes hold 50 elements but 101 values at 4 bits need 51"):
        hq.dequantize_blockwise(
            codes, scales, None, scheme="nf4", bits=4, block_size=64, numel=101, dtype=torch.float32
        )


@pytest.mark.parametrize(
    "x,kwargs,error,match",
    [
        (torch.arange(4), {}, TypeError, r"dtype torch.int64.*float32, bfloat16 or float16.*x.float\(\)"),
        (torch.ones(4, dtype=torch.bool), {}, TypeError, r"dtype torch.bool"),
        (torch.ones(4, dtype=torch.complex64), {}, TypeError, r"dtype torch.complex64"),
        (torch.ones(4, dtype=torch.float64), {}, TypeError, r"dtype torch.float64"),
        ([1.0, 2.0], {}, TypeError, r"must be a torch.Tensor, got list"),
        (torch.ones(4), {"scheme": "int8"}, ValueError, r"unknown quantization scheme 'int8'; use one of symmetric"),
        (
            torch.ones(4),
            {"bits": 3},
            ValueError,
            r"bits=3 is not supported by scheme 'symmetric'; use bits in \(4, 8\)",
        ),
        (torch.ones(4), {"scheme": "nf4", "bits": 8}, ValueError, r"bits=8 is not supported by scheme 'nf4'"),
        (torch.ones(4), {"block_size": 48}, ValueError, r"block_size=48 must be a power of two between 32 and 4096"),
        (torch.ones(4), {"block_size": 8192}, ValueError, r"block_size=8192"),
        (torch.ones(4), {"block_size": 16}, ValueError, r"block_size=16"),
        (torch.ones(4), {"block_size": 64.0}, TypeError, r"block_size must be an int, got 64.0"),
    ],
)
def test_bad_input_errors(x, kwargs, error, match):
    arguments = {"scheme": "symmetric", "bits": 8, **kwargs}
    with pytest.raises(error, match=match):
        hq.quantize(x, **arguments)


def test_from_state_errors():
    tensors, meta = hq.quantize(torch.randn(100), scheme="asymmetric", bits=4).to_state()
    with pytest.raises(ValueError, match=r"lacks tensors \['zero_points'\]"):
        hq.QuantizedTensor.from_state({k: v for k, v in tensors.items() if k != "zero_points"}, meta)
    with pytest.raises(ValueError, match=r"codes hold 50 elements but shape \[101\] at 4 bits needs 51"):
        hq.QuantizedTensor.from_state(tensors, dict(meta, shape=[101]))
    with pytest.raises(ValueError, match=r"lacks \['scheme'\]"):
        hq.QuantizedTensor.from_state(tensors, {k: v for k, v in meta.items() if k != "scheme"})
    with pytest.raises(TypeError, match="dequantize takes a QuantizedTensor"):
        hq.dequantize(torch.zeros(3))


def test_error_feedback_cancels_accumulated_rounding():
    # Quantizing the same value every step: without feedback the error repeats, with feedback the
    # running mean of the dequantized values converges to the value (error <= step / steps).
    x = _randn((256,), torch.float32, seed=5)
    kwargs = {"scheme": "symmetric", "bits": 4, "block_size": 64}
    residual, total = None, torch.zeros_like(x)
    steps = 64
    for _ in range(steps):
        qt, new_residual = hq.quantize_with_error_feedback(x, residual, **kwargs)
        target = x if residual is None else x + residual
        torch.testing.assert_close(new_residual, target - qt.dequantize(torch.float32), rtol=0, atol=0)
        residual, total = new_residual, total + qt.dequantize(torch.float32)
    plain_error = float((hq.quantize(x, **kwargs).dequantize() - x).abs().max())
    feedback_error = float((total / steps - x).abs().max())
    assert feedback_error < plain_error / 10
    assert residual.dtype == torch.float32
    _, bf16_residual = hq.quantize_with_error_feedback(x, residual.bfloat16(), **kwargs)
    assert bf16_residual.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"residual has shape \(3,\) but x has \(256,\)"):
        hq.quantize_with_error_feedback(x, torch.zeros(3), **kwargs)


def test_bitsandbytes_nf4_oracle():
    import bitsandbytes.functional as bnb_functional  # the oracle (dev extra)

    x = _randn((33, 129), torch.float32)
    packed, state = bnb_functional.quantize_4bit(x, blocksize=64, quant_type="nf4")
    ours = hq.quantize(x, scheme="nf4", bits=4, block_size=64)
    torch.testing.assert_close(state.code.float(), hq.NF4_VALUES, rtol=0, atol=1e-6)
    assert torch.equal(state.absmax, ours.scales)
    expected = bnb_functional.dequantize_4bit(packed, state)
    differ = (ours.dequantize() - expected).abs() > 1e-6
    # bitsandbytes' thresholds are decimal constants: agreement is exact except at near-ties.
    _, tie_distance = _reference_codes(x, "nf4", 4, 64)
    assert bool((tie_distance[differ.reshape(-1)] < 1e-5).all()) and int(differ.sum()) <= 2


@pytest.mark.parametrize("scheme,add_zero", [("uniform", False), ("symmetric", True)])
def test_bitsandbytes_linear_8bit_oracle(scheme, add_zero):
    import bitsandbytes.functional as bnb_functional  # the oracle (dev extra)

    # bitsandbytes' linear map without an added zero is linspace(-1, 1, 256) (our uniform grid);
    # with it, the 255 points k/127 (our symmetric int8) plus a padding 0.
    code = bnb_functional.create_linear_map(signed=True, total_bits=8, add_zero=add_zero)
    x = _randn((4097,), torch.float32)
    codes, state = bnb_functional.quantize_blockwise(x, code=code, blocksize=256)
    ours = hq.quantize(x, scheme=scheme, bits=8, block_size=256)
    assert torch.equal(state.absmax, ours.scales)
    expected = bnb_functional.dequantize_blockwise(codes, state)
    differ = (ours.dequantize() - expected).abs() > 1e-5
    # The map's values are fp32 linspace points, not exact k/127: codes may differ at near-ties.
    _, tie_distance = _reference_codes(x, scheme, 8, 256)
    assert bool((tie_distance[differ] < 2e-3).all()) and int(differ.sum()) < 20


def test_import_does_not_import_triton(python_subprocess):
    result = python_subprocess("import sys, hf_galore_plugin.quant; print('triton' in sys.modules)")
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_finite_input_wider_than_float32_range_stays_finite(scheme, bits, stochastic):
    # A block spanning [-3e38, 3e38]: max - min overflows float32 (asymmetric used to give all NaN).
    big = torch.finfo(torch.float32).max
    x = torch.linspace(-0.9 * big, 0.9 * big, 64, dtype=torch.float64).to(torch.float32)
    x = torch.cat([x, torch.randn(64, generator=torch.Generator().manual_seed(0))])
    generator = torch.Generator().manual_seed(1) if stochastic else None
    qt = hq.quantize(
        x, scheme=scheme, bits=bits, block_size=64, double_quant=False, stochastic=stochastic, generator=generator
    )
    out = qt.dequantize(torch.float32)
    assert bool(torch.isfinite(out).all()), out[~torch.isfinite(out)][:4]
    # within one step of the block's grid (oracle: exact float64 arithmetic on the same range)
    wide = x[:64].double()
    step = float((wide.max() - wide.min()) / (2**bits - 1)) if scheme == "asymmetric" else float(wide.abs().max())
    assert float((out[:64].double() - wide).abs().max()) <= step * (1.0 if scheme != "nf4" else 0.5)
    # the ordinary block next to it is quantized as on its own
    alone = hq.quantize(x[64:], scheme=scheme, bits=bits, block_size=64, double_quant=False)
    if not stochastic:
        assert torch.equal(out[64:], alone.dequantize(torch.float32))


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("shape,block_size", [((4096,), 256), ((32, 128), 64), ((4097,), 256), ((33, 65), 64)])
def test_dequantize_equals_per_block_formula(scheme, bits, shape, block_size):
    # Oracle: every value is code * step (+ zero point) of its block, computed on the padded whole-block
    # layout; dequantize skips the pad (whole blocks) and the zero offset pass and must give the same bits.
    from hf_galore_plugin.codes import code_levels, nibble_offset
    from hf_galore_plugin.quant.functional import dequantize_blockwise_torch, grid_table

    x = _randn(shape, torch.float32)
    qt = hq.quantize(x, scheme=scheme, bits=bits, block_size=block_size)
    numel = x.numel()
    codes = hq.unpack_int4(qt.codes, numel=numel) if bits == 4 else qt.codes[:numel]
    values = codes.to(torch.float32) - float(nibble_offset(scheme, bits))
    blocks = torch.nn.functional.pad(values, (0, -numel % block_size)).view(-1, block_size)
    scales, levels = qt.block_scales(), code_levels(scheme, bits)
    if scheme == "symmetric":
        expected = blocks * (scales / float(levels))[:, None]
    elif scheme == "asymmetric":
        expected = blocks * scales[:, None] + qt.zero_points[:, None]
    elif scheme == "uniform":
        expected = (blocks * (2.0 / levels) - 1.0) * scales[:, None]
    else:
        expected = grid_table(codes.device)[blocks.long()] * scales[:, None]
    expected = expected.reshape(-1)[:numel].view(shape)
    assert torch.equal(qt.dequantize(torch.float32), expected)
    got = dequantize_blockwise_torch(
        qt.codes, scales, qt.zero_points, scheme=scheme, bits=bits, block_size=block_size, numel=numel,
        dtype=torch.float32,
    )  # fmt: skip
    assert torch.equal(got.view(shape), expected)
