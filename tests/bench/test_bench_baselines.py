"""The baselines scripts/bench/bench_advantage.py times against: the vectorised torch version a user would write must
give the reference loop's advantages, or the speed-up against it would compare different computations."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from reference_advantage import random_batch, reference_advantage  # noqa: E402
from vectorized_advantage import vectorized_advantage  # noqa: E402


@pytest.mark.parametrize("norm_mode", ["joint", "separate", "scaled_separate"])
@pytest.mark.parametrize("seed", [0, 1])
def test_vectorized_matches_the_loop(norm_mode, seed):
    rewards, F, I, m, group, _ = random_batch(4, 4, 300, 12, seed=seed, outcome="continuous")
    want = reference_advantage(rewards, F, I, m, group, norm_mode=norm_mode, gamma=0.9)
    got = vectorized_advantage(rewards, F, I, m, group, norm_mode=norm_mode, gamma=0.9)
    assert got.dtype == rewards.dtype and got.shape == want.shape
    assert (got.double() - want).abs().max().item() < 1e-5


def test_vectorized_with_one_group_and_a_single_boundary_row():
    rewards, F, I, m, _, _ = random_batch(1, 3, 50, 1, seed=3)
    group = torch.zeros(3, dtype=torch.long)
    want = reference_advantage(rewards, F, I, m, group)
    assert (vectorized_advantage(rewards, F, I, m, group).double() - want).abs().max().item() < 1e-5


def test_bench_advantage_prints_the_machine_rounds_and_its_last_line():
    """A small run of the benchmark itself: machine line first, min / median / max, the last line's format."""
    import re
    import subprocess

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_advantage.py"
    run = subprocess.run([sys.executable, str(script), "--groups", "2", "--group-size", "2", "--length", "256",
                          "--max-turns", "6", "--rounds", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "load average at start" in lines[0]
    assert any("min" in line and "max" in line and "3 rounds" in line for line in lines)
    assert re.fullmatch(r"advantage: speedup_vs_vectorized=[\d.]+ speedup_vs_loop=[\d.]+ "
                        r"fraction_of_memory_floor=[\d.]+ max_abs_diff=[\d.e+-]+", lines[-1]), lines[-1]
