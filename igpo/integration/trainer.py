"""Trainer modes for verl's v1 trainer with turn-level methods, chosen by ``trainer.v1.trainer_mode``: ``igpo_sync``
(synchronous), ``igpo_colocate_async`` (asynchronous, rollout and training on the same devices, partial rollouts) and
``igpo_separate_async`` (asynchronous, a standalone rollout on devices of its own).

verl's registered estimators only see ``token_level_rewards``/``response_mask``/``uid``; a turn-level method needs
each trajectory's turn structure. ``TurnLevelTrainer`` replaces verl's ``_compute_advantage`` with one pipeline for
every method (``igpo.integration.methods``, chosen by ``algorithm.adv_estimator``), and each mode is that one class
over verl's trainer of the same schedule (``PPOTrainerSync``, ``PPOTrainerColocateAsync``,
``PPOTrainerSeparateAsync``): verl decides when prompts are dispatched, when generation pauses and when weights move;
the step itself is the same code:

    fetch the step's trajectories and their turn records (``igpo.agent.records``) from TransferQueue
    -> ARPO's check of the stored tree (``algorithm.arpo.enabled``)
    -> the infra-failure policy (``igpo.core.infra``: which rows and turns leave the signal and the loss)
    -> verl's rollout correction in its decoupled mode (``igpo.integration.rollout_correction``: importance
       weights and rejection from the rollout's and the actor's log-probabilities, by verl's function)
    -> ``method.advantage(batch, scorer)``: advantages, returns, metrics
    -> ARPO's attribution (``algorithm.arpo.attribution=hard``)
    -> advantages, returns (and the masks, when the policy masked or verl's correction rejected; the importance
       weights, when it weighted) written back

An estimator no method claims (``grpo``, ``rloo``, ...) is verl's own step on the outcome reward, as a method of the
same pipeline (``igpo.integration.methods.outcome``). Around the pipeline: deterministic prompt uids and batch order
(one seed, one run), the rollout failure guard, the run's early stops and reports (``run_control``), the checkpointed
state (``checkpoint``).

In the asynchronous mode a trajectory may span weight versions (its generation was paused for an update and resumed
on the new weights). Every answer probe and counterfactual the methods score is scored here, at the advantage, by
the actor's current weights: the weights that compute the step's ``old_log_probs`` and take its update. So the
information gain of every turn of a trajectory comes from one model, whatever versions generated its turns
(docs/guide/async.md).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
import types

import numpy as np
import ray
import torch
from tensordict import NonTensorStack, TensorDict

import transfer_queue as tq
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from igpo.agent.agent_config import arpo_config_from, plain_section
from igpo.agent.records import TurnRecord
from igpo.config import IGPOConfig, check_rollout_correction
from igpo.core.infra import InfraMask
from igpo.core.health import HealthConfig, HealthMonitor
from igpo.integration import histograms as hist
from igpo.integration import rollout_correction, rollout_failures, trajectory_log
from igpo.integration.actor_scoring import ActorScorer
from igpo.integration.checkpoint import CheckpointState
# The module, not its names: the plugin hook imports this trainer while the estimator module may still be half
# imported (when it is a process's first import); its functions are looked up at call time.
from igpo.integration import estimator as estimators
from igpo.integration.infra_breaker import InfraBreaker
from igpo.integration.methods import method_for
from igpo.integration.node_reach import require_reach_from_every_node
from igpo.integration.pipeline import StepOutput, TreeCheck, advantage_step, resolve_infra_policy
from igpo.integration.run_control import RunControl
from igpo.integration.tool_spend import ToolSpendConfig

logger = logging.getLogger(__name__)

BASE_FIELDS = ("uid", "response_mask", "rm_scores", "extra_fields")


def prompt_uid(step: int, number: int) -> str:
    """A prompt's uid: the step it was drawn for and its number in the run (no '_': verl splits keys on it)."""
    return f"s{int(step):07d}p{int(number):09d}"


