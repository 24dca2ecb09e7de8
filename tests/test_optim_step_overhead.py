"""The host work of an ordinary optimizer step: no tensor value read to the host, for every state format;
the host copy of the step counts that makes this possible follows every write it can see; and a group's
fp32 tensors step in one fused call whatever their sizes.

A read of a device tensor's value (`.item()`, `nonzero`, ...) is a device sync that stalls the host; a
step count read per parameter would be dozens per step. Syncs and ops are counted with the benchmarks'
dispatch mode (`benchmarks/step_overhead.py`, `OpCount`), which counts every such read whatever the
device, so the CPU run checks what a GPU run would do.
"""

from __future__ import annotations

import copy
import pathlib
import sys

import pytest
import torch

import hf_galore_plugin as hgp
from hf_galore_plugin.optim import AdamW
from hf_galore_plugin.utils import KERNEL_DISPATCH

from conftest import build_tiny_llama

# Appended: benchmarks/distributed.py must not shadow the tests' own `distributed` package.
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from step_overhead import OpCount  # noqa: E402

# A 30k vocabulary at hidden 128: embeddings and LM head of 3.8M values each; at rank 32 every factor
# (128 x 32 = 4096 values or more) reaches the 8-bit threshold while norms keep fp32 state, so the
# 8-bit runs step both kinds in one group.
LARGE_VOCAB = dict(vocab_size=30000, hidden_size=128, intermediate_size=344, num_hidden_layers=2)
RANK = 32

STATE_FORMATS = {
    "fp32": ("galore_adamw", {}),
    "8bit": ("galore_adamw_8bit", {}),
    "8bit_error_feedback": ("galore_adamw_8bit", {"error_feedback": True}),
    "qgalore_8bit": ("qgalore_adamw_8bit", {}),
    "fp32_offloaded": ("galore_adamw", {"state_offload": "cpu"}),
    "8bit_error_feedback_offloaded": ("galore_adamw_8bit", {"error_feedback": True, "state_offload": "cpu"}),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("state_format", list(STATE_FORMATS))
def test_ordinary_optimizer_step_makes_no_device_sync(state_format):
    preset, overrides = STATE_FORMATS[state_format]
    model = build_tiny_llama(**LARGE_VOCAB)
    # aligned: every layer calibrates on the first step, so the third step is an ordinary one for all of
    # them and the step counts below are exact (the default staggered schedule calibrates phase by phase)
    config = hgp.GaLoreConfig.preset(preset, rank=RANK, update_proj_gap=10**6, refresh_schedule="aligned", **overrides)
    hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    tokens = torch.randint(0, LARGE_VOCAB["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        model(input_ids=tokens, labels=tokens).loss.backward()

    for _ in range(2):  # the calibration step (first basis, state created), then an ordinary one
        forward_backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    forward_backward()
    with OpCount() as counted:
        optimizer.step()
    # The run covers the format it is named for.
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    # Three steps; the calibration refresh after the first reset the factors' state.
    steps = {id(p): 2 if group.get("galore") else 3 for group in optimizer.param_groups for p in group["params"]}
    eight_bit = [s for s in states if "block_size" in s]
    if "8bit" in state_format:
        assert len(eight_bit) == 16  # embeddings, LM head and the 7 factors of each layer (>= 4096 values each)
        assert all(("exp_avg_residual_codes" in s) == ("error_feedback" in state_format) for s in eight_bit)
    else:
        assert not eight_bit
    assert all(g["state_offload"] == ("cpu" if "offloaded" in state_format else "none") for g in optimizer.param_groups)
    assert all(int(optimizer.state[p]["step"]) == steps[id(p)] for p in model.parameters() if p.requires_grad)
    assert counted.syncs == 0, dict(counted.names)


def _params_and_grads(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 96), (40,), (5000,)]  # the last one takes 8-bit state at state_bits=8
    starts = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    return starts, grads


def _step(params, optimizer, grads):
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    optimizer.step()


@pytest.mark.parametrize("path", ["fp32_fused", "fp32_single_tensor", "8bit"])
def test_state_zeroed_in_place_steps_like_a_fresh_state(path, monkeypatch):
    # DeepSpeed's adapter resets a ZeRO partition's state by zeroing its tensors in place, step count
    # included: the next step must be a first step (bias correction at step 1), exactly as a fresh
    # optimizer's first step from the same weights. A host copy that missed the write would use step 4
    # (the fused kernel reads the tensor itself; the other paths take the count from the host).
    if path == "fp32_single_tensor":
        monkeypatch.setattr(KERNEL_DISPATCH, "fused_adamw", False)
    state_bits = 8 if path == "8bit" else 32
    starts, grads = _params_and_grads()
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=state_bits)
    for step_grads in grads[:3]:
        _step(params, optimizer, step_grads)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh_optimizer = AdamW(fresh, lr=1e-2, weight_decay=0.1, state_bits=state_bits)
    _step(params, optimizer, grads[3])
    _step(fresh, fresh_optimizer, grads[3])
    for a, b in zip(params, fresh):
        assert torch.equal(a, b)
        assert int(optimizer.state[a]["step"]) == 1


def test_step_count_written_through_data_is_seen_after_reload_step_counts():
    # `.data` writes bypass the version counter (DeepSpeed's elastic ZeRO restore copies saved state that
    # way): after `reload_step_counts` the optimizer steps as one whose counts were always those values.
    starts, grads = _params_and_grads()
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = AdamW(params, lr=1e-2, state_bits=8)
    reference = [torch.nn.Parameter(s.clone()) for s in starts]
    reference_optimizer = AdamW(reference, lr=1e-2, state_bits=8)
    for step_grads in grads[:2]:
        _step(params, optimizer, step_grads)
        _step(reference, reference_optimizer, step_grads)
    _step(reference, reference_optimizer, grads[2])
    # Bring the first optimizer's state to the reference's, its step counts written through `.data`.
    reference_state = reference_optimizer.state_dict()["state"]
    for i, p in enumerate(params):
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor):
                value.data.copy_(reference_state[i][key])
        p.data.copy_(reference[i].detach())
    optimizer.reload_step_counts()
    _step(params, optimizer, grads[3])
    _step(reference, reference_optimizer, grads[3])
    for a, b in zip(params, reference):
        assert torch.equal(a, b)


