"""ARPO in the igpo_sync trainer (hard attribution, the tree check on what verl stored) and the launch checks."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from igpo.agent.records import BranchRecord, TurnBatch, TurnRecord
from igpo.integration.branching import arpo_tree_check, hard_attribution


def _record(index, parent=-1, pos=0):
    return TurnRecord(branch=BranchRecord(index=index, parent=parent, branch_pos=pos))


def _turns(records):
    return TurnBatch.from_records(records, length=4)


def test_hard_equals_soft_when_nothing_branched_and_averages_shared_tokens_otherwise():
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, 0.0], [4.0, 4.0, 4.0, 4.0]])
    mask = torch.ones(3, 4, dtype=torch.long)
    uids = ["a", "a", "a"]
    roots = [_record(0), _record(1), _record(2)]
    assert torch.equal(hard_attribution(adv, mask, uids, _turns(roots)), adv)
    tree = [_record(0), _record(1, parent=0, pos=2), _record(2)]
    metrics = {}
    hard = hard_attribution(adv, mask, uids, _turns(tree), metrics)
    assert metrics == {"arpo/hard_shared_tokens": 4.0}  # two positions in two rows
    assert hard[:2, :2].eq(0.0).all()  # the two tokens rows 0 and 1 share get the mean of 1 and -1
    assert torch.equal(hard[:, 2:], adv[:, 2:]) and torch.equal(hard[2], adv[2])


def test_tree_check_counts_mismatched_prefixes_and_incomplete_groups():
    responses = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9], [1, 2, 3, 0], [5, 7, 7, 7]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0], [1, 0, 1, 1]])
    uids = ["a", "a", "a", "b"]
    good = [_record(0), _record(1, 0, 2), _record(2), _record(0)]
    assert arpo_tree_check(responses[:3], mask[:3], uids[:3], _turns(good[:3]), 3) == (0.0, 0.0)
    bad = [_record(0), _record(1, 0, 3), _record(2), _record(0)]  # rows 0 and 1 differ at position 2
    assert arpo_tree_check(responses, mask, uids, _turns(bad), 3) == (1.0, 1.0)  # and prompt b has one row of three


def _launch_config(**overrides):
    base = {
        "trainer": {"use_v1": True, "v1": {"trainer_mode": "igpo_sync"}},
        "actor_rollout_ref": {"rollout": {"n": 4, "agent": {"default_agent_loop": "igpo_agent"}}},
        "algorithm": {"igpo": {"agent": {}}, "arpo": {"enabled": True}},
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def test_launch_checks_switch_the_loop_and_refuse_what_cannot_branch():
    from igpo.config import IGPOConfig
    from igpo.config import ConfigError
    from igpo.launch.launch_plan import check_arpo

    def check(config):
        return check_arpo(config, IGPOConfig.from_algorithm(config.algorithm))

    config = _launch_config()
    arpo = check(config)
    assert (arpo.rollouts_per_prompt, arpo.initial_rollouts) == (4, 2)
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "arpo_agent"
    off = _launch_config(**{"algorithm.arpo.enabled": False})
    check(off)
    assert off.actor_rollout_ref.rollout.agent.default_agent_loop == "igpo_agent"
    cases = {
        "trainer.use_v1": (False, "trainer.use_v1=true"),
        "trainer.v1.trainer_mode": ("sync", "trainer_mode=igpo_sync"),
        "actor_rollout_ref.rollout.agent.default_agent_loop": ("tool_agent", "default_agent_loop=arpo_agent"),
        "algorithm.igpo.agent.completion_cutoff": (0.9, "completion_cutoff=1.0"),
        "algorithm.arpo.initial_rollouts": (5, r"initial_rollouts=5 exceeds"),
        "algorithm.arpo.entropy_weight": (-1, r"entropy_weight=-1.0 must be"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ConfigError, match=message):
            check(_launch_config(**{key: value}))


# ---- soft vs hard attribution through verl's policy loss ----------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _pg_grad(token_of, theta_old, advantages, mask, mode):
    """d loss / d θ of verl's clipped PPO loss (compute_policy_loss_vanilla, its agg_loss) where row b, position p
    holds token ``token_of[b, p]`` of the distinct-token log-probs θ: the copies of a shared token are one parameter,
    as the copies of a shared prefix are one context of the policy."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                               "global_batch_info": {}})
    theta = (theta_old + 0.05 * torch.sin(torch.arange(theta_old.numel(), dtype=torch.float64))).requires_grad_()
    loss, _ = compute_policy_loss_vanilla(theta_old[token_of], theta[token_of], advantages, mask,
                                          loss_agg_mode=mode, config=config)
    loss.backward()
    return theta.grad


def _toy_group():
    """One prompt, three trajectories of 4 response tokens: 0 a root; 1 branched from 0 after 2 tokens (shares
    tokens 0, 1); 2 a root. Distinct tokens 0..9."""
    token_of = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5], [6, 7, 8, 9]])
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)[:, None].expand(3, 4).clone()
    mask = torch.ones(3, 4, dtype=torch.float64)
    theta_old = -torch.linspace(0.5, 2.0, 10, dtype=torch.float64)
    return token_of, adv, mask, theta_old