def validation_uid(step: int, number: int) -> str:
    """A validation prompt's uid: the step it is validated at and its number in that validation (no '_')."""
    return f"v{int(step):07d}q{int(number):09d}"


@contextlib.contextmanager
def validation_uids(step: int):
    """While open, verl's trainer module draws ``validation_uid(step, 0)``, ``(step, 1)``, ... where it would draw
    uuid4s (its ``_validate`` names each validation prompt so): the agent loop seeds each request by its prompt's
    uid, so sampled validation (``val_kwargs.temperature`` > 0) repeats with the seed, and runs at one seed validate
    on the same samples. Only that module's name ``uuid`` is swapped, and only for the call."""
    numbers = itertools.count()
    drawn = types.SimpleNamespace(uuid4=lambda: validation_uid(step, next(numbers)))
    original = trainer_base.uuid
    trainer_base.uuid = drawn
    try:
        yield
    finally:
        trainer_base.uuid = original


def trajectory_order(key: str) -> tuple:
    """Sort key of a TransferQueue trajectory key ``{uid}_{session}_{index}``: uid, then session and index as numbers
    (so that session 10 follows 9); a key of another shape sorts by itself."""
    parts = str(key).rsplit("_", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return (parts[0], int(parts[1]), int(parts[2]))
    return (str(key), -1, -1)


def step_fields(out: StepOutput, padded_mask: torch.Tensor, nested_mask) -> dict:
    """What the advantage step writes back to TransferQueue for the actor's update, nested as ``nested_mask`` (the
    stored response mask): advantages and returns, the masks when the infra policy masked (``masked_response``), and
    the mask after rejection and the importance weights when verl's decoupled correction applied
    (``corrected_response``)."""
    fields = {"advantages": response_to_nested(out.advantages.float(), nested_mask),
              "returns": response_to_nested(out.returns.float(), nested_mask)}
    fields.update(masked_response(out.infra, padded_mask, nested_mask))
    fields.update(corrected_response(out.correction, padded_mask, nested_mask))
    return fields


def corrected_response(correction: rollout_correction.Correction | None, padded_mask: torch.Tensor,
                       nested_mask) -> dict:
    """What verl's decoupled correction writes back, as verl's ``_compute_advantage`` writes it: the mask after
    rejection as ``response_mask`` (the loss terms read it), the importance weights as ``rollout_is_weights`` (the
    policy loss multiplies its per-token terms by them). ``loss_mask``, the token-mean's denominator, keeps the
    rejected tokens, as in verl."""
    if correction is None:
        return {}
    fields = {"response_mask": response_to_nested(correction.response_mask.to(padded_mask.dtype), nested_mask)}
    if correction.rollout_is_weights is not None:
        fields["rollout_is_weights"] = response_to_nested(correction.rollout_is_weights.float(), nested_mask)
    return fields


def masked_response(infra: InfraMask, padded_mask: torch.Tensor, nested_mask) -> dict:
    """The masks to write back when the infra policy masked something: the actor's loss terms (policy gradient,
    entropy and KL alike) and verl's metrics read ``response_mask`` from TransferQueue, as after verl's
    rollout-correction rejection sampling; the engine's token count (the token-mean denominator) reads ``loss_mask``,
    which verl's agent loop stored as a copy of ``response_mask``: both change, so the kept tokens are weighted as if
    the masked ones had never been sampled. The nested layout (row lengths) is kept."""
    if not infra.changed:
        return {}
    mask = response_to_nested(infra.loss_mask.to(padded_mask.dtype), nested_mask)
    return {"response_mask": mask, "loss_mask": mask}


class TurnLevelTrainer(RunControl, CheckpointState):
    """The turn-level advantage pipeline and its run control, over any of verl's v1 trainers (the class after it in
    a mode's bases decides the schedule)."""

    histograms = hist.StepHistograms(enabled=False)  # trainer.histograms=true: __init__ gives the run its own

    def __init__(self, config):
        super().__init__(config)
        self.igpo = IGPOConfig.from_algorithm(config.algorithm)
        check_rollout_correction(config)
        # verl's decoupled correction, applied at our advantage step (None in bypass mode: the loss applies it)
        self.decoupled_correction = rollout_correction.decoupled_section(config.algorithm)
        estimator = str(config.algorithm.adv_estimator)
        estimators.check_estimator(estimator, config)
        if config.algorithm.get("use_kl_in_reward", False):
            raise ValueError("algorithm.use_kl_in_reward=true puts a reward on every token, which breaks IGPO's "
                             "turn rewards; use actor_rollout_ref.actor.use_kl_loss=true instead.")
        self.method = method_for(config)
        logger.warning("igpo_sync: advantage estimator %s (%s)", estimator, self.method.title)
        self.infra_failure = resolve_infra_policy(self.method, self.igpo.infra_failure, estimator)
        self.tool_spend = ToolSpendConfig.from_dict(plain_section(config.get("tools", None)))
        self.arpo = arpo_config_from(config)
        loop_name = str(config.actor_rollout_ref.rollout.agent.default_agent_loop)
        if self.arpo.enabled and loop_name != "arpo_agent":
            raise ValueError(f"algorithm.arpo.enabled=true with rollout.agent.default_agent_loop={loop_name}: branching "
                             "lives in the arpo_agent loop; set actor_rollout_ref.rollout.agent.default_agent_loop="
                             "arpo_agent (bash train_igpo.sh / python -m igpo.main do it for igpo_agent).")
        self._tool_stats: dict | None = None  # the tool server's /stats at the end of the previous step
        self._step_seconds: list[float] = []  # wall time of each step of this process (for the ETA)
        self._prompts_fetched = 0  # numbers the deterministic prompt uids (_fetch_one_gen_batch)
        self._scorer: ActorScorer | None = None
        self.health = HealthMonitor(HealthConfig.from_dict(plain_section(config.trainer.get("health", None))))
        self.infra_breaker = InfraBreaker(self.tool_spend.infra_breaker)
        self.histograms = hist.StepHistograms(hist.histograms_enabled(config.trainer))
        self.trajectory_dir = trajectory_log.trajectory_dir(config.trainer)
        if self.igpo.agent.tool_server_url is not None:
            # Before the workers load a model: a node whose agent-loop workers cannot reach the tool server would
            # have all its tool calls masked as infra failures (igpo.integration.node_reach).
            require_reach_from_every_node(self.igpo.agent.tool_server_url)

    def _build_replay_buffer(self):
        """verl's replay buffer, stopping the run when the rollout cannot deliver (igpo.integration.rollout_failures):
        at once when the rollout engine died, or past one step's worth of failed sessions."""
        per_step = int(self.config.data.train_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
        return rollout_failures.guard(super()._build_replay_buffer(), limit=per_step)

    def _init_resource_pool_mgr(self):
        """verl's worker layout, with the actor role served by our subclass (it adds the scoring methods)."""
        # Imported here, not at module level: importing the worker module imports verl, whose plugin loading imports
        # this module; a module-level import would make that a cycle in any process that imports the worker first.
        from igpo.integration.actor_worker import IGPOActorRolloutRefWorker

        super()._init_resource_pool_mgr()
        for role, worker_cls in list(self.role_worker_mapping.items()):
            if role.name.startswith("Actor"):
                self.role_worker_mapping[role] = ray.remote(IGPOActorRolloutRefWorker)

    # ---- one seed, one run -----------------------------------------------------------------------------------------

    def _fetch_one_gen_batch(self):
        """verl's batch with uids that depend only on the step and the prompt's place in it (verl draws uuid4s):
        the agent loop's per-request sampling seeds and the batch order below are keyed by them."""
        batch = super()._fetch_one_gen_batch()
        start, self._prompts_fetched = self._prompts_fetched, self._prompts_fetched + len(batch)
        batch["uid"] = NonTensorStack(*[prompt_uid(self.global_steps, start + i) for i in range(len(batch))])
        return batch

    def _validate(self):
        with validation_uids(self.global_steps):
            return super()._validate()

    def _balance_batch(self, batch, metrics, *args, **kwargs):
        """verl's balancing from a fixed starting order: TransferQueue returns trajectories in the order they
        finished, which varies run to run and would change mini-batches, micro-batches and their sums."""
        batch.reorder(sorted(range(len(batch.keys)), key=lambda i: trajectory_order(batch.keys[i])))
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    # ---- the advantage pipeline ----------------------------------------------------------------------------------

    def _compute_advantage(self, batch, metrics: dict):
        method = self.method
        started = time.perf_counter()
        tree_fields = ("responses",) if self.arpo.enabled else ()
        log_fields = ("prompts", "responses") if self.trajectory_dir is not None else ()
        correction_fields = rollout_correction.LOG_PROB_FIELDS if self.decoupled_correction is not None else ()
        select = dict.fromkeys([*BASE_FIELDS, *method.fields, *method.response_fields, *tree_fields, *log_fields,
                                *correction_fields])
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(select))
        records = [TurnRecord.from_extra_fields(e) for e in data.pop("extra_fields").tolist()]
        uids = data.pop("uid").tolist()
        tree = None
        if self.arpo.enabled:
            responses = data.select("responses").to_padded_tensor()["responses"]
            tree = TreeCheck(responses, self.arpo.rollouts_per_prompt)
        # The trajectory log and the method may want the same fields (prompts, responses with actor-side scoring):
        # each is taken out of the batch once.
        taken = {name: _per_row(data.pop(name)) for name in dict.fromkeys([*log_fields, *method.fields])}
        ids = {name: taken[name] for name in log_fields}
        rows = {name: taken[name] for name in method.fields}
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()
        # A response field TransferQueue does not hold (verl's critic values without a critic) is left out.
        response = {n: padded[n].float() for n in dict.fromkeys([*method.response_fields, *correction_fields])
                    if n in padded.keys()}
        steps_per_epoch = int(getattr(self, "steps_per_epoch", 0) or 0)
        out = advantage_step(
            method, records, uids, padded["response_mask"], padded["rm_scores"], infra_failure=self.infra_failure,
            scorer=self._actor_scorer(), fields={**rows, **response}, keys=list(batch.keys),
            step=int(self.global_steps), total_steps=int(self.total_training_steps),
            epoch=self.global_steps // steps_per_epoch if steps_per_epoch else 0, tree_check=tree,
            arpo_hard=self._arpo_hard, histograms=self.histograms, rollout_correction=self.decoupled_correction)
        metrics.update(out.metrics)
        metrics[f"timing_s/{method.name}_advantage"] = time.perf_counter() - started
        if self.trajectory_dir is not None:
            applied = trajectory_log.Applied(out.advantages, out.loss_mask, out.turns.num_turns, out.terms)
            trajectory_log.write_step(self.trajectory_dir, int(self.global_steps), uids, ids["prompts"],
                                      ids["responses"], padded["response_mask"], padded["rm_scores"], records, applied)
        fields = step_fields(out, padded["response_mask"], nested_mask)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                               fields=TensorDict(fields, batch_size=len(batch)))

    def _actor_scorer(self) -> ActorScorer:
        if self._scorer is None:
            self._scorer = ActorScorer(self.actor_rollout_wg, self.tokenizer, self.config)
        return self._scorer

    @property
    def _arpo_hard(self) -> bool:
        return self.arpo.enabled and self.arpo.attribution == "hard"

    # ---- metrics and reports ---------------------------------------------------------------------------------------

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        # verl logs how many weight versions trajectories spanned (training/off_policy/trajectory_spans/*); the share
        # that spanned more than one is how many were paused for an update and resumed on new weights.
        spans = [int(tag["max_global_steps"]) - int(tag["min_global_steps"]) for tag in batch.tags
                 if not tag.get("is_padding", False) and tag.get("min_global_steps") is not None
                 and tag.get("max_global_steps") is not None]
        if spans:
            metrics["igpo/partial_trajectory_share"] = float(np.mean([span > 0 for span in spans]))
        # The step's wall time is known only now; actor-side scoring is IGPO's main extra cost, so report its share.
        if "timing_s/igpo_scoring" in metrics and timing_raw.get("step"):
            metrics["igpo/scoring_step_share"] = metrics["timing_s/igpo_scoring"] / timing_raw["step"]
        self._after_step(metrics, timing_raw)
        if self.histograms.enabled:  # igpo/hist/* into verl's TensorBoard event file, at its step
            self.histograms.write(self.logger.logger["tensorboard"].writer, int(self.global_steps))

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, *args, **kwargs):
        """verl's per-data-source validation metrics, plus the mean over every validation sample (``val-core/all/f1``,
        ``val-core/all/score``, and ``val-core/all/em`` where the reward reports it): the one number the launcher
        prints before and after training; with ``val_kwargs.n`` samples per question it is the avg@n."""
        metrics = super()._val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, sample_turns, *args,
                                              **kwargs)
        for key in ("f1", "score", "em"):
            values = reward_extra_infos_dict.get(key)
            if values is not None and len(values):
                metrics[f"val-core/all/{key}"] = float(np.mean(np.asarray(values, dtype=np.float64)))
        return metrics

    def on_train_begin(self):
        super().on_train_begin()
        self._start_reports()

    def on_init_end(self):
        super().on_init_end()
        # Where verl placed the actor ranks (one Ray node id per rank): a multi-node run shows one rank per node.
        nodes = [r["node_id"] for r in sorted(self.actor_rollout_wg.igpo_worker_report(False), key=lambda r: r["rank"])]
        logger.warning("igpo: actor ranks on Ray nodes %s (%d distinct)", json.dumps(nodes), len(set(nodes)))


