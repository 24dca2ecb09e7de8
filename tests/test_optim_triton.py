"""The fused 8-bit AdamW Triton kernel against its torch twin, on CPU via TRITON_INTERPRET=1.

Shapes are small (1..20000 values, block 256, 8 blocks a program: at most 10 programs a launch) because the
interpreter runs ~ms per program.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from hf_galore_plugin.kernels import adamw8bit as kernels  # noqa: E402
from hf_galore_plugin.optim import AdamW  # noqa: E402
from hf_galore_plugin.optim.adamw8bit import AdamW8bitHyper, adamw8bit_step_torch, adamw8bit_step_triton  # noqa: E402
from hf_galore_plugin.utils import KERNEL_DISPATCH  # noqa: E402

BLOCK = 256
HYPER = AdamW8bitHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, block_size=BLOCK)


@pytest.fixture(autouse=True)
def _interpreter_on_cpu():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.fail("run with TRITON_INTERPRET=1 (tests/conftest.py sets it) or on a CUDA machine")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _state(n, error_feedback):
    blocks = -(-n // BLOCK)
    device = _device()
    codes = lambda dtype: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
    scales = lambda: torch.zeros(blocks, device=device)  # noqa: E731
    state = [codes(torch.int8), scales(), codes(torch.uint8), scales()]
    return state + [codes(torch.int8), scales(), codes(torch.int8), scales()] if error_feedback else state


def _run_both(n, *, error_feedback, dtype=torch.float32, steps=3):
    g = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=g).to(dtype).to(_device())
    twin_param, kernel_param = param.clone(), param.clone()
    twin_state, kernel_state = _state(n, error_feedback), _state(n, error_feedback)
    for step in range(1, steps + 1):
        # Gradients spanning ~4 decades inside a block exercise every decade of the code book.
        grad = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(dtype).to(_device())
        adamw8bit_step_torch(twin_param, grad, twin_state, step=step, hyper=HYPER)
        adamw8bit_step_triton(kernel_param, grad, kernel_state, step=step, hyper=HYPER)
    return twin_param, kernel_param, twin_state, kernel_state


@pytest.mark.parametrize("n", [1, 300, 1000, 4097, 20000])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_kernel_matches_twin_fp32(n, error_feedback):
    """Bit-identical parameters, codes and scales: kernel and twin round every fp32 operation alike
    (correctly rounded division and square root, no fused multiply-adds) and find codes with the same
    bucket table. 20000 values: 79 blocks in 10 programs of 8 blocks, the last one partly masked."""
    twin_param, kernel_param, twin_state, kernel_state = _run_both(n, error_feedback=error_feedback)
    assert torch.equal(kernel_param, twin_param)
    for twin, kernel in zip(twin_state, kernel_state, strict=True):
        assert torch.equal(kernel, twin)


def test_kernel_matches_twin_bf16_params():
    # One step: the interpreter's fp32 -> bf16 cast truncates while torch and CUDA round to
    # nearest, so there the written values may differ by one bf16 ulp (<= 2**-7 relative); over
    # several steps the truncation bias compounds (measured: 3 ulps after 3 steps) and would
    # hide real errors. On CUDA both round to nearest; an FMA-contracted fp32 result can still
    # land on the other side of a bf16 rounding boundary, so the same one-ulp bound holds.
    twin_param, kernel_param, _, _ = _run_both(1000, error_feedback=False, dtype=torch.bfloat16, steps=1)
    torch.testing.assert_close(kernel_param.float(), twin_param.float(), rtol=2.0**-7, atol=0.0)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_kernel_empty_launch_is_noop(error_feedback):
    """A zero-element parameter raises nothing and writes nothing: every argument is an empty view at
    the start of a filled buffer, and no byte of those buffers may change (a launch that ignored the
    element count would write into them)."""
    device = _device()
    buffers = [torch.full((2 * BLOCK,), 0.25, device=device), torch.full((2 * BLOCK,), -1.5, device=device)]
    for tensor in _state(2 * BLOCK, error_feedback):
        buffers.append(torch.full_like(tensor, 7 if tensor.dtype in (torch.int8, torch.uint8) else 0.5))
    before = [b.clone() for b in buffers]
    param, grad, *state = [b[:0] for b in buffers]
    adamw8bit_step_triton(param, grad, state, step=1, hyper=HYPER)
    for buffer, original in zip(buffers, before):
        assert torch.equal(buffer, original)


def test_optimizer_dispatches_to_kernel(monkeypatch):
    """AdamW(state_bits=8) through the custom op runs the kernel (3 launches) and equals the same run on
    the twin (KERNEL_DISPATCH.triton_disabled)."""
    launches = []
    launch = kernels.launch_adamw8bit_step
    monkeypatch.setattr(kernels, "launch_adamw8bit_step", lambda *a, **k: launches.append(1) or launch(*a, **k))

    def train(disable_triton):
        monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", disable_triton)
        p = torch.nn.Parameter(torch.randn(20, 250, generator=torch.Generator().manual_seed(0)).to(_device()))
        opt = AdamW([p], lr=1e-2, weight_decay=0.1, state_bits=8, error_feedback=True)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            p.grad = (torch.randn(20, 250, generator=g) * torch.rand(20, 250, generator=g) ** 4).to(_device())
            opt.step()
        return p.detach()

    through_kernel = train(False)
    assert len(launches) == 3
    torch.testing.assert_close(through_kernel, train(True), rtol=1e-6, atol=1e-6)
    assert len(launches) == 3
