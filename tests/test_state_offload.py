"""state_offload='cpu': host-resident optimizer state streamed through the device in chunks.

Oracle: the same optimizer with state_offload='none' (resident state). The update functions are
the same, and chunk boundaries are multiples of the quantization block and of the fused kernel's
64-value unit, so every result must be bit-identical, not close. Chunks are made tiny here
(state_offload_chunk_mb ~ 10 KiB) so every tensor of a few thousand values is cut many times and
the double-buffered path (load i+1 before updating i) is exercised on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import hf_galore_plugin as hgp
from hf_galore_plugin.engines.capabilities import UnsupportedByEngine, check_state_offload
from hf_galore_plugin.integrations.optim_args import parse_optim_args
from hf_galore_plugin.optim import AdamW
from hf_galore_plugin.optim.offload import bytes_per_value, chunk_bounds
from hf_galore_plugin.utils import KERNEL_DISPATCH

from conftest import build_tiny_llama, torch_round_trip
from conftest import use_torch_twins  # noqa: E402

TINY_CHUNK_MB = 10 / 1024  # 10 KiB of state per staging slot: ~1280 fp32-state values per chunk


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    # The 8-bit Triton kernel is tested against its torch twin elsewhere; chunking is independent of
    # which kernel runs.
    use_torch_twins(monkeypatch)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    # awkward sizes: not a multiple of 64 or of the block, a 1-value tensor, a non-contiguous one
    shapes = [(300, 70), (4097,), (64, 33), (1,)]
    params = [torch.nn.Parameter(torch.randn(*shape).to(dtype)) for shape in shapes]
    params.append(torch.nn.Parameter(torch.randn(70, 50).to(dtype).t()))
    return params


def _train(params, optimizer, steps: int = 4, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()


def _optimizer(params, offload: str, **kw) -> AdamW:
    # two groups with different hyperparameters; min_8bit_numel=1000 leaves the small tensors fp32
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]
    options = dict(lr=1e-2, weight_decay=0.1, min_8bit_numel=1000, state_offload=offload)
    return AdamW(groups, **{**options, "state_offload_chunk_mb": TINY_CHUNK_MB, **kw})


def _assert_same_state(a: AdamW, b: AdamW) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for index in sa:
        assert sa[index].keys() == sb[index].keys()
        for key, value in sa[index].items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == sb[index][key].dtype and torch.equal(value, sb[index][key]), (index, key)
            else:
                assert value == sb[index][key]


STATE_CASES = [
    pytest.param({"state_bits": 32}, id="fp32"),
    pytest.param({"state_bits": 8, "block_size": 64}, id="8bit"),
    pytest.param({"state_bits": 8, "block_size": 256, "error_feedback": True}, id="8bit-ef"),
]


@pytest.mark.parametrize("state", STATE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offloaded_step_is_bit_identical_to_resident(state, dtype):
    resident, offloaded = _params(dtype), _params(dtype)
    opt_resident, opt_offloaded = _optimizer(resident, "none", **state), _optimizer(offloaded, "cpu", **state)
    _train(resident, opt_resident)
    _train(offloaded, opt_offloaded)
    for a, b in zip(resident, offloaded):
        assert torch.equal(a, b)
    _assert_same_state(opt_resident, opt_offloaded)
    # The parameters moved (the equality above is about training, not about nothing happening).
    assert not torch.equal(resident[0], _params(dtype)[0])
    # The largest tensor was cut into many chunks, and the staging slots stayed at their bound.
    big_state = opt_offloaded.state[offloaded[0]]
    per_value = bytes_per_value(big_state, big_state.get("block_size"))
    chunk_bytes = int(TINY_CHUNK_MB * 2**20)
    assert len(chunk_bounds(offloaded[0].numel(), per_value, chunk_bytes, 256)) >= 5
    assert 0 < opt_offloaded.staging_nbytes() <= 2 * chunk_bytes
    steps = 4 * len(offloaded)  # a 0-d fp32 "step" per parameter stays outside host_state_nbytes
    assert opt_offloaded.host_state_nbytes() == opt_resident.state_nbytes() - steps
    assert opt_resident.host_state_nbytes() == 0


def test_fused_cpu_path_is_taken_chunk_by_chunk(monkeypatch):
    # fp32 CPU tensors step in torch's fused kernel when resident; offloaded chunks must use it too,
    # or the results would differ by rounding. Count the fused calls: one per chunk.
    calls = []
    original = torch._fused_adamw_

    def counting(params, *args, **kwargs):
        calls.append(len(params))
        return original(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = AdamW([param], lr=1e-2, state_offload="cpu", state_offload_chunk_mb=TINY_CHUNK_MB)
    param.grad = torch.randn(5000)
    optimizer.step()
    assert len(calls) == len(chunk_bounds(5000, 8.0, int(TINY_CHUNK_MB * 2**20), 64)) > 1


@pytest.mark.parametrize("state", STATE_CASES)
@pytest.mark.parametrize("saved_offloaded", [True, False], ids=["offload->resident", "resident->offload"])
def test_checkpoint_loads_across_offload_settings(state, saved_offloaded):
    """A state_dict written with offload loads without it and vice versa: same tensors, and two
    more steps equal an uninterrupted run."""
    first, second = ("cpu", "none") if saved_offloaded else ("none", "cpu")
    uninterrupted = _params(torch.float32)
    opt_uninterrupted = _optimizer(uninterrupted, "none", **state)
    _train(uninterrupted, opt_uninterrupted, steps=3)
    _train(uninterrupted, opt_uninterrupted, steps=2, seed=7)

    params = _params(torch.float32)
    optimizer = _optimizer(params, first, **state)
    _train(params, optimizer, steps=3)
    saved = torch_round_trip(optimizer.state_dict())
    if not saved_offloaded:  # as a checkpoint written before state_offload existed: no such group key
        for group in saved["param_groups"]:
            del group["state_offload"]
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = _optimizer(resumed_params, second, **state)
    resumed.load_state_dict(saved)
    _assert_same_state(optimizer, resumed)
    _train(resumed_params, resumed, steps=2, seed=7)
    for a, b in zip(uninterrupted, resumed_params):
        assert torch.equal(a, b)
    assert (resumed.host_state_nbytes() > 0) == (second == "cpu")


def _galore_run(offload: str, moment_handling: str, state_bits: int):
    model = build_tiny_llama(seed=0)
    config = hgp.GaLoreConfig(
        rank=8, update_proj_gap=2, moment_handling=moment_handling, state_bits=state_bits, state_offload=offload
    )
    model = hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-3, weight_decay=0.01)
    optimizer._chunk_bytes = int(TINY_CHUNK_MB * 2**20)  # many chunks for the embeddings and head
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    refreshed = 0
    for _ in range(5):  # refreshes at steps 0 (calibration), 2 and 4
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        refreshed += len(hgp.after_step(model, optimizer)["refreshed"])
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, refreshed


@pytest.mark.parametrize("moment_handling", ["keep", "project", "reset"])
@pytest.mark.parametrize("state_bits", [32, 8])
def test_galore_refresh_with_offloaded_state_matches_resident(moment_handling, state_bits):
    """create_optimizer with GaLoreConfig.state_offload: factors, embeddings and head; refreshes
    transform (project) or reset the offloaded moments exactly as the resident ones."""
    resident_model, resident, refreshed = _galore_run("none", moment_handling, state_bits)
    offloaded_model, offloaded, refreshed_offloaded = _galore_run("cpu", moment_handling, state_bits)
    assert refreshed == refreshed_offloaded > 0
    assert offloaded.host_state_nbytes() > 0
    for (name, a), b in zip(resident_model.state_dict().items(), offloaded_model.state_dict().values()):
        assert torch.equal(a, b), name
    _assert_same_state(resident, offloaded)


def test_state_offload_values_are_validated():
    with pytest.raises(ValueError, match=r"state_offload='gpu'.*\['none', 'cpu'\]"):
        hgp.GaLoreConfig(state_offload="gpu")
    with pytest.raises(ValueError, match=r"state_offload='disk'.*\['none', 'cpu'\]"):
        AdamW([torch.nn.Parameter(torch.zeros(3))], state_offload="disk")
    with pytest.raises(ValueError, match=r"state_offload_chunk_mb=0"):
        AdamW([torch.nn.Parameter(torch.zeros(3))], state_offload="cpu", state_offload_chunk_mb=0)
    assert parse_optim_args("rank=8,state_offload=cpu")["state_offload"] == "cpu"
    assert hgp.GaLoreConfig().state_offload == "none"


@pytest.mark.parametrize("engine", ["fsdp2", "zero1", "zero2", "zero3"])
def test_engines_that_own_their_state_refuse_offload_with_their_own_fix(engine):
    check_state_offload(engine, state_offload="none")
    fix = "CPUOffloadPolicy" if engine == "fsdp2" else "offload_optimizer"
    with pytest.raises(UnsupportedByEngine, match=rf"state_offload='cpu' is not supported under .*{fix}"):
        check_state_offload(engine, state_offload="cpu")
    for engine_ok in ("single", "ddp"):
        check_state_offload(engine_ok, state_offload="cpu")


def test_dtensor_parameters_are_refused_at_construction():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        with pytest.raises(UnsupportedByEngine, match="FSDP2.*CPUOffloadPolicy"):
            AdamW([param], state_offload="cpu")
        AdamW([param], state_offload="none")
    finally:
        if own_group:
            dist.destroy_process_group()


def test_trainer_resume_with_offloaded_state_is_exact(tmp_path):
    """optim_args '...,state_offload=cpu' through the Trainer: an interrupted run resumed from its
    checkpoint equals the uninterrupted one, and both equal the resident-state run."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 256, (32, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def run(output_dir, optim_args, resume=None):
        args = TrainingArguments(
            output_dir=str(output_dir), optim="qgalore_adamw_8bit", optim_args=optim_args,
            max_steps=6, save_strategy="steps", save_steps=3, per_device_train_batch_size=4,
            learning_rate=1e-3, report_to=[], use_cpu=True, seed=0, data_seed=0, logging_steps=1,
            dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=build_tiny_llama(seed=0), args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    offload_args = "rank=8,update_proj_gap=2,state_offload=cpu"
    full = run(tmp_path / "full", offload_args)
    resumed = run(tmp_path / "resumed", offload_args, resume=str(tmp_path / "full" / "checkpoint-3"))
    resident = run(tmp_path / "resident", "rank=8,update_proj_gap=2")
    for trainer, offloaded in ((full, True), (resumed, True), (resident, False)):
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
        assert (inner.host_state_nbytes() > 0) == offloaded
    for other in (resumed, resident):
        for (key, a), b in zip(full.model.state_dict().items(), other.model.state_dict().values()):
            assert torch.equal(a, b), key


@pytest.mark.parametrize("method", ["galore_adamw", "qgalore_adamw_8bit"])
def test_planner_counts_offloaded_state_as_host_memory(method):
    """--optim-args state_offload=cpu: the device peak drops by the state bytes less the staging
    slots, and the traced host bytes equal what the real optimizer keeps on the host."""
    pytest.importorskip("transformers")
    from hf_galore_plugin.plan.trace import Settings, trace_method

    config = build_tiny_llama(seed=0).config

    def trace(optim_args):
        settings = Settings(seq_len=16, batch_size=2, dtype=torch.float32, gradient_checkpointing=True,
                            device="cuda", rank=8, lora_rank=8, optim_args=optim_args)  # fmt: skip
        return trace_method(config, method, settings)

    resident, offloaded = trace({}), trace({"state_offload": "cpu"})
    # the layout oracle: the real optimizer on the real model, after one step
    model = hgp.prepare_model(build_tiny_llama(seed=0), hgp.GaLoreConfig.preset(method, rank=8, state_offload="cpu"))
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    host = optimizer.host_state_nbytes()
    assert offloaded.host_state_bytes == host > 0 and resident.host_state_bytes == 0
    staging = optimizer.staging_nbytes()
    assert 0 < staging < host
    for which in ("normal", "refresh"):
        before, after = getattr(resident, which), getattr(offloaded, which)
        assert after.peak_bytes < before.peak_bytes
        # the moments move to the host; only the 0-d fp32 step counters (host scalars for every
        # parameter, counted as device bytes by the resident trace as well) stay in this part
        assert after.parts["optimizer_state"] <= 4 * len(optimizer.state) < before.parts["optimizer_state"]

    def phase_peak(trace, step, phase):
        return max(peak.peak_bytes for name, _, peak in trace.steps[step] if name == phase)

    # Outside the optimizer step the device holds exactly the state bytes less (step 2: every state
    # exists; the calibration at step 0 resets the factors' state, recreated by step 1's update);
    # inside it, the two staging slots (freed after the step) are among the step's temporaries.
    for phase in ("forward", "backward"):
        assert phase_peak(resident, 2, phase) - phase_peak(offloaded, 2, phase) == host, phase
    for step in (1, 2):
        optimizer_phase = max((p for name, _, p in offloaded.steps[step] if name == "optimizer"),
                              key=lambda p: p.peak_bytes)  # fmt: skip
        assert optimizer_phase.parts["other"] >= staging


@pytest.mark.distributed
@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_ddp_two_ranks_with_offloaded_state_match_single_process(tmp_path, preset):
    """The 2-rank gloo DDP harness (tests/distributed) with state_offload=cpu against the resident
    single-process oracle, under the harness's own tolerance for cross-rank summation order."""
    from distributed._launch import assert_matches, int8_folds, run_two_ranks, single_process_run

    out = tmp_path / "ddp.pt"
    result = run_two_ranks(out, ENGINE="ddp", PRESET=preset, PROJ_TYPE="std", BASIS_METHOD="svd", STATE_OFFLOAD="cpu")
    assert result.returncode == 0, result.stderr[-4000:]
    single = single_process_run(preset, "std")
    assert_matches(single, torch.load(out, weights_only=True), int8_folds=int8_folds(preset, single))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="platform: needs CUDA (side-stream copies, pinned memory)")
