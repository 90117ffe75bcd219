"""What a backend returns: structured results, rendered to text only once, by the service."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol


@dataclass(frozen=True)
class SearchHit:
    """One search result. ``url`` is what a later ``visit`` takes (``corpus://<id>`` for the local corpus)."""

    title: str
    url: str
    snippet: str
    date: str | None = None
    source: str | None = None
    score: float | None = None
    doc_id: str | None = None

    def to_dict(self) -> dict:
        # not dataclasses.asdict: it deep-copies every field, a measurable cost at hundreds of hits per second
        return {f: getattr(self, f) for f in _HIT_FIELDS}


@dataclass(frozen=True)
class PageResult:
    """A visited page: goal-directed ``evidence`` + ``summary`` (web), or the stored ``content`` (local corpus)."""

    url: str
    title: str
    evidence: str | None = None
    summary: str | None = None
    content: str | None = None
    truncated: bool = False  # the page was longer than the token budget and was cut before summarising

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in _PAGE_FIELDS}


_HIT_FIELDS = tuple(f.name for f in fields(SearchHit))
_PAGE_FIELDS = tuple(f.name for f in fields(PageResult))


class Backend(Protocol):
    name: str
    upstream_names: list[str]
    cacheable: bool  # paid upstreams are worth caching; the in-memory corpus is faster than the cache

    def namespace(self, tool: str) -> str:
        """Everything besides the request that changes the answer (endpoint, model, limits): part of the cache key."""

    async def search_one(self, query: str, topk: int, deadline: float) -> list[SearchHit]:
        """Hits for one query, best first, at most ``topk``; ``[]`` means no results. Raises ToolError."""

    async def visit_one(self, url: str, goal: str, deadline: float) -> PageResult:
        """One page. Raises ToolError (``no_results`` for an unreadable or empty page)."""

    async def aclose(self) -> None: ...
