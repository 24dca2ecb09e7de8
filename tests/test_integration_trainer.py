"""Trainer flow with the plugin's optimizer names: layer replacement, optimizer settings, lr scale,
logging, exact resume, merged saves that load without the plugin, peft, bad configurations.

Tiny Llama (hidden 64, 2 layers) on random token ids; every test trains a few steps on CPU.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import hf_galore_plugin as hgp

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM, Trainer, TrainerCallback  # noqa: E402

from hf_galore_plugin.checkpoint.state import GALORE_STATE_NAME  # noqa: E402
from hf_galore_plugin.integrations.callback import GaLoreCallback  # noqa: E402
from conftest import RANK_ARGS, build_tiny_llama, logged_losses, run_python, token_data, training_args  # noqa: E402
from conftest import use_torch_twins  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    # The Triton kernels are tested against their torch twins elsewhere; the integration runs the twins,
    # also on a CUDA machine.
    use_torch_twins(monkeypatch)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    return build_tiny_llama(seed=seed)


losses = logged_losses


# ---------------------------------------------------------------------- flow and settings
def test_trainer_replaces_layers_and_builds_optimizer_from_training_args(tmp_path):
    model = tiny_llama()
    args = training_args(
        tmp_path,
        optim="qgalore_adamw_8bit",
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.05,
        max_steps=3,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_data())
    # replaced at construction, before any wrapping; the callback is attached first
    assert isinstance(model.model.layers[0].mlp.down_proj, hgp.GaLoreLinear)
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, hgp.GaLoreLinear)
    assert isinstance(trainer.callback_handler.callbacks[0], GaLoreCallback)
    assert hgp.state_of(model).config == hgp.GaLoreConfig.preset("qgalore_adamw_8bit", rank=8, update_proj_gap=3)
    trainer.train()

    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, hgp.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = set(trainer.get_decay_parameter_names(model))
    for group in optimizer.param_groups:
        assert group["betas"] == (0.8, 0.95) and group["lr"] == trainer.lr_scheduler.get_last_lr()[0]
        scale = dict(hgp.galore_layers(model))[group["galore_layers"][0]].scale if group.get("galore") else 1.0
        assert group["eps"] == pytest.approx(1e-7 * scale)  # eps x the scale of the group's layers
        for p in group["params"]:  # the Trainer's own decay / no-decay split
            assert (group["weight_decay"] == 0.05) == (names[id(p)] in decay)
        assert group.get("galore", False) == all(names[id(p)].endswith("galore_factor") for p in group["params"])
    logged = trainer.state.log_history[0]
    for key in ("galore/lr_multiplier", "galore/refreshed_layers", "galore/gap_mean", "galore/bytes_optimizer_state"):
        assert key in logged, logged


class _RecordLR(TrainerCallback):
    """Records, inside optimizer.step(), the lr of the GaLore groups and of the plain groups."""

    def __init__(self):
        self.seen: list[tuple[float, float]] = []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = optimizer.optimizer

        def record(opt, *_):
            galore = {g["lr"] for g in opt.param_groups if g.get("galore")}
            plain = {g["lr"] for g in opt.param_groups if not g.get("galore")}
            assert len(galore) == len(plain) == 1
            self.seen.append((galore.pop(), plain.pop()))

        inner.register_step_pre_hook(record)  # after the callback's scaling hook


@pytest.mark.parametrize("recovery, multipliers", [(0.0, [0.85] * 4), (0.5, [0.85, 0.925, 1.0, 1.0])])
def test_lr_scale_with_linear_schedule(tmp_path, recovery, multipliers):
    recorder = _RecordLR()
    args = training_args(
        tmp_path,
        optim_args=f"{RANK_ARGS},lr_recovery_fraction={recovery}",
        lr_scheduler_type="linear",
        warmup_steps=1,
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_data(), callbacks=[recorder])
    trainer.train()
    # oracle: the linear schedule with 1 warmup step over 4 steps, as adamw_torch would see it
    schedule = [0.0, 1e-3, 1e-3 * 2 / 3, 1e-3 / 3]
    assert [plain for _, plain in recorder.seen] == pytest.approx(schedule, abs=0)
    assert [galore for galore, _ in recorder.seen] == pytest.approx(
        [lr * m for lr, m in zip(schedule, multipliers)], rel=1e-12
    )
    # the scheduler and the checkpointed optimizer state keep the user's lr
    inner = trainer.optimizer.optimizer
    assert {g["lr"] for g in inner.param_groups} == {trainer.lr_scheduler.get_last_lr()[0]}


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    refreshes = []
    for accumulation, batch in ((1, 4), (2, 2)):
        model = tiny_llama()
        args = training_args(
            tmp_path / str(accumulation),
            gradient_accumulation_steps=accumulation,
            per_device_train_batch_size=batch,
            max_steps=7,
        )
        Trainer(model=model, args=args, train_dataset=token_data()).train()
        refreshes.append([int(layer.galore_num_refreshes) for _, layer in hgp.galore_layers(model)])
    assert refreshes[0] == refreshes[1] and min(refreshes[0]) >= 2


def test_explicit_callback_with_own_optimizer(tmp_path):
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=8, update_proj_gap=2, lr_scale=0.5))
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    args = training_args(tmp_path, optim="adamw_torch", optim_args=None, max_steps=4)
    trainer = Trainer(
        model=model, args=args, train_dataset=token_data(), callbacks=[GaLoreCallback()], optimizers=(optimizer, None)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert all(int(layer.galore_num_refreshes) >= 2 for _, layer in hgp.galore_layers(model))
    assert trainer.state.log_history[0]["galore/lr_multiplier"] == 0.5
    # the callback applies lr_scale: after_step does not warn that it is not applied
    assert not [w for w in caught if "GaLoreCallback in a Trainer run" in str(w.message)]


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("optim", ["galore_adamw", "qgalore_adamw_8bit", "galore_adafactor"])
def test_resume_from_checkpoint_is_bit_exact(tmp_path, optim):
    def run(output_dir, resume=None):
        args = training_args(output_dir, optim=optim, max_steps=8, save_strategy="steps", save_steps=4)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_data())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-4"
    state = torch.load(checkpoint / GALORE_STATE_NAME, weights_only=True)["state"]
    assert any(key.endswith("galore_factor") for key in state)
    resumed = run(tmp_path / "resumed", resume=str(checkpoint))

    full_losses, resumed_losses = losses(full), losses(resumed)
    # steps 1-4 come back from the checkpoint's trainer_state.json, 5-8 are computed again
    assert sorted(resumed_losses) == list(range(1, 9)) and resumed_losses == full_losses
    full_state, resumed_state = full.model.state_dict(), resumed.model.state_dict()
    assert full_state.keys() == resumed_state.keys()
    for key in full_state:
        assert torch.equal(full_state[key], resumed_state[key]), key
    refreshes = [int(layer.galore_num_refreshes) for _, layer in hgp.galore_layers(resumed.model)]
    assert min(refreshes) >= 2  # the resumed half crossed a refresh (gap 3)


def test_save_model_is_merged_and_loads_without_the_plugin(tmp_path):
    model = tiny_llama()
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=4), train_dataset=token_data())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    model.save_pretrained(str(tmp_path / "direct"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(hgp.__file__)))
    code = f"""
        import importlib.util, os, sys
        # the plugin is installed editable: drop its path entries and its editable finder
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != {repo_root!r}]
        sys.meta_path[:] = [f for f in sys.meta_path if "hf_galore_plugin" not in repr(f) + repr(type(f))]
        sys.path_importer_cache.clear()
        assert importlib.util.find_spec("hf_galore_plugin") is None, "plugin still importable"
        import torch
        from transformers import AutoModelForCausalLM
        from safetensors.torch import load_file
        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        for folder in ("final", "direct"):
            path = {str(tmp_path)!r} + "/" + folder
            keys = load_file(path + "/model.safetensors").keys()
            assert not any("galore" in k for k in keys), sorted(keys)
            model = AutoModelForCausalLM.from_pretrained(path)
            assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
            assert model.dtype == torch.float32
            with torch.no_grad():
                logits = model(input_ids=expected["ids"]).logits
            torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
        assert "hf_galore_plugin" not in sys.modules
        print("ok")
    """
    result = run_python(code, cwd=tmp_path, env={"PYTHONPATH": ""})
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


# ---------------------------------------------------------------------- bad configurations
class _NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.head = nn.Conv1d(16, 256, 1)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


@pytest.mark.parametrize(
    "make_model, overrides, pattern",
    [
        (_NoLinear, {}, r"no nn.Linear layer"),
        (tiny_llama, {"optim_target_modules": ["qkv_fused"]}, r"matched no trainable nn.Linear"),
        (tiny_llama, {"optim_args": "rank=128"}, r"rank 128|rank=128|Lower `rank`"),
    ],
)
def test_bad_configurations_fail_at_construction(tmp_path, make_model, overrides, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        Trainer(model=make_model(), args=training_args(tmp_path, **overrides), train_dataset=token_data())
    assert "galore_adamw" in str(info.value)


# ---------------------------------------------------------------------- peft
def test_peft_lora_layers_stay_plain_modules_to_save_use_galore(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["down_proj"])
    )
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=3), train_dataset=token_data())
    layer = base.model.layers[0]
    assert isinstance(layer.mlp.down_proj.modules_to_save["default"], hgp.GaLoreLinear)
    assert type(layer.mlp.down_proj.original_module) is nn.Linear  # frozen copy untouched
    assert type(layer.self_attn.q_proj.lora_A["default"]) is nn.Linear
    assert type(layer.self_attn.q_proj.base_layer) is nn.Linear
    lora_before = layer.self_attn.q_proj.lora_B["default"].weight.detach().clone()
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    lora_b = layer.self_attn.q_proj.lora_B["default"].weight
    assert any(lora_b is p for g in optimizer.param_groups if not g.get("galore") for p in g["params"])
    assert not torch.equal(lora_b, lora_before)
    trainer.save_model(str(tmp_path / "adapter"))
    saved = peft.utils.load_peft_weights(str(tmp_path / "adapter"))
    assert not any("galore" in key for key in saved)
    merged = hgp.merged_state_dict(model)
    down_keys = [key for key in saved if "down_proj" in key]
    assert len(down_keys) == 2  # one merged weight per layer, no galore_* keys
    for key in down_keys:
        torch.testing.assert_close(
            saved[key], merged[key.replace(".weight", ".modules_to_save.default.weight")], rtol=0, atol=0
        )
    assert isinstance(layer.mlp.down_proj.modules_to_save["default"], hgp.GaLoreLinear)  # put back after saving
