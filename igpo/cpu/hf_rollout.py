"""A Hugging Face transformers rollout server for verl's agent loops on CPU (rollout name ``hf``).

verl 0.9.1 only serves rollouts through vLLM, SGLang or TensorRT-LLM, none of which runs on a CPU-only machine.
This module implements the same contracts with plain ``transformers``:

* ``HFRolloutServer`` — the Ray actor behind ``LLMServerClient.generate`` (token in, token out), with per-token
  log-probs, vLLM-compatible ``prompt_logprobs`` (what rollout-side answer scoring uses) and weight updates.
  Concurrent requests are gathered into batches and decoded together with a KV cache. For verl's asynchronous trainer
  modes it pauses as vLLM does: ``abort_all_requests`` closes a gate, stops the batch being decoded after its current
  token and answers every unfinished request with what it has so far (``stop_reason="aborted"``; verl's
  ``FullyAsyncLLMServerClient`` sends the rest again after ``resume_generation``, to the new weights); requests that
  arrive behind the closed gate wait for it to open (or are answered at once as aborted with ``reject_request``).
* ``HFReplica`` — the ``RolloutReplica`` that starts one server per replica, on the trainer's workers (hybrid) or
  on a resource pool of its own (standalone: verl's ``separate_async`` schedule).
* ``HFServerAdapter`` — the ``BaseRollout`` that loads weights into the server: in each hybrid actor worker it pushes
  the trainer's weights after every update, so rollouts always sample from the current policy; in a standalone
  replica's checkpoint-engine worker it loads what the checkpoint engine received (``igpo.cpu.checkpoint_engine``),
  with the trainer's step as the weight version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, Iterable, Optional

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

logger = logging.getLogger(__name__)

SERVER_NAME = "igpo_hf_rollout_server_{replica_rank}"
NamedTensor = tuple[str, torch.Tensor]
MAX_BATCH = 64


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    prompt_logprobs: Optional[int]
    future: asyncio.Future = field(repr=False)
    seed: Optional[int] = None  # vLLM's per-request seed: this request's tokens come from its own generator


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
            uniform: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverting the filtered distribution's CDF at ``uniform`` [B] (one draw in [0, 1)
    per row, from the row's own generator); rows with temperature 0 are greedy. Vectorised over the batch."""
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits, sorted_idx = scaled.sort(-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    probs = sorted_logits.softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always survives), within top_k.
    keep = ((probs.cumsum(-1) - probs) < top_p[:, None]) & (ranks < k[:, None])
    cdf = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1).cumsum(-1)
    choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    choice = torch.minimum(choice, keep.sum(-1) - 1)  # rounding at the top of the CDF stays on a kept token
    sampled = sorted_idx.gather(-1, choice[:, None]).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """float32 at least; float64 logits stay float64."""
    return logits if logits.dtype == torch.float64 else logits.float()


