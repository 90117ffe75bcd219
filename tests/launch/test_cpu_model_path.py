"""A model given by MODEL_PATH to the CPU demo is used as it is and its digest printed, as for a built one: the turn
credit comparison's model kept in git (results/turn_credit/model_A2) trains the same weights on any CPU type."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "results" / "turn_credit" / "model_A2"


def test_the_cpu_demo_prints_the_digest_of_a_model_given_by_model_path():
    env = {**os.environ, "IGPO_DEVICE": "cpu", "MODEL_PATH": str(PINNED)}
    proc = subprocess.run(["bash", "train_igpo.sh", "--dry-run", "demo.task=chain"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "igpo: demo model sha256 ab3e9e6bcc97c34a (MODEL_PATH)" in lines, proc.stdout
    assert any(line.endswith(f"tiny model at {PINNED})") for line in lines), proc.stdout
    assert not any("preparing the tiny demo model" in line for line in lines)  # nothing built
