"""Benchmark InfoPO's counterfactual pass: ``score_continuations`` against the reference's two full forwards per turn.

InfoPO's intrinsic value of turn t compares the next action a_{t+1} after the factual context and after the
counterfactual one (the observation's content o_t replaced by the placeholder, chat-template tokens kept):

    sampled_logratio  I_t = (1/L) Σ_{j∈a_{t+1}} [log π(a_j | h, o_t, a_<j) − log π(a_j | h, ∅, a_<j)]
    kl                I_t = (1/L) Σ_{j∈a_{t+1}} KL(π(· | h, o_t, a_<j) || π(· | h, ∅, a_<j))

Two ways, same model (fp32), same inputs, same I_t:
    ours:  igpo.core.infopo builds the request (``observation_content_span`` finds each content span,
           ``ContinuationRequest.add_turn`` adds the factual and the counterfactual copy, ``as_dict`` is the wire
           format) and ``score_continuations`` scores it in one packed pass (the shared trajectory prefix once, then
           each copy after its boundary). Both terms come from the pass (factual copies included, as with
           reuse_old_log_probs=false or score=kl), so both sides compute the same thing.
    naive: the InfoPO reference's form: for every scored turn, two plain HF forwards without a cache, the whole
           factual sequence x[:a_e] and the whole counterfactual sequence (``counterfactual_sequence``) up to and
           including the next action; the action's log-probs are read from each. Only the action's predicting rows
           go through the LM head (``logits_to_keep``), which makes this baseline faster than the reference's full
           logits, so the speed-up is conservative.

Layout (the agent loop's, synthetic ids): a 256-token prompt, then N=17 actions of 30–60 tokens (each ends with
the end-of-turn id), between them K=16 tool observations ``prefix(4) + content(120–260) + suffix(6)``; L ≈ 4.1K
tokens. Every observation is a scored turn (K=16). Model: Qwen3 built locally from ``Qwen3Config`` (4 layers, hidden
256, 4 heads of 64, 2 K/V heads, MLP 768, vocab 4096, random weights with initializer_range 0.1 instead of 0.02, so
that the next action depends on the observation: mean |I_t| ~0.1, mean KL ~1 nat), 2 threads.

Timing: the machine is shared and its load drifts, so R rounds each time one ``sampled_logratio`` pass, one ``kl``
pass and one naive pass (the naive pass reads both I_t forms from its forwards; the readout is ~45 rows per
forward), the order rotating by round; warm-up runs each once on the first two turns. A speed-up is the median of the
per-round ratios naive / ours in wall time; the same in this process's CPU time (all threads) is printed beside it,
since a short pass of ours can land in a burst of other load that a 30-40 s naive pass averages out. max_abs_diff
is the largest |ours − naive| over both forms' I_t; above 1e-5 the script exits 1. The median seconds per pass are
printed on the line above the last; they move with the machine's speed, so the last line holds ratios and counts only
(goal: speedup_vs_two_forward >= 2 at max_abs_diff <= 1e-5):
    infopo: speedup_vs_two_forward=<x>x max_abs_diff=<d> tokens_ours=<n> tokens_naive=<m> speedup_kl=<y>x ...
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark_report import Rounds, check_rounds, machine_line, timed  # noqa: E402

from igpo.core.ground_truth import Probe  # noqa: E402
from igpo.core.infopo import ContinuationRequest, counterfactual_sequence, observation_content_span  # noqa: E402
from igpo.core.scoring import ScoringConfig, score_continuations  # noqa: E402

VOCAB = 4096
EOT = 1
PREFIX = [2, 3, 4, 5]  # "\n<|im_start|>user\n<tool_response>\n" after the action's <|im_end|>
SUFFIX = [6, 7, 8, 9, 10, 11]  # "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
PLACEHOLDER = [12, 13, 14, 15]  # "No information found."
FIRST_CONTENT_ID = 16


def build_model(max_positions: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, initializer_range=0.1,
                         attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).float().eval()


def trajectory(n_tool_turns: int, prompt_len: int, seed: int = 0):
    """Token ids of a multi-turn rollout and its turn records: (ids, boundaries b_t, action ends) as the loop keeps
    them (turn t's action is ids[b_t:end_t], end-of-turn id included)."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(FIRST_CONTENT_ID, VOCAB, (n,), generator=g).tolist()

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    ids, boundaries, ends = tokens(prompt_len), [], []
    for t in range(n_tool_turns + 1):
        boundaries.append(len(ids))
        ids += tokens(between(30, 60) - 1) + [EOT]
        ends.append(len(ids))
        if t < n_tool_turns:
            ids += PREFIX + tokens(between(120, 260)) + SUFFIX
    return ids, boundaries, ends


def build_turns(ids, boundaries, ends) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """(t, content span of observation t, span of the next action a_{t+1}) per scored turn, found as the trainer
    finds them."""
    turns = []
    for t in range(len(boundaries) - 1):
        content = observation_content_span(ids, ends[t], boundaries[t + 1], EOT, PREFIX, [SUFFIX])
        turns.append((t, content, (boundaries[t + 1], ends[t + 1])))
    return turns


def request_for(ids, turns) -> ContinuationRequest:
    request = ContinuationRequest(ids)
    for t, content, action in turns:
        request.add_turn(t, content, action, PLACEHOLDER, factual=True)
    return request


def ours(model, request: ContinuationRequest, kl: bool) -> torch.Tensor:
    """I_t per scored turn [K] from one packed pass."""
    spec = request.as_dict(kl)
    continuations = [Probe(c["token_ids"], tuple(c["span"])) for c in spec["continuations"]]
    values = score_continuations(model, torch.tensor(spec["trajectory_ids"]), spec["boundaries"], continuations,
                                 ScoringConfig(strategy="packed"), spec.get("pairs"))
    if kl:
        return values.double()
    return torch.tensor([float(values[f]) - float(values[c]) for _, f, c in request.turns], dtype=torch.float64)


@torch.no_grad()
def naive(model, ids, turns) -> tuple[torch.Tensor, torch.Tensor]:
    """(I_t sampled_logratio [K], I_t kl [K]) from two full forwards per scored turn."""
    x = torch.tensor(ids)
    logratio, kl = [], []
    for _, content, (a_s, a_e) in turns:
        factual = x[:a_e]
        counterfactual, _ = counterfactual_sequence(factual, content, PLACEHOLDER)
        n, target = a_e - a_s, x[a_s:a_e, None]
        # Rows a_e-n-1 .. a_e-2 of each sequence predict the action's n tokens (the last row predicts nothing).
        lf = torch.log_softmax(model(input_ids=factual[None], use_cache=False,
                                     logits_to_keep=n + 1).logits[0, :-1].float(), -1)
        lc = torch.log_softmax(model(input_ids=counterfactual[None], use_cache=False,
                                     logits_to_keep=n + 1).logits[0, :-1].float(), -1)
        logratio.append(float(lf.gather(-1, target).mean()) - float(lc.gather(-1, target).mean()))
        kl.append(float((lf.exp() * (lf - lc)).sum(-1).mean()))
    return torch.tensor(logratio, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool-turns", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (>= 3)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    check_rounds(args.rounds)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    ids, boundaries, ends = trajectory(args.tool_turns, args.prompt_len)
    model = build_model(len(ids) + 64)
    turns = build_turns(ids, boundaries, ends)
    request = request_for(ids, turns)
    tokens_ours = max(request.boundaries) + sum(len(c) - 1 for c, _ in request.continuations)
    tokens_naive = sum(2 * a_e + len(PLACEHOLDER) - (ce - cs) for _, (cs, ce), (_, a_e) in turns)
    contents = [ce - cs for _, (cs, ce), _ in turns]
    actions = [e - b for b, e in zip(boundaries, ends)]
    print(f"L={len(ids)} tokens, K={len(turns)} scored turns ({len(boundaries)} actions of {min(actions)}-"
          f"{max(actions)} tokens, observation contents of {min(contents)}-{max(contents)} tokens), "
          f"{len(request.continuations)} copies; tokens through the layers: ours {tokens_ours}, naive {tokens_naive} "
          f"({tokens_naive / tokens_ours:.1f}x)")

    warm = request_for(ids, turns[:2])
    ours(model, warm, False), ours(model, warm, True), naive(model, ids, turns[:2])
    runs = {"logratio": lambda: ours(model, request, False), "kl": lambda: ours(model, request, True),
            "naive": lambda: naive(model, ids, turns)}
    seconds, cpu = {name: [] for name in runs}, {name: [] for name in runs}
    results = {}
    for r in range(args.rounds):
        names = list(runs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name], s, c = timed(runs[name])
            seconds[name].append(s)
            cpu[name].append(c)
    ratio_lr = [n / o for n, o in zip(seconds["naive"], seconds["logratio"])]
    ratio_kl = [n / o for n, o in zip(seconds["naive"], seconds["kl"])]
    ratio_cpu = [n / o for n, o in zip(cpu["naive"], cpu["logratio"])]
    naive_lr, naive_kl = results["naive"]
    diff_lr = float((results["logratio"] - naive_lr).abs().max())
    diff_kl = float((results["kl"] - naive_kl).abs().max())
    max_abs_diff = max(diff_lr, diff_kl)
    for name, values in seconds.items():
        print(f"  {name} per round: {', '.join(f'{s:.2f}' for s in values)} s wall, "
              f"{', '.join(f'{c:.2f}' for c in cpu[name])} s CPU")
    print(f"  speedup sampled_logratio {Rounds(ratio_lr).describe('.2f', 'x')}")
    print(f"  speedup kl {Rounds(ratio_kl).describe('.2f', 'x')}")
    print(f"  speedup sampled_logratio in CPU time {Rounds(ratio_cpu).describe('.2f', 'x')}")
    print(f"  I_t sampled_logratio mean |I| {float(naive_lr.abs().mean()):.3e}, max |ours - naive| {diff_lr:.1e}; "
          f"kl mean {float(naive_kl.mean()):.3e}, max |ours - naive| {diff_kl:.1e}")
    print(f"absolute (this machine, moves with its speed): seconds_ours={statistics.median(seconds['logratio']):.2f} "
          f"seconds_naive={statistics.median(seconds['naive']):.2f}")
    print(f"infopo: speedup_vs_two_forward={statistics.median(ratio_lr):.2f}x max_abs_diff={max_abs_diff:.1e} "
          f"tokens_ours={tokens_ours} tokens_naive={tokens_naive} speedup_kl_vs_two_forward="
          f"{statistics.median(ratio_kl):.2f}x speedup_cpu_time={statistics.median(ratio_cpu):.2f}x L={len(ids)} "
          f"K={len(turns)}")
    if not max_abs_diff <= 1e-5:  # NaN fails too
        print(f"FAIL: ours and the two-forward reference differ by {max_abs_diff:.2e} > 1e-5 in fp32 (or a value is "
              "not finite); they must agree (run tests/core/test_infopo.py and tests/core/test_scoring.py).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
