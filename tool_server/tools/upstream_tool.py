"""A tool that calls an outside HTTP service itself: one module holding its upstream call, its budget and price
name, and its error classification, plus one ``register(...)`` line (``tool_server.tools``).

The server derives the rest from the registered tools: the ``--budget-<name>`` flag of the tool's ``BudgetFlag``,
the upstream's line in ``/stats``, ``/health`` and ``/metrics`` (under ``upstream``, the name the trainer's
``tools.price_per_1k.<upstream>`` prices), and an ``Upstream`` with every guard (concurrency limit, token bucket,
retries on 429/5xx/timeouts/resets, the budget, bounded bodies, URL checks on every redirect hop). A tool that
upper-cases what an echo service sends back:

    class EchoTool(UpstreamTool):
        name = "echo"
        schema = {...}; arguments = ("text",); request_model = EchoRequest; argument_words = "the text"
        upstream = "echo"                                   # /stats name and price key
        budgets = (BudgetFlag("echo", "max echo service calls this run"),)
        base_url_env = "ECHO_BASE_URL"                      # the endpoint, from the environment or --env-file
        default_base_url = "https://echo.example.com"

        def request(self, arguments): ...                   # client side, as for every tool
        async def call_upstream(self, endpoint, request, deadline):
            return await endpoint.request("POST", "/echo", deadline=deadline, json_body={"text": request.text})
        def render(self, request, response):
            return response.json()["text"].upper(), []

``classify`` turns an answer the upstream gave (HTTP 2xx-4xx; 429 and 5xx were retried already) into a
``ToolError``, or None when it is usable; the default blames credentials on 401/402/403 and our configuration on
every other 4xx, both ``infra`` (not the model's fault). ``render`` may raise ``ToolError`` too (a malformed reply
is ``infra``; an empty answer ``no_results``).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from ..config import UpstreamLimits
from ..errors import ToolError
from ..upstream import Upstream, UpstreamResponse
from .base import Tool, ToolResponse

_CREDENTIAL_STATUSES = (401, 402, 403)
# a guard a little after the call's own deadline: Upstream honours the deadline itself, this only catches a tool
# whose call_upstream does not
_GRACE_S = 1.0


@dataclass
class Endpoint:
    """The outside service as its tool sees it: the base URL (from ``base_url_env`` or the default), the key (from
    ``key_env``; None without one) and ``request``, which sends through the tool's ``Upstream``."""

    base_url: str
    key: str | None = field(repr=False)
    upstream: Upstream

    async def request(self, method: str, path: str, *, deadline: float, headers: dict[str, str] | None = None,
                      json_body: Any = None,
                      oversize: Literal["error", "truncate"] = "error") -> UpstreamResponse:
        """``method`` ``base_url + path`` with the upstream's retries, limits and budget; any answer but 429/5xx
        comes back (``classify`` judges it), every other failure raises ``ToolError``."""
        return await self.upstream.request(method, self.base_url + path, deadline=deadline, headers=headers,
                                           json_body=json_body, oversize=oversize)


class UpstreamTool(Tool):
    """Base class of a tool that calls one outside HTTP service; subclasses set the class attributes below (and
    ``Tool``'s), and implement ``request``, ``call_upstream`` and ``render``."""

    upstream: ClassVar[str]
    """The service's name in ``/stats``, ``/health`` and ``/metrics``, and the trainer's price key
    (``tools.price_per_1k.<upstream>``)."""
    base_url_env: ClassVar[str]
    """The environment variable (or ``--env-file`` line) that points the tool at its service (a test fake, a
    proxy); without it, ``default_base_url``."""
    default_base_url: ClassVar[str | None] = None
    key_env: ClassVar[str | None] = None
    """The environment variable holding the service's key; the server refuses to start without it when set."""
    limits: ClassVar[UpstreamLimits] = UpstreamLimits()
    """Concurrency, rate, timeouts and retries of the calls (the budget comes from the tool's budget flag)."""
    deadline_s: ClassVar[float] = 30.0
    """Wall-clock limit of one call, retries included."""

    async def call_upstream(self, endpoint: Endpoint, request: BaseModel, deadline: float) -> UpstreamResponse:
        """Call the service for a validated request (``endpoint.request``), by ``deadline`` (time.monotonic())."""
        raise NotImplementedError

    def classify(self, response: UpstreamResponse) -> ToolError | None:
        """What an answer of the service means: None when ``render`` can use it, else the error to report."""
        if response.status in _CREDENTIAL_STATUSES:
            return ToolError("infra", f"{self.upstream} refused our credentials (HTTP {response.status}); check "
                                      f"{self.key_env or 'its key'} and the account", reason="credentials")
        if response.status >= 400:
            return ToolError("infra", f"{self.upstream} refused our request (HTTP {response.status}); a "
                                      f"configuration mismatch: check {self.base_url_env}", reason="config")
        return None

    def render(self, request: BaseModel, response: UpstreamResponse) -> tuple[str, list[dict]]:
        """The observation text the model reads and the structured results of a usable answer."""
        raise NotImplementedError

    def subject(self, request: BaseModel) -> str:
        """What a call is about, in the log and in an error observation."""
        return request.model_dump_json()[:200]

    async def execute(self, service: Any, request: BaseModel) -> ToolResponse:
        endpoint: Endpoint = service.endpoints[self.upstream]
        subject = self.subject(request)
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s + _GRACE_S):
                response = await self.call_upstream(endpoint, request, start + self.deadline_s)
            error = self.classify(response)
            if error is not None and error.kind == "infra":  # the service's fault or ours: /health shows it
                raise endpoint.upstream.blame(error, error.reason or error.kind)
            if error is not None:
                raise error
            text, results = self.render(request, response)
            outcome = ToolResponse(ok=True, text=text, results=results)
        except TimeoutError:
            error = ToolError("infra", f"{self.name} exceeded its {self.deadline_s:g}s deadline", retryable=True)
            outcome = ToolResponse(ok=False, text=self.render_error(subject, error), results=[], error=error)
        except ToolError as error:
            error.message = service.redact(error.message)
            outcome = ToolResponse(ok=False, text=self.render_error(subject, error), results=[], error=error)
        service.stats.record(self.name, time.monotonic() - start, outcome.error.kind if outcome.error else None)
        return outcome
