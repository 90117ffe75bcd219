"""IGPO's actor-side answer scoring (``IGPOMethod._score_on_actor``) through the trainer's advantage pipeline: only
trajectories with a scored tool turn are sent to the scorer (a baseline alone feeds no information gain), and the
gains, advantages and IG statistics are those of scoring every boundary."""

from types import SimpleNamespace

import pytest
import torch

import method_harness as harness

PROMPT = [11, 12, 13, 14]
L = 12  # response tokens per row
# Per row: (tool name and status of each turn, the [start, end] of each turn's tokens in the response). Turn s starts
# after the observation of turn s-1, so boundary s (the context before turn s) is len(PROMPT) + its start.
ROWS = [
    ((("search", "ok"), ("search", "ok"), (None, "answer")), ((0, 2), (6, 7), (10, 11))),  # two scored tool turns
    (((None, "answer"),), ((0, 11),)),                                                   # answer at once
    (((None, "bad_request"), (None, "answer")), ((0, 2), (6, 11))),                      # no call reached a tool
    ((("search", "ok"), (None, "answer")), ((0, 2), (6, 11))),                           # one scored tool turn
    (((None, "answer"),), ((0, 5),)),                                                    # answer at once
    ((("search", "no_results"), (None, "answer")), ((0, 3), (7, 11))),                   # no results still counts
]
UIDS = ["q0"] * 4 + ["q1"] * 2
SCORED_ROWS = [0, 3, 5]  # the rows with a scored tool turn (ig_turns=reached)


def answer_logprob(trajectory: list[int], boundary: int) -> float:
    """A made-up l_s that depends on the context, the same for every probe (values exact in float32)."""
    return -0.25 * (sum(trajectory[:boundary]) % 13) - 0.5 * (boundary % 3)


class RecordingScorer:
    """``ActorScorer``'s interface; scores with ``answer_logprob`` and keeps every request it was sent."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.frame = SimpleNamespace(eot_text="<|im_end|>")
        self.max_positions = None
        self.requests: list[dict] = []

    def score_answers(self, requests: list[dict]) -> dict[int, list]:
        self.requests += requests
        return {r: [[answer_logprob(request["trajectory_ids"], b)] * len(request["probes"])
                     for b in request["boundaries"]] for r, request in enumerate(requests)}


def batch():
    """(extras with every boundary's l_s as a rollout would record it, prompts, responses, mask, scores)."""
    extras, prompts, responses = [], [], []
    mask = torch.zeros(len(ROWS), L, dtype=torch.bool)
    scores = torch.zeros(len(ROWS), L)
    for i, (turns, spans) in enumerate(ROWS):
        response = [100 + 7 * i + t for t in range(L)]
        trajectory = PROMPT + response
        boundaries = [len(PROMPT) + start for start, _ in spans]
        for start, end in spans:
            mask[i, start:end + 1] = True
        last = spans[-1][1]
        scores[i, last] = 0.5 * (i % 3)
        extras.append({"igpo_num_turns": len(turns), "igpo_turn_ends": [end for _, end in spans],
                       "igpo_boundaries": boundaries, "igpo_tool_names": [name for name, _ in turns],
                       "igpo_tool_status": [status for _, status in turns],
                       "igpo_turn_format_ok": [status != "bad_request" for _, status in turns],
                       "igpo_answer_logprobs": [[answer_logprob(trajectory, b)] for b in boundaries]})
        prompts.append(torch.tensor(PROMPT))
        responses.append(torch.tensor(response[:last + 1] + [0] * (L - last - 1)))
    return extras, prompts, responses, mask, scores


def run_actor_side(tokenizer):
    extras, prompts, responses, mask, scores = batch()
    method = harness.igpo_method(score_on="actor")
    scorer = RecordingScorer(tokenizer)
    fields = {"prompts": prompts, "responses": responses,
              "reward_model": [{"ground_truth": "Paris"} for _ in ROWS]}
    out = harness.advantage_step(method, harness.records(extras), UIDS, mask, scores, scorer=scorer, fields=fields,
                                 infra_failure=harness.default_policy(method), step=1, total_steps=10)
    return out, scorer


def test_only_trajectories_with_a_scored_tool_turn_are_scored(tiny_tokenizer):
    out, scorer = run_actor_side(tiny_tokenizer)
    sent = [request["trajectory_ids"][len(PROMPT)] for request in scorer.requests]
    # Each row's first response token is 100 + 7 i: the requests are rows 0, 3 and 5, each with its baseline.
    assert [(token - 100) // 7 for token in sent] == SCORED_ROWS
    assert [len(request["boundaries"]) for request in scorer.requests] == [3, 2, 2]
    tokens = sum(len(r["trajectory_ids"]) + len(r["boundaries"]) * len(r["probes"][0]["token_ids"])
                 for r in scorer.requests)
    assert out.metrics["igpo/scoring_tokens"] == tokens
    assert out.metrics["igpo/scoring_skipped"] == 0 and out.metrics["igpo/samples_without_baseline"] == 0


def test_gains_and_advantages_are_those_of_scoring_every_boundary(tiny_tokenizer):
    actor, _ = run_actor_side(tiny_tokenizer)
    extras, _, _, mask, scores = batch()
    method = harness.igpo_method(score_on="rollout")  # every boundary's l_s from the records, baselines included
    every = harness.advantage_step(method, harness.records(extras), UIDS, mask, scores,
                                   infra_failure=harness.default_policy(method), step=1, total_steps=10)
    assert actor.turn_values.numel() == 4 and bool((actor.turn_values != 0).any())
    assert torch.equal(actor.turn_values, every.turn_values)
    assert torch.equal(actor.advantages, every.advantages) and torch.equal(actor.returns, every.returns)
    own = ("igpo/scoring_tokens", "igpo/scoring_skipped", "timing_s/igpo_scoring")
    assert {k: v for k, v in actor.metrics.items() if k not in own} == pytest.approx(every.metrics, nan_ok=True)
