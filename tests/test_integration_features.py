"""Trainer features with the plugin's optimizers: gradient checkpointing, bf16/fp16 mixed precision,
torch.compile, evaluation + load_best_model_at_end, gradient clipping with a warmup schedule, fp16
models (SVD upcast), DeepSpeed configs with an ``optimizer`` block, QLoRA-style 4-bit peft models.

Oracles: the same run in fp32 eager (exact for checkpointing, 1e-4 for compile, a bf16 tolerance
for bf16), the model state recorded at the best step, the schedule transformers computes for
``adamw_torch``, and an fp32 SVD of the recorded gradient.
"""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest
import torch
from torch import nn

import hf_galore_plugin as hgp

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_galore_plugin.integrations.callback import GaLoreCallback  # noqa: E402
from conftest import RANK_ARGS, build_tiny_llama, logged_losses, token_data, training_args  # noqa: E402
from conftest import free_port, use_torch_twins  # noqa: E402

losses = logged_losses


def tiny_llama(seed: int = 0):
    return build_tiny_llama(seed=seed)


# update_proj_gap=3 (conftest.RANK_ARGS); the default staggered schedule packs the tiny Llama's 14 layers
# (sketches and kept inputs at the first forward's 4 x 16 tokens) into 3 phases, which calibrate at steps 0-2
# and refresh at 3-5: every layer refreshes twice.
STEPS = 6


@pytest.fixture(autouse=True)
def _torch_twins_and_clean_environment(monkeypatch):
    use_torch_twins(monkeypatch)  # see test_integration_trainer.py
    # TrainingArguments writes accelerate's settings into os.environ (ACCELERATE_DYNAMO_BACKEND for
    # torch_compile, ACCELERATE_USE_DEEPSPEED): later Trainers would inherit them
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def refresh_counts(model: nn.Module) -> list[int]:
    return [int(layer.galore_num_refreshes) for _, layer in hgp.galore_layers(model)]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """The reference: galore_adamw in fp32 eager, STEPS steps."""
    with pytest.MonkeyPatch.context() as patch:
        use_torch_twins(patch)
        model = tiny_llama()
        trainer = Trainer(
            model=model,
            args=training_args(tmp_path_factory.mktemp("fp32"), max_steps=STEPS),
            train_dataset=token_data(),
        )
        trainer.train()
    assert refresh_counts(model) == [2] * len(refresh_counts(model))
    return {"losses": losses(trainer), "refreshes": refresh_counts(model)}


def run(tmp_path, model=None, callbacks=(), eval_dataset=None, **overrides) -> Trainer:
    model = model if model is not None else tiny_llama()
    overrides.setdefault("max_steps", STEPS)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, **overrides),
        train_dataset=token_data(),
        eval_dataset=eval_dataset,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


# ---------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_gives_the_same_losses(tmp_path, fp32_run):
    model = tiny_llama()
    trainer = run(tmp_path, model=model, activation_checkpointing=True)
    assert model.model.gradient_checkpointing  # the Trainer really switched it on
    # recomputing the forward changes nothing in fp32: same losses, refreshes recorded once per step
    assert losses(trainer) == pytest.approx(fp32_run["losses"], abs=1e-5)
    assert refresh_counts(model) == fp32_run["refreshes"]


# ---------------------------------------------------------------------- mixed precision
class _RecordGaLoreOutputDtype(TrainerCallback):
    def __init__(self):
        self.dtypes: set[torch.dtype] = set()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for _, layer in hgp.galore_layers(model):
            layer.register_forward_hook(lambda module, inputs, output: self.dtypes.add(output.dtype))


def test_bf16_mixed_precision_tracks_fp32(tmp_path, fp32_run):
    recorder = _RecordGaLoreOutputDtype()
    model = tiny_llama()
    trainer = run(tmp_path, model=model, callbacks=[recorder], bf16=True)
    assert recorder.dtypes == {torch.bfloat16}  # autocast reached the GaLore layers
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # fp32 master weights, factors, W0
    bf16_losses = losses(trainer)
    assert bf16_losses != fp32_run["losses"]  # it really computed in bf16
    # bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per op, averaging out over the
    # 4x16 tokens of a loss): measured within 1.1e-4 of fp32 (2e-5 relative) at every step.
    assert bf16_losses == pytest.approx(fp32_run["losses"], rel=1e-3)
    assert refresh_counts(model) == fp32_run["refreshes"]


