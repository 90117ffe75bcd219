"""Benchmark teacher-forced answer scoring: ``packed`` against ``kv_reuse`` (one-pass and chunked prefill) and ``per_turn``.

Strategies (same random-weight model, fp32, same inputs; the scoring path is igpo.core.scoring's public API):
    packed:   ``score_answer_logprobs`` with ``ScoringConfig(strategy="packed")`` (one shared-prefix pass, layer by
              layer; trajectory query blocks of ``chunk_tokens`` = 1024 by default).
    kv_reuse: the reference's way: one HF prefill of the trajectory into a ``DynamicCache``, then each probe against
              the cache cropped to its boundary (boundaries in decreasing order, so ``crop`` only ever shortens the
              cache and no copy is made); the probe's tokens are appended and cropped away again by the next crop.
              ``kv_reuse_chunkC``: the same with the prefill fed C tokens at a time (what a user short of memory
              would do; C = 1024 and 256 by default, ``--chunks``).
    per_turn: ``ScoringConfig(strategy="per_turn")``: one full forward of context[:b] + probe per boundary.

Part 1, speed (this process, 2 threads): L=4096 tokens, K=64 boundaries spread evenly (b_k = k·L/K), one probe of
A=16 tokens whose last 8 tokens are the GT span. The machine is shared and its load drifts, so timing is
interleaved: each of R rounds (3) runs one full ``packed`` pass, one full ``kv_reuse`` pass, and ``per_turn`` on every
R-th boundary (the rounds together cover all K once). Each round gives a ratio per baseline (baseline time, per_turn
scaled by K/|subset|, over the round's packed time), printed as median (min, max); the last line gives the medians.
max_abs_diff is the largest difference from packed's [K, P] scores of per_turn and kv_reuse here, and, in part 2, of
every other setting's scores from packed's at the same length (4K and 32K: the memory runs score the same workload,
so the check costs no extra scoring); the script exits 1 above 1e-5.

Part 2, memory, at L=4096/K=64 and L=32768/K=200: packed (default block), packed with ``chunk_tokens`` = the smallest
chunk (its memory-lean setting), kv_reuse one-pass and at every chunk (one-pass at 32K only with --long-unchunked: it
holds the most memory of the KV-reuse settings, so it cannot set the worst ratio, and takes 1-3 minutes per scoring
on 2 shared cores). One fresh subprocess per length and setting,
which scores ``--memory-rounds`` (3) times. Memory is MEASURED, not computed: before each scoring the subprocess
returns freed heap to the OS (malloc_trim) and resets its peak-RSS counter (/proc/self/clear_refs 5); the scoring's
own peak working memory (activations, masks, K/V cache, logits) is the peak RSS then (VmHWM) minus the RSS before
(VmRSS), as the OS saw it. So that RSS tracks live memory, the children run with a fixed glibc mmap threshold
(1 MiB: every larger buffer is returned to the OS on free) and without transparent huge pages. The first scoring of
a process also pays one-time allocations, so the max over rounds is usually the first; the median is reported. peak_mem_ratio = packed / a KV-reuse setting, per round.

The model is a Qwen2 built locally from ``Qwen2Config`` (4 layers, hidden 256, 4 heads, 2 K/V heads, vocab 4096).
Its all-layer K/V cache is only 4x one layer's, so KV reuse with a small prefill chunk (which holds all layers' K/V
and one chunk's activations) is near its memory floor; packed holds one layer's K/V, the trajectory's hidden states
and one block's activations. The script prints those sizes.
Last line (goals: speedup_vs_per_turn >= 20, speedup_vs_kv_reuse >= 1.5, peak_mem_ratio <= 0.5 at 32K against every
KV-reuse setting and <= 1.0 at 4K, max_abs_diff <= 1e-5); _worst = the largest ratio over the KV-reuse settings:
    scoring: speedup_vs_per_turn=<x>x speedup_vs_kv_reuse=<y>x peak_mem_ratio_vs_kv_reuse_L32k_worst=<r>
    peak_mem_ratio_vs_kv_reuse_L4k_worst=<r4> max_abs_diff=<d> packed_block256_L32k_worst=<s>
    packed_block256_L4k_worst=<s4>
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark_report import Rounds, check_rounds, machine_line  # noqa: E402

from igpo.core.ground_truth import Probe  # noqa: E402
from igpo.core.scoring import ScoringConfig, score_answer_logprobs, scoring_cost  # noqa: E402

VOCAB = 4096
THREADS = 2
MMAP_THRESHOLD = 1 << 20  # bytes: the memory children's fixed glibc mmap threshold (memory_run)
PR_SET_THP_DISABLE = 41  # linux/prctl.h


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
                   temperature: float = 1.0, prefill_chunk: int | None = None) -> torch.Tensor:
    """The KV-cache-reuse baseline: [K, P] float32 mean log-probs of each probe's GT span after each boundary.

    ``prefill_chunk``: None prefills the trajectory in one forward (as the reference does); C feeds it C tokens at a
    time into the same cache (chunked prefill, what a user short of memory would do: the activations and attention
    workspace of C tokens instead of the whole trajectory; the all-layer cache is the same)."""
    from transformers import DynamicCache

    out = torch.empty(len(boundaries), len(probes), dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    # Prefill up to the last boundary; only the cache is wanted, so one position of logits is projected per forward.
    context = trajectory[None, :max(boundaries)]
    step = prefill_chunk or context.shape[1]
    for start in range(0, context.shape[1], step):
        model(input_ids=context[:, start:start + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
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


def timed(model, trajectory, boundaries, probes, strategy: str, chunk: int | None = None):
    """(scores, seconds). ``chunk``: kv_reuse's prefill chunk, or packed's trajectory block (``chunk_tokens``);
    None = kv_reuse's one-forward prefill, packed's default block."""
    start = time.perf_counter()
    if strategy == "kv_reuse":
        out = score_kv_reuse(model, trajectory, boundaries, probes, prefill_chunk=chunk)
    else:
        config = ScoringConfig(strategy=strategy) if chunk is None else ScoringConfig(strategy=strategy, chunk_tokens=chunk)
        out = score_answer_logprobs(model, trajectory, boundaries, probes, config)
    return out, time.perf_counter() - start


def _status_gb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident) in GB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError(f"/proc/self/status has no {field}; this memory measurement needs Linux.")


def memory_run(strategy: str, chunk: int | None, length: int, n_boundaries: int, probe_len: int, rounds: int) -> None:
    """Child process: one strategy, ``rounds`` times; prints one JSON line with its times, the scoring's own peak
    memory in each round and the last round's [K, P] scores."""
    # Resident memory tracks live memory only if freed buffers leave the process: with glibc's default dynamic mmap
    # threshold a buffer freed once raises the threshold (up to 32 MiB), later ones of that size come from the heap
    # and stay resident or not depending on fragmentation (the suspected cause of one setting's 32K peak ranging
    # 0.125-0.205 GB over bench_all runs). child() fixes the threshold (MALLOC_MMAP_THRESHOLD_: every buffer >= 1 MiB is its own mapping, returned on
    # free), and transparent huge pages are turned off for this process (PR_SET_THP_DISABLE), so a partly used 2 MiB
    # page does not count in full. Both sides run under the same rules.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_THP_DISABLE) failed: errno {ctypes.get_errno()}; this memory measurement needs "
                         "Linux >= 3.15")
    torch.set_num_threads(THREADS)
    model = build_model(length + probe_len)
    trajectory, boundaries, probes = workload(length, n_boundaries, probe_len, seed=1)
    seconds, scoring_gb = [], []
    for _ in range(rounds):
        # Start from a clean slate: hand freed memory back to the OS (otherwise scoring could reuse it without the
        # RSS showing it), then reset the peak-RSS counter (clear_refs 5), so VmHWM is this round's scoring's.
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before_gb = _status_gb("VmRSS")
        out, s = timed(model, trajectory, boundaries, probes, strategy, chunk)
        scoring_gb.append(_status_gb("VmHWM") - before_gb)
        seconds.append(s)
        if not torch.isfinite(out).all():
            raise SystemExit(f"{strategy} at L={length} produced non-finite scores")
        scores = out.tolist()
        del out
    print(json.dumps({"seconds": seconds, "scoring_gb": scoring_gb, "scores": scores}))