def test_deep_copied_optimizer_steps_like_the_original():
    # torch copies an optimizer through its state only (defaults, state, groups): the copy rebuilds what
    # it keeps besides (the step counts' host copy, the offload staging) and steps exactly as the original.
    starts, grads = _params_and_grads()
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = AdamW(params, lr=1e-2, state_bits=8, state_offload="cpu")
    for step_grads in grads[:2]:
        _step(params, optimizer, step_grads)
    clone = copy.deepcopy(optimizer)
    clone_params = [p for group in clone.param_groups for p in group["params"]]
    _step(params, optimizer, grads[2])
    _step(clone_params, clone, grads[2])
    for a, b in zip(params, clone_params):
        assert torch.equal(a, b)
        assert int(clone.state[b]["step"]) == 3


def test_fp32_group_steps_in_one_fused_call_bit_identical_to_one_tensor_each():
    # A group of fp32 tensors of many sizes, most not a multiple of 64 values, at two step counts (every
    # other one reset midway) steps in one fused call with a few ops per step count and none per tensor,
    # and each tensor exactly as when it is the only tensor of its optimizer (each value goes through the
    # kernel's vector loop either way; see adamw._FUSED_ALIGN).
    shapes = [(7, 9), (64,), (130,), (1,), (33, 65), (4096,), (63,), (5, 7, 3), (200, 3)]
    g = torch.Generator().manual_seed(0)
    starts = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    grouped = [torch.nn.Parameter(t.clone()) for t in starts]
    alone = [torch.nn.Parameter(t.clone()) for t in starts]
    grouped_optimizer = AdamW(grouped, **hyper)
    alone_optimizers = [AdamW([p], **hyper) for p in alone]
    for step, step_grads in enumerate(grads):
        if step == 3:
            for p, q, optimizer in zip(grouped[::2], alone[::2], alone_optimizers[::2]):
                grouped_optimizer.reset_state(p)
                optimizer.reset_state(q)
        for p, grad in zip(grouped, step_grads):
            p.grad = grad.clone()
        with OpCount() as counted:
            grouped_optimizer.step()
        for q, grad, optimizer in zip(alone, step_grads, alone_optimizers):
            _step([q], optimizer, [grad])
        assert counted.names["_fused_adamw_"] == 1
        if step not in (0, 3):  # steps that create no state
            # The step counts' increment, the kernel and the profiler's two marks; per step count with
            # tails: a zero pad, 4 concatenations, 3 write-backs.
            assert counted.work == 4 + 8 * (2 if step > 3 else 1), dict(counted.names)
    for p, q, optimizer in zip(grouped, alone, alone_optimizers):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(grouped_optimizer.state[p][key], optimizer.state[q][key])
    assert sorted(int(grouped_optimizer.state[p]["step"]) for p in grouped) == [3] * 5 + [6] * 4