@pytest.mark.parametrize("state", STATE_CASES)
def test_cuda_offloaded_step_and_transform_match_resident(state, monkeypatch):
    """On CUDA: pinned host state, copies on a side stream, and transform_state staging the state on
    the device; bit-identical to resident state on the same device."""
    monkeypatch.delenv("HF_GALORE_DISABLE_TRITON")  # the Triton kernel, as users get it on a GPU
    monkeypatch.setattr(KERNEL_DISPATCH, "triton_disabled", False)
    resident = [torch.nn.Parameter(p.detach().cuda()) for p in _params(torch.float32)]
    offloaded = [torch.nn.Parameter(p.detach().cuda()) for p in _params(torch.float32)]
    opt_resident, opt_offloaded = _optimizer(resident, "none", **state), _optimizer(offloaded, "cpu", **state)
    _train(resident, opt_resident)
    _train(offloaded, opt_offloaded)
    state_tensors = [
        v for s in opt_offloaded.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)
    ]
    assert state_tensors and all(v.device.type == "cpu" and v.is_pinned() for v in state_tensors)
    basis = torch.linalg.qr(torch.randn(70, 70, device="cuda"))[0]
    for opt, params in ((opt_resident, resident), (opt_offloaded, offloaded)):
        opt.transform_state(params[0], lambda m, v: (m @ basis, (v @ basis.abs()).clamp_min(0)))
    _train(resident, opt_resident, steps=2, seed=5)
    _train(offloaded, opt_offloaded, steps=2, seed=5)
    for a, b in zip(resident, offloaded):
        assert torch.equal(a, b)
    _assert_same_state(opt_resident, opt_offloaded)


def test_planner_cli_reports_host_bytes_and_refuses_sharding_engines(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json

    from hf_galore_plugin.plan.__main__ import main

    config = tmp_path / "config.json"
    config.write_text(build_tiny_llama(seed=0).config.to_json_string())
    common = ["--config", str(config), "--methods", "galore_adamw", "--seq-len", "16", "--rank", "8", "--json"]
    assert main(common + ["--optim-args", "state_offload=cpu"]) == 0
    entry = json.loads(capsys.readouterr().out)["methods"]["galore_adamw"]
    assert entry["host_state_bytes"] > 0 and sum(entry["parts"].values()) == entry["peak_bytes"]
    argv = common + ["--optim-args", "state_offload=cpu", "--world-size", "2", "--engine", "zero3"]
    assert main(argv) == 2
    assert "offload_optimizer" in capsys.readouterr().err


def test_optimizer_and_config_accept_the_same_offload_values():
    from hf_galore_plugin import config
    from hf_galore_plugin.optim import offload

    assert offload.STATE_OFFLOAD == config.STATE_OFFLOAD
