"""GaLore checkpoints: a galore_state.pt is bound to its checkpoint (step, settings, merged weights);
settings the saved tensors depend on are refused when they change, the others take effect and are
logged (transformers' layerwise names resume checkpoints of the names they run, and back); unreadable
files are named; rotation never removes the last complete checkpoint; the Trainer's "latest checkpoint"
is the newest complete one; load_best_model_at_end verifies the best checkpoint as a resume does and
says what to do about the best model when it refuses.

Tiny Llama on random token ids, a few Trainer steps on CPU; one training run is shared by the module.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_galore_plugin as hgp

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM, Trainer  # noqa: E402
from conftest import build_tiny_llama  # noqa: E402
from conftest import use_torch_twins  # noqa: E402
from conftest import token_data as shared_token_data  # noqa: E402
from conftest import training_args  # noqa: E402

from hf_galore_plugin.checkpoint.files import GaLoreCheckpointError  # noqa: E402
from hf_galore_plugin.checkpoint.manifest import MANIFEST_NAME, write_manifest  # noqa: E402
from hf_galore_plugin.checkpoint.state import GALORE_STATE_FORMAT, GALORE_STATE_NAME, tensor_checksums  # noqa: E402
from hf_galore_plugin.integrations import saving  # noqa: E402

ARGS = "rank=4,update_proj_gap=2"


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    use_torch_twins(monkeypatch)


# A smaller Llama than the shared one: these tests save and reload many checkpoints.
SMALL_LLAMA = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
    vocab_size=128, max_position_embeddings=32,
)  # fmt: skip


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    return build_tiny_llama(seed=seed, **SMALL_LLAMA)


def token_data(n: int = 32, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    return shared_token_data(n, 8, vocab=128, seed=seed)


def make_trainer(output_dir, *, optim_args=ARGS, seed=0, data_seed=1, **overrides) -> Trainer:
    args = training_args(
        output_dir, **{"optim_args": optim_args, "save_strategy": "steps", "save_steps": 2, **overrides}
    )
    return Trainer(model=tiny_llama(seed), args=args, train_dataset=token_data(seed=data_seed))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One run with checkpoint-2 and checkpoint-4 (each with galore_state.pt)."""
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        use_torch_twins(patch)
        make_trainer(out).train()
    return out


def copy_checkpoint(run_dir, step, to) -> str:
    target = to / f"checkpoint-{step}"
    shutil.copytree(run_dir / f"checkpoint-{step}", target)
    return str(target)


def reseal(folder) -> None:
    """A new manifest for `folder`'s files as they are now: the checks behind the manifest (step, settings,
    counters, merged weights) must stand on their own, e.g. for a folder someone re-sealed."""
    write_manifest(str(folder), global_step=int(str(folder).rpartition("-")[2]))


# ---------------------------------------------------------------------- file format
def test_galore_state_carries_step_settings_and_optimizer(run_dir):
    saved = torch.load(run_dir / "checkpoint-4" / GALORE_STATE_NAME, weights_only=True)
    assert saved["format"] == GALORE_STATE_FORMAT
    assert saved["global_step"] == 4 and saved["optimizer"] == "galore_adamw"
    assert saved["config"] == hgp.GaLoreConfig(rank=4, update_proj_gap=2).to_dict()
    assert any(key.endswith("galore_factor") for key in saved["state"])
    assert saved["checksums"] == tensor_checksums(saved["state"])  # every tensor's, checked on every load
    assert not [name for name in os.listdir(run_dir / "checkpoint-4") if ".tmp" in name]


# ---------------------------------------------------------------------- binding
def test_galore_state_copied_from_another_step_is_refused(run_dir, tmp_path):
    folder = copy_checkpoint(run_dir, 4, tmp_path)
    shutil.copy(run_dir / "checkpoint-2" / GALORE_STATE_NAME, os.path.join(folder, GALORE_STATE_NAME))
    reseal(folder)
    trainer = make_trainer(tmp_path / "resumed", max_steps=6)
    with pytest.raises(GaLoreCheckpointError, match=r"belongs to step 2, but checkpoint .*checkpoint-4 is step 4"):
        trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 0


