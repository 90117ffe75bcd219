#!/usr/bin/env bash
# GPU check of the packed answer scorer on one CUDA device (written for an H200, ~141 GB).
# First the CUDA tests of the advantage (tensor-op passes on the GPU vs the CPU kernels, tests/test_advantage.py -k
# cuda; needs pytest and numba), then scripts/gpu_check_scoring.py: fp32 exactness of packed (FlexAttention and SDPA) vs per_turn, then bf16 packed
# with FlexAttention at L = 32K, 64K, 128K with K = 200 (time, peak memory, agreement and estimated speed-up vs
# per_turn on a few boundaries), then SDPA at 32K for comparison. Needs torch with CUDA and FlexAttention (>= 2.5),
# transformers with Qwen2, and this repository (nothing is downloaded: the model is random, built locally).
#
# Usage:  bash scripts/gpu_check_scoring.sh [extra args for gpu_check_scoring.py, e.g. --preset 1.5b]
# Env:    PYTHON (interpreter; default .venv/bin/python if present, else python3), CHECK_TIMEOUT_S (default 540),
#         OUT (if set, the log is also written to $OUT/gpu_check_scoring.log).
# Exit:   0 all checks passed; 1 a check failed (see [FAIL] lines); 2 no CUDA device or a missing dependency;
#         124 the time limit was hit (the log shows how far it got; rerun with --lengths 32768,65536 or
#         --per-turn-samples 2 to shorten).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
LOG="${OUT:-/tmp}/gpu_check_scoring.log"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! "$PY" - <<'PY'
import sys
try:
    import torch, transformers  # noqa: F401
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
except Exception as error:  # report which dependency is missing, then exit 2
    print(f"[FAIL] dependency: {type(error).__name__}: {error}")
    sys.exit(2)
if not torch.cuda.is_available():
    print(f"[FAIL] torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})")
    sys.exit(2)
print(f"torch {torch.__version__} CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}; "
      f"transformers {transformers.__version__}")
PY
then
  echo "gpu_check_scoring: environment check failed (exit 2); nothing was run"
  exit 2
fi

advantage_ok=1
if ! "$PY" -m pytest -q -p no:cacheprovider tests/test_advantage.py -k cuda 2>&1 | tail -3 | tee "$LOG"; then
  echo "[FAIL] advantage on CUDA (tests/test_advantage.py -k cuda)" | tee -a "$LOG"
  advantage_ok=0
fi
timeout "${CHECK_TIMEOUT_S:-540}" "$PY" scripts/gpu_check_scoring.py "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
[[ $status == 0 && $advantage_ok == 0 ]] && status=1
case $status in
  0) echo "gpu_check_scoring: all checks passed (log: $LOG)";;
  1) echo "gpu_check_scoring: some checks FAILED, see [FAIL] lines (log: $LOG)";;
  124) echo "gpu_check_scoring: time limit ${CHECK_TIMEOUT_S:-540}s hit; partial results above (log: $LOG)";;
  *) echo "gpu_check_scoring: crashed with exit $status (log: $LOG)";;
esac
exit $status
