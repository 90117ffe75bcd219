"""``algorithm.igpo`` — every IGPO knob, validated once into typed dataclasses.

The section is read from verl's ``algorithm`` config (a DictConfig that verl never converts, so our keys are safe
there). Each component owns its dataclass; this module only splits the section among them and rejects unknown keys,
so a typo such as ``algorithm.igpo.norm_mod=joint`` fails at start-up instead of silently running the default.

| component | dataclass | keys |
|---|---|---|
| information gain | ``igpo.core.info_gain.InfoGainConfig`` | info_gain_type, ig_tool_filter, ig_compute_freq, use_format_penalty, format_penalty_scale, format_penalty_mode, answer_alias |
| advantage | ``igpo.core.advantage.AdvantageConfig`` | norm_mode, ig_weight, adaptive_gamma_min_weight, norm_order, norm_group, epsilon, scale_floor, scale_cap (+ algorithm.gamma, algorithm.norm_adv_by_std_in_grpo) |
| curriculum | ``igpo.core.advantage.CurriculumConfig`` | use_curriculum, curriculum_{f1,ig}_{init,final}, curriculum_scope |
| warm-up gate | ``IGPOConfig`` | ig_warmup_threshold, ig_warmup_ema_alpha, ig_warmup_timing |
| infrastructure failures | ``IGPOConfig`` (``igpo.core.infra``) | infra_failure |
| scoring | ``IGPOConfig`` + ``igpo.agent.agent_config.RolloutScoringConfig`` | score_on, verify_scoring, answer_template_prefix, answer_template_suffix |
| agent loop | ``igpo.agent.agent_config.AgentLoopConfig`` | the ``agent`` sub-section |

Keys of the reference system (DR-Venus sets them directly under ``algorithm``, e.g. ``algorithm.info_gain_norm_mode``)
are refused with the name of our key (``refuse_reference_keys``): the ``grpo_info_gain`` alias accepts the reference's
estimator name, never silently its settings. ``configs/fidelity/reference_drvenus.yaml`` (``+fidelity=reference_drvenus``)
reproduces the reference's training signal.

InfoPO (``algorithm.adv_estimator=infopo``) reads its own section, ``algorithm.infopo``, into
``igpo.core.infopo.InfoPOConfig`` (``infopo_config_from_algorithm``; unknown keys refused the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from igpo.agent.agent_config import (SCORE_ON, AgentLoopConfig, RolloutScoringConfig, coerce_to_fields, field_names,
                                     info_gain_config_from, plain_section)
from igpo.core.advantage import WARMUP_TIMINGS, AdvantageConfig, CurriculumConfig
from igpo.core.info_gain import InfoGainConfig
from igpo.core.infra import INFRA_FAILURE_POLICIES
from igpo.core.infopo import InfoPOConfig

class ConfigError(ValueError):
    """A user-fixable configuration problem; printed without a traceback."""


_CURRICULUM_KEYS = {
    "use_curriculum": "enabled",
    "curriculum_f1_init": "f1_init",
    "curriculum_f1_final": "f1_final",
    "curriculum_ig_init": "ig_init",
    "curriculum_ig_final": "ig_final",
    "curriculum_scope": "scope",
}
_OWN_KEYS = ("score_on", "verify_scoring", "answer_template_prefix", "answer_template_suffix",
             "ig_warmup_threshold", "ig_warmup_ema_alpha", "ig_warmup_timing", "infra_failure", "agent")

# DR-Venus' algorithm-level keys (RL/verl/trainer/config/algorithm.py) -> what replaces each here.
_SAME_NAME = ("ig_weight", "adaptive_gamma_min_weight", "info_gain_type", "ig_compute_freq", "ig_tool_filter",
              "use_format_penalty", "format_penalty_scale", "ig_warmup_threshold", "ig_warmup_ema_alpha",
              "use_curriculum", "curriculum_f1_init", "curriculum_f1_final", "curriculum_ig_init", "curriculum_ig_final")
REFERENCE_KEYS = {
    **{key: f"algorithm.igpo.{key}" for key in _SAME_NAME},
    "info_gain_norm_mode": "algorithm.igpo.norm_mode",
    "use_info_gain": "algorithm.adv_estimator=igpo (true) or grpo (false)",
    "use_vectorized_gt_logprob": "algorithm.igpo.score_on=actor (one packed scoring pass replaces it)",
    "use_kv_cache_ig": "algorithm.igpo.score_on=actor (one packed scoring pass replaces it)",
}


def refuse_reference_keys(algorithm: Mapping[str, Any]) -> None:
    """Raise when the ``algorithm`` section holds a DR-Venus key: reading it would need a mapping that could drift,
    and ignoring it would train with our default while the user believes the reference's value is in force."""
    # The section's keys once, then a lookup only where one is present: verl's estimator parses its config on every
    # call, and a lookup per reference key (18 DictConfig gets) was half of that parse (~50 of ~100 us).
    present = set(algorithm.keys())
    found = [key for key in REFERENCE_KEYS if key in present and algorithm.get(key, None) is not None]
    if found:
        fixes = "; ".join(f"algorithm.{key} -> {REFERENCE_KEYS[key]}" for key in found)
        raise ValueError(f"reference (DR-Venus) configuration key(s) {found} are not read by igpo; replace them: "
                         f"{fixes}. For the reference's whole training signal add +fidelity=reference_drvenus.")


