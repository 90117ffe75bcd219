"""scripts/bench/bench_step.py at a small size: the tiny demo model, one question x 4 samples, one round. The script's
own checks pass (finite advantages, information gain where it exists, rollout-side and actor-side answer log-probs
within 1e-4), it prints its table, and its last line carries every ratio, each a plausible step ratio."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench" / "bench_step.py"
TINY = REPO / ".cache" / "tiny_demo_warm" / "model.safetensors"


@pytest.mark.skipif(not TINY.is_file(), reason="the CPU demo's model is built by scripts/test.sh (train_igpo.sh "
                                              "--dry-run)")
def test_bench_step_times_every_phase_and_reports_the_step_ratios():
    run = subprocess.run([sys.executable, str(SCRIPT), "--models", "tiny", "--rounds", "1", "--questions", "1"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "load average at start" in lines[0]
    assert re.search(r"^tiny: 4 trajectories \(1 question x 4\)", run.stdout, re.M), run.stdout
    assert re.search(r"max \|diff\| [\d.e+-]+ \(tolerance 0\.0001\)", run.stdout), run.stdout
    header = next(line for line in lines if line.strip().startswith("phase "))
    assert header.split() == ["phase", "GRPO", "IGPO", "InfoPO", "GiGPO", "IGPO", "rollout-side"]
    for phase in ("rollout*", "reward*", "scoring", "advantage", "old log-probs*", "ref log-probs*", "update*"):
        assert any(line.strip().startswith(phase + " ") for line in lines), phase
    m = re.fullmatch(r"step: ig_step_overhead=([\d.]+) scoring_share=([\d.]+) infopo_step_overhead=([\d.]+) "
                     r"gigpo_step_overhead=([\d.]+) ig_step_overhead_rollout_side=([\d.]+) model=tiny", lines[-1])
    assert m, lines[-1]
    ig, share, infopo, gigpo, rollout_side = map(float, m.groups())
    # Every method's step holds GRPO's shared phases plus its own: a ratio far below 1 would mean a phase was lost.
    assert 0.9 < ig < 20 and 0.9 < infopo < 20 and 0.9 < gigpo < 20 and 0.3 < rollout_side < 20
    assert 0 < share < 1
