"""TIPS (``algorithm.adv_estimator=tips``; docs/methods/tips.md): potential-based shaping of each tool turn with a
frozen teacher's log-probability of the gold answer, in IGPO's pipeline in place of the information gain.

``TIPSMethod`` overrides only ``turn_gains``. At the boundaries IGPO would score (``algorithm.igpo``'s tool filter,
``ig_compute_freq``, ``ig_turns``) the answer probes IGPO builds are scored on verl's reference policy (the initial
weights, never trained: ``ActorScorer.score_reference_answers``), giving the potentials Φ; a tool turn earns
c·(γ·Φ_after − Φ_before) and, with ``terminal=zero``, the answer turn's outcome gains −c·Φ_last
(``igpo.core.tips``). Format penalty, warm-up gate, curriculum, infrastructure masking, ARPO pool weights and
``norm_mode`` are IGPO's; the normalisation order is ``algorithm.tips.norm_order`` (after the discount by default, in
which the shaping telescopes), and γ is ``algorithm.gamma`` unless ``algorithm.tips.gamma`` sets another.

Refused at start-up, each with its reason: a refreshed teacher, a run in which verl builds no reference policy in the
actor's worker (no KL loss, LoRA, the standalone-rollout mode), and IGPO's scoring settings TIPS cannot honour.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from igpo.agent.agent_config import plain_section
from igpo.config import ConfigError
from igpo.core.tips import TIPSConfig, batch_scale, shaped_turn_rewards
from igpo.integration.methods.base import StepBatch, register_method
from igpo.integration.methods.igpo import IGPOMethod, TurnGains

logger = logging.getLogger(__name__)


@register_method("tips")
class TIPSMethod(IGPOMethod):
    name = "tips"
    title = "TIPS (potential-based shaping with a frozen teacher's answer log-probability)"
    gain_term = "shaping_reward"

    def __init__(self, config: Any):
        super().__init__(config)
        self.tips = TIPSConfig.from_dict(plain_section(config.algorithm.get("tips", None)))
        self.refuse_rollout_scoring_and_prob_diff(
            "the potentials are scored on the reference policy by the actor's workers (the rollout's scores are the "
            "current policy's, not the teacher's); set algorithm.igpo.score_on=actor and verify_scoring=false (the "
            "defaults).",
            "the potential is a log-probability and the shaping a difference of potentials; remove the key "
            "(log_prob_diff, the default).")
        refuse_without_reference(config, self.tips)
        returns_gamma = self.igpo.advantage.gamma
        self.gamma = returns_gamma if self.tips.gamma is None else float(self.tips.gamma)
        if self.gamma != returns_gamma:
            logger.warning("tips: the shaping's gamma %s differs from the returns' algorithm.gamma %s, so the shaping "
                           "does not telescope (an ablation; docs/methods/tips.md)", self.gamma, returns_gamma)
        advantage = dataclasses.replace(self.igpo.advantage, norm_order=self.tips.norm_order)
        self.igpo = dataclasses.replace(self.igpo, advantage=advantage)
        self.fields = ("prompts", "responses", "reward_model")
        self.scale = float(self.tips.scale)  # c; with scale_mode=batch, the last step's (kept when a step has none)

    def turn_gains(self, batch: StepBatch, scorer: Any, metrics: dict) -> TurnGains:
        """c·(γ·Φ_{j+1} − Φ_prev) per scored tool turn, Φ from the reference policy; the terminal term as the
        outcome's shift."""
        turns = batch.turns
        scored = self.scored_boundaries(batch)
        potential, skipped = self._score_on_actor(batch, scorer, scored, metrics, reference=True)
        shaping = shaped_turn_rewards(potential, scored, turns.num_turns, self.gamma)
        if self.tips.scale_mode == "batch":
            measured = batch_scale(shaping.reward, shaping.mask, self.tips.scale)
            self.scale = self.scale if measured is None else measured
        c = self.scale
        reward = c * shaping.reward
        shift = None
        if self.tips.terminal == "zero":
            shift = torch.where(torch.isfinite(shaping.terminal), -c * shaping.terminal, 0.0)
        applied = shaping.mask
        finite_phi = potential[torch.isfinite(potential)]
        metrics["tips/scale"] = c
        metrics["tips/gamma"] = self.gamma
        metrics["tips/shaped_turns"] = float(applied.sum())
        metrics["tips/shaped_rows"] = float(applied.any(dim=1).sum())
        metrics["tips/reward_mean"] = float(reward[applied].mean()) if bool(applied.any()) else 0.0
        metrics["tips/reward_abs_mean"] = float(reward[applied].abs().mean()) if bool(applied.any()) else 0.0
        metrics["tips/potential_mean"] = float(finite_phi.mean()) if finite_phi.numel() else float("nan")
        terminal = shaping.terminal[torch.isfinite(shaping.terminal)]
        metrics["tips/terminal_shift_mean"] = float(-c * terminal.mean()) if shift is not None and terminal.numel() \
            else 0.0
        return TurnGains(reward.float(), applied, shaping.stats, {"teacher_potential": potential.double()}, skipped,
                         outcome_shift=shift)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "tips_scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.scale = float(state.get("tips_scale", self.tips.scale))


def refuse_without_reference(config: Any, tips: TIPSConfig) -> None:
    """Refuse, with the reason and the fix, a teacher this pipeline cannot provide (docs/methods/tips.md, "What is
    refused")."""
    if tips.teacher == "refreshed":
        raise ConfigError(
            "algorithm.tips.teacher=refreshed is not implemented: the only second copy of the weights verl keeps is "
            "the reference policy, which is also the KL loss's anchor, so refreshing it would move the KL towards the "
            "policy of refresh_every steps ago; a third copy would need an FSDP engine of its own on every rank and "
            "its weights saved with the checkpoint (verl does not save the reference). Use teacher=frozen (the "
            "authors' release scores with a fixed served model as well).")
    actor = config.actor_rollout_ref.actor
    if not bool(actor.get("use_kl_loss", False)) and not bool(config.algorithm.get("use_kl_in_reward", False)):
        raise ConfigError(
            "algorithm.adv_estimator=tips with actor_rollout_ref.actor.use_kl_loss=false: TIPS's frozen teacher is "
            "verl's reference policy, which verl builds only with the KL loss on. Set "
            "actor_rollout_ref.actor.use_kl_loss=true (with kl_loss_coef=0 the reference is the teacher alone and adds "
            "no loss term).")
    model = config.actor_rollout_ref.get("model", None) or {}
    lora = (model.get("lora", None) or {}).get("rank", 0) or model.get("lora_rank", 0)
    if int(lora or 0) > 0 or model.get("lora_adapter_path", None) is not None:
        raise ConfigError(
            "algorithm.adv_estimator=tips with LoRA (actor_rollout_ref.model.lora_rank > 0 or lora_adapter_path): verl "
            "then builds no reference policy (the actor with its adapters disabled stands in for it), and scoring "
            "with the adapters disabled is not wired. Train without LoRA, or choose another estimator.")
    trainer = config.get("trainer", None) or {}
    mode = (trainer.get("v1", None) or {}).get("trainer_mode", "igpo_sync")
    if mode == "igpo_separate_async":
        raise ConfigError(
            "algorithm.adv_estimator=tips with trainer.v1.trainer_mode=igpo_separate_async: verl puts the reference "
            "policy in a worker group of its own in that mode, not in the actor's worker where TIPS scores. Use "
            "igpo_sync or igpo_colocate_async.")
