"""Outcome-only baselines: any advantage estimator registered with verl (``algorithm.adv_estimator=grpo``, rloo, ...)
that no method here claims, through the same pipeline as the turn-level methods.

``VerlEstimator.advantage`` is verl's own advantage step (the v1 trainer's ``_compute_advantage``) on the step's
tensors: the outcome reward as the token rewards, verl's decoupled rollout correction where verl applies it (its
rejection in the mask and its importance weights in the batch that verl's estimator reads, as in verl's step), and
verl's estimator with its grouping of a session's outputs. The pipeline applies the same correction (verl's function
on the same tensors) for every method, logs its ``rollout_corr/*`` metrics and writes its mask and weights back for
the actor (``igpo.integration.rollout_correction``), and adds the rollout metrics and ARPO's attribution around it,
on the same agent loop, so comparisons with IGPO or InfoPO are like for like. The trainer refuses a KL penalty in
the reward, so the rewards are the outcome scores. verl's estimators compute their group statistics themselves and
cannot leave a trajectory out, so trajectories with infrastructure failures are trained on
(``algorithm.igpo.infra_failure=keep``, counted in ``igpo/infra_errors``)."""

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

        from igpo.integration.rollout_correction import decoupled_section

        if len(batch.keys) != len(batch.uids):
            raise ValueError(f"{len(batch.keys)} TransferQueue keys for {len(batch.uids)} rows: verl's {self.name} "
                             "groups a session's outputs by their keys ({uid}_{session}_{index}); pass one per row.")
        algorithm = self.config.algorithm
        data = DataProto.from_dict(
            tensors={"response_mask": batch.response_mask.long(), "rm_scores": batch.rm_scores,
                     "token_level_scores": batch.rm_scores, "token_level_rewards": batch.rm_scores, **batch.fields},
            non_tensors={"uid": np.array(batch.uids, dtype=object)})
        correction = decoupled_section(algorithm)
        if correction is not None and "rollout_log_probs" in data.batch.keys():
            # What verl's estimator reads after verl's correction: the rejected mask, and the weights
            # (optimal_token_baseline takes them). The metrics are the pipeline's (same function, same tensors).
            data, _ = compute_rollout_correction_and_add_to_batch(data, correction)
        data = compute_advantage_for_multi_trajectories(
            data, batch_keys=batch.keys, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma,
            lam=algorithm.lam, num_repeat=self.config.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm)
        return MethodResult(data.batch["advantages"], data.batch["returns"])
