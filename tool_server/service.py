"""The tool service: per-item cache, in-flight de-duplication, hard deadlines, stats, and the one text rendering
the model sees. One item = one query or one URL; a request with several items runs them concurrently.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from .backends.base import Backend, PageResult, SearchHit
from .cache import ResponseCache, cache_key, normalize_text
from .config import ServerConfig
from .errors import ToolError, most_severe
from .limits import InflightDedup
from .stats import Stats

log = logging.getLogger("tool_server")

ITEM_SEPARATOR = "\n=======\n"
# a deadline guard a little after the item's own deadline: upstream code honours the deadline itself, this only
# catches a path that does not (it must never be what normally ends a call)
_GRACE_S = 1.0


@dataclass
class ToolResponse:
    ok: bool
    text: str
    results: list[dict]
    error: ToolError | None = None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "text": self.text, "results": self.results,
                "error": self.error.to_dict() if self.error else None}


@dataclass
class _Item:
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
_Run = Callable[[float], Awaitable["list[SearchHit] | PageResult"]]


def render_search(query: str, hits: list[SearchHit]) -> str:
    if not hits:
        return f"No results found for '{query}'. Try a more general query."
    lines = [f"A search for '{query}' found {len(hits)} results:", ""]
    for k, hit in enumerate(hits, 1):
        lines.append(f"{k}. [{hit.title}]({hit.url})")
        if hit.date:
            lines.append(f"Date published: {hit.date}")
        if hit.source:
            lines.append(f"Source: {hit.source}")
        lines.append(hit.snippet)
        lines.append("")
    return "\n".join(lines).rstrip()


def render_page(page: PageResult, goal: str) -> str:
    if page.content is not None:  # a stored corpus page: show it whole
        return f"Page {page.url} (Title: {page.title})\n{page.content}"
    return (f"The useful information in {page.url} for user goal {goal} as follows:\n\n"
            f"Evidence in page:\n{page.evidence}\n\nSummary:\n{page.summary}")


def render_error(tool: str, subject: str, error: ToolError) -> str:
    if error.kind == "no_results" and tool == "search":
        return f"No results found for '{subject}'. Try a more general query."
    advice = {"infra": "The tool service had a temporary failure; this is not your mistake. You may retry later "
                       "or continue without it.",
              "budget": "The tool budget for this run is spent; answer with what you have.",
              "bad_request": "Fix the arguments and call again.",
              "no_results": "Try another URL."}[error.kind]
    return f"[{tool} failed for {subject!r}: {error.message}] {advice}"


class ToolService:
    def __init__(self, config: ServerConfig, backend: Backend, cache: ResponseCache, stats: Stats,
                 redact=lambda s: s) -> None:
        self.config = config
        self.backend = backend
        self.cache = cache
        self.stats = stats
        self.dedup = InflightDedup()
        self._redact = redact

    def redact(self, text: str) -> str:
        """``text`` with every secret of this server masked."""
        return self._redact(text)

    async def search(self, queries: list[str], topk: int) -> ToolResponse:
        items = await asyncio.gather(*(self._item("search", q, {"q": normalize_text(q), "topk": topk},
                                                  self.config.search_deadline_s,
                                                  lambda d, q=q: self.backend.search_one(q, topk, d))
                                       for q in queries))
        texts, results = [], []
        for query, item in zip(queries, items):
            if item.error is None:
                texts.append(render_search(query, item.value))
                empty = None if item.value else ToolError("no_results", f"no results for {query[:200]!r}").to_dict()
                results.append({"query": query, "ok": empty is None, "cached": item.cached,
                                "hits": [h.to_dict() for h in item.value], "error": empty})
            else:
                texts.append(render_error("search", query, item.error))
                results.append({"query": query, "ok": False, "cached": False, "hits": [],
                                "error": item.error.to_dict()})
        return self._respond(texts, results, items)

    async def visit(self, urls: list[str], goal: str) -> ToolResponse:
        items = await asyncio.gather(*(self._item("visit", u, {"url": u.strip(), "goal": normalize_text(goal)},
                                                  self.config.visit_deadline_s,
                                                  lambda d, u=u: self.backend.visit_one(u.strip(), goal, d))
                                       for u in urls))
        texts, results = [], []
        for url, item in zip(urls, items):
            if item.error is None:
                texts.append(render_page(item.value, goal))
                results.append({"url": url, "ok": True, "cached": item.cached, "page": item.value.to_dict(),
                                "error": None})
            else:
                texts.append(render_error("visit", url, item.error))
                results.append({"url": url, "ok": False, "cached": False, "page": None,
                                "error": item.error.to_dict()})
        return self._respond(texts, results, items)

    def _respond(self, texts: list[str], results: list[dict], items: list[_Item]) -> ToolResponse:
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

    async def _item(self, tool: str, subject: str, request: dict, deadline_s: float, run: _Run) -> _Item:
        start = time.monotonic()
        item = await self._item_inner(tool, request, deadline_s, run)
        if item.error is not None:
            item.error.message = self._redact(item.error.message)
        latency = time.monotonic() - start
        self.stats.record(tool, latency, item.outcome)
        log.info("%s %r -> %s%s in %.3fs", tool, subject[:120], item.outcome or "ok",
                 " (cache)" if item.cached else "", latency)
        return item

    async def _item_inner(self, tool: str, request: dict, deadline_s: float, run: _Run) -> _Item:
        key = cache_key(self.backend.namespace(tool), request) if self.backend.cacheable else None
        if key is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self.stats.cache_hits += 1
                return _Item(value=_decode(tool, hit), cached=True)
            self.stats.cache_misses += 1

        async def compute() -> _Item:
            deadline = time.monotonic() + deadline_s
            try:
                async with asyncio.timeout(deadline_s + _GRACE_S):
                    value = await run(deadline)
            except ToolError as exc:
                return _Item(error=exc)
            except TimeoutError:
                return _Item(error=ToolError("infra", f"{tool} exceeded its {deadline_s:.0f}s deadline",
                                             retryable=True))
            except Exception as exc:  # a bug must become a visible infra error, not a hung or dropped call
                log.exception("%s failed unexpectedly", tool)
                return _Item(error=ToolError("infra", f"internal error in {tool}: {type(exc).__name__}",
                                             retryable=False))
            if key is not None:
                self.cache.put(key, _encode(value))
            return _Item(value=value)

        if key is None:
            return await compute()
        item = await self.dedup.run(key, compute)
        self.stats.dedup_joins = self.dedup.joined
        # a fresh ToolError per caller: redaction/mutation of one response must not touch another's
        if item.error is not None:
            err = item.error
            return _Item(error=ToolError(err.kind, err.message, retryable=err.retryable))
        return item


def _encode(value) -> dict:
    if isinstance(value, list):
        return {"hits": [h.to_dict() for h in value]}
    return {"page": value.to_dict()}


def _decode(tool: str, blob: dict):
    if tool == "search":
        return [SearchHit(**h) for h in blob["hits"]]
    return PageResult(**blob["page"])
