"""The tool service: runs the registered tools (``tool_server.tools``) with per-item cache, in-flight
de-duplication, hard deadlines and stats. One item = one query or one URL; a request with several items runs them
concurrently, and each tool renders its items' text (the observation the model sees). With ``--latency`` a call
also waits a seeded web-like delay after its work (``tool_server.latency``).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from pydantic import BaseModel

from . import tools
from .backends.base import Backend, PageResult, SearchHit
from .cache import ResponseCache, cache_key
from .config import ServerConfig
from .errors import ToolError, most_severe
from .latency import LatencyDraws
from .limits import InflightDedup
from .stats import Stats
from .tools import ToolResponse
from .tools.upstream_tool import Endpoint

log = logging.getLogger("tool_server")

ITEM_SEPARATOR = "\n=======\n"
# a deadline guard a little after the item's own deadline: upstream code honours the deadline itself, this only
# catches a path that does not (it must never be what normally ends a call)
_GRACE_S = 1.0


@dataclass
class CallItems:
    """How the items of one delayed call were answered: the latency rule skips the delay of a call whose every
    item came from the cache."""

    items: int = 0
    cached: int = 0

    @property
    def all_cached(self) -> bool:
        return self.items > 0 and self.items == self.cached


# The call whose items ``ToolService.item`` is answering. Tools run their items through ``item`` without a handle
# on the call, and gather them in tasks of their own (which copy the context, so they share this object): a context
# variable ties each item to its call without widening the Tool interface. None outside a delayed call.
_CALL_ITEMS: contextvars.ContextVar[CallItems | None] = contextvars.ContextVar("tool_server_call_items", default=None)


@dataclass
class Item:
    """The outcome of one query or URL: a value or an error, never both."""

    value: list[SearchHit] | PageResult | None = None
    error: ToolError | None = None
    cached: bool = False

    @property
    def outcome(self) -> str | None:
        """The error kind for stats; an empty search counts as "no_results" although it is not an error."""
        if self.error is not None:
            return self.error.kind
        return "no_results" if isinstance(self.value, list) and not self.value else None


# runs one item against the backend, given its absolute deadline (time.monotonic())
Run = Callable[[float], Awaitable["list[SearchHit] | PageResult"]]


class ToolService:
    def __init__(self, config: ServerConfig, backend: Backend, cache: ResponseCache, stats: Stats,
                 redact=lambda s: s, endpoints: dict[str, Endpoint] | None = None) -> None:
        self.config = config
        self.backend = backend
        # the outside services of the tools that call one themselves (tools.upstream_tool), by upstream name
        self.endpoints = dict(endpoints or {})
        self.cache = cache
        self.stats = stats
        self.dedup = InflightDedup()
        self.latency = LatencyDraws(config.latency)
        self._redact = redact

    async def aclose(self) -> None:
        """Close the backend's and the tools' upstream connections."""
        await self.backend.aclose()
        for endpoint in self.endpoints.values():
            await endpoint.upstream.aclose()

    def redact(self, text: str) -> str:
        """``text`` with every secret of this server masked."""
        return self._redact(text)

    async def call(self, name: str, request: dict | BaseModel) -> ToolResponse:
        """Run the registered tool ``name`` on ``request`` (its HTTP body, validated here when given as a dict).

        Raises ``BadToolCall`` for an unknown tool, pydantic's ``ValidationError`` for a malformed body and
        ``ToolError("bad_request")`` for a request beyond this server's limits; every other outcome, failures
        included, is the returned response."""
        tool = tools.get(name)
        if not isinstance(request, tool.request_model):
            request = tool.request_model.model_validate(request)
        return await self._delayed(tool.name, request.model_dump(mode="json"), lambda: tool.execute(self, request))

    async def search(self, queries: list[str], topk: int) -> ToolResponse:
        """Search checked queries: what the Search-R1 and FlashRAG endpoints serve, delayed like ``POST
        /tools/search`` (its body's keys, with ``topk`` resolved)."""
        return await self._delayed("search", {"queries": queries, "topk": topk},
                                   lambda: tools.get("search").run(self, queries, topk))

    async def visit(self, urls: list[str], goal: str) -> ToolResponse:
        return await self._delayed("visit", {"urls": urls, "goal": goal},
                                   lambda: tools.get("visit").run(self, urls, goal))

    async def _delayed(self, name: str, arguments: dict,
                       work: Callable[[], Awaitable[ToolResponse]]) -> ToolResponse:
        """Run ``work`` (the tool's call), then wait the call's injected delay (``config.latency``), if any.

        The delay comes after the work and outside its deadlines, so it never turns into a timeout of the tool
        (``search_deadline_s``, ``visit_deadline_s``, an upstream tool's ``deadline_s``); the client's timeout
        still covers work plus delay (``LatencyConfig.cap_s`` keeps the delay below the agent's default). A call
        answered wholly from the cache does not wait: a real cache answers at once, and the web runs being rehearsed
        cache too. A call refused with ``ToolError`` (HTTP 400) does not wait either."""
        delay = self.latency.next_delay(name, arguments)
        if delay is None:
            return await work()
        trace = CallItems()
        token = _CALL_ITEMS.set(trace)
        try:
            response = await work()
        finally:
            _CALL_ITEMS.reset(token)
        if trace.all_cached:
            return response
        await asyncio.sleep(delay)
        self.stats.record_injected(name, delay)
        return response

    async def item(self, tool: tools.Tool, subject: str, request: dict, deadline_s: float, run: Run) -> Item:
        """One query/URL of a request: cached (when the backend is worth caching), shared with an identical call in
        flight, bounded by ``deadline_s``, counted in the stats. ``request`` is what the answer depends on."""
        start = time.monotonic()
        item = await self._item_inner(tool, request, deadline_s, run)
        if item.error is not None:
            item.error.message = self._redact(item.error.message)
        latency = time.monotonic() - start
        self.stats.record(tool.name, latency, item.outcome)
        trace = _CALL_ITEMS.get()
        if trace is not None:
            trace.items += 1
            trace.cached += item.cached
        log.info("%s %r -> %s%s in %.3fs", tool.name, subject[:120], item.outcome or "ok",
                 " (cache)" if item.cached else "", latency)
        return item

    def respond(self, texts: list[str], results: list[dict], items: list[Item]) -> ToolResponse:
        """One response from its items' texts and results; its error is the most severe item error."""
        text = ITEM_SEPARATOR.join(texts)
        if len(text) > self.config.max_text_chars:
            text = text[: self.config.max_text_chars] + "\n[output truncated]"
        errors = [i.error for i in items if i.error is not None]
        hard = [e for e in errors if e.kind != "no_results"]
        search_empty = [i for i in items if i.error is None and isinstance(i.value, list) and not i.value]
        if hard:  # any infra/budget/bad-request failure is reported, even if other items worked
            error = most_severe(hard)
        elif len(errors) + len(search_empty) == len(items):
            error = errors[0] if errors else ToolError("no_results", "the search found no results")
        else:
            error = None
        return ToolResponse(ok=error is None, text=text, results=results, error=error)

    async def _item_inner(self, tool: tools.Tool, request: dict, deadline_s: float, run: Run) -> Item:
        key = cache_key(self.backend.namespace(tool.name), request) if self.backend.cacheable else None
        if key is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self.stats.cache_hits += 1
                return Item(value=tool.decode(hit), cached=True)
            self.stats.cache_misses += 1

        async def compute() -> Item:
            deadline = time.monotonic() + deadline_s
            try:
                async with asyncio.timeout(deadline_s + _GRACE_S):
                    value = await run(deadline)
            except ToolError as exc:
                return Item(error=exc)
            except TimeoutError:
                return Item(error=ToolError("infra", f"{tool.name} exceeded its {deadline_s:.0f}s deadline",
                                             retryable=True))
            except Exception as exc:  # a bug must become a visible infra error, not a hung or dropped call
                log.exception("%s failed unexpectedly", tool.name)
                return Item(error=ToolError("infra", f"internal error in {tool.name}: {type(exc).__name__}",
                                             retryable=False))
            if key is not None:
                self.cache.put(key, tool.encode(value))
            return Item(value=value)

        if key is None:
            return await compute()
        item = await self.dedup.run(key, compute)
        self.stats.dedup_joins = self.dedup.joined
        # a fresh ToolError per caller: redaction/mutation of one response must not touch another's
        if item.error is not None:
            err = item.error
            return Item(error=ToolError(err.kind, err.message, retryable=err.retryable))
        return item

