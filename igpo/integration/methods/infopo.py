"""InfoPO (``algorithm.adv_estimator=infopo``; docs/methods/infopo.md): a turn is credited with how much its
observation changed the policy's next action versus a placeholder observation. The actor scores each observation's
counterfactual (content replaced by ``algorithm.infopo.placeholder``, template kept;
``IGPOActorRolloutRefWorker.infopo_score_counterfactuals``), and ``igpo.core.infopo.infopo_advantage`` fuses the
group-normalised intrinsic values with the outcome advantage through the variance gate; ``infopo/*`` metrics. With
ARPO branches, a turn whose I_t |S| trajectories share (their common prefix runs through its next action) weighs
1/|S| on each copy in the group's μ^I/σ^I: counted once.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from igpo.config import ConfigError, infopo_config_from_algorithm
from igpo.core.arpo import shared_turn_weights
from igpo.core.infopo import ContinuationRequest, InfoPOInputs, infopo_advantage, observation_content_span, row_gate
from igpo.core.infra import token_turns
from igpo.integration.methods.base import Method, MethodResult, StepBatch, register_method

logger = logging.getLogger(__name__)


def check_infopo(config: Any, infopo: Any) -> tuple[bool, str]:
    """Whether InfoPO's factual term can be the old log-probs the trainer computes anyway, and why (for the log).

    They are the same quantity (θ_old, the factual context, logits / rollout temperature) when the actor recomputes
    them; in rollout-correction bypass mode they are the rollout engine's log-probs instead, and the kl score needs
    whole distributions, not the sampled token's log-prob. The actor's FSDP strategy must be fsdp2 (the packed
    scorer drives the layers one by one).
    """
    strategy = str(config.actor_rollout_ref.actor.strategy)
    if strategy != "fsdp2":
        raise ConfigError(f"actor_rollout_ref.actor.strategy={strategy!r} with algorithm.adv_estimator=infopo: the "
                          "counterfactual pass gathers the decoder layer by layer, which only FSDP2 allows; set "
                          "actor_rollout_ref.actor.strategy=fsdp2 (the presets do).")
    if not infopo.reuse_old_log_probs:
        return False, "is recomputed beside the counterfactual (algorithm.infopo.reuse_old_log_probs=false)"
    if infopo.score == "kl":
        return False, ("is recomputed beside the counterfactual: score=kl needs the factual distribution, not only "
                       "the sampled token's old log-prob")
    correction = config.algorithm.get("rollout_correction") or {}
    if correction.get("bypass_mode", False):
        return False, ("is recomputed beside the counterfactual: in rollout_correction bypass mode old_log_probs are "
                       "the rollout engine's, not the actor's")
    return True, ("reuses the actor's old_log_probs (same weights, context and temperature): one counterfactual copy "
                  "per turn")


@register_method("infopo")
class InfoPOMethod(Method):
    name = "infopo"
    title = "InfoPO counterfactual information gain"

    def __init__(self, config: Any):
        super().__init__(config)
        self.infopo = infopo_config_from_algorithm(config.algorithm)
        self.reuse_old_log_probs, why = check_infopo(config, self.infopo)
        logger.warning("igpo_sync: InfoPO's factual term %s", why)
        self.fields = ("prompts", "responses")
        self.response_fields = ("old_log_probs",) if self.reuse_old_log_probs else ()

    def advantage(self, batch: StepBatch, scorer: Any) -> MethodResult:
        """InfoPO advantages [B, L] (= returns). Raises ``RuntimeError`` when the turns that could not be scored pass
        ``algorithm.infopo.max_failed_turn_ratio``. Trajectories the infra policy masked are left out of InfoPO's
        inputs (so out of every group statistic) and get a zero advantage; a masked turn loses its intrinsic value and
        its tokens."""
        turns, infra = batch.turns, batch.infra
        metrics: dict[str, float] = {}
        B, L = batch.response_mask.shape
        num_turns, T = turns.num_turns, turns.width
        intrinsic, scored, failed = self.counterfactual(batch, scorer, metrics)
        attempted = int(scored.sum() + failed.sum())
        n_failed = int(failed.sum())
        metrics["infopo/failed_turns"] = float(n_failed)
        metrics["infopo/failed_turn_ratio"] = n_failed / attempted if attempted else 0.0
        limit = self.infopo.max_failed_turn_ratio
        if attempted and n_failed / attempted > limit:
            raise RuntimeError(
                f"InfoPO: {n_failed} of {attempted} turns ({100 * n_failed / attempted:.1f}%) could not be scored "
                f"(their observation's content span was not found, the counterfactual did not fit the context window, "
                f"or the score was not finite; the warnings above name each) > algorithm.infopo.max_failed_turn_ratio="
                f"{limit}. Fix the cause (chat template, context window) or raise the threshold; a failed turn is "
                "never scored as 0.")
        outcome = batch.rm_scores.sum(-1).double()
        turn_rewards = torch.zeros(B, T, dtype=torch.float64)
        has_turns = num_turns > 0
        turn_rewards[has_turns, (num_turns - 1).clamp(min=0)[has_turns]] = outcome[has_turns]
        keep = torch.nonzero(~infra.rows).squeeze(1)
        pool_weight = self._shared_turn_weights(batch, intrinsic, scored & ~infra.turns & ~infra.rows[:, None], metrics)
        # infopo_advantage wants dense group ids: renumber the groups of the rows that stay.
        _, kept_group = torch.unique(batch.group[keep], return_inverse=True)
        inputs = InfoPOInputs(turn_rewards=turn_rewards[keep], num_turns=torch.where(has_turns, num_turns, 0)[keep],
                              token_turn=token_turns(turns.turn_ends, num_turns, L)[keep],
                              action_mask=infra.loss_mask[keep], intrinsic=intrinsic[keep],
                              intrinsic_mask=(scored & ~infra.turns)[keep], group=kept_group.reshape(-1),
                              epoch=int(batch.epoch),
                              pool_weight=pool_weight[keep] if pool_weight is not None else None)
        advantages = torch.zeros(B, L, dtype=torch.float64)
        nan = float("nan")
        gate, beta, magnitude = (torch.full((B,), nan, dtype=torch.float64) for _ in range(3))
        if keep.numel():
            advantages[keep], stats = infopo_advantage(inputs, self.infopo)
            metrics.update({f"infopo/{k}": v for k, v in stats.items()})
            gate[keep] = row_gate(inputs, self.infopo)
            beta[keep], magnitude[keep] = stats["beta_t"], stats["magnitude_ratio"]
        credited = scored & ~infra.turns & ~infra.rows[:, None]
        terms = {"intrinsic": torch.where(credited, intrinsic, nan), "gate": gate, "beta": beta,
                 "magnitude_ratio": magnitude}
        return MethodResult(advantages, advantages, metrics, turn_values=intrinsic[credited], terms=terms)

    def _shared_turn_weights(self, batch: StepBatch, intrinsic: torch.Tensor, pooled: torch.Tensor,
                             metrics: dict) -> torch.Tensor | None:
        """Pool weights [B, T] of the intrinsic values when ARPO branched (None otherwise: the plain pool). I_t is fixed
        by the tokens through the NEXT action a_{t+1} (it scores a_{t+1} with and without o_t), so only rows whose
        shared prefix covers a_{t+1}'s last token + 1 hold the same I_t; each copy weighs 1/|S| in the group's
        μ^I/σ^I. ``pooled`` [B, T]: the scored turns that stay (before ``zero_intrinsic``)."""
        meta = batch.turns.branch_meta()
        if not bool((meta["parent"] >= 0).any()):
            return None
        turns = batch.turns
        B, T = turns.turn_ends.shape
        ends = torch.ones(B, T, dtype=torch.long)
        ends[:, :-1] = turns.turn_ends[:, 1:] + 1
        pooled = pooled & (torch.arange(T)[None, :] < (turns.num_turns[:, None] - 1))
        if self.infopo.zero_intrinsic == "drop":
            pooled = pooled & (intrinsic != 0)
        weight, _ = shared_turn_weights(ends, pooled, batch.group, meta["index"], meta["parent"], meta["branch_pos"],
                                        batch.response_mask.shape[1])
        metrics["infopo/shared_turns"] = float((pooled & (weight < 1)).sum())
        return torch.where(pooled, weight, 1.0)

    def counterfactual(self, batch: StepBatch, scorer: Any,
                       metrics: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(I [B, T] credited to the turn that produced the observation, scored [B, T], failed [B, T]).

        Turn t < N-1 of a trajectory is scored when its observation has content: the actor scores the next action
        a_{t+1} after the counterfactual context (content -> placeholder, template kept); the factual term comes from
        ``old_log_probs`` (same θ, context and temperature) or from a factual copy in the same pass.
        """
        started = time.perf_counter()
        cfg, turns = self.infopo, batch.turns
        prompts, responses = batch.fields["prompts"], batch.fields["responses"]
        old_log_probs = batch.fields.get("old_log_probs")
        frame = scorer.frame
        placeholder = scorer.encode(cfg.placeholder)
        B, T = turns.turn_ends.shape
        intrinsic = torch.zeros(B, T, dtype=torch.float64)
        scored = torch.zeros(B, T, dtype=torch.bool)
        failed = torch.zeros(B, T, dtype=torch.bool)
        kl = cfg.score == "kl"
        factual = kl or old_log_probs is None
        max_positions = scorer.max_positions
        requests, owners = [], []
        for i, record in enumerate(turns.records):
            n = int(turns.num_turns[i])
            boundaries = record.boundaries[:n]
            if n < 2 or len(boundaries) < n:
                continue
            P = int(prompts[i].numel())
            ids = torch.cat([prompts[i], responses[i]]).tolist()
            request, actions = ContinuationRequest(ids), {}
            for t in range(n - 1):
                action = (int(boundaries[t + 1]), int(turns.turn_ends[i, t + 1]) + P + 1)
                try:
                    cs, ce = observation_content_span(ids, int(turns.turn_ends[i, t]) + P + 1, action[0],
                                                      frame.eot_id, frame.prefix_ids, list(frame.suffix_ids.values()))
                    if cs == ce:
                        continue  # an empty observation: nothing to take away (the reference skips it too)
                    if max_positions is not None and cs + len(placeholder) + action[1] - ce > max_positions:
                        raise ValueError(f"the counterfactual needs {cs + len(placeholder) + action[1] - ce} positions "
                                         f"> the context window {max_positions}")
                    request.add_turn(t, (cs, ce), action, placeholder, factual=factual)
                    actions[t] = action
                except ValueError as error:
                    failed[i, t] = True
                    logger.warning("infopo: sample %d turn %d is not scored (%s); counted in infopo/failed_turns",
                                   i, t, error)
            if request.turns:
                requests.append(request)
                owners.append((i, P, actions))
        results = scorer.score_counterfactuals([r.as_dict(kl) for r in requests]) if requests else {}
        for r, (request, (i, P, actions)) in enumerate(zip(requests, owners)):
            values = results[r]
            for m, (t, f, c) in enumerate(request.turns):
                if kl:
                    value = values[m]
                elif f is not None:
                    value = values[f] - values[c]
                else:
                    a_s, a_e = actions[t]
                    value = float(old_log_probs[i, a_s - P:a_e - P].double().mean()) - values[c]
                if math.isfinite(value):
                    intrinsic[i, t], scored[i, t] = value, True
                else:
                    failed[i, t] = True
        shared = sum(max(r.boundaries) + sum(len(ids) - 1 for ids, _ in r.continuations) for r in requests)
        unshared = sum(b + len(ids) - 1 for r in requests for b, (ids, _) in zip(r.boundaries, r.continuations))
        metrics["infopo/counterfactual_tokens"] = float(shared)
        metrics["infopo/counterfactual_tokens_unshared"] = float(unshared)
        metrics["infopo/factual_from_old_log_probs"] = float(not factual)
        metrics["timing_s/infopo_counterfactual"] = time.perf_counter() - started
        return intrinsic, scored, failed
