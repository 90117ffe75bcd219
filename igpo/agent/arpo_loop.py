"""``arpo_agent``: ARPO's entropy-adaptive branching (docs/methods/arpo.md) on verl 0.9.1's agent loop.

How branching reaches siblings. verl's v1 agent-loop worker (``AgentLoopWorkerTQ._run_prompt``) starts the
``rollout.n`` sessions of a prompt as n coroutines of ONE worker process and event loop, all with the prompt's uid and
their own ``session_id`` 0..n−1, and stores each session's output under ``{uid}_{session_id}_0``. The first session
of a prompt to run creates the prompt's group (a per-event-loop registry keyed by uid and step), lets one scheduling
pass go by so that its siblings join, and then runs the prompt's whole tree in one task (``PromptTree``); every
session awaits that task and returns trajectory number ``session_id``. One object owns all M samples, and verl still
receives exactly M outputs per prompt, one per session, grouped by uid exactly as for plain GRPO. (verl's legacy v0
trainer repeats the batch and may split a prompt's samples across workers: ARPO refuses it.)

Each trajectory is the ``igpo_agent`` loop itself (``IGPOAgentLoop.run``: the same turns, tool masking and
end-of-turn handling), driven through a recording proxy of the rollout server and of the tool client, its *tape*.
One round: every running trajectory generates ONE turn and runs its tool call, then stops ("parks") when it asks for
its next turn, or finishes. After the round (``igpo.core.arpo`` has the formulas):

* a root's first turn gives H_init; a turn j ≥ 1 (generated right after tool result j−1) gives H_j and
  ΔH = H_j − H_init, so the decision follows the CURRENT tool result (no one-round lag);
* ``branch_attempts`` (seeded by seed, step, worker rank, prompt index, round) and ``plan_round`` decide the
  branches; a branch copies the source's tape up to that tool result and replays it (recorded generations and tool
  results, no engine or tool call), so its ids and masks equal the source's on [0, ``arpo_branch_pos``) by
  construction (checked at the end), then samples its own turn j; the source keeps its own turn j. That turn j of the
  branch is not measured and cannot branch (``core.may_branch_at``): each tool result gets one round of at most Z − 1
  new paths, from the trajectory that reached it first; the branch may branch from its own later tool results;
* when nothing runs and fewer than M exist, all the missing ones start as fresh top-ups in that round.

Entropy source. verl's vLLM server returns only the sampled token's log-prob for generated tokens, so the top-K
distributions come from one extra request per measured turn: ``prompt_logprobs=K`` over the context up to the tool
result plus the turn's first k tokens (vLLM through verl's server, and ``igpo/cpu/hf_rollout.py``, answer it; on vLLM
it is a prefill without prefix cache). Only prompts with free slots are measured. Requests that would not fit
``rollout.max_model_len`` are skipped and counted (``arpo_unmeasured``); such a turn cannot branch. The request goes
through ``igpo.agent.scoring_request`` in every trainer mode: in the asynchronous ones it bypasses the resume loop of
verl's ``FullyAsyncLLMServerClient`` (which drops ``prompt_logprobs``), and one aborted by a weight-sync pause is sent
again after the pause, so that turn's entropy is measured by the weights loaded during the pause (one version per
measurement; the turn itself was sampled by the previous one). One still aborted after
``scoring_request.RESEND_FOR_S`` is counted in ``arpo_unmeasured``.

Every output's ``extra_fields`` gets its ``BranchRecord`` (``igpo.agent.records``): its tree index (= session id), its
parent, its branch position (response tokens shared with the parent), whether it is a top-up, its H_init, the ΔH of
each of its own measured turns, the turns it could not measure, the rounds and the prompt (the uid).

Greedy sampling (temperature 0, e.g. validation) and a session count other than M (``val_kwargs.n`` ≠ ``rollout.n``)
run plain ``igpo_agent`` trajectories, one per session, with root metadata.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import weakref
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from igpo.agent.agent_loop import IGPOAgentLoop, batch_key, is_context_overflow, NoLimit, shared_tool_client
from igpo.agent.agent_config import arpo_config_from
from igpo.agent.records import BranchRecord
from igpo.agent.scoring_request import PromptLogprobsMissing, request_prompt_logprobs, single_request
from igpo.core import arpo as core

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

_JOIN_PASSES = 3  # scheduling passes the first session waits for its siblings (verl creates them all before any runs)


class ARPOSetupError(ValueError):
    """The configuration or the engine cannot run ARPO (raised, never turned into plain sampling silently)."""


class ARPOReplayError(RuntimeError):
    """A branch did not replay its source's tape: the loop asked for something else than the source did."""


