"""Benchmark teacher-forced answer scoring: ``packed`` against ``per_turn`` in one run, then ``packed`` at long context.

Part 1 (same process, same random-weight model, fp32, 2 threads): L=4096 tokens, K=64 boundaries spread evenly over
the trajectory (b_k = k·L/K), one probe of A=16 tokens whose last 8 tokens are the GT span. Both strategies score
every boundary. The machine is shared and its load drifts, so timing is interleaved: in each of R rounds, one full
``packed`` pass and ``per_turn`` on every R-th boundary (the rounds together cover all K once). Each round gives a
ratio (its per_turn time scaled by K/|subset|, over its packed time); the headline speed-up is the median of those
ratios, robust to load spikes in either strategy; the ratio of totals is printed too. max_abs_diff compares the two
[K, P] outputs.
Part 2 (a fresh subprocess, so its peak RSS is its own): ``packed`` alone at L=32768, K=200; we report the
subprocess's peak resident memory (whole process: Python + torch + model + scoring) in GB.

The model is a Qwen2 built locally from ``Qwen2Config`` (4 layers, hidden 256, 4 heads, 2 K/V heads, vocab 4096).
Last line: ``scoring: speedup_vs_per_turn=<x>x max_abs_diff=<d> peak_mem_gb_L32k_K200=<m>``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from igpo.core.ground_truth import Probe  # noqa: E402
from igpo.core.scoring import ScoringConfig, score_answer_logprobs, scoring_cost  # noqa: E402

VOCAB = 4096


def build_model(max_positions: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).eval()


def workload(length: int, n_boundaries: int, probe_len: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    trajectory = torch.randint(0, VOCAB, (length,), generator=generator)
    boundaries = [(k + 1) * length // n_boundaries for k in range(n_boundaries)]
    probe = Probe(token_ids=torch.randint(0, VOCAB, (probe_len,), generator=generator).tolist(),
                  span=(probe_len // 2, probe_len))
    return trajectory, boundaries, [probe]


def timed(model, trajectory, boundaries, probes, cfg):
    start = time.perf_counter()
    out = score_answer_logprobs(model, trajectory, boundaries, probes, cfg)
    return out, time.perf_counter() - start


def long_run(length: int, n_boundaries: int, probe_len: int) -> None:
    """Child process: packed only; prints one JSON line with its own peak RSS."""
    torch.set_num_threads(2)
    model = build_model(length + probe_len)
    trajectory, boundaries, probes = workload(length, n_boundaries, probe_len, seed=1)
    base_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out, seconds = timed(model, trajectory, boundaries, probes, ScoringConfig())
    if not torch.isfinite(out).all():
        raise SystemExit("long run produced non-finite scores")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_gb": peak_gb, "before_scoring_gb": base_gb,
                      "tokens": scoring_cost(boundaries, probes).tokens_packed}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--boundaries", type=int, default=64)
    parser.add_argument("--probe-len", type=int, default=16)
    parser.add_argument("--long-length", type=int, default=32768)
    parser.add_argument("--long-boundaries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        long_run(args.long_length, args.long_boundaries, args.probe_len)
        return

    torch.set_num_threads(2)
    model = build_model(args.length + args.probe_len)
    trajectory, boundaries, probes = workload(args.length, args.boundaries, args.probe_len)
    cost = scoring_cost(boundaries, probes)
    score_answer_logprobs(model, trajectory, boundaries[:2], probes, ScoringConfig())  # warm-up (allocator, kernels)
    # The CPU is shared, so load drifts during the run: interleave the two strategies in R rounds, each round timing
    # one full packed pass and per_turn on every R-th boundary; per_turn's total covers all K boundaries exactly once.
    rounds = args.rounds
    reference = torch.empty(args.boundaries, len(probes))
    t_packed, t_parts, ratios = [], [], []
    for r in range(rounds):
        packed, seconds = timed(model, trajectory, boundaries, probes, ScoringConfig(strategy="packed"))
        t_packed.append(seconds)
        subset = boundaries[r::rounds]
        reference[r::rounds], part = timed(model, trajectory, subset, probes, ScoringConfig(strategy="per_turn"))
        t_parts.append(part)
        # This round's per_turn time scaled to all K boundaries, over this round's packed time.
        ratios.append(part * len(boundaries) / len(subset) / seconds)
    speedup = sorted(ratios)[rounds // 2] if rounds % 2 else sum(sorted(ratios)[rounds // 2 - 1:rounds // 2 + 1]) / 2
    max_abs_diff = (packed - reference).abs().max().item()
    print(f"L={args.length} K={args.boundaries} A={args.probe_len}: tokens packed={cost.tokens_packed} "
          f"per_turn={cost.tokens_per_turn} (ratio {cost.tokens_per_turn / cost.tokens_packed:.1f}x)")
    print(f"  packed per round: {', '.join(f'{t:.2f}' for t in t_packed)} s")
    print(f"  per_turn per round (every {rounds}th boundary): {', '.join(f'{t:.2f}' for t in t_parts)} s "
          f"(total {sum(t_parts):.1f}s for all {args.boundaries})")
    print(f"  speedup per round: {', '.join(f'{x:.1f}' for x in ratios)}; median {speedup:.1f}x; "
          f"ratio of totals {sum(t_parts) / (sum(t_packed) / rounds):.1f}x; max_abs_diff {max_abs_diff:.2e}")

    child = subprocess.run([sys.executable, __file__, "--child", "--long-length", str(args.long_length),
                            "--long-boundaries", str(args.long_boundaries), "--probe-len", str(args.probe_len)],
                           capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"long run failed (exit {child.returncode}):\n{child.stderr[-4000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"L={args.long_length} K={args.long_boundaries} A={args.probe_len}: packed {result['seconds']:.1f}s, "
          f"{result['tokens']} tokens; peak RSS {result['peak_gb']:.2f} GB "
          f"({result['before_scoring_gb']:.2f} GB before scoring)")
    print(f"scoring: speedup_vs_per_turn={speedup:.1f}x max_abs_diff={max_abs_diff:.1e} "
          f"peak_mem_gb_L32k_K200={result['peak_gb']:.2f}")


if __name__ == "__main__":
    main()
