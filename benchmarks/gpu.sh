#!/usr/bin/env bash
# The GPU subset of the benchmarks, for one Hopper GPU (H100/H200), in under 10 minutes:
#   0. the fused 8-bit AdamW Triton kernel against its torch twin (tests/test_optim_triton.py, compiled),
#   1. quantization kernel throughput (benchmarks/quant.py),
#   2. fused 8-bit AdamW kernel throughput vs torch fused AdamW and bitsandbytes AdamW8bit,
#   3. step time, tokens/s, device syncs per normal step (CUDA sync debug mode) and peak
#      torch.cuda.max_memory_allocated of a ~1.1B Llama (hidden 2048, intermediate 5504, 22 layers, bf16)
#      for torch's fused and foreach AdamW, bitsandbytes and torchao AdamW8bit, galore-torch (each if
#      importable) and our three presets, each method in its own process so peaks do not mix,
#   4. offloaded optimizer state (state_offload="cpu"): the CUDA path's bit-identity test (pinned host
#      state, side-stream copies) and step time with and without offload, fp32 and 8-bit state,
#   5. host work per training step on the GPU (benchmarks/step_overhead.py --device cuda: the tiny Llama's
#      thread CPU time, ops and syncs per step for every method and the two eager-floor rows),
#   6. eager and compiled from step 0 (benchmarks/step_overhead.py --compile --gap 10, hidden 1024, rank 128,
#      batch 4 x 256): wall time per step of each method both ways, Dynamo's graphs and graph breaks.
# Usage: bash benchmarks/gpu.sh [OUT_DIR]       (default outputs/gpu)
# Writes OUT_DIR/gpu.md (all tables, with date and device, to copy into docs/benchmarks/gpu.md) and gpu.log.
# Without CUDA it runs nothing and exits with status 2 and a message saying why.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"
OUT="${1:-outputs/gpu}"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  torch_info="$("$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")' 2>/dev/null || echo "torch not importable with $PYTHON")"
  echo "gpu.sh: no CUDA GPU is visible to torch ($torch_info); nothing was measured." >&2
  echo "gpu.sh: run it on a machine with one Hopper GPU (H100/H200) and a CUDA build of torch." >&2
  exit 2
fi

mkdir -p "$OUT"
LOG="$OUT/gpu.log"
: > "$LOG"
device="$("$PYTHON" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")')"
versions="$("$PYTHON" -c 'import torch, triton; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}")' 2>/dev/null || echo unknown)"
case "$device" in *sm_9*) ;; *) echo "gpu.sh: $device is not Hopper (sm_90); running anyway" | tee -a "$LOG" ;; esac
started=$(date +%s)
failures=0
run() {  # run LABEL TIMEOUT_S COMMAND...: log everything; a failure is recorded, the script goes on
  local label="$1" limit="$2"; shift 2
  echo "=== $label: $*" | tee -a "$LOG"
  if ! timeout "$limit" "$@" >> "$LOG" 2>&1; then
    echo "=== $label FAILED (see $LOG)" | tee -a "$LOG"
    failures=$((failures + 1))
  fi
}

run "Triton kernels vs torch twins (compiled, not interpreted)" 150 env TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_optim_triton.py
run "quantization kernels" 120 "$PYTHON" benchmarks/quant.py --out "$OUT/quant"
run "fused 8-bit AdamW kernel" 90 "$PYTHON" benchmarks/gpu_step.py kernel --out "$OUT"
for method in adamw_fused adamw bnb_adamw8bit torchao_adamw8bit galore_torch galore_adamw galore_adamw_8bit galore_adafactor galore_muon qgalore_adamw_8bit; do
  package=""
  case "$method" in
    bnb_adamw8bit) package=bitsandbytes ;;
    torchao_adamw8bit) package=torchao ;;
    galore_torch) package=galore_torch ;;
  esac
  if [ -n "$package" ] && ! "$PYTHON" -c "import $package" 2>/dev/null; then
    echo "=== $method: $package is not importable, skipped" | tee -a "$LOG"
    continue
  fi
  run "1B step: $method" 75 "$PYTHON" benchmarks/gpu_step.py step --method "$method" --out "$OUT"