# Overrides of the reference systems' launch scripts (DR-Venus RL/train_igpo.sh, IGPO policy_optimization.sh) that are
# not verl 0.9.1 keys, or verl keys set to a value only the reference's fork understands -> what to use here.
# Refused before Hydra composes the config, with or without "+": a "+key" would otherwise be added and ignored.
REFERENCE_LAUNCH_KEYS = {
    **{f"algorithm.{key}": replacement for key, replacement in REFERENCE_KEYS.items()},
    "actor_rollout_ref.rollout.agent.completion_cutoff": "algorithm.igpo.agent.completion_cutoff",
    "actor_rollout_ref.rollout.agent.max_concurrent_samples": "algorithm.igpo.agent.max_concurrent_trajectories",
    "actor_rollout_ref.actor.mask_tool_response": "nothing: observations are never trained on here (the agent loop "
                                                  "gives them response-mask 0); remove it",
    "agent_grpo.n": "actor_rollout_ref.rollout.n",
    "max_turns": "algorithm.igpo.agent.max_turns (and algorithm.igpo.agent.max_turns_jitter=5 for the reference's "
                 "jitter)",
    "tool_timeout": "algorithm.igpo.agent.tool_timeout_s",
    "trace_save_interval": "trainer.rollout_data_dir=<dir> (verl dumps every step's rollouts there)",
    "trace_max_samples": "trainer.rollout_data_dir=<dir> (verl dumps every step's rollouts there)",
    "search_engine": "the tool server's backend: TOOL_BACKEND=web|local for train_igpo.sh",
    "codeact_env_disabled": "nothing: igpo's agent has no code-act branch; remove it",
    "do_search": "nothing: the agent always has its tools (algorithm.igpo.agent.tool_names); remove it",
    "data.max_model_len": "actor_rollout_ref.rollout.max_model_len (the agent's context cap follows it; "
                          "algorithm.igpo.agent.max_context_tokens to cap it lower)",
    "data.data_writing_path": "trainer.rollout_data_dir=<dir>",
    "trainer.resume_dataloader_steps": "trainer.resume_mode=auto (the data loader position is checkpointed)",
    "reward_model.train_reward_type": "reward.custom_reward_function.reward_kwargs.train_reward_type",
    "reward_model.valid_reward_type": "nothing: validation reports f1, em and (with a judge) the judge's score per "
                                      "sample; python -m igpo.evaluate for benchmark runs",
    "reward_model.reward_kwargs.deepthink_disabled": "nothing: igpo has no DeepThink history summarisation; remove it",
    "reward_model.reward_kwargs": "reward.custom_reward_function.reward_kwargs",
}
_FORK_ONLY_VALUES = {
    "reward_model.reward_manager": (("naive_batch",), "nothing: the outcome reward is reward.custom_reward_function "
                                                      "(pkg://igpo.reward), with verl's own reward manager"),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": (
        ("dr_agent_loop",), "nothing: igpo's agent loop is registered by the igpo plugin; remove it"),
}


