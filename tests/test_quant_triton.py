"""The quantization Triton kernels against their torch twins, run on CPU by the Triton interpreter.

The kernels mirror the twins' fp32 arithmetic (correctly rounded divisions, round half to even),
so codes, scales and zero points must be identical, including at ties; stochastic rounding is
compared with the same tensor of randoms. Grids stay at a few programs (4096 values each).
"""

from __future__ import annotations

import math
import sys

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_galore_plugin.quant as hq  # noqa: E402
from hf_galore_plugin.quant import functional  # noqa: E402
from hf_galore_plugin.utils import KERNEL_DISPATCH, use_triton  # noqa: E402

if sys.platform != "linux":  # the one platform skip: Triton ships Linux wheels only (the [triton] extra)
    pytest.skip("platform: Triton kernels run on Linux only; elsewhere the torch twins run", allow_module_level=True)
import triton  # noqa: E402,F401

from hf_galore_plugin.kernels import quant as kernels  # noqa: E402

# numpy (inside the interpreter) warns on the 0 / 0 of blocks with zero scale, whose result
# tl.where then discards.
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

CONFIGS = list(hq.SCHEME_BITS)
SHAPES = [(1,), (100,), (4097,), (3, 5, 70)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch):
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", False)


def _randn(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_same_outputs(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_kernel_equals_twin(scheme, bits, shape, dtype, stochastic):
    x = _randn(shape, dtype)
    x.view(-1)[-1] = 0.0
    randoms = torch.rand(x.numel(), generator=torch.Generator().manual_seed(1)) if stochastic else None
    block_size = 32 if x.numel() < 200 else 64
    kwargs = {"scheme": scheme, "bits": bits, "block_size": block_size}
    expected = functional.quantize_blockwise_torch(x, randoms=randoms, **kwargs)
    _assert_same_outputs(kernels.quantize_blockwise_triton(x, randoms=randoms, **kwargs), expected)
    _assert_same_outputs(kernels.blockwise_stats_triton(x, **kwargs), functional.blockwise_stats_torch(x, **kwargs))


@pytest.mark.parametrize("scheme,bits", CONFIGS)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 4097])
def test_dequantize_kernel_equals_twin(scheme, bits, out_dtype, numel):
    kwargs = {"scheme": scheme, "bits": bits, "block_size": 256}
    codes, scales, zero_points = functional.quantize_blockwise_torch(_randn((numel,), torch.float32), **kwargs)
    args = (codes, scales, zero_points)
    expected = functional.dequantize_blockwise_torch(*args, numel=numel, dtype=out_dtype, **kwargs)
    got = kernels.dequantize_blockwise_triton(*args, numel=numel, dtype=out_dtype, **kwargs)
    assert got.dtype == out_dtype
    if out_dtype == torch.bfloat16:
        # The interpreter's fp32 -> bf16 cast truncates (a GPU rounds to nearest): one bf16 ulp.
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("scheme,bits", CONFIGS)
def test_quantize_with_given_scales_equals_twin(scheme, bits):
    # The double-quantization path encodes against given (dequantized) scales; some values clamp.
    x = _randn((300,), torch.float32)
    kwargs = {"scheme": scheme, "bits": bits, "block_size": 64}
    scales, zero_points = functional.blockwise_stats_torch(x, **kwargs)
    given = {"scales": scales * 0.9, "zero_points": zero_points}
    _assert_same_outputs(
        kernels.quantize_blockwise_triton(x, **given, **kwargs),
        functional.quantize_blockwise_torch(x, **given, **kwargs),
    )


