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
# The transformers-4.57 stage (a second venv, see scripts/test_transformers_457.sh) runs only with no
# arguments. It starts in the background before the main run and computes on one thread: building its
# venv waits on downloads and its tests are serial, so beside the two workers it fills the gaps in their
# use of the cores instead of adding its whole time after them. Its output is printed after the main run.
_tf457_pid=""
if [ -f scripts/test_transformers_457.sh ] && [ "${HF_GALORE_SKIP_TF457:-0}" != "1" ] && [ "$#" -eq 0 ]; then
  _tf457_log="$(mktemp "${TMPDIR:-/tmp}/hf_galore_tf457.XXXXXX.log")"
  echo "[test] transformers-4.57 stage started in the background (log: $_tf457_log)"
  # setsid: the stage and its subprocesses form one process group, which an interrupt stops together.
  OMP_NUM_THREADS=1 setsid bash scripts/test_transformers_457.sh >"$_tf457_log" 2>&1 &
  _tf457_pid=$!
  trap 'kill -- "-$_tf457_pid" 2>/dev/null || true; exit 130' INT TERM
fi
_rc=0
# `--dist worksteal`: a worker that runs out of tests takes queued ones from the other, so a long test
# near the end does not leave one core idle.
if [ "$#" -eq 0 ]; then
  # The benchmark smoke runs (marker `benchmark`) are out of a plain pytest run (pyproject addopts); the
  # full run takes them in the same invocation (one pool of workers), so CI covers them.
  python -m pytest tests -ra --durations=20 -n 2 --dist worksteal -m "benchmark or not benchmark" || _rc=$?
else
  python -m pytest tests -ra --durations=15 -n 2 --dist worksteal "$@" || _rc=$?
fi
if [ -n "$_tf457_pid" ]; then
  _tf457_rc=0
  wait "$_tf457_pid" || _tf457_rc=$?
  echo "[test] transformers-4.57 stage (exit status $_tf457_rc):"
  cat "$_tf457_log"
  rm -f "$_tf457_log"
  [ "$_rc" -ne 0 ] || _rc=$_tf457_rc
fi
exit "$_rc"
