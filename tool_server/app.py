"""HTTP API (FastAPI). Our endpoints: ``/tools/search``, ``/tools/visit``, ``/health``, ``/stats``, ``/metrics``.
Compatible endpoints for existing clients: Search-R1 ``POST /retrieve``; FlashRAG ``POST /search`` and
``POST /batch_search``.

Tool endpoints answer HTTP 200 with ``{"ok", "text", "results", "error"}`` for every tool-level outcome, and
400/413 with the same shape for malformed requests. Compatible endpoints map infra failures to 503 (their clients
retry 5xx), budget to 402 and bad requests to 400.
"""
from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from .backends.base import Backend
from .backends.local import LocalBackend
from .cache import ResponseCache
from .config import Secrets, ServerConfig
from .errors import ToolError
from .probe import probe_backend
from .redact import Redactor
from .service import ToolService
from .stats import Stats

log = logging.getLogger("tool_server")

_COMPAT_STATUS = {"infra": 503, "budget": 402, "bad_request": 400}


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queries: list[str]
    topk: int | None = None


class VisitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    urls: list[str]
    goal: str


class RetrieveRequest(BaseModel):  # Search-R1 dialect; extra keys tolerated as its clients send them
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


class FlashSearchRequest(BaseModel):
    query: str
    top_n: int = 10
    return_score: bool = False


class FlashBatchRequest(BaseModel):
    query: list[str]
    top_n: int = 10
    return_score: bool = False


def build_service(config: ServerConfig, secrets: Secrets | None = None) -> ToolService:
    """Validate the config, load the backend (the local index is built here) and wire cache and stats."""
    config.validate()
    cache = ResponseCache(config.cache_path, ttl_s=config.cache_ttl_s)
    if config.backend == "web":
        if secrets is None:
            raise ValueError("build_service(backend='web') needs Secrets; build them with Secrets.from_env")
        from .backends.web import WebBackend  # imported lazily: the local backend needs no HTTP client
        stats = Stats(WebBackend.upstream_names)
        backend: Backend = WebBackend(config, secrets, stats)
    elif config.backend == "retriever":
        from .backends.retriever import RetrieverBackend

        stats = Stats(RetrieverBackend.upstream_names)
        # the passages a search returns live in the response cache, so a cached search and its visits agree
        backend = RetrieverBackend(config, stats, passages=cache)
    else:
        stats = Stats(LocalBackend.upstream_names)
        # --budget-search caps the search upstream of every backend (build_config puts it in each upstream's limits)
        backend = LocalBackend(config.corpus, index_dir=config.index_dir, stats=stats, budget=config.retriever.budget)
    redactor = Redactor(secrets.values() if secrets else [])
    return ToolService(config, backend, cache, stats, redact=redactor)


