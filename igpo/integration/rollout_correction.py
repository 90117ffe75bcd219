"""verl's rollout correction (``algorithm.rollout_correction``) at the turn-level advantage step.

verl 0.9.1 corrects for the gap between the policy that sampled the tokens and the policy that trains on them in
one of two ways (``RolloutCorrectionConfig``):

- **decoupled** (``bypass_mode=false``, three policies): the actor recomputes ``old_log_probs`` (pi_old); at the
  advantage step, verl's ``compute_rollout_correction_and_add_to_batch`` compares them with the rollout's own
  ``rollout_log_probs`` (pi_rollout): importance weights ``rollout_is_weights`` from ``log r = log pi_old - log
  pi_rollout`` (per token or per sequence, truncated at ``rollout_is_threshold``, or IcePop for ``"lower_upper"``,
  optionally normalised to mean 1 over the batch) and a rejection mask (``rollout_rs``: token_k1..k3,
  seq_sum_k1..k3, seq_mean_k1..k3 (the geometric mean ratio for k1), seq_max_k2/k3) that takes tokens or whole
  sequences out of ``response_mask``; the PPO ratio in the loss is pi_theta / pi_old, times the weights.
- **bypass** (``bypass_mode=true``, two policies): ``old_log_probs`` are the rollout's; the correction happens in
  the actor's ``bypass_mode`` loss against the current policy pi_theta (PPO clip, or REINFORCE with the weights).

Our trainer modes replace verl's ``_compute_advantage``, where verl applies the decoupled correction, so this
module applies it there, by verl's own function, for every method of the pipeline: ``decoupled_section`` says
whether it applies (the section is set and not in bypass mode, as verl decides), ``apply`` runs verl's function on
the step's log-probabilities and returns what verl would write back. A trajectory's turn structure is left alone:
the methods see the stored mask, so a rejected trajectory still counts in its group's statistics (as it does in
verl's GRPO, whose group statistics read only the outcome), and the rejection only takes it out of the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

# The TransferQueue fields verl's function reads besides the mask (pi_old, pi_rollout), [B, L] each.
LOG_PROB_FIELDS = ("old_log_probs", "rollout_log_probs")


@dataclass
class Correction:
    """What verl's decoupled correction writes back for one step: ``response_mask`` [B, L] bool (the loss mask
    after rejection: rejected tokens and sequences are False), ``rollout_is_weights`` [B, L] (None without
    ``rollout_is``; zero outside the mask) and its ``rollout_corr/*`` metrics, as verl names them."""

    response_mask: torch.Tensor
    rollout_is_weights: torch.Tensor | None
    metrics: dict[str, float]


def decoupled_section(algorithm: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``algorithm.rollout_correction`` when verl applies it at the advantage step (set, and not in bypass mode);
    None otherwise. With neither ``rollout_is`` nor ``rollout_rs`` verl still measures the rollout/actor gap there
    (the ``rollout_corr/*`` metrics only), so we do too."""
    section = algorithm.get("rollout_correction", None)
    if section is None or bool(section.get("bypass_mode", False)):
        return None
    return section


def apply(section: Mapping[str, Any], old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
          loss_mask: torch.Tensor) -> Correction | None:
    """verl's ``compute_rollout_correction_and_add_to_batch`` on the step's pi_old ``old_log_probs`` and pi_rollout
    ``rollout_log_probs`` [B, L] over ``loss_mask`` [B, L] (the stored mask less what the infra-failure policy took
    out, so that masked trajectories neither weigh in the batch normalisation nor are measured). None when the mask
    holds no token (every trajectory was masked: verl's function refuses such a batch, and the step trains nothing)."""
    if not bool(loss_mask.any()):
        return None
    data = DataProto.from_dict(tensors={"old_log_probs": old_log_probs.float(),
                                        "rollout_log_probs": rollout_log_probs.float(),
                                        "response_mask": loss_mask.long()})
    data, metrics = compute_rollout_correction_and_add_to_batch(data, section)
    weights = data.batch["rollout_is_weights"] if "rollout_is_weights" in data.batch.keys() else None
    return Correction(data.batch["response_mask"].bool(), weights, dict(metrics))