def test_soft_and_hard_give_different_gradients_on_shared_tokens_and_equal_ones_elsewhere():
    token_of, adv, mask, theta_old = _toy_group()
    uids = ["q"] * 3
    tree = _turns([_record(0), _record(1, parent=0, pos=2), _record(2)])
    hard_adv = hard_attribution(adv, mask, uids, tree)
    shared, own = [0, 1], [2, 3, 4, 5, 6, 7, 8, 9]
    for mode in LOSS_AGG_MODES:
        soft = _pg_grad(token_of, theta_old, adv, mask, mode)
        hard = _pg_grad(token_of, theta_old, hard_adv, mask, mode)
        assert torch.allclose(soft[own], hard[own], rtol=0, atol=1e-15), mode
        # soft trains a token shared by |S| = 2 trajectories twice (the sum of their advantages); hard once (the mean)
        assert torch.allclose(soft[shared], 2 * hard[shared], rtol=1e-12), mode
        assert not torch.allclose(soft[shared], hard[shared]), mode
    # seq-mean-token-sum: hard is exactly the de-duplicated batch, where the shared tokens appear once (in row 0)
    # with the mean advantage of their sharers; token-mean: the same up to the token count N (12 vs 10)
    dedup_adv, dedup_mask = adv.clone(), mask.clone()
    dedup_adv[0, :2] = (1.0 - 0.5) / 2
    dedup_mask[1, :2] = 0
    hard = _pg_grad(token_of, theta_old, hard_adv, mask, "seq-mean-token-sum")
    assert torch.allclose(hard, _pg_grad(token_of, theta_old, dedup_adv, dedup_mask, "seq-mean-token-sum"), atol=1e-15)
    hard = _pg_grad(token_of, theta_old, hard_adv, mask, "token-mean")
    dedup = _pg_grad(token_of, theta_old, dedup_adv, dedup_mask, "token-mean")
    assert torch.allclose(hard * 12, dedup * 10, atol=1e-14)


def test_soft_and_hard_give_equal_gradients_when_no_token_is_shared():
    token_of, adv, mask, theta_old = _toy_group()
    token_of[1, :2] = torch.tensor([10, 11])  # trajectory 1 is a root now: nothing shared
    theta_old = torch.cat([theta_old, torch.tensor([-0.7, -1.1], dtype=torch.float64)])
    roots = _turns([_record(0), _record(1), _record(2)])
    hard_adv = hard_attribution(adv, mask, ["q"] * 3, roots)
    assert torch.equal(hard_adv, adv)
    for mode in LOSS_AGG_MODES:
        assert torch.equal(_pg_grad(token_of, theta_old, adv, mask, mode),
                           _pg_grad(token_of, theta_old, hard_adv, mask, mode)), mode


def test_igpo_over_a_branched_group_pools_the_shared_turn_once_and_hard_averages_the_shared_prefix():
    """The IGPO estimator on an ARPO tree through the advantage pipeline (the end-to-end ARPO run,
    tests/e2e/test_e2e_arpo.py, trains verl's GRPO): the tree check passes; the IG turn a branch copied from its source
    weighs 1/2 in the IG statistics (tests/core/test_shared_turns.py has the math), and a tree of roots changes nothing;
    hard attribution then averages the shared prefix's advantages."""
    import method_harness as harness

    from igpo.integration.pipeline import TreeCheck, advantage_step

    uids = ["a"] * 3 + ["b"] * 3
    # (index, parent, branch_pos): a1 branched from a0 after a0's first tool result (4 response tokens); b: roots.
    tree = [(0, -1, 0), (1, 0, 4), (2, -1, 0), (0, -1, 0), (1, -1, 0), (2, -1, 0)]
    length, boundaries = 8, [4, 8]  # a search (tokens 0-1), its observation (2-3), the answer (4-7)
    mask = torch.ones(6, length, dtype=torch.bool)
    mask[:, 2:4] = False
    scores = torch.zeros(6, length)
    scores[:, -1] = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.5])
    # l_s at the two boundaries; a1 copies a0's search and its result, so it holds a0's IG for turn 0.
    logprobs = [(-2.0, -1.0), (-2.0, -1.0), (-2.5, -2.25), (-1.5, -1.25), (-2.0, -0.5), (-1.0, -1.75)]
    extras = []
    for row, (index, parent, pos) in enumerate(tree):
        record = TurnRecord(turn_ends=[1, length - 1], boundaries=boundaries, tool_names=["search", None],
                            tool_status=["ok", "answer"], format_ok=[True, True],
                            answer_logprobs=[[value] for value in logprobs[row]])
        plain = record.to_extra_fields()
        record.branch = BranchRecord(index=index, parent=parent, branch_pos=pos, prompt=uids[row])
        extras.append((plain, record.to_extra_fields()))
    responses = torch.arange(length).repeat(6, 1)  # every branch equals its parent before its branch position

    def step(records, **kwargs):
        return advantage_step(harness.igpo_method(), harness.records(records), uids, mask, scores, step=1,
                              total_steps=10, **kwargs)

    plain = step([fields for fields, _ in extras])
    roots = step([{**fields, "arpo_parent": -1, "arpo_branch_pos": 0} for _, fields in extras],
                 tree_check=TreeCheck(responses, 3))
    soft = step([fields for _, fields in extras], tree_check=TreeCheck(responses, 3))
    assert soft.metrics["arpo/prefix_mismatches"] == 0.0 and soft.metrics["arpo/incomplete_groups"] == 0.0
    assert soft.metrics["igpo/shared_ig_turns"] == 2.0 and "igpo/shared_ig_turns" not in plain.metrics
    assert torch.equal(roots.advantages, plain.advantages) and not torch.allclose(soft.advantages, plain.advantages)
    hard = step([fields for _, fields in extras], tree_check=TreeCheck(responses, 3), arpo_hard=True)
    assert torch.equal(hard.advantages, hard_attribution(soft.advantages, mask, uids, soft.turns))
    assert not torch.equal(hard.advantages, soft.advantages) and hard.metrics["arpo/hard_shared_tokens"] > 0
