"""Can turn credit pay for progress? Rollouts of one chain question by the real agent loop, none with a wrong call and
all with the same (failed) outcome, so only the turn credit can tell them apart: the trajectory that made more correct
hops must get more credit for its first call, taken from the same state (no hop made yet), and a first call must get
more than an answer given from that state. The oracle (the world's hops as turn reward) runs through the trainer's
advantage pipeline in each design (docs/methods/turn_credit.md). The default ``scaled_separate`` fails it: the hop
rewards are z-scored over the group's calls, all equal here, so every call gets the same credit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import method_harness as harness

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "agent"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
from test_agent_loop import ANSWER, search  # noqa: E402
from test_oracle_method import CHAIN, oracle_method, rollouts, turn_advantage  # noqa: E402

from igpo.integration.pipeline import advantage_step  # noqa: E402

HOPS = ["@Talven", "@Mora", "#Quorvane"]
# Rows: 0, 1, 2 and 3 correct hops, then an answer; every outcome 0.
SCRIPTS = [[ANSWER]] + [[search(h) for h in HOPS[:n]] + [ANSWER] for n in (1, 2, 3)]

DESIGNS = {
    "uncentred": ({}, {"norm_mode": "uncentred", "ig_weight": 0.25}),
    "potential": ({"progress_unit": "chain"}, {"norm_mode": "potential"}),
    "state_grouped": ({}, {"norm_mode": "state_grouped"}),
}


async def progress_batch(tokenizer):
    extras, mask, scores = await rollouts(tokenizer, SCRIPTS, [0.0] * len(SCRIPTS), CHAIN)
    assert [sum(e["igpo_hop_right"]) for e in extras] == [0, 1, 2, 3]
    assert [e["igpo_hop_total"] for e in extras] == [3] * 4
    return extras, mask, scores


@pytest.mark.parametrize("design", sorted(DESIGNS))
async def test_more_correct_hops_get_more_credit_in_every_progress_design(tiny_tokenizer, design):
    oracle, igpo = DESIGNS[design]
    extras, mask, scores = await progress_batch(tiny_tokenizer)
    out = advantage_step(oracle_method(oracle, **igpo), harness.records(extras), ["p"] * 4, mask, scores)
    first = [turn_advantage(out, row, 0) for row in range(4)]  # row 0's first turn is its answer
    assert first[0] < first[1] < first[2] < first[3], (design, first)
    # The whole trajectory: the mean advantage over its trained tokens rises with the hops made.
    means = [float(out.advantages[row][mask[row]].mean()) for row in range(4)]
    assert means[0] < means[1] < means[2] < means[3], (design, means)


async def test_the_default_scaled_separate_cannot_pay_for_progress(tiny_tokenizer):
    """The current default fails the test above: each first call gets the same advantage whatever followed it."""
    extras, mask, scores = await progress_batch(tiny_tokenizer)
    out = advantage_step(oracle_method(), harness.records(extras), ["p"] * 4, mask, scores)
    first = [turn_advantage(out, row, 0) for row in range(1, 4)]
    assert first[0] == pytest.approx(first[1], abs=1e-6) and first[1] == pytest.approx(first[2], abs=1e-6), first
    assert out.metrics["igpo/ig_scale"] > 0  # the pool had calls: their z-scores are all 0


async def test_state_grouped_compares_a_call_with_the_answer_given_from_the_same_state(tiny_tokenizer):
    """Under state_grouped with the hop anchor, row 0's answer and the other rows' first calls share the state "no
    hop yet"; the answer's step return (its outcome, 0) is the lowest of that state, so its advantage is negative and
    below each call's (the outcomes are equal, so the episode term is 0 and the advantage is the step term)."""
    extras, mask, scores = await progress_batch(tiny_tokenizer)
    out = advantage_step(oracle_method(norm_mode="state_grouped"), harness.records(extras), ["p"] * 4, mask, scores)
    assert turn_advantage(out, 0, 0) < min(0.0, turn_advantage(out, 1, 0))
    # Row 3's first call: R = 1 + 0.95 + 0.95² against the state's mean (0 + 1 + 1.95 + 2.8525) / 4.
    assert turn_advantage(out, 3, 0) == pytest.approx(2.8525 - 5.8025 / 4, abs=1e-5)
    assert out.metrics["igpo/state_shared_share"] > 0.5
    turn_anchor = advantage_step(oracle_method(norm_mode="state_grouped", state_anchor="turn"),
                                 harness.records(extras), ["p"] * 4, mask, scores)
    assert turn_anchor.metrics["igpo/state_shared_share"] > 0  # the turn index is a state as well, a coarser one


async def test_progress_unit_chain_pays_a_chain_one_in_all_and_needs_the_chain_length(tiny_tokenizer):
    extras, mask, scores = await progress_batch(tiny_tokenizer)
    out = advantage_step(oracle_method({"progress_unit": "chain"}, norm_mode="potential"), harness.records(extras),
                         ["p"] * 4, mask, scores)
    rewards = out.terms["oracle_reward"][3]
    assert rewards[:3].tolist() == pytest.approx([1 / 3] * 3)  # three correct hops of a three-hop chain
    with pytest.raises(ValueError, match="progress_unit=chain: a trajectory names its chain but its record has no "
                                         "chain length"):
        older = [{k: v for k, v in e.items() if k != "igpo_hop_total"} for e in extras]
        advantage_step(oracle_method({"progress_unit": "chain"}), harness.records(older), ["p"] * 4, mask, scores)
    with pytest.raises(ValueError, match="progress_unit='chains' is unknown"):
        oracle_method({"progress_unit": "chains"})
