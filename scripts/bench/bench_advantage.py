"""Benchmark: the registered IGPO estimator against the two baselines a user would write, and the memory floor.

Batch: B=256 trajectories (32 groups x 8 rollouts), L=32768 response tokens, 1..200 turns each, scaled_separate,
gamma=0.95 (DR-Venus defaults). No exact-zero IG and no format penalties, so that the reference convention that
stock verl's call implies (outcome at the last response token, IG at the other non-zero ones) places the rewards
exactly where the baselines' explicit masks do; the script checks that before timing.

Sides, timed interleaved round by round (each side once per round, after one warm-up call), on one thread by default
(verl runs the trainer in a Ray actor with one CPU):
    verl:       stock verl's call of the registered estimator, ``core_algos.get_adv_estimator_fn("igpo")(
                token_level_rewards=, response_mask=, config=, index=)`` on dense inputs (rewards [B, L] float32,
                response_mask [B, L] bool, uid strings, the ``algorithm`` DictConfig). Everything the estimator does
                is inside the timing: reading the config, mapping uids to groups, finding the reward positions, the
                turn-level math, writing the advantages.
    vectorized: ``tests/support/vectorized_advantage.vectorized_advantage``: the plain-torch version a competent user would
                write (nonzero, bincount z-scores, a discount matrix, cumsum + gather onto the tokens). It is given the
                explicit outcome / IG masks, so it skips the search for reward positions that verl's call does: the
                speed-up against it is conservative.
    loop:       ``tests/support/reference_advantage.reference_advantage``, the per-sample float64 loop in the reference's
                shape, on the same rewards, explicit masks and response mask.
    floor:      the bytes the estimator must move, moved once: one streaming pass that reads every input byte once
                (rewards and response mask, 40 MiB: every reward must be read, since a non-zero reward off the mask
                is an error) and writes a fresh output (``np.zeros``, as the estimator allocates it) only up to each
                row's last response token (the padding after it stays untouched zero pages, as the estimator leaves
                it); a numba loop that LLVM vectorizes.
    turns:      ``advantage_at_boundaries(turn_boundaries(...))`` from what the rollout records per turn, as the
                igpo_sync trainer calls it. NOT timed: building the per-turn records from the dense batch.
Stages of the verl call, timed in the same rounds, to show where its time goes: ``boundaries_from_token_rewards``
(the one pass over the inputs that finds the reward positions), ``advantage_at_boundaries`` (turn-level math, then
writing the advantages onto fresh zero pages), the floor's read pass alone (the 40 MiB read, nothing written); the
rest of the verl call (config, uids, checks) is the difference.

Reported per round: speedup_vs_vectorized = vectorized / verl, speedup_vs_loop = loop / verl,
fraction_of_memory_floor = floor / verl (1.0 = the estimator runs at the speed of moving its bytes once); each as
median (min, max) over the rounds (21 by default); fraction_of_memory_floor also from each side's fastest round
(the least disturbed one). The last line gives the medians. Goals: >= 10x vs vectorized, >= 0.8 of the floor,
max_abs_diff <= 1e-5. The script exits 1 when the estimator's or the vectorized baseline's max_abs_diff against the
loop exceeds 1e-5. Last line:
    advantage: speedup_vs_vectorized=<x> speedup_vs_loop=<y> fraction_of_memory_floor=<f> max_abs_diff=<d>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import verl  # noqa: E402,F401  (loads the igpo plugin, which registers the estimator)
from benchmark_report import Rounds, check_rounds, machine_line  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from reference_advantage import random_batch, reference_advantage  # noqa: E402
from vectorized_advantage import vectorized_advantage  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from igpo.core.advantage import (  # noqa: E402
    AdvantageConfig,
    advantage_at_boundaries,
    boundaries_from_token_rewards,
    masks_from_token_rewards,
)
from igpo.core.info_gain import turn_boundaries  # noqa: E402

MAX_ABS_DIFF = 1e-5


@numba.njit(nogil=True)
def _last_response_token(mask_row) -> int:
    """Index after the last non-zero byte (0 if none): a backward scan in 64-byte chunks, reading only the padding."""
    end = mask_row.shape[0]
    while end > 0:
        start = max(0, end - 64)
        chunk = mask_row[start:end]
        x = 0
        for j in range(chunk.shape[0]):
            x |= chunk[j]
        if x:
            break
        end = start
    while end > 0 and mask_row[end - 1] == 0:
        end -= 1
    return end


@numba.njit(nogil=True)
def _floor_pass(rewards, bits, mask, out):
    """Per row: out[:end] = rewards * mask up to the last response token (reads those rewards and mask bytes), then
    the rewards after it OR-reduced (read, nothing written); returns the OR so the reads cannot be dropped."""
    seen = 0
    for i in range(rewards.shape[0]):
        m = mask[i]
        end = _last_response_token(m)
        o, r, mv = out[i, :end], rewards[i, :end], m[:end]
        for t in range(end):
            o[t] = r[t] * mv[t]
        tail = bits[i, end:]
        x = 0
        for t in range(tail.shape[0]):
            x |= tail[t]
        seen |= x
    return seen


@numba.njit(nogil=True)
def _read_pass(bits, mask):
    """The floor's reads alone: every reward and mask byte once, OR-reduced."""
    seen = 0
    for i in range(bits.shape[0]):
        b, m = bits[i], mask[i]
        x = 0
        for t in range(b.shape[0]):
            x |= b[t] | m[t]
        seen |= x
    return seen


