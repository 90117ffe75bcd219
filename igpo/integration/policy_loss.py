"""verl's ``bypass_mode`` policy loss, made to accept a micro-batch in which every token is masked.

The asynchronous trainer modes take the PPO ratio against the rollout's own log-probabilities (verl's rollout-correction
bypass mode, ``policy_loss.loss_mode=bypass_mode``). That loss first measures the rollout/training mismatch, and the
measurement raises ``ValueError("response_mask must contain at least one valid token")`` on a micro-batch without a
valid token. Our infra policy produces such micro-batches: it masks the whole response of a trajectory that an
infrastructure failure (a spent tool budget, a dead upstream) cut short, and when the actor's micro-batch holds only
such trajectories, the step died (seen in CI: GiGPO in ``igpo_colocate_async`` with a budget of one search).

Such a micro-batch contributes nothing to the update, so it is given the loss verl's bypass mode would compute after
the measurement (the PPO-clip or REINFORCE loss under the same, all-zero mask: zero, with a gradient of zeros) and no
mismatch metrics (there are no tokens to measure). Any micro-batch with a valid token goes to verl's function
unchanged. Registered under verl's own name by igpo/plugin.py in every process that imports verl's ``core_algos``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

NAME = "bypass_mode"


def guard_bypass_loss(core_algos: ModuleType) -> None:
    """Replace ``core_algos.POLICY_LOSS_REGISTRY["bypass_mode"]`` with the guarded loss (once per process)."""
    registry = core_algos.POLICY_LOSS_REGISTRY
    verls = registry[NAME]
    if getattr(verls, "igpo_guarded", False):
        return

    def bypass_mode(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                    rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if bool(response_mask.any()):
            return verls(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                         response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                         rollout_is_weights=rollout_is_weights)
        correction = config.policy_loss.get("rollout_correction", None) if config is not None else None
        loss_type = correction.get("loss_type", "ppo_clip") if correction is not None else "ppo_clip"
        if loss_type == "reinforce":
            loss_fn = core_algos.compute_policy_loss_reinforce
        elif loss_type == "ppo_clip":
            loss_fn = core_algos.compute_policy_loss_vanilla
        else:  # verl's own error for the setting
            return verls(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                         response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                         rollout_is_weights=rollout_is_weights)
        # Both take (rollout or old log-probs, log-probs, advantages, mask, aggregation, config, IS weights); in bypass
        # mode ``old_log_prob`` holds the rollout's. IS weights need tokens to measure: none here.
        return loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, None)

    bypass_mode.igpo_guarded = True
    bypass_mode.verl_loss = verls
    bypass_mode.__doc__ = f"verl's {NAME} policy loss; a micro-batch without a valid token gives a zero loss."
    registry[NAME] = bypass_mode
