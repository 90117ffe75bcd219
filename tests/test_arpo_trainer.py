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
    from igpo.launch.launch_plan import ConfigError, check_arpo

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
