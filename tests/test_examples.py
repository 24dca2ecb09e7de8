"""The README's plain-PyTorch example runs and learns."""

import importlib.util
import math
from pathlib import Path

import pytest
from torch import nn

from conftest import use_torch_twins

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plain_pytorch.py"


@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_plain_pytorch_example_learns(preset, monkeypatch):
    use_torch_twins(monkeypatch)
    spec = importlib.util.spec_from_file_location("plain_pytorch_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--preset", preset, "--steps", "40", "--gap", "10"])
    losses = result["losses"]
    assert losses[0] == pytest.approx(math.log(256), rel=0.1)  # an untrained byte model is near uniform
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]
    assert all(type(m) is not nn.Module and "GaLore" not in type(m).__name__ for m in result["model"].modules())


# ---------------------------------------------------------------------- the demo's console
DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"
BNB_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
_LOAD_DEMO = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("demo", {str(DEMO)!r})
demo = sys.modules["demo"] = importlib.util.module_from_spec(spec)  # its dataclasses look the module up
spec.loader.exec_module(demo)
"""


def test_demo_drops_only_the_bitsandbytes_cpu_kernel_notice():
    from conftest import run_python

    result = run_python(
        _LOAD_DEMO
        + f"""
import logging
log = logging.getLogger("bitsandbytes.backends.cpu.ops")
log.warning("{BNB_NOTICE}: No module named 'kernels'. Please make sure ...")
log.warning("another bitsandbytes notice")
logging.getLogger("bitsandbytes").warning("{BNB_NOTICE} (another logger)")
demo.quiet_bitsandbytes_cpu_kernel_notice()
print(len(log.filters))
"""
    )
    assert result.stdout.split() == ["1"]  # installing twice adds no second filter
    lines = result.stderr.splitlines()
    assert "another bitsandbytes notice" in lines and f"{BNB_NOTICE} (another logger)" in lines
    assert not any(line.startswith(f"{BNB_NOTICE}:") for line in lines), result.stderr


DEEPSPEED_NOTICE = "Setting accelerator to CPU"


def test_demo_console_has_no_deepspeed_accelerator_notice():
    # transformers imports DeepSpeed when it is installed; without a GPU DeepSpeed logs that it falls back to
    # the CPU. Oracle: the same calls without the demo's set-up.
    import torch

    from conftest import run_python

    if torch.cuda.is_available():
        pytest.skip("platform: with a GPU DeepSpeed finds it and logs no CPU notice; the demo sets nothing")
    # DeepSpeed picks its accelerator on import (transformers imports it while the Trainer is built)
    calls = "\nimport deepspeed\nfrom deepspeed.accelerator import get_accelerator\nprint(get_accelerator().device_name())\n"
    env = {"DS_ACCELERATOR": ""}
    baseline = run_python(
        "import os; os.environ.pop('DS_ACCELERATOR')\nimport hf_galore_plugin" + calls, env=env, check=False
    )
    if "No module named 'deepspeed'" in baseline.stderr:
        pytest.skip("platform: deepspeed is not installed, so nothing logs the notice")
    assert DEEPSPEED_NOTICE in baseline.stdout + baseline.stderr, baseline.stderr[-2000:]  # its logger: stdout
    demo = run_python("import os; os.environ.pop('DS_ACCELERATOR')\n" + _LOAD_DEMO + calls, env=env)
    assert demo.stdout.split()[-1] == "cpu", demo.stdout
    assert DEEPSPEED_NOTICE not in demo.stdout + demo.stderr, demo.stdout + demo.stderr[-2000:]


def test_demo_console_has_no_bitsandbytes_notice_when_transformers_imports_it():
    # transformers.trainer -> peft -> bitsandbytes: on a CPU with AVX512-BF16 bitsandbytes logs the notice
    # at import. Oracle: the same imports without the demo's filter.
    from conftest import run_python

    imports = "\nimport transformers.trainer\nimport sys\nprint('bitsandbytes' in sys.modules)\n"
    baseline = run_python("import hf_galore_plugin" + imports)
    if BNB_NOTICE not in baseline.stderr:
        pytest.skip(
            "platform: bitsandbytes does not try its hub CPU kernel here (not installed, or a CPU without "
            f"AVX512-BF16; bitsandbytes imported: {baseline.stdout.strip()}), so there is no notice to drop"
        )
    demo = run_python(_LOAD_DEMO + imports)
    assert demo.stdout.strip() == "True" and BNB_NOTICE not in demo.stderr, demo.stderr