def refuse_reference_overrides(overrides: list[str]) -> None:
    """Raise ``ValueError`` naming our key for each command-line override that sets a reference launch key
    (``REFERENCE_LAUNCH_KEYS``), with or without a ``+``/``++``/``~`` prefix. Other overrides pass untouched."""
    found = []
    for override in overrides:
        key, _, value = override.lstrip("~+").partition("=")
        key = key.strip()
        replacement = REFERENCE_LAUNCH_KEYS.get(key)
        if replacement is None and key in _FORK_ONLY_VALUES:
            needles, message = _FORK_ONLY_VALUES[key]
            replacement = message if any(n in value for n in needles) else None
        if replacement is not None:
            found.append(f"{override} -> {replacement}")
    if found:
        raise ValueError("reference (DR-Venus / IGPO launch script) override(s) that igpo does not read: "
                         + "; ".join(found) + ". For the reference's whole training signal add "
                         "+fidelity=reference_drvenus.")


_ADVANTAGE_KEYS = tuple(k for k in field_names(AdvantageConfig) if k not in ("gamma", "norm_adv_by_std"))


def advantage_config_from_algorithm(algorithm: Mapping[str, Any]) -> AdvantageConfig:
    """``AdvantageConfig`` from verl's ``algorithm`` config: ``algorithm.igpo.<field>`` (other keys of the section are
    ignored here, None keeps the default), plus ``algorithm.gamma`` and ``algorithm.norm_adv_by_std_in_grpo``."""
    refuse_reference_keys(algorithm)
    section = plain_section(algorithm.get("igpo", None))
    values = {k: section[k] for k in _ADVANTAGE_KEYS if section.get(k) is not None}
    if algorithm.get("gamma", None) is not None:
        values["gamma"] = algorithm.get("gamma")
    if algorithm.get("norm_adv_by_std_in_grpo", None) is not None:
        values["norm_adv_by_std"] = bool(algorithm.get("norm_adv_by_std_in_grpo"))
    return AdvantageConfig(**coerce_to_fields(AdvantageConfig, values))


@dataclass(frozen=True)
class IGPOConfig:
    """The validated ``algorithm.igpo`` section (see the module docstring for which keys go where)."""

    info_gain: InfoGainConfig
    advantage: AdvantageConfig
    curriculum: CurriculumConfig
    scoring: RolloutScoringConfig
    agent: AgentLoopConfig
    # The one default of score_on lives in RolloutScoringConfig (the agent loop reads the same section).
    score_on: str = RolloutScoringConfig.score_on
    # With score_on=rollout, also score on the actor and log igpo/scoring_rollout_vs_actor_max_abs_diff: checks that
    # the rollout engine's numerics (e.g. bf16 vLLM) agree with the trainer's; costs one extra scoring pass.
    verify_scoring: bool = False
    ig_warmup_threshold: float = 0.0
    ig_warmup_ema_alpha: float = 0.1
    # Whether step t's own outcome can open the gate (igpo.core.advantage.WarmupGate documents both).
    ig_warmup_timing: str = "update_then_decide"
    # What trains when a tool call failed for infrastructure reasons (timeout, 5xx, spent budget): mask_trajectory,
    # mask_turn or keep (igpo.core.infra). None = the estimator's default: mask_trajectory for igpo and infopo; verl's
    # stock estimators (grpo ...) cannot leave a row out of their group statistics, so they keep (with a warning).
    infra_failure: str | None = None

    def __post_init__(self):
        if self.score_on not in SCORE_ON:
            raise ValueError(f"algorithm.igpo.score_on={self.score_on!r} is unknown; use one of {SCORE_ON}.")
        if self.ig_warmup_timing not in WARMUP_TIMINGS:
            raise ValueError(f"algorithm.igpo.ig_warmup_timing={self.ig_warmup_timing!r} is unknown; use one of "
                             f"{WARMUP_TIMINGS}.")
        if not 0.0 < self.ig_warmup_ema_alpha <= 1.0:
            raise ValueError(f"algorithm.igpo.ig_warmup_ema_alpha={self.ig_warmup_ema_alpha} must be in (0, 1].")
        if self.infra_failure is not None and self.infra_failure not in INFRA_FAILURE_POLICIES:
            raise ValueError(f"algorithm.igpo.infra_failure={self.infra_failure!r} is unknown; use one of "
                             f"{INFRA_FAILURE_POLICIES} (or leave it unset for the estimator's default).")

    @classmethod
    def from_algorithm(cls, algorithm: Mapping[str, Any]) -> "IGPOConfig":
        """Build from verl's ``algorithm`` config; unknown ``algorithm.igpo`` keys raise with the list of known ones."""
        refuse_reference_keys(algorithm)
        section = plain_section(algorithm.get("igpo", None))
        known = set(field_names(InfoGainConfig)) | set(_ADVANTAGE_KEYS) | set(_CURRICULUM_KEYS) | set(_OWN_KEYS)
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown key(s) algorithm.igpo.{unknown}: check the spelling; known keys are "
                             f"{sorted(known)} (see configs/igpo_base.yaml).")
        info = info_gain_config_from(section)
        advantage = advantage_config_from_algorithm(algorithm)
        curriculum = CurriculumConfig(**coerce_to_fields(CurriculumConfig, {
            field: section[key] for key, field in _CURRICULUM_KEYS.items() if key in section}))
        own = {k: section[k] for k in ("score_on", "verify_scoring", "ig_warmup_threshold", "ig_warmup_ema_alpha",
                                       "ig_warmup_timing", "infra_failure") if k in section}
        for key in ("ig_warmup_threshold", "ig_warmup_ema_alpha"):
            if key in own:
                own[key] = float(own[key])
        return cls(
            info_gain=info,
            advantage=advantage,
            curriculum=curriculum,
            scoring=RolloutScoringConfig.from_dict(section),
            agent=AgentLoopConfig.from_dict(section.get("agent")),
            **own,
        )