def child(strategy: str, chunk: int | None, length: int, n_boundaries: int, probe_len: int, rounds: int) -> dict:
    run = subprocess.run([sys.executable, __file__, "--child", strategy, "--chunk", str(chunk or 0), "--long-length",
                          str(length), "--long-boundaries", str(n_boundaries), "--probe-len", str(probe_len),
                          "--memory-rounds", str(rounds)], capture_output=True, text=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    if run.returncode != 0:
        raise SystemExit(f"{strategy} at L={length} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def label(strategy: str, chunk: int | None) -> str:
    return strategy if chunk is None else f"{strategy}_chunk{chunk}"


def tokens_label(length: int) -> str:
    return f"L{length // 1024}k" if length % 1024 == 0 else f"L{length}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--boundaries", type=int, default=64)
    parser.add_argument("--probe-len", type=int, default=16)
    parser.add_argument("--long-length", type=int, default=32768)
    parser.add_argument("--long-boundaries", type=int, default=200)
    parser.add_argument("--chunks", default="1024,256",
                        help="memory part: chunk sizes C, comma-separated, of KV reuse's chunked prefill and of packed's "
                             "trajectory block (chunk_tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (>= 3)")
    parser.add_argument("--memory-rounds", type=int, default=3, help="scorings per strategy and length (>= 3)")
    parser.add_argument("--long-unchunked", action="store_true",
                        help="memory part: also run KV reuse's one-pass prefill at --long-length (minutes per scoring)")
    parser.add_argument("--child", choices=("packed", "kv_reuse"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        memory_run(args.child, args.chunk or None, args.long_length, args.long_boundaries, args.probe_len,
                   args.memory_rounds)
        return 0
    check_rounds(args.rounds)
    check_rounds(args.memory_rounds)
    chunks = [int(c) for c in args.chunks.split(",") if c]

    torch.set_num_threads(THREADS)
    print(machine_line(THREADS))
    model = build_model(args.length + args.probe_len)
    trajectory, boundaries, probes = workload(args.length, args.boundaries, args.probe_len)
    cost = scoring_cost(boundaries, probes)
    for strategy in ("packed", "kv_reuse"):  # warm-up (allocator, kernels)
        timed(model, trajectory, boundaries[:2], probes, strategy)
    # The CPU is shared, so load drifts during the run: interleave the strategies in R rounds, each round timing one
    # full packed and kv_reuse pass and per_turn on every R-th boundary; per_turn's rounds cover all K once.
    rounds = args.rounds
    per_turn = torch.empty(args.boundaries, len(probes))
    t_packed, t_kv, t_parts, vs_kv, vs_per_turn = Rounds(), Rounds(), Rounds(), Rounds(), Rounds()
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
    diffs = {"kv_reuse": (packed - kv).abs().max().item(), "per_turn": (packed - per_turn).abs().max().item()}
    print(f"L={args.length} K={args.boundaries} A={args.probe_len}: tokens packed={cost.tokens_packed} "
          f"per_turn={cost.tokens_per_turn} (ratio {cost.tokens_per_turn / cost.tokens_packed:.1f}x)")
    print(f"  packed per round: {', '.join(f'{t:.2f}' for t in t_packed.values)} s")
    print(f"  kv_reuse per round: {', '.join(f'{t:.2f}' for t in t_kv.values)} s")
    print(f"  per_turn per round (every {rounds}th boundary): {', '.join(f'{t:.2f}' for t in t_parts.values)} s "
          f"(total {sum(t_parts.values):.1f}s for all {args.boundaries})")
    print(f"  speedup vs kv_reuse: {vs_kv.describe('.2f', 'x')}")
    print(f"  speedup vs per_turn: {vs_per_turn.describe('.1f', 'x')}")

    # Memory: one fresh subprocess per (length, strategy), scoring memory_rounds times.
    # packed at its default block and at the smallest chunk (its memory-lean setting, like for like with KV reuse's
    # smallest prefill chunk); KV reuse unchunked (the reference) and at every chunk.
    # At the long length KV reuse's one-pass prefill is left out unless asked for: it holds the most memory of the
    # KV-reuse settings (so it cannot set the worst ratio) and costs minutes per scoring on 2 cores.
    variants = [("packed", None), ("packed", min(chunks)), ("kv_reuse", None), *(("kv_reuse", c) for c in chunks)]
    lengths = ((args.length, args.boundaries), (args.long_length, args.long_boundaries))
    run_at = {args.length: variants, args.long_length: [v for v in variants if args.long_unchunked or v != ("kv_reuse", None)]}
    gb, seconds_of = {}, {}
    for length, n_boundaries in lengths:
        scores = {}
        for strategy, chunk in run_at[length]:
            result = child(strategy, chunk, length, n_boundaries, args.probe_len, args.memory_rounds)
            gb[length, label(strategy, chunk)] = Rounds(result["scoring_gb"])
            seconds_of[length, label(strategy, chunk)] = Rounds(result["seconds"])
            scores[label(strategy, chunk)] = torch.tensor(result["scores"])
        # Every setting scored the same workload: each must agree with packed at its default block.
        for name, other in scores.items():
            if name != "packed":
                diffs[f"{name}@{tokens_label(length)}"] = (scores["packed"] - other).abs().max().item()
    max_abs_diff = max(diffs.values())
    print(f"max_abs_diff vs packed: {', '.join(f'{name} {d:.2e}' for name, d in diffs.items())}")

    def ratio(length: int, packed_name: str, kv_name: str) -> Rounds:
        return Rounds(p / k for p, k in zip(gb[length, packed_name].values, gb[length, kv_name].values))

    worst, worst_lean = {}, {}
    config = build_model(8).config
    kv_bytes_per_token = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    for length, n_boundaries in lengths:
        print(f"{tokens_label(length)} K={n_boundaries}: fp32 sizes at L tokens: one layer's K/V "
              f"{length * kv_bytes_per_token / 1e9:.3f} GB, all {config.num_hidden_layers} layers' "
              f"{config.num_hidden_layers * length * kv_bytes_per_token / 1e9:.3f} GB, the trajectory's hidden states "
              f"{length * config.hidden_size * 4 / 1e9:.3f} GB")
        kv_names = [label(strategy, chunk) for strategy, chunk in run_at[length] if strategy == "kv_reuse"]
        for strategy, chunk in run_at[length]:
            name = label(strategy, chunk)
            print(f"  {name:20s} scoring's peak memory {gb[length, name].describe('.3f', ' GB')}; "
                  f"{seconds_of[length, name].median:.1f} s (median)")
        default = {kv: ratio(length, "packed", kv) for kv in kv_names}
        lean = {kv: ratio(length, label("packed", min(chunks)), kv) for kv in kv_names}
        print("  peak_mem_ratio packed (default block) / " + "; ".join(f"{kv} {r.describe('.2f')}"
                                                                       for kv, r in default.items()))
        print(f"  peak_mem_ratio packed (block {min(chunks)}) / " + "; ".join(f"{kv} {r.describe('.2f')}"
                                                                             for kv, r in lean.items()))
        worst[length] = max(r.median for r in default.values())
        worst_lean[length] = max(r.median for r in lean.values())
    long, short = tokens_label(args.long_length), tokens_label(args.length)
    print(f"scoring: speedup_vs_per_turn={vs_per_turn.median:.1f}x speedup_vs_kv_reuse={vs_kv.median:.2f}x "
          f"peak_mem_ratio_vs_kv_reuse_{long}_worst={worst[args.long_length]:.2f} "
          f"peak_mem_ratio_vs_kv_reuse_{short}_worst={worst[args.length]:.2f} max_abs_diff={max_abs_diff:.1e} "
          f"packed_block{min(chunks)}_{long}_worst={worst_lean[args.long_length]:.2f} "
          f"packed_block{min(chunks)}_{short}_worst={worst_lean[args.length]:.2f}")
    if max_abs_diff > 1e-5:
        print(f"FAIL: a baseline differs from packed by {max_abs_diff:.2e} > 1e-5 in fp32; the strategies must agree "
              "(run tests/core/test_scoring.py).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