def test_fp16_trainer_on_cpu_trains_without_autocast_like_fp32(tmp_path, fp32_run):
    # accelerate enables fp16 autocast and the GradScaler only on accelerators ("cuda", "xpu", ...):
    # with use_cpu=True, fp16=True trains in fp32 (Accelerator.native_amp stays False), so the run
    # must give the fp32 run's losses bit for bit. The fp16 path of our layer is tested directly under
    # torch.autocast below.
    args = training_args(tmp_path, fp16=True, max_steps=STEPS)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_data())
    assert trainer.accelerator.mixed_precision == "fp16"
    assert trainer.accelerator.native_amp is False and trainer.accelerator.scaler is None
    trainer.train()
    assert losses(trainer) == fp32_run["losses"]
    assert refresh_counts(trainer.model) == fp32_run["refreshes"]


def test_fp16_autocast_with_grad_scaler_tracks_fp32():
    torch.manual_seed(0)
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(1))

    def train(autocast: bool, steps: int) -> tuple[list[float], nn.Module, torch.amp.GradScaler]:
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 48))
        model = hgp.prepare_model(dense, hgp.GaLoreConfig(rank=4, update_proj_gap=2))
        optimizer = hgp.create_optimizer(model, lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", enabled=autocast)
        seen = []
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            hgp.after_step(model, optimizer)
            optimizer.zero_grad()
            seen.append(loss.item())
        return seen, model, scaler

    fp32_losses, _, _ = train(autocast=False, steps=4)
    fp16_losses, model, scaler = train(autocast=True, steps=5)
    assert min(refresh_counts(model)) == 3  # steps 0, 2, 4
    # fp16 keeps 11 significant bits (rounding 2^-12 = 2.4e-4 relative per op): the first steps agree within
    # 3e-4. Later steps are not compared: Adam's first updates are +-lr for every entry whatever its size,
    # so an entry of dB within fp16 rounding of zero (|g| ~ 1e-7 here) takes either sign and one such flip
    # moves the loss by ~1e-2 (seen on some seeds with every formulation of the step). What fp16 must
    # keep is the gradient: from the same weights, the unscaled factor gradients of an autocast step
    # equal fp32's within fp16 rounding (a few units of 2^-11 of the gradient's norm).
    assert fp16_losses[:4] == pytest.approx(fp32_losses[:4], rel=3e-4)

    layers = [layer for _, layer in hgp.galore_layers(model)]
    grads = {}
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = model(x).float().square().mean()
        (scaler.scale(loss) if autocast else loss).backward()
        grads[autocast] = [
            layer.galore_factor.grad.clone() / (scaler.get_scale() if autocast else 1.0) for layer in layers
        ]
        model.zero_grad()
    for exact, half in zip(grads[False], grads[True]):
        # measured 1.0 and 1.4 units of 2^-11 at a power-of-two scale, 2.1 at scale='auto' here (sqrt(12): the
        # stored basis carries it, one more fp16 rounding of every basis entry); bases read in bf16 instead of
        # fp16 gave 2.3 units at a power-of-two scale
        assert float((half - exact).norm() / exact.norm()) < 3 * 2.0**-11


def test_callback_skips_steps_the_optimizer_skipped():
    # An fp16 GradScaler overflow makes accelerate's optimizer wrapper report step_was_skipped:
    # that step moved nothing, so it must not count towards the refresh schedule.
    model = hgp.prepare_model(nn.Sequential(nn.Linear(32, 32)), hgp.GaLoreConfig(rank=4, update_proj_gap=2))
    optimizer = hgp.create_optimizer(model, lr=1e-2)
    model(torch.full((4, 32), float("inf"))).sum().backward()  # an overflowed step, recorded for the basis
    layer = hgp.galore_layers(model)[0][1]
    assert layer._pending_grad is not None
    optimizer.step_was_skipped = True
    callback = GaLoreCallback()
    state = transformers.TrainerState()
    callback.on_step_end(None, state, None, model=model, optimizer=optimizer)
    assert layer.counter("galore_step") == 0
    assert layer._pending_grad is None  # its inf gradient does not reach the next basis


# ---------------------------------------------------------------------- torch.compile
def test_torch_compile_trainer_matches_eager(tmp_path):
    # torch_compile=True with the default inductor backend works here too (measured: same losses
    # to 2e-6) but compiles for ~60 s on 2 CPU cores; the "eager" backend runs the same Dynamo
    # capture (graph breaks, guards, recompiles at refresh steps) without code generation.
    # Inductor itself is tested on a small model below.
    # A budget of two phases (calibration at steps 0-1, refreshes at 3-4): steps 2 and 5 are ordinary ones.
    optim_args = f"{RANK_ARGS},refresh_budget_mb=0.2"
    eager_model = tiny_llama()
    eager = run(tmp_path / "eager", model=eager_model, optim_args=optim_args)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_llama()
    trainer = run(tmp_path, model=model, torch_compile=True, torch_compile_backend="eager", optim_args=optim_args)
    counters = torch._dynamo.utils.counters
    # Compiled from the first step: one graph for the record steps (calibration, refreshes), one for the
    # others, no breaks (tests/test_compile.py has the plain-loop cases).
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["graph_break"])
    assert losses(trainer) == pytest.approx(losses(eager), abs=1e-4)
    assert refresh_counts(model) == refresh_counts(eager_model) == [2] * len(refresh_counts(model))


