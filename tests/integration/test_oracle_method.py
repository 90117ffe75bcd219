"""The oracle (igpo.integration.methods.oracle) through the trainer's advantage pipeline: it is IGPO's pipeline fed
with the world's hops in place of the information gain, a correct hop earns more than a wrong call, rows whose sample
names no chain get no turn reward, and its settings are checked."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import method_harness as harness

REPO = Path(__file__).resolve().parents[2]
# The agent loop's scripted model and fake tools live with its tests.
sys.path.insert(0, str(REPO / "tests" / "agent"))
from test_agent_loop import ANSWER, rollout, scripted, search  # noqa: E402

from igpo.config import ConfigError  # noqa: E402
from igpo.integration.methods import method_for  # noqa: E402
from igpo.integration.methods.oracle import OracleMethod  # noqa: E402
from igpo.integration.pipeline import advantage_step  # noqa: E402

CHAIN = {"hop_targets": ["@Talven", "@Mora", "#Quorvane"]}


def oracle_method(oracle=None, **igpo) -> OracleMethod:
    return method_for(harness.config("oracle", igpo={"ig_tool_filter": "", **igpo}, oracle=oracle or {}))


def random_batch(seed: int, penalty: float, groups: int = 3, size: int = 4, L: int = 48):
    """Records of ``groups`` prompts (the last one names no chain) with 1-5 turns: correct hops, wrong and failed
    calls, malformed and empty turns, infrastructure failures. Returns (oracle's extras, IGPO's extras with the hop
    potential written as each boundary's answer log-prob, uids, mask, scores)."""
    rng = random.Random(seed)
    oracle_extras, igpo_extras, uids = [], [], []
    mask, scores = torch.zeros(groups * size, L, dtype=torch.bool), torch.zeros(groups * size, L)
    for i in range(groups * size):
        g = i // size
        known = g < groups - 1
        n = rng.randint(1, 5)
        pos, ends, names, status, ok, hops, phi, empty = 0, [], [], [], [], [], [], 0
        potential = 0.0
        for j in range(n):
            phi.append(potential)
            tokens = 0 if j < n - 1 and rng.random() < 0.1 else rng.randint(1, 3)
            mask[i, pos:pos + tokens] = True
            ends.append(pos + tokens - 1 if tokens else pos)
            pos += max(tokens, 1)
            empty += tokens == 0
            if j < n - 1:
                name = rng.choice(["search", "visit", None])
                names.append(name)
                status.append(rng.choice(["ok", "ok", "ok", "no_results", "duplicate", "infra_error"]) if name
                              else "bad_request")
                hops.append(name is not None and status[-1] == "ok" and rng.random() < 0.5)
                potential += 1.0 if hops[-1] else -penalty if name is not None else 0.0
                pos += rng.randint(1, 3)  # the observation
            else:
                names.append(None)
                status.append("answer")
                hops.append(False)
            ok.append(rng.random() > 0.2)
        scores[i, ends[-1]] = rng.choice([0.0, 0.5, 1.0])
        record = {"igpo_num_turns": n, "igpo_turn_ends": ends, "igpo_boundaries": [4 + e for e in ends],
                  "igpo_tool_names": names, "igpo_tool_status": status, "igpo_turn_format_ok": ok,
                  "igpo_empty_turns": empty, "igpo_hop_right": hops if known else []}
        # The oracle must not read answer log-probs: give it noise there.
        oracle_extras.append({**record, "igpo_answer_logprobs": [[rng.uniform(-5, 0)] for _ in range(n)]})
        igpo_extras.append({**record, "igpo_answer_logprobs": [[v] for v in phi] if known else [None] * n})
        uids.append(f"q{g}")
    return oracle_extras, igpo_extras, uids, mask, scores


SETTINGS = [
    ({}, {}), ({"wrong_call_penalty": 0.5}, {}), ({"wrong_call_penalty": 0.25}, {"ig_turns": "all"}),
    ({}, {"ig_compute_freq": 2}), ({"wrong_call_penalty": 1.0}, {"ig_tool_filter": "visit"}),
    ({}, {"norm_mode": "joint"}), ({}, {"norm_mode": "separate", "norm_group": "group_turn"}),
    ({}, {"norm_mode": "raw_ig"}), ({"wrong_call_penalty": 0.5}, {"norm_order": "after_discount"}),
    ({}, {"format_penalty_mode": "in_ig_pool"}), ({}, {"use_curriculum": True}),
    ({}, {"ig_warmup_threshold": 0.4}), ({}, {"infra_failure": "mask_turn"}), ({}, {"infra_failure": "keep"}),
]


@pytest.mark.parametrize("oracle, igpo", SETTINGS)
def test_the_oracle_is_igpos_pipeline_fed_with_the_hops_as_information_gain(oracle, igpo):
    """IGPO whose rollout recorded Φ_s (correct hops minus the penalty per other call before boundary s, computed here
    by a loop over the turns) as each boundary's answer log-prob gives the very advantages the oracle gives from the
    hop records alone, under every normalisation, order, selection and masking option."""
    reference = harness.igpo_method(score_on="rollout", **igpo)
    method = oracle_method(oracle, **igpo)
    for seed in range(4):  # one method object across steps: the warm-up gate's state carries over in both
        oracle_extras, igpo_extras, uids, mask, scores = random_batch(seed, oracle.get("wrong_call_penalty", 0.0))
        ours = advantage_step(method, harness.records(oracle_extras), uids, mask, scores, scorer=None,
                              infra_failure=harness.default_policy(method), step=seed + 1, total_steps=4)
        theirs = advantage_step(reference, harness.records(igpo_extras), uids, mask, scores,
                                infra_failure=harness.default_policy(reference), step=seed + 1, total_steps=4)
        assert torch.equal(ours.advantages, theirs.advantages) and torch.equal(ours.returns, theirs.returns)
        assert torch.equal(ours.turn_values, theirs.turn_values)
        assert torch.equal(ours.terms["oracle_reward"].nan_to_num(7.0),
                           theirs.terms["information_gain"].nan_to_num(7.0))
        # IGPO asks for (and misses) a baseline on the rows without a chain; the oracle leaves them out.
        own = {"igpo/ig_requested", "igpo/samples_without_baseline"}
        mine = {k: v for k, v in ours.metrics.items() if k not in own and not k.startswith("oracle/")}
        assert mine == pytest.approx({k: v for k, v in theirs.metrics.items() if k not in own}, nan_ok=True)
    assert bool((ours.turn_values != 0).any())


async def rollouts(tokenizer, scripts, outcomes, extra_info):
    """(extras, mask, scores) of one prompt group's rollouts by the real agent loop."""
    outs = [(await rollout(tokenizer, scripted(*script), extra_info=extra_info, agent={"max_turns": 6}))[0]
            for script in scripts]
    L = max(len(o.response_ids) for o in outs)
    mask, scores = torch.zeros(len(outs), L, dtype=torch.bool), torch.zeros(len(outs), L)
    for i, (out, r) in enumerate(zip(outs, outcomes)):
        mask[i, :len(out.response_mask)] = torch.tensor(out.response_mask, dtype=torch.bool)
        scores[i, len(out.response_ids) - 1] = r
    return [o.extra_fields for o in outs], mask, scores


def turn_advantage(out, row: int, turn: int) -> float:
    """The advantage on turn ``turn``'s last generated token of row ``row``."""
    return float(out.advantages[row, int(out.turns.turn_ends[row, turn])])


@pytest.mark.parametrize("penalty", [0.0, 0.5])
async def test_a_correct_hop_gets_more_advantage_than_a_wrong_call_in_the_same_group(tiny_tokenizer, penalty):
    """Two rollouts of one chain question with the same outcome (so the outcome gives no signal): A finds the first
    hop and then calls a distractor, B calls the distractor first and then finds the hop. Each correct hop's turn gets
    more advantage than the wrong call at the same turn of the other rollout (an outcome-only estimator gives all four
    the same advantage here)."""
    scripts = [[search("@Talven"), search("#Brask"), ANSWER], [search("#Brask"), search("@Talven"), ANSWER]]
    extras, mask, scores = await rollouts(tiny_tokenizer, scripts, [0.0, 0.0], CHAIN)
    assert [e["igpo_hop_right"] for e in extras] == [[True, False, False], [False, True, False]]
    out = advantage_step(oracle_method({"wrong_call_penalty": penalty}), harness.records(extras), ["p", "p"], mask,
                         scores)
    assert turn_advantage(out, 0, 0) > turn_advantage(out, 1, 0)
    assert turn_advantage(out, 1, 1) > turn_advantage(out, 0, 1)
    assert out.metrics["oracle/right_hop_turns"] == 2 and out.metrics["oracle/wrong_call_turns"] == 2


async def test_rows_whose_sample_names_no_chain_get_the_outcome_only(tiny_tokenizer):
    """A batch of a chain question (group p) and a question without hop targets (group q): q's rows have no turn
    reward, so each trained token of theirs carries the row's outcome z-score within q; p's turns are credited."""
    scripts = [[search("@Talven"), ANSWER], [search("#Brask"), ANSWER]]
    p_extras, p_mask, p_scores = await rollouts(tiny_tokenizer, scripts, [1.0, 0.0], CHAIN)
    q_extras, q_mask, q_scores = await rollouts(tiny_tokenizer, scripts, [1.0, 0.0], None)
    assert all(e["igpo_hop_right"] == [] for e in q_extras)
    L = max(p_mask.shape[1], q_mask.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, L - t.shape[1]))  # noqa: E731
    mask, scores = torch.cat([pad(p_mask), pad(q_mask)]), torch.cat([pad(p_scores), pad(q_scores)])
    out = advantage_step(oracle_method(), harness.records(p_extras + q_extras), ["p", "p", "q", "q"], mask, scores)
    assert out.metrics["oracle/rows_without_chain"] == 2
    z = 1.0 / (1.0 + 1e-8) ** 0.5 / (1.0 + 1e-6 / (1.0 + 1e-8) ** 0.5)  # (r − μ)/(σ + ε): r ∈ {1, 0}, σ ≈ 0.5
    for row, sign in ((2, 1.0), (3, -1.0)):
        trained = out.advantages[row][mask[row]]
        assert torch.allclose(trained, torch.full_like(trained, sign * z), atol=1e-5)
        assert bool(out.terms["oracle_reward"][row].isnan().all())
        assert bool(out.terms["hop_potential"][row].isnan().all())
    assert turn_advantage(out, 0, 0) > turn_advantage(out, 1, 0)  # group p still credits the correct hop
    assert out.terms["hop_potential"][0, :2].tolist() == [0.0, 1.0]