def test_galore_state_left_by_another_run_is_refused(run_dir, tmp_path):
    # A second run in the same output_dir (other data) wrote checkpoint-4's model and optimizer but died
    # before its galore_state.pt: the first run's file, same step, stays next to the new weights.
    other = tmp_path / "other"
    make_trainer(other, data_seed=7, save_steps=4).train()
    folder = str(other / "checkpoint-4")
    shutil.copy(run_dir / "checkpoint-4" / GALORE_STATE_NAME, os.path.join(folder, GALORE_STATE_NAME))
    reseal(folder)
    trainer = make_trainer(tmp_path / "resumed", max_steps=6)
    with pytest.raises(GaLoreCheckpointError, match=r"checkpoint .*other/checkpoint-4.* disagree.*merged weight"):
        trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("from_step", [2, 4])
def test_galore_state_without_its_format_is_refused_naming_the_fix(run_dir, tmp_path, from_step):
    # A plain dict of tensors carries no step or settings: even checkpoint-4's own tensors in it cannot be
    # verified against the checkpoint, and checkpoint-2's must never load into checkpoint-4.
    folder = copy_checkpoint(run_dir, 4, tmp_path)
    state = torch.load(run_dir / f"checkpoint-{from_step}" / GALORE_STATE_NAME, weights_only=True)["state"]
    torch.save(state, os.path.join(folder, GALORE_STATE_NAME))
    reseal(folder)
    trainer = make_trainer(tmp_path / "resumed", max_steps=6)
    with pytest.raises(GaLoreCheckpointError, match=r"is not a galore_state.pt written by hf_galore_plugin") as info:
        trainer.train(resume_from_checkpoint=folder)
    assert folder in str(info.value) and "from_pretrained" in str(info.value)
    assert trainer.state.global_step == 0


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_new_save_into_an_old_folder_removes_the_stale_manifest_state_and_temporaries(run_dir, tmp_path, monkeypatch):
    # The second run dies inside its model write: the folder must not look complete afterwards, and the
    # temporary a killed writer left there is gone.
    out = tmp_path / "reused"
    stale = os.path.join(copy_checkpoint(run_dir, 2, out), f"{GALORE_STATE_NAME}.tmp-{_dead_pid()}")
    open(stale, "wb").close()
    from transformers import modeling_utils

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the model")

    monkeypatch.setattr(modeling_utils, "safe_save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        make_trainer(out, data_seed=7).train()
    assert not os.path.exists(out / "checkpoint-2" / GALORE_STATE_NAME)
    assert not os.path.exists(out / "checkpoint-2" / MANIFEST_NAME)
    assert not os.path.exists(stale)


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "optim_args, field, saved, now",
    [
        ("rank=4,update_proj_gap=2,scale=0.5", "scale", "'auto'", "0.5"),
        ("rank=8,update_proj_gap=2", "rank", "4", "8"),
        ("rank=4,update_proj_gap=2,proj_type=left", "proj_type", "'std'", "'left'"),
        ("rank=4,update_proj_gap=2,basis_storage=int8", "basis_storage", "'as_computed'", "'int8'"),
    ],
)
def test_changed_fixed_setting_is_refused_before_any_step(run_dir, tmp_path, optim_args, field, saved, now):
    trainer = make_trainer(tmp_path / "resumed", optim_args=optim_args, max_steps=6)
    with pytest.raises(GaLoreCheckpointError, match=rf"{field}: saved {saved}, now {now}") as info:
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-4"))
    assert "checkpoint-4" in str(info.value)
    assert trainer.state.global_step == 0


def test_changed_optimizer_name_is_refused(run_dir, tmp_path):
    trainer = make_trainer(tmp_path / "resumed", optim="galore_adamw_8bit", max_steps=6)
    with pytest.raises(GaLoreCheckpointError, match=r"state_bits: saved 32, now 8"):
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-4"))


