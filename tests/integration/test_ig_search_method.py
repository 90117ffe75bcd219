"""IG-Search (igpo.integration.methods.ig_search) through the trainer's advantage pipeline, on trajectories the real
igpo_agent loop wrote: each measured turn's gain is the answer's log-probability after its real search result minus
after another prompt group's result in its place (checked against sequences built here from the texts, with a
made-up scorer and with a real model), turns without a document are counted, and the settings are checked."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import method_harness as harness

REPO = Path(__file__).resolve().parents[2]
# The agent loop's scripted model and fake tools live with its tests.
sys.path.insert(0, str(REPO / "tests" / "agent"))
from test_agent_loop import ANSWER, FakeTools, Result, rollout, scripted, search  # noqa: E402

from golden_ig import reference_logprob  # noqa: E402
from igpo.agent.chat_frame import encode_content  # noqa: E402
from igpo.config import ConfigError  # noqa: E402
from igpo.core.ground_truth import AnswerTemplate, answer_probes  # noqa: E402
from igpo.integration.methods import method_for  # noqa: E402
from igpo.integration.methods.ig_search import IGSearchMethod  # noqa: E402
from igpo.integration.pipeline import advantage_step  # noqa: E402

GOLD = "Ada<|answer_split|>Ada Lovelace"
# Every search of group p ("@" queries) returns RESULT["p"], every search of group q ("#" queries) RESULT["q"].
RESULT = {"p": "The book was written by Ada Lovelace in 1843.", "q": "Brask is a river town in the north."}
PAIRED_TOL = 2e-6
SCRIPTS = {"p": [[search("@Talven"), ANSWER], [search("@Talven"), search("@Mora"), ANSWER]],
           "q": [[search("#Brask"), ANSWER], [search("#Brask"), search("#Osk"), ANSWER]]}


def ig_search_method(ig_search=None, **igpo) -> IGSearchMethod:
    return method_for(harness.config("ig_search", igpo={"ig_tool_filter": "", **igpo}, ig_search=ig_search or {}))


async def search_batch(tokenizer, groups=("p", "q")):
    """(extras, fields, mask, scores, uids, frame) of the scripted rollouts of ``groups``."""
    tools = FakeTools(lambda name, args: Result(True, RESULT["p" if args["query"][0].startswith("@") else "q"]))
    outs, uids, frame = [], [], None
    for group in groups:
        for script in SCRIPTS[group]:
            out, _, _, loop = await rollout(tokenizer, scripted(*script), tools=tools, agent={"max_turns": 6})
            outs.append(out)
            uids.append(group)
            frame = loop.frame
    L = max(len(o.response_ids) for o in outs)
    mask, scores = torch.zeros(len(outs), L, dtype=torch.bool), torch.zeros(len(outs), L)
    for i, out in enumerate(outs):
        mask[i, :len(out.response_mask)] = torch.tensor(out.response_mask, dtype=torch.bool)
        scores[i, len(out.response_ids) - 1] = float(i % 2)
    fields = {"prompts": [torch.tensor(o.prompt_ids) for o in outs],
              "responses": [torch.tensor(o.response_ids) for o in outs],
              "reward_model": [{"ground_truth": GOLD} for _ in outs]}
    return [o.extra_fields for o in outs], fields, mask, scores, uids, frame


def expected_copies(tokenizer, frame, extras, fields, uids, alias_mode="first"):
    """Per measured (row, turn): the two full sequences before and through the probe, built from the texts: the real
    context through boundary j + 1, and the same with this row's search result replaced by the other group's."""
    template = AnswerTemplate("Now there's enough information to answer\n</think>\n<answer>\n",
                              "\n</answer>" + frame.eot_text)
    probes = answer_probes(tokenizer, GOLD, template, alias_mode)
    out = {}
    for i, extra in enumerate(extras):
        ids = torch.cat([fields["prompts"][i], fields["responses"][i]]).tolist()
        own, other = (encode_content(tokenizer, RESULT[g]) for g in (uids[i], "q" if uids[i] == "p" else "p"))
        for j, status in enumerate(extra["igpo_tool_status"]):
            if status != "ok":
                continue
            b = extra["igpo_boundaries"][j + 1]
            cs = max(k for k in range(b - len(own) + 1) if ids[k:k + len(own)] == own)  # this turn's own result
            real, replaced = ids[:b], ids[:cs] + other + ids[cs + len(own):b]
            out[i, j] = [(real + p.token_ids, replaced + p.token_ids, p) for p in probes]
    return out


def made_up(sequence: list[int], gold_start: int) -> float:
    """A log-probability that depends on every token before the gold span (values exact in float64)."""
    return -0.001 * (sum(sequence[:gold_start]) % 1009) - 0.0001 * gold_start


class PairedScorer:
    """The ``ActorScorer`` interface IG-Search uses; ``score_counterfactuals`` answers with ``made_up`` (or with
    ``model``'s teacher-forced log-probs, as the actor worker computes them) and keeps every request."""

    def __init__(self, tokenizer, frame, model=None):
        self.tokenizer, self.frame, self.model = tokenizer, frame, model
        self.max_positions = None
        self.requests: list[dict] = []

    def score_counterfactuals(self, requests: list[dict]) -> dict[int, list]:
        from igpo.core.ground_truth import Probe
        from igpo.core.scoring import ScoringConfig, score_continuations

        self.requests += requests
        out = {}
        for r, request in enumerate(requests):
            ids = request["trajectory_ids"]
            if self.model is not None:
                with torch.no_grad():
                    out[r] = score_continuations(
                        self.model, torch.tensor(ids), request["boundaries"],
                        [Probe(c["token_ids"], tuple(c["span"])) for c in request["continuations"]],
                        ScoringConfig()).tolist()
                continue
            out[r] = [made_up(ids[:b] + c["token_ids"], b + c["span"][0])
                      for b, c in zip(request["boundaries"], request["continuations"])]
        return out


async def test_each_turn_is_credited_with_its_result_over_another_groups_result(tiny_tokenizer):
    extras, fields, mask, scores, uids, frame = await search_batch(tiny_tokenizer)
    scorer = PairedScorer(tiny_tokenizer, frame)
    out = advantage_step(ig_search_method(), harness.records(extras), uids, mask, scores, scorer=scorer,
                         fields=fields)
    expected = expected_copies(tiny_tokenizer, frame, extras, fields, uids)
    assert len(expected) == 6 and out.metrics["ig_search/measured_turns"] == 6
    gain = out.terms["information_gain"]
    for (i, j), [(real, replaced, probe)] in expected.items():
        f = made_up(real, len(real) - len(probe.token_ids) + probe.span[0])
        c = made_up(replaced, len(replaced) - len(probe.token_ids) + probe.span[0])
        assert out.terms["answer_logprob"][i, j + 1].item() == f
        assert out.terms["random_doc_logprob"][i, j + 1].item() == c
        assert gain[i, j].item() == pytest.approx(f - c, abs=1e-6) and f != c
    assert int(torch.isfinite(gain).sum()) == 6  # no reward on an answer turn
    # IGPO's pipeline fed with these gains (as the rollout's boundary scores of a telescoping IG) trains the same.
    igpo_extras = []
    for i, extra in enumerate(extras):
        values, v = [0.0], 0.0
        for j in range(extra["igpo_num_turns"] - 1):
            v += gain[i, j].item() if (i, j) in expected else 0.0
            values.append(v)
        igpo_extras.append({**extra, "igpo_answer_logprobs": [[x] for x in values]})
    reference = advantage_step(harness.igpo_method(score_on="rollout"), harness.records(igpo_extras), uids, mask,
                               scores)
    assert torch.allclose(out.advantages, reference.advantages, atol=1e-5)


async def test_with_a_real_model_the_gain_is_the_plain_forwards_difference(tiny_tokenizer, tiny_model_dir):
    """Both copies scored in the actor's paired pass (``igpo.core.scoring.score_continuations``, two aliases) give the
    log-probabilities of plain forwards over the sequences built from the texts; the gain is their difference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    extras, fields, mask, scores, uids, frame = await search_batch(tiny_tokenizer)
    out = advantage_step(ig_search_method(answer_alias="mean"), harness.records(extras), uids, mask, scores,
                         scorer=PairedScorer(tiny_tokenizer, frame, model), fields=fields)
    expected = expected_copies(tiny_tokenizer, frame, extras, fields, uids, alias_mode="mean")
    worst = 0.0
    with torch.no_grad():
        for (i, j), copies in expected.items():
            assert len(copies) == 2
            f = sum(reference_logprob(model, real[:len(real) - len(p.token_ids)], p.token_ids, p.span)
                    for real, _, p in copies) / 2
            c = sum(reference_logprob(model, replaced[:len(replaced) - len(p.token_ids)], p.token_ids, p.span)
                    for _, replaced, p in copies) / 2
            got = (out.terms["answer_logprob"][i, j + 1].item(), out.terms["random_doc_logprob"][i, j + 1].item(),
                   out.terms["information_gain"][i, j].item())
            # The tiny model barely reads the documents (gains of 1e-4 to 3e-4), so the copies are told apart only
            # well above the scorer's float32 agreement with plain forwards (5e-7 here).
            assert all(torch.isfinite(torch.tensor(got))) and abs(f - c) > 50 * PAIRED_TOL, (i, j, got, f, c)
            worst = max(worst, abs(got[0] - f), abs(got[1] - c), abs(got[2] - (f - c)))
    assert worst <= PAIRED_TOL


async def test_a_turn_without_another_groups_document_is_counted_and_gets_no_reward(tiny_tokenizer, caplog):
    extras, fields, mask, scores, uids, frame = await search_batch(tiny_tokenizer, groups=("p",))
    scorer = PairedScorer(tiny_tokenizer, frame)
    out = advantage_step(ig_search_method(), harness.records(extras), uids, mask, scores, scorer=scorer,
                         fields=fields)
    assert out.metrics["ig_search/unmeasured_no_document"] == 3 and out.metrics["ig_search/measured_turns"] == 0
    assert scorer.requests == [] and bool(out.terms["information_gain"].isnan().all())
    assert "none of the 3 turns to measure" in caplog.text
    for row in range(2):  # the outcome alone: one value on every trained token of a row
        trained = out.advantages[row][mask[row]]
        assert torch.allclose(trained, trained[:1].expand_as(trained))


def test_settings_ig_search_cannot_honour_are_refused():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.ig_search.\['documents'\]"):
        ig_search_method({"documents": "corpus"})
    for igpo in ({"score_on": "rollout"}, {"verify_scoring": True}):
        with pytest.raises(ConfigError, match="one paired pass"):
            ig_search_method(**igpo)
    with pytest.raises(ConfigError, match="info_gain_type=prob_diff"):
        ig_search_method(info_gain_type="prob_diff")
    method = ig_search_method({"seed": 4})
    assert method.ig_search.seed == 4 and method.fields == ("prompts", "responses", "reward_model")


def test_the_scorer_is_not_called_in_a_step_with_nothing_to_measure():
    """A batch of answers only: no turn to measure, no request."""
    extras = [{"igpo_num_turns": 1, "igpo_turn_ends": [3], "igpo_boundaries": [4], "igpo_tool_names": [None],
               "igpo_tool_status": ["answer"], "igpo_turn_format_ok": [True]} for _ in range(2)]
    mask = torch.ones(2, 4, dtype=torch.bool)
    scores = torch.tensor([[0, 0, 0, 1.0], [0, 0, 0, 0.0]])
    fields = {"prompts": [torch.tensor([1, 2, 3, 4])] * 2, "responses": [torch.tensor([5, 6, 7, 8])] * 2,
              "reward_model": [{"ground_truth": GOLD}] * 2}
    scorer = SimpleNamespace(frame=SimpleNamespace(eot_text="<|im_end|>", eot_id=0, prefix_ids=(), suffix_ids={}),
                             tokenizer=None, max_positions=None)
    out = advantage_step(ig_search_method(), harness.records(extras), ["p", "p"], mask, scores, scorer=scorer,
                         fields=fields)
    assert out.metrics["ig_search/measured_turns"] == 0 and out.metrics["ig_search/scoring_tokens"] == 0


async def test_copies_of_a_turn_draw_the_same_document(tiny_tokenizer):
    """ARPO's copies of a turn (the same tokens through its observation) must hold the same gain to count once in the
    group statistics: six copies of one rollout all get the same one of group q's three different results."""
    tools = FakeTools(lambda name, args: Result(True, f"Result page for {args['query'][0][1:]}, nothing else."))
    outs = []
    for script in ([search("@Talven"), ANSWER], [search("#Brask"), ANSWER], [search("#Osk"), search("#Vell"), ANSWER]):
        out, _, _, loop = await rollout(tiny_tokenizer, scripted(*script), tools=tools, agent={"max_turns": 6})
        outs.append(out)
    outs = [outs[0]] * 6 + outs[1:]
    uids = ["p"] * 6 + ["q", "q"]
    L = max(len(o.response_ids) for o in outs)
    mask, scores = torch.zeros(len(outs), L, dtype=torch.bool), torch.zeros(len(outs), L)
    for i, out in enumerate(outs):
        mask[i, :len(out.response_mask)] = torch.tensor(out.response_mask, dtype=torch.bool)
    fields = {"prompts": [torch.tensor(o.prompt_ids) for o in outs],
              "responses": [torch.tensor(o.response_ids) for o in outs],
              "reward_model": [{"ground_truth": GOLD} for _ in outs]}
    out = advantage_step(ig_search_method(), harness.records([o.extra_fields for o in outs]), uids, mask, scores,
                         scorer=PairedScorer(tiny_tokenizer, loop.frame), fields=fields)
    copies = out.terms["random_doc_logprob"][:6, 1]
    assert bool(torch.isfinite(copies).all()) and bool((copies == copies[0]).all())
    # The q rows draw among p's documents (one text), p's copies among q's three: a different step may draw another.
    steps = {advantage_step(ig_search_method(), harness.records([o.extra_fields for o in outs]), uids, mask, scores,
                            scorer=PairedScorer(tiny_tokenizer, loop.frame), fields=fields,
                            step=step).terms["random_doc_logprob"][0, 1].item() for step in range(8)}
    assert len(steps) > 1
