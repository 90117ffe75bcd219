"""``igpo_agent``: the deep-research agent loop for verl 0.9.1 (docs/design/reference_igpo.md §4; verl's contract:
docs/design/architecture.md).

One trajectory is up to ``max_turns`` assistant turns of think -> tool call -> observation -> ... -> answer. The
token sequence is built incrementally, token in / token out (docs/design/reference_igpo.md §10 items 3, 4, 23):

    context = prompt_ids                                  (chat template of [system, user] + generation prompt)
    turn j:  b_j = len(context)                           (boundary: the context the policy saw before turn j)
             context += sampled ids (+ end-of-turn token if the engine stopped without it)   response_mask 1
             context += observation ids                   (end-of-turn closing, user header, <tool_response>,
                                                           the content, generation prompt)      response_mask 0

The observation ids come from three pieces derived ONCE from the chat template (prefix, suffix) plus the tokenized
content, so the work of a turn does not depend on the length of the history. Boundaries and turn ends are exact
indices into this sequence; nothing is recovered from text afterwards.

When the next turn cannot be a tool-calling turn (not enough context left for it, its observation and a final
answer; the turn limit; the batch-wide completion cut-off) an instruction to answer now is APPENDED to the last
user message, never substituted for it (docs/design/reference_igpo.md §10 item 16), and the next turn is the last.

With ``algorithm.igpo.score_on=rollout`` the loop also asks the rollout engine for the log-probabilities of the
pseudo answer P(gt) after every scored boundary b_s (docs/design/reference_igpo.md §1.1-1.3):

    l_s = (1/|G|) * sum_{k in G} log pi(y_k | context[:b_s], y_<k)

as a background request that overlaps the next generation and tool call (``igpo/agent/answer_scoring.py``).

Every request stays inside ``rollout.max_model_len`` when it is set (the context limit is capped at it, and a scoring
request that would not fit is not sent). An engine that still refuses a prompt as too long ends that trajectory as
truncated (``igpo_context_overflow``) instead of failing the worker's whole batch; any other generation error
propagates.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import re
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from igpo.agent import failures, protocol
from igpo.agent.agent_config import AgentLoopConfig, RolloutScoringConfig, info_gain_config_from, plain_section
from igpo.agent.answer_scoring import AnswerScoring
from igpo.agent.chat_frame import AgentTemplateError, encode_content, frame_for
from igpo.agent.records import hop_targets
from igpo.agent.trajectory import Trajectory
from igpo.core.ground_truth import Probe, answer_probes, parse_ground_truth
from igpo.core.outcome import contains_answer
from igpo.core.info_gain import InfoGainConfig
from igpo.core.turn_format import check_answer_turn, check_tool_turn, reference_tag_fix, reference_turn_ok

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


class SampleError(ValueError):
    """One sample cannot be rolled out (prompt too long, unusable ground truth): it becomes a flagged dummy output."""


# How a rollout engine says that a prompt does not fit its context. verl's vLLM server and igpo/cpu/hf_rollout.py
# check before generating ("... leaves no room to generate within ..."); vLLM's own input validation says "longer
# than the maximum model length"; OpenAI-style front ends say "maximum context length".
_CONTEXT_OVERFLOW_PHRASES = ("leaves no room to generate", "maximum model length", "maximum context length")


def is_context_overflow(err: BaseException) -> bool:
    """A ValueError whose message says the prompt is too long (Ray re-raises it as a RayTaskError subclassing the
    original class, or, when it cannot, keeps the original as ``cause``)."""
    for candidate in (err, getattr(err, "cause", None)):
        if isinstance(candidate, ValueError) and any(p in str(candidate) for p in _CONTEXT_OVERFLOW_PHRASES):
            return True
    return False


class ToolCaller(Protocol):
    """What the loop needs from a tool client (``tool_server.client.ToolClient`` satisfies it).

    ``call`` returns an object with ``ok: bool``, ``text: str``, ``error_kind: None | "infra" | "bad_request" |
    "no_results" | "budget"``; it must not mutate ``arguments``.
    """

    async def call(self, name: str, arguments: dict) -> Any: ...



@dataclass
class _Settings:
    agent: AgentLoopConfig
    scoring: RolloutScoringConfig
    info_gain: InfoGainConfig | None
    seed: int | None = None


def request_seed(*parts: Any) -> int:
    """A sampling seed (63 bits) that depends only on ``parts``: the run's seed, the step, the prompt's uid, the
    trajectory's stream (session or ARPO tree index), the turn and the resample attempt. The engine samples each
    request from its own generator seeded with it (vLLM's per-request ``seed``; the CPU hf server likewise), so a
    trajectory's tokens do not depend on which other requests shared its batch or arrived first."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass
class _BatchProgress:
    started: int = 0
    finished: int = 0
    cut: bool = False


@dataclass
class _LoopState:
    """Per-process, per-event-loop shared state (verl instantiates one loop object per trajectory)."""

    tool_clients: dict[tuple[str, float], Any] = field(default_factory=dict)
    semaphores: dict[int, asyncio.Semaphore] = field(default_factory=dict)
    batches: dict[Any, _BatchProgress] = field(default_factory=dict)


_SETTINGS: dict[int, tuple[Any, _Settings]] = {}
# The tool calls this process's agent loops sent, by status (ok, no_results, bad_request, infra_error): the trainer
# reads them from each agent-loop worker to report tool calls per Ray node (igpo.integration.node_reach.tool_calls_by_node).
TOOL_CALLS: Counter = Counter()

_LOOP_STATES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState]" = weakref.WeakKeyDictionary()


