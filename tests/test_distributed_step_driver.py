"""The optimizer's check that after_step drives the GaLore layers, under DeepSpeed ZeRO on 2 ranks.

ZeRO steps its inner optimizer once per parameter group (ZeRO-1/2) or sub-group (ZeRO-3) of every training
step, so counting optimizer.step() calls would report, on every rank, that the layers do not train in a run
where they do. The check counts training steps; a loop that never calls after_step is still reported.
"""

from pathlib import Path

import pytest

from distributed._launch import run_two_ranks

import deepspeed  # noqa: E402,F401  (the [deepspeed] extra, which the dev extra installs)

pytestmark = pytest.mark.distributed

NOT_DRIVEN = "after_step(model, optimizer) was never called"
UNDRIVEN_SCRIPT = Path(__file__).parent / "distributed" / "zero_without_after_step.py"


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_step_driver_check_warns_only_when_after_step_never_runs(tmp_path, stage):
    run = dict(ENGINE=f"zero{stage}", PRESET="galore_adamw", PROJ_TYPE="std", STEPS="3")
    driven = run_two_ranks(tmp_path / "driven.pt", **run)
    assert driven.returncode == 0, driven.stderr[-4000:]
    assert NOT_DRIVEN not in driven.stderr, driven.stderr[-4000:]
    undriven = run_two_ranks(tmp_path / "undriven.pt", script=UNDRIVEN_SCRIPT, **run)
    assert undriven.returncode == 0, undriven.stderr[-4000:]
    assert undriven.stderr.count(NOT_DRIVEN) == 2, undriven.stderr[-4000:]  # each rank, once