@pytest.mark.parametrize(
    "first, then",
    [
        ("galore_adamw", "galore_adamw_layerwise"),
        ("galore_adamw_layerwise", "galore_adamw"),
        ("galore_adafactor_layerwise", "galore_adafactor"),
    ],
)
def test_layerwise_name_resumes_a_checkpoint_of_the_name_it_runs_exactly(tmp_path, first, then):
    # transformers' layerwise names run the plugin's optimizer of the base name (registry.LAYERWISE_ALIASES):
    # the two train bit-identically, so a checkpoint of one resumes under the other. Oracle: the
    # uninterrupted run under the first name.
    full = make_trainer(tmp_path / "full", optim=first)
    full.train()
    resumed = make_trainer(tmp_path / "resumed", optim=then, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    expected, got = full.model.state_dict(), resumed.model.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_changed_update_proj_gap_takes_effect_and_is_logged(run_dir, tmp_path, caplog):
    trainer = make_trainer(tmp_path / "resumed", optim_args="rank=4,update_proj_gap=5", max_steps=4)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-4"))  # loads, runs no step
    assert "update_proj_gap 2 -> 5" in caplog.text
    assert {int(layer.galore_gap) for _, layer in hgp.galore_layers(trainer.model)} == {5}


def test_resume_of_a_run_started_under_the_old_defaults_keeps_them(tmp_path, caplog):
    # A checkpoint written with the paper's refresh, the defaults before the bounded refresh, resumed by a
    # Trainer that names neither setting: neither refused nor switched. Oracle: the uninterrupted run,
    # whose step 4 refreshes every layer with an exact SVD (a sketch or a staggered phase would differ).
    paper = ARGS + ",refresh_schedule=aligned,basis_method=svd"
    uninterrupted = make_trainer(tmp_path / "old", optim_args=paper, max_steps=6)
    uninterrupted.train()
    resumed = make_trainer(tmp_path / "new", optim_args=ARGS, max_steps=6)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "old" / "checkpoint-4"))
    assert "refresh_schedule='aligned', basis_method='svd', the defaults before the bounded refresh" in caplog.text
    config = hgp.state_of(resumed.model).config
    assert (config.refresh_schedule, config.basis_method) == ("aligned", "svd")
    expected = hgp.galore_state_dict(uninterrupted.model)
    for key, value in hgp.galore_state_dict(resumed.model).items():
        assert torch.equal(value, expected[key]), key


def test_plain_api_rank_mismatch_names_the_layer_and_the_setting():
    model = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=4))
    other = hgp.prepare_model(tiny_llama(), hgp.GaLoreConfig(rank=8))
    with pytest.raises(
        RuntimeError,
        match=r"GaLore state of layer 'model.layers.0.self_attn.q_proj' does not fit .*"
        r"galore_factor: saved \(32, 8\), this layer \(32, 4\)",
    ):
        hgp.load_galore_state_dict(model, hgp.galore_state_dict(other))


# ---------------------------------------------------------------------- unreadable files
@pytest.mark.parametrize("damage", ["truncated", "pickled object", "empty"])
def test_unreadable_galore_state_names_file_and_checkpoint(run_dir, tmp_path, damage):
    folder = copy_checkpoint(run_dir, 4, tmp_path)
    path = os.path.join(folder, GALORE_STATE_NAME)
    if damage == "truncated":
        with open(path, "r+b") as handle:
            handle.truncate(os.path.getsize(path) // 2)
    elif damage == "pickled object":
        torch.save({"state": logging.getLogger("x")}, path)
    else:
        open(path, "wb").close()
    reseal(folder)
    trainer = make_trainer(tmp_path / "resumed", max_steps=6)
    with pytest.raises(GaLoreCheckpointError) as info:
        trainer.train(resume_from_checkpoint=folder)
    message = str(info.value)
    assert path in message and f"checkpoint {folder}" in message
    assert "weights_only" not in message and info.value.__cause__ is None and info.value.__suppress_context__


# ---------------------------------------------------------------------- completeness
def test_resume_true_skips_an_incomplete_newest_checkpoint(run_dir, tmp_path, caplog):
    out = tmp_path / "out"
    copy_checkpoint(run_dir, 2, out)
    os.remove(copy_checkpoint(run_dir, 4, out) + "/" + MANIFEST_NAME)
    trainer = make_trainer(out, max_steps=4, save_strategy="no")
    steps = []
    trainer.add_callback(
        type(
            "Steps",
            (transformers.TrainerCallback,),
            {"on_step_end": lambda self, args, state, control, **kw: steps.append(state.global_step)},
        )()
    )
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert steps == [3, 4]  # resumed from checkpoint-2
    assert "skipping incomplete checkpoint(s)" in caplog.text and "checkpoint-4" in caplog.text
    final = make_trainer(tmp_path / "full", save_strategy="no")
    final.train()
    for key, value in final.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[key], value), key


def test_explicit_incomplete_checkpoint_is_refused_naming_the_complete_one(run_dir, tmp_path):
    out = tmp_path / "out"
    complete = copy_checkpoint(run_dir, 2, out)
    incomplete = copy_checkpoint(run_dir, 4, out)
    os.remove(os.path.join(incomplete, MANIFEST_NAME))
    trainer = make_trainer(out, max_steps=6)
    with pytest.raises(
        ValueError, match=rf"{incomplete} is incomplete: it has no {MANIFEST_NAME}.*resume from {complete}"
    ):
        trainer.train(resume_from_checkpoint=incomplete)