def infopo_config_from_algorithm(algorithm: Mapping[str, Any]) -> InfoPOConfig:
    """``InfoPOConfig`` from ``algorithm.infopo`` (unknown keys raise), plus ``algorithm.gamma`` (used by the r2g
    variants only) and ``algorithm.norm_adv_by_std_in_grpo``."""
    gamma = algorithm.get("gamma", None)
    norm = algorithm.get("norm_adv_by_std_in_grpo", None)
    return InfoPOConfig.from_dict(plain_section(algorithm.get("infopo", None)),
                                  gamma=None if gamma is None else float(gamma),
                                  norm_adv_by_std=None if norm is None else bool(norm))


# The keys of verl's RolloutCorrectionConfig that change the bypass-mode loss (with loss_type=ppo_clip the importance
# weights are only measured there: the PPO ratio against the rollout already is the correction).
BYPASS_LOSS_KEYS = ("loss_type", "rollout_rs", "rollout_rs_threshold")
BYPASS_REINFORCE_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize")


def check_rollout_correction(config: Any) -> None:
    """verl's rollout correction (``algorithm.rollout_correction``) as our trainer modes apply it
    (``igpo.integration.rollout_correction``, docs/guide/async.md "Rollout correction"): in decoupled mode
    (``bypass_mode=false``) at our advantage step, in bypass mode in the actor's ``bypass_mode`` loss. The values go
    through verl's own function once, on one token, so a bad option or threshold stops the launch, not the first
    step; a setting the run would drop or misread is refused with the key and the fix."""
    correction = config.algorithm.get("rollout_correction") or {}
    bypass = bool(correction.get("bypass_mode", False))
    active = [key for key in ("rollout_is", "rollout_rs") if correction.get(key) is not None]
    named = ", ".join(f"{key}={correction.get(key)!r}" for key in active) or "bypass_mode=true"
    loss_type = str(correction.get("loss_type", "ppo_clip"))
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    loss_mode = str(policy_loss.get("loss_mode", "vanilla"))
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ConfigError(f"algorithm.rollout_correction.loss_type={loss_type!r} is not one of verl's ('ppo_clip', "
                          "'reinforce').")
    _check_with_verl(correction)
    if (active or bypass) and not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        raise ConfigError(
            f"algorithm.rollout_correction.{named} needs the rollout's log-probabilities, and "
            "actor_rollout_ref.rollout.calculate_log_probs is false (verl would skip the correction without a word); "
            "set actor_rollout_ref.rollout.calculate_log_probs=true.")
    if not bypass:
        if loss_mode == "bypass_mode":
            raise ConfigError(
                "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode with algorithm.rollout_correction."
                "bypass_mode=false: verl's bypass loss reads old_log_probs as the rollout's, but in decoupled mode the "
                "actor recomputes them, so it would correct against the wrong policy. Set algorithm.rollout_correction."
                "bypass_mode=true (the correction in the loss), or policy_loss.loss_mode=vanilla (decoupled: the "
                "correction at the advantage step).")
        if loss_type == "reinforce":
            raise ConfigError(
                "algorithm.rollout_correction.loss_type=reinforce with bypass_mode=false: verl reads loss_type only in "
                "bypass mode, so the run would train PPO-clip; set algorithm.rollout_correction.bypass_mode=true (the "
                "bypass_pg_* presets) or loss_type=ppo_clip.")
        return
    if (active or loss_type == "reinforce") and loss_mode != "bypass_mode":
        raise ConfigError(
            f"algorithm.rollout_correction.{named} with bypass_mode=true and actor_rollout_ref.actor.policy_loss."
            f"loss_mode={loss_mode}: in bypass mode verl applies the correction in its bypass_mode loss, so this loss "
            "would drop it; set actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode (bash train_igpo.sh does "
            "when the loss is vanilla).")
    if loss_mode == "bypass_mode":
        # verl's v1 trainer does not hand algorithm.rollout_correction to the actor (its legacy trainer did): the
        # loss reads the actor's own section, with verl's RolloutCorrectionConfig defaults where it is not set.
        actors = policy_loss.get("rollout_correction", None) or {}
        keys = BYPASS_LOSS_KEYS + (BYPASS_REINFORCE_KEYS if loss_type == "reinforce" else ())
        defaults = _verl_correction_defaults()
        differ = [key for key in keys if actors.get(key, defaults[key]) != correction.get(key, defaults[key])]
        if differ:
            key = differ[0]
            raise ConfigError(
                f"algorithm.rollout_correction.{key}={correction.get(key, defaults[key])!r} but the actor's "
                f"bypass_mode loss reads actor_rollout_ref.actor.policy_loss.rollout_correction.{key}="
                f"{actors.get(key, defaults[key])!r} (verl's v1 trainer does not copy the section to the actor). Set "
                "the correction under algorithm.rollout_correction only (bash train_igpo.sh and python -m igpo.main "
                "copy it to the actor), or both sections alike.")