def check_loop_settings(cfg: core.ARPOConfig, agent: Any) -> None:
    """Agent settings a branch could not replay identically (shared by the loop and the launch checks)."""
    if cfg.enabled and agent.completion_cutoff < 1.0:
        raise ARPOSetupError(
            f"algorithm.arpo.enabled=true with algorithm.igpo.agent.completion_cutoff={agent.completion_cutoff}: the "
            "cut-off depends on timing, so a branch replaying its source could be cut where the source was not. Set "
            "algorithm.igpo.agent.completion_cutoff=1.0.")


# ----------------------------------------------------------------------------------------------------- the tape


@dataclass
class _Event:
    """One engine generation ("gen") or tool call ("tool") of a trajectory, with its result or exception. ``context``
    is the trajectory's live (append-only) context list the request was made with; its first ``prompt_len`` tokens
    are the request's prompt."""

    kind: str
    prompt_len: int = 0
    context: list[int] | None = None
    value: Any = None
    error: BaseException | None = None


class _Member:
    """One trajectory of a prompt's tree: its record, its tape and where it stands in the round protocol."""

    def __init__(self, record: core.ARPOTrajectory, events: list[_Event], max_turns: int, prompt_len: int | None):
        self.record = record
        self.events = events  # replayed first (a branch's copied prefix), then appended live
        self.cursor = 0
        self.max_turns = max_turns
        self.prompt_len = prompt_len
        self.request_id = uuid4().hex
        self.turn_starts: list[tuple[int, int]] = []  # (boundary, index into events) of each live turn
        self.last_live_len: int | None = None
        self.parked_at: int | None = None
        self.released: tuple[int, int] | None = None  # the turn it was released into this round
        self.go: asyncio.Future | None = None
        self.stop: asyncio.Future = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None
        self.delta_h: list[float] = []
        self.unmeasured = 0

    async def park(self, boundary: int) -> None:
        """Called by the taped server when the trajectory asks for a new turn live: wait for the next round."""
        if self.prompt_len is None:
            self.prompt_len = boundary
        self.turn_starts.append((boundary, len(self.events)))
        self.parked_at = boundary
        self.go = asyncio.get_running_loop().create_future()
        _resolve(self.stop)
        await self.go

    def release(self) -> None:
        self.released, self.parked_at = self.turn_starts[-1], None
        self.stop = asyncio.get_running_loop().create_future()
        go, self.go = self.go, None
        go.set_result(None)

    def next_event(self, kind: str, prompt_len: int = 0) -> _Event | None:
        """The next recorded event while replaying (None once live)."""
        if self.cursor >= len(self.events):
            return None
        event = self.events[self.cursor]
        self.cursor += 1
        if event.kind != kind or (kind == "gen" and event.prompt_len != prompt_len):
            raise ARPOReplayError(
                f"arpo: trajectory {self.record.index} (branch of {self.record.parent}) asked for a {kind} call"
                f"{f' on {prompt_len} tokens' if kind == 'gen' else ''} where its source made a {event.kind} call"
                f"{f' on {event.prompt_len} tokens' if event.kind == 'gen' else ''}; the igpo_agent loop must be "
                "deterministic given its engine and tool results (check algorithm.igpo.agent.completion_cutoff=1).")
        return event

    def record_live(self, event: _Event) -> None:
        self.events.append(event)
        self.cursor += 1


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _TapedServer:
    """The rollout server as one trajectory sees it: replays its tape, then records; parks at each new live turn.
    Scoring requests (``prompt_logprobs``) are not part of the trajectory and pass through, by the single-request path
    that keeps their prompt log-probs (``igpo.agent.scoring_request``)."""

    def __init__(self, real: Any, member: _Member):
        self._real, self._member = real, member

    async def generate(self, request_id: str, *, prompt_ids: Any, sampling_params: dict[str, Any], **kwargs: Any):
        if sampling_params.get("prompt_logprobs") is not None:
            return await single_request(self._real)(request_id=request_id, prompt_ids=prompt_ids,
                                                    sampling_params=sampling_params, **kwargs)
        member, n = self._member, len(prompt_ids)
        event = member.next_event("gen", n)
        if event is not None:
            if event.error is not None:
                raise event.error
            return event.value
        if n != member.last_live_len:  # a new turn (a resampled turn asks again with the same context)
            await member.park(n)
        member.last_live_len = n
        event = _Event("gen", n, prompt_ids)
        try:
            event.value = await self._real.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                    sampling_params=sampling_params, **kwargs)
        except Exception as error:
            event.error = error
            raise
        finally:
            member.record_live(event)
        return event.value


