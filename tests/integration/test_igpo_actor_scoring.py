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


class ModelScorer(RecordingScorer):
    """``ActorScorer``'s interface over a real model in this process, scoring as the actor worker does
    (``igpo.core.scoring.score_batch``): the weights the trainer holds at the advantage."""

    def __init__(self, tokenizer, model):
        super().__init__(tokenizer)
        self.model = model

    def score_answers(self, requests: list[dict]) -> dict[int, list]:
        from igpo.core.ground_truth import Probe
        from igpo.core.scoring import ScoreRequest, ScoringConfig, score_batch

        self.requests += requests
        batch = [ScoreRequest(torch.tensor(r["trajectory_ids"]), r["boundaries"],
                              [Probe(p["token_ids"], tuple(p["span"])) for p in r["probes"]]) for r in requests]
        with torch.no_grad():
            return {i: scores.tolist() for i, scores in enumerate(score_batch(self.model, batch, ScoringConfig()))}


def test_a_trajectory_spanning_two_weight_versions_gets_its_information_gain_from_the_training_weights(
        tiny_tokenizer, tiny_model_dir):
    """In an asynchronous trainer mode a trajectory's turns may come from two weight versions (its generation paused
    for an update and resumed on the new weights). The declared rule (docs/guide/async.md): every boundary is scored
    at the advantage by the actor's current weights, the ones that train the step. Row 0's first turn was generated
    on version 1 and the rest on version 2; the rollout's own log-probs (what a rollout-side scorer would have kept)
    mix the two versions. The answer log-probs and IG that train are those of the training weights alone, checked
    against plain forwards of that model, and not those of version 1 or of the mix."""
    from transformers import AutoModelForCausalLM

    from golden_ig import reference_logprob
    from igpo.core.ground_truth import answer_probes
    from igpo.integration.methods.igpo import IGPOMethod

    training = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    older = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in older.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    extras, prompts, responses, mask, scores = batch()
    method = harness.igpo_method(score_on="actor")
    assert isinstance(method, IGPOMethod)
    template = method.igpo.scoring.answer_template("<|im_end|>")
    probe = answer_probes(tiny_tokenizer, "Paris", template, "first")[0]
    trajectory = torch.cat([prompts[0], responses[0]]).tolist()
    boundaries = extras[0]["igpo_boundaries"]

    def values(model):
        with torch.no_grad():
            return [reference_logprob(model, trajectory[:b], probe.token_ids, probe.span) for b in boundaries]

    new, old = values(training), values(older)
    extras[0]["igpo_turn_versions"] = [[1, 1], [1, 2], [2, 2]]
    extras[0]["igpo_answer_logprobs"] = [[old[0]], [new[1]], [new[2]]]  # what the rollout saw, turn by turn
    fields = {"prompts": prompts, "responses": responses, "reward_model": [{"ground_truth": "Paris"} for _ in ROWS]}
    out = harness.advantage_step(method, harness.records(extras), UIDS, mask, scores,
                                 scorer=ModelScorer(tiny_tokenizer, training), fields=fields,
                                 infra_failure=harness.default_policy(method), step=1, total_steps=10)
    assert out.turns.records[0].turn_versions == [[1, 1], [1, 2], [2, 2]]
    scored = out.terms["answer_logprob"][0, :3].tolist()
    assert scored == pytest.approx(new, abs=1e-4)
    gains = out.terms["information_gain"][0, :2].tolist()
    assert gains == pytest.approx([new[1] - new[0], new[2] - new[1]], abs=1e-4)
    assert abs(gains[0] - (new[1] - old[0])) > 1e-2 and abs(gains[0] - (old[1] - old[0])) > 1e-2
