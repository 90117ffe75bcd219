"""verl's own estimators (``algorithm.adv_estimator=grpo``, ...) through the one advantage pipeline
(igpo.integration.methods.outcome.VerlEstimator): verl's advantages, the rollout metrics around them, ARPO's tree
check and hard attribution on top; no Ray, no TransferQueue."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos

import method_harness as harness
from igpo.agent.records import BranchRecord, TurnBatch, TurnRecord
from igpo.integration.branching import hard_attribution
from igpo.integration.methods import method_for
from igpo.integration.methods.outcome import VerlEstimator
from igpo.integration.pipeline import TreeCheck, advantage_step
from igpo.integration.rollout_correction import decoupled_section
from igpo.integration.rollout_metrics import rollout_metrics

UIDS = ["a", "a", "a", "b", "b", "b"]
KEYS = [f"{uid}_{session}_0" for uid, session in zip(UIDS, [0, 1, 2, 0, 1, 2])]


def grpo(**algorithm) -> VerlEstimator:
    return method_for(harness.config("grpo", gamma=1.0, lam=1.0, **algorithm))


def batch(outcomes=(1.0, 0.0, 0.5, 1.0, 1.0, 0.0), length=6):
    """Records (two turns each: a search, an answer), response mask [B, L] and the outcome on the last token."""
    B = len(outcomes)
    records = [TurnRecord(turn_ends=[1, length - 1], tool_names=["search", None], tool_status=["ok", "answer"],
                          format_ok=[True, True]) for _ in range(B)]
    mask = torch.ones(B, length, dtype=torch.bool)
    mask[:, 2:4] = False  # the observation
    scores = torch.zeros(B, length)
    scores[:, -1] = torch.tensor(outcomes)
    return records, mask, scores


def test_an_unclaimed_name_is_verls_estimator_and_the_pipeline_gives_verls_grpo_advantages():
    method = grpo()
    assert isinstance(method, VerlEstimator) and method.name == "grpo" and not method.masks_infra
    records, mask, scores = batch()
    out = advantage_step(method, records, UIDS, mask, scores, infra_failure="keep", keys=KEYS)
    expected, _ = core_algos.compute_grpo_outcome_advantage(scores, mask.long(), UIDS, norm_adv_by_std_in_grpo=True)
    assert torch.equal(out.advantages, expected) and torch.equal(out.returns, expected)
    # The metrics of verl's path: the rollout metrics, the outcome share and the (empty) infra policy; no arpo/*.
    turns = TurnBatch.from_records(records, mask.shape[1])
    assert set(out.metrics) == {*rollout_metrics(turns), "outcome/same_outcome_group_share",
                                "outcome/success_share", "igpo/infra_masked_trajectories", "igpo/infra_masked_turns"}
    assert out.metrics["outcome/success_share"] == 0.5  # outcomes 1, 0, 0.5, 1, 1, 0: a partial F1 is no success
    assert out.metrics["igpo/infra_masked_trajectories"] == out.metrics["igpo/infra_masked_turns"] == 0.0
    assert out.metrics["igpo/tool_calls"] == 6.0


def test_a_session_with_several_outputs_takes_its_last_outputs_advantage():
    # verl's GRPO groups the outputs of one agent-loop session ({uid}_{session}_{index}) and scores the last one.
    records, mask, scores = batch()
    keys = ["a_0_0", "a_0_1", "a_1_0", "b_0_0", "b_1_0", "b_2_0"]
    out = advantage_step(grpo(), records, UIDS, mask, scores, infra_failure="keep", keys=keys)
    assert torch.equal(out.advantages[0], out.advantages[1])
    with pytest.raises(ValueError, match="5 TransferQueue keys for 6 rows"):
        advantage_step(grpo(), records, UIDS, mask, scores, infra_failure="keep", keys=keys[:5])


def test_hard_attribution_rewrites_verls_advantages_on_the_shared_prefix():
    records, mask, scores = batch()
    tree = [(0, -1, 0), (1, 0, 2), (2, -1, 0), (0, -1, 0), (1, -1, 0), (2, 1, 5)]
    for record, uid, (index, parent, pos) in zip(records, UIDS, tree):
        record.branch = BranchRecord(index=index, parent=parent, branch_pos=pos, prompt=uid)
    responses = torch.arange(6).repeat(6, 1)
    plain = advantage_step(grpo(), records, UIDS, mask, scores, infra_failure="keep", keys=KEYS)
    out = advantage_step(grpo(), records, UIDS, mask, scores, infra_failure="keep", keys=KEYS, arpo_hard=True,
                         tree_check=TreeCheck(responses, 3))
    turns = TurnBatch.from_records(records, mask.shape[1])
    assert torch.equal(out.advantages, hard_attribution(plain.advantages, mask, UIDS, turns))
    assert not torch.equal(out.advantages, plain.advantages)
    assert out.metrics["arpo/prefix_mismatches"] == 0.0 and out.metrics["arpo/incomplete_groups"] == 0.0
    assert out.metrics["arpo/hard_shared_tokens"] > 0 and out.metrics["arpo/branches_per_prompt"] == 1.0


def test_verls_rollout_correction_measures_where_verl_would():
    """The pipeline applies verl's decoupled correction for every method (tests/integration/test_rollout_correction.py);
    with neither rollout_is nor rollout_rs it only measures, as verl does, and in bypass mode it does nothing here."""
    records, mask, scores = batch()
    old = torch.full(mask.shape, -1.0)
    fields = {"old_log_probs": old, "rollout_log_probs": old - 0.1}
    correction = {"rollout_is": None, "rollout_rs": None, "bypass_mode": False}
    measuring = grpo(rollout_correction=correction)
    measured = advantage_step(measuring, records, UIDS, mask, scores, infra_failure="keep", keys=KEYS, fields=fields,
                              rollout_correction=decoupled_section(measuring.config.algorithm))
    assert any(name.startswith("rollout_corr/") for name in measured.metrics)
    assert torch.equal(measured.correction.response_mask, mask) and measured.correction.rollout_is_weights is None
    bypass = OmegaConf.to_container(OmegaConf.create({**correction, "bypass_mode": True}))
    skipping = grpo(rollout_correction=bypass)
    skipped = advantage_step(skipping, records, UIDS, mask, scores, infra_failure="keep", keys=KEYS, fields=fields,
                             rollout_correction=decoupled_section(skipping.config.algorithm))
    assert not any(name.startswith("rollout_corr/") for name in skipped.metrics) and skipped.correction is None
    assert torch.equal(measured.advantages, skipped.advantages)


def test_verls_estimator_sees_the_rejection_as_in_verls_step():
    """A rejected sequence's tokens get no advantage from verl's estimator (verl's step rejects before it estimates),
    and its loss mask is empty."""
    records, mask, scores = batch()
    old = torch.full(mask.shape, -1.0)
    old_2 = old.clone()
    old_2[2] = -3.0  # trajectory 2: the actor finds it e^-2 times as likely per token as the rollout did
    fields = {"old_log_probs": old_2, "rollout_log_probs": old}
    method = grpo(rollout_correction={"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2.0"})
    out = advantage_step(method, records, UIDS, mask, scores, infra_failure="keep", keys=KEYS, fields=fields,
                         rollout_correction=decoupled_section(method.config.algorithm))
    assert not out.loss_mask[2].any() and out.advantages[2].abs().max() == 0
    assert torch.equal(out.loss_mask[[0, 1, 3, 4, 5]], mask[[0, 1, 3, 4, 5]])
