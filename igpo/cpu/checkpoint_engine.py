"""A checkpoint engine without NCCL: the trainer's weights reach standalone rollout workers through Ray's object store.

verl's ``separate_async`` trainer moves weights from the actor workers to a rollout running on its own resource pool
with a checkpoint engine (``CheckpointEngineManager.update_weights``); its engines (NCCL, NIXL, Mooncake, ...) need
GPUs. This one needs only Ray, so the CPU backend can run that schedule. Registered with verl's own registry as
``actor_rollout_ref.rollout.checkpoint_engine.backend=ray_object_store``; verl imports this module in every process
that builds an engine when ``checkpoint_engine.custom_backend_module=igpo.cpu.checkpoint_engine`` (the launch plan
sets both on the CPU).

One weight sync, in verl's order of calls:

    prepare             the master (actor rank 0) starts its ``WeightMailbox`` actor once and empties it; its
                        metadata is the mailbox's name, the other ranks' is empty
    build_topology      (trainer process) hands that name to every actor rank and rollout worker
    init_process_group  each side looks the mailbox up by name
    send_weights        every actor rank drains the weight generator (FSDP gathers each tensor collectively); the
                        master packs the tensors into buckets of ``bucket_size`` bytes, puts each in the object
                        store and posts its reference, tagged with the weight version (``global_steps``)
    receive_weights     each rollout worker reads the posted buckets in order until the master closes the version,
                        refusing a bucket of another version than the one it was asked to load; the close carries
                        the sender's fingerprint of the version (per tensor, the float64 sum and sum of squares,
                        added up in order) and Ray node, and the receiver, having computed the same over what it
                        read, refuses a version whose fingerprint differs and logs where it loaded which version
    finalize            the master empties the mailbox, which frees the buckets in the object store

Every receiver reads every bucket, so any number of replicas load the same version. A sender that fails closes the
version with its error, and the receivers raise it instead of waiting for buckets that never come.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, Generator

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND = "ray_object_store"
MAILBOX_NAME = "igpo_weight_mailbox_{owner}"

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The sender of a weight version failed, or a receiver got buckets of another version than it was asked for,
    or tensors whose fingerprint differs from the sender's."""


class Fingerprint:
    """Order-dependent float64 sums over a version's tensors: the same tensors in the same order give the same
    figure on every node, bit for bit, so a receiver can tell that it loaded what the sender sent."""

    def __init__(self) -> None:
        self.tensors = 0
        self.total = 0.0

    def add(self, tensor: torch.Tensor) -> None:
        values = tensor.detach().to("cpu", torch.float64)
        self.total += float(values.sum()) + float((values * values).sum())
        self.tensors += 1


@ray.remote(num_cpus=0)
class WeightMailbox:
    """The buckets of the weight version being sent, as object references, in the order they were posted.

    The references are held inside a list so that Ray hands them on as references instead of resolving them.
    """

    def __init__(self) -> None:
        self._buckets: list[tuple[int | None, list[ray.ObjectRef]]] = []
        self._closed = False
        self._error: str | None = None
        self._summary: dict[str, Any] | None = None
        self._changed = asyncio.Condition()

    async def clear(self) -> None:
        async with self._changed:
            self._buckets, self._closed, self._error, self._summary = [], False, None, None
            self._changed.notify_all()

    async def post(self, version: int | None, bucket: list[ray.ObjectRef]) -> None:
        async with self._changed:
            self._buckets.append((version, bucket))
            self._changed.notify_all()

    async def close(self, error: str | None = None, summary: dict[str, Any] | None = None) -> None:
        """End the version: with the sender's ``error``, or complete with its ``summary`` (fingerprint, tensors,
        node)."""
        async with self._changed:
            self._closed, self._error, self._summary = True, error, summary
            self._changed.notify_all()

    async def read(self, index: int) -> tuple[int | None, list[ray.ObjectRef] | None, str | None,
                                             dict[str, Any] | None]:
        """Bucket ``index`` as (version, [reference], None, None), waiting until it is posted; (None, None, error,
        summary) once the version is closed with fewer buckets (``error`` is None after a complete send, and
        ``summary`` the sender's)."""
        async with self._changed:
            await self._changed.wait_for(lambda: index < len(self._buckets) or self._closed)
            if index < len(self._buckets):
                version, bucket = self._buckets[index]
                return version, bucket, None, None
            return None, None, self._error, self._summary


