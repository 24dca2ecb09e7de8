"""`python -m hf_galore_plugin` runs unmodified scripts and modules with the names registered;
the examples run end to end on a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_GALORE_DISABLE_TRITON": "1", "TRITON_INTERPRET": "0"}

PARSE_SCRIPT = """
    import sys
    from transformers import HfArgumentParser, TrainingArguments
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    print("argv0", sys.argv[0].endswith({suffix!r}), "optim", args.optim.value, "optim_args", args.optim_args)
"""


def _run(argv, cwd, timeout=180):
    result = subprocess.run(
        [sys.executable, "-m", "hf_galore_plugin", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ENV,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_runner_runs_a_script_as_main_with_its_own_argv(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(PARSE_SCRIPT.format(suffix="train.py")))
    out = _run(["train.py", "--output_dir", "o", "--optim", "qgalore_adamw_8bit", "--optim_args", "rank=4"], tmp_path)
    assert "argv0 True optim qgalore_adamw_8bit optim_args rank=4" in out


def test_runner_runs_a_module_as_main(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(textwrap.dedent(PARSE_SCRIPT.format(suffix="train.py")))
    out = _run(["-m", "mypkg.train", "--output_dir", "o", "--optim", "galore_adamw_8bit"], tmp_path)
    assert "argv0 True optim galore_adamw_8bit optim_args None" in out


def test_runner_without_target_prints_usage(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hf_galore_plugin"], capture_output=True, text=True, env=ENV)
    assert result.returncode == 2 and "usage: python -m hf_galore_plugin" in result.stdout


def test_example_run_clm_cli_trains_with_qgalore(tmp_path):
    out = _run(
        [
            os.path.join(ROOT, "examples", "run_clm_cli.py"),
            "--output_dir",
            str(tmp_path),
            "--optim",
            "qgalore_adamw_8bit",
            "--optim_args",
            "rank=8,update_proj_gap=2",
            "--max_steps",
            "4",
            "--use_cpu",
            "true",
            "--report_to",
            "none",
            "--per_device_train_batch_size",
            "4",
            "--save_strategy",
            "no",
        ],
        tmp_path,
    )
    assert "optim=qgalore_adamw_8bit" in out and "layers=GaLoreLinear" in out
    assert (tmp_path / "model.safetensors").is_file()


def test_example_train_trainer_runs_every_preset(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "train_trainer.py"),
            "--steps",
            "3",
            "--output_dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for preset in ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"):
        assert f"{preset}: loss" in result.stdout
        assert (tmp_path / preset / "model.safetensors").is_file()
