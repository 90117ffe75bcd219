"""``visit``: open pages (URLs from search results) and return what is relevant to a goal: the stored passage for the
local corpus (``corpus://<id>``), goal-directed evidence and a summary for the web."""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..backends.base import PageResult
from ..cache import normalize_text
from ..errors import ToolError
from .base import BadToolCall, BudgetFlag, Tool, ToolResponse, check_unicode, str_list


class VisitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    urls: list[str]
    goal: str


class VisitTool(Tool):
    name = "visit"
    schema = {
        "type": "function",
        "function": {
            "name": "visit",
            "description": (
                "Open web pages and return a summary of the content that is relevant to the goal, with evidence."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "url": {
                        "type": "array",
                        "items": {"type": "string"},
                        "minItems": 1,
                        "description": "One or more URLs to read (typically taken from search results).",
                    },
                    "goal": {"type": "string", "description": "What information to extract from the pages."},
                },
                "required": ["url", "goal"],
            },
        },
    }
    arguments = ("url", "goal")
    request_model = VisitRequest
    budgets = (BudgetFlag("visit", "max Jina Reader calls this run"),
               BudgetFlag("summary", "max summariser LLM calls this run"))
    argument_words = "the query, URL or goal"
    no_results_advice = "Try another URL."

    def request(self, arguments: dict) -> dict:
        urls = str_list(arguments.get("url"), "url")
        goal = arguments.get("goal")
        if not isinstance(goal, str) or not goal.strip():
            raise BadToolCall("visit needs 'goal': a non-empty string saying what to look for")
        return {"urls": urls, "goal": goal}

    def check(self, urls: list[str], goal: str, config: Any) -> None:
        if not urls:
            raise ToolError("bad_request", "give at least one URL")
        check_unicode(urls, "a URL")
        check_unicode([goal], "the goal")
        if len(urls) > config.max_urls:
            raise ToolError("bad_request", f"{len(urls)} URLs in one call; the limit is {config.max_urls}")
        if any(not u.strip() for u in urls):
            raise ToolError("bad_request", "a URL is empty")
        if not goal.strip():
            raise ToolError("bad_request", "the goal is empty; say what information to look for")
        if len(goal) > config.max_goal_chars:
            raise ToolError("bad_request", f"the goal has {len(goal)} characters; the limit is "
                                           f"{config.max_goal_chars}")

    async def execute(self, service: Any, request: VisitRequest) -> ToolResponse:
        self.check(request.urls, request.goal, service.config)
        return await self.run(service, request.urls, request.goal)

    async def run(self, service: Any, urls: list[str], goal: str) -> ToolResponse:
        items = await asyncio.gather(*(service.item(self, u, {"url": u.strip(), "goal": normalize_text(goal)},
                                                    service.config.visit_deadline_s,
                                                    lambda d, u=u: service.backend.visit_one(u.strip(), goal, d))
                                       for u in urls))
        texts, results = [], []
        for url, item in zip(urls, items):
            if item.error is None:
                texts.append(self.render(item.value, goal))
                results.append({"url": url, "ok": True, "cached": item.cached, "page": item.value.to_dict(),
                                "error": None})
            else:
                texts.append(self.render_error(url, item.error))
                results.append({"url": url, "ok": False, "cached": False, "page": None,
                                "error": item.error.to_dict()})
        return service.respond(texts, results, items)

    def render(self, page: PageResult, goal: str) -> str:
        if page.content is not None:  # a stored corpus page: show it whole
            return f"Page {page.url} (Title: {page.title})\n{page.content}"
        return (f"The useful information in {page.url} for user goal {goal} as follows:\n\n"
                f"Evidence in page:\n{page.evidence}\n\nSummary:\n{page.summary}")

    def encode(self, value: PageResult) -> dict:
        return {"page": value.to_dict()}

    def decode(self, blob: dict) -> PageResult:
        return PageResult(**blob["page"])