async def test_a_step_in_which_no_sample_names_its_chain_is_refused(tiny_tokenizer):
    extras, mask, scores = await rollouts(tiny_tokenizer, [[search("@Talven"), ANSWER]] * 2, [1.0, 0.0], None)
    with pytest.raises(ValueError, match="no trajectory of step 3 names its chain.*hop_targets.*another estimator"):
        advantage_step(oracle_method(), harness.records(extras), ["q", "q"], mask, scores, step=3)


class NoScorer:
    """Any use of the actor's scoring passes fails the test: the oracle must need none."""

    def __getattr__(self, name):
        raise AssertionError(f"the oracle used the scorer ({name})")


async def test_the_oracle_runs_no_scoring_pass_and_fetches_no_sequence(tiny_tokenizer):
    extras, mask, scores = await rollouts(tiny_tokenizer, [[search("@Talven"), ANSWER]] * 2, [1.0, 0.0], CHAIN)
    method = oracle_method()
    assert isinstance(method, OracleMethod) and method.fields == () and method.response_fields == ()
    assert method.title == "oracle (the world's truth as turn reward; an upper reference, not a method)"
    out = advantage_step(method, harness.records(extras), ["p", "p"], mask, scores, scorer=NoScorer())
    assert "igpo/scoring_tokens" not in out.metrics and out.metrics["igpo/scoring_errors"] == 0


def test_settings_the_oracle_cannot_honour_are_refused():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.oracle.\['penalty'\].*wrong_call_penalty"):
        oracle_method({"penalty": 0.5})
    with pytest.raises(ValueError, match="algorithm.oracle.wrong_call_penalty=-1"):
        oracle_method({"wrong_call_penalty": -1})
    for igpo in ({"score_on": "rollout"}, {"verify_scoring": True}):
        with pytest.raises(ConfigError, match="answer probes that the oracle never reads"):
            oracle_method(**igpo)
    with pytest.raises(ConfigError, match="info_gain_type=prob_diff.*difference of hop counts"):
        oracle_method(info_gain_type="prob_diff")
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.igpo"):  # algorithm.igpo is IGPO's, checked so
        oracle_method(norm_mod="joint")