def thp_counters() -> dict[str, int]:
    """The kernel's transparent-huge-page fault counters (/proc/vmstat; empty where unreadable): a fresh output's
    writes cost far more when its faults fall back to 4 KiB pages, and the floor is mostly those writes."""
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {k: int(v) for k, v in pairs if k in ("thp_fault_alloc", "thp_fault_fallback")}
    except OSError:
        return {}


def memory_floor(rewards: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    out = np.zeros(tuple(rewards.shape), np.float32)
    _floor_pass(rewards.numpy(), rewards.numpy().view(np.int32), mask.view(torch.uint8).numpy(), out)
    return out


def turn_records(rewards, F, I, m, pen):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--max-turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=21,
                        help="timed rounds (>= 3); every side runs once per round (a round is ~0.6 s, most of it the "
                             "loop; the 10-ms sides vary by 2x between rounds, so the median needs many)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = verl's one-CPU trainer actor)")
    args = parser.parse_args()
    check_rounds(args.rounds)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))

    rewards, F, I, m, group, _ = random_batch(args.groups, args.group_size, args.length, args.max_turns, seed=0,
                                              ig_zero_frac=0.0)
    derived_f, derived_i = masks_from_token_rewards(rewards, m)
    if not (torch.equal(derived_f, F) and torch.equal(derived_i, I)):
        raise SystemExit("the batch has reward positions that verl's convention cannot see (an exact-zero IG); the "
                         "comparison would not be like for like. Build it with ig_zero_frac=0.")
    uid = np.array([f"prompt-{int(g)}" for g in group], dtype=object)  # verl's non_tensor_batch["uid"]
    algorithm = OmegaConf.create({"adv_estimator": "igpo", "gamma": 0.95, "norm_adv_by_std_in_grpo": True,
                                  "igpo": {"norm_mode": "scaled_separate"}})
    cfg = AdvantageConfig(gamma=0.95)
    estimator = core_algos.get_adv_estimator_fn("igpo")
    records = turn_records(rewards, F, I, m, torch.zeros_like(rewards))
    dense_group = torch.unique(group, return_inverse=True)[1]
    bits, mask_bytes = rewards.numpy().view(np.int32), m.view(torch.uint8).numpy()
    K = (F | I).sum(1).float()
    print(f"batch: B={rewards.shape[0]} L={rewards.shape[1]} boundaries/trajectory mean={K.mean():.1f} "
          f"max={int(K.max())}; response tokens {m.float().mean():.1%} of the grid; mode={cfg.norm_mode} "
          f"gamma={cfg.gamma}")

    sides = {
        "floor": lambda: memory_floor(rewards, m),
        "verl": lambda: estimator(token_level_rewards=rewards, response_mask=m, config=algorithm, index=uid)[0],
        "vectorized": lambda: vectorized_advantage(rewards, F, I, m, group, norm_mode=cfg.norm_mode, gamma=cfg.gamma),
        "turns": lambda: advantage_at_boundaries(turn_boundaries(*records), m, group, cfg)[0],
        "stage:positions": lambda: boundaries_from_token_rewards(rewards, m),
        "stage:turn_math+write": lambda: advantage_at_boundaries(
            positions, m, dense_group, cfg, with_metrics=False)[0],
        "floor:read": lambda: _read_pass(bits, mask_bytes),
        "loop": lambda: reference_advantage(rewards, F, I, m, group, norm_mode=cfg.norm_mode, gamma=cfg.gamma),
    }
    positions = boundaries_from_token_rewards(rewards, m)[0]
    seconds = {name: Rounds() for name in sides}
    result = {name: fn() for name, fn in sides.items()}  # warm-up: numba loads or compiles its kernels
    thp_before = thp_counters()
    for _ in range(args.rounds):
        for name, fn in sides.items():
            result[name] = None  # the previous result is freed here, outside the timing (~4 ms for 32 MiB)
            t0 = time.perf_counter()
            result[name] = fn()
            seconds[name].append(time.perf_counter() - t0)

    thp_after = thp_counters()
    ref = result["loop"]
    diff = {name: (result[name].double() - ref).abs().max().item() for name in ("verl", "vectorized", "turns")}
    ratio = {
        "vectorized": Rounds(v / e for v, e in zip(seconds["vectorized"].values, seconds["verl"].values)),
        "loop": Rounds(v / e for v, e in zip(seconds["loop"].values, seconds["verl"].values)),
        "floor": Rounds(v / e for v, e in zip(seconds["floor"].values, seconds["verl"].values)),
        "turns_vs_loop": Rounds(v / e for v, e in zip(seconds["loop"].values, seconds["turns"].values)),
    }
    for name, values in seconds.items():
        print(f"  {name:22s} {Rounds(t * 1e3 for t in values.values).describe('.1f', ' ms')}")
    rest = Rounds(v - p - w for v, p, w in zip(seconds["verl"].values, seconds["stage:positions"].values,
                                                seconds["stage:turn_math+write"].values))
    print(f"  where verl's call goes (medians): finding the reward positions {seconds['stage:positions'].median * 1e3:.1f} "
          f"ms (the floor's read of the same 40 MiB alone: {seconds['floor:read'].median * 1e3:.1f} ms), turn-level "
          f"math + writing the advantages {seconds['stage:turn_math+write'].median * 1e3:.1f} ms, the rest (config, "
          f"uids, checks) {rest.median * 1e3:.1f} ms; floor {seconds['floor'].median * 1e3:.1f} ms")
    if thp_after:
        print("  huge-page faults over the timed rounds, all sides (each side's fresh output is faulted in while timed; "
              "4 KiB fallbacks would make those writes slower): "
              + ", ".join(f"{k} +{thp_after[k] - thp_before.get(k, 0)}" for k in sorted(thp_after)))
    print(f"  max_abs_diff vs the loop: verl {diff['verl']:.2e}, vectorized {diff['vectorized']:.2e}, "
          f"turn records {diff['turns']:.2e}")
    print(f"  speedup_vs_vectorized {ratio['vectorized'].describe('.1f', 'x')}")
    print(f"  speedup_vs_loop {ratio['loop'].describe('.1f', 'x')}")
    print(f"  fraction_of_memory_floor {ratio['floor'].describe('.2f')}; from each side's fastest round "
          f"{min(seconds['floor'].values) / min(seconds['verl'].values):.2f}")
    print(f"  turn records (igpo_sync's entry; records built outside the timing, no search for reward positions): "
          f"speedup_vs_loop {ratio['turns_vs_loop'].describe('.1f', 'x')}")
    print(f"advantage: speedup_vs_vectorized={ratio['vectorized'].median:.1f} speedup_vs_loop={ratio['loop'].median:.1f} "
          f"fraction_of_memory_floor={ratio['floor'].median:.2f} max_abs_diff={diff['verl']:.2e}")
    worst = max(diff.values())
    if worst > MAX_ABS_DIFF:
        print(f"FAIL: max_abs_diff {worst:.2e} > {MAX_ABS_DIFF:g} against the reference loop ({diff}); an "
              "implementation disagrees with the reference (run tests/core/test_advantage.py and "
              "tests/bench/test_bench_baselines.py).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
