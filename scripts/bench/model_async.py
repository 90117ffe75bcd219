"""A model, not a measurement: what ``igpo_colocate_async`` can buy over ``igpo_sync`` on a GPU node, from the step
phases and the tool latency, checked against the CPU benchmark (scripts/bench/bench_async.py).

    python scripts/bench/model_async.py [--latency search=1:10] [--calls 10 30] [--trajectories 512] [--gen-s 0.5]
                                  [--update-s 60 180 600]

The schedule, step by step. A trajectory i makes K tool calls; its rollout takes D_i = Σ_k (ℓ_ik + g): each call's
latency ℓ (log-normal, the tool server's --latency p50:p99) plus the generation of the turn before it (g seconds on the
rollout engine). A step trains N trajectories and spends U seconds on everything after the batch is complete (log-
probs, advantage with its scoring passes, update, weight sync).

    synchronous:   S = E[max_i D_i] + U        the batch waits for its slowest trajectory, then trains
    colocate async, one warm-up batch (2N trajectories in flight, generation paused during U, tool calls not):
                   A >= max(U, E[D] / 2)       a step cannot train faster than it updates, and with 2N in flight N
                                               finish no faster than one every E[D] / (2N) seconds on average

so S / A <= (E[max D] + U) / max(U, E[D] / 2): an upper bound on the speed-up, not a prediction. It grows with the
spread of trajectory durations (the tail that the synchronous step waits for) and shrinks as the update time U
dominates; the real schedule also pays for pausing, resuming and the weight sync, and trains the quicker trajectories
of a step first. Expectations are Monte Carlo estimates (--draws batches, seeded). The last line is the largest bound.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

Z99 = 2.3263478740408408


def durations(rng: np.random.Generator, specs: list[tuple[float, float]], calls: int, gen_s: float, n: int,
              draws: int) -> np.ndarray:
    """[draws, n] trajectory durations: ``calls`` calls each, cycling through the tools' (p50, p99) specs."""
    total = np.full((draws, n), calls * gen_s)
    for k in range(calls):
        p50, p99 = specs[k % len(specs)]
        sigma = math.log(p99 / p50) / Z99
        total += p50 * np.exp(sigma * rng.standard_normal((draws, n)))
    return total


def bound(expected_max: float, expected_mean: float, update_s: float) -> tuple[float, float, float]:
    sync = expected_max + update_s
    async_floor = max(update_s, expected_mean / 2)
    return sync, async_floor, sync / async_floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", action="append", default=None, help="TOOL=P50:P99 seconds (default search=1:10)")
    parser.add_argument("--calls", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--gen-s", type=float, default=0.5, help="generation seconds per turn on the GPU engine")
    parser.add_argument("--update-s", type=float, nargs="+", default=[60.0, 180.0, 600.0])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    specs = []
    for text in args.latency or ["search=1:10"]:
        _, values = text.split("=", 1)
        p50, p99 = (float(v) for v in values.split(":"))
        specs.append((p50, p99))
    rng = np.random.default_rng(args.seed)
    print(f"Model: latency {', '.join(args.latency or ['search=1:10'])}, N = {args.trajectories} trajectories a step, "
          f"g = {args.gen_s} s a turn; S = E[max D] + U, A >= max(U, E[D]/2).")
    print("| calls per trajectory | E[D] s | E[max D] s | U s | sync step s | async floor s | speed-up bound |")
    print("|---|---|---|---|---|---|---|")
    best = 0.0
    for calls in args.calls:
        d = durations(rng, specs, calls, args.gen_s, args.trajectories, args.draws)
        expected_max, expected_mean = float(d.max(axis=1).mean()), float(d.mean())
        for update_s in args.update_s:
            sync, floor, ratio = bound(expected_max, expected_mean, update_s)
            best = max(best, ratio)
            print(f"| {calls} | {expected_mean:.1f} | {expected_max:.1f} | {update_s:.0f} | {sync:.1f} | {floor:.1f} | "
                  f"{ratio:.2f}x |")
    print(f"largest modelled speed-up bound: {best:.2f}x")


if __name__ == "__main__":
    main()
