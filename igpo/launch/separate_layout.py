"""The layout of verl's ``separate_async`` schedule (our ``igpo_separate_async``), planned before Ray starts.

``plan_separate_async`` (called by ``igpo.launch.launch_plan.plan_launch``) lays out the trainer's pool, the
standalone rollout's pool, the checkpoint engine between them and the weight-sync step, or refuses what verl would
only reject inside Ray, or never. What verl 0.9.1 does with these keys (``PPOTrainerSeparateAsync`` and the rollout
replicas it starts):

- its constructor asserts ``rollout.nnodes > 0``, ``rollout.n_gpus_per_node > 0``, a checkpoint engine other than
  ``naive`` (which reaches only a rollout on the trainer's own GPUs) and ``data.train_batch_size ==
  separate_async.parameter_sync_step x actor.ppo_mini_batch_size``;
- the trainer's pool comes first: ``trainer.nnodes`` Ray placement groups of ``trainer.n_gpus_per_node`` GPUs, each
  packed onto one node (the FSDP actor and reference, and the rollout replicas colocated with them);
- the standalone rollout follows: ``(rollout.nnodes x rollout.n_gpus_per_node) // w`` replicas of ``w = tensor x
  data x pipeline parallel`` GPUs, each a pool of its own whose placement groups hold ``min(w,
  rollout.n_gpus_per_node)`` GPUs on one node. GPUs past the last whole replica stay idle, none at all start when
  ``w`` exceeds the pool, and a replica wider than a node must span whole nodes;
- verl compares only the cluster's total of GPUs with the pools'. A placement group that no node has room for waits
  for one forever, and Ray may put any group on any node with room. So the plan counts whole nodes: the trainer's
  groups occupy at most ``trainer.nnodes`` nodes, which leaves ``rollout.nnodes`` untouched nodes for the rollout's
  groups whatever Ray chose. The two pools share a node only on a one-node cluster, where there is no other choice.

The cluster is what the launcher knows before Ray starts (``Cluster``); the trainer's ``trainer.nnodes x
trainer.n_gpus_per_node`` are the trainer pool's only, which in this schedule is a part of the cluster.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import OmegaConf, open_dict

from igpo.config import ConfigError

# verl's separate_async schedule and ours over it. On the CPU the rollout pool is fake "GPU"s like the trainer's, and
# the weights move through Ray's object store (igpo/cpu/checkpoint_engine.py) since verl's engines (nccl, nixl,
# mooncake, ...) need GPUs.
SEPARATE_ASYNC_MODES = ("separate_async", "igpo_separate_async")
CPU_CHECKPOINT_ENGINE = "ray_object_store"
CPU_CHECKPOINT_MODULE = "igpo.cpu.checkpoint_engine"
# Set by train_igpo.sh to NNODES x the GPUs per node it counted (or IGPO_GPUS): the machines, not a knob.
CLUSTER_ENV = "IGPO_CLUSTER"
ROLLOUT = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class Cluster:
    """The machines a launch runs on: ``nodes`` nodes of ``gpus_per_node`` GPUs each."""

    nodes: int
    gpus_per_node: int

    def __str__(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s)"

    @staticmethod
    def from_environ(environ: Mapping[str, str]) -> "Cluster | None":
        """The cluster ``train_igpo.sh`` passes as ``IGPO_CLUSTER=<nodes>x<gpus per node>``; None without it (``python
        -m igpo.main`` run directly: nothing before Ray knows the other nodes)."""
        value = environ.get(CLUSTER_ENV)
        if not value:
            return None
        match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", value.strip())
        if match is None:
            raise ConfigError(f"{CLUSTER_ENV}={value!r} must read <nodes>x<GPUs per node>, e.g. 2x8 (train_igpo.sh "
                              "sets it from NNODES and the GPUs it counts; unset it to plan without a cluster).")
        return Cluster(int(match.group(1)), int(match.group(2)))


def plan_separate_async(config: Any, cluster: Cluster | None, on_cpu: bool, prompts: int, mini: int,
                        turn_level: bool) -> list[str]:
    """Lay out ``separate_async`` in ``config`` (OmegaConf, modified in place) or raise ``ConfigError``. ``prompts``
    and ``mini``: ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` (``mini`` divides ``prompts``);
    ``turn_level``: the estimator scores turns at the advantage. Returns notes.

    Both backends set the sync step that makes the batch sizes agree. On the CPU the rest is planned too: one node of
    the rollout pool, the ``ray_object_store`` engine and Ray's fake "GPU" count covering both pools. On GPUs a
    rollout pool not given is planned on a cluster of two nodes or more (``_split_nodes``), and the pools are checked
    against the cluster (``_check_pools``) and the rollout's replicas against its pool (``_check_replicas``)."""
    notes = _plan_cpu(config, prompts, mini) if on_cpu else _plan_gpus(config, cluster, prompts, mini)
    sync_step = int(config.trainer.v1.separate_async.parameter_sync_step)
    return notes + (_scoring_within_a_sync(sync_step) if turn_level else [])


def _plan_gpus(config: Any, cluster: Cluster | None, prompts: int, mini: int) -> list[str]:
    """On GPUs: the rollout's pool (planned, or checked against the cluster), a GPU engine, the sync step."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    notes, missing = [], []
    if int(rollout.nnodes) < 1:
        # Nothing before Ray knows the other nodes of a direct launch: trainer.nnodes x n_gpus_per_node stand for them.
        whole = cluster or Cluster(int(trainer.nnodes), int(trainer.n_gpus_per_node))
        if whole.nodes < 2:
            missing.append(_one_node_fix(whole))
        else:
            notes.append(_split_nodes(config, whole))
    elif int(rollout.n_gpus_per_node) < 1:
        missing.append(f"{ROLLOUT}.n_gpus_per_node=<GPUs> (it is {rollout.n_gpus_per_node}; verl asserts >= 1)")
    if str(rollout.checkpoint_engine.backend) == "naive":
        missing.append(f"{ROLLOUT}.checkpoint_engine.backend=nccl (or nixl, mooncake: the naive engine only reaches a "
                       "rollout on the trainer's own GPUs)")
    if missing:
        raise ConfigError("trainer.v1.separate_async generates on a rollout with GPUs of its own and moves the weights "
                          "to it through a checkpoint engine; set " + "; ".join(missing) + ".")
    notes.extend(_sync_step(config, prompts, mini))
    if cluster is None:
        notes.append(f"separate_async: the cluster's size is not known here (train_igpo.sh passes NNODES and the GPUs "
                     f"per node): the trainer's and the rollout's pools need trainer.nnodes + {ROLLOUT}.nnodes = "
                     f"{int(trainer.nnodes) + int(rollout.nnodes)} nodes of their own")
    else:
        _check_pools(config, cluster)
    replicas = _check_replicas(rollout)
    notes.insert(0, f"separate_async layout: trainer (FSDP actor/ref) on {int(trainer.nnodes)} node(s) x "
                    f"{int(trainer.n_gpus_per_node)} GPU(s); standalone {rollout.name} rollout on "
                    f"{int(rollout.nnodes)} node(s) x {int(rollout.n_gpus_per_node)} GPU(s) ({replicas}); weights "
                    f"through the {rollout.checkpoint_engine.backend} checkpoint engine after every "
                    f"{int(trainer.v1.separate_async.parameter_sync_step)} update(s) (parameter_sync_step)"
                    + (f"; cluster {cluster}" if cluster else ""))
    return notes


def _one_node_fix(cluster: Cluster) -> str:
    """The overrides to name when the rollout has no pool and the cluster is a single node."""
    if cluster.gpus_per_node < 2:
        share = "one GPU cannot hold two pools: trainer.v1.trainer_mode=igpo_colocate_async shares it"
    else:
        half = cluster.gpus_per_node // 2
        share = (f"on one node of {cluster.gpus_per_node} split it, e.g. trainer.n_gpus_per_node="
                 f"{cluster.gpus_per_node - half} {ROLLOUT}.nnodes=1 {ROLLOUT}.n_gpus_per_node={half}; with "
                 "NNODES >= 2 the plan gives the rollout a node of its own")
    return (f"{ROLLOUT}.nnodes=<nodes> {ROLLOUT}.n_gpus_per_node=<GPUs> (the standalone rollout's own GPUs, beside "
            f"trainer.nnodes x trainer.n_gpus_per_node; cluster {cluster}: {share})")


def _split_nodes(config: Any, cluster: Cluster) -> str:
    """No rollout pool given on two nodes or more: the rollout gets one whole node, the trainer the others."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    was = int(trainer.nnodes)
    with open_dict(config):
        rollout.nnodes = 1
        if OmegaConf.is_interpolation(rollout, "n_gpus_per_node"):  # verl's default, the trainer's: not the user's
            rollout.n_gpus_per_node = cluster.gpus_per_node
        trainer.nnodes = min(was, cluster.nodes - 1)
    return (f"separate_async: the standalone rollout planned onto a node of its own ({ROLLOUT}.nnodes=1 "
            f"{ROLLOUT}.n_gpus_per_node={rollout.n_gpus_per_node}), the trainer onto trainer.nnodes={trainer.nnodes}"
            + (f" (was {was})" if trainer.nnodes != was else "")
            + f" of the cluster's {cluster.nodes} nodes; set trainer.nnodes and {ROLLOUT}.nnodes to split them "
            "otherwise")


def _sync_step(config: Any, prompts: int, mini: int) -> list[str]:
    """verl needs ``train_batch_size = parameter_sync_step x ppo_mini_batch_size``: set the step that makes it hold."""
    section = config.trainer.v1.separate_async
    sync_step, needed = int(section.parameter_sync_step), prompts // mini
    if sync_step == needed:
        return []
    with open_dict(config):
        section.parameter_sync_step = needed
    return [f"separate_async: parameter_sync_step={needed} (was {sync_step}): verl needs data.train_batch_size="
            f"{prompts} = parameter_sync_step x actor.ppo_mini_batch_size={mini}"]


def _check_pools(config: Any, cluster: Cluster) -> None:
    """The trainer's and the rollout's pools fit the cluster: each pool's GPUs per node within a node's, on separate
    nodes (on a one-node cluster: its GPUs shared, the sum within the node's)."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    nodes = {"trainer.nnodes": int(trainer.nnodes), f"{ROLLOUT}.nnodes": int(rollout.nnodes)}
    gpus = {"trainer.n_gpus_per_node": int(trainer.n_gpus_per_node),
            f"{ROLLOUT}.n_gpus_per_node": int(rollout.n_gpus_per_node)}
    for key, value in gpus.items():
        if value > cluster.gpus_per_node:
            raise ConfigError(f"{key}={value} > the {cluster.gpus_per_node} GPUs of a node (cluster {cluster}): a "
                              f"pool's GPUs per node are placed on one node; set {key}={cluster.gpus_per_node} or "
                              "fewer.")
    stated = " + ".join(f"{key}={value}" for key, value in nodes.items())
    if cluster.nodes == 1:
        if max(nodes.values()) > 1:
            raise ConfigError(f"{stated}: the cluster is one node ({cluster}); set both to 1, or NNODES to the nodes "
                              "of the Ray cluster.")
        if sum(gpus.values()) > cluster.gpus_per_node:
            half = cluster.gpus_per_node // 2
            raise ConfigError(f"{' + '.join(f'{k}={v}' for k, v in gpus.items())} = {sum(gpus.values())} GPUs > the "
                              f"{cluster.gpus_per_node} of the one node ({cluster}), which both pools share; split it, "
                              f"e.g. trainer.n_gpus_per_node={cluster.gpus_per_node - half} "
                              f"{ROLLOUT}.n_gpus_per_node={half}.")
    elif sum(nodes.values()) > cluster.nodes:
        raise ConfigError(f"{stated} = {sum(nodes.values())} nodes > the cluster's {cluster.nodes} ({cluster}): the "
                          "trainer and the standalone rollout need nodes of their own (Ray may place a pool's per-node "
                          "groups on any node with room, so only separate nodes are sure to hold both). Split them, "
                          f"e.g. trainer.nnodes={cluster.nodes - 1} {ROLLOUT}.nnodes=1 for {cluster.nodes} nodes.")


def _check_replicas(rollout: Any) -> str:
    """Every GPU of the rollout's pool serves a vLLM replica of ``w = tensor x data x pipeline parallel`` GPUs: ``w``
    divides a node's GPUs of the pool, or spans whole nodes of it. Returns the replicas in words."""
    degrees = {key: int(rollout.get(key, 1) or 1) for key in ("tensor_model_parallel_size", "data_parallel_size",
                                                               "pipeline_model_parallel_size")}
    width = math.prod(degrees.values())
    per_node, nodes = int(rollout.n_gpus_per_node), int(rollout.nnodes)
    valid = [d for d in range(1, per_node + 1) if per_node % d == 0]
    valid += [per_node * k for k in range(2, nodes + 1) if nodes % k == 0]
    if width not in valid:
        stated = " x ".join(f"{ROLLOUT}.{key}={value}" for key, value in degrees.items()
                            if value != 1 or key == "tensor_model_parallel_size")
        if width <= per_node:
            why = (f"each replica sits on one node, whose {per_node} GPUs hold {per_node // width} of them and leave "
                   f"{per_node % width} idle")
        elif width > nodes * per_node:
            why = "verl would start no replica at all"
        else:
            why = "a replica wider than a node spans whole nodes of the pool"
        raise ConfigError(f"{stated} = {width} GPUs per vLLM replica does not divide the standalone rollout's "
                          f"{nodes} node(s) x {per_node} GPU(s) ({why}); use a tensor x data x pipeline parallel "
                          f"product of {valid}.")
    return f"{nodes * per_node // width} replica(s) of tensor parallel {degrees['tensor_model_parallel_size']}"


def _plan_cpu(config: Any, prompts: int, mini: int) -> list[str]:
    """On the CPU: a rollout pool of one fake "GPU", the ``ray_object_store`` engine, the sync step and the fake
    "GPU"s of Ray's local cluster covering both pools."""
    rollout = config.actor_rollout_ref.rollout
    engine = rollout.checkpoint_engine
    backend = str(engine.backend)
    if backend not in ("naive", CPU_CHECKPOINT_ENGINE):
        raise ConfigError(f"{ROLLOUT}.checkpoint_engine.backend={backend} needs GPUs; on the CPU use "
                          f"{CPU_CHECKPOINT_ENGINE} (the plan's default for separate_async).")
    notes = _sync_step(config, prompts, mini)
    with open_dict(config):
        if int(rollout.nnodes) < 1:
            rollout.nnodes = 1
        if int(rollout.n_gpus_per_node) < 1:
            rollout.n_gpus_per_node = 1
        engine.backend = CPU_CHECKPOINT_ENGINE
        engine.custom_backend_module = CPU_CHECKPOINT_MODULE  # verl imports it where it builds an engine
        rollout_devices = int(rollout.nnodes) * int(rollout.n_gpus_per_node)
        devices = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node) + rollout_devices
        ray_init = (config.get("ray_kwargs") or {}).get("ray_init")
        if ray_init is not None and ray_init.get("num_gpus") is not None:
            # The fake "GPU"s of the CPU backend: the trainer's pool and the rollout's each take theirs.
            ray_init.num_gpus = max(int(ray_init.num_gpus), devices)
        else:
            notes.append(f"separate_async: the Ray cluster must offer {devices} \"GPU\" resources (the trainer's and "
                         f"the rollout's {rollout_devices}); on the CPU start each node with 'ray start --num-gpus=N'")
    notes.insert(0, f"separate_async on the CPU: a standalone {rollout.name} rollout on {rollout_devices} CPU "
                    f"\"GPU\" of its own, weights through Ray's object store ({CPU_CHECKPOINT_ENGINE}) after every "
                    f"{int(config.trainer.v1.separate_async.parameter_sync_step)} update(s)")
    return notes


def _scoring_within_a_sync(sync_step: int) -> list[str]:
    """With several updates per weight sync verl computes every mini-batch's old log-probs with the sync's weights
    (restored from a copy), but our pipeline scores answer probes and counterfactuals at the advantage, with the
    weights the mini-batch is about to train: the k-th mini-batch's turn signal comes from weights k updates on."""
    if sync_step <= 1:
        return []
    return [f"separate_async: parameter_sync_step={sync_step}: the turn-level signal of the k-th mini-batch of a "
            f"weight sync is scored by the weights after its k earlier updates (verl's old log-probs use the sync's "
            f"weights); parameter_sync_step=1 (train_batch_size = ppo_mini_batch_size) scores all with one model"]
