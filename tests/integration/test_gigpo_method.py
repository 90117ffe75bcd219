"""The GiGPO method (igpo.integration.methods.gigpo) through the trainer's advantage pipeline, on trajectories the
real igpo_agent loop wrote (scripted model, fake tools): anchor states read from the observation tokens, advantages on
each turn's tokens, infrastructure failures and malformed turns, the config section."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import method_harness as harness

REPO = Path(__file__).resolve().parents[2]
# The agent loop's scripted model and fake tools live with its tests.
sys.path.insert(0, str(REPO / "tests" / "agent"))
from test_agent_loop import ANSWER, FakeTools, Result, rollout, scripted, search  # noqa: E402

from igpo.core.gigpo import GiGPOConfig, GiGPOInputs, gigpo_advantage  # noqa: E402
from igpo.integration.methods import method_for  # noqa: E402
from igpo.integration.methods.gigpo import GiGPOMethod, gigpo_config_from_algorithm  # noqa: E402
from igpo.integration.pipeline import advantage_step  # noqa: E402

MALFORMED = "<think>x</think>\n<tool_call>not json</tool_call>"


def gigpo_method(**gigpo) -> GiGPOMethod:
    return method_for(harness.config("gigpo", gamma=0.5, gigpo=gigpo))


async def batch_of(tokenizer, scripts, outcomes, tools=None):
    """(records' extra_fields, fields, response_mask, rm_scores, frame) of one prompt group's rollouts."""
    outs = []
    for script in scripts:
        out, _, _, loop = await rollout(tokenizer, scripted(*script), tools=tools)
        outs.append(out)
    L = max(len(o.response_ids) for o in outs)
    mask = torch.zeros(len(outs), L, dtype=torch.bool)
    scores = torch.zeros(len(outs), L)
    for i, (out, r) in enumerate(zip(outs, outcomes)):
        mask[i, :len(out.response_mask)] = torch.tensor(out.response_mask, dtype=torch.bool)
        scores[i, len(out.response_ids) - 1] = r
    fields = {"prompts": [torch.tensor(o.prompt_ids) for o in outs],
              "responses": [torch.tensor(o.response_ids) for o in outs]}
    return [o.extra_fields for o in outs], fields, mask, scores, loop.frame


def run(method, extras, fields, mask, scores, frame, policy="mask_trajectory"):
    return advantage_step(method, harness.records(extras), ["p0"] * len(extras), mask, scores, infra_failure=policy,
                          scorer=SimpleNamespace(frame=frame), fields=fields)


# A: q1 -> answer (1); B: q1 -> answer (0); C: q2 -> answer (1); D: answer (0); E: q2 -> q1 -> answer (1).
SCRIPTS = [[search("q1"), ANSWER], [search("q1"), ANSWER], [search("q2"), ANSWER], [ANSWER],
           [search("q2"), search("q1"), ANSWER]]
OUTCOMES = [1.0, 0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("anchor, groups", [
    # step groups as (trajectory, turn) sets; the question is every first turn's anchor
    ("last_observation", [{(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)}, {(0, 1), (1, 1), (4, 2)}, {(2, 1), (4, 1)}]),
    ("observation_history", [{(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)}, {(0, 1), (1, 1)}, {(2, 1), (4, 1)},
                             {(4, 2)}]),
])
async def test_anchor_states_come_from_the_observation_tokens(tiny_tokenizer, anchor, groups):
    extras, fields, mask, scores, frame = await batch_of(tiny_tokenizer, SCRIPTS, OUTCOMES)
    method = gigpo_method(anchor=anchor)
    out = run(method, extras, fields, mask, scores, frame)
    states, _ = method.anchor_states(SimpleNamespace(turns=out.turns, fields=fields), SimpleNamespace(frame=frame))
    ids = method.exact_anchors(states, out.turns.width)
    found: dict[int, set] = {}
    for i, n in enumerate(out.turns.num_turns.tolist()):
        for t in range(n):
            found.setdefault(int(ids[i, t]), set()).add((i, t))
    assert sorted(found.values(), key=min) == sorted(groups, key=min)
    m = out.metrics
    assert m["gigpo/anchor_fallbacks"] == 0 and m["gigpo/step_rows"] == 10
    assert m["gigpo/step_groups"] == len(groups) and m["gigpo/step_group_size_max"] == 5
    grouped = sum(len(g) for g in groups if len(g) >= 2)
    assert m["gigpo/grouped_row_share"] == pytest.approx(grouped / 10)
    later = sum(1 for g in groups if len(g) >= 2 for _, t in g if t >= 1)
    assert m["gigpo/grouped_row_share_after_first"] == pytest.approx(later / 5)

    # Each turn's tokens carry that turn's A = A^E + omega A^S from the core; observation tokens carry nothing.
    anchor_ids = torch.full_like(ids, -1)
    for k, members in enumerate(groups):
        for i, t in members:
            anchor_ids[i, t] = k
    turns = out.turns
    rows = torch.arange(turns.width)[None, :] < turns.num_turns[:, None]
    expected = gigpo_advantage(GiGPOInputs(torch.tensor(OUTCOMES, dtype=torch.float64), turns.num_turns, rows,
                                           ~turns.format_ok & rows, anchor_ids, torch.zeros(5, dtype=torch.long)),
                               GiGPOConfig(anchor=anchor, gamma=0.5))
    for i in range(5):
        start = 0
        for t in range(int(turns.num_turns[i])):
            end = int(turns.turn_ends[i, t]) + 1
            trained = mask[i, start:end]
            assert torch.allclose(out.advantages[i, start:end][trained],
                                  expected.advantage[i, t].expand(int(trained.sum())))
            start = end
        assert out.advantages[i][~mask[i]].abs().max() == 0
    assert out.advantages[2, mask[2]].min() > 0 > out.advantages[1, mask[1]].max()


async def test_a_masked_trajectory_is_in_no_group_and_gets_nothing(tiny_tokenizer):
    def respond(name, args):
        if "down" in str(args):
            return Result(False, "", error_kind="upstream_5xx")
        return Result(True, f"result of {name} {args}")

    scripts = SCRIPTS[:3] + [[search("down"), ANSWER]]
    extras, fields, mask, scores, frame = await batch_of(tiny_tokenizer, scripts, OUTCOMES[:3] + [1.0],
                                                         tools=FakeTools(respond))
    assert extras[3]["igpo_tool_status"][0] == "infra_error"
    method = gigpo_method()
    out = run(method, extras, fields, mask, scores, frame)
    alone = run(method, extras[:3], {k: v[:3] for k, v in fields.items()}, mask[:3], scores[:3], frame)
    assert out.advantages[3].abs().max() == 0 and out.metrics["igpo/infra_masked_trajectories"] == 1
    assert torch.equal(out.advantages[:3], alone.advantages)
    kept = run(method, extras, fields, mask, scores, frame, policy="keep")
    assert kept.advantages[3, mask[3]].abs().min() > 0


async def test_a_malformed_turn_pays_the_invalid_action_penalty(tiny_tokenizer):
    extras, fields, mask, scores, frame = await batch_of(tiny_tokenizer, [[MALFORMED, ANSWER], [MALFORMED, ANSWER]],
                                                         [1.0, 1.0])
    assert extras[0]["igpo_turn_format_ok"] == [False, True]
    free = run(gigpo_method(invalid_action_penalty=0.0), extras, fields, mask, scores, frame)
    paid = run(gigpo_method(invalid_action_penalty=0.1), extras, fields, mask, scores, frame)
    assert free.advantages.abs().max() == 0  # equal outcomes, equal states: no signal
    assert paid.metrics["gigpo/invalid_turns"] == 2
    # Episode scores 0.9, 1, 0.9, 1 (mean 0.95); the malformed turns' step group holds two equal returns.
    first = paid.advantages[0, :int(paid.turns.turn_ends[0, 0]) + 1]
    assert torch.allclose(first[first != 0], torch.tensor(-0.05, dtype=torch.float64))
    # The error text the loop answered with is the second turn's anchor: both trajectories share it.
    assert paid.metrics["gigpo/step_groups"] == 2 and paid.metrics["gigpo/grouped_row_share"] == 1.0


async def test_without_the_chat_frame_the_anchor_cannot_be_read(tiny_tokenizer):
    extras, fields, mask, scores, _ = await batch_of(tiny_tokenizer, SCRIPTS[:2], OUTCOMES[:2])
    with pytest.raises(ValueError, match="chat frame"):
        advantage_step(gigpo_method(), harness.records(extras), ["p0", "p0"], mask, scores, fields=fields)


def test_config_section_is_parsed_once_and_refuses_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.gigpo.\['step_advantage_w'\]"):
        gigpo_method(step_advantage_w=1.0)
    with pytest.raises(ValueError, match="algorithm.gigpo.mode"):
        gigpo_method(mode="std")
    assert isinstance(gigpo_method(), GiGPOMethod) and gigpo_method().gigpo.gamma == 0.5
    section = yaml.safe_load((REPO / "configs" / "igpo_base.yaml").read_text())["algorithm"]["gigpo"]
    assert gigpo_config_from_algorithm({"gigpo": section}) == GiGPOConfig()


async def test_similar_observations_share_a_step_group_with_similarity_on(tiny_tokenizer):
    """The same batch with the observations' texts close but not identical: exact groups keep them apart, similarity
    groups (verl-agent's search recipe, threshold 0.9) join them, and the joined rows are counted."""
    def respond(name, args):
        query = args["query"][0]
        page = "The employer of Talven is Brightwater Mills, founded 1881 in Osk; it makes flour and paper."
        return Result(True, page if query == "q1" else page.replace("1881", "1882") if query == "q2" else query)

    extras, fields, mask, scores, frame = await batch_of(tiny_tokenizer, SCRIPTS, OUTCOMES, tools=FakeTools(respond))
    scorer = SimpleNamespace(frame=frame, tokenizer=tiny_tokenizer)
    exact = advantage_step(gigpo_method(), harness.records(extras), ["p0"] * 5, mask, scores, scorer=scorer,
                           fields=fields)
    similar = advantage_step(gigpo_method(similarity=True, similarity_threshold=0.9), harness.records(extras),
                             ["p0"] * 5, mask, scores, scorer=scorer, fields=fields)
    # Exact: the question, then q1's page {(0,1), (1,1), (4,2)} and q2's {(2,1), (4,1)}. Similar: one page group.
    assert exact.metrics["gigpo/step_groups"] == 3 and similar.metrics["gigpo/step_groups"] == 2
    assert "gigpo/similarity_joined_rows" not in exact.metrics
    groups = similar.terms["step_group"]
    assert len({float(groups[i, t]) for i, t in [(0, 1), (1, 1), (2, 1), (4, 1), (4, 2)]}) == 1
    # q1's page came first (trajectory 0, turn 1), so q2's two rows joined by similarity, after the first turn.
    assert similar.metrics["gigpo/similarity_joined_rows_after_first"] == 2
    assert similar.terms["similarity_joined"][[2, 4], [1, 1]].tolist() == [1.0, 1.0]
    assert similar.terms["similarity_joined"].sum() == 2
    assert not torch.equal(exact.advantages, similar.advantages)
    # A stricter threshold than the two pages' ratio keeps them apart again.
    strict = advantage_step(gigpo_method(similarity=True, similarity_threshold=0.999), harness.records(extras),
                            ["p0"] * 5, mask, scores, scorer=scorer, fields=fields)
    assert torch.equal(strict.advantages, exact.advantages) and strict.metrics["gigpo/similarity_joined_rows"] == 0


def test_the_similarity_keys_are_checked():
    with pytest.raises(ValueError, match=r"similarity_threshold=1.0 must be a number in \(0, 1\)"):
        gigpo_method(similarity=True, similarity_threshold=1.0)
    with pytest.raises(ValueError, match="algorithm.gigpo.similarity='yes' must be true or false"):
        gigpo_method(similarity="yes")


def test_the_verl_agent_search_preset_sets_what_its_recipe_sets():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        config = compose(config_name="cpu_demo", overrides=["gigpo_preset=verl_agent_search"])
    assert config.algorithm.adv_estimator == "gigpo" and config.algorithm.gamma == 0.95
    assert gigpo_config_from_algorithm(config.algorithm) == GiGPOConfig(
        step_advantage_weight=1.0, mode="mean_std_norm", similarity=True, similarity_threshold=0.9,
        invalid_action_penalty=0.01, anchor="last_observation", episode_pool="step_rows", gamma=0.95)
