"""One step of the advantage pipeline, without Ray or TransferQueue (the trainer fetches and writes back around it;
tests call it directly). Every estimator goes this way, verl's own too (``methods.outcome.VerlEstimator``):

    turn records -> TurnBatch -> ARPO tree check -> infra-failure policy -> verl's rollout correction (decoupled
    mode: importance weights and rejection, ``igpo.integration.rollout_correction``) -> method.advantage -> rollout
    metrics -> ARPO attribution
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from igpo.agent.records import TurnBatch, TurnRecord
from igpo.core.advantage import group_ids, same_outcome_share
from igpo.core.infra import InfraMask, infra_mask
from igpo.integration import histograms as hist
from igpo.integration import rollout_correction as correction_step
from igpo.integration.branching import arpo_tree_check, hard_attribution
from igpo.integration.methods.base import Method, StepBatch
from igpo.integration.rollout_metrics import rollout_metrics

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    advantages: torch.Tensor
    returns: torch.Tensor
    infra: InfraMask
    turns: TurnBatch
    metrics: dict[str, float]
    turn_values: torch.Tensor | None
    terms: dict[str, torch.Tensor]
    correction: correction_step.Correction | None = None  # verl's decoupled rollout correction, where it applied

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, L] bool: the tokens that train, after the infra policy and verl's rejection sampling."""
        return self.correction.response_mask if self.correction is not None else self.infra.loss_mask


@dataclass(frozen=True)
class TreeCheck:
    """ARPO's check that verl stored the tree the rollout built (``algorithm.arpo.enabled``): the stored response ids
    [B, L] and M, the trajectories every prompt must have."""

    responses: torch.Tensor
    rollouts_per_prompt: int


def check_tree(turns: TurnBatch, response_mask: torch.Tensor, uids: list, check: TreeCheck, metrics: dict,
               step: Any = "?") -> None:
    """Every prompt has its M trajectories (tree indices 0..M−1) and every branch equals its parent on response tokens
    and loss mask before its branch position (``arpo/incomplete_groups``, ``arpo/prefix_mismatches``: both 0 unless
    the rollout is broken)."""
    metrics["arpo/prefix_mismatches"], metrics["arpo/incomplete_groups"] = arpo_tree_check(
        check.responses, response_mask, uids, turns, check.rollouts_per_prompt)
    if metrics["arpo/prefix_mismatches"] or metrics["arpo/incomplete_groups"]:
        logger.warning("arpo: step %s: %d branches differ from their parent before their branch position, %d "
                       "prompts lack trajectories; the tree records do not describe this batch",
                       step, metrics["arpo/prefix_mismatches"], metrics["arpo/incomplete_groups"])


def resolve_infra_policy(method, chosen: str | None, estimator: str) -> str:
    """``algorithm.igpo.infra_failure`` resolved for the method (unset: mask_trajectory where the method can leave a
    trajectory out of its statistics; keep for verl's stock estimators, which cannot)."""
    if method.masks_infra:
        return chosen or "mask_trajectory"
    if chosen not in (None, "keep"):
        raise ValueError(
            f"algorithm.igpo.infra_failure={chosen} is not supported with algorithm.adv_estimator={estimator}: "
            "verl's estimator computes its group statistics itself and cannot leave a trajectory out of them. "
            "Use adv_estimator=igpo or infopo, or set algorithm.igpo.infra_failure=keep.")
    logger.warning("igpo_sync: adv_estimator=%s trains on trajectories with infrastructure failures "
                   "(algorithm.igpo.infra_failure=keep; masking them needs adv_estimator=igpo or infopo); they "
                   "are counted in igpo/infra_errors", estimator)
    return "keep"