done
"$PYTHON" benchmarks/gpu_step.py table --out "$OUT" >> "$LOG" 2>&1
run "offloaded state: CUDA bit-identity" 90 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_state_offload.py -k cuda
run "offloaded state: fp32 step time" 60 "$PYTHON" benchmarks/offload.py --device cuda --hidden 2048 --vocab 128256 --dtype bf16 --steps 10 --json "$OUT/offload_fp32.json"
run "host work per step (tiny Llama on the GPU)" 120 bash -c "'$PYTHON' benchmarks/step_overhead.py --device cuda --rounds 40 --out '$OUT/step_overhead.json' > '$OUT/step_overhead.md'"
run "eager and compiled from step 0 (hidden 1024)" 150 bash -c "'$PYTHON' benchmarks/step_overhead.py --device cuda --size h1024 --rank 128 --batch 4 --seq-len 256 --compile --gap 10 --rounds 30 --methods adamw_fused galore_torch galore_adamw galore_adamw_8bit qgalore_adamw_8bit --out '$OUT/compiled.json' > '$OUT/compiled.md'"
run "offloaded state: 8-bit step time" 60 "$PYTHON" benchmarks/offload.py --device cuda --hidden 2048 --vocab 128256 --dtype bf16 --state-bits 8 --error-feedback --steps 10 --json "$OUT/offload_8bit.json"

{
  echo "## GPU"
  echo
  echo "Measured $(date -u +%Y-%m-%d) on $device ($versions) with \`bash benchmarks/gpu.sh\`;"
  echo "$(( $(date +%s) - started )) s in all, $failures step(s) failed (see gpu.log)."
  echo
  echo "### Quantization kernels (benchmarks/quant.py)"
  echo
  cat "$OUT/quant/quant.md" 2>/dev/null || echo "(not measured: see gpu.log)"
  echo
  echo "### Triton correctness on the GPU (tests/test_optim_triton.py)"
  echo
  grep -E "passed|failed|error" "$LOG" | grep -v "^===" | tail -1 || echo "(not run: see gpu.log)"
  echo
  echo "### Fused 8-bit AdamW step, 64M values"
  echo
  cat "$OUT/kernel.md" 2>/dev/null || echo "(not measured: see gpu.log)"
  echo
  echo "### 1.1B Llama step (bf16, batch 4 x 512)"
  echo
  cat "$OUT/step.md" 2>/dev/null || echo "(not measured: see gpu.log)"
  echo
  echo "### Host work per step (benchmarks/step_overhead.py --device cuda --rounds 40)"
  echo
  grep -v -E "Warning|warn" "$OUT/step_overhead.md" 2>/dev/null || echo "(not measured: see gpu.log)"
  echo
  echo "### Eager and compiled from step 0, hidden 1024, rank 128 (benchmarks/step_overhead.py --compile --gap 10)"
  echo
  grep -v -E "Warning|warn" "$OUT/compiled.md" 2>/dev/null || echo "(not measured: see gpu.log)"
  echo
  echo "### Offloaded optimizer state (benchmarks/offload.py, 128256 x 2048 embedding and head, bf16)"
  echo
  for f in "$OUT"/offload_fp32.json "$OUT"/offload_8bit.json; do
    [ -f "$f" ] && "$PYTHON" -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1])), indent=1))' "$f"
  done
  grep -A3 "offloaded state" "$LOG" | grep -E "passed|failed" | tail -1 || true
} > "$OUT/gpu.md"
cat "$OUT/gpu.md"
echo "wrote $OUT/gpu.md and $LOG"
[ "$failures" -eq 0 ]
