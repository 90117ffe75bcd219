"""Trainer mode ``igpo_sync`` for verl's v1 trainer (``trainer.v1.trainer_mode=igpo_sync``).

verl's registered estimators only see ``token_level_rewards``/``response_mask``/``uid``; IGPO needs each
trajectory's turn structure. This subclass of the stock synchronous trainer replaces one method,
``_compute_advantage``: it reads the agent loop's ``extra_fields`` (turn ends, tool names, format flags, answer
log-probs per boundary) from TransferQueue and places the per-turn rewards at the recorded turn ends:

    IG_j = v_{j+1} − v_prev   (igpo.core.info_gain)     on the last generated token of turn j
    outcome (F1/judge), or the answer-format penalty    on the last generated token of the trajectory
    format penalty of turn j                             on the last generated token of turn j (own channel, or
                                                         in place of its IG with format_penalty_mode=in_ig_pool)

as reward positions (``igpo.core.info_gain.turn_boundaries``; no [B, L] reward tensor is built), then calls
``igpo.core.advantage.advantage_at_boundaries`` and logs the ``igpo/*`` metrics. The warm-up gate and the
curriculum are applied here (``ig_warmup_timing``, ``curriculum_scope``); the gate's state is saved beside verl's
checkpoints (``igpo_state.json``). An empty turn (an aborted generation) ends on its untrained end-of-turn token: its
IG or penalty is a reward position outside the loss mask (counted in ``igpo/empty_turns``).

With ``algorithm.adv_estimator=infopo`` the same records drive InfoPO instead (``_infopo_advantage``): the actor
scores each observation's counterfactual (content replaced by ``algorithm.infopo.placeholder``,
``IGPOActorRolloutRefWorker.infopo_score_counterfactuals``), and ``igpo.core.infopo.infopo_advantage`` fuses the
group-normalised intrinsic values with the outcome advantage through the variance gate; ``infopo/*`` metrics.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import ray
import torch
from tensordict import NonTensorStack, TensorDict

import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from igpo.config import IGPOConfig, arpo_config_from, infopo_config_from_algorithm
from igpo.core import arpo as arpo_core
from igpo.integration.estimator import ESTIMATOR_NAMES, INFOPO_NAMES
from igpo.agent.agent_config import _plain
from igpo.integration.tool_spend import ToolSpendConfig, fetch_stats, spent_budgets, step_metrics
from igpo.launch.launch_plan import check_estimator, check_infopo, check_rollout_correction
from igpo.core.infopo import ContinuationRequest, InfoPOInputs, infopo_advantage, observation_content_span
from igpo.core.ground_truth import answer_probes
from igpo.core.scoring import validate_request
from igpo.core.advantage import WarmupGate, advantage_at_boundaries, curriculum_weights, last_response_token
from igpo.core.health import HealthConfig, HealthMonitor, turn_health
from igpo.core.infra import InfraMask, infra_mask
from igpo.integration import histograms as hist
from igpo.integration import rollout_failures
from igpo.integration.infra_breaker import InfraBreaker, describe_failures
from igpo.integration.node_reach import describe_tool_calls, require_reach_from_every_node, tool_calls_by_node
from igpo.core.info_gain import ig_by_answer_seen, penalty_into_ig_pool, reduce_alias_logprobs, scored_boundaries, \
    turn_boundaries, turn_format_penalty, turn_information_gain

logger = logging.getLogger(__name__)

STATE_FILE = "igpo_state.json"


def prompt_uid(step: int, number: int) -> str:
    """A prompt's uid: the step it was drawn for and its number in the run (no '_': verl splits keys on it)."""
    return f"s{int(step):07d}p{int(number):09d}"