@register_trainer("igpo_sync")
class IGPOTrainerSync(TurnLevelTrainer, PPOTrainerSync):
    """verl's synchronous v1 trainer with turn-level methods (IGPO, InfoPO, ...) in one advantage pipeline."""


@register_trainer("igpo_colocate_async")
class IGPOTrainerColocateAsync(TurnLevelTrainer, PPOTrainerColocateAsync):
    """verl's asynchronous colocated v1 trainer (warm-up batches in flight, generation paused for each update and
    resumed on the new weights) with the same pipeline: ``trainer.v1.trainer_mode=igpo_colocate_async``, configured by
    verl's own ``trainer.v1.colocate_async`` section."""


@register_trainer("igpo_separate_async")
class IGPOTrainerSeparateAsync(TurnLevelTrainer, PPOTrainerSeparateAsync):
    """verl's asynchronous v1 trainer with a standalone rollout (its own devices, generating while the trainer
    trains; the weights move through a checkpoint engine after each update, and generation in flight is paused and
    resumed on them) with the same pipeline: ``trainer.v1.trainer_mode=igpo_separate_async``, configured by verl's own
    ``trainer.v1.separate_async`` section. On the CPU the launch plan gives the rollout a pool of its own and the
    ``ray_object_store`` checkpoint engine (igpo/cpu/checkpoint_engine.py)."""

    def _init_resource_pool_mgr(self):
        """verl's layout, with the actor roles served by a class that has both our scoring methods and the weight
        save/restore verl's separate mode needs (``IGPODetachActorWorker``)."""
        # Imported here for the reason TurnLevelTrainer._init_resource_pool_mgr gives (an import cycle through verl).
        from igpo.integration.separate_worker import IGPODetachActorWorker

        super()._init_resource_pool_mgr()
        for role in list(self.role_worker_mapping):
            if role.name.startswith("Actor"):
                self.role_worker_mapping[role] = ray.remote(IGPODetachActorWorker)


def _per_row(value):
    """A fetched field as one entry per row: a tensor per row (nested or padded), or the stored objects."""
    return value.unbind() if isinstance(value, torch.Tensor) else value.tolist()
