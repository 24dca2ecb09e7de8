"""Helpers of the distributed tests: run sharded_galore.py in one process or under torchrun, compare."""

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "sharded_galore.py"


def _env(**overrides: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # torch twins in the workers
    env.update(OMP_NUM_THREADS="1", **overrides)
    return env


def run_two_ranks(out: Path, *args: str, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    """torchrun, gloo, 2 processes; a failing rank ends the run (torchrun stops the other), never a hang."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(out),
            *args,
        ],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_one_process(out: Path, *args: str, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), str(out), *args], env=_env(**env), capture_output=True, text=True, timeout=300
    )


@functools.lru_cache(maxsize=None)
def single_process_run(preset: str, proj_type: str, fake_step: str = "0", basis_method: str = "svd") -> dict:
    """The oracle: the same global batch in one process (cached: several engines compare against it)."""
    out = Path(tempfile.mkdtemp(prefix="galore_single_")) / "single.pt"
    env = _env(ENGINE="single", PRESET=preset, PROJ_TYPE=proj_type, FAKE_STEP=fake_step, BASIS_METHOD=basis_method)
    subprocess.run([sys.executable, str(SCRIPT), str(out)], check=True, env=env, timeout=300)
    return torch.load(out, weights_only=True)


# Allowed per fold and weight matrix when W0 is INT8 with stochastic rounding (see assert_weights_match).
CODE_FLIPS_PER_FOLD = 4


# Two ranks against one process at the torch level (fp32 sums in another order: two halves reduced vs one
# batch). Measured over DDP, FSDP1, FSDP2, ZeRO-1/2/3 (galore_adamw, qgalore_adamw_8bit, svd and randomized
# bases, 30 steps): losses within 2.2e-7 relative, merged weights within 9.7e-8 absolute (values up to ~1).
# The bounds are those measurements times ~10, for machines that sum in yet another order.
LOSS_RTOL = 2e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-6, 1e-6


def assert_weights_match(
    got: torch.Tensor,
    expected: torch.Tensor,
    *,
    key: str,
    int8_folds: int = 0,
    group_size: int = 256,
    rtol: float = WEIGHT_RTOL,
    atol: float = WEIGHT_ATOL,
) -> None:
    """Merged weights of a multi-rank run against one process: within `rtol`, `atol` (fp32 sums in
    another order), except, when W0 is INT8 with stochastic rounding (``int8_folds`` = folds of the run),
    at most ``CODE_FLIPS_PER_FOLD`` elements per fold that differ by at most one quantization step of their
    W0 block: a last-bit difference of a folded value (two ranks reduce in another order than one process)
    moves ``floor(v + u)`` across an integer when ``v + u`` lies within that bit of it, on any machine whose
    reduction order differs. Which elements flip depends on the machine's summation order; how many can is
    bounded by how rarely ``v + u`` lands that close to an integer."""
    close = torch.isclose(got, expected, rtol=rtol, atol=atol)
    if int8_folds == 0 or bool(close.all()):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=key)
        return
    flat = expected.detach().float().reshape(-1)
    pad = -flat.numel() % group_size
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, group_size)
    step = (blocks.abs().amax(dim=1, keepdim=True) / 127.0).expand_as(blocks).reshape(-1)[: flat.numel()]
    diff = (got.detach().float().reshape(-1) - flat).abs()
    off = ~close.reshape(-1)
    steps = diff[off] / step[off]
    limit = CODE_FLIPS_PER_FOLD * int8_folds
    count, worst = int(off.sum()), float(steps.max())
    assert count <= limit and worst <= 1.05, (
        f"{key}: {count} elements differ beyond rtol={rtol:g}/atol={atol:g} (allowed: {limit}, i.e. {CODE_FLIPS_PER_FOLD} "
        f"per fold x {int8_folds} folds of the INT8 W0), the largest by {worst:.3f} quantization steps of its "
        "block (allowed: 1)"
    )


def int8_folds(preset: str, single: dict) -> int:
    """Folds into an INT8, stochastically rounded W0 in a run of `preset` (0 when W0 is not INT8)."""
    from hf_galore_plugin import GaLoreConfig

    config = GaLoreConfig.preset(preset)
    return int(single["refreshes"]) if config.weight_storage == "int8" and config.stochastic_rounding else 0


def assert_matches(single: dict, multi: dict, *, int8_folds: int = 0) -> None:
    assert single["refreshes"] == multi["refreshes"] >= 3  # calibration + refreshes at steps 10 and 20
    # fp32 sums in a different order: see LOSS_RTOL for what was measured
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=LOSS_RTOL, atol=0)
    assert single["weights"].keys() == multi["weights"].keys()
    for key, expected in single["weights"].items():
        assert_weights_match(multi["weights"][key], expected, key=key, int8_folds=int8_folds)
    assert multi["multipliers"] == single["multipliers"]  # base weight decay applied on the same steps
    assert all(m < 1.0 for m in single["multipliers"].values())  # ... and applied at all