class _TapedTools:
    """The tool client as one trajectory sees it: replays recorded results (a timeout too), then records."""

    def __init__(self, real: Any, member: _Member):
        self._real, self._member = real, member

    async def call(self, name: str, arguments: dict) -> Any:
        event = self._member.next_event("tool")
        if event is not None:
            if event.error is not None:
                raise event.error
            return event.value
        event = _Event("tool")
        self._member.record_live(event)  # recorded first: the loop's deadline cancels this call midway
        try:
            event.value = await self._real().call(name, arguments)
        except asyncio.CancelledError:
            event.error = asyncio.TimeoutError()  # the loop's wait_for deadline: replayed as the same timeout
            raise
        except Exception as error:
            event.error = error
            raise
        return event.value


class _TreeMember(IGPOAgentLoop):
    """The igpo_agent loop for one trajectory of a tree (not registered): no per-trajectory concurrency slot (a
    parked trajectory would hold it while the round waits for the others) and the root's turn limit, inherited by
    its branches so that they replay the same turns."""

    _arpo_max_turns: int

    def _slot(self, state: Any) -> Any:
        return NoLimit()

    def _draw_max_turns(self, seed_key: tuple | None = None) -> int:
        return self._arpo_max_turns


# ----------------------------------------------------------------------------------------------------- the tree


