"""Benchmark: vectorized IGPO advantage vs the per-sample float64 reference loop, in one run.

Batch: B=256 trajectories (32 groups x 8 rollouts), L=32768 response tokens, 1..200 turns each, scaled_separate,
gamma=0.95 (DR-Venus defaults) with format penalties. Both sides are timed as the best of N runs (the machine is
shared and noisy; the minimum is the most repeatable statistic, and the same one is used for both), on one thread
by default (verl runs the trainer in a Ray actor with one CPU, so one thread is what the estimator gets there).

Two entry points are timed against the same reference and checked against its output:
    turns:  turn_boundaries + advantage_at_boundaries from what the rollout records, per-turn tensors [B, T] (turn
            ends, IG, penalty) plus the outcome, as the igpo_sync trainer calls it every step. The placement of the
            rewards on tokens is inside the timing; the reference is handed it ready-made as dense tensors.
    masks:  compute_igpo_advantage from those dense [B, L] rewards, outcome/IG masks and penalties (the reference's
            own inputs; stock verl's estimator call). On top of the turns entry's work it finds the reward positions
            by streaming the 48 MiB of outcome/IG masks and penalties (~3-4 ms on one core here). Both entries write
            a fresh 32 MiB output; faulting those pages in costs ~3 ms of their time.
The last line is the trainer's entry (the line above it gives the masks entry):
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

from igpo.core.advantage import AdvantageConfig, advantage_at_boundaries, compute_igpo_advantage  # noqa: E402
from igpo.core.info_gain import turn_boundaries  # noqa: E402


def turn_tensors(rewards, F, I, m, pen):
    """The batch as the rollout records it: per tool turn its end token, IG (if scored) and penalty; the outcome and
    its token. Built once, outside the timing."""
    B = rewards.shape[0]
    turn_pos = [torch.nonzero((I[i] | (pen[i] != 0)) & ~F[i]).flatten() for i in range(B)]
    T = max(1, max(len(p) for p in turn_pos))
    ends = torch.zeros(B, T, dtype=torch.long)
    ig = torch.zeros(B, T)
    ig_mask = torch.zeros(B, T, dtype=torch.bool)
    penalty = torch.zeros(B, T)
    for i, p in enumerate(turn_pos):
        ends[i, :len(p)], ig[i, :len(p)], ig_mask[i, :len(p)], penalty[i, :len(p)] = p, rewards[i, p], I[i, p], pen[i, p]
    has = F.any(1)
    outcome_pos = torch.where(has, F.to(torch.uint8).argmax(1), -1)
    outcome = rewards.gather(1, outcome_pos.clamp(min=0)[:, None]).squeeze(1)
    return ig, ig_mask, penalty, ends, outcome, outcome_pos, m


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

    turns = turn_tensors(rewards, F, I, m, pen)

    def from_masks():
        return compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen)[0]

    def from_turns():
        return advantage_at_boundaries(turn_boundaries(*turns), m, group, cfg)[0]

    from_masks(), from_turns()  # warm-up (numba loads its compiled kernels on first use)
    t_masks, adv_masks = best_of(args.repeats, from_masks)
    t_turns, adv_turns = best_of(args.repeats, from_turns)
    t_ref, ref = best_of(args.ref_repeats, lambda: reference_advantage(rewards, F, I, m, group, norm_mode=cfg.norm_mode,
                                                                       gamma=cfg.gamma, penalty=pen))
    diff_masks = (adv_masks.double() - ref).abs().max().item()
    diff_turns = (adv_turns.double() - ref).abs().max().item()
    print(f"reference loop: {t_ref * 1e3:.1f} ms (best of {args.ref_repeats}); vectorized (best of {args.repeats}): "
          f"masks {t_masks * 1e3:.1f} ms, turns {t_turns * 1e3:.1f} ms")
    print(f"advantage (masks entry): speedup_vs_loop={t_ref / t_masks:.1f}x max_abs_diff={diff_masks:.2e}")
    print(f"advantage: speedup_vs_loop={t_ref / t_turns:.1f}x max_abs_diff={diff_turns:.2e}")


if __name__ == "__main__":
    main()
