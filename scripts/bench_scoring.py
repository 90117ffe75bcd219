"""Benchmark teacher-forced answer scoring: ``packed`` against two baselines, ``kv_reuse`` and ``per_turn``.

Strategies (same random-weight model, fp32, same inputs; the scoring path is igpo.core.scoring's public API):
    packed:   ``score_answer_logprobs`` with ``ScoringConfig(strategy="packed")`` (one shared-prefix pass).
    kv_reuse: the reference's way: one HF prefill of the trajectory into a ``DynamicCache``, then each probe against
              the cache cropped to its boundary (boundaries in decreasing order, so ``crop`` only ever shortens the
              cache and no copy is made); the probe's tokens are appended and cropped away again by the next crop.
    per_turn: ``ScoringConfig(strategy="per_turn")``: one full forward of context[:b] + probe per boundary.

Part 1, speed (this process, 2 threads): L=4096 tokens, K=64 boundaries spread evenly (b_k = k·L/K), one probe of
A=16 tokens whose last 8 tokens are the GT span. The machine is shared and its load drifts, so timing is
interleaved: each of R rounds runs one full ``packed`` pass, one full ``kv_reuse`` pass, and ``per_turn`` on every
R-th boundary (the rounds together cover all K once). Each round gives a ratio per baseline (baseline time, per_turn
scaled by K/|subset|, over the round's packed time); a speed-up is the median of those ratios. max_abs_diff is the
largest difference of either baseline's [K, P] scores from packed's; the script exits 1 above 1e-5.

Part 2, memory (one fresh subprocess per strategy and length): packed and kv_reuse at L=4096/K=64 and
L=32768/K=200. Memory is MEASURED, not computed: with the model and inputs loaded, the subprocess returns freed heap
to the OS (malloc_trim), resets its peak-RSS counter (/proc/self/clear_refs 5) and scores once; the scoring's own
peak working memory (activations, masks, K/V cache, logits) is the peak RSS then (VmHWM) minus the RSS before
(VmRSS), as the OS saw it. peak_mem_ratio = packed / kv_reuse.

The model is a Qwen2 built locally from ``Qwen2Config`` (4 layers, hidden 256, 4 heads, 2 K/V heads, vocab 4096).
Last line (goals: speedup_vs_per_turn >= 20, speedup_vs_kv_reuse >= 1.5, peak_mem_ratio <= 0.5, max_abs_diff <= 1e-5):
    scoring: speedup_vs_per_turn=<x>x speedup_vs_kv_reuse=<y>x peak_mem_ratio_vs_kv_reuse_L32k=<r> max_abs_diff=<d>
    peak_mem_ratio_vs_kv_reuse_L4k=<r4> seconds_L32k_packed=<s> seconds_L32k_kv_reuse=<t>
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
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


@torch.no_grad()
def score_kv_reuse(model, trajectory: torch.Tensor, boundaries: list[int], probes: list[Probe],
                   temperature: float = 1.0) -> torch.Tensor:
    """The KV-cache-reuse baseline: [K, P] float32 mean log-probs of each probe's GT span after each boundary."""
    from transformers import DynamicCache

    out = torch.empty(len(boundaries), len(probes), dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    # One prefill up to the last boundary; only the cache is wanted, so one position of logits is projected.
    model(input_ids=trajectory[None, :max(boundaries)], past_key_values=cache, use_cache=True, logits_to_keep=1)
    probe_ids = [torch.tensor(probe.token_ids, dtype=torch.long) for probe in probes]
    for k in sorted(range(len(boundaries)), key=lambda k: -boundaries[k]):
        for p, probe in enumerate(probes):
            cache.crop(boundaries[k])  # drops the later boundaries' tokens and the previous probe's
            gs, ge = probe.span
            # Positions b+gs-1 .. b+ge-2 predict y_gs .. y_{ge-1}; HF numbers them from the cache's length.
            logits = model(input_ids=probe_ids[p][None, :ge - 1], past_key_values=cache, use_cache=True,
                           logits_to_keep=ge - gs).logits[0].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out[k, p] = logp.gather(-1, probe_ids[p][gs:ge, None]).mean()
    return out


def timed(model, trajectory, boundaries, probes, strategy: str):
    start = time.perf_counter()
    if strategy == "kv_reuse":
        out = score_kv_reuse(model, trajectory, boundaries, probes)
    else:
        out = score_answer_logprobs(model, trajectory, boundaries, probes, ScoringConfig(strategy=strategy))
    return out, time.perf_counter() - start


def _status_gb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident) in GB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError(f"/proc/self/status has no {field}; this memory measurement needs Linux.")


def memory_run(strategy: str, length: int, n_boundaries: int, probe_len: int) -> None:
    """Child process: one strategy once; prints one JSON line with its time and the scoring's own peak memory."""
    torch.set_num_threads(2)
    model = build_model(length + probe_len)
    trajectory, boundaries, probes = workload(length, n_boundaries, probe_len, seed=1)
    # Start from a clean slate: hand memory freed while building the model back to the OS (otherwise scoring could
    # reuse it without the RSS showing it), then reset the peak-RSS counter (clear_refs 5), so VmHWM is scoring's.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before_gb = _status_gb("VmRSS")
    out, seconds = timed(model, trajectory, boundaries, probes, strategy)
    if not torch.isfinite(out).all():
        raise SystemExit(f"{strategy} at L={length} produced non-finite scores")
    peak_gb = _status_gb("VmHWM")
    print(json.dumps({"seconds": seconds, "peak_gb": peak_gb, "before_scoring_gb": before_gb,
                      "scoring_gb": peak_gb - before_gb, "tokens": scoring_cost(boundaries, probes).tokens_packed}))


