"""Helpers of the distributed tests: run sharded_galore.py (or another script) in one process or on two ranks,
compare."""

import functools
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from distributed._forked import run_script
from conftest import free_port

SCRIPT = Path(__file__).parent / "sharded_galore.py"


def _env(**overrides: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # torch twins in the workers
    env.update(OMP_NUM_THREADS="1", **overrides)
    return env


# The two-rank and one-process runs start by forking a server that has imported these (forkserver with
# preload, one server per test process): a fresh interpreter spends 2-4 s of CPU importing them, the fork
# milliseconds. The suite starts ~130 such processes (and used to start a torchrun launcher per group).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "deepspeed",
    "transformers.models.llama.modeling_llama",
    "transformers.trainer",
]


@functools.lru_cache(maxsize=None)
def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def launch(
    argv: list[str], env: dict, *, ranks: Optional[int] = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python argv`` with environment `env`, forked from the preloaded server (tests/distributed/_forked.py).

    `ranks`: that many processes with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, the TORCHELASTIC_* variables; rank 0 hosts the store), as ``torchrun --standalone``
    would start them; benchmarks/distributed.py (tests/test_benchmarks_cli.py) goes through torchrun itself.
    Like torchrun, a rank that fails stops the others, never a hang. Past `timeout` seconds every process is
    killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does. The result holds the first
    non-zero exit status (0 when all succeed) and the processes' stdout and stderr one after another, rank 0
    first, except that the first failed rank's come last, where a test's ``stderr[-4000:]`` shows them."""
    context = _context()
    count = ranks or 1
    port = str(free_port()) if ranks is not None else ""
    with tempfile.TemporaryDirectory(prefix="launch_") as folder:
        procs, files = [], []
        for rank in range(count):
            rank_env = dict(env)
            if ranks is not None:
                rank_env.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                    WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(ranks),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID=f"tests-{port}",
                    TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                    TORCHELASTIC_USE_AGENT_STORE="False",
                )  # fmt: skip
            out, err = os.path.join(folder, f"{rank}.out"), os.path.join(folder, f"{rank}.err")
            files.append((out, err))
            proc = context.Process(target=run_script, args=(list(argv), rank_env, os.getcwd(), out, err))
            proc.start()
            procs.append(proc)
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            while any(p.exitcode is None for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a failed rank: the others would wait for it in their next collective
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        # The first rank to fail ended the run; the ones stopped after it report -9 (SIGKILL).
        failed = sorted((r for r, code in enumerate(codes) if code != 0), key=lambda r: codes[r] < 0)
        order = [r for r in range(count) if r not in failed[:1]] + failed[:1]
        texts = [(_read(out), _read(err)) for out, err in files]
    stdout = "".join(texts[r][0] for r in order)
    stderr = "".join(texts[r][1] for r in order)
    command = [sys.executable, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, codes[failed[0]] if failed else 0, stdout, stderr)


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def run_two_ranks(out: Path, *args: str, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    """`script` on 2 gloo ranks (:func:`launch`)."""
    return launch([str(script), str(out), *args], _env(**env), ranks=2)


def run_one_process(out: Path, *args: str, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    return launch([str(script), str(out), *args], _env(**env))


@functools.lru_cache(maxsize=None)
def single_process_run(
    preset: str, proj_type: str, fake_step: str = "0", basis_method: str = "svd", scale: str = "0.25"
) -> dict:
    """The oracle: the same global batch in one process (cached: several engines compare against it)."""
    out = Path(tempfile.mkdtemp(prefix="galore_single_")) / "single.pt"
    result = run_one_process(out, ENGINE="single", PRESET=preset, PROJ_TYPE=proj_type, FAKE_STEP=fake_step,
                             BASIS_METHOD=basis_method, SCALE=scale)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


# Allowed per fold and weight matrix when W0 is INT8 with stochastic rounding (see assert_weights_match).
CODE_FLIPS_PER_FOLD = 4
# Beside the flips, any number of elements may differ by up to this fraction of their block's quantization
# step: the consequence of a flipped code for the later updates (measured: 0.045 of a step, in one input
# column of the next layer, after one flip in the layer before; the bound is ~2x that).
DRIFT_STEPS = 0.1


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
    bounded by how rarely ``v + u`` lands that close to an integer. A flipped code changes what the layers
    after it see, so their later updates may differ too: by at most ``DRIFT_STEPS`` of a step, any number of
    elements, while a flip is a difference of more than that and at most one step."""
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
    count, worst = int((steps > DRIFT_STEPS).sum()), float(steps.max())
    assert count <= limit and worst <= 1.05, (
        f"{key}: {count} elements differ beyond rtol={rtol:g}/atol={atol:g} and {DRIFT_STEPS} quantization steps "
        f"(allowed: {limit}, i.e. {CODE_FLIPS_PER_FOLD} per fold x {int8_folds} folds of the INT8 W0), the largest "
        f"by {worst:.3f} quantization steps of its block (allowed: 1)"
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


def engine_and_reference(
    tmp_path: Path, engine: str, preset: str, proj_type: str, reference: str = "single", **env: str
) -> tuple[dict, dict]:
    """`preset` under `engine` on 2 ranks and under `reference` ('single': in one process; or another engine on
    2 ranks), with the extra environment `env` in both (not cached): (the reference's result, the engine's), each
    with "state_numel", the optimizer state values rank 0 holds (local shards of DTensors)."""
    results = []
    for name in (reference, engine):
        run = run_one_process if name == "single" else run_two_ranks
        out, numel = tmp_path / f"{name}.pt", tmp_path / f"{name}_state_numel.pt"
        result = run(out, ENGINE=name, PRESET=preset, PROJ_TYPE=proj_type, STATE_NUMEL_OUT=str(numel), **env)
        assert result.returncode == 0, result.stderr[-4000:]
        results.append({**torch.load(out, weights_only=True), "state_numel": torch.load(numel, weights_only=True)})
    return results[0], results[1]