@pytest.mark.parametrize("scheme,bits", CONFIGS)
def test_public_quantize_dispatches_to_kernel_and_matches_twin(scheme, bits, monkeypatch):
    x = _randn((5, 130), torch.bfloat16)
    assert use_triton(x)
    calls = []
    launcher = kernels.quantize_blockwise_triton
    monkeypatch.setattr(kernels, "quantize_blockwise_triton", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    kwargs = {"scheme": scheme, "bits": bits, "double_quant": True, "stochastic": True}
    through_kernel = hq.quantize(x, generator=torch.Generator().manual_seed(3), **kwargs)
    # one call for the nested scales, one for the data
    assert len(calls) == 2
    kernel_out = through_kernel.dequantize()
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", True)
    through_twin = hq.quantize(x, generator=torch.Generator().manual_seed(3), **kwargs)
    kernel_state, twin_state = through_kernel.to_state()[0], through_twin.to_state()[0]
    assert all(torch.equal(kernel_state[k], twin_state[k]) for k in twin_state)
    torch.testing.assert_close(kernel_out, through_twin.dequantize(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("scheme,bits", CONFIGS)
def test_kernel_non_finite_block_gets_nan_scale(scheme, bits):
    x = _randn((3 * 64,), torch.float32)
    x[65], x[130] = math.inf, math.nan
    kwargs = {"scheme": scheme, "bits": bits, "block_size": 64}
    got = kernels.quantize_blockwise_triton(x, **kwargs)
    _assert_same_outputs(got, functional.quantize_blockwise_torch(x, **kwargs))
    assert got[1].isnan().tolist() == [False, True, True]
    out = hq.quantize(x, **kwargs).dequantize().view(3, 64)
    assert bool(torch.isfinite(out[0]).all()) and bool(out[1:].isnan().all())


@pytest.mark.parametrize("scheme,bits", [("symmetric", 8), ("nf4", 4)])
def test_kernel_empty_tensor(scheme, bits):
    kwargs = {"scheme": scheme, "bits": bits, "block_size": 64}
    codes, scales, _ = kernels.quantize_blockwise_triton(torch.empty(0), **kwargs)
    assert codes.numel() == 0 and scales.numel() == 0
    out = kernels.dequantize_blockwise_triton(codes, scales, None, numel=0, dtype=torch.float16, **kwargs)
    assert out.shape == (0,) and out.dtype == torch.float16
    assert hq.quantize(torch.empty(2, 0), double_quant=True, **kwargs).dequantize().shape == (2, 0)


def test_kernel_stochastic_rounding_is_unbiased():
    # Same statistical check as the twin test, through the kernel with its own random draws.
    draws, block_size = 256, 64
    base = _randn((block_size,), torch.float32, seed=4)
    qt = hq.quantize(
        base.repeat(draws),
        scheme="nf4",
        bits=4,
        block_size=block_size,
        stochastic=True,
        generator=torch.Generator().manual_seed(9),
    )
    samples = qt.dequantize().view(draws, -1)
    step = float((hq.NF4_VALUES[1:] - hq.NF4_VALUES[:-1]).max()) * float(qt.scales[0])
    # Standard error <= (step / 2) / sqrt(draws); 6 of them bound a false alarm below 1e-8 a value.
    assert float((samples.mean(dim=0) - base).abs().max()) <= 6 * (step / 2) / math.sqrt(draws)


@pytest.mark.parametrize("stochastic", [False, True])
def test_kernel_asymmetric_block_wider_than_float32_range_equals_twin(stochastic):
    big = torch.finfo(torch.float32).max
    x = torch.cat(
        [torch.linspace(-0.9 * big, 0.9 * big, 64, dtype=torch.float64).to(torch.float32), _randn((64,), torch.float32)]
    )
    randoms = torch.rand(x.numel(), generator=torch.Generator().manual_seed(2)) if stochastic else None
    kwargs = {"scheme": "asymmetric", "bits": 8, "block_size": 64}
    got = kernels.quantize_blockwise_triton(x, randoms=randoms, **kwargs)
    _assert_same_outputs(got, functional.quantize_blockwise_torch(x, randoms=randoms, **kwargs))
    out = kernels.dequantize_blockwise_triton(*got, numel=x.numel(), dtype=torch.float32, **kwargs)
    twin = functional.dequantize_blockwise_torch(*got, numel=x.numel(), dtype=torch.float32, **kwargs)
    torch.testing.assert_close(out, twin, rtol=0, atol=0)
    assert bool(torch.isfinite(out).all())
