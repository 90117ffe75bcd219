"""What a tool is: one class holding everything about it that the parser, the client, the server and the warm-start
need, so adding a tool is one module plus one registration line in ``tool_server.tools``.

A tool states
- ``name`` and ``schema``: the function schema written into the system prompt (the text that describes it);
- ``arguments`` and ``request(arguments)``: the argument names the model may pass, and how the client turns them
  into the HTTP body of ``POST /tools/<name>`` (raising ``BadToolCall``, the model's mistake, before any network);
- ``request_model``: the pydantic model the server validates that body with (unknown keys refused);
- ``execute(service, request)``: how the server runs it, returning a ``ToolResponse`` whose ``text`` is the
  rendered observation the model reads;
- ``render_error``: how a failure reads to the model;
- ``budgets``: the per-run caps on the paid calls it makes, each a ``--budget-<name>`` flag of the server.

A tool that calls an outside HTTP service itself subclasses ``tool_server.tools.upstream_tool.UpstreamTool``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from ..errors import ToolError


@dataclass(frozen=True)
class BudgetFlag:
    """A cap on a tool's paid upstream calls in one run: the server's ``--budget-<name> N`` flag (``help`` is its
    help text); without the flag the calls are not capped. ``python -m tool_server`` has one flag per name the
    registered tools declare."""

    name: str
    help: str

    @property
    def flag(self) -> str:
        return f"--budget-{self.name}"


class BadToolCall(ValueError):
    """The model's call cannot be sent: unknown tool or malformed arguments (a model error, not an infra one)."""


@dataclass
class ToolResponse:
    """What ``POST /tools/<name>`` answers: ``text`` is what the model sees (an error observation when not ok)."""

    ok: bool
    text: str
    results: list[dict]
    error: ToolError | None = None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "text": self.text, "results": self.results,
                "error": self.error.to_dict() if self.error else None}


_ADVICE = {"infra": "The tool service had a temporary failure; this is not your mistake. You may retry later "
                    "or continue without it.",
           "budget": "The tool budget for this run is spent; answer with what you have.",
           "bad_request": "Fix the arguments and call again."}


class Tool:
    """Base class of a tool; subclasses set the class attributes and implement ``request`` and ``execute``."""

    name: ClassVar[str]
    schema: ClassVar[dict[str, Any]]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``, shown to the model verbatim."""
    arguments: ClassVar[tuple[str, ...]]
    """The argument names a call may carry; any other is refused by the client with the list of these."""
    request_model: ClassVar[type[BaseModel]]
    """The HTTP body's model (``extra="forbid"``)."""
    argument_words: ClassVar[str]
    """How the arguments are called in the "shorten ..." advice for an oversized call (e.g. "the code")."""
    no_results_advice: ClassVar[str] = "Try another call."
    budgets: ClassVar[tuple[BudgetFlag, ...]] = ()
    """The budget flags capping this tool's paid upstream calls (none: it calls nothing that costs money)."""

    def request(self, arguments: dict) -> dict:
        """The HTTP body for the model's ``arguments`` (keys already checked against ``arguments``); never mutates
        them. Raises ``BadToolCall`` with words the model can act on."""
        raise NotImplementedError

    async def execute(self, service: Any, request: BaseModel) -> ToolResponse:
        """Run a validated request on the server (``service`` is the ``tool_server.service.ToolService``: config,
        backend, cache, stats). Raise ``ToolError("bad_request", ...)`` for a request beyond the server's limits
        (HTTP 400); every other outcome, failures included, is a ``ToolResponse`` (HTTP 200)."""
        raise NotImplementedError

    def render_error(self, subject: str, error: ToolError) -> str:
        advice = _ADVICE.get(error.kind, self.no_results_advice)
        return f"[{self.name} failed for {subject!r}: {error.message}] {advice}"

    def encode(self, value: Any) -> dict:
        """A cacheable result as plain JSON (only tools whose results the service caches implement it)."""
        raise NotImplementedError(f"the {self.name} tool's results are not cached")

    def decode(self, blob: dict) -> Any:
        raise NotImplementedError(f"the {self.name} tool's results are not cached")


def str_list(value: Any, key: str) -> list[str]:
    """A string or a non-empty list of strings, as a new list (the caller's list is not reused)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise BadToolCall(f"'{key}' must be a non-empty string or a non-empty list of non-empty strings")
    return list(value)


def check_unicode(texts: list[str], what: str) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\udcff"), which no UTF-8 encoder (cache keys, logs, upstream
    requests) accepts: refuse it here as the caller's mistake instead of failing later with a 500."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ToolError("bad_request", f"{what} contains an unpaired UTF-16 surrogate at character {err.start} "
                                           "(\\u{:04x}); send valid Unicode text".format(ord(text[err.start]))) from None
