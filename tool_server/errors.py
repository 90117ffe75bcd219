"""Structured tool errors: every failure that reaches a caller is one of four kinds.

- ``infra``: our side or an upstream failed (timeout, 5xx, connection reset, malformed upstream reply, bad
  credentials). Not the model's fault; a trainer may drop or down-weight the trajectory.
- ``bad_request``: the call itself is invalid (unknown tool, bad arguments, a URL we refuse to fetch).
- ``budget``: the run's paid-call budget for an upstream is spent; nothing more will be called.
- ``no_results``: the call worked and found nothing (empty search, unreadable or empty page).
"""
from __future__ import annotations

from typing import Literal

ErrorKind = Literal["infra", "bad_request", "budget", "no_results"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("infra", "bad_request", "budget", "no_results")

# When several items of one request fail differently, the response reports the most severe kind: an infra or
# budget failure must not hide behind another item's "no results".
_SEVERITY: dict[str, int] = {"infra": 3, "budget": 2, "bad_request": 1, "no_results": 0}


class ToolError(Exception):
    """A failure with a kind the caller can act on; ``message`` is safe to show the model (no secrets)."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool = False, reason: str | None = None) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"ToolError kind={kind!r} is not one of {ERROR_KINDS}")
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.retryable = retryable
        # the failure class behind an infra error (connection, timeout, http_503, bad_reply, config, credentials):
        # what /health and the trainer's infra breaker report; None when the kind says enough
        self.reason = reason

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "retryable": self.retryable}


def most_severe(errors: list[ToolError]) -> ToolError:
    return max(errors, key=lambda e: _SEVERITY[e.kind])
