#!/usr/bin/env bash
# The GPU check of this repository, on one CUDA device (written for one H200; about 4-6 minutes, capped at 8).
# Checks (scripts/gpu_check_scoring.py has the details): the advantage's CUDA path against the CPU kernels; the packed
# answer scorer exact against per_turn in fp32 (FlexAttention and SDPA, L=8K); the scorer under FSDP2 bf16 mixed
# precision with CPU offload; time and peak memory of packed vs per_turn (measured, or stratified estimate, stated per
# line) at L = 32K, 64K, 128K with K = 200 under single-rank FSDP2 (nccl); FlexAttention recompilations across lengths.
# Needs python with CUDA torch (FlexAttention), transformers (Qwen3), numba; pytest and triton optional. No internet,
# vLLM, verl or Ray: the models are random, built locally; the working tree is used as is (nothing is installed).
#
# Usage:  bash scripts/gpu_check.sh [--cpu-dry-run] [options of scripts/gpu_check_scoring.py, e.g. --preset qwen3-1.7b]
#         --cpu-dry-run runs everything at tiny sizes on the CPU (gloo instead of nccl), to test the script itself.
# Env:    PYTHON (interpreter; default .venv-gpu/bin/python if present, else python3; the dry run prefers .venv),
#         OUT (output folder; default outputs/gpu_check), CHECK_TIMEOUT_S (hard limit, default 480).
# Writes: $OUT/summary.txt (one PASS/FAIL line per check, then a RESULT line), $OUT/results.json (the numbers),
#         $OUT/log.txt (everything printed).
# Exit:   0 all checks passed; 1 a check failed; 2 the environment cannot run the checks; 124 the time limit was hit
#         (summary.txt keeps the checks that finished; shorten with --lengths 32768,65536 or --strata 4).
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
for arg in "$@"; do [[ $arg == --cpu-dry-run ]] && dry=1; done
PY="${PYTHON:-}"
if [[ -z $PY ]]; then
  if [[ $dry == 1 && -x .venv/bin/python ]]; then PY=.venv/bin/python
  elif [[ $dry == 0 && -x .venv-gpu/bin/python ]]; then PY=.venv-gpu/bin/python
  else PY=python3; fi
fi
OUT="${OUT:-outputs/gpu_check}"
LIMIT="${CHECK_TIMEOUT_S:-480}"
mkdir -p "$OUT"
export OUT
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
rm -f "$SUMMARY"

{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); python: $PY; limit ${LIMIT}s; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
} 2>&1 | tee "$LOG"

# The script's own time budget (--budget-s, default 450 s) stops it from starting checks late; this is the backstop.
timeout --kill-after=20 "$LIMIT" "$PY" scripts/gpu_check_scoring.py --out "$OUT" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}

# The script rewrites summary.txt after every check; finish it here when the script could not.
if [[ ! -s $SUMMARY ]]; then
  echo "FAIL start: $PY could not run scripts/gpu_check_scoring.py (exit $status); see $LOG" > "$SUMMARY"
  echo "RESULT: FAIL (the checks did not start)" >> "$SUMMARY"
  status=2
elif [[ $status == 124 || $status == 137 ]]; then
  sed -i '/^RESULT: /d' "$SUMMARY"
  echo "RESULT: TIMEOUT after ${LIMIT}s (the lines above finished; see $LOG)" >> "$SUMMARY"
  status=124
elif ! tail -n 1 "$SUMMARY" | grep -q '^RESULT: \(PASS\|FAIL\)'; then
  sed -i '/^RESULT: /d' "$SUMMARY"
  echo "RESULT: FAIL (scripts/gpu_check_scoring.py stopped with exit $status before finishing; see $LOG)" >> "$SUMMARY"
  [[ $status == 0 ]] && status=1
fi
echo "gpu_check: exit $status; summary $SUMMARY"
cat "$SUMMARY"
exit "$status"