class HFRolloutServer:
    """Token-in-token-out generation with a transformers causal LM; one instance per rollout replica."""

    def __init__(self, model_path: str, max_model_len: int, response_length: int, dtype: str | None = None,
                 seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, int(os.environ.get("IGPO_CPU_ROLLOUT_THREADS", "1"))))
        # float64 (the default) makes a seeded run repeat exactly: a request's logits depend on which requests share
        # its batch (padding, kernel shapes) by float rounding, ~1e-7 in float32 — enough to flip a sampled token now
        # and then, after which the run takes another course; ~1e-16 in float64. float32 is the faster option for
        # larger models on CPU (IGPO_CPU_ROLLOUT_DTYPE=float32), at the price of runs that drift apart.
        dtype = dtype or os.environ.get("IGPO_CPU_ROLLOUT_DTYPE", "float64")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"IGPO_CPU_ROLLOUT_DTYPE={dtype!r}: the CPU rollout server computes in float64 (default, "
                             "exact repeats of a seeded run) or float32 (faster, runs drift apart)")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        logger.warning("igpo: hf rollout server computes in %s", dtype)
        self.model.eval()
        self.eos_ids = set(self._eos_ids())
        self.pad_id = self.model.config.pad_token_id or 0
        self.max_model_len = max_model_len
        self.response_length = response_length
        self.global_steps: Optional[int] = None
        # Requests without their own seed draw from this one (vLLM's engine seed, rollout.seed).
        self._generator = torch.Generator().manual_seed(int(seed))
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        # Pausing for a weight update (module docstring): the gate new requests pass, the flag the decoding thread
        # reads after every token, and whether a batch is being decoded now.
        self._gate = asyncio.Event()
        self._gate.set()
        self._reject = False
        self._abort = threading.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    # ---- generation -------------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **_: Any,
    ) -> TokenOutput:
        if image_data or video_data:
            raise ValueError("the CPU hf rollout serves text-only models; got image/video inputs")
        prompt_ids = list(prompt_ids)
        if not self._gate.is_set():
            if self._reject:
                return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted",
                                   extra_fields={"global_steps": self.global_steps})
            await self._gate.wait()
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within max_model_len="
                f"{self.max_model_len}; shorten the context or raise actor_rollout_ref.rollout.max_model_len")
        max_tokens = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens", self.response_length))
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._serve())
        request = _Request(
            prompt_ids=prompt_ids,
            max_tokens=max(1, min(int(max_tokens), room)),
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=int(sampling_params.get("top_k", -1) or -1),
            prompt_logprobs=sampling_params.get("prompt_logprobs"),
            future=asyncio.get_running_loop().create_future(),
            seed=None if sampling_params.get("seed") is None else int(sampling_params["seed"]),
        )
        await self._queue.put(request)
        token_ids, log_probs, stop_reason, prompt_lp = await request.future
        extra_fields: dict[str, Any] = {"global_steps": self.global_steps}
        if prompt_lp is not None:
            extra_fields["prompt_logprobs"], extra_fields["prompt_ids"] = prompt_lp
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason,
                           extra_fields=extra_fields)

    async def _serve(self) -> None:
        """Gather whatever requests are waiting into one batch; decode it in a thread so requests keep arriving."""
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < MAX_BATCH:
                batch.append(self._queue.get_nowait())
            self._idle.clear()
            try:
                results = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as error:  # noqa: BLE001 - forwarded to every waiting caller
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            finally:
                self._idle.set()
            for request, result in zip(batch, results):
                if not request.future.done():
                    request.future.set_result(result)

    @torch.no_grad()
    def _generate_batch(self, batch: list[_Request]):
        from transformers import DynamicCache

        size = len(batch)
        lengths = torch.tensor([len(r.prompt_ids) for r in batch])
        width = int(lengths.max())
        # Left padding so that every row's next token is at the same column.
        input_ids = torch.full((size, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((size, width), dtype=torch.long)
        for row, request in enumerate(batch):
            input_ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            attention[row, width - len(request.prompt_ids):] = 1
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        temperature = torch.tensor([r.temperature for r in batch])
        top_p = torch.tensor([r.top_p for r in batch])
        top_k = torch.tensor([r.top_k for r in batch])
        max_tokens = torch.tensor([r.max_tokens for r in batch])
        generators = [self._generator if r.seed is None else torch.Generator().manual_seed(r.seed) for r in batch]

        cache = DynamicCache()
        # The vocabulary projection of every prompt position is only needed for prompt log-probs: for a real
        # vocabulary (49,152 tokens for SmolLM2) it costs more than the decoder itself on a long prompt.
        wants_prompt = any(r.prompt_logprobs is not None for r in batch)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=0 if wants_prompt else 1)
        prompt_lp = self._prompt_logprobs(batch, out.logits, width)
        logits = _wide(out.logits[:, -1, :])

        tokens: list[list[int]] = [[] for _ in range(size)]
        logps: list[list[float]] = [[] for _ in range(size)]
        done = torch.zeros(size, dtype=torch.bool)
        eos = torch.tensor(sorted(self.eos_ids))
        next_pos = positions[:, -1] + 1
        for step in range(int(max_tokens.max())):
            if self._abort.is_set():  # paused for a weight update: every unfinished row returns what it has
                break
            # Log-probs of the sampled tokens under logits / temperature, as verl's actor computes them.
            scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
            log_softmax = (logits / scale[:, None]).log_softmax(-1)
            uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
            chosen = _sample(logits, temperature, top_p, top_k, uniform.to(logits.dtype))
            chosen_lp = log_softmax.gather(-1, chosen[:, None]).squeeze(-1)
            for row in torch.nonzero(~done).flatten().tolist():
                tokens[row].append(int(chosen[row]))
                logps[row].append(float(chosen_lp[row]))
            done |= torch.isin(chosen, eos) | (step + 1 >= max_tokens)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones((size, 1), dtype=torch.long)], dim=-1)
            out = self.model(input_ids=chosen[:, None], attention_mask=attention, position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True)
            logits = _wide(out.logits[:, -1, :])
            next_pos = next_pos + 1

        results = []
        for row, request in enumerate(batch):
            stopped_on_eos = bool(tokens[row]) and tokens[row][-1] in self.eos_ids
            reason = "completed" if stopped_on_eos else "length" if bool(done[row]) else "aborted"
            results.append((tokens[row], logps[row], reason, prompt_lp[row]))
        return results

    @staticmethod
    def _prompt_logprobs(batch: list[_Request], logits: torch.Tensor, width: int
                         ) -> list[Optional[tuple[list[list[float]], list[list[int]]]]]:
        """verl's vLLM layout (``extract_prompt_logprobs``), untempered like vLLM's prompt log-probs. prompt_logprobs=0:
        entry i = [log p(prompt[i+1] | prompt[:i+1])]; prompt_logprobs=k > 0: entry i = the k largest log-probs of that
        position's distribution, best first (the prompt token itself only if it is among them), with their token ids
        (what ARPO's entropy reads). Then one pad entry for the last token. Returns (log-probs, ids) per request."""
        wanted = [r.prompt_logprobs is not None for r in batch]
        if not any(wanted):
            return [None] * len(batch)
        vocab = logits.shape[-1]
        result: list[Optional[tuple[list[list[float]], list[list[int]]]]] = []
        for row, request in enumerate(batch):
            if not wanted[row]:
                result.append(None)
                continue
            k = int(request.prompt_logprobs)
            if k < 0 or k > vocab:
                raise ValueError(f"prompt_logprobs={k} must be in [0, {vocab}] (the vocabulary size)")
            n = len(request.prompt_ids)
            start = width - n
            positions = _wide(logits[row, start:width - 1]).log_softmax(-1)  # this row's prompt only
            if k == 0:
                targets = torch.tensor(request.prompt_ids[1:], dtype=torch.long)
                picked = positions.gather(-1, targets[:, None]).squeeze(-1)
                result.append(([[float(v)] for v in picked] + [[0.0]], [[t] for t in request.prompt_ids[1:]] + [[0]]))
                continue
            top = positions.topk(k, dim=-1)
            result.append((top.values.tolist() + [[0.0] * k], top.indices.tolist() + [[0] * k]))
        return result

    # ---- weights and lifecycle (the hybrid engine's sleep/wake is a no-op on CPU; pausing is not) ---------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> int:
        # state_dict(keep_vars=True) also lists tied aliases such as lm_head.weight, which trainers may send.
        params = dict(self.model.state_dict(keep_vars=True))
        missing = [name for name in state_dict if name not in params]
        if missing:
            raise KeyError(f"hf rollout: weight update has unknown parameters {missing[:5]} (model mismatch?)")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                params[name].copy_(tensor.to(params[name].dtype))
        if global_steps is not None:
            self.global_steps = global_steps
        return len(state_dict)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self): return None
    async def sleep(self): return None
    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Close the gate, answer the queued requests and the batch being decoded as aborted (with the tokens they
        have), and return once no batch is decoding, so that a weight update that follows never races a forward
        pass. Requests arriving later wait for ``resume_generation`` (``reject_request``: are answered as aborted)."""
        self._gate.clear()
        self._reject = reject_request
        self._abort.set()
        aborted = 0
        while self._queue is not None and not self._queue.empty():
            request = self._queue.get_nowait()
            if not request.future.done():
                request.future.set_result(([], [], "aborted", None))
                aborted += 1
        running = not self._idle.is_set()
        await self._idle.wait()
        self._abort.clear()
        return {"aborted_count": aborted + int(running), "request_ids": []}

    async def resume_generation(self):
        """Open the gate closed by ``abort_all_requests``: waiting requests go on, on the weights loaded since."""
        self._reject = False
        self._gate.set()
    async def clear_kv_cache(self): return None
    async def release_kv_cache(self): return None
    async def resume_kv_cache(self): return None
    async def start_profile(self, **_): return None
    async def stop_profile(self): return None


class HFReplica(RolloutReplica):
    """One ``HFRolloutServer`` per replica. Hybrid: the weights come from the actor workers it shares. Standalone
    (``init_standalone``): verl starts one checkpoint-engine worker per rollout rank on the replica's own resource
    pool, and the weights come through the checkpoint engine; the server is the same either way."""

    async def launch_servers(self):
        name = SERVER_NAME.format(replica_rank=self.replica_rank)
        server_cls = ray.remote(HFRolloutServer)
        # num_cpus=0: the server shares the cores with the trainer workers, as vLLM shares their GPUs.
        server = server_cls.options(name=name, num_cpus=0, max_concurrency=self.max_concurrency).remote(
            model_path=self.model_config.get("local_path") or self.model_config.get("path"),
            max_model_len=int(self.config.max_model_len or (self.config.prompt_length + self.config.response_length)),
            response_length=int(self.config.response_length),
            seed=int(self.config.get("seed") or 0),
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = name

    def rollout_worker_use_gpu(self) -> bool:
        return False


class HFServerAdapter(BaseRollout):
    """Lives in each hybrid actor worker, or in each checkpoint-engine worker of a standalone replica; rank 0 of the
    replica pushes updated weights to the server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(SERVER_NAME.format(replica_rank=self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights: Iterable[NamedTensor] | AsyncIterable[NamedTensor],
                             global_steps: Optional[int] = None, wire_format: str = "named_tensors", **kwargs):
        """Load ``weights`` into the server as version ``global_steps``: the actor's generator (hybrid) or the
        checkpoint engine's asynchronous one (standalone)."""
        if wire_format != "named_tensors":
            raise ValueError(f"hf rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        # Every rank must drain the generator (it may gather shards collectively); only the leader sends.
        state = {name: tensor.detach().to("cpu").clone() async for name, tensor in ensure_async_iterator(weights)}
        if self.is_leader:
            await self._server_handle().update_weights.remote(state, global_steps)