def _verl_correction_defaults() -> dict[str, Any]:
    """verl's ``RolloutCorrectionConfig()`` as a dict: what a section reads where a key is not set."""
    # Imported here: this module is read in every process (agent loops, tool clients), verl's config only where a
    # run is checked.
    from dataclasses import asdict

    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    return {key: value for key, value in asdict(RolloutCorrectionConfig()).items() if not key.startswith("_")}


def _check_with_verl(correction: Mapping[str, Any]) -> None:
    """verl's ``compute_rollout_correction_and_rejection_mask`` on one token with the section's values (verl parses
    the thresholds and options there); its ValueError or TypeError becomes a ConfigError."""
    # Imported here: this module is read in every process (agent loops, tool clients), verl's helper only where a
    # run is checked.
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    token = torch.zeros(1, 1)
    try:
        compute_rollout_correction_and_rejection_mask(
            token, token, torch.ones(1, 1), rollout_is=correction.get("rollout_is", None),
            rollout_is_threshold=correction.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=bool(correction.get("rollout_is_batch_normalize", False)),
            rollout_rs=correction.get("rollout_rs", None),
            rollout_rs_threshold=correction.get("rollout_rs_threshold", None))
    except (ValueError, TypeError) as error:
        settings = ", ".join(f"{key}={correction.get(key)!r}" for key in (
            "rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold") if key in correction)
        raise ConfigError(f"algorithm.rollout_correction ({settings}): verl refuses it: {error}") from None