class PromptTree:
    """All M trajectories of one prompt in one step, grown in rounds (module docstring)."""

    def __init__(self, template: "ARPOAgentLoop", sampling_params: dict[str, Any], kwargs: dict[str, Any],
                 rank: int = 0):
        self.template, self.sampling_params, self.kwargs = template, dict(sampling_params), dict(kwargs)
        self.cfg: core.ARPOConfig = template.arpo
        self.server = template.server_manager
        self.step = _nonneg_int(kwargs.get("global_steps"))
        self.prompt = _nonneg_int(kwargs.get("index"))
        self.rank = rank
        self.rounds = 0

    def _start(self, record: core.ARPOTrajectory, source: _Member | None, cut: int) -> _Member:
        t = self.template
        if source is None:
            member = _Member(record, [], t._draw_max_turns(), None)
        else:
            member = _Member(record, list(source.events[:cut]), source.max_turns, source.prompt_len)
        loop = _TreeMember.__new__(_TreeMember)
        loop.__dict__.update(t.__dict__)
        loop.server_manager = _TapedServer(self.server, member)
        real_tools = t._tool_caller
        loop._tool_caller = _TapedTools(
            (lambda: real_tools) if real_tools is not None
            else (lambda: shared_tool_client(t.cfg.tool_server_url, t.cfg.tool_timeout_s)), member)
        loop._arpo_max_turns = member.max_turns
        loop._seed_stream = record.index  # a branch samples its own live turns, not its source's
        member.task = asyncio.create_task(IGPOAgentLoop._run(loop, self.sampling_params, **self.kwargs))
        member.task.add_done_callback(lambda _task, m=member: _resolve(m.stop))
        return member

    async def _settle(self, members: list[_Member]) -> None:
        """Until every member is parked or finished; a member's exception stops the tree."""
        await asyncio.gather(*(m.stop for m in members if not m.task.done()))
        for m in members:
            if m.task.done() and not m.task.cancelled() and m.task.exception() is not None:
                raise m.task.exception()

    async def run(self) -> list[AgentLoopOutput]:
        cfg = self.cfg
        records = core.initial_trajectories(cfg)
        members = [self._start(r, None, 0) for r in records]
        try:
            while True:
                await self._settle(members)
                # A full prompt cannot branch any more: its turns are not measured (on vLLM each measurement is a
                # prefill of the whole context).
                full = len(members) >= cfg.rollouts_per_prompt
                measured = [None] * len(members) if full else await asyncio.gather(*(self._measure(m) for m in members))
                for i, (m, value) in enumerate(zip(members, measured)):
                    if value is not None and value[0] == "init":
                        records[i] = m.record = core.with_initial_entropy(records[i], value[1])
                new: list[_Member] = []
                if not full:
                    eligible, deltas, points = [False] * len(members), [], [0] * len(members)
                    for i, (m, value) in enumerate(zip(members, measured)):
                        if value is not None and value[0] == "delta":
                            eligible[i] = True
                            deltas.append(value[1])
                            points[i] = m.released[0] - m.prompt_len
                    index = [i for i, e in enumerate(eligible) if e]
                    accepted = core.branch_attempts(index, torch.tensor(deltas, dtype=torch.float64), cfg,
                                                    step=self.step, rank=self.rank, prompt=self.prompt,
                                                    round_=self.rounds)
                    running = [m.parked_at is not None for m in members]
                    plan = core.plan_round(records, running, eligible, accepted, cfg)
                    records = core.apply_plan(records, plan, points)
                    for record in records[len(members):]:
                        if record.parent >= 0:
                            source = members[record.parent]
                            member = self._start(record, source, source.released[1])
                        else:
                            member = self._start(record, None, 0)
                        new.append(member)
                    members += new
                if new:
                    await self._settle(new)
                for m in members:
                    m.released = None
                parked = [m for m in members if m.parked_at is not None]
                if not parked:
                    break
                for m in parked:
                    m.release()
                self.rounds += 1
            outputs = [m.task.result() for m in members]
        finally:
            for m in members:
                if not m.task.done():
                    m.task.cancel()
        if len(outputs) != cfg.rollouts_per_prompt:
            raise RuntimeError(f"arpo: a prompt ended with {len(outputs)} trajectories, not {cfg.rollouts_per_prompt}")
        self._check_prefixes(members, outputs)
        for m, out in zip(members, outputs):
            r = m.record
            out.extra_fields.update(BranchRecord(
                index=r.index, parent=r.parent, branch_pos=r.branch_pos, is_topup=r.is_topup, h_init=r.h_init,
                delta_h=list(m.delta_h), unmeasured=m.unmeasured, rounds=self.rounds,
                prompt=str(self.kwargs.get("uid"))).to_extra_fields())
        return outputs

    async def _measure(self, m: _Member) -> tuple[str, float] | None:
        """("init", H) for a root's first turn, ("delta", ΔH) for a turn after a tool result, None when the member
        generated no turn this round or the turn could not be measured."""
        if m.released is None:
            return None
        boundary, start = m.released
        if not core.may_branch_at(m.record, boundary - m.prompt_len):
            return None  # a branch's own first turn: its tool result had its round of branching (no prefill spent)
        turn = [e for e in m.events[start:] if e.kind == "gen" and e.prompt_len == boundary]
        first = boundary == m.prompt_len and m.record.parent < 0
        if not first and m.record.h_init is None:
            return None  # its first turn was not measured: no reference to compare with
        last = turn[-1] if turn else None
        tokens = list(last.value.token_ids)[: self.cfg.entropy_tokens] if last and last.error is None else []
        if not tokens:
            return None  # an empty or failed generation has no entropy
        h = await self._entropy(m, last.context[:boundary] + tokens, boundary, len(tokens))
        if h is None:
            m.unmeasured += 1
            return None
        if first:
            return "init", h
        delta = h - m.record.h_init
        m.delta_h.append(delta)
        return "delta", delta

    async def _entropy(self, m: _Member, prompt_ids: list[int], boundary: int, n: int) -> float | None:
        """H = mean over the n measured tokens of the normalised top-K entropy (``core.step_entropy``)."""
        limit = self.template.max_model_len
        if limit is not None and len(prompt_ids) >= limit:
            return None
        try:
            answer = await request_prompt_logprobs(self.server, m.request_id, prompt_ids, self.cfg.top_k)
        except PromptLogprobsMissing as error:
            raise ARPOSetupError(
                f"arpo: {error}; ARPO reads the top-K log-probs after each tool result from it. Use a server that "
                "returns them (vLLM, or the CPU hf rollout), or set algorithm.arpo.enabled=false.") from None
        except Exception as error:  # noqa: BLE001 - only a context the engine refuses is survivable
            if is_context_overflow(error):
                return None
            raise
        if answer is None:
            return None  # aborted by pauses for longer than scoring_request.RESEND_FOR_S: counted as unmeasured
        rows = answer.prompt_logprobs
        window = rows[boundary - 1: boundary - 1 + n]
        if len(window) != n or any(not isinstance(r, (list, tuple)) or len(r) < 2 for r in window):
            shapes = [len(r) if isinstance(r, (list, tuple)) else r for r in window[:3]]
            raise ARPOSetupError(
                f"arpo: the rollout server returned prompt_logprobs rows of {shapes} entries for prompt_logprobs="
                f"{self.cfg.top_k}; ARPO needs the top-K log-probs of each position.")
        width = max(len(r) for r in window)
        values = torch.full((1, n, width), float("-inf"), dtype=torch.float64)
        for j, row in enumerate(window):
            for e, v in enumerate(row):
                if v is not None:
                    values[0, j, e] = float(v)
        return float(core.step_entropy(values, torch.tensor([n]), self.cfg)[0])

    @staticmethod
    def _check_prefixes(members: list[_Member], outputs: list[AgentLoopOutput]) -> None:
        for m, out in zip(members, outputs):
            r = m.record
            if r.parent < 0:
                continue
            src = outputs[r.parent]
            n = r.branch_pos
            if list(out.response_ids[:n]) != list(src.response_ids[:n]) or \
                    list(out.response_mask[:n]) != list(src.response_mask[:n]) or len(out.response_ids) < n:
                raise ARPOReplayError(f"arpo: branch {r.index} differs from its source {r.parent} before its branch "
                                      f"position {n}; the tree metadata would be wrong.")


