#!/usr/bin/env bash
# Run the optimizer-name tests on transformers 4.57.6 in a second virtual environment (.venv-tf457).
# Order matters as in scripts/env.sh: torch first, then transformers under a constraints file that
# pins the installed torch, so nothing pulls a CUDA build. The plugin is installed without its
# dependencies (they would pull the newest transformers back in).
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${HF_GALORE_VENV_457:-$_root/.venv-tf457}"
_torch="${HF_GALORE_TORCH:-torch==2.13.0}"
if [ ! -x "$_venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$_venv"
fi
_py="$_venv/bin/python"
if [ ! -f "$_venv/.tf457_installed" ]; then
  "$_py" -m pip install -q --upgrade pip
  "$_py" -m pip install -q "$_torch" numpy
  echo "torch==$("$_py" -c 'import torch; print(torch.__version__.split("+")[0])')" > "$_venv/constraints.txt"
  "$_py" -m pip install -q -c "$_venv/constraints.txt" "transformers==4.57.6" "accelerate>=1.0" pytest
  "$_py" -m pip install -q -c "$_venv/constraints.txt" --no-deps -e "$_root"
  touch "$_venv/.tf457_installed"
fi
cd "$_root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_GALORE_DISABLE_TRITON=1
"$_py" -c 'import transformers; assert transformers.__version__ == "4.57.6", transformers.__version__'
exec "$_py" -m pytest -q -p no:cacheprovider tests/test_integration_names.py "$@"
