"""Benchmark: vectorized IGPO advantage vs the per-sample float64 reference loop, in one run.

Batch: B=256 trajectories (32 groups x 8 rollouts), L=32768 response tokens, 1..200 turns each, scaled_separate,
gamma=0.95 (DR-Venus defaults) with format penalties. Both sides are timed as the best of N runs (the machine is
shared and noisy; the minimum is the most repeatable statistic, and the same one is used for both). Prints the
headline figure as the last line:
    advantage: speedup_vs_loop=<x>x max_abs_diff=<d>
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--repeats", type=int, default=15, help="runs of the vectorized version (best is reported)")
    parser.add_argument("--ref-repeats", type=int, default=3, help="runs of the reference loop (best is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = fair to the loop)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = random_batch(args.groups, args.group_size, args.length, args.max_turns, seed=0, penalty_frac=0.05)
    rewards, F, I, m, group, pen = batch
    cfg = AdvantageConfig()
    turns = (F | I | (pen != 0)).sum(1).float()
    print(f"batch: B={rewards.shape[0]} L={rewards.shape[1]} boundaries/trajectory mean={turns.mean():.1f} "
          f"max={int(turns.max())}; mode={cfg.norm_mode} gamma={cfg.gamma}; threads={args.threads}")

    def best_of(n, fn):
        best, result = float("inf"), None
        for _ in range(n):
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
        return best, result

    compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen)  # warm-up
    t_vec, (adv, _, _) = best_of(args.repeats, lambda: compute_igpo_advantage(rewards, F, I, m, group, cfg,
                                                                            penalty=pen))
    t_ref, ref = best_of(args.ref_repeats, lambda: reference_advantage(rewards, F, I, m, group, norm_mode=cfg.norm_mode,
                                                                       gamma=cfg.gamma, penalty=pen))
    diff = (adv.double() - ref).abs().max().item()
    print(f"vectorized: {t_vec * 1e3:.1f} ms (best of {args.repeats}); reference loop: {t_ref * 1e3:.1f} ms "
          f"(best of {args.ref_repeats})")
    print(f"advantage: speedup_vs_loop={t_ref / t_vec:.1f}x max_abs_diff={diff:.2e}")


if __name__ == "__main__":
    main()
