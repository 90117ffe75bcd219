"""``search``: one or more queries, the top hits of each (title, URL, snippet), rendered as a numbered list."""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..backends.base import SearchHit
from ..cache import normalize_text
from ..errors import ToolError
from .base import BadToolCall, BudgetFlag, Tool, ToolResponse, check_unicode, str_list


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queries: list[str]
    topk: int | None = None


class SearchTool(Tool):
    name = "search"
    schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": (
                "Web search. Runs each query and returns the top results (title, URL, snippet) for every query. "
                "Use several complementary queries in one call."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {
                        "type": "array",
                        "items": {"type": "string"},
                        "minItems": 1,
                        "description": "One or more search queries.",
                    },
                },
                "required": ["query"],
            },
        },
    }
    arguments = ("query", "topk")
    request_model = SearchRequest
    # one cap on the backend's search upstream, whichever it is (Serper, the retriever, the local index)
    budgets = (BudgetFlag("search", "max Serper (or retriever) calls this run (default: no cap)"),)
    argument_words = "the query, URL or goal"

    def request(self, arguments: dict) -> dict:
        payload: dict = {"queries": str_list(arguments.get("query"), "query")}
        if "topk" in arguments:
            topk = arguments["topk"]
            if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
                raise BadToolCall(f"topk must be a positive integer, got {topk!r}")
            payload["topk"] = topk
        return payload

    def check(self, queries: list[str], topk: int | None, config: Any) -> int:
        """The server's limits on a search; returns the top-k to use (the server's default when None)."""
        if not queries:
            raise ToolError("bad_request", "give at least one query")
        check_unicode(queries, "a query")
        if len(queries) > config.max_queries:
            raise ToolError("bad_request", f"{len(queries)} queries in one call; the limit is {config.max_queries}")
        for q in queries:
            if not q.strip():
                raise ToolError("bad_request", "a query is empty; every query must contain text")
            if len(q) > config.max_query_chars:
                raise ToolError("bad_request", f"a query has {len(q)} characters; the limit is "
                                               f"{config.max_query_chars}")
        topk = config.default_topk if topk is None else topk
        if not 1 <= topk <= config.max_topk:
            raise ToolError("bad_request", f"topk={topk} must be in 1..{config.max_topk}")
        return topk

    async def execute(self, service: Any, request: SearchRequest) -> ToolResponse:
        topk = self.check(request.queries, request.topk, service.config)
        return await self.run(service, request.queries, topk)

    async def run(self, service: Any, queries: list[str], topk: int) -> ToolResponse:
        """Search checked queries (the HTTP route and the Search-R1/FlashRAG endpoints both come here)."""
        items = await asyncio.gather(*(service.item(self, q, {"q": normalize_text(q), "topk": topk},
                                                    service.config.search_deadline_s,
                                                    lambda d, q=q: service.backend.search_one(q, topk, d))
                                       for q in queries))
        texts, results = [], []
        for query, item in zip(queries, items):
            if item.error is None:
                texts.append(self.render(query, item.value))
                empty = None if item.value else ToolError("no_results", f"no results for {query[:200]!r}").to_dict()
                results.append({"query": query, "ok": empty is None, "cached": item.cached,
                                "hits": [h.to_dict() for h in item.value], "error": empty})
            else:
                texts.append(self.render_error(query, item.error))
                results.append({"query": query, "ok": False, "cached": False, "hits": [],
                                "error": item.error.to_dict()})
        return service.respond(texts, results, items)

    def render(self, query: str, hits: list[SearchHit]) -> str:
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

    def render_error(self, subject: str, error: ToolError) -> str:
        if error.kind == "no_results":
            return f"No results found for '{subject}'. Try a more general query."
        return super().render_error(subject, error)

    def encode(self, value: list[SearchHit]) -> dict:
        return {"hits": [h.to_dict() for h in value]}

    def decode(self, blob: dict) -> list[SearchHit]:
        return [SearchHit(**h) for h in blob["hits"]]