def child(strategy: str, length: int, n_boundaries: int, probe_len: int) -> dict:
    run = subprocess.run([sys.executable, __file__, "--child", strategy, "--long-length", str(length),
                          "--long-boundaries", str(n_boundaries), "--probe-len", str(probe_len)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{strategy} at L={length} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    ordered, n = sorted(values), len(values)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--boundaries", type=int, default=64)
    parser.add_argument("--probe-len", type=int, default=16)
    parser.add_argument("--long-length", type=int, default=32768)
    parser.add_argument("--long-boundaries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    parser.add_argument("--child", choices=("packed", "kv_reuse"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        memory_run(args.child, args.long_length, args.long_boundaries, args.probe_len)
        return 0

    torch.set_num_threads(2)
    model = build_model(args.length + args.probe_len)
    trajectory, boundaries, probes = workload(args.length, args.boundaries, args.probe_len)
    cost = scoring_cost(boundaries, probes)
    for strategy in ("packed", "kv_reuse"):  # warm-up (allocator, kernels)
        timed(model, trajectory, boundaries[:2], probes, strategy)
    # The CPU is shared, so load drifts during the run: interleave the strategies in R rounds, each round timing one
    # full packed and kv_reuse pass and per_turn on every R-th boundary; per_turn's rounds cover all K once.
    rounds = args.rounds
    per_turn = torch.empty(args.boundaries, len(probes))
    t_packed, t_kv, t_parts, vs_kv, vs_per_turn = [], [], [], [], []
    for r in range(rounds):
        packed, seconds = timed(model, trajectory, boundaries, probes, "packed")
        kv, kv_seconds = timed(model, trajectory, boundaries, probes, "kv_reuse")
        subset = boundaries[r::rounds]
        per_turn[r::rounds], part = timed(model, trajectory, subset, probes, "per_turn")
        t_packed.append(seconds)
        t_kv.append(kv_seconds)
        t_parts.append(part)
        vs_kv.append(kv_seconds / seconds)
        vs_per_turn.append(part * len(boundaries) / len(subset) / seconds)  # scaled to all K boundaries
    diff_kv = (packed - kv).abs().max().item()
    diff_per_turn = (packed - per_turn).abs().max().item()
    max_abs_diff = max(diff_kv, diff_per_turn)
    print(f"L={args.length} K={args.boundaries} A={args.probe_len}: tokens packed={cost.tokens_packed} "
          f"per_turn={cost.tokens_per_turn} (ratio {cost.tokens_per_turn / cost.tokens_packed:.1f}x)")
    print(f"  packed per round: {', '.join(f'{t:.2f}' for t in t_packed)} s")
    print(f"  kv_reuse per round: {', '.join(f'{t:.2f}' for t in t_kv)} s")
    print(f"  per_turn per round (every {rounds}th boundary): {', '.join(f'{t:.2f}' for t in t_parts)} s "
          f"(total {sum(t_parts):.1f}s for all {args.boundaries})")
    print(f"  speedup vs kv_reuse per round: {', '.join(f'{x:.2f}' for x in vs_kv)}; median {median(vs_kv):.2f}x")
    print(f"  speedup vs per_turn per round: {', '.join(f'{x:.1f}' for x in vs_per_turn)}; median "
          f"{median(vs_per_turn):.1f}x; max_abs_diff vs packed: kv_reuse {diff_kv:.2e}, per_turn {diff_per_turn:.2e}")

    memory = {}
    for length, n_boundaries in ((args.length, args.boundaries), (args.long_length, args.long_boundaries)):
        for strategy in ("packed", "kv_reuse"):
            result = memory[strategy, length] = child(strategy, length, n_boundaries, args.probe_len)
            print(f"L={length} K={n_boundaries} {strategy}: {result['seconds']:.1f}s; scoring's peak memory "
                  f"{result['scoring_gb']:.3f} GB (process peak RSS {result['peak_gb']:.2f} GB, "
                  f"{result['before_scoring_gb']:.2f} GB before scoring)")
    ratio = {length: memory["packed", length]["scoring_gb"] / memory["kv_reuse", length]["scoring_gb"]
             for length in (args.length, args.long_length)}
    print(f"scoring: speedup_vs_per_turn={median(vs_per_turn):.1f}x speedup_vs_kv_reuse={median(vs_kv):.2f}x "
          f"peak_mem_ratio_vs_kv_reuse_L32k={ratio[args.long_length]:.2f} max_abs_diff={max_abs_diff:.1e} "
          f"peak_mem_ratio_vs_kv_reuse_L4k={ratio[args.length]:.2f} "
          f"seconds_L32k_packed={memory['packed', args.long_length]['seconds']:.1f} "
          f"seconds_L32k_kv_reuse={memory['kv_reuse', args.long_length]['seconds']:.1f}")
    if max_abs_diff > 1e-5:
        print(f"FAIL: a baseline differs from packed by {max_abs_diff:.2e} > 1e-5 in fp32; the strategies must agree "
              "(run tests/test_scoring.py).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
