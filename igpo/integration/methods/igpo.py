"""IGPO (``algorithm.adv_estimator=igpo``, alias ``grpo_info_gain``): information gain per turn plus the outcome,
in a GRPO-style turn-level advantage (docs/methods/igpo.md). Rewards are placed at the recorded turn ends:

    IG_j = v_{j+1} − v_prev   (igpo.core.info_gain)     on the last generated token of turn j
    outcome (F1/judge), or the answer-format penalty    on the last generated token of the trajectory
    format penalty of turn j                             on the last generated token of turn j (own channel, or
                                                         in place of its IG with format_penalty_mode=in_ig_pool)

as reward positions (``igpo.core.info_gain.turn_boundaries``; no [B, L] reward tensor is built), then
``igpo.core.advantage.advantage_at_boundaries``. With ARPO branches, an IG turn that |S| trajectories share (copied
before their branch point) weighs 1/|S| on each copy in the group statistics: counted once. v is the policy's log-probability of the gold answer after each
turn: scored by the rollout engine during the rollout (``score_on=rollout``) or here by the actor's packed scorer
(``score_on=actor``). The warm-up gate (``ig_warmup_timing``) and the curriculum are applied here; the gate's state is
saved with the checkpoint. An empty turn (an aborted generation) ends on its untrained end-of-turn token: its IG or
penalty is a reward position outside the loss mask (``igpo/empty_turns``).

Only ``IGPOMethod.turn_gains`` produces the per-turn values (``TurnGains``); a method that credits turns with
something else (``methods/oracle.py``: the demo world's hops) subclasses it and replaces that one step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from igpo.config import ConfigError, IGPOConfig
from igpo.core.advantage import WarmupGate, advantage_at_boundaries, curriculum_weights, last_response_token
from igpo.core.arpo import shared_turn_weights
from igpo.core.ground_truth import answer_probes
from igpo.core.info_gain import ig_by_answer_seen, ig_by_hop, penalty_into_ig_pool, reduce_alias_logprobs, scored_boundaries, \
    turn_boundaries, turn_format_penalty, turn_information_gain
from igpo.core.scoring import validate_request
from igpo.integration.methods.base import Method, MethodResult, StepBatch, register_method

logger = logging.getLogger(__name__)


@dataclass
class TurnGains:
    """What ``IGPOMethod.turn_gains`` hands the rest of the pipeline: ``gain`` [B, T−1] float, the reward of tool turn
    j (0 where ``mask`` is False); ``mask`` [B, T−1] bool, the turns that carry a reward position (a gain of 0 is still
    one); ``stats``, logged as ``igpo/<name>``; ``terms``, per-boundary [B, T] values for the trajectory log (NaN where
    none); ``skipped``, samples the actor could not score (counted in ``igpo/scoring_errors``); ``outcome_shift``
    [B] float or None, added to each row's outcome reward while the warm-up gate is open (TIPS's terminal term; logged
    as the term ``outcome_shift``)."""

    gain: torch.Tensor
    mask: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: float = 0.0
    outcome_shift: torch.Tensor | None = None


@register_method("igpo", "grpo_info_gain")
class IGPOMethod(Method):
    """Subclasses replace ``turn_gains`` (what a tool turn is credited with) and keep the rest: format penalty,
    warm-up gate, curriculum, infrastructure masking, ARPO pool weights, ``advantage_at_boundaries``, metrics, terms."""

    name = "igpo"
    title = "IGPO turn-level"
    gain_term = "information_gain"  # the trajectory log's name of the per-turn gain (MethodResult.terms)

    def __init__(self, config: Any):
        super().__init__(config)
        self.igpo = IGPOConfig.from_algorithm(config.algorithm)
        self.warmup = WarmupGate(self.igpo.ig_warmup_threshold, self.igpo.ig_warmup_ema_alpha,
                                 self.igpo.ig_warmup_timing)
        actor_scores = self.igpo.score_on == "actor" or self.igpo.verify_scoring
        self.fields = ("prompts", "responses", "reward_model") if actor_scores else ()

    def advantage(self, batch: StepBatch, scorer: Any) -> MethodResult:
        """IGPO advantages and returns [B, L]. ``scorer`` (the actor's scoring passes) is used when the actor scores
        the answer probes; None is fine with ``score_on=rollout``. A trajectory the infra policy masked gets no reward
        position, so it is in no group's statistics, and a zero advantage; a masked turn loses its IG position and its
        tokens' advantage."""
        turns, infra, cfg = batch.turns, batch.infra, self.igpo
        metrics: dict[str, float] = {}
        B, L = batch.response_mask.shape
        last = last_response_token(batch.response_mask)
        has_tokens = last >= 0
        outcome = batch.rm_scores.sum(-1)
        num_turns, turn_ends, T = turns.num_turns, turns.turn_ends, turns.width
        gains = self.turn_gains(batch, scorer, metrics)
        ig, ig_turn_mask, ig_stats = gains.gain, gains.mask, dict(gains.stats)

        # An outage's outcome says nothing about the policy: masked rows do not move the warm-up gate either.
        counted = has_tokens & ~infra.rows
        gate_open = self.warmup.update(float(outcome[counted].mean()) if bool(counted.any()) else 0.0)
        # Turn j < N-1 ends on its last generated token; the final turn carries the outcome instead.
        tool_turn = torch.arange(T - 1)[None, :] < (num_turns[:, None] - 1)
        ig_stats.update(ig_by_answer_seen(ig, ig_turn_mask & tool_turn & turns.answer_known[:, :-1],
                                          turns.answer_seen[:, :-1]))
        # The k-th tool call's IG (a chain's first searches are necessary and do not show the answer yet), split by
        # correct and wrong hop where the samples name their chain.
        called = torch.zeros(B, T, dtype=torch.long)
        for i, names in enumerate(turns.tool_names):
            called[i, :len(names)] = torch.tensor([name is not None for name in names], dtype=torch.long)
        hop = torch.where(called.bool(), called.cumsum(1), 0)[:, :-1]
        split = bool(turns.hop_known.any())
        ig_stats.update(ig_by_hop(ig, ig_turn_mask & tool_turn, hop, right=turns.hop_right[:, :-1] if split else None,
                                  known=turns.hop_known if split else None))
        penalty, answer_penalty = turn_format_penalty(turns.format_ok, num_turns, cfg.info_gain)
        if not gate_open:
            ig_turn_mask = torch.zeros_like(ig_turn_mask)
            penalty = torch.zeros_like(penalty)
            answer_penalty = torch.zeros_like(answer_penalty)

        # The reference replaces the outcome by the answer-format penalty when the final answer is malformed.
        outcome = torch.where(answer_penalty != 0, answer_penalty, outcome)
        rewarded_outcome = outcome
        if gains.outcome_shift is not None and gate_open:
            rewarded_outcome = outcome + gains.outcome_shift.to(outcome.dtype)
        # Masked rows keep no reward position (no outcome, IG or penalty), masked turns no IG or penalty position.
        signal_turn = tool_turn & ~infra.rows[:, None] & ~infra.turns[:, :-1]
        ig_turn_mask = ig_turn_mask & signal_turn
        tool_penalty = torch.where(signal_turn, penalty[:, :-1], 0.0)
        if cfg.info_gain.format_penalty_mode == "in_ig_pool":
            ig, ig_turn_mask, tool_penalty = penalty_into_ig_pool(ig, ig_turn_mask, tool_penalty)
        last = torch.where(infra.rows, -1, last)
        weight = self._shared_turn_weights(batch, ig_turn_mask, metrics)
        anchor = outcome_anchor = None
        if cfg.advantage.norm_mode == "state_grouped":
            states = self.state_anchors(batch)
            anchor = states[:, :-1]
            outcome_anchor = states.gather(1, (num_turns - 1).clamp(min=0)[:, None])[:, 0]
        bounds = turn_boundaries(ig, ig_turn_mask, tool_penalty, turn_ends[:, :-1], rewarded_outcome, last,
                                 infra.loss_mask, weight=weight, anchor=anchor, outcome_anchor=outcome_anchor)

        w_outcome, w_ig = curriculum_weights(batch.step, batch.total_steps, cfg.curriculum, ig_active=gate_open)
        # Empty turns (aborted generations) end on untrained tokens; their rewards still count (masked_turns_ok).
        advantages, returns, adv_metrics = advantage_at_boundaries(
            bounds, infra.loss_mask, batch.group, cfg.advantage, outcome_weight=w_outcome, ig_weight_schedule=w_ig,
            masked_turns_ok=True)
        metrics["igpo/empty_turns"] = float(sum(r.empty_turns for r in turns.records))
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        information_gain = torch.full((B, T), float("nan"), dtype=torch.float64)
        information_gain[:, :-1] = torch.where(ig_turn_mask, ig.double(), nan)
        format_penalty = torch.full((B, T), float("nan"), dtype=torch.float64)
        format_penalty[:, :-1] = torch.where(signal_turn, tool_penalty.double(), nan)
        terms = {**gains.terms, self.gain_term: information_gain, "format_penalty": format_penalty,
                 "outcome": torch.where(infra.rows | ~has_tokens, nan, outcome.double()),
                 "outcome_weight": torch.full((B,), float(w_outcome), dtype=torch.float64),
                 "ig_weight": torch.full((B,), float(w_ig), dtype=torch.float64)}
        if gains.outcome_shift is not None:
            shift = gains.outcome_shift.double() if gate_open else torch.zeros(B, dtype=torch.float64)
            terms["outcome_shift"] = torch.where(infra.rows | ~has_tokens, nan, shift)
        metrics.update(adv_metrics)
        metrics.update({f"igpo/{k}": v for k, v in ig_stats.items()})
        # Samples the actor could not score (bad probe, context window) are scoring errors too, whichever side scored.
        metrics["igpo/scoring_errors"] = float(sum(r.scoring_errors for r in turns.records)) + gains.skipped
        metrics["igpo/ig_gate_active"] = float(gate_open)
        metrics["igpo/outcome_score_ema"] = float(self.warmup.ema if self.warmup.ema is not None else 0.0)
        if cfg.curriculum.enabled:
            metrics["curriculum/f1_weight"], metrics["curriculum/ig_weight"] = w_outcome, w_ig
        return MethodResult(advantages, returns, metrics, turn_values=ig[ig_turn_mask], terms=terms)

    def refuse_rollout_scoring_and_prob_diff(self, scoring_why: str, type_why: str) -> None:
        """For a subclass whose gains come from elsewhere than the rollout's answer scores and are differences of
        log-values: refuse ``score_on=rollout`` / ``verify_scoring`` and an ``info_gain_type`` other than
        ``log_prob_diff``, each with the subclass's reason, rather than ignore them."""
        estimator = f"algorithm.adv_estimator={self.name}"
        if self.igpo.score_on == "rollout" or self.igpo.verify_scoring:
            raise ConfigError(f"{estimator} with algorithm.igpo.score_on=rollout or verify_scoring=true: {scoring_why}")
        if self.igpo.info_gain.info_gain_type != "log_prob_diff":
            raise ConfigError(f"{estimator} with algorithm.igpo.info_gain_type={self.igpo.info_gain.info_gain_type}: "
                              f"{type_why}")

    def turn_gains(self, batch: StepBatch, scorer: Any, metrics: dict) -> TurnGains:
        """IG_j of every tool turn from the answer log-probs at the scored boundaries: the rollout's
        (``score_on=rollout``) or the actor's packed scorer's (``score_on=actor``, and with ``verify_scoring`` both,
        their largest difference logged). The one step a method of this family replaces."""
        turns, cfg = batch.turns, self.igpo
        boundary_lp = turns.answer_logprobs(cfg.info_gain.answer_alias)
        scored = self.scored_boundaries(batch)
        skipped = 0.0
        if cfg.score_on == "actor":
            boundary_lp, skipped = self._score_on_actor(batch, scorer, scored, metrics)
        elif cfg.verify_scoring:
            actor_lp, skipped = self._score_on_actor(batch, scorer, scored, metrics)
            both = torch.isfinite(actor_lp) & torch.isfinite(boundary_lp)
            diff = (actor_lp - boundary_lp).abs()[both]
            metrics["igpo/scoring_rollout_vs_actor_max_abs_diff"] = float(diff.max()) if diff.numel() else float("nan")
        ig, ig_turn_mask, ig_stats = turn_information_gain(boundary_lp.float(), scored, turns.num_turns, cfg.info_gain)
        return TurnGains(ig, ig_turn_mask, ig_stats, {"answer_logprob": boundary_lp.double()}, skipped)

    default_state_anchor = "turn"  # what a turn's state is under norm_mode=state_grouped unless state_anchor says

    def state_anchors(self, batch: StepBatch) -> torch.Tensor:
        """[B, T] long: the state turn j was taken from, for ``norm_mode=state_grouped`` (its key within the prompt
        group; −1: none). ``state_anchor`` (or the method's default): ``turn``, the turn's index j; ``hops``, the
        correct hops the trajectory made before turn j (the demo world's record, ``TurnBatch.hop_right``; −1 on rows
        whose sample names no chain)."""
        turns = batch.turns
        choice = self.igpo.advantage.state_anchor or self.default_state_anchor
        B, T = turns.hop_right.shape
        if choice == "turn":
            return torch.arange(T).expand(B, T).clone()
        if len(turns.records) and not bool(turns.hop_known.any()):
            raise ValueError(
                f"algorithm.igpo.state_anchor=hops (norm_mode=state_grouped): no trajectory of step {batch.step} names "
                "its chain (extra_info.hop_targets, written by the demo world), so there are no hops to tell states "
                "apart; set algorithm.igpo.state_anchor=turn, or train on a demo-world dataset.")
        before = torch.cumsum(turns.hop_right.long(), dim=1) - turns.hop_right.long()
        return torch.where(turns.hop_known[:, None], before, -1)

    def scored_boundaries(self, batch: StepBatch) -> torch.Tensor:
        """[B, T] bool: the boundaries ``algorithm.igpo`` selects (tool filter, ``ig_compute_freq``, ``ig_turns``;
        ``igpo.core.info_gain.scored_boundaries``); boundary s ≥ 1 gives turn s − 1 its reward position."""
        turns = batch.turns
        scored = torch.zeros(len(turns.records), turns.width, dtype=torch.bool)
        for i, row in enumerate(scored_boundaries(turns.tool_names, self.igpo.info_gain, turns.tool_status)):
            scored[i, :len(row)] = torch.tensor(row, dtype=torch.bool)
        return scored

    @staticmethod
    def _shared_turn_weights(batch: StepBatch, ig_turn_mask: torch.Tensor, metrics: dict) -> torch.Tensor | None:
        """Pool weights [B, T−1] of the IG positions when ARPO branched (None otherwise: the plain pool). IG_j is
        fixed by the tokens through turn j's tool result, and branches start at tool-result ends, so rows whose
        shared prefix covers turn j's last token + 1 hold the same IG_j: each copy weighs 1/|S| in the group's μ/σ."""
        meta = batch.turns.branch_meta()
        if not bool((meta["parent"] >= 0).any()):
            return None
        ends = batch.turns.turn_ends[:, :-1] + 1
        weight, _ = shared_turn_weights(ends, ig_turn_mask, batch.group, meta["index"], meta["parent"],
                                        meta["branch_pos"], batch.response_mask.shape[1])
        metrics["igpo/shared_ig_turns"] = float((ig_turn_mask & (weight < 1)).sum())
        return torch.where(ig_turn_mask, weight, 1.0)

    def _score_on_actor(self, batch: StepBatch, scorer: Any, scored: torch.Tensor, metrics: dict,
                        reference: bool = False) -> tuple[torch.Tensor, float]:
        """(answer log-probs per boundary [B, T], aliases reduced; samples not scored) from the actor's packed
        scorer, on the actor's weights or, with ``reference``, on verl's reference policy's (TIPS's teacher). A sample whose probe or context does not fit is not scored (a warning; it gets no IG). A sample with no
        scored tool turn is not sent at all (its boundaries stay NaN; nothing reads them) and is not counted."""
        started = time.perf_counter()
        prompts, responses = batch.fields["prompts"], batch.fields["responses"]
        reward_models = batch.fields["reward_model"]
        # The agent loop's frame: the probe ends with the same end-of-turn text the rollout used.
        template = self.igpo.scoring.answer_template(scorer.frame.eot_text)
        B, T = scored.shape
        requests, owners, skipped = [], [], 0
        for i, record in enumerate(batch.turns.records):
            n = int(batch.turns.num_turns[i])
            # Without a scored tool turn the baseline v_0 feeds no gain (turn_information_gain), so the trajectory is
            # not scored: in a warm-started SmolLM2 batch these answer-at-once requests were half the scoring tokens.
            if not bool(scored[i, 1:n].any()):
                continue
            boundaries = record.boundaries[:n]
            chosen = [s for s in range(min(n, len(boundaries))) if scored[i, s]]
            if not chosen:
                continue
            trajectory = torch.cat([prompts[i], responses[i]]).tolist()
            try:
                probes = answer_probes(scorer.tokenizer, (reward_models[i] or {}).get("ground_truth"), template,
                                       self.igpo.info_gain.answer_alias)
                validate_request(len(trajectory), [boundaries[s] for s in chosen], probes, scorer.max_positions)
            except (TypeError, ValueError) as error:
                skipped += 1
                logger.warning("igpo: sample %d is not scored (%s); it gets no information gain", i, error)
                continue
            requests.append({"trajectory_ids": trajectory, "boundaries": [boundaries[s] for s in chosen],
                             "probes": [{"token_ids": p.token_ids, "span": list(p.span)} for p in probes]})
            owners.append((i, chosen, len(probes)))
        aliases = max([n_probes for _, _, n_probes in owners], default=1)
        out = torch.full((B, T, aliases), float("nan"), dtype=torch.float64)
        alias_ok = torch.zeros(B, aliases, dtype=torch.bool)
        results = scorer.score_reference_answers(requests) if reference else scorer.score_answers(requests)
        for r, (i, chosen, n_probes) in enumerate(owners):
            out[i, chosen, :n_probes] = torch.tensor(results[r], dtype=torch.float64)  # [K, P]
            alias_ok[i, :n_probes] = True
        tokens = sum(len(r["trajectory_ids"]) + len(r["boundaries"]) * sum(len(p["token_ids"]) for p in r["probes"])
                     for r in requests)
        metrics["igpo/scoring_tokens"] = float(tokens)
        metrics["igpo/scoring_skipped"] = float(skipped)
        metrics["timing_s/igpo_scoring"] = time.perf_counter() - started
        return reduce_alias_logprobs(out, alias_ok, self.igpo.info_gain.answer_alias), float(skipped)

    def state_dict(self) -> dict[str, Any]:
        return {"warmup_gate": self.warmup.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warmup.load_state_dict(state.get("warmup_gate", {}))

    def report(self, step: int, total_steps: int) -> dict[str, Any]:
        w_outcome, w_ig = curriculum_weights(step, total_steps, self.igpo.curriculum, ig_active=self.warmup.active)
        return {"warmup_gate": self.warmup.state_dict(), "curriculum": [w_outcome, w_ig]}