def _loop_state() -> _LoopState:
    loop = asyncio.get_running_loop()
    state = _LOOP_STATES.get(loop)
    if state is None:
        state = _LOOP_STATES[loop] = _LoopState()
    return state


def _settings_for(trainer_config: Any) -> _Settings:
    """Parse and validate ``algorithm.igpo`` once per trainer config object (cached per process)."""
    cached = _SETTINGS.get(id(trainer_config))
    if cached is not None and cached[0] is trainer_config:
        return cached[1]
    # The trainer validates the whole algorithm.igpo section at start-up (igpo.config.IGPOConfig); the loop reads
    # the keys it uses.
    section = plain_section((trainer_config.get("algorithm") or {}).get("igpo", None))
    scoring = RolloutScoringConfig.from_dict(section)
    info_gain = info_gain_config_from(section) if scoring.score_on == "rollout" else None
    seed = trainer_config.get("seed")
    settings = _Settings(AgentLoopConfig.from_dict(section.get("agent")), scoring, info_gain,
                         None if seed is None else int(seed))
    _SETTINGS[id(trainer_config)] = (trainer_config, settings)
    return settings


def shared_tool_client(url: str, timeout_s: float) -> Any:
    """One ``ToolClient`` per process, event loop, URL and timeout (its HTTP pool is bound to the loop)."""
    state = _loop_state()
    client = state.tool_clients.get((url, timeout_s))
    if client is None:
        from tool_server.client import ToolClient

        client = state.tool_clients[(url, timeout_s)] = ToolClient(url, timeout_s=timeout_s)
    return client


def batch_key(kwargs: dict[str, Any]) -> Any:
    """Trajectories of one worker batch share the global step they were launched for."""
    step = kwargs.get("global_steps")
    try:
        return int(step)
    except (TypeError, ValueError):
        return repr(step)


