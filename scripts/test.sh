#!/usr/bin/env bash
# Run the whole test suite in the project's virtual environment (created on first use).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k quant`; they come after the defaults, so
# `-n 0` runs everything in this one process (for -s, --pdb) and `-n 4` sets another worker count.
#
# Tests run in 2 pytest-xdist worker processes (`-n 2`: CI's machine has 2 cores); tests/conftest.py
# gives each worker its share of the cores as torch threads. The multi-process tests start their own
# 2-rank torchrun groups on ports torchrun picks, so two of them may run side by side.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source scripts/env.sh
# `--dist worksteal`: a worker that runs out of tests takes queued ones from the other, so a long test
# near the end does not leave one core idle.
if [ "$#" -eq 0 ]; then
  # The benchmark smoke runs (marker `benchmark`) are out of a plain pytest run (pyproject addopts); the
  # full run takes them in the same invocation (one pool of workers), so CI covers them.
  python -m pytest tests -ra --durations=20 -n 2 --dist worksteal -m "benchmark or not benchmark"
else
  python -m pytest tests -ra --durations=15 -n 2 --dist worksteal "$@"
fi
if [ -f scripts/test_transformers_457.sh ] && [ "${HF_GALORE_SKIP_TF457:-0}" != "1" ] && [ "$#" -eq 0 ]; then
  # The optimizer-name registration must also work on the 4.57 line of transformers (second venv).
  bash scripts/test_transformers_457.sh
fi