def test_torch_compile_inductor_matches_eager():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))

    def train(compile_it: bool) -> list[float]:
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
        model = hgp.prepare_model(dense, hgp.GaLoreConfig(rank=4, update_proj_gap=2))
        forward = torch.compile(model, backend="inductor") if compile_it else model
        optimizer = hgp.create_optimizer(model, lr=1e-2)
        seen = []
        for _ in range(4):  # refreshes at steps 0 and 2: the compiled backward records the gradient
            loss = forward(x).square().mean()
            loss.backward()
            optimizer.step()
            hgp.after_step(model, optimizer)
            optimizer.zero_grad()
            seen.append(loss.item())
        assert refresh_counts(model) == [2, 2]
        return seen

    assert train(compile_it=True) == pytest.approx(train(compile_it=False), abs=1e-4)


# ---------------------------------------------------------------------- evaluation, best model
class _PickBestAndRecord(TrainerCallback):
    """Makes checkpoint `best_step` the best by a metric, and records the model state at each save."""

    def __init__(self, best_step: int):
        self.best_step = best_step
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_pick"] = 0.0 if state.global_step == self.best_step else 1.0

    def on_save(self, args, state, control, model=None, **kwargs):
        self.saved[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_eval_during_training_and_load_best_model_restores_galore_state(tmp_path):
    picker = _PickBestAndRecord(best_step=2)
    model = tiny_llama()
    trainer = run(
        tmp_path,
        model=model,
        callbacks=[picker],
        eval_dataset=token_data(8),
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="pick",
        greater_is_better=False,
    )
    evaluated = [entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert evaluated == [2, 4, 6]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert sorted(picker.saved) == [2, 4, 6]
    # the model now holds exactly the state of step 2: W0, factor, basis, counters — not the
    # merged weight of the checkpoint's model.safetensors copied into W0
    restored = model.state_dict()
    assert restored.keys() == picker.saved[2].keys()
    for key, value in picker.saved[2].items():  # NaN: the similarity of a first basis
        torch.testing.assert_close(restored[key], value, rtol=0, atol=0, equal_nan=True, msg=key)
    assert any(not torch.equal(picker.saved[2][k], picker.saved[6][k]) for k in restored)
    assert {layer.counter("galore_step") for _, layer in hgp.galore_layers(model)} == {2}


# ---------------------------------------------------------------------- clipping, warmup schedule
class _RecordStep(TrainerCallback):
    """Inside optimizer.step(): the total gradient norm (after clipping) and the groups' lr."""

    def __init__(self):
        self.norms: list[float] = []
        self.lrs: list[tuple[float, float]] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        def record(opt, *_):
            grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            galore = {g["lr"] for g in opt.param_groups if g.get("galore")}
            plain = {g["lr"] for g in opt.param_groups if not g.get("galore")}
            self.lrs.append((galore.pop(), plain.pop()))

        optimizer.optimizer.register_step_pre_hook(record)  # runs after the callback's lr scaling


def test_gradient_clipping_and_cosine_schedule_with_warmup(tmp_path):
    recorder = _RecordStep()
    max_norm = 0.05
    trainer = run(
        tmp_path,
        callbacks=[recorder],
        max_steps=6,
        max_grad_norm=max_norm,
        lr_scheduler_type="cosine",
        warmup_steps=2,
    )
    logged_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    # the Trainer clips what the optimizer steps on: the factors' (projected) gradients and the
    # plain parameters'. The logged norm is before clipping.
    assert min(logged_norms) > max_norm
    assert recorder.norms == pytest.approx([max_norm] * 6, rel=1e-4)
    # oracle: transformers' cosine schedule with 2 warmup steps over 6, as adamw_torch sees it
    probe = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = transformers.get_cosine_schedule_with_warmup(probe, num_warmup_steps=2, num_training_steps=6)
    expected = []
    for _ in range(6):
        expected.append(probe.param_groups[0]["lr"])
        probe.step()
        schedule.step()
    assert [plain for _, plain in recorder.lrs] == pytest.approx(expected, rel=1e-12)
    assert [galore for galore, _ in recorder.lrs] == pytest.approx([0.85 * lr for lr in expected], rel=1e-12)


# ---------------------------------------------------------------------- fp16 models: the SVD upcast
@pytest.mark.parametrize("basis_method", ["svd", "sketch"])
def test_fp16_model_refresh_computes_the_basis_in_fp32(tmp_path, monkeypatch, basis_method):
    # "fp16 SVD" is not an error for this plugin: the layer records the refresh gradient (or its sketch)
    # in fp32 and compute_basis / basis_from_sketch always decompose in fp32 (torch has no half-precision
    # SVD on several backends, and fp16's 11 bits would make the singular vectors inaccurate); the basis
    # is then stored in the model's dtype. So an fp16 model trains; nothing to reject.
    layers_module = importlib.import_module("hf_galore_plugin.layers.refresh")
    name = "compute_basis" if basis_method == "svd" else "basis_from_sketch"
    real = getattr(layers_module, name)
    calls = []

    def spy(record, **kwargs):
        basis = real(record, **kwargs)
        calls.append((record.clone(), kwargs, basis))
        return basis

    monkeypatch.setattr(layers_module, name, spy)
    model = tiny_llama().to(torch.float16)
    # svd: the paper's refresh (every layer at steps 0 and 3); sketch: the defaults (two phases, as above)
    refresh = ",refresh_schedule=aligned,basis_method=svd" if basis_method == "svd" else ""
    trainer = run(tmp_path, model=model, max_steps=STEPS, optim_args=RANK_ARGS + refresh)
    assert all(math.isfinite(loss) for loss in losses(trainer).values())
    assert len(calls) == 2 * len(hgp.galore_layers(model))  # every layer calibrates and refreshes once
    if basis_method == "sketch":
        for sketch, kwargs, basis in calls:
            assert sketch.dtype == torch.float32 and basis.dtype == torch.float32
            torch.testing.assert_close(basis.mT @ basis, torch.eye(kwargs["rank"]), rtol=0, atol=1e-5)
    for grad, kwargs, basis in calls if basis_method == "svd" else ():
        assert grad.dtype == torch.float32 and basis.dtype == torch.float32
        identity = torch.eye(basis.shape[1])
        torch.testing.assert_close(basis.mT @ basis, identity, rtol=0, atol=1e-5)  # orthonormal in fp32
        # the same subspace as an fp32 SVD of that gradient (up to signs of the singular vectors)
        matrix = grad if kwargs["side"] == "left" else grad.mT
        reference = torch.linalg.svd(matrix, full_matrices=False).U[:, : kwargs["rank"]]
        torch.testing.assert_close((reference.mT @ basis).abs(), identity, rtol=0, atol=1e-3)
    for _, layer in hgp.galore_layers(model):
        assert layer.weight.dtype == torch.float16 and layer.galore_factor.dtype == torch.float16
        stored = layer.basis("right") if layer.right_rank is not None else layer.basis("left")
        assert stored.dtype == torch.float16
        # stored in fp16: orthonormal to fp16 rounding (2^-11 relative per entry, summed over 64)
        torch.testing.assert_close(stored.float().mT @ stored.float(), torch.eye(stored.shape[1]), rtol=0, atol=2e-3)


# ---------------------------------------------------------------------- DeepSpeed optimizer block
@pytest.fixture
def deepspeed_single_process(monkeypatch):
    pytest.importorskip("deepspeed")
    for key, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        monkeypatch.setenv(key, value)
    # the gloo shm-comm op would be compiled with g++ on first init (~50 s); nothing here needs it
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # TrainingArguments(deepspeed=...) set up accelerate's singletons and a process group: undo
    # both so later tests get a plain single-process CPU state
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
}


@pytest.mark.parametrize("as_file", [False, True], ids=["dict", "json_path"])
def test_deepspeed_optimizer_block_fails_before_training(tmp_path, deepspeed_single_process, as_file):
    config = {**DEEPSPEED_CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    if as_file:
        (tmp_path / "ds.json").write_text(json.dumps(config))
        config = str(tmp_path / "ds.json")
    args = training_args(tmp_path, deepspeed=config)
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"'optimizer' block \('AdamW'\).*Remove the 'optimizer' block"):
        Trainer(model=model, args=args, train_dataset=token_data())
    assert not hgp.galore_layers(model)  # raised before touching the model

    # without the block the same config is accepted: layers are replaced, the scheduler stays
    del args.hf_deepspeed_config.config["optimizer"]
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_data())
    assert hgp.galore_layers(trainer.model)