def test_rotation_waits_for_the_galore_state(tmp_path, monkeypatch):
    # save_total_limit=1: when galore_state.pt of checkpoint-4 is written, checkpoint-2 must still exist.
    seen = []
    original = saving.save_galore_checkpoint

    def spy(path, *args, **kwargs):
        seen.append(sorted(name for name in os.listdir(os.path.dirname(os.path.dirname(path))) if "checkpoint" in name))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(saving, "save_galore_checkpoint", spy)
    make_trainer(tmp_path, save_total_limit=1).train()
    assert seen == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"]]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]


# ---------------------------------------------------------------------- peft
def _peft_trainer(output_dir, **overrides):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["down_proj"])
    )
    args = training_args(output_dir, **{"optim_args": ARGS, "save_strategy": "steps", "save_steps": 2, **overrides})
    return Trainer(model=model, args=args, train_dataset=token_data(), eval_dataset=token_data(8))


def test_peft_modules_to_save_resume_is_exact(tmp_path):
    full = _peft_trainer(tmp_path / "full")
    full.train()
    resumed = _peft_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    expected, got = full.model.state_dict(), resumed.model.state_dict()
    assert expected.keys() == got.keys() and any("galore_factor" in key for key in got)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_peft_load_best_model_at_end_restores_the_best_checkpoint_exactly(tmp_path):
    trainer = _peft_trainer(
        tmp_path,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
    )  # the worse one: not the last
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-2")
    saved = torch.load(os.path.join(best, GALORE_STATE_NAME), weights_only=True)["state"]
    got = hgp.galore_state_dict(trainer.model)
    assert saved.keys() == got.keys()
    for key in saved:
        torch.testing.assert_close(got[key], saved[key], rtol=0, atol=0, equal_nan=True, msg=key)


# ---------------------------------------------------------------------- load_best_model_at_end
class _DamageBest(transformers.TrainerCallback):
    """Right after checkpoint-2 is complete: damage a basis in its galore_state.pt and delete its manifest,
    rewrite it over the damage, or keep it (then the manifest sees the damage)."""

    def __init__(self, manifest: str):
        self.manifest = manifest
        self.key = ""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        folder = os.path.join(args.output_dir, "checkpoint-2")
        path = os.path.join(folder, GALORE_STATE_NAME)
        payload = torch.load(path, weights_only=True)
        state = payload["state"]
        # a layer that refreshed in step 2: its factor is zero, so the merged weights do not show its basis
        layer = next(
            k.removesuffix(".galore_factor") for k, v in state.items() if k.endswith(".galore_factor") and not v.any()
        )
        self.key = next(key for key in state if key.startswith(f"{layer}.galore_basis_"))
        state[self.key].view(-1)[3] += 1.5e-3
        with open(path, "wb") as handle:
            torch.save(payload, handle)
        if self.manifest == "deleted":
            os.remove(os.path.join(folder, MANIFEST_NAME))
        elif self.manifest == "rewritten":
            reseal(folder)


@pytest.mark.parametrize("manifest", ["deleted", "rewritten", "kept"])
def test_load_best_model_at_end_refuses_a_damaged_best_checkpoint_with_advice_for_the_load(tmp_path, manifest):
    # The best checkpoint is verified as a resume verifies one; its refusal says what to do about the best
    # model (training has finished): nothing about resuming or a new run. greater_is_better: the worse,
    # earlier checkpoint is the best, not the model in memory.
    args = training_args(
        tmp_path, optim_args=ARGS, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
    )  # fmt: skip
    damage = _DamageBest(manifest)
    trainer = Trainer(
        model=tiny_llama(), args=args, train_dataset=token_data(), eval_dataset=token_data(8), callbacks=[damage]
    )
    with pytest.raises(GaLoreCheckpointError) as info:
        trainer.train()
    message = str(info.value)
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "checkpoint-2") and best in message, message
    assert "load_best_model_at_end=False, or pick another checkpoint of this run" in message, message
    assert "resume" not in message.lower() and "new run" not in message, message
    if manifest == "deleted":
        assert f"is incomplete: it has no {MANIFEST_NAME}" in message
    else:  # named by the tensors' own checksums, or by the manifest
        assert f"{os.path.join(best, GALORE_STATE_NAME)} is damaged" in message and f"state.{damage.key}" in message
