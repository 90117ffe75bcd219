"""Benchmark: vectorized IGPO advantage vs the per-sample float64 reference loop, in one run.

Batch: B=256 trajectories (32 groups x 8 rollouts), L=32768 response tokens, 1..200 turns each, scaled_separate,
gamma=0.95 (DR-Venus defaults) with format penalties. Prints the headline figure as the last line:
    advantage: speedup_vs_loop=<x>x max_abs_diff=<d>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from reference_advantage import random_batch, reference_advantage  # noqa: E402

from igpo.core.advantage import AdvantageConfig, compute_igpo_advantage  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--max-turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = fair to the loop)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = random_batch(args.groups, args.group_size, args.length, args.max_turns, seed=0, penalty_frac=0.05)
    rewards, F, I, m, group, pen = batch
    cfg = AdvantageConfig()
    turns = (F | I | (pen != 0)).sum(1).float()
    print(f"batch: B={rewards.shape[0]} L={rewards.shape[1]} boundaries/trajectory mean={turns.mean():.1f} "
          f"max={int(turns.max())}; mode={cfg.norm_mode} gamma={cfg.gamma}; threads={args.threads}")

    compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen)  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        adv, _, _ = compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen)
        times.append(time.perf_counter() - t0)
    t_vec = statistics.median(times)

    t0 = time.perf_counter()
    ref = reference_advantage(rewards, F, I, m, group, norm_mode=cfg.norm_mode, gamma=cfg.gamma, penalty=pen)
    t_ref = time.perf_counter() - t0
    diff = (adv.double() - ref).abs().max().item()
    print(f"vectorized: {t_vec * 1e3:.1f} ms (median of {args.repeats}); reference loop: {t_ref * 1e3:.1f} ms "
          "(full batch, timed once)")
    print(f"advantage: speedup_vs_loop={t_ref / t_vec:.1f}x max_abs_diff={diff:.2e}")


if __name__ == "__main__":
    main()
