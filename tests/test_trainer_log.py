"""What the Trainer's console shows of the plugin's log keys, what reporting integrations receive, and the
progress bar and duration of a basis refresh.

Tiny Llama (hidden 64, 2 layers) on random token ids; each test trains up to 50 steps on CPU.
"""

from __future__ import annotations

import ast
import itertools

import pytest
import torch

import hf_galore_plugin  # noqa: F401  registers the optimizer names
from hf_galore_plugin import GaLoreConfig
from hf_galore_plugin.integrations import callback as galore_callback

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from conftest import build_tiny_llama  # noqa: E402
from conftest import use_torch_twins  # noqa: E402
from conftest import training_args as shared_training_args  # noqa: E402

PREFIX = galore_callback.LOG_PREFIX


@pytest.fixture(autouse=True)
def _torch_twins(monkeypatch):
    # The Triton kernels are tested against their torch twins elsewhere; the integration runs the twins.
    use_torch_twins(monkeypatch)


def token_data(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(tmp_path, optim_args: str, **overrides) -> TrainingArguments:
    """The shared Trainer-test arguments for a 50-step run logging every 10 steps."""
    return shared_training_args(
        tmp_path, **{"optim_args": optim_args, "max_steps": 50, "logging_steps": 10, **overrides}
    )


class Recorder(TrainerCallback):
    """Keeps a copy of every ``logs`` dict it is handed, as TensorBoard/W&B callbacks do in ``on_log``."""

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


def console_lines(text: str) -> list[dict]:
    """The training log lines the console callbacks printed (dict reprs with a loss)."""
    lines = [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if "loss" in line]


def plugin_keys(logs: dict) -> set[str]:
    return {key for key in logs if key.startswith(PREFIX)}


@pytest.mark.parametrize(
    "log_keys, disable_tqdm",
    [(None, True), (None, False), ("full", True)],
    ids=["brief-printer", "brief-progressbar", "full-printer"],
)
def test_console_shows_brief_keys_while_integrations_get_every_key(
    tmp_path, monkeypatch, capsys, log_keys, disable_tqdm
):
    # A recording callback where the Trainer puts reporting integrations (report_to="tensorboard" etc.):
    # among the default callbacks, after the GaLore callback and before the console callback.
    monkeypatch.setattr(transformers.trainer, "get_reporting_integration_callbacks", lambda report_to: [Recorder])
    optim_args = "rank=8,update_proj_gap=5" + (f",log_keys={log_keys}" if log_keys else "")
    args = training_args(tmp_path, optim_args, disable_tqdm=disable_tqdm)
    trainer = Trainer(model=build_tiny_llama(), args=args, train_dataset=token_data())
    integration = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Recorder))
    added_later = Recorder()  # after the console callback: must still get the full dict
    trainer.add_callback(added_later)
    trainer.train()

    printed = console_lines(capsys.readouterr().out)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(printed) == len(history) == 5
    for recorder in (integration, added_later):
        received = [logs for logs in recorder.logged if "loss" in logs]
        assert len(received) == 5
        for logs, entry in zip(received, history):
            # every key the plugin computes (the oracle: the Trainer's own log_history entry)
            assert plugin_keys(logs) == plugin_keys(entry)
            assert {f"{PREFIX}gap_mean", f"{PREFIX}bytes_optimizer_state", f"{PREFIX}refresh_seconds"} <= set(logs)
            assert len(plugin_keys(logs)) >= 10
    for line, entry in zip(printed, history):
        if log_keys == "full":
            assert plugin_keys(line) == plugin_keys(entry)
        else:
            assert plugin_keys(line) == set(galore_callback.BRIEF_LOG_KEYS), line
            assert len(plugin_keys(line)) <= 4
            assert float(line[f"{PREFIX}refreshed_layers"]) == entry[f"{PREFIX}refreshed_layers"] > 0