def create_app(service: ToolService) -> FastAPI:
    config = service.config

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await service.backend.aclose()
        service.cache.close()

    app = FastAPI(title="IGPO tool server", lifespan=lifespan, docs_url=None, redoc_url=None)

    def check_queries(queries: list[str], topk: int | None) -> int:
        if not queries:
            raise ToolError("bad_request", "give at least one query")
        _check_unicode(queries, "a query")
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

    def check_visit(urls: list[str], goal: str) -> None:
        if not urls:
            raise ToolError("bad_request", "give at least one URL")
        _check_unicode(urls, "a URL")
        _check_unicode([goal], "the goal")
        if len(urls) > config.max_urls:
            raise ToolError("bad_request", f"{len(urls)} URLs in one call; the limit is {config.max_urls}")
        if any(not u.strip() for u in urls):
            raise ToolError("bad_request", "a URL is empty")
        if not goal.strip():
            raise ToolError("bad_request", "the goal is empty; say what information to look for")
        if len(goal) > config.max_goal_chars:
            raise ToolError("bad_request", f"the goal has {len(goal)} characters; the limit is "
                                           f"{config.max_goal_chars}")

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        # summarise without echoing the input (it may be huge)
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return _bad_request(request.url.path, f"invalid request: {where}")

    @app.exception_handler(ToolError)
    async def on_tool_error(request: Request, exc: ToolError):
        if request.url.path.startswith("/tools/"):
            status = 400 if exc.kind == "bad_request" else 200
            return JSONResponse(_error_body(exc), status_code=status)
        return JSONResponse({"detail": exc.message}, status_code=_COMPAT_STATUS.get(exc.kind, 200))

    @app.get("/health")
    async def health(probe: bool = False):
        """The server is up; each upstream's state from its recent calls (``ok``, ``failing``, ``down``,
        ``unknown``); ``status`` is "degraded" when one is failing or down. ``?probe=true`` also calls each upstream
        once now (``tool_server.probe``) and lists the failures under ``probe``."""
        upstreams = service.stats.health()
        bad = any(u["state"] in ("failing", "down") for u in upstreams.values())
        body: dict = {"status": "degraded" if bad else "ok", "backend": service.backend.name,
                      "upstreams": upstreams}
        if probe:
            body["probe"] = [{k: service.redact(v) for k, v in f.to_dict().items()}
                             for f in await probe_backend(service.backend)]
        return body

    @app.post("/tools/search")
    async def tools_search(req: SearchRequest):
        topk = check_queries(req.queries, req.topk)
        # JSONResponse directly: the body is plain JSON types already, FastAPI's recursive encoder is pure cost
        return JSONResponse((await service.search(req.queries, topk)).to_dict())

    @app.post("/tools/visit")
    async def tools_visit(req: VisitRequest):
        check_visit(req.urls, req.goal)
        return JSONResponse((await service.visit(req.urls, req.goal)).to_dict())

    async def compat_search(queries: list[str], topk: int) -> list[list[tuple[dict, float | None]]]:
        """Per query, (document, score) pairs; raises ToolError for failures other than "no results"."""
        topk = check_queries(queries, topk)
        response = await service.search(queries, topk)
        if response.error is not None and response.error.kind != "no_results":
            raise response.error
        out = []
        for result in response.results:
            out.append([(_document(service.backend, h), h["score"]) for h in result["hits"]])
        return out

    @app.post("/retrieve")
    async def retrieve(req: RetrieveRequest):
        per_query = await compat_search(req.queries, req.topk)
        if req.return_scores:
            return {"result": [[{"document": d, "score": s} for d, s in hits] for hits in per_query]}
        return {"result": [[d for d, _ in hits] for hits in per_query]}

    @app.post("/search")
    async def flash_search(req: FlashSearchRequest):
        (hits,) = await compat_search([req.query], req.top_n)
        docs = [d for d, _ in hits]
        return [docs, [s for _, s in hits]] if req.return_score else docs

    @app.post("/batch_search")
    async def flash_batch_search(req: FlashBatchRequest):
        per_query = await compat_search(req.query, req.top_n)
        docs = [[d for d, _ in hits] for hits in per_query]
        return [docs, [[s for _, s in hits] for hits in per_query]] if req.return_score else docs

    @app.get("/stats")
    async def stats():
        return {"backend": service.backend.name, **service.stats.snapshot(),
                "cache_entries": len(service.cache), "in_flight": len(service.dedup)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.stats.prometheus(), media_type="text/plain; version=0.0.4")

    return BodyLimit(app, config.max_request_bytes)


def _document(backend: Backend, hit: dict) -> dict:
    """Corpus documents exactly as stored (local) or as the upstream retriever sent them; web hits in the same
    {"id", "contents"} shape (title on line one)."""
    if isinstance(backend, LocalBackend):
        return backend.document(hit["doc_id"])
    if hit.get("doc_id") is not None and hasattr(backend, "document"):
        document = backend.document(hit["doc_id"])
        if document is not None:
            return document
    return {"id": hit["url"], "contents": f"\"{hit['title']}\"\n{hit['snippet']}"}


def _check_unicode(texts: list[str], what: str) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\udcff"), which no UTF-8 encoder (cache keys, logs, upstream
    requests) accepts: refuse it here as the caller's mistake instead of failing later with a 500."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ToolError("bad_request", f"{what} contains an unpaired UTF-16 surrogate at character {err.start} "
                                           "(\\u{:04x}); send valid Unicode text".format(ord(text[err.start]))) from None


def _error_body(error: ToolError) -> dict:
    return {"ok": False, "text": f"[tool call rejected: {error.message}]", "results": [], "error": error.to_dict()}


def _bad_request(path: str, message: str, status: int = 400) -> JSONResponse:
    error = ToolError("bad_request", message)
    if path.startswith("/tools/"):
        return JSONResponse(_error_body(error), status_code=status)
    return JSONResponse({"detail": message}, status_code=status)


_DRAIN_LIMIT = 64 << 20


class BodyLimit:
    """ASGI wrapper: buffers at most ``max_bytes`` of a request body, answers 413 beyond (chunked bodies too)."""

    def __init__(self, app: FastAPI, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        declared = int(declared) if declared is not None and declared.isdigit() else None
        too_big = declared is not None and declared > self.max_bytes
        chunks, size, more = [], 0, True
        while more and not too_big:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                too_big = True
            else:
                chunks.append(chunk)
            more = message.get("more_body", False)
        if too_big:
            # Read (and drop) the rest of the body before answering: a server that answers and closes while the
            # client is still sending makes the client see a connection reset instead of this 413. Bounded: a body
            # declared (or found) larger than _DRAIN_LIMIT is not read, and the connection closes after all.
            drained = size
            if declared is None or declared <= _DRAIN_LIMIT:
                while more and drained <= _DRAIN_LIMIT:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    drained += len(message.get("body", b""))
                    more = message.get("more_body", False)
            response = _bad_request(scope["path"], f"request body exceeds {self.max_bytes} bytes", status=413)
            return await response(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def __getattr__(self, name):  # expose the FastAPI app's attributes (routes, state) to callers and tests
        return getattr(self.app, name)
