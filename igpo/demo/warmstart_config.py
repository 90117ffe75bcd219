"""The warm-start's knobs (``WarmStartConfig``), apart from the warm-start itself so that the demo world, which
states the demo model's settings, and the warm-start, which plays the world's questions, import it without importing
each other."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from igpo.demo.titles import DemoDataConfig


@dataclass(frozen=True)
class WarmStartConfig:
    """Knobs of the warm-start. The agent-loop sizes must equal the demo run's ``algorithm.igpo.agent`` values
    (and rollout lengths), or the training sequences differ from the rollouts (observations cut elsewhere).

    max_steps / seconds: training stops after max_steps, or earlier when the wall-time cap is reached (building the
        data is not counted). 600 steps of batch 8 take ~60 s on two idle cores (~0.1 s/step) and give ~97% well-formed
        first search calls; a step-bound run is reproducible, a time-cut one depends on the machine. The default cap
        (1 h) is a guard against a stuck machine, not a budget: on a loaded machine a 3-minute cap cut the run at
        144 of 600 steps and the demo model wrote malformed tool calls, and with other jobs on both cores the 600
        steps took 23 min; a cut run says so on stderr.
    batch_size, lr, warmup_steps, weight_decay, grad_clip: AdamW; linear warm-up, then linear decay to 0.1 lr
        at max_steps (by steps alone: the cap ends a run, it never changes the schedule).
    threads: torch CPU threads while training (restored afterwards).
    examples_per_passage: synthetic questions per training passage, each with its own random snippet (world task:
        trajectories of the warm-start policy per training question).
    max_turns, max_tokens_per_turn, max_observation_tokens, prompt_length, response_length: the loop's sizes (CPU
        demo). max_turns >= 3: with 2 the loop appends the answer-now instruction to the only observation.
    verify_examples: how many synthetic sequences are replayed through the real agent loop as a check.
    system_prompt, tool_names: the loop's ``algorithm.igpo.agent`` values (null: the loop's default prompt).
    topk: passages per search (the demo tool server's ``--default-topk``).
    data: how snippets are drawn and which passages are held out (never trained on).
    """

    seconds: float = 3600.0
    max_steps: int = 600
    batch_size: int = 8
    lr: float = 1e-2
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    threads: int = 2
    examples_per_passage: int = 2
    seed: int = 0
    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_observation_tokens: int = 96
    verify_examples: int = 8
    prompt_length: int = 1024
    response_length: int = 512
    system_prompt: str | None = None
    tool_names: tuple[str, ...] = ("search", "visit")
    topk: int = 5
    data: DemoDataConfig = field(default_factory=DemoDataConfig)

    def __post_init__(self):
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"warm-start: {name}={getattr(self, name)!r}: {rule}")

        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise fail("seconds", "must be a finite number of seconds > 0 (e.g. 180)")
        for name in ("max_steps", "batch_size", "threads", "examples_per_passage", "max_tokens_per_turn",
                     "prompt_length", "response_length", "verify_examples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise fail(name, "must be an integer >= 1")
        if not isinstance(self.max_turns, int) or self.max_turns < 3:
            raise fail("max_turns", "must be an integer >= 3 (the demo's algorithm.igpo.agent.max_turns): with 2 the "
                       "loop appends the answer-now instruction to the only observation")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise fail("warmup_steps", "must be an integer >= 0 (0 = no warm-up)")
        if not (0 < self.lr < 1):
            raise fail("lr", "must be in (0, 1); 1e-2 suits the tiny model")
        if not self.weight_decay >= 0:
            raise fail("weight_decay", "must be >= 0")
        if not self.grad_clip > 0:
            raise fail("grad_clip", "must be > 0 (the max gradient norm)")
        if not isinstance(self.max_observation_tokens, int) or self.max_observation_tokens < 32:
            raise fail("max_observation_tokens", "must be an integer >= 32, as algorithm.igpo.agent requires")

    def agent_section(self) -> dict[str, Any]:
        section = {"max_tokens_per_turn": self.max_tokens_per_turn,
                   "max_observation_tokens": self.max_observation_tokens, "tool_names": list(self.tool_names)}
        if self.system_prompt is not None:
            section["system_prompt"] = self.system_prompt
        return section
