"""The `torch.ops.hf_galore` custom ops: schema, fake registrations, dispatch rule.

Oracles: the real op's outputs (the fake registration must give their shapes and dtypes), and
`torch.library.opcheck` (schema, fake, autograd registration and AOT dispatch against real runs).
Each check runs with the Triton kernels (CPU under the interpreter: conftest's `triton_kernels_on_cpu`) and
with the torch twins (`KERNEL_DISPATCH.triton_disabled`), the two implementations an op dispatches to.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import hf_galore_plugin.quant as hq
from hf_galore_plugin.optim.adamw8bit import AdamW8bitHyper, adamw8bit_step
from hf_galore_plugin.utils import KERNEL_DISPATCH

IMPLEMENTATIONS = [
    pytest.param(False, id="triton", marks=pytest.mark.skipif(sys.platform != "linux", reason="platform: Linux")),
    pytest.param(True, id="twin"),
]
BLOCK = 64
# numpy (inside the Triton interpreter) warns on the 0 / 0 of blocks with zero scale, whose result
# tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, monkeypatch):
    if not request.param:
        request.getfixturevalue("triton_kernels_on_cpu")
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", request.param)
    return request.param


def _x(numel=300, dtype=torch.float32, seed=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _quant_cases(scheme_bits=hq.SCHEME_BITS):
    """(op, args) of every custom quantization op for each (scheme, bits): 5 cases, optional arguments
    None and given."""
    ops = torch.ops.hf_galore
    cases = []
    for scheme, bits in scheme_bits:
        x = _x(300, torch.bfloat16)
        cases.append((ops.blockwise_stats.default, (x, scheme, bits, BLOCK)))
        cases.append((ops.quantize_blockwise.default, (x, scheme, bits, BLOCK, None, None, None)))
        randoms = torch.rand(300, generator=torch.Generator().manual_seed(1))
        scales, zero_points = hq.blockwise_stats(x, scheme=scheme, bits=bits, block_size=BLOCK)
        cases.append((ops.quantize_blockwise.default, (x, scheme, bits, BLOCK, randoms, scales, zero_points)))
        codes, scales, zero_points = hq.quantize_blockwise(x, scheme=scheme, bits=bits, block_size=BLOCK)
        for dtype in (torch.float32, torch.float16):
            args = (codes, scales, zero_points, scheme, bits, BLOCK, 300, dtype)
            cases.append((ops.dequantize_blockwise.default, args))
    return cases


HYPER = AdamW8bitHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, block_size=256)


def _step_tensors(numel=300, error_feedback=True):
    """Parameter, gradient and the 4 state tensors (8 with error feedback) of one 8-bit parameter."""
    blocks = -(-numel // 256)
    g = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(numel, generator=g), torch.randn(numel, generator=g),
        torch.randint(-127, 128, (numel,), generator=g, dtype=torch.int8), torch.rand(blocks, generator=g),
        torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8), torch.rand(blocks, generator=g),
    ]  # fmt: skip
    if error_feedback:
        tensors += [torch.zeros(numel, dtype=torch.int8), torch.zeros(blocks)] * 2
    return tensors


def _step_args(numel=300, error_feedback=True):
    """Arguments of `hf_galore::adamw8bit_step` (one list per tensor argument) for one parameter at step 3."""
    tensors = _step_tensors(numel, error_feedback)
    lists = [[t] for t in tensors] + [[]] * (10 - len(tensors))
    return (*lists, [3], *HYPER)


def _meta(outputs):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [(tuple(t.shape), t.dtype) for t in outputs]


@pytest.mark.parametrize("case", range(len(hq.SCHEME_BITS) * 5))
def test_quant_op_fake_matches_real(case, implementation):
    """Under FakeTensorMode each op gives outputs of the shapes and dtypes the real op returns."""
    op, args = _quant_cases()[case]
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    assert _meta(fake) == _meta(real)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_step_op_fake_allocates_nothing(error_feedback, implementation):
    """The 8-bit step under FakeTensorMode returns nothing and keeps every tensor's shape and dtype,
    as the real step does (it works in place)."""
    args = _step_args(error_feedback=error_feedback)
    real_args = [[t.clone() for t in a] if i < 10 else a for i, a in enumerate(args)]
    assert torch.ops.hf_galore.adamw8bit_step(*real_args) is None
    assert not torch.equal(real_args[0][0], args[0][0])  # the real step moved the parameter
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [[mode.from_tensor(t) for t in a] if i < 10 else a for i, a in enumerate(args)]
        assert torch.ops.hf_galore.adamw8bit_step(*fake_args) is None
    for fake, real in zip(fake_args[:10], real_args[:10]):
        assert _meta(tuple(fake)) == _meta(tuple(real))


# opcheck runs each op ~10 times (interpreted kernels are slow): the schemes whose code paths differ
# most (absmax with int8 codes; min/max with zero points; a grid with 4-bit packing).
OPCHECK_SCHEMES = (("symmetric", 8), ("asymmetric", 4), ("nf4", 4))


@pytest.mark.parametrize("case", range(len(OPCHECK_SCHEMES) * 5))
def test_quant_op_opcheck(case, implementation):
    op, args = _quant_cases(OPCHECK_SCHEMES)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_step_op_opcheck(error_feedback, implementation):
    torch.library.opcheck(torch.ops.hf_galore.adamw8bit_step.default, _step_args(error_feedback=error_feedback))


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_entry_points_call_the_ops_or_inline_twins(monkeypatch):
    """The Python entry points call `torch.ops.hf_galore.*`; with `KERNEL_DISPATCH.inline_twins` the twins
    run as plain torch ops (a dispatch mode sees their aten ops) with bit-identical results."""
    x = _x(300)
    state = _step_tensors()
    results = {}
    for inline in (False, True):
        monkeypatch.setattr(KERNEL_DISPATCH, "inline_twins", inline)
        monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", True)
        tensors = [t.clone() for t in state]
        with _OpNames() as mode:
            codes, scales, zero_points = hq.quantize_blockwise(x, scheme="asymmetric", bits=4, block_size=BLOCK)
            out = hq.dequantize_blockwise(
                codes,
                scales,
                zero_points,
                scheme="asymmetric",
                bits=4,
                block_size=BLOCK,
                numel=300,
                dtype=torch.float32,
            )
            adamw8bit_step(tensors[0], tensors[1], tensors[2:], step=3, hyper=HYPER)
        ours = [n for n in mode.names if n.startswith("hf_galore::")]
        if inline:
            assert not ours and "aten::round" in mode.names
        else:
            assert ours == [
                "hf_galore::quantize_blockwise",
                "hf_galore::dequantize_blockwise",
                "hf_galore::adamw8bit_step",
            ]
        results[inline] = [codes, scales, zero_points, out, *tensors]
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)


def test_dispatch_setting_is_read_once_at_import(python_subprocess):
    """HF_GALORE_DISABLE_TRITON and TRITON_INTERPRET are read when `hf_galore_plugin.utils` is imported:
    a later change of the environment does not move an op to the other implementation."""
    result = python_subprocess(
        """
        import os
        import torch
        from hf_galore_plugin.utils import KERNEL_DISPATCH, is_triton_available, use_triton
        x = torch.zeros(4)
        before = (KERNEL_DISPATCH.triton_disabled, KERNEL_DISPATCH.triton_on_cpu, use_triton(x))
        os.environ["HF_GALORE_DISABLE_TRITON"] = "0"
        after = use_triton(x)
        print(before, after, is_triton_available())
        """,
        env={"HF_GALORE_DISABLE_TRITON": "1", "TRITON_INTERPRET": "1"},
    )
    assert result.stdout.split()[-5:] == ["(True,", "True,", "False)", "False", "True"]


def test_step_entry_point_refuses_partial_error_feedback_state():
    """The residual tensors of error feedback come as all four or none: a partial set would make the torch
    step and the kernel disagree about which moments carry a residual."""
    tensors = _step_tensors(error_feedback=True)
    with pytest.raises(ValueError, match=r"state tuples of \[7\] tensors; give 4 .* or 8"):
        adamw8bit_step(tensors[0], tensors[1], tensors[2:9], step=1, hyper=HYPER)
    with pytest.raises(ValueError, match="a state tuple holds None"):
        adamw8bit_step(tensors[0], tensors[1], [*tensors[2:8], None, tensors[9]], step=1, hyper=HYPER)


@pytest.mark.parametrize("storage", ["int8", "nf4"])
def test_quantized_layer_compiles_through_the_ops(storage, implementation):
    """A GaLore layer with a quantized W0, past its calibration step, compiles (inductor) without graph breaks
    and gives the eager output bit for bit: dynamo sees each op through its fake registration and does not
    trace into the Triton launcher (which, traced, fails under the interpreter) or the twin. (A step that
    records a refresh adds a backward hook: one graph break there.)"""
    from torch import nn

    from hf_galore_plugin.api import after_step, prepare_model
    from hf_galore_plugin.config import GaLoreConfig

    torch.manual_seed(0)
    model = prepare_model(nn.Sequential(nn.Linear(64, 96)), GaLoreConfig(rank=4, weight_storage=storage))
    x = torch.randn(4, 64)
    model(x).square().sum().backward()
    after_step(model)  # the first basis: the steps after it are ordinary
    assert not model[0].refresh_due
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, backend="inductor")(x), model(x))
    torch._dynamo.reset()