def _nonneg_int(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _worker_rank() -> int:
    """The agent-loop worker's number (verl names its actors ``agent_loop_worker_<i>_<hex>``); 0 outside Ray."""
    try:
        import ray

        if not ray.is_initialized():  # outside Ray (tests); asking for the context would start a local Ray
            return 0
        name = ray.get_runtime_context().get_actor_name() or ""
    except Exception:  # noqa: BLE001 - not in a Ray actor
        return 0
    found = re.match(r"agent_loop_worker_(\d+)_", name)
    return int(found.group(1)) if found else 0


# ----------------------------------------------------------------------------------------------------- the loop


@dataclass
class _Group:
    sessions: set[int] = field(default_factory=set)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    tree: asyncio.Task | None = None
    plain: bool = False
    collected: int = 0


_GROUPS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, _Group]]" = weakref.WeakKeyDictionary()
_CONFIGS: dict[int, tuple[Any, core.ARPOConfig]] = {}


def _groups() -> dict[Any, _Group]:
    loop = asyncio.get_running_loop()
    groups = _GROUPS.get(loop)
    if groups is None:
        groups = _GROUPS[loop] = {}
    return groups


def _arpo_for(trainer_config: Any) -> core.ARPOConfig:
    cached = _CONFIGS.get(id(trainer_config))
    if cached is not None and cached[0] is trainer_config:
        return cached[1]
    try:
        cfg = arpo_config_from(trainer_config)
    except ValueError as error:
        raise ARPOSetupError(str(error)) from None
    _CONFIGS[id(trainer_config)] = (trainer_config, cfg)
    return cfg


class ARPOAgentLoop(IGPOAgentLoop):
    """``igpo_agent`` with ARPO's branching across the sessions of a prompt (``algorithm.arpo``; module docstring).
    With ``algorithm.arpo.enabled=false`` it is the plain igpo_agent loop."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.arpo = _arpo_for(self.config)
        check_loop_settings(self.arpo, self.cfg)

    async def _run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if not self.arpo.enabled:
            return await super()._run(sampling_params, **kwargs)
        if "session_id" not in kwargs:
            raise ARPOSetupError("algorithm.arpo.enabled=true needs verl's v1 trainer (trainer.use_v1=true), whose "
                                 "agent-loop worker runs all rollout.n sessions of a prompt together; the legacy "
                                 "trainer gives each sample to the loop alone.")
        groups = _groups()
        key = (str(kwargs.get("uid")), batch_key(kwargs))
        session = int(kwargs["session_id"])
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group()
            group.sessions.add(session)
            for _ in range(_JOIN_PASSES):
                await asyncio.sleep(0)
            m = self.arpo.rollouts_per_prompt
            greedy = float(sampling_params.get("temperature", 1.0) or 0.0) == 0.0
            if greedy or sorted(group.sessions) != list(range(m)):
                group.plain = True
                logger.info("arpo_agent: prompt %s runs %d plain trajectories (%s)", key[0], len(group.sessions),
                            "greedy sampling" if greedy else f"sessions {sorted(group.sessions)} != 0..{m - 1}")
            else:
                group.tree = asyncio.create_task(PromptTree(self, sampling_params, kwargs, _worker_rank()).run())
            group.decided.set()
        else:
            group.sessions.add(session)
            await group.decided.wait()
        try:
            if group.plain:
                out = await super()._run(sampling_params, **kwargs)
                out.extra_fields.update(BranchRecord(index=session, prompt=key[0]).to_extra_fields())
                return out
            outputs = await asyncio.shield(group.tree)
            return outputs[session]
        finally:
            group.collected += 1
            if group.collected >= len(group.sessions) and groups.get(key) is group:
                del groups[key]