class IGPOAgentLoop(AgentLoopBase):
    """Deep-research agent loop (search / visit tools) with exact per-turn token bookkeeping for IGPO.

    verl instantiates it per trajectory with ``trainer_config, server_manager, tokenizer, processor, dataset_cls,
    data_config, hf_model_type, tools``. ``tool_caller`` (an object with ``async call(name, arguments)``) replaces
    the shared ``ToolClient`` built from ``algorithm.igpo.agent.tool_server_url`` — the hook for tests and custom
    tool back-ends. All knobs come from ``algorithm.igpo`` (see ``igpo.agent.agent_config``).
    """

    def __init__(self, *args: Any, tool_caller: ToolCaller | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = _settings_for(self.config)
        self.cfg = self.settings.agent
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        max_model_len = self.rollout_config.get("max_model_len")
        # The engine refuses a prompt that leaves no room to generate within max_model_len. When it is null the
        # engine uses the model's max_position_embeddings, which the trainer's config check writes into the config.
        self.max_model_len = int(max_model_len) if max_model_len is not None else None
        budget = self.cfg.max_context_tokens or self.prompt_length + self.response_length
        self.max_context = budget if self.max_model_len is None else min(budget, self.max_model_len)
        template_kwargs = dict(self.apply_chat_template_kwargs or {})
        self.template_kwargs = template_kwargs
        self.frame = frame_for(self.tokenizer, template_kwargs)
        if tool_caller is None and self.cfg.tool_server_url is None:
            raise AgentTemplateError(
                "algorithm.igpo.agent.tool_server_url is not set; the igpo_agent loop needs the tool service "
                "(start tool_server and pass its URL, e.g. "
                "+algorithm.igpo.agent.tool_server_url=http://127.0.0.1:8001)."
            )
        self._tool_caller = tool_caller
        self._system_prompt = self.cfg.system_prompt or protocol.default_prompt_for(self.cfg.tool_names)
        self._seed_stream: int | None = None  # the ARPO tree sets its member's index; else the session id

    def _seed_key(self, kwargs: dict[str, Any]) -> tuple | None:
        """What makes this trajectory's sampling reproducible: the run's ``seed``, the step, the prompt's uid (made
        deterministic by the trainer) and the trajectory's stream. None (engine-random sampling) without a seed or
        without verl's v1 session id."""
        stream = self._seed_stream if self._seed_stream is not None else kwargs.get("session_id")
        if self.settings.seed is None or stream is None or kwargs.get("uid") is None:
            return None
        return (self.settings.seed, batch_key(kwargs), str(kwargs["uid"]), int(stream))

    # ------------------------------------------------------------------ entry point

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One session; one that raises is recorded for the trainer (igpo.agent.failures) before verl's worker
        logs it and marks the prompt failed."""
        try:
            return await self._run(sampling_params, **kwargs)
        except Exception as err:
            await failures.record(kwargs, err)
            raise

    async def _run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        state = _loop_state()
        key = batch_key(kwargs)
        progress = state.batches.setdefault(key, _BatchProgress())
        progress.started += 1
        traj = Trajectory(request_id=uuid4().hex, seed_key=self._seed_key(kwargs))
        try:
            async with self._slot(state):
                await self._rollout(traj, sampling_params, kwargs, progress)
        except SampleError as err:
            logger.warning("igpo_agent: sample %s becomes a dummy output: %s", kwargs.get("index"), err)
            traj.record.error = str(err)
        finally:
            if traj.scoring is not None:
                traj.scoring.cancel()
            self._finish(state, key, progress)
        return self._output(traj, kwargs)

    def _slot(self, state: _LoopState) -> Any:
        limit = self.cfg.max_concurrent_trajectories
        if limit == 0:
            return NoLimit()
        sem = state.semaphores.get(limit)
        if sem is None:
            sem = state.semaphores[limit] = asyncio.Semaphore(limit)
        return sem

    def _finish(self, state: _LoopState, key: Any, progress: _BatchProgress) -> None:
        """Count a finished trajectory; cut the batch's stragglers once ``completion_cutoff`` of it is done."""
        progress.finished += 1
        cutoff = self.cfg.completion_cutoff
        if cutoff < 1.0 and progress.started >= 2 and progress.finished >= math.ceil(cutoff * progress.started):
            progress.cut = True
        if progress.finished >= progress.started and state.batches.get(key) is progress:
            del state.batches[key]

    # ------------------------------------------------------------------ the loop

    async def _rollout(
        self, traj: Trajectory, sampling_params: dict[str, Any], kwargs: dict[str, Any], progress: _BatchProgress
    ) -> None:
        cfg, frame = self.cfg, self.frame
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        if not messages or messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self._system_prompt})
        if self.settings.info_gain is not None:
            traj.scoring = AnswerScoring(self.server_manager, traj.request_id, self._probes(kwargs),
                                         self.settings.info_gain, self.max_model_len)
        aliases = _aliases(kwargs)
        targets = hop_targets(kwargs.get("extra_info"))
        traj.record.hop_total = len(targets)
        max_turns = self._draw_max_turns(traj.seed_key)

        prompt_ids = self._render_prompt(messages)
        reason = "max_turns" if max_turns == 1 else "cutoff" if progress.cut else None
        if reason is None and not self._tool_turn_fits(len(prompt_ids), self._limit(len(prompt_ids))):
            reason = "context"
        if reason is not None:
            messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{protocol.ANSWER_NOW[reason]}"}
            prompt_ids = self._render_prompt(messages)
        if len(prompt_ids) > self.prompt_length:
            raise SampleError(
                f"prompt has {len(prompt_ids)} tokens > rollout.prompt_length={self.prompt_length}; raise "
                "data.max_prompt_length / rollout.prompt_length or shorten the system prompt."
            )
        traj.prompt_len = len(prompt_ids)
        traj.context = list(prompt_ids)
        limit = self._limit(traj.prompt_len)
        seen_calls: dict[str, int] = {}

        for j in range(max_turns):
            if reason is not None:
                traj.record.forced_final = True
                traj.record.cutoff = traj.record.cutoff or reason == "cutoff"
            boundary = len(traj.context)
            if limit - boundary < 2:  # not even one token plus the end-of-turn token fits
                traj.record.truncated, traj.record.stop_reason = True, "context"
                break
            traj.record.boundaries.append(boundary)
            if traj.scoring is not None:
                traj.scoring.schedule(traj.record, traj.context, j, boundary)

            try:
                ids, logprobs, text, parsed = await self._generate_turn(
                    traj, sampling_params, min(cfg.max_tokens_per_turn, limit - boundary - 1), seen_calls, reason
                )
            except Exception as err:  # noqa: BLE001 - only a too-long prompt is handled; the rest propagates
                if not is_context_overflow(err):
                    raise
                # The context limit did not match the engine's (max_model_len null, or larger than the engine
                # uses). Ending this trajectory keeps the rest of the worker's batch, which an exception would lose.
                logger.warning("igpo_agent: the engine refused a context of %d tokens as too long; the trajectory "
                               "ends truncated. Check rollout.max_model_len against the engine: %s", boundary, err)
                traj.record.boundaries.pop()  # boundary j has no turn
                if traj.scoring is not None:
                    traj.scoring.cancel(j)
                traj.record.truncated, traj.record.stop_reason, traj.record.context_overflow = True, "context", True
                break
            ended = bool(ids) and ids[-1] == frame.eot_id
            traj.append(ids, True, logprobs)
            traj.record.turn_ends.append(len(traj.context) - traj.prompt_len - 1)
            traj.record.turn_versions.append(traj.turn_version)
            if not ended:  # the engine stopped at max_tokens (or aborted): close the turn for the template.
                # The policy did not sample this token, so it is not trained on (mask 0).
                traj.append([frame.eot_id], False)
                traj.record.eos_appended += 1
            if not ids:
                # An empty generation (an abort) has no token of its own: its turn ends on the untrained end-of-turn
                # token just appended, never on the previous observation (or -1 for a first turn). The trainer keeps
                # its rewards as positions outside the loss mask and counts it (igpo/empty_turns).
                traj.record.turn_ends[-1] = len(traj.context) - traj.prompt_len - 1
                traj.record.empty_turns += 1
            reference_rules = cfg.turn_rules == "reference"
            if reference_rules:  # the reference stores, checks and scores the tag-fixed text
                text = reference_tag_fix(text, frame.think_prefilled)
            traj.record.final_turn_text = text

            if reason is not None or parsed.kind == "answer":
                if targets:
                    traj.record.hop_right.append(False)
                traj.record.tool_names.append(None)
                traj.record.tool_status.append("answer" if parsed.kind == "answer" else "none")
                traj.record.format_ok.append(reference_turn_ok(text, final=True) if reference_rules else
                                             check_answer_turn(text, think_prefilled=frame.think_prefilled,
                                                               require_think=cfg.require_think))
                traj.record.final_answer = parsed.answer if parsed.kind == "answer" else None
                traj.record.stop_reason = reason or "answer"
                traj.record.truncated = traj.record.truncated or not ended
                break

            name, status, content = await self._act(traj, parsed, seen_calls, j)
            if targets:  # diagnostics: did this call make the chain's next correct hop (and reach its passage)?
                reached = sum(traj.record.hop_right)
                traj.record.hop_right.append(status == "ok" and reached < len(targets)
                                             and query_names(parsed.arguments, targets[reached]))
            traj.record.tool_names.append(name)
            traj.record.tool_status.append(status)
            traj.record.format_ok.append(reference_turn_ok(text, final=False) if reference_rules else
                                         check_tool_turn(text, think_prefilled=frame.think_prefilled,
                                                         require_think=cfg.require_think))

            # Decide whether turn j+1 must be the final one, then close turn j with its observation.
            after_turn = len(traj.context)
            reason = "max_turns" if j + 2 >= max_turns else "cutoff" if progress.cut else None
            content_ids = encode_content(self.tokenizer, content)
            obs = frame.observation(content_ids, None, cfg.max_observation_tokens, self.tokenizer)
            if reason is None and not self._tool_turn_fits(after_turn + len(obs), limit):
                reason = "context"
            if reason is not None:
                # Leave a whole final turn when possible by shrinking this observation.
                frame_len = len(frame.prefix_ids) + len(frame.suffix_ids[reason])
                room = limit - after_turn - frame_len - cfg.max_tokens_per_turn - 1
                budget = max(0, min(cfg.max_observation_tokens, room))
                obs = frame.observation(content_ids, reason, budget, self.tokenizer)
                if after_turn + len(obs) + 2 > limit:
                    traj.record.truncated, traj.record.stop_reason = True, "context"
                    break
            else:
                budget = cfg.max_observation_tokens
            traj.append(obs, False)
            traj.observations += 1
            if aliases:  # diagnostics: did the observation the policy saw hold the answer? (IG should follow it)
                shown = content if len(content_ids) <= budget else self.tokenizer.decode(content_ids[:budget])
                traj.record.answer_seen.append(contains_answer(shown, aliases))

        if traj.scoring is not None:
            await traj.scoring.collect(traj.record)

    async def _generate_turn(
        self,
        traj: Trajectory,
        sampling_params: dict[str, Any],
        max_tokens: int,
        seen_calls: dict[str, int],
        final_reason: str | None,
    ) -> tuple[list[int], list[float] | None, str, protocol.ParsedTurn]:
        """Sample one turn; resample (bounded) an empty / repetitive turn or a repeated tool call."""
        cfg, frame = self.cfg, self.frame
        params = {**sampling_params, "max_tokens": max_tokens}
        attempt = 0
        while True:
            if traj.seed_key is not None:
                params["seed"] = request_seed(*traj.seed_key, len(traj.record.boundaries), attempt)
            start = time.perf_counter()
            out = await self.server_manager.generate(
                request_id=traj.request_id, prompt_ids=traj.context, sampling_params=params
            )
            traj.generate_s += time.perf_counter() - start
            traj.merge_server_fields(out)
            # An engine that overshoots max_tokens would break the context budget: keep what was asked for.
            ids = list(out.token_ids)[:max_tokens]
            body = ids[:-1] if ids and ids[-1] == frame.eot_id else ids
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            if cfg.turn_rules == "reference":
                parsed = protocol.parse_turn_reference(reference_tag_fix(text, frame.think_prefilled))
            else:
                parsed = protocol.parse_turn(text)
            retry = protocol.is_degenerate(text, cfg.repetition_window, cfg.repetition_max_repeats) or (
                cfg.dedup_tool_calls
                and final_reason is None
                and parsed.kind == "tool_call"
                and protocol.call_key(parsed.name, parsed.arguments) in seen_calls
            )
            if retry and attempt < cfg.max_generation_retries:
                attempt += 1
                traj.record.retries += 1
                continue
            logprobs = list(out.log_probs)[:max_tokens] if out.log_probs is not None else None
            if logprobs is None or len(logprobs) != len(ids):
                traj.logprobs = None  # the engine did not return per-token log-probs: report none rather than fake
            return ids, logprobs, text, parsed

    async def _act(
        self, traj: Trajectory, parsed: protocol.ParsedTurn, seen_calls: dict[str, int], turn: int
    ) -> tuple[str | None, str, str]:
        """Run the turn's tool call; return (tool name, status, observation content)."""
        if parsed.kind == "malformed":
            return None, "malformed", protocol.malformed_call_message(parsed.error or "malformed turn")
        name = parsed.name
        if name not in self.cfg.tool_names:
            return name, "bad_request", protocol.unknown_tool_message(name, self.cfg.tool_names)
        key = protocol.call_key(name, parsed.arguments)  # snapshot before the call: a client may not mutate it
        if self.cfg.dedup_tool_calls and key in seen_calls:
            return name, "duplicate", protocol.duplicate_call_message(seen_calls[key])
        caller = self._tool_caller or shared_tool_client(self.cfg.tool_server_url, self.cfg.tool_timeout_s)
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(caller.call(name, parsed.arguments), timeout=self.cfg.tool_timeout_s)
        except asyncio.TimeoutError:
            status, text = "infra_error", f"Error: the {name} tool timed out after {self.cfg.tool_timeout_s:g} s."
        except Exception as err:  # noqa: BLE001 - any client failure is an infrastructure error of this turn
            logger.warning("igpo_agent: tool %s raised %s", name, type(err).__name__)
            status, text = "infra_error", f"Error: the {name} tool failed ({type(err).__name__})."
        else:
            status = _STATUS_OF_ERROR_KIND.get(None if result.ok else result.error_kind, "infra_error")
            text = result.text or f"Error: the {name} tool returned no text ({status})."
        traj.tool_s += time.perf_counter() - start
        TOOL_CALLS[status] += 1
        if status == "infra_error":
            traj.record.infra_errors += 1
        else:  # an infrastructure failure may be retried by the model without counting as a duplicate
            seen_calls.setdefault(key, turn)
        return name, status, text

    # ------------------------------------------------------------------ budget helpers

    def _limit(self, prompt_len: int) -> int:
        """Largest context length: the context budget, and the response never longer than response_length."""
        return min(self.max_context, prompt_len + self.response_length)

    def _tool_turn_fits(self, context_len: int, limit: int) -> bool:
        """Can the next turn be a tool call? It, a worst-case observation and then a final turn must all fit."""
        turn = self.cfg.max_tokens_per_turn + 1
        observation = self.cfg.max_observation_tokens + self.frame.max_frame_len
        return context_len + turn + observation + turn <= limit

    def _draw_max_turns(self, seed_key: tuple | None = None) -> int:
        jitter = self.cfg.max_turns_jitter
        if jitter == 0:
            return self.cfg.max_turns
        draw = random.Random(request_seed(*seed_key, "max_turns")).random() if seed_key else random.random()
        return max(1, self.cfg.max_turns + int((2.0 * draw - 1.0) * jitter))

    def _render_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ rollout-side answer scoring

    def _probes(self, kwargs: dict[str, Any]) -> list[Probe]:
        template = self.settings.scoring.answer_template(self.frame.eot_text)
        try:
            ground_truth = (kwargs.get("reward_model") or {})["ground_truth"]
            return answer_probes(self.tokenizer, ground_truth, template, self.settings.info_gain.answer_alias)
        except (KeyError, TypeError, ValueError) as err:
            raise SampleError(f"cannot build the answer probe from reward_model.ground_truth: {err}") from err

    # ------------------------------------------------------------------ output

    def _output(self, traj: Trajectory, kwargs: dict[str, Any]) -> AgentLoopOutput:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.frame.eot_id
        return traj.to_output(kwargs, step=batch_key(kwargs), pad_id=pad, eot_id=self.frame.eot_id,
                              response_length=self.response_length, scored=self.settings.info_gain is not None)


_STATUS_OF_ERROR_KIND = {
    None: "ok",
    "no_results": "no_results",
    "bad_request": "bad_request",
    "infra": "infra_error",
    "budget": "infra_error",
}


def _aliases(kwargs: dict[str, Any]) -> list[str]:
    """The sample's gold aliases for the answer-seen diagnostics; [] (not an error) when it has none."""
    try:
        return parse_ground_truth((kwargs.get("reward_model") or {})["ground_truth"])
    except (KeyError, TypeError, ValueError):
        return []


def query_names(arguments: Any, entity: str) -> bool:
    """Whether a search call's ``query`` (a string or a list of strings) names ``entity`` as a whole word: "@Talven"
    matches "@Talven" and "who is @Talven?", not "@Talvenor"."""
    query = arguments.get("query") if isinstance(arguments, dict) else None
    if isinstance(query, str):
        queries = [query]
    else:
        queries = [q for q in query if isinstance(q, str)] if isinstance(query, list) else []
    pattern = re.compile(rf"(?<![\w@#]){re.escape(entity)}(?!\w)")
    return any(pattern.search(q) for q in queries)


class NoLimit:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: Any) -> None:
        return None