# ---------------------------------------------------------------------- QLoRA-style model
def test_qlora_4bit_base_is_left_alone(tmp_path):
    peft = pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    tiny_llama().save_pretrained(str(tmp_path / "base"))
    # QLoRA: a frozen NF4 base (bitsandbytes' CPU backend), down_proj and lm_head kept in fp32
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        llm_int8_skip_modules=["down_proj", "lm_head"],
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "base"), quantization_config=quantization, device_map="cpu"
    )
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["down_proj"])
    )
    quantized = {
        name: (module.weight.detach().clone(), module.weight.quant_state.absmax.clone())
        for name, module in model.named_modules()
        if isinstance(module, bnb.nn.Linear4bit)
    }
    assert len(quantized) == 2 * 6  # q, k, v, o, gate, up in each of the 2 layers
    layer = base.model.layers[0]
    lora_before = layer.self_attn.q_proj.lora_B["default"].weight.detach().clone()

    trainer = run(tmp_path / "out", model=model, max_steps=3)

    # the frozen 4-bit layers: same class, same codes and scales
    for name, module in model.named_modules():
        if name in quantized:
            assert type(module) is bnb.nn.Linear4bit, name
            assert torch.equal(module.weight, quantized[name][0]), name
            assert torch.equal(module.weight.quant_state.absmax, quantized[name][1]), name
    assert sum(isinstance(module, bnb.nn.Linear4bit) for module in model.modules()) == len(quantized)
    # LoRA adapters: plain AdamW groups, trained; modules_to_save (unfrozen nn.Linear): GaLore
    galore_names = [name for name, _ in hgp.galore_layers(model)]
    assert galore_names and all("down_proj.modules_to_save" in name for name in galore_names)
    optimizer = trainer.optimizer.optimizer
    lora_b = layer.self_attn.q_proj.lora_B["default"].weight
    assert any(lora_b is p for g in optimizer.param_groups if not g.get("galore") for p in g["params"])
    assert not torch.equal(lora_b, lora_before)
    assert min(refresh_counts(model)) >= 1
