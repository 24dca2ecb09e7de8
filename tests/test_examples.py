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
