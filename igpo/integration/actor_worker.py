"""Actor-side answer scoring (``algorithm.igpo.score_on=actor``): a worker method on verl's FSDP actor workers.

``IGPOActorRolloutRefWorker`` is verl's ``ActorRolloutRefWorker`` plus one method, ``igpo_score_answers``, that runs
the packed teacher-forced scorer (``igpo.core.scoring``) with the current training weights (θ_old: scoring happens
before the policy update). The trainer mode swaps this class in for the actor role.

Sharding: every rank receives all requests and scores ``requests[rank::world]``. FSDP2 gathers each layer's
parameters collectively, once per request, so ranks stay in lockstep only if they score the same number of requests:
shorter shares are padded with a one-token dummy request whose result is dropped.

``infopo_score_counterfactuals`` does the same for InfoPO's counterfactual pass (paired continuations after each
observation's content start, ``igpo.core.scoring.score_continuations``), with the same sharding and padding.

``tips_score_reference_answers`` scores the same requests as ``igpo_score_answers`` on verl's reference policy
(``self.ref``, built in this worker when the KL loss is on): TIPS's frozen teacher (docs/methods/tips.md).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.device import get_device_name
from verl.workers.engine_workers import ActorRolloutRefWorker

from igpo.core.ground_truth import Probe
from igpo.core.scoring import ScoreRequest, ScoringConfig, score_batch, score_continuations


def shard_requests(requests: list[dict], rank: int, world: int) -> tuple[list[int], int]:
    """Indices of the requests this rank scores, and how many dummy requests it adds so all ranks do equal work."""
    mine = list(range(rank, len(requests), world))
    per_rank = -(-len(requests) // world) if requests else 0
    return mine, per_rank - len(mine)


def _to_request(spec: dict) -> ScoreRequest:
    return ScoreRequest(
        trajectory_ids=torch.as_tensor(spec["trajectory_ids"], dtype=torch.long),
        boundaries=list(spec["boundaries"]),
        probes=[Probe(token_ids=list(p["token_ids"]), span=tuple(p["span"])) for p in spec["probes"]],
    )


def _dummy_like(spec: dict) -> dict:
    """A minimal request of the same model: its first probe after a one-token context."""
    probe = spec["probes"][0]
    return {"trajectory_ids": [int(spec["trajectory_ids"][0])], "boundaries": [1], "probes": [probe]}


def _continuation_dummy(spec: dict) -> dict:
    """A minimal paired request: the first continuation after a one-token context (its KL pair with itself)."""
    dummy = {"trajectory_ids": [int(spec["trajectory_ids"][0])], "boundaries": [1],
             "continuations": [spec["continuations"][0]]}
    if spec.get("pairs") is not None:
        dummy["pairs"] = [[0, 0]]
    return dummy


def score_counterfactual_share(module: torch.nn.Module, requests: list[dict], scoring: dict, rank: int,
                               world: int) -> dict[int, list[float]]:
    """This rank's share of InfoPO requests (``igpo.core.infopo.ContinuationRequest.as_dict``), padded with dummies
    so that every rank runs the same number of packed passes (FSDP2 gathers stay in lockstep).

    Returns {request index: per-copy mean log-probs, or per-pair mean KL when the request has ``pairs``}.
    """
    if not requests:
        return {}
    mine, padding = shard_requests(requests, rank, world)
    cfg = ScoringConfig(**scoring)
    out = {}
    for slot, spec in enumerate([requests[i] for i in mine] + [_continuation_dummy(requests[0])] * padding):
        values = score_continuations(
            module, torch.as_tensor(spec["trajectory_ids"], dtype=torch.long), spec["boundaries"],
            [Probe(token_ids=list(c["token_ids"]), span=tuple(c["span"])) for c in spec["continuations"]], cfg,
            spec.get("pairs"))
        if slot < len(mine):
            out[mine[slot]] = values.tolist()
    return out


class IGPOActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker with IGPO's answer-scoring pass."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def igpo_score_answers(self, requests: list[dict], scoring: dict) -> dict[int, list[list[float]]]:
        """Score this rank's share; returns {request index: [K][P] mean answer log-probs}.

        Each request: ``trajectory_ids`` (prompt + response ids, unpadded), ``boundaries`` (context lengths to score
        after), ``probes`` ([{token_ids, span}]); every request has at least one boundary and one probe.
        """
        return self._score_answer_share(self.actor.engine, requests, scoring)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tips_score_reference_answers(self, requests: list[dict], scoring: dict) -> dict[int, list[list[float]]]:
        """``igpo_score_answers`` on the reference policy's weights (TIPS's frozen teacher), same requests, sharding
        and results."""
        return self._score_answer_share(self._reference_engine(), requests, scoring)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def infopo_score_counterfactuals(self, requests: list[dict], scoring: dict) -> dict[int, list[float]]:
        """InfoPO's counterfactual pass on this rank's share (``score_counterfactual_share``), θ_old, no grad."""
        if not requests:
            return {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        with self._scoring_module() as module:
            return score_counterfactual_share(module, requests, scoring, rank, world)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def igpo_worker_report(self, with_digest: bool) -> dict:
        """This rank's Ray node and, with ``with_digest``, a SHA-256 of its shard of the actor weights.

        The trainer logs both: the node ids show verl's placement across nodes (and that this class, ours, runs on
        each), the digests let a resumed run be checked against what was saved (same bytes, same digest).
        """
        import hashlib

        import ray

        report = {"rank": dist.get_rank() if dist.is_initialized() else 0,
                  "node_id": ray.get_runtime_context().get_node_id()}
        if with_digest:
            digest = hashlib.sha256()
            for name, tensor in sorted(self.actor.engine.module.state_dict().items()):
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # an FSDP2 shard (DTensor)
                digest.update(name.encode())
                digest.update(local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            report["digest"] = digest.hexdigest()[:16]
        return report

    def _score_answer_share(self, engine, requests: list[dict], scoring: dict) -> dict[int, list[list[float]]]:
        """This rank's share of answer-scoring requests on ``engine``'s module, padded so every rank runs as many."""
        if not requests:
            return {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine, padding = shard_requests(requests, rank, world)
        batch = [_to_request(requests[i]) for i in mine] + [_to_request(_dummy_like(requests[0]))] * padding
        with self._scoring_module(engine) as module:
            scores = score_batch(module, batch, ScoringConfig(**scoring))
        return {index: scores[slot].tolist() for slot, index in enumerate(mine)}

    def _reference_engine(self):
        """The reference policy's engine (the initial weights, never trained), or an error saying why there is none:
        verl builds ``self.ref`` in this worker only for the ``actor_rollout_ref`` role (the KL loss on, no LoRA, the
        rollout in the same worker group)."""
        if getattr(self, "ref", None) is None:
            raise RuntimeError(
                f"TIPS scores on the reference policy, but this worker (role {getattr(self, 'role', '?')!r}) holds "
                "none: verl builds it here only with actor_rollout_ref.actor.use_kl_loss=true, without LoRA, and with "
                "the rollout in the actor's worker group (trainer modes igpo_sync and igpo_colocate_async).")
        return self.ref.engine

    @contextlib.contextmanager
    def _scoring_module(self, engine=None) -> Iterator[torch.nn.Module]:
        """``engine``'s module (default: the actor's, with the training weights θ_old), on the device, in eval mode,
        without autograd; the parameters go back to the CPU afterwards when verl offloads them between phases. verl's
        reference engine is forward-only and offloads through FSDP2's own CPU offload policy (its
        ``is_param_offload_enabled`` is False), so nothing is moved for it here."""
        engine = self.actor.engine if engine is None else engine
        offloaded = bool(getattr(engine, "is_param_offload_enabled", False))
        if offloaded:
            engine.to(get_device_name(), model=True, optimizer=False, grad=False)
        module = engine.module
        was_training = module.training
        try:
            module.eval()
            with torch.no_grad():
                yield module
        finally:
            module.train(was_training)
            if offloaded:
                engine.to("cpu", model=True, optimizer=False, grad=False)