def test_an_explicit_callback_reaches_the_integrations_too(tmp_path, monkeypatch, capsys):
    # Trainer(callbacks=[GaLoreCallback()]) puts the user's callback after the reporting integrations.
    monkeypatch.setattr(transformers.trainer, "get_reporting_integration_callbacks", lambda report_to: [Recorder])
    model = hf_galore_plugin.prepare_model(build_tiny_llama(), GaLoreConfig(rank=8, update_proj_gap=2))
    optimizer = hf_galore_plugin.create_optimizer(model, lr=1e-3)
    args = training_args(tmp_path, None, optim="adamw_torch", max_steps=4, logging_steps=2)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=token_data(),
        callbacks=[galore_callback.GaLoreCallback()],
        optimizers=(optimizer, None),
    )
    integration = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Recorder))
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    received = [logs for logs in integration.logged if "loss" in logs]
    assert len(received) == len(history) == 2
    for logs, entry in zip(received, history):
        assert plugin_keys(logs) == plugin_keys(entry) and len(plugin_keys(logs)) >= 10
    printed = console_lines(capsys.readouterr().out)
    assert len(printed) == 2
    for line in printed:  # the first window holds only the calibration: no similarity to a previous basis
        assert f"{PREFIX}refreshed_layers" in line and plugin_keys(line) <= set(galore_callback.BRIEF_LOG_KEYS)


def test_log_keys_is_validated():
    with pytest.raises(ValueError, match=r"log_keys='verbose'.*choose one of \['brief', 'full'\]"):
        GaLoreConfig(log_keys="verbose")


def refresh_steps_run(tmp_path, **overrides) -> Trainer:
    overrides = {"max_steps": 7, "logging_steps": 1, "disable_tqdm": False, **overrides}
    # a budget that packs the 14 layers' sketches and kept inputs (4 x 16 fp32 tokens) into 2 staggered phases:
    # calibration at steps 0-1, refreshes at 3-4, none at 2 and 5
    args = training_args(tmp_path, "rank=8,update_proj_gap=3,refresh_budget_mb=0.2", **overrides)
    trainer = Trainer(model=build_tiny_llama(), args=args, train_dataset=token_data())
    trainer.train()
    return trainer


def refresh_entries(trainer: Trainer) -> tuple[list[dict], list[dict]]:
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    refreshed = [entry for entry in entries if entry[f"{PREFIX}refreshed_layers"] > 0]
    quiet = [entry for entry in entries if entry[f"{PREFIX}refreshed_layers"] == 0]
    assert len(refreshed) >= 2 and quiet, entries  # calibration + refreshes every 3 steps, ordinary steps between
    return refreshed, quiet


def test_slow_refresh_shows_a_progress_bar_and_logs_its_duration(tmp_path, monkeypatch, capsys):
    # Every reading of the callback's clock is 3 s after the previous one: each refresh "takes" 3 s.
    ticks = itertools.count(step=3.0)
    monkeypatch.setattr(galore_callback, "_clock", lambda: next(ticks))
    # tqdm measures its delay with its own clock: the threshold 0 stands for a refresh past it.
    monkeypatch.setattr(galore_callback, "REFRESH_PROGRESS_DELAY_S", 0.0)
    trainer = refresh_steps_run(tmp_path)
    refreshed, quiet = refresh_entries(trainer)
    for entry in refreshed:
        assert entry[f"{PREFIX}refresh_seconds"] == entry[f"{PREFIX}refresh_seconds_max"] == 3.0
    assert all(f"{PREFIX}refresh_seconds" not in entry for entry in quiet)
    err = capsys.readouterr().err
    # a bar on every refresh step, over the layers it refreshes (one staggered phase: some of the 14 here)
    for entry in refreshed:
        due = int(entry[f"{PREFIX}refreshed_layers"])  # logged as a float
        assert 0 < due < len(hf_galore_plugin.galore_layers(trainer.model))
        assert f"GaLore refresh at step {entry['step']}:   0%|          | 0/{due} [" in err, err[-2000:]


def test_fast_refresh_prints_no_bar_and_logs_its_duration(tmp_path, monkeypatch, capsys):
    # A tiny model's refresh takes milliseconds, but seconds on a loaded 2-core machine: a threshold of an
    # hour makes every refresh here a fast one (tqdm then prints nothing, with the real clocks).
    monkeypatch.setattr(galore_callback, "REFRESH_PROGRESS_DELAY_S", 3600.0)
    trainer = refresh_steps_run(tmp_path)
    refreshed, _ = refresh_entries(trainer)
    for entry in refreshed:
        assert 0 < entry[f"{PREFIX}refresh_seconds"] < galore_callback.REFRESH_PROGRESS_DELAY_S
    assert "GaLore refresh at step" not in capsys.readouterr().err


def test_disable_tqdm_hides_a_slow_refresh_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(galore_callback, "REFRESH_PROGRESS_DELAY_S", 0.0)
    refresh_steps_run(tmp_path, disable_tqdm=True)
    assert "GaLore refresh at step" not in capsys.readouterr().err
