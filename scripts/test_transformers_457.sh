#!/usr/bin/env bash
# Run the tests of the transformers patches on the oldest supported line, transformers 4.57.6, in a
# second virtual environment (.venv-tf457): the optimizer-name tests, the patching tests, and the
# Trainer tests that go through the patched methods (exact resume, load-best, merged save, checkpoint
# checks, and the DeepSpeed resume path through deepspeed_load_checkpoint on 2 gloo ranks).
# Order matters as in scripts/env.sh: torch first, then the rest under a constraints file that pins the
# installed torch, so nothing pulls a CUDA build. The plugin is installed without its dependencies (they
# would pull the newest transformers back in). peft is not installed here: its tests run on the main line.
# Extra arguments go to pytest.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${HF_GALORE_VENV_457:-$_root/.venv-tf457}"
_torch="${HF_GALORE_TORCH:-torch==2.13.0}"
# The marker names what was installed: a venv made for an older list is completed on the next run.
# The plugin's entry points (its optimizer names) come from its installed metadata: pyproject.toml's hash is
# part of the marker, so a changed pyproject reinstalls the plugin into this venv.
_marker="$_venv/.tf457_installed_v3_$(sha256sum "$_root/pyproject.toml" | cut -c1-12)"
if [ ! -x "$_venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$_venv"
fi
_py="$_venv/bin/python"
if [ ! -f "$_marker" ]; then
  "$_py" -m pip install -q --upgrade pip
  "$_py" -m pip install -q "$_torch" numpy
  echo "torch==$("$_py" -c 'import torch; print(torch.__version__.split("+")[0])')" > "$_venv/constraints.txt"
  # galore-torch: the oracle of the tests that leave the GaLore names to transformers' own implementation.
  "$_py" -m pip install -q -c "$_venv/constraints.txt" "transformers==4.57.6" "accelerate>=1.0" deepspeed pytest galore-torch
  "$_py" -m pip install -q -c "$_venv/constraints.txt" --no-deps -e "$_root"
  touch "$_marker"
fi
cd "$_root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_GALORE_DISABLE_TRITON=1
"$_py" -c 'import transformers; assert transformers.__version__ == "4.57.6", transformers.__version__'
# The Trainer tests are selected with -k to keep this run short (a few minutes on 2 cores).
exec "$_py" -m pytest -q -p no:cacheprovider -m "not benchmark" \
  tests/test_integration_names.py \
  tests/test_integration_patching.py \
  tests/test_integration_trainer.py \
  tests/test_integration_features.py \
  tests/test_checkpoints.py \
  tests/test_distributed_trainer.py \
  -k "test_integration_names or test_integration_patching \
or replaces_layers or resume_from_checkpoint or save_model_is_merged \
or load_best_model_restores_galore_state \
or (test_checkpoints and not peft) \
or (resume_exactly and zero1)" \
  "$@"