@CheckpointEngineRegistry.register(BACKEND)
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine contract over Ray's object store (module docstring).

    Args:
        bucket_size: bytes per posted bucket (``checkpoint_engine.update_weights_bucket_megabytes``); a tensor larger
            than that is posted alone.
        is_master: this is actor rank 0, the one that sends (verl passes it to the actor ranks only).
    """

    def __init__(self, bucket_size: int, is_master: bool = False) -> None:
        if bucket_size <= 0:
            raise ValueError(f"checkpoint_engine.update_weights_bucket_megabytes gives bucket_size={bucket_size} "
                             "bytes; set it to a positive number of megabytes.")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self._mailbox: ray.actor.ActorHandle | None = None  # the one this sync uses (init_process_group)
        self._own_mailbox: ray.actor.ActorHandle | None = None  # the master's, started once
        self._own_name: str | None = None

    # ---- topology ------------------------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        if self._own_mailbox is None:
            # Owned by this actor process: the mailbox lives as long as the trainer's rank 0 does.
            name = MAILBOX_NAME.format(owner=ray.get_runtime_context().get_actor_id())
            self._own_mailbox = WeightMailbox.options(name=name).remote()
            self._own_name = name
        ray.get(self._own_mailbox.clear.remote())
        return {"mailbox": self._own_name}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        names = [entry["mailbox"] for entry in metadata if entry.get("mailbox")]
        if len(names) != 1:
            raise WeightSyncError(f"{BACKEND}: expected exactly one sender (actor rank 0) to offer a mailbox, got "
                                  f"{len(names)} of {len(metadata)} workers; the actor ranks must be built with "
                                  "is_master=(rank == 0), as verl's actor worker does.")
        return {"mailbox": [names[0]] * actor_wg_world_size}, {"mailbox": [names[0]] * rollout_world_size}

    def init_process_group(self, mailbox: str) -> None:
        self._mailbox = ray.get_actor(mailbox)

    def finalize(self) -> None:
        if self.is_master and self._own_mailbox is not None:
            ray.get(self._own_mailbox.clear.remote())  # drops the references: the object store frees the buckets
        self._mailbox = None

    # ---- transfer ------------------------------------------------------------------------------------------------

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict:
        if not self.is_master:
            # The other ranks take part in each tensor's gather but send nothing.
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        mailbox = self._require_mailbox("send_weights")
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        tensors = buckets = total = 0
        fingerprint = Fingerprint()
        try:
            async for name, tensor in ensure_async_iterator(weights):
                tensor = tensor.detach().to("cpu").contiguous()
                fingerprint.add(tensor)
                if bucket and size + tensor.nbytes > self.bucket_size:
                    await mailbox.post.remote(global_steps, [ray.put(bucket)])
                    buckets += 1
                    bucket, size = {}, 0
                bucket[name] = tensor
                size += tensor.nbytes
                total += tensor.nbytes
                tensors += 1
            if bucket:
                await mailbox.post.remote(global_steps, [ray.put(bucket)])
                buckets += 1
        except BaseException as error:
            await mailbox.close.remote(f"the sender (actor rank 0) failed after {tensors} tensors: "
                                       f"{type(error).__name__}: {error}")
            raise
        await mailbox.close.remote(summary={"fingerprint": fingerprint.total, "tensors": fingerprint.tensors,
                                            "node": ray.get_runtime_context().get_node_id()})
        return {"weight_sync/tensors": float(tensors), "weight_sync/buckets": float(buckets),
                "weight_sync/megabytes": total / 2**20}

    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        mailbox = self._require_mailbox("receive_weights")
        index = 0
        fingerprint = Fingerprint()
        while True:
            version, bucket, error, summary = await mailbox.read.remote(index)
            if bucket is None:
                if error is not None:
                    raise WeightSyncError(f"{BACKEND}: weight version {global_steps} was not delivered: {error}")
                _check_fingerprint(global_steps, fingerprint, summary)
                return
            if version != global_steps:
                raise WeightSyncError(f"{BACKEND}: asked to load weight version {global_steps}, but bucket {index} "
                                      f"is of version {version}; the trainer and the rollout disagree on the step.")
            for name, tensor in (await bucket[0]).items():
                fingerprint.add(tensor)
                yield name, tensor
            index += 1

    def _require_mailbox(self, call: str) -> ray.actor.ActorHandle:
        if self._mailbox is None:
            raise WeightSyncError(f"{BACKEND}: {call} before init_process_group; verl's CheckpointEngineManager "
                                  "calls prepare, build_topology and init_process_group first.")
        return self._mailbox


def _check_fingerprint(version: int | None, received: Fingerprint, summary: dict[str, Any] | None) -> None:
    """Refuse a version whose tensors are not the sender's; log where it was loaded and from which node."""
    if summary is None:
        raise WeightSyncError(f"{BACKEND}: weight version {version} was closed without the sender's fingerprint.")
    if (received.tensors, received.total) != (summary["tensors"], summary["fingerprint"]):
        raise WeightSyncError(f"{BACKEND}: weight version {version}: received {received.tensors} tensors with "
                              f"fingerprint {received.total!r}, the sender sent {summary['tensors']} with "
                              f"{summary['fingerprint']!r}; the weights changed on the way.")
    node = ray.get_runtime_context().get_node_id()
    logger.warning("igpo: weight version %s loaded on Ray node %s from Ray node %s (%d tensors, fingerprint %r: "
                   "the sender's)", version, node[:8], str(summary["node"])[:8], received.tensors, received.total)
