"""Multi-process runs on CPU (torchrun, gloo, 2 ranks) against a single-process run of the same global batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "distributed"
pytestmark = pytest.mark.distributed


def _env(preset: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # torch twins in the workers
    env.update(PRESET=preset, OMP_NUM_THREADS="1")
    return env


@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_ddp_two_ranks_match_single_process(tmp_path, preset):
    script = SCRIPTS / "ddp_galore.py"
    single, multi = tmp_path / "single.pt", tmp_path / "ddp.pt"
    subprocess.run([sys.executable, str(script), str(single)], check=True, env=_env(preset), timeout=300)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(multi)],
        check=True, env=_env(preset), timeout=300,
    )
    a, b = torch.load(single, weights_only=True), torch.load(multi, weights_only=True)
    assert a["refreshes"] == b["refreshes"] >= 3  # calibration + refreshes at steps 10, 20
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-4, atol=1e-6)
    # fp32 sums in a different order (two halves all-reduced vs one batch): 1e-4 relative on the weights;
    # the INT8 base is re-quantized with stochastic rounding at each fold, which can flip a code where the
    # two runs' weights differ in the last bits, so it gets one INT8 step of slack.
    for key in a["weights"]:
        wa, wb = a["weights"][key], b["weights"][key]
        atol = 1e-5 if preset == "galore_adamw" else float(wa.abs().max()) / 127
        torch.testing.assert_close(wb, wa, rtol=1e-4, atol=atol, msg=key)
