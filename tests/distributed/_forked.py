"""The child side of tests/distributed/_launch.py: run a script as ``python script args`` would, in a process
forked from a server that has imported torch, transformers and deepspeed already.

Kept free of heavy imports: the forkserver imports this module to start each child."""

from __future__ import annotations

import os
import runpy
import sys


def run_script(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In the child: output to the files `stdout`/`stderr`, environment `env` (replacing the server's), `cwd`,
    ``sys.argv = argv`` and the script's folder first on ``sys.path``, then the script as ``__main__``. Its exit
    status is the child's (an exception: 1, ``sys.exit(n)``: n)."""
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        # torch was imported by the server under its own environment: the thread count must follow this one.
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