def _multi_step_args(error_feedback: bool):
    """Arguments of `hf_galore::adamw8bit_step` for three parameters (one value, a partial block,
    several blocks) at different step counts."""
    g = torch.Generator().manual_seed(2)
    sizes, block_size = [1, 300, 1024], 256
    columns: list[list[torch.Tensor]] = [[] for _ in range(10)]
    for n in sizes:
        blocks = -(-n // block_size)
        tensors = [
            torch.randn(n, generator=g), torch.randn(n, generator=g),
            torch.randint(-127, 128, (n,), generator=g, dtype=torch.int8), torch.rand(blocks, generator=g),
            torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8), torch.rand(blocks, generator=g),
        ]  # fmt: skip
        if error_feedback:
            tensors += [torch.zeros(n, dtype=torch.int8), torch.zeros(blocks)] * 2
        for column, tensor in zip(columns, tensors):
            column.append(tensor)
    return (*columns, [3, 1, 7], 1e-2, 0.9, 0.999, 1e-8, 0.1, block_size)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_multi_step_op_passes_opcheck_and_bumps_the_version_of_what_it_writes(error_feedback):
    # The op is declared with torch.library.Library (custom_op's per-call Python costs more than the C++
    # step of a small group): torch's own checks of schema, fake registration and traced dispatch, and
    # the version counters autograd relies on to refuse a tensor modified after it was saved.
    op = torch.ops.hf_galore.adamw8bit_step.default
    torch.library.opcheck(op, _multi_step_args(error_feedback))
    args = _multi_step_args(error_feedback)
    tensors = args[:10]
    before = [[t._version for t in column] for column in tensors]
    op(*args)
    for i, (column, versions) in enumerate(zip(tensors, before)):
        written = i != 1  # the gradients are only read
        assert all((t._version > v) == written for t, v in zip(column, versions)), i


def test_multi_step_refuses_non_contiguous_state():
    # The op takes tensors of any shape without viewing them 1-D (a view per tensor per step costs more
    # than a small parameter's C++ step), so the kernels read them as flat memory: a transposed code
    # tensor would be read in the wrong order, and is refused instead.
    from hf_galore_plugin.optim.adamw8bit import AdamW8bitHyper, adamw8bit_step_multi

    param, grad = torch.zeros(16, 32), torch.zeros(16, 32)
    codes = torch.zeros(32, 16, dtype=torch.int8).t()
    state = (codes, torch.zeros(2), torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(2))
    hyper = AdamW8bitHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, block_size=256)
    with pytest.raises(ValueError, match="every state tensor must be contiguous"):
        adamw8bit_step_multi([param], [grad], [state], steps=[1], hyper=hyper)
