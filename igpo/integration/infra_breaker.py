"""The infrastructure-failure breaker (issue 25): masking keeps a rare outage out of the loss, but a run whose tool
calls keep failing trains on the trajectories that happened not to call a tool, on the wrong data, for as long as
it is left running. The breaker stops such a run.

After every step: ``share = infra failures / tool calls`` of the step's rollouts (a tool call that timed out, got a
5xx, could not reach the tool server or hit a spent budget, over every turn that called a tool). A step with
``share > max_share`` is a strike; ``steps`` strikes in a row save a checkpoint and end the run after that step,
with one line naming the upstream and its failure classes (from the tool server's ``/stats``). A step below the
limit resets the count. ``steps: 0`` turns the breaker off (masking alone then handles every outage).

Configured in the ``tools.infra_breaker`` section (``configs/igpo_base.yaml``); pure bookkeeping, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

FAILURE_PREFIX = "tools/upstream_failures/"  # tools/upstream_failures/<upstream>/<class>: failed attempts in a step


@dataclass(frozen=True)
class InfraBreakerConfig:
    """``max_share``: the share of a step's tool calls that may fail for infrastructure reasons (0-1).
    ``steps``: consecutive steps above it that stop the run (0: never stop)."""

    max_share: float = 0.2
    steps: int = 2

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> "InfraBreakerConfig":
        section = dict(section or {})
        unknown = sorted(set(section) - {"max_share", "steps"})
        if unknown:
            raise ValueError(f"unknown key(s) tools.infra_breaker.{unknown}: known keys are ['max_share', 'steps'] "
                             "(see configs/igpo_base.yaml).")
        config = cls(**{k: v for k, v in section.items() if v is not None})
        try:
            share, steps = float(config.max_share), int(config.steps)
        except (TypeError, ValueError):
            raise ValueError(f"tools.infra_breaker max_share={config.max_share!r}, steps={config.steps!r}: give a "
                             "share in [0, 1) and a whole number of steps, e.g. max_share=0.2 steps=2") from None
        if not 0 <= share < 1:
            raise ValueError(f"tools.infra_breaker.max_share={share} must be in [0, 1): the share of a step's tool "
                             "calls that may fail for infrastructure reasons (0.2 = 20%).")
        if steps < 0 or steps != config.steps:
            raise ValueError(f"tools.infra_breaker.steps={config.steps!r} must be a whole number >= 0 (0 turns the "
                             "breaker off).")
        return cls(max_share=share, steps=steps)


class InfraBreaker:
    """Counts consecutive steps whose infrastructure-failure share exceeds ``max_share``."""

    def __init__(self, config: InfraBreakerConfig) -> None:
        self.config = config
        self.strikes = 0
        self.last_share = 0.0

    def update(self, tool_calls: float, infra_failures: float) -> bool:
        """Record one step; True when the run should stop after it."""
        self.last_share = float(infra_failures) / float(tool_calls) if tool_calls else 0.0
        self.strikes = self.strikes + 1 if self.last_share > self.config.max_share else 0
        return self.config.steps > 0 and self.strikes >= self.config.steps

    def state(self) -> dict:
        return {"strikes": self.strikes}

    def load(self, state: Mapping[str, Any]) -> None:
        self.strikes = int(state.get("strikes", 0))


def failure_classes(metrics: Mapping[str, float]) -> dict[str, dict[str, int]]:
    """{upstream: {failure class: failed attempts}} of one step, from the ``tools/upstream_failures/*`` metrics."""
    out: dict[str, dict[str, int]] = {}
    for key, value in metrics.items():
        if key.startswith(FAILURE_PREFIX) and value:
            upstream, _, reason = key[len(FAILURE_PREFIX):].partition("/")
            out.setdefault(upstream, {})[reason] = int(value)
    return out


ATTEMPTS_NOTE = "(failed requests to the upstream since the previous step, each retry counted)"


def describe_failures(metrics: Mapping[str, float], tool_server_url: str | None) -> str:
    """``retriever: http_503 x12, timeout x2 (failed requests ..., each retry counted)`` for the upstreams that failed
    in the step. The counts are the tool server's failed upstream requests, not failed tool calls: one search may
    send several queries, each tried up to ``max_attempts`` times, so they can exceed the step's tool calls. When no
    upstream failed, the failures were between the agent loop and the tool server (unreachable, timed out) and the
    line names that server."""
    classes = failure_classes(metrics)
    if not classes:
        return (f"the tool server at {tool_server_url} (no upstream failed behind it: it was unreachable or too slow "
                "for algorithm.igpo.agent.tool_timeout_s)")
    return "; ".join(f"{upstream}: " + ", ".join(f"{reason} x{n}" for reason, n in sorted(reasons.items(),
                                                                                         key=lambda kv: -kv[1]))
                     for upstream, reasons in sorted(classes.items())) + " " + ATTEMPTS_NOTE
