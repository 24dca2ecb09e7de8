"""The launcher of the multi-process tests (tests/distributed/_launch.py) against what torchrun does: the same
worker environment, a failing rank stops the others and its output is shown, a timeout kills every rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from distributed._launch import launch

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    print("rank", rank, "of", os.environ["WORLD_SIZE"], sys.argv[1:], os.getcwd(), os.environ["MARK"], flush=True)
    dist.init_process_group("gloo")  # env:// from MASTER_ADDR / MASTER_PORT, as under torchrun
    dist.barrier()
    if os.environ["MODE"] == "fail" and rank == 1:
        raise RuntimeError("rank 1 fails here")
    if os.environ["MODE"] in ("fail", "sleep"):
        time.sleep(100)  # busy elsewhere: only being stopped ends it early
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _run(tmp_path, mode: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = {"MODE": mode, "MARK": "from-the-caller", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return launch([str(script), "a", "b"], env, ranks=2, timeout=timeout)


def test_two_ranks_get_torchruns_environment_argv_and_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _run(tmp_path, "ok")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} of 2 ['a', 'b'] {tmp_path} from-the-caller" for r in (0, 1)]


def test_a_failing_rank_stops_the_other_and_its_error_comes_last(tmp_path):
    started = time.monotonic()
    result = _run(tmp_path, "fail")
    assert result.returncode == 1
    assert "RuntimeError: rank 1 fails here" in result.stderr[-2000:]
    assert time.monotonic() - started < 50  # rank 0 was stopped, not waited for


def test_a_timeout_kills_every_rank_and_raises(tmp_path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run(tmp_path, "sleep", timeout=5)
    assert time.monotonic() - started < 40


def test_one_process_runs_as_python_would(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import sys\nprint(sys.argv[1:], __name__, sys.path[0])\nsys.exit(3)\n")
    result = launch([str(script), "x"], {"PATH": "/usr/bin:/bin"})
    assert result.returncode == 3
    assert result.stdout.strip() == f"['x'] __main__ {tmp_path}"
    assert result.args == [sys.executable, str(script), "x"]
