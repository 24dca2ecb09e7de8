"""Faults a checkpoint must survive or refuse, never resume silently wrong.

1. SIGKILL a GaLore Trainer run at every instant that matters (between steps, inside every file write of
   a checkpoint, between galore_state.pt and the manifest, before and inside rotation, with
   save_total_limit=1), then ``train(resume_from_checkpoint=True)`` from whatever the output_dir holds.
   Every resume must end with final tensors bit-identical to an uninterrupted run, or be refused before
   any step with a message naming the complete checkpoint to use (or saying that none exists). The table
   in docs/guides/checkpoints.md "What survives a crash" is this test's. The kill points and the worker are in
   tests/_fault_worker.py (one interpreter, forked runs).
2. Damage every file of a complete checkpoint (a flipped byte, a truncation, the file of another step),
   its counters, a basis right after its refresh and an expert stack (behind a re-sealed manifest), and
   fill the disk during every save (a small tmpfs): each is refused naming the file, or fails with one
   "no space left on device" error leaving the previous checkpoint intact. These run in process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import build_tiny_llama, token_data, training_args, use_torch_twins  # noqa: E402
from transformers import Trainer  # noqa: E402

import hf_galore_plugin as hgp  # noqa: E402
from hf_galore_plugin.checkpoint.files import GaLoreCheckpointError  # noqa: E402
from hf_galore_plugin.checkpoint.manifest import (  # noqa: E402
    MANIFEST_NAME,
    CheckpointIntegrityError,
    checkpoint_files,
    write_manifest,
)
from hf_galore_plugin.checkpoint.state import GALORE_STATE_NAME, tensor_checksums  # noqa: E402
from hf_galore_plugin.layers import assign_refresh_phases  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_worker.py")


@pytest.mark.slow
def test_sigkill_anywhere_resumes_exactly_or_is_refused(tmp_path):
    repo = os.path.dirname(os.path.dirname(WORKER))
    env = {
        **os.environ,
        "HF_GALORE_DISABLE_TRITON": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, WORKER, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with open(tmp_path / "rows.json") as handle:
        rows = json.load(handle)["rows"]
    assert len(rows) >= 14
    table = "\n".join(f"{r['point']}: held {r['held']} -> {r['outcome']} {r.get('message', '')[:160]}" for r in rows)
    for row in rows:
        assert row["killed"], f"the kill at {row['point']!r} did not happen\n{table}"
        assert not row["temporaries"], f"{row['point']}: left {row['temporaries']}\n{table}"
        complete = [entry for entry in row["held"] if not entry.endswith("(incomplete)")]
        if row["outcome"] == "refused":
            if complete:
                assert any(entry in row["message"] for entry in complete), table
            else:
                assert "no complete GaLore checkpoint" in row["message"], table
        else:
            assert row["outcome"] == "exact", table
            newest = max(int(entry.split("-")[1]) for entry in complete)
            assert row["resumed_steps"] == list(range(newest + 1, 7)), table  # resumed from the newest complete
    # the crash points inside a save all fell back to the previous complete checkpoint and resumed
    assert sum(row["outcome"] == "exact" for row in rows) >= 12, table


# ---------------------------------------------------------------------- damaged checkpoints (in process)
# Every file of a checkpoint is damaged in turn (a flipped byte, a truncation, the same file of another
# step) and a resume must be refused naming that file, before any step: no damaged checkpoint may resume.
SMALL_LLAMA = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
    vocab_size=128, max_position_embeddings=32,
)  # fmt: skip
OPTIM_ARGS = "rank=4,update_proj_gap=3"  # refreshes at steps 0 and 3: checkpoint-4 holds a moved factor


def _trainer(output_dir, **overrides) -> Trainer:
    args = training_args(
        output_dir, **{"optim_args": OPTIM_ARGS, "save_strategy": "steps", "save_steps": 2, **overrides}
    )
    return Trainer(model=build_tiny_llama(seed=0, **SMALL_LLAMA), args=args, train_dataset=token_data(32, 8, vocab=128))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """checkpoint-2 and checkpoint-4 of one run."""
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        use_torch_twins(patch)
        _trainer(out).train()
    return out


@pytest.fixture(scope="module")
def resumer(run_dir, tmp_path_factory):
    """One Trainer for every refused resume: a refusal happens before anything is loaded or stepped."""
    with pytest.MonkeyPatch.context() as patch:
        use_torch_twins(patch)
        yield _trainer(tmp_path_factory.mktemp("resumer"), max_steps=6)


def _flip(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


def _refused(trainer: Trainer, folder: str) -> str:
    with pytest.raises(GaLoreCheckpointError) as info:
        trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 0
    return str(info.value)


def _files(run_dir) -> list[str]:
    return checkpoint_files(str(run_dir / "checkpoint-4"))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "swapped from checkpoint-2"])
def test_corruption_matrix_every_damaged_file_is_refused_naming_it(run_dir, resumer, tmp_path, damage):
    files = _files(run_dir)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", GALORE_STATE_NAME} <= set(files)
    silent = []
    for name in [*files, MANIFEST_NAME]:
        folder = tmp_path / name.replace("/", "_") / "checkpoint-4"
        shutil.copytree(run_dir / "checkpoint-4", folder)
        path = str(folder / name)
        if damage == "flipped byte":
            _flip(path, os.path.getsize(path) // 2)
        elif damage == "truncated":
            os.truncate(path, os.path.getsize(path) - 1)
        else:
            shutil.copy(run_dir / "checkpoint-2" / name, path)
            if open(path, "rb").read() == open(run_dir / "checkpoint-4" / name, "rb").read():
                continue  # the same bytes at both steps (config.json, training_args.bin): nothing damaged
        try:
            message = _refused(resumer, str(folder))
        except BaseException as exc:  # noqa: BLE001 - collect every case, then fail once with the list
            silent.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        named = "its manifest" if name == MANIFEST_NAME else path
        if named not in message and not (name == MANIFEST_NAME and "manifest" in message):
            silent.append(f"{name}: refused without naming it: {message[:300]}")
    assert not silent, "\n".join(silent)


def test_damaged_model_tensor_is_named_and_galore_state_not_blamed(run_dir, resumer, tmp_path):
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", folder)
    path = str(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    with open(path, "rb") as handle:
        header_end = 8 + int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_end - 8))
    _flip(path, header_end + header[name]["data_offsets"][0] + 3, bit=6)  # an exponent bit of the first value
    message = _refused(resumer, str(folder))
    assert f"{path} is damaged" in message and f"tensor {name}" in message
    assert GALORE_STATE_NAME not in message


def test_flipped_exponent_bit_of_a_basis_is_refused_naming_the_tensor(run_dir, resumer, tmp_path):
    # Right after a refresh the factor is zero, so the merged weights cannot show a damaged basis:
    # only the checksum can. The flip is done through torch (a rewritten file, every other byte the same).
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", folder)
    path = str(folder / GALORE_STATE_NAME)
    payload = torch.load(path, weights_only=True)
    key = next(key for key in payload["state"] if key.endswith("galore_basis_right"))
    payload["state"][key].view(-1).view(torch.int32)[5] ^= 1 << 29
    with open(path, "wb") as handle:  # as the plugin writes it (torch names the archive after a path)
        torch.save(payload, handle)
    message = _refused(resumer, str(folder))
    assert f"{path} is damaged" in message and f"state.{key}" in message


@pytest.mark.parametrize(
    "counter, value, pattern",
    [
        ("galore_step", 0, r"galore_step differs between layers"),
        ("galore_step", 5, r"galore_step=5 \(the checkpoint is step 4"),
        ("galore_gap", 1000, r"galore_gap=1000 \(update_proj_gap=3\)"),
        ("galore_last_refresh", 4, r"galore_last_refresh=4 \(must be -1 or a step before galore_step=4\)"),
    ],
)
def test_counters_out_of_schedule_are_refused_even_with_a_matching_manifest(
    run_dir, resumer, tmp_path, counter, value, pattern
):
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", folder)
    path = str(folder / GALORE_STATE_NAME)
    payload = torch.load(path, weights_only=True)
    key = next(key for key in payload["state"] if key.endswith(f"self_attn.q_proj.{counter}"))
    payload["state"][key].fill_(value)
    with open(path, "wb") as handle:  # as the plugin writes it (torch names the archive after a path)
        torch.save(payload, handle)
    write_manifest(str(folder), global_step=4)  # re-sealed: the checks behind the manifest must stand alone
    message = _refused(resumer, str(folder))
    assert re.search(pattern, message), message
    assert "self_attn.q_proj" in message


def _rewrite(path: str, payload: dict) -> None:
    with open(path, "wb") as handle:  # as the plugin writes it (torch names the archive after a path)
        torch.save(payload, handle)


@pytest.mark.parametrize("damage", ["1.5e-3 added", "lowest mantissa bit flipped"])
def test_damaged_basis_right_after_its_refresh_is_refused_behind_a_rewritten_manifest(
    run_dir, resumer, tmp_path, damage
):
    # checkpoint-4: the phase-0 layers refreshed at step 3, so their factor is zero and the merged weight
    # W0 + scale * 0 Q^T, which the model file holds, does not depend on their basis: with the manifest
    # rewritten over the damage, only the tensors' own checksums in galore_state.pt can see it.
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", folder)
    path = str(folder / GALORE_STATE_NAME)
    payload = torch.load(path, weights_only=True)
    state = payload["state"]
    layer = next(
        k.removesuffix(".galore_factor") for k, v in state.items() if k.endswith(".galore_factor") and not v.any()
    )
    assert state[f"{layer}.galore_last_refresh"] == 3  # refreshed in the checkpoint's last step
    key = next(k for k in state if k.startswith(f"{layer}.galore_basis_"))
    if damage == "1.5e-3 added":
        state[key].view(-1)[5] += 1.5e-3
    else:
        state[key].view(-1).view(torch.int32)[5] ^= 1
    _rewrite(path, payload)
    write_manifest(str(folder), global_step=4)  # re-sealed: the checks behind the manifest must stand alone
    message = _refused(resumer, str(folder))
    assert f"{path} is damaged" in message and f"state.{key}" in message, message


# A tiny Qwen3-MoE (tests/test_experts.py builds the same family): its experts are GaLore expert stacks,
# whose merged 3-D weights transformers writes as one tensor per expert and projection.
def _moe_trainer(output_dir, **overrides) -> Trainer:
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    args = training_args(
        output_dir,
        **{
            "optim_args": "rank=4,update_proj_gap=3,experts=true,expert_rank=2",
            "save_strategy": "steps",
            "save_steps": 4,
            **overrides,
        },
    )
    return Trainer(model=model, args=args, train_dataset=token_data(32, 8, vocab=128))


@pytest.fixture(scope="module")
def moe_run_dir(tmp_path_factory):
    """checkpoint-4 of an MoE run."""
    out = tmp_path_factory.mktemp("moe_run")
    with pytest.MonkeyPatch.context() as patch:
        use_torch_twins(patch)
        trainer = _moe_trainer(out)
        assert any(key.endswith("experts.gate_up_proj.galore_factor") for key in hgp.galore_state_dict(trainer.model))
        trainer.train()
    return out


STACK = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    "damage", ["expert factor", "expert factor, checksums rewritten too", "merged expert weight in the model file"]
)
def test_damaged_expert_stack_is_refused_behind_a_rewritten_manifest(moe_run_dir, tmp_path, damage):
    # 3.5e-3 added to one value; the manifest is rewritten over the damage. The checksums see a changed
    # factor; the merged-weight check (expert stacks included) sees a factor whose file was rewritten whole,
    # and a damaged merged weight in the model file (the model file has no checksums of its own).
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(moe_run_dir / "checkpoint-4", folder)
    if damage == "merged expert weight in the model file":
        from safetensors.torch import load_file, save_file

        path = str(folder / "model.safetensors")
        weights = load_file(path)
        weights["model.layers.0.mlp.experts.1.gate_proj.weight"][0, 0] += 3.5e-3  # transformers' layout
        save_file(weights, path, metadata={"format": "pt"})
    else:
        path = str(folder / GALORE_STATE_NAME)
        payload = torch.load(path, weights_only=True)
        payload["state"][f"{STACK}.galore_factor"][1].view(-1)[0] += 3.5e-3
        if damage == "expert factor, checksums rewritten too":
            payload["checksums"] = tensor_checksums(payload["state"])
        _rewrite(path, payload)
    write_manifest(str(folder), global_step=4)
    with pytest.MonkeyPatch.context() as patch:
        use_torch_twins(patch)
        trainer = _moe_trainer(tmp_path / "resumed", max_steps=6)
        message = _refused(trainer, str(folder))
    if damage == "expert factor":
        assert f"{path} is damaged" in message and f"state.{STACK}.galore_factor" in message, message
    else:
        assert "disagree: the merged weight of" in message and repr(STACK) in message, message


def test_resume_true_refuses_a_damaged_newest_checkpoint_naming_the_previous_one(run_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run_dir / "checkpoint-2", out / "checkpoint-2")
    shutil.copytree(run_dir / "checkpoint-4", out / "checkpoint-4")
    _flip(str(out / "checkpoint-4" / "optimizer.pt"), os.path.getsize(out / "checkpoint-4" / "optimizer.pt") // 2)
    trainer = _trainer(out, max_steps=6)
    with pytest.raises(CheckpointIntegrityError, match=r"optimizer.pt is damaged.*Resume from .*checkpoint-2"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0


# ---------------------------------------------------------------------- settings changed on resume
class _RefreshLog(transformers.TrainerCallback):
    """(layer, galore step) of every refresh; runs after GaLoreCallback (which the plugin puts first)."""

    def __init__(self, switch_at=None):
        self.events: set[tuple[str, int]] = set()
        self.switch_at = switch_at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for name, layer in hgp.galore_layers(model):
            step = layer.counter("galore_step") - 1  # after_step has counted the step it refreshed in
            if layer.counter("galore_last_refresh") == step:
                self.events.add((name, step))
        if state.global_step == self.switch_at:
            # The oracle: the setting changed by hand at this step, as a user would between two steps.
            state = hgp.state_of(model)
            config = state.config = state.config.replace(refresh_schedule="staggered", refresh_tokens=8)
            layers = [layer for _, layer in hgp.galore_layers(model)]
            for layer in layers:
                layer.config = config
            assign_refresh_phases(layers)
            for layer in layers:
                layer.sync_counters()


def test_refresh_schedule_changed_on_resume_takes_effect_at_the_resumed_step(tmp_path):
    # aligned until checkpoint-4, staggered from there: layer L (phase p) refreshes next at step 6 + p
    # (gap 6, last refresh at 0; the 7 layers, packed at refresh_tokens=8, into 3 phases), against an
    # uninterrupted run that switched at step 4.
    aligned = "rank=4,update_proj_gap=6,refresh_schedule=aligned"
    staggered = "rank=4,update_proj_gap=6,refresh_schedule=staggered,refresh_tokens=8"
    _trainer(tmp_path / "first", optim_args=aligned, max_steps=11, save_steps=4).train()  # the same LR schedule
    oracle_log = _RefreshLog(switch_at=4)
    oracle = _trainer(tmp_path / "oracle", optim_args=aligned, max_steps=11, save_strategy="no")
    oracle.add_callback(oracle_log)
    oracle.train()

    log = _RefreshLog()
    resumed = _trainer(tmp_path / "resumed", optim_args=staggered, max_steps=11, save_strategy="no")
    resumed.add_callback(log)
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-4"))

    fresh = hgp.prepare_model(build_tiny_llama(seed=0, **SMALL_LLAMA), hgp.state_of(resumed.model).config)
    phases = {name: layer.counter("galore_phase") for name, layer in hgp.galore_layers(fresh)}
    assert len(set(phases.values())) > 1  # the layers are really staggered
    assert {name: layer.counter("galore_phase") for name, layer in hgp.galore_layers(resumed.model)} == phases
    assert log.events == {(name, 6 + phase) for name, phase in phases.items()}
    assert log.events == {event for event in oracle_log.events if event[1] >= 4}
    expected = oracle.model.state_dict()
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected[key]), key


# ---------------------------------------------------------------------- a full disk during a save
# The order in which a save writes the files of checkpoint-4 (transformers' save_model, optimizer, scheduler,
# RNG, trainer state; then ours, last).
WRITE_ORDER = [
    "config.json", "generation_config.json", "model.safetensors", "training_args.bin", "optimizer.pt",
    "scheduler.pt", "rng_state.pth", "trainer_state.json", GALORE_STATE_NAME, MANIFEST_NAME,
]  # fmt: skip
PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs the right to mount: root or CAP_SYS_ADMIN)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"platform: cannot mount a tmpfs here ({mounted.stderr.decode().strip()[:100]})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


class _FillDisk(transformers.TrainerCallback):
    """At the end of step `step` (before its save), leave `free` bytes on the disk of `folder`."""

    def __init__(self, folder, step: int, free: int):
        self.folder, self.step, self.free = str(folder), step, free

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            stat = os.statvfs(self.folder)
            with open(os.path.join(self.folder, "filler"), "wb") as handle:
                os.posix_fallocate(handle.fileno(), 0, max(stat.f_bavail * stat.f_frsize - self.free, PAGE))


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@pytest.mark.parametrize("target", ["model.safetensors", "optimizer.pt", GALORE_STATE_NAME, MANIFEST_NAME])
def test_disk_full_during_a_save_names_the_file_and_keeps_the_previous_checkpoint(run_dir, small_disk, target):
    reference = run_dir / "checkpoint-4"
    sizes = {name: os.path.getsize(reference / name) for name in WRITE_ORDER if (reference / name).exists()}
    sizes.setdefault(MANIFEST_NAME, os.path.getsize(reference / MANIFEST_NAME))
    before = sum(_pages(size) for name, size in sizes.items() if WRITE_ORDER.index(name) < WRITE_ORDER.index(target))
    out = small_disk / "out"
    trainer = _trainer(out)
    trainer.add_callback(_FillDisk(small_disk, 4, before + _pages(sizes[target]) // PAGE // 2 * PAGE))
    with pytest.raises(OSError) as info:
        trainer.train()
    message = str(info.value)
    assert info.value.errno == 28 and "No space left on device" in message
    assert str(out / "checkpoint-4" / target) in message, message
    assert "previous complete checkpoint" in message and str(out / "checkpoint-2") in message
    assert not os.path.exists(out / "checkpoint-4" / MANIFEST_NAME)  # incomplete: skipped on resume
    assert not [name for name in os.listdir(out / "checkpoint-4") if ".tmp-" in name]

    os.remove(small_disk / "filler")
    resumed = _trainer(out)
    resumed.train(resume_from_checkpoint=True)  # from checkpoint-2, which the failed save left intact
    from safetensors.torch import load_file

    for name, saved, got in (
        (GALORE_STATE_NAME, torch.load(reference / GALORE_STATE_NAME, weights_only=True)["state"], None),
        (
            "model.safetensors",
            load_file(reference / "model.safetensors"),
            load_file(out / "checkpoint-4" / "model.safetensors"),
        ),
    ):
        got = hgp.galore_state_dict(resumed.model) if got is None else got
        assert saved.keys() == got.keys(), name
        for key in saved:
            torch.testing.assert_close(got[key], saved[key], rtol=0, atol=0, equal_nan=True, msg=f"{name} {key}")
