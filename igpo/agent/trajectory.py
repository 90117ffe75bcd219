"""One ``igpo_agent`` rollout's working state: the token sequence with its loss mask and log-probs, the ``TurnRecord``
that reaches the trainer, the rollout-side scoring requests, timings and the weight versions the engine reported;
and the ``AgentLoopOutput`` verl receives at the end (``Trajectory.to_output``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from igpo.agent.answer_scoring import AnswerScoring
from igpo.agent.records import TurnRecord


@dataclass
class Trajectory:
    """Everything one rollout accumulates; turned into an ``AgentLoopOutput`` at the end. ``record`` holds what
    reaches the trainer per turn (``TurnRecord``); the rest is the loop's own working state."""

    request_id: str
    seed_key: tuple | None = None  # (run seed, step, uid, stream): per-request sampling seeds (``request_seed``)
    prompt_len: int = 0
    context: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    record: TurnRecord = field(default_factory=TurnRecord)
    observations: int = 0
    scoring: AnswerScoring | None = None  # the rollout-side answer scoring requests (score_on=rollout)
    server_fields: dict[str, Any] = field(default_factory=dict)
    generate_s: float = 0.0
    tool_s: float = 0.0
    num_preempted: int = -1
    turn_version: list | None = None  # [first, last] weight version of the latest generation (merge_server_fields)

    def append(self, ids: list[int], trained: bool, logprobs: list[float] | None = None) -> None:
        self.context.extend(ids)
        self.mask.extend([1 if trained else 0] * len(ids))
        if self.logprobs is not None:
            self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def merge_server_fields(self, out: Any) -> None:
        """Keep the weight versions the trajectory was generated with (verl's v1 trainer needs both)."""
        fields_ = out.extra_fields or {}
        first = fields_.get("min_global_steps", fields_.get("global_steps"))
        if "min_global_steps" not in self.server_fields:
            self.server_fields["min_global_steps"] = first
        latest = fields_.get("max_global_steps", fields_.get("global_steps"))
        if latest is not None:
            self.server_fields["max_global_steps"] = latest
        # verl's asynchronous client resumes an aborted generation on new weights and reports the first and last
        # version it used; the synchronous one reports the one version.
        self.turn_version = None if first is None and latest is None else [first, latest]
        if out.num_preempted is not None:
            self.num_preempted = max(self.num_preempted, 0) + out.num_preempted

    def to_output(self, kwargs: dict[str, Any], *, step: Any, pad_id: int, eot_id: int, response_length: int,
                  scored: bool) -> AgentLoopOutput:
        """verl's output of this trajectory. ``step``: the batch's global step (``batch_key``); ``pad_id`` and
        ``eot_id`` build the dummy of a sample that failed before it had a prompt; ``scored``: rollout-side answer
        scoring is on, so every boundary has an ``answer_logprobs`` entry."""
        if self.prompt_len == 0:  # the sample failed before it had a prompt: a 1-token, fully masked dummy
            self.context, self.prompt_len, self.mask, self.logprobs = [pad_id, eot_id], 1, [0], [0.0]
        prompt_ids = self.context[: self.prompt_len]
        response_ids = self.context[self.prompt_len:]
        if not response_ids:
            response_ids, self.mask, self.logprobs = [eot_id], [0], [0.0]
        if len(response_ids) > response_length:
            raise RuntimeError(
                f"igpo_agent built a response of {len(response_ids)} tokens > rollout.response_length="
                f"{response_length}; the context budget check is broken."
            )
        fallback_step = step if isinstance(step, int) else 0  # no generation happened: the launch step
        record = self.record
        if scored and len(record.answer_logprobs) != len(record.boundaries):
            record.answer_logprobs = [None] * len(record.boundaries)
        if record.error is not None:
            record.stop_reason = "error"
        # The judge needs the question; the reward function receives only the response and the ground truth.
        record.question = next((str(m.get("content", "")) for m in reversed(list(kwargs.get("raw_prompt") or []))
                                if isinstance(m, dict) and m.get("role") == "user"), "")
        extra = record.to_extra_fields()
        extra.update({
            "min_global_steps": self.server_fields.get("min_global_steps", fallback_step),
            "max_global_steps": self.server_fields.get("max_global_steps", fallback_step),
            "turn_scores": [],
            "tool_rewards": [],
        })
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=self.mask,
            response_logprobs=self.logprobs,
            # the user prompt, the assistant turns, the tool responses
            num_turns=1 + len(self.record.turn_ends) + self.observations,
            metrics={
                "generate_sequences": self.generate_s, "tool_calls": self.tool_s, "num_preempted": self.num_preempted,
            },
            extra_fields=extra,
        )
