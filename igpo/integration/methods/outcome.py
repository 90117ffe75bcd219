"""Outcome-only baselines: any advantage estimator registered with verl (``algorithm.adv_estimator=grpo``, rloo, ...)
that no method here claims, through the same pipeline as the turn-level methods.

``VerlEstimator.advantage`` is verl's own advantage step (the v1 trainer's ``_compute_advantage``) on the step's
tensors: the outcome reward as the token rewards, verl's rollout-correction metrics where verl computes them, and
verl's estimator with its grouping of a session's outputs. The pipeline adds the rollout metrics and ARPO's
attribution around it, on the same agent loop, so comparisons with IGPO or InfoPO are like for like. The igpo_sync
trainer refuses a KL penalty in the reward and an active rollout correction (``igpo.config.check_rollout_correction``)
at start-up, so here the rewards are the outcome scores and the correction only measures (its response mask is the
stored one, and it adds no weights). verl's estimators compute their group statistics themselves and cannot leave a
trajectory out, so trajectories with infrastructure failures are trained on (``algorithm.igpo.infra_failure=keep``,
counted in ``igpo/infra_errors``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from igpo.integration.methods.base import Method, MethodResult, StepBatch


class VerlEstimator(Method):
    masks_infra = False
    title = "verl's, on the outcome reward"
    # What verl's step reads besides the base fields; those TransferQueue does not hold (no critic, no reference
    # model, no rollout log-probs) are left out, as verl's fetch leaves them out.
    response_fields = ("rollout_log_probs", "old_log_probs", "ref_log_prob", "values")

    def __init__(self, config):
        super().__init__(config)
        self.name = str(config.algorithm.adv_estimator)

    def advantage(self, batch: StepBatch, scorer: Any) -> MethodResult:
        # Imported when first used: importing verl runs its plugin hook, which imports the method registry
        # (igpo.integration.estimator imports igpo.integration.methods), still half imported while it imports this
        # module.
        from verl.protocol import DataProto
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
        from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

        if len(batch.keys) != len(batch.uids):
            raise ValueError(f"{len(batch.keys)} TransferQueue keys for {len(batch.uids)} rows: verl's {self.name} "
                             "groups a session's outputs by their keys ({uid}_{session}_{index}); pass one per row.")
        algorithm = self.config.algorithm
        data = DataProto.from_dict(
            tensors={"response_mask": batch.response_mask.long(), "rm_scores": batch.rm_scores,
                     "token_level_scores": batch.rm_scores, "token_level_rewards": batch.rm_scores, **batch.fields},
            non_tensors={"uid": np.array(batch.uids, dtype=object)})
        metrics: dict[str, float] = {}
        correction = algorithm.get("rollout_correction", None)
        if (correction is not None and "rollout_log_probs" in data.batch.keys()
                and not correction.get("bypass_mode", False)):
            data, metrics = compute_rollout_correction_and_add_to_batch(data, correction)
        data = compute_advantage_for_multi_trajectories(
            data, batch_keys=batch.keys, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma,
            lam=algorithm.lam, num_repeat=self.config.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm)
        return MethodResult(data.batch["advantages"], data.batch["returns"], dict(metrics))
