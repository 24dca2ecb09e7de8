#!/usr/bin/env bash
# The README's first command: tiny Llama on Shakespeare with AdamW (at one rate and at GaLore's per-group
# rates), GaLore, 8-bit GaLore, Q-GaLore and LoRA through transformers.Trainer (about 5 minutes on 2 CPU
# cores). Arguments go to examples/demo.py.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$_root/scripts/env.sh"
# The Triton interpreter is for kernel tests only; the demo runs the kernels' torch twins on CPU.
unset TRITON_INTERPRET
exec python "$_root/examples/demo.py" "$@"