def trajectory_order(key: str) -> tuple:
    """Sort key of a TransferQueue trajectory key ``{uid}_{session}_{index}``: uid, then session and index as numbers
    (so that session 10 follows 9); a key of another shape sorts by itself."""
    parts = str(key).rsplit("_", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return (parts[0], int(parts[1]), int(parts[2]))
    return (str(key), -1, -1)


def _turn_tensors(extras: list[dict], length: int, alias_mode: str):
    """Per-turn tensors [B, T] from the agent loop's extra_fields dicts (T = the batch's largest turn count).

    A turn whose last token lies beyond the stored response (cut by ``rollout.response_length``) is dropped: its
    reward would have no token to sit on.
    """
    batch = len(extras)
    num_turns = [int(e.get("igpo_num_turns") or 0) for e in extras]
    width = max(1, max(num_turns, default=0))
    turn_ends = torch.zeros(batch, width, dtype=torch.long)
    format_ok = torch.ones(batch, width, dtype=torch.bool)
    aliases = max([len(entry) for e in extras for entry in (e.get("igpo_answer_logprobs") or []) if entry],
                  default=1)
    alias_lp = torch.full((batch, width, aliases), float("nan"), dtype=torch.float64)
    alias_ok = torch.zeros(batch, aliases, dtype=torch.bool)
    tool_names: list[list[str | None]] = []
    for i, e in enumerate(extras):
        n = num_turns[i]
        # An end of -1 is an empty first turn recorded by an older loop: its end-of-turn token is response token 0.
        ends = [max(int(end), 0) for end in list(e.get("igpo_turn_ends") or [])[:n]] if n else []
        inside = [end < length for end in ends]
        n = len(ends) if all(inside) else inside.index(False)
        num_turns[i] = n
        if n:
            turn_ends[i, :n] = torch.tensor(ends[:n])
            format_ok[i, :n] = torch.tensor([bool(v) for v in list(e.get("igpo_turn_format_ok") or [True] * n)[:n]])
        tool_names.append(list(e.get("igpo_tool_names") or [None] * n)[:n] if n else [])
        for s, entry in enumerate(list(e.get("igpo_answer_logprobs") or [])[:n]):
            if entry:
                alias_lp[i, s, :len(entry)] = torch.tensor([float(v) for v in entry], dtype=torch.float64)
                alias_ok[i, :len(entry)] = True
    boundary_lp = reduce_alias_logprobs(alias_lp, alias_ok, alias_mode)
    return torch.tensor(num_turns), turn_ends, format_ok, tool_names, boundary_lp


def _arpo_meta(extras: list[dict]) -> dict[str, torch.Tensor]:
    """arpo_index, arpo_parent, arpo_branch_pos [B] from the agent loop's records (roots where a record has none)."""
    defaults = {"arpo_index": 0, "arpo_parent": -1, "arpo_branch_pos": 0}
    return {key: torch.tensor([int(e[key]) if e.get(key) is not None else d for e in extras], dtype=torch.long)
            for key, d in defaults.items()}


def arpo_tree_check(responses: torch.Tensor, response_mask: torch.Tensor, uids: list, extras: list[dict],
                    m: int) -> tuple[float, float]:
    """(branches whose response ids or mask differ from their parent's before arpo_branch_pos, prompts whose rows are
    not exactly arpo_index 0..m−1)."""
    meta = _arpo_meta(extras)
    group = arpo_core.soft_group_ids(uids)
    args = (group, meta["arpo_index"], meta["arpo_parent"], meta["arpo_branch_pos"])
    ok = arpo_core.prefix_identical(responses, *args) & arpo_core.prefix_identical(response_mask, *args)
    indices: dict = {}
    for u, i in zip(uids, meta["arpo_index"].tolist()):
        indices.setdefault(u, []).append(i)
    incomplete = sum(sorted(v) != list(range(m)) for v in indices.values())
    return float((~ok).sum()), float(incomplete)


def _infra_failed_turns(extras: list[dict], width: int) -> torch.Tensor:
    """[B, width] bool: turn t's tool call failed for infrastructure reasons (the agent loop's ``igpo_tool_status``
    is ``infra_error``: a timeout, 5xx, connection error or spent budget)."""
    failed = torch.zeros(len(extras), width, dtype=torch.bool)
    for i, e in enumerate(extras):
        for t, status in enumerate(list(e.get("igpo_tool_status") or [])[:width]):
            failed[i, t] = status == "infra_error"
    return failed


def _answer_seen(extras: list[dict], num_turns: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen, known), [B, width] bool: the observation after turn j contained a gold alias (the agent loop's
    ``igpo_answer_seen``), and whether that is known (a sample without usable ground truth records nothing)."""
    seen = torch.zeros(len(extras), width, dtype=torch.bool)
    known = torch.zeros(len(extras), width, dtype=torch.bool)
    for i, e in enumerate(extras):
        flags = [bool(v) for v in list(e.get("igpo_answer_seen") or [])[:int(num_turns[i])]]
        if flags:
            seen[i, :len(flags)] = torch.tensor(flags)
            known[i, :len(flags)] = True
    return seen, known


@register_trainer("igpo_sync")
class IGPOTrainerSync(PPOTrainerSync):
    """verl's synchronous v1 trainer with IGPO's turn-level rewards and advantage."""

    histograms = hist.StepHistograms(enabled=False)  # trainer.histograms=true: __init__ gives the run its own

    def __init__(self, config):
        super().__init__(config)
        self.igpo = IGPOConfig.from_algorithm(config.algorithm)
        check_rollout_correction(config)
        estimator = str(config.algorithm.adv_estimator)
        check_estimator(estimator)
        # IGPO's own turn-level advantage, or any other registered estimator (stock GRPO: outcome only) run by verl's
        # step on the same agent loop, for like-for-like comparisons.
        self.uses_igpo = estimator in ESTIMATOR_NAMES
        self.uses_infopo = estimator in INFOPO_NAMES
        if self.uses_infopo:
            self.infopo = infopo_config_from_algorithm(config.algorithm)
            self.infopo_reuse, why = check_infopo(config, self.infopo)
            logger.warning("igpo_sync: InfoPO's factual term %s", why)
        logger.warning("igpo_sync: advantage estimator %s (%s)", estimator,
                       "IGPO turn-level" if self.uses_igpo else "InfoPO counterfactual information gain"
                       if self.uses_infopo else "verl's, on the outcome reward")
        if config.algorithm.get("use_kl_in_reward", False):
            raise ValueError("algorithm.use_kl_in_reward=true puts a reward on every token, which breaks IGPO's "
                             "turn rewards; use actor_rollout_ref.actor.use_kl_loss=true instead.")
        self.warmup = WarmupGate(self.igpo.ig_warmup_threshold, self.igpo.ig_warmup_ema_alpha,
                                 self.igpo.ig_warmup_timing)
        self.infra_failure = self._infra_failure_policy(estimator)
        self.tool_spend = ToolSpendConfig.from_dict(_plain(config.get("tools", None)))
        self.arpo = arpo_config_from(config)
        loop_name = str(config.actor_rollout_ref.rollout.agent.default_agent_loop)
        if self.arpo.enabled and loop_name != "arpo_agent":
            raise ValueError(f"algorithm.arpo.enabled=true with rollout.agent.default_agent_loop={loop_name}: branching "
                             "lives in the arpo_agent loop; set actor_rollout_ref.rollout.agent.default_agent_loop="
                             "arpo_agent (bash train_igpo.sh / python -m igpo.main do it for igpo_agent).")
        self._tool_stats: dict | None = None  # the tool server's /stats at the end of the previous step
        self._step_seconds: list[float] = []  # wall time of each step of this process (for the ETA)
        self._prompts_fetched = 0  # numbers the deterministic prompt uids (_fetch_one_gen_batch)
        self.health = HealthMonitor(HealthConfig.from_dict(_plain(config.trainer.get("health", None))))
        self.infra_breaker = InfraBreaker(self.tool_spend.infra_breaker)
        self.histograms = hist.StepHistograms(hist.histograms_enabled(config.trainer))
        if self.igpo.agent.tool_server_url is not None:
            # Before the workers load a model: a node whose agent-loop workers cannot reach the tool server would
            # have all its tool calls masked as infra failures (igpo.integration.node_reach).
            require_reach_from_every_node(self.igpo.agent.tool_server_url)

    def _build_replay_buffer(self):
        """verl's replay buffer, stopping the run when the rollout cannot deliver (igpo.integration.rollout_failures): at once
        when the rollout engine died, or past one step's worth of failed sessions."""
        per_step = int(self.config.data.train_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
        return rollout_failures.guard(super()._build_replay_buffer(), limit=per_step)

    # ---- one seed, one run -----------------------------------------------------------------------------------------

    def _fetch_one_gen_batch(self):
        """verl's batch with uids that depend only on the step and the prompt's place in it (verl draws uuid4s):
        the agent loop's per-request sampling seeds and the batch order below are keyed by them."""
        batch = super()._fetch_one_gen_batch()
        start, self._prompts_fetched = self._prompts_fetched, self._prompts_fetched + len(batch)
        batch["uid"] = NonTensorStack(*[prompt_uid(self.global_steps, start + i) for i in range(len(batch))])
        return batch

    def _balance_batch(self, batch, metrics, *args, **kwargs):
        """verl's balancing from a fixed starting order: TransferQueue returns trajectories in the order they
        finished, which varies run to run and would change mini-batches, micro-batches and their sums."""
        batch.reorder(sorted(range(len(batch.keys)), key=lambda i: trajectory_order(batch.keys[i])))
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    def _infra_failure_policy(self, estimator: str) -> str:
        """``algorithm.igpo.infra_failure`` resolved for this estimator (unset: mask_trajectory where we compute the
        advantage, keep for verl's stock estimators, whose group statistics cannot leave a row out)."""
        chosen = self.igpo.infra_failure
        if self.uses_igpo or self.uses_infopo:
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

    def _infra_mask(self, extras: list[dict], response_mask: torch.Tensor, metrics: dict) -> InfraMask:
        """What the infra_failure policy takes out of this batch (``igpo.core.infra``), with its two counters."""
        num_turns, turn_ends, _, _, _ = _turn_tensors(extras, response_mask.shape[1], "first")
        failed = _infra_failed_turns(extras, turn_ends.shape[1])
        policy = getattr(self, "infra_failure", "mask_trajectory")  # resolved in __init__; unit tests skip it
        mask = infra_mask(failed, num_turns, turn_ends, response_mask, policy)
        metrics["igpo/infra_masked_trajectories"] = float(mask.rows.sum())
        metrics["igpo/infra_masked_turns"] = float(mask.turns.sum())
        if len(extras) and bool(mask.rows.all()):
            # The actor's token-mean loss is then 0/0; verl skips an update whose gradient norm is not finite.
            logger.warning("igpo: every trajectory of step %s hit an infrastructure failure and is masked "
                           "(algorithm.igpo.infra_failure=%s): this step trains nothing; check the tool server",
                           getattr(self, "global_steps", "?"), policy)
        return mask

    def _init_resource_pool_mgr(self):
        """verl's worker layout, with the actor role served by our subclass (it adds the answer-scoring method)."""
        # Imported here, not at module level: importing the worker module imports verl, whose plugin loading imports
        # this module; a module-level import would make that a cycle in any process that imports the worker first.
        from igpo.integration.actor_worker import IGPOActorRolloutRefWorker

        super()._init_resource_pool_mgr()
        for role, worker_cls in list(self.role_worker_mapping.items()):
            if role.name.startswith("Actor"):
                self.role_worker_mapping[role] = ray.remote(IGPOActorRolloutRefWorker)

    # ---- actor-side answer scoring ------------------------------------------------------------------------------

    def _score_on_actor(self, batch, extras, scored, num_turns, metrics) -> torch.Tensor:
        """Answer log-probs per boundary [B, T, A] computed by the actor workers with the packed scorer."""
        from igpo.agent.agent_loop import _frame_for

        started = time.perf_counter()
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["prompts", "responses", "reward_model"])
        prompts, responses = data["prompts"].unbind(), data["responses"].unbind()
        reward_models = data.pop("reward_model").tolist()
        # The agent loop's cached frame: the probe ends with the same end-of-turn text the rollout used.
        frame = _frame_for(self.tokenizer, dict(self.config.data.get("apply_chat_template_kwargs", {}) or {}))
        template = self.igpo.scoring.answer_template(frame.eot_text)
        B, T = scored.shape
        requests, owners, skipped = [], [], 0
        max_positions = self._max_positions()
        for i, extra in enumerate(extras):
            n = int(num_turns[i])
            boundaries = list(extra.get("igpo_boundaries") or [])[:n]
            chosen = [s for s in range(min(n, len(boundaries))) if scored[i, s]]
            if not chosen:
                continue
            trajectory = torch.cat([prompts[i], responses[i]]).tolist()
            try:
                probes = answer_probes(self.tokenizer, (reward_models[i] or {}).get("ground_truth"), template,
                                       self.igpo.info_gain.answer_alias)
                validate_request(len(trajectory), [boundaries[s] for s in chosen], probes, max_positions)
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
        scoring = {"strategy": "packed", "temperature": float(self.config.actor_rollout_ref.rollout.temperature)}
        results: dict[int, list] = {}
        for part in self.actor_rollout_wg.igpo_score_answers(requests, scoring):
            results.update(part)
        for r, (i, chosen, n_probes) in enumerate(owners):
            values = torch.tensor(results[r], dtype=torch.float64)  # [K, P]
            out[i, chosen, :n_probes] = values
            alias_ok[i, :n_probes] = True
        tokens = sum(len(r["trajectory_ids"]) + len(r["boundaries"]) * sum(len(p["token_ids"]) for p in r["probes"])
                     for r in requests)
        metrics["igpo/scoring_tokens"] = float(tokens)
        metrics["igpo/scoring_skipped"] = float(skipped)
        metrics["timing_s/igpo_scoring"] = time.perf_counter() - started
        return reduce_alias_logprobs(out, alias_ok, self.igpo.info_gain.answer_alias)

    def _max_positions(self) -> int | None:
        """The policy's context window, to refuse probes that do not fit before they reach the workers."""
        if not hasattr(self, "_context_window"):
            try:
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(self.config.actor_rollout_ref.model.path)
                self._context_window = getattr(hf_config, "max_position_embeddings", None)
            except (OSError, ValueError):
                self._context_window = None  # a remote path: the workers check it when they score
        return self._context_window

    # ---- advantage ----------------------------------------------------------------------------------------------

    def _compute_advantage(self, batch, metrics: dict):
        if getattr(self, "arpo", None) is not None and self.arpo.enabled:
            self._check_arpo_tree(batch, metrics)
        if self.uses_infopo:
            return self._compute_infopo_advantage(batch, metrics)
        if not self.uses_igpo:
            return self._compute_stock_advantage(batch, metrics)
        started = time.perf_counter()
        fields = ["uid", "response_mask", "rm_scores", "extra_fields"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        extras = [e if isinstance(e, dict) else {} for e in data.pop("extra_fields").tolist()]
        uids = data.pop("uid").tolist()
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()

        def score_on_actor(scored, num_turns):
            return self._score_on_actor(batch, extras, scored, num_turns, metrics)

        infra = self._infra_mask(extras, padded["response_mask"].bool(), metrics)
        advantages, returns = self._igpo_advantage(extras, uids, padded["response_mask"].bool(),
                                                   padded["rm_scores"].float(), metrics, score_on_actor, infra=infra)
        advantages = self._arpo_attribution(advantages, padded["response_mask"], uids, extras, metrics)
        metrics["timing_s/igpo_advantage"] = time.perf_counter() - started
        fields = {"advantages": response_to_nested(advantages.float(), nested_mask),
                  "returns": response_to_nested(returns.float(), nested_mask)}
        fields.update(self._masked_response(infra, padded["response_mask"], nested_mask))
        output = TensorDict(fields, batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)

    @staticmethod
    def _masked_response(infra: InfraMask, padded_mask: torch.Tensor, nested_mask) -> dict:
        """The masks to write back when the infra policy masked something: the actor's loss terms (policy gradient,
        entropy and KL alike) and verl's metrics read ``response_mask`` from TransferQueue, as after verl's
        rollout-correction rejection sampling; the engine's token count (the token-mean denominator) reads
        ``loss_mask``, which verl's agent loop stored as a copy of ``response_mask``: both change, so the kept
        tokens are weighted as if the masked ones had never been sampled. The nested layout (row lengths) is kept."""
        if not infra.changed:
            return {}
        mask = response_to_nested(infra.loss_mask.to(padded_mask.dtype), nested_mask)
        return {"response_mask": mask, "loss_mask": mask}

    def _compute_stock_advantage(self, batch, metrics: dict):
        """A non-IGPO estimator (e.g. ``grpo``): verl's own step on the outcome reward, plus our rollout metrics."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        extras = [e if isinstance(e, dict) else {} for e in data.pop("extra_fields").tolist()]
        num_turns = torch.tensor([int(e.get("igpo_num_turns") or 0) for e in extras], dtype=torch.long)
        metrics.update(self._rollout_metrics(extras, num_turns))
        self.histograms.record(hist.TURNS, num_turns)
        metrics["igpo/infra_masked_trajectories"] = metrics["igpo/infra_masked_turns"] = 0.0  # policy: keep
        out = super()._compute_advantage(batch, metrics)
        if self._arpo_hard:  # rewrite verl's advantages with the tree average
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=["uid", "advantages", "response_mask"])
            nested_mask, padded = data["response_mask"], data.to_padded_tensor()
            advantages = self._arpo_attribution(padded["advantages"].float(), padded["response_mask"],
                                                data.pop("uid").tolist(), extras, metrics)
            fields = TensorDict({"advantages": response_to_nested(advantages, nested_mask)}, batch_size=len(batch))
            out = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        return out

    def _check_arpo_tree(self, batch, metrics: dict) -> None:
        """The tree metadata as verl stored it: every prompt has its M trajectories (arpo_index 0..M−1) and every
        branch equals its parent on response tokens and loss mask before ``arpo_branch_pos``
        (``arpo/incomplete_groups`` and ``arpo/prefix_mismatches``, both 0 unless the rollout is broken)."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["uid", "responses", "response_mask", "extra_fields"])
        extras = [e if isinstance(e, dict) else {} for e in data.pop("extra_fields").tolist()]
        uids = data.pop("uid").tolist()
        padded = data.to_padded_tensor()
        metrics["arpo/prefix_mismatches"], metrics["arpo/incomplete_groups"] = arpo_tree_check(
            padded["responses"], padded["response_mask"], uids, extras, self.arpo.rollouts_per_prompt)
        if metrics["arpo/prefix_mismatches"] or metrics["arpo/incomplete_groups"]:
            logger.warning("arpo: step %s: %d branches differ from their parent before their branch position, %d "
                           "prompts lack trajectories; the tree metadata does not describe this batch",
                           getattr(self, "global_steps", "?"), metrics["arpo/prefix_mismatches"],
                           metrics["arpo/incomplete_groups"])

    @property
    def _arpo_hard(self) -> bool:
        arpo = getattr(self, "arpo", None)  # set in __init__; unit tests build the trainer without it
        return arpo is not None and arpo.enabled and arpo.attribution == "hard"

    def _arpo_attribution(self, advantages: torch.Tensor, response_mask: torch.Tensor, uids: list,
                          extras: list[dict], metrics: dict | None = None) -> torch.Tensor:
        """ARPO's hard attribution (``algorithm.arpo.attribution=hard``): every copy of a token that branches share
        gets the mean advantage of the trajectories sharing it (``igpo.core.arpo.hard_attribution``, from the rollout's
        tree metadata and its own response mask). Soft (the default) and ARPO off return the advantages as they are."""
        if not self._arpo_hard:
            return advantages
        group = arpo_core.soft_group_ids(uids)
        meta = _arpo_meta(extras)
        if metrics is not None:  # trained tokens that several trajectories share (their advantage is averaged)
            shared = arpo_core.share_counts(group, meta["arpo_index"], meta["arpo_parent"], meta["arpo_branch_pos"],
                                            advantages.shape[1]) > 1
            metrics["arpo/hard_shared_tokens"] = float((shared & response_mask.bool()).sum())
        return arpo_core.hard_attribution(advantages, response_mask.bool(), group, meta["arpo_index"],
                                          meta["arpo_parent"], meta["arpo_branch_pos"])

    def _igpo_advantage(self, extras: list[dict], uids: list, response_mask: torch.Tensor, rm_scores: torch.Tensor,
                        metrics: dict, score_on_actor, infra: InfraMask | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """IGPO advantages and returns [B, L] from the agent loop's records (no Ray, no TransferQueue: unit-tested).

        ``score_on_actor(scored, num_turns)`` returns the answer log-probs per boundary [B, T] when the actor scores.
        ``infra``: what the infra_failure policy masks (computed here when not given; the caller that writes the
        loss mask back passes its own). A masked trajectory gets no reward position, so it is in no group's
        statistics, and a zero advantage; a masked turn loses its IG position and its tokens' advantage.
        """
        if infra is None:
            infra = self._infra_mask(extras, response_mask, metrics)
        B, L = response_mask.shape
        group_of: dict = {}
        group = torch.tensor([group_of.setdefault(u, len(group_of)) for u in uids], dtype=torch.long)
        last = last_response_token(response_mask)
        has_tokens = last >= 0
        outcome = rm_scores.sum(-1)

        num_turns, turn_ends, format_ok, tool_names, boundary_lp = _turn_tensors(
            extras, L, self.igpo.info_gain.answer_alias)
        T = turn_ends.shape[1]
        scored = torch.zeros(B, T, dtype=torch.bool)
        statuses = [list(e.get("igpo_tool_status") or [])[:len(names)] for e, names in zip(extras, tool_names)]
        for i, row in enumerate(scored_boundaries(tool_names, self.igpo.info_gain, statuses)):
            scored[i, :len(row)] = torch.tensor(row, dtype=torch.bool)
        if self.igpo.score_on == "actor":
            boundary_lp = score_on_actor(scored, num_turns)
        elif self.igpo.verify_scoring:
            actor_lp = score_on_actor(scored, num_turns)
            both = torch.isfinite(actor_lp) & torch.isfinite(boundary_lp)
            diff = (actor_lp - boundary_lp).abs()[both]
            metrics["igpo/scoring_rollout_vs_actor_max_abs_diff"] = float(diff.max()) if diff.numel() else float("nan")

        # An outage's outcome says nothing about the policy: masked rows do not move the warm-up gate either.
        counted = has_tokens & ~infra.rows
        gate_open = self.warmup.update(float(outcome[counted].mean()) if bool(counted.any()) else 0.0)
        ig, ig_turn_mask, ig_stats = turn_information_gain(boundary_lp.float(), scored, num_turns, self.igpo.info_gain)
        # Turn j < N-1 ends on its last generated token; the final turn carries the outcome instead.
        tool_turn = torch.arange(T - 1)[None, :] < (num_turns[:, None] - 1)
        seen, known = _answer_seen(extras, num_turns, T)
        ig_stats.update(ig_by_answer_seen(ig, ig_turn_mask & tool_turn & known[:, :-1], seen[:, :-1]))
        penalty, answer_penalty = turn_format_penalty(format_ok, num_turns, self.igpo.info_gain)
        if not gate_open:
            ig_turn_mask = torch.zeros_like(ig_turn_mask)
            penalty = torch.zeros_like(penalty)
            answer_penalty = torch.zeros_like(answer_penalty)

        # The reference replaces the outcome by the answer-format penalty when the final answer is malformed.
        outcome = torch.where(answer_penalty != 0, answer_penalty, outcome)
        # Masked rows keep no reward position (no outcome, IG or penalty), masked turns no IG or penalty position.
        signal_turn = tool_turn & ~infra.rows[:, None] & ~infra.turns[:, :-1]
        ig_turn_mask = ig_turn_mask & signal_turn
        tool_penalty = torch.where(signal_turn, penalty[:, :-1], 0.0)
        if self.igpo.info_gain.format_penalty_mode == "in_ig_pool":
            ig, ig_turn_mask, tool_penalty = penalty_into_ig_pool(ig, ig_turn_mask, tool_penalty)
        last = torch.where(infra.rows, -1, last)
        response_mask = infra.loss_mask
        bounds = turn_boundaries(ig, ig_turn_mask, tool_penalty, turn_ends[:, :-1], outcome, last, response_mask)

        w_outcome, w_ig = curriculum_weights(self.global_steps, self.total_training_steps, self.igpo.curriculum,
                                             ig_active=gate_open)
        # Empty turns (aborted generations) end on untrained tokens; their rewards still count (masked_turns_ok).
        advantages, returns, adv_metrics = advantage_at_boundaries(
            bounds, response_mask, group, self.igpo.advantage, outcome_weight=w_outcome, ig_weight_schedule=w_ig,
            masked_turns_ok=True)
        metrics["igpo/empty_turns"] = float(sum(int(e.get("igpo_empty_turns", 0) or 0) for e in extras))
        self.histograms.record(hist.TURN_IG, ig[ig_turn_mask])
        self.histograms.record(hist.ADVANTAGE, advantages[response_mask])
        self.histograms.record(hist.TURNS, num_turns)

        metrics.update(adv_metrics)
        metrics.update({f"igpo/{k}": v for k, v in ig_stats.items()})
        metrics.update(self._rollout_metrics(extras, num_turns))
        # Samples the actor could not score (bad probe, context window) are scoring errors too, whichever side scored.
        metrics["igpo/scoring_errors"] += metrics.get("igpo/scoring_skipped", 0.0)
        metrics["igpo/ig_gate_active"] = float(gate_open)
        metrics["igpo/outcome_score_ema"] = float(self.warmup.ema if self.warmup.ema is not None else 0.0)
        if self.igpo.curriculum.enabled:
            metrics["curriculum/f1_weight"], metrics["curriculum/ig_weight"] = w_outcome, w_ig
        return advantages, returns

    # ---- InfoPO ---------------------------------------------------------------------------------------------------

    def _compute_infopo_advantage(self, batch, metrics: dict):
        started = time.perf_counter()
        fields = ["uid", "response_mask", "rm_scores", "extra_fields", "prompts", "responses"]
        if self.infopo_reuse:
            fields.append("old_log_probs")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        extras = [e if isinstance(e, dict) else {} for e in data.pop("extra_fields").tolist()]
        uids = data.pop("uid").tolist()
        prompts, responses = data.pop("prompts").unbind(), data.pop("responses").unbind()
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()
        old_log_probs = padded["old_log_probs"].float() if self.infopo_reuse else None

        def counterfactual(num_turns, turn_ends):
            return self._infopo_counterfactual(prompts, responses, extras, num_turns, turn_ends, old_log_probs,
                                               metrics)

        infra = self._infra_mask(extras, padded["response_mask"].bool(), metrics)
        advantages = self._infopo_advantage(extras, uids, padded["response_mask"].bool(), padded["rm_scores"].float(),
                                            metrics, counterfactual, infra=infra)
        advantages = self._arpo_attribution(advantages, padded["response_mask"], uids, extras, metrics)
        metrics["timing_s/infopo_advantage"] = time.perf_counter() - started
        nested = response_to_nested(advantages.float(), nested_mask)
        fields = {"advantages": nested, "returns": response_to_nested(advantages.float(), nested_mask)}
        fields.update(self._masked_response(infra, padded["response_mask"], nested_mask))
        output = TensorDict(fields, batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)

    def _infopo_counterfactual(self, prompts, responses, extras, num_turns, turn_ends, old_log_probs,
                               metrics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(I [B, T] credited to the turn that produced the observation, scored [B, T], failed [B, T]).

        Turn t < N-1 of a trajectory is scored when its observation has content: the actor scores the next action
        a_{t+1} after the counterfactual context (content -> placeholder, template kept); the factual term comes from
        ``old_log_probs`` (same θ, context and temperature) or from a factual copy in the same pass.
        """
        from igpo.agent.agent_loop import _encode_content, _frame_for

        started = time.perf_counter()
        cfg = self.infopo
        frame = _frame_for(self.tokenizer, dict(self.config.data.get("apply_chat_template_kwargs", {}) or {}))
        placeholder = _encode_content(self.tokenizer, cfg.placeholder)
        B, T = turn_ends.shape
        intrinsic = torch.zeros(B, T, dtype=torch.float64)
        scored = torch.zeros(B, T, dtype=torch.bool)
        failed = torch.zeros(B, T, dtype=torch.bool)
        kl = cfg.score == "kl"
        factual = kl or old_log_probs is None
        max_positions = self._max_positions()
        requests, owners = [], []
        for i, extra in enumerate(extras):
            n = int(num_turns[i])
            boundaries = list(extra.get("igpo_boundaries") or [])[:n]
            if n < 2 or len(boundaries) < n:
                continue
            P = int(prompts[i].numel())
            ids = torch.cat([prompts[i], responses[i]]).tolist()
            request, actions = ContinuationRequest(ids), {}
            for t in range(n - 1):
                action = (int(boundaries[t + 1]), int(turn_ends[i, t + 1]) + P + 1)
                try:
                    cs, ce = observation_content_span(ids, int(turn_ends[i, t]) + P + 1, action[0], frame.eot_id,
                                                      frame.prefix_ids, list(frame.suffix_ids.values()))
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
        scoring = {"strategy": "packed", "temperature": float(self.config.actor_rollout_ref.rollout.temperature)}
        results: dict[int, list] = {}
        if requests:
            for part in self.actor_rollout_wg.infopo_score_counterfactuals([r.as_dict(kl) for r in requests], scoring):
                results.update(part)
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

    def _infopo_advantage(self, extras: list[dict], uids: list, response_mask: torch.Tensor, rm_scores: torch.Tensor,
                          metrics: dict, counterfactual, infra: InfraMask | None = None) -> torch.Tensor:
        """InfoPO advantages [B, L] (= returns) from the agent loop's records (no Ray, no TransferQueue: unit-tested).

        ``counterfactual(num_turns, turn_ends)`` returns (I, scored, failed), each [B, T]. Raises ``RuntimeError`` when
        the failed turns pass ``algorithm.infopo.max_failed_turn_ratio``. ``infra`` as in ``_igpo_advantage``: masked
        trajectories are left out of InfoPO's inputs (so out of every group statistic) and get a zero advantage; a
        masked turn loses its intrinsic value and its tokens.
        """
        if infra is None:
            infra = self._infra_mask(extras, response_mask, metrics)
        B, L = response_mask.shape
        group_of: dict = {}
        group = torch.tensor([group_of.setdefault(u, len(group_of)) for u in uids], dtype=torch.long)
        num_turns, turn_ends, _, _, _ = _turn_tensors(extras, L, "first")
        T = turn_ends.shape[1]
        intrinsic, scored, failed = counterfactual(num_turns, turn_ends)
        attempted = int(scored.sum() + failed.sum())
        n_failed = int(failed.sum())
        metrics["infopo/failed_turns"] = float(n_failed)
        metrics["infopo/failed_turn_ratio"] = n_failed / attempted if attempted else 0.0
        if attempted and n_failed / attempted > self.infopo.max_failed_turn_ratio:
            raise RuntimeError(
                f"InfoPO: {n_failed} of {attempted} turns ({100 * n_failed / attempted:.1f}%) could not be scored "
                f"(their observation's content span was not found, the counterfactual did not fit the context window, "
                f"or the score was not finite; the warnings above name each) > algorithm.infopo.max_failed_turn_ratio="
                f"{self.infopo.max_failed_turn_ratio}. Fix the cause (chat template, context window) or raise the "
                "threshold; a failed turn is never scored as 0.")
        # Token i of a trajectory belongs to the first turn whose end is >= i (tokens after the last kept turn, cut
        # by the response length, to the last kept turn).
        positions = torch.arange(L)[None, :].expand(B, L).contiguous()
        width_ends = torch.where(torch.arange(T)[None, :] < num_turns[:, None], turn_ends, L + 1)
        token_turn = torch.searchsorted(width_ends.contiguous(), positions)
        token_turn = torch.minimum(token_turn, (num_turns - 1).clamp(min=0)[:, None])
        outcome = rm_scores.sum(-1).double()
        turn_rewards = torch.zeros(B, T, dtype=torch.float64)
        has_turns = num_turns > 0
        turn_rewards[has_turns, (num_turns - 1).clamp(min=0)[has_turns]] = outcome[has_turns]
        epoch = self.global_steps // max(1, int(getattr(self, "steps_per_epoch", 0) or 0)) \
            if getattr(self, "steps_per_epoch", 0) else 0
        keep = torch.nonzero(~infra.rows).squeeze(1)
        # infopo_advantage wants dense group ids: renumber the groups of the rows that stay.
        _, kept_group = torch.unique(group[keep], return_inverse=True)
        inputs = InfoPOInputs(turn_rewards=turn_rewards[keep], num_turns=torch.where(has_turns, num_turns, 0)[keep],
                              token_turn=token_turn[keep], action_mask=infra.loss_mask[keep], intrinsic=intrinsic[keep],
                              intrinsic_mask=(scored & ~infra.turns)[keep], group=kept_group.reshape(-1),
                              epoch=int(epoch))
        advantages = torch.zeros(B, L, dtype=torch.float64)
        stats = {}
        if keep.numel():
            advantages[keep], stats = infopo_advantage(inputs, self.infopo)
        metrics.update({f"infopo/{k}": v for k, v in stats.items()})
        metrics.update(self._rollout_metrics(extras, num_turns))
        self.histograms.record(hist.TURN_IG, intrinsic[scored & ~infra.turns & ~infra.rows[:, None]])
        self.histograms.record(hist.ADVANTAGE, advantages[infra.loss_mask])
        self.histograms.record(hist.TURNS, num_turns)
        return advantages

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        # The step's wall time is known only now; actor-side scoring is IGPO's main extra cost, so report its share.
        if "timing_s/igpo_scoring" in metrics and timing_raw.get("step"):
            metrics["igpo/scoring_step_share"] = metrics["timing_s/igpo_scoring"] / timing_raw["step"]
        metrics.update(self._progress_metrics(timing_raw))
        self._record_tool_spend(metrics)
        self._check_infra(metrics)
        self._check_health(metrics)
        self._write_histograms()
        by_node = self._tool_calls_by_node() if getattr(self, "_loop_nodes", 0) > 1 else None
        if by_node:
            logger.warning("igpo: tool calls by Ray node so far: %s", describe_tool_calls(by_node))

    def _write_histograms(self) -> None:
        """This step's ``igpo/hist/*`` (``igpo.integration.histograms``) into verl's TensorBoard event file, at its step."""
        if self.histograms.enabled:
            self.histograms.write(self.logger.logger["tensorboard"].writer, int(self.global_steps))

    def _check_infra(self, metrics: dict) -> None:
        """The infra-error breaker (``igpo.integration.infra_breaker``): ``tools.infra_breaker.steps`` consecutive steps in which
        more than ``max_share`` of the tool calls failed for infrastructure reasons save a checkpoint and stop the
        run after this step, naming the upstream and its failure classes."""
        calls, failures = metrics.get("igpo/tool_calls", 0.0), metrics.get("igpo/infra_errors", 0.0)
        stop = self.infra_breaker.update(calls, failures)
        metrics["igpo/infra_error_share"] = self.infra_breaker.last_share
        step, total = int(self.global_steps), int(self.total_training_steps)
        if not stop or step >= total or metrics.get("training/stopped_on_tool_budget"):
            return
        config = self.infra_breaker.config
        folder = self._stop_after_this_step(metrics, "training/stopped_on_infra_errors")
        print(f"igpo: infra breaker: {self.infra_breaker.strikes} consecutive steps with more than "
              f"{config.max_share:.0%} of tool calls failing for infrastructure reasons (this step: {int(failures)} of "
              f"{int(calls)}, {int(metrics.get('igpo/infra_masked_trajectories', 0))} trajectories masked); failing: "
              f"{describe_failures(metrics, self.igpo.agent.tool_server_url)}. Stopped after step {step}/{total}; "
              f"checkpoint {folder}. Fix the upstream (its /health on the tool server says what it answers), then "
              "rerun with trainer.resume_mode=auto and the same trainer.default_local_dir "
              "(tools.infra_breaker.steps=0 turns the breaker off).", flush=True)

    def _check_health(self, metrics: dict) -> None:
        """The early warning (``igpo.core.health``): one ``igpo: warning:`` line per finding, into the training log
        and the launcher's terminal; with ``trainer.health.stop_after`` consecutive warning steps, a checkpoint and a
        clean stop after this step."""
        step, total = int(self.global_steps), int(self.total_training_steps)
        for warning in self.health.update(step, metrics):
            print(f"igpo: warning: {warning}", flush=True)
        metrics["health/warning_streak"] = float(self.health.strikes)
        if self.health.should_stop and step < total:
            folder = self._stop_after_this_step(metrics, "training/stopped_on_health")
            print(f"igpo: warning: stopping after step {step}/{total}: {self.health.strikes} consecutive steps with "
                  f"health warnings (trainer.health.stop_after={self.health.config.stop_after}); checkpoint {folder}. "
                  "Inspect the rollouts (trainer.rollout_data_dir) before resuming with trainer.resume_mode=auto.",
                  flush=True)

    # ---- progress, tool spend and budgets ----------------------------------------------------------------------

    def _progress_metrics(self, timing_raw: dict) -> dict[str, float]:
        """``progress/total_steps`` and ``progress/eta_s`` (mean wall time of this process's steps, validation
        included, times the steps left): the launcher prints ``step i/N ETA``."""
        self._step_seconds.append(float(timing_raw.get("step", 0.0)) + float(timing_raw.get("testing", 0.0)))
        left = max(0, int(self.total_training_steps) - int(self.global_steps))
        return {"progress/total_steps": float(self.total_training_steps),
                "progress/eta_s": left * float(np.mean(self._step_seconds))}

    def on_train_begin(self):
        super().on_train_begin()
        # The baseline of step 1's tools/* deltas: validation before training is not charged to step 1.
        url = self.igpo.agent.tool_server_url
        if url is not None:
            self._tool_stats = fetch_stats(url)
        # Where verl placed the agent-loop workers (round-robin over the nodes with CPUs): with several nodes, each
        # step logs the tool calls per node, so a node whose calls fail is named.
        self._loop_workers = list(getattr(self.agent_loop_manager, "agent_loop_workers", None) or [])
        nodes = self._tool_calls_by_node()
        self._loop_nodes = len(nodes or {})
        if nodes is not None:
            logger.warning("igpo: %d agent-loop workers on Ray nodes %s (%d distinct)", len(self._loop_workers),
                           json.dumps(sorted(nodes)), len(nodes))

    def _tool_calls_by_node(self) -> dict | None:
        """``igpo.integration.node_reach.tool_calls_by_node`` of this run's agent-loop workers; None (and a warning) when they
        cannot be asked: a report, never a reason to stop training."""
        if not self._loop_workers:
            return None
        try:
            return tool_calls_by_node(self._loop_workers)
        except (ray.exceptions.RayError, AttributeError) as error:
            logger.warning("igpo: could not ask the agent-loop workers for their tool calls (%s: %s)",
                           type(error).__name__, error)
            return None

    def _record_tool_spend(self, metrics: dict) -> None:
        """Log this step's ``tools/*`` metrics (``igpo.integration.tool_spend``); when a tool budget is spent, save a checkpoint
        and end the run after this step (``tools.stop_on_budget``) instead of training on refused tool calls."""
        url = self.igpo.agent.tool_server_url
        stats = fetch_stats(url) if url is not None else None
        if stats is None:
            return
        metrics.update(step_metrics(self._tool_stats, stats, self.tool_spend.price_per_1k))
        self._tool_stats = stats
        spent = spent_budgets(stats)
        if spent and self.tool_spend.stop_on_budget and self.global_steps < self.total_training_steps:
            self._stop_on_budget(spent, metrics)

    def _stop_after_this_step(self, metrics: dict, flag: str) -> str:
        """End the run cleanly after this step: a checkpoint of it (unless verl's save_freq saved it already), the
        metric ``flag`` = 1, and the loop's end moved here. Returns the checkpoint folder."""
        step = int(self.global_steps)
        save_freq = int(self.config.trainer.save_freq)
        if not (save_freq > 0 and step % save_freq == 0):  # verl saved this step already otherwise
            self._save_checkpoint()
        metrics[flag] = 1.0
        # verl's loop runs while global_steps <= total_training_steps: it ends after logging this step's metrics.
        self.total_training_steps = step
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{step}")

    def _stop_on_budget(self, spent: list[str], metrics: dict) -> None:
        step, total = int(self.global_steps), int(self.total_training_steps)
        folder = self._stop_after_this_step(metrics, "training/stopped_on_tool_budget")
        message = (f"igpo: tool budget spent ({'; '.join(spent)}): stopping cleanly after step {step}/{total}; "
                   f"checkpoint {folder}. To continue, restart the tool server with a larger --budget-* and rerun "
                   "with trainer.resume_mode=auto and the same trainer.default_local_dir (tools.stop_on_budget=false "
                   "trains on with the refused calls masked).")
        print(message, flush=True)  # into the training log, and the launcher shows it on the terminal

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, *args, **kwargs):
        """verl's per-data-source validation metrics, plus the mean over every validation sample (``val-core/all/f1``,
        ``val-core/all/score``): the one number the launcher prints before and after training."""
        metrics = super()._val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, sample_turns, *args,
                                              **kwargs)
        for key in ("f1", "score"):
            values = reward_extra_infos_dict.get(key)
            if values is not None and len(values):
                metrics[f"val-core/all/{key}"] = float(np.mean(np.asarray(values, dtype=np.float64)))
        return metrics

    @staticmethod
    def _rollout_metrics(extras: list[dict], num_turns: torch.Tensor) -> dict[str, float]:
        """Rollout health: infra errors (not the model's fault), forced finals, cut-offs, truncations, boundaries the
        rollout could not score (score_on=rollout) and trajectories the engine refused as too long."""
        def share(key: str) -> float:
            return float(np.mean([bool(e.get(key, False)) for e in extras])) if extras else 0.0

        def total(key: str) -> float:
            return float(sum(int(e.get(key, 0) or 0) for e in extras))

        return {
            **arpo_core.step_metrics(extras),  # arpo/* when the arpo_agent loop branched (nothing otherwise)
            "igpo/turns_mean": float(num_turns.float().mean()) if len(num_turns) else 0.0,
            # Tool calls (malformed and answer turns excluded) per trajectory: what ARPO claims to halve vs GRPO.
            "igpo/tool_calls_per_trajectory": float(np.mean([
                sum(name is not None for name in (e.get("igpo_tool_names") or [])) for e in extras]))
            if extras else 0.0,
            "igpo/infra_errors": total("igpo_infra_errors"),
            # every turn that called a tool (malformed and answer turns excluded): the infra breaker's denominator
            "igpo/tool_calls": float(sum(sum(name is not None for name in (e.get("igpo_tool_names") or []))
                                         for e in extras)),
            "igpo/scoring_errors": total("igpo_scoring_errors"),
            "igpo/forced_final_ratio": share("igpo_forced_final"),
            "igpo/cutoff_ratio": share("igpo_cutoff"),
            "igpo/truncated_ratio": share("igpo_truncated"),
            "igpo/context_overflow_ratio": share("igpo_context_overflow"),
            **turn_health(e.get("igpo_tool_status") for e in extras),
        }

    # ---- checkpointed state ------------------------------------------------------------------------------------

    def on_init_end(self):
        super().on_init_end()
        # Where verl placed the actor ranks (one Ray node id per rank): a multi-node run shows one rank per node.
        nodes = [r["node_id"] for r in sorted(self.actor_rollout_wg.igpo_worker_report(False), key=lambda r: r["rank"])]
        logger.warning("igpo: actor ranks on Ray nodes %s (%d distinct)", json.dumps(nodes), len(set(nodes)))

    def _checkpoint_report(self) -> dict:
        """What a resume must restore, in one line: global step, warm-up gate, curriculum position, dataloader
        position and a digest of each actor rank's weights."""
        data = self.train_dataloader.state_dict()
        w_outcome, w_ig = curriculum_weights(self.global_steps, self.total_training_steps, self.igpo.curriculum,
                                             ig_active=self.warmup.active)
        ranks = sorted(self.actor_rollout_wg.igpo_worker_report(True), key=lambda r: r["rank"])
        return {"global_step": self.global_steps, "warmup_gate": self.warmup.state_dict(),
                "curriculum": [w_outcome, w_ig],
                "dataloader": {"batches": data.get("_num_yielded"),
                               "samples": (data.get("_sampler_iter_state") or {}).get("samples_yielded")},
                "actor_digests": [r["digest"] for r in ranks]}

    def _save_checkpoint(self):
        # Our state goes into the step's folder BEFORE verl's save, which ends by pointing
        # latest_checkpointed_iteration.txt at that folder: a crash in between leaves the pointer on the previous
        # step (whose state file is complete) instead of a resumable step without one. Written to a temporary file
        # and renamed, so a reader never sees half a file.
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE)
        report = self._checkpoint_report()
        with open(path + ".tmp", "w") as handle:
            json.dump({"warmup_gate": self.warmup.state_dict(), "health": self.health.state(),
                       "infra_breaker": self.infra_breaker.state(), "saved": report}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(path + ".tmp", path)
        super()._save_checkpoint()
        logger.warning("igpo: checkpoint saved: %s", json.dumps(report, sort_keys=True))

    def _resume_folder(self) -> str:
        """The step folder verl's ``_load_checkpoint`` just resumed from (it set ``global_steps`` from its name):
        ``resume_from_path`` only in resume_mode=resume_path (auto ignores it), else the step under
        ``default_local_dir``; relative paths against the working directory, as verl resolves them."""
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if not self.global_steps:
            return
        folder = self._resume_folder()
        path = os.path.join(folder, STATE_FILE)
        if os.path.isfile(path):
            with open(path) as handle:
                state = json.load(handle)
            self.warmup.load_state_dict(state.get("warmup_gate", {}))
            self.health.load(state.get("health", {}))
            self.infra_breaker.load(state.get("infra_breaker", {}))
        else:
            logger.warning("igpo: no %s in %s; the IG warm-up gate restarts from scratch", STATE_FILE, folder)
        logger.warning("igpo: resumed from %s: %s", folder, json.dumps(self._checkpoint_report(), sort_keys=True))


from igpo import plugin as _plugin  # noqa: E402 - last: what the plugin put off while this module was half imported

_plugin.load_deferred(__name__)
