"""GPU check of the packed answer scorer (igpo/core/scoring.py) on one CUDA device (written for an H200).

Stages (each prints PASS/FAIL/INFO lines; the process exits 1 if any stage FAILs, 2 if there is no CUDA device):
  1. exact:  fp32 model (TF32 off), L=8192, K=32, 3 probes: packed (FlexAttention) and packed (SDPA) vs per_turn on
             every (boundary, probe); PASS if max |diff| <= 1e-4.
  2. long:   bf16 model, L in (32K, 64K, 128K), K=200, one probe of A=16 tokens: packed with FlexAttention; time,
             peak CUDA memory, tokens. per_turn runs on S boundaries spread over the trajectory; its time for all K is
             estimated as sum over k of a fit t(b) = c0 + c1·b + c2·b^2 to those S timings (printed as an estimate).
             bf16 agreement on those S boundaries is reported; PASS if max |diff| <= 0.15 (bf16 kernels differ in
             accumulation order; the exact check is stage 1).
  3. sdpa:   the same at L=32K with the SDPA backend (additive masks), for comparison.
The model is a random-weight Qwen2 built locally from Qwen2Config (no download). Compile time of FlexAttention is
paid in a warm-up and reported separately. Use --cpu-dry-run to exercise the script's logic on CPU at tiny sizes.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from igpo.core.ground_truth import Probe  # noqa: E402
from igpo.core.scoring import ScoringConfig, score_answer_logprobs, scoring_cost  # noqa: E402

PRESETS = {
    # ~0.5B parameters, Qwen2.5-0.5B-like shape (GQA 14/2 heads, head_dim 64).
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    # ~1.5B parameters, Qwen2.5-1.5B-like shape (GQA 12/2 heads, head_dim 128).
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    # CPU dry run: tiny.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
failures: list[str] = []


def report(status: str, message: str) -> None:
    print(f"[{status}] {message}", flush=True)
    if status == "FAIL":
        failures.append(message)


def build_model(preset: str, dtype: torch.dtype, device: str, max_positions: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=max_positions, tie_word_embeddings=True,
                         attn_implementation="sdpa", **PRESETS[preset])
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def workload(length: int, n_boundaries: int, probe_lens: list[int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    trajectory = torch.randint(0, vocab, (length,), generator=g)
    boundaries = [max(1, (k + 1) * length // n_boundaries) for k in range(n_boundaries)]
    probes = [Probe(torch.randint(0, vocab, (a,), generator=g).tolist(), (a // 3, a - 1)) for a in probe_lens]
    return trajectory, boundaries, probes


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device, fn):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def stage_exact(args, device) -> None:
    length, k = (8192, 32) if not args.cpu_dry_run else (256, 6)
    model = build_model(args.exact_preset, torch.float32, device, length + 64)
    trajectory, boundaries, probes = workload(length, k, [16, 5, 30], model.config.vocab_size, seed=1)
    reference, t_ref = timed(device, lambda: score_answer_logprobs(
        model, trajectory, boundaries, probes, ScoringConfig(strategy="per_turn")))
    for backend in ("flex", "sdpa"):
        try:
            cfg = ScoringConfig(attention=backend, chunk_tokens=4096)
            packed, t = timed(device, lambda: score_answer_logprobs(model, trajectory, boundaries, probes, cfg))
            diff = (packed - reference).abs().max().item()
            report("PASS" if diff <= 1e-4 else "FAIL",
                   f"exact fp32 {backend}: L={length} K={k} P=3 max|packed-per_turn|={diff:.2e} (<= 1e-4); "
                   f"packed {t:.2f}s (incl. first-call compile) vs per_turn {t_ref:.2f}s")
        except Exception:  # one backend failing must not hide the other's result
            report("FAIL", f"exact fp32 {backend} raised:\n{traceback.format_exc(limit=4)}")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def per_turn_estimate(device, model, trajectory, boundaries, probes, n_samples):
    """Time per_turn on n_samples boundaries spread over the trajectory; fit t(b) = c0 + c1 b + c2 b^2; sum over K."""
    picks = sorted({boundaries[round(i * (len(boundaries) - 1) / max(1, n_samples - 1))] for i in range(n_samples)})
    cfg = ScoringConfig(strategy="per_turn")
    score_answer_logprobs(model, trajectory, picks[:1], probes, cfg)  # warm-up
    scores, times = [], []
    for b in picks:
        out, t = timed(device, lambda: score_answer_logprobs(model, trajectory, [b], probes, cfg))
        scores.append(out)
        times.append(t)
    x = torch.tensor(picks, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x, x * x], dim=1)
    coeffs = torch.linalg.lstsq(design, torch.tensor(times, dtype=torch.float64)[:, None]).solution[:, 0]
    all_b = torch.tensor(boundaries, dtype=torch.float64)
    estimate = (coeffs[0] + coeffs[1] * all_b + coeffs[2] * all_b**2).clamp(min=0).sum().item()
    return picks, torch.cat(scores), estimate, sum(times)


def stage_long(args, device, backend: str, lengths: list[int]) -> None:
    max_len = max(lengths)
    model = build_model(args.preset, torch.bfloat16, device, max_len + 64)
    vocab = model.config.vocab_size
    cfg = ScoringConfig(attention=backend, chunk_tokens=args.chunk_tokens, max_probe_tokens=args.max_probe_tokens)
    warm_traj, warm_b, warm_p = workload(min(lengths), 8, [args.probe_len], vocab, seed=2)
    _, t_warm = timed(device, lambda: score_answer_logprobs(model, warm_traj, warm_b, warm_p, cfg))
    report("INFO", f"{backend}: warm-up (compile, allocator) {t_warm:.1f}s")
    for length in lengths:
        try:
            trajectory, boundaries, probes = workload(length, args.boundaries, [args.probe_len], vocab, seed=3)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            packed, t_packed = timed(device, lambda: score_answer_logprobs(model, trajectory, boundaries, probes,
                                                                           cfg))
            peak_gb = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else float("nan")
            cost = scoring_cost(boundaries, probes)
            finite = bool(torch.isfinite(packed).all())
            report("PASS" if finite else "FAIL",
                   f"{backend} L={length} K={args.boundaries} A={args.probe_len}: packed {t_packed:.2f}s, "
                   f"{cost.tokens_packed} tokens (per_turn would process {cost.tokens_per_turn}), "
                   f"peak extra CUDA memory {peak_gb:.2f} GB, finite={finite}")
            if args.per_turn_samples > 0:
                picks, ref, estimate, spent = per_turn_estimate(device, model, trajectory, boundaries, probes,
                                                                args.per_turn_samples)
                rows = [boundaries.index(b) for b in picks]
                diff = (packed[rows] - ref).abs().max().item()
                report("PASS" if diff <= 0.15 else "FAIL",
                       f"{backend} L={length}: bf16 max|packed-per_turn| on {len(picks)} boundaries = {diff:.3f} "
                       f"(<= 0.15); per_turn est. {estimate:.1f}s for all K (measured {spent:.1f}s on "
                       f"{len(picks)}) => speedup ~{estimate / t_packed:.0f}x")
        except Exception:
            report("FAIL", f"{backend} L={length} raised:\n{traceback.format_exc(limit=4)}")
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
    del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="0.5b", choices=sorted(PRESETS))
    parser.add_argument("--exact-preset", default="0.5b", choices=sorted(PRESETS))
    parser.add_argument("--lengths", default="32768,65536,131072")
    parser.add_argument("--boundaries", type=int, default=200)
    parser.add_argument("--probe-len", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=16384)
    parser.add_argument("--max-probe-tokens", type=int, default=4096)
    parser.add_argument("--per-turn-samples", type=int, default=4)
    parser.add_argument("--stages", default="exact,long,sdpa")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU, to test this script")
    args = parser.parse_args()

    if args.cpu_dry_run:
        device = "cpu"
        args.preset = args.exact_preset = "tiny"
        args.lengths, args.boundaries, args.chunk_tokens = "512,1024", 12, 256
    elif not torch.cuda.is_available():
        print("[FAIL] no CUDA device visible to torch (torch.cuda.is_available() is False); run on the GPU machine "
              "or pass --cpu-dry-run to test the script", flush=True)
        sys.exit(2)
    else:
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False  # stage 1 compares fp32 numerics
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    import transformers

    print(f"transformers {transformers.__version__}; preset {args.preset}; stages {args.stages}", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    stages = args.stages.split(",")
    start = time.perf_counter()
    if "exact" in stages:
        stage_exact(args, device)
    if "long" in stages:
        stage_long(args, device, "flex", lengths)
    if "sdpa" in stages:
        stage_long(args, device, "sdpa", lengths[:1])
    print(f"summary: {'FAIL' if failures else 'PASS'} ({len(failures)} failed checks) in "
          f"{time.perf_counter() - start:.0f}s", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