def apply_infra_policy(turns: TurnBatch, response_mask: torch.Tensor, policy: str, metrics: dict,
                       step: Any = "?") -> InfraMask:
    """What ``policy`` (``algorithm.igpo.infra_failure``) takes out of this batch (``igpo.core.infra``), with its
    two counters."""
    mask = infra_mask(turns.infra_failed, turns.num_turns, turns.turn_ends, response_mask, policy)
    metrics["igpo/infra_masked_trajectories"] = float(mask.rows.sum())
    metrics["igpo/infra_masked_turns"] = float(mask.turns.sum())
    if len(turns.records) and bool(mask.rows.all()):
        # The actor's token-mean loss is then 0/0; verl skips an update whose gradient norm is not finite.
        logger.warning("igpo: every trajectory of step %s hit an infrastructure failure and is masked "
                       "(algorithm.igpo.infra_failure=%s): this step trains nothing; check the tool server", step,
                       policy)
    return mask


def advantage_step(method: Method, records: Sequence[TurnRecord], uids: Sequence, response_mask: torch.Tensor,
                   rm_scores: torch.Tensor, *, infra_failure: str = "mask_trajectory", scorer: Any = None,
                   fields: dict | None = None, keys: Sequence[str] = (), step: int = 0, total_steps: int = 0,
                   epoch: int = 0, tree_check: TreeCheck | None = None, arpo_hard: bool = False,
                   histograms: hist.StepHistograms | None = None,
                   rollout_correction: Mapping[str, Any] | None = None) -> StepOutput:
    """Advantages and returns [B, L] of one step from the agent loop's ``records``, the prompt ``uids``, the stored
    ``response_mask`` [B, L] and ``rm_scores`` [B, L]; ``fields``: the method's own fields; ``keys``: the rows'
    TransferQueue keys; ``tree_check``: check the stored ARPO tree first; ``histograms``: where the step's turn
    values, advantages and turn counts are recorded (``trainer.histograms``); ``rollout_correction``: verl's
    section when its decoupled mode applies (``rollout_correction.decoupled_section``), applied by verl's function
    to ``fields["old_log_probs"]`` and ``fields["rollout_log_probs"]`` (skipped, as verl skips it, when the rollout
    stored no log-probabilities); its weights and rejection are in ``StepOutput.correction``."""
    metrics: dict[str, float] = {}
    response_mask = response_mask.bool()
    turns = TurnBatch.from_records(records, response_mask.shape[1])
    if tree_check is not None:
        check_tree(turns, response_mask, list(uids), tree_check, metrics, step)
    infra = apply_infra_policy(turns, response_mask, infra_failure, metrics, step)
    correction = None
    fields = dict(fields or {})
    if rollout_correction is not None and all(name in fields for name in correction_step.LOG_PROB_FIELDS):
        correction = correction_step.apply(rollout_correction, fields["old_log_probs"], fields["rollout_log_probs"],
                                           infra.loss_mask)
        if correction is None:
            logger.warning("igpo: step %s: no token left after the infra policy; verl's rollout correction is not "
                           "computed (no rollout_corr/* metrics this step)", step)
        else:
            metrics.update(correction.metrics)
    batch = StepBatch(turns, list(uids), group_ids(uids), response_mask, rm_scores.float(), infra,
                      fields=fields, keys=list(keys), step=step, total_steps=total_steps, epoch=epoch)
    result = method.advantage(batch, scorer)
    metrics.update(rollout_metrics(turns))
    outcome = batch.rm_scores.sum(-1)
    metrics["outcome/same_outcome_group_share"] = same_outcome_share(outcome, batch.group, ~infra.rows)
    # On-policy success: the share of the step's kept trajectories with the full outcome score (the exact answer
    # under the F1 or EM reward); the method comparison's primary measure (scripts/experiments/compare_methods.py).
    kept = outcome[~infra.rows]
    metrics["outcome/success_share"] = float((kept >= 1.0).double().mean()) if len(kept) else float("nan")
    metrics.update(result.metrics)
    advantages = result.advantages
    if arpo_hard:
        advantages = hard_attribution(advantages, response_mask, list(uids), turns, metrics)
    if histograms is not None:
        if result.turn_values is not None:
            histograms.record(hist.TURN_IG, result.turn_values)
        histograms.record(hist.ADVANTAGE, advantages[infra.loss_mask])
        histograms.record(hist.TURNS, turns.num_turns)
    return StepOutput(advantages, result.returns, infra, turns, metrics, result.turn_values, result.terms, correction)
