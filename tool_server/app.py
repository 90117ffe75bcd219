"""HTTP API (FastAPI). Our endpoints: ``POST /tools/<name>`` for every registered tool (``tool_server.tools``),
``/health``, ``/stats``, ``/metrics``. Compatible endpoints for existing clients: Search-R1 ``POST /retrieve``; FlashRAG ``POST /search`` and
``POST /batch_search``.

Tool endpoints answer HTTP 200 with ``{"ok", "text", "results", "error"}`` for every tool-level outcome, and
400/413 with the same shape for malformed requests. Compatible endpoints map infra failures to 503 (their clients
retry 5xx), budget to 402 and bad requests to 400.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import replace
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from . import tools
from .backends.base import Backend
from .backends.local import LocalBackend
from .cache import ResponseCache
from .config import ConfigError, Secrets, ServerConfig
from .errors import ToolError
from .probe import probe_backend
from .redact import Redactor
from .safety import TargetGuard, origin_of
from .service import ToolService
from .stats import Stats
from .tools.python_sandbox import SandboxUnavailable, bwrap_sandbox
from .tools.upstream_tool import Endpoint
from .upstream import Upstream

log = logging.getLogger("tool_server")

_COMPAT_STATUS = {"infra": 503, "budget": 402, "bad_request": 400}


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


def build_service(config: ServerConfig, secrets: Secrets | None = None,
                  keys: dict[str, str] | None = None) -> ToolService:
    """Validate the config, check the python tool's sandbox, load the backend (the local index is built here) and
    wire cache, stats and the outside services of the tools that call one (``keys``: their keys by upstream name).
    ``ConfigError`` when the sandbox that ``config.python_sandbox`` asks for cannot run here."""
    config.validate()
    check_latency_tools(config)
    check_python_sandbox(config)
    keys = dict(keys or {})
    cache = ResponseCache(config.cache_path, ttl_s=config.cache_ttl_s)
    if config.backend == "web":
        if secrets is None:
            raise ValueError("build_service(backend='web') needs Secrets; build them with Secrets.from_env")
        from .backends.web import WebBackend  # imported lazily: the local backend needs no HTTP client
        stats = _stats(WebBackend.upstream_names)
        backend: Backend = WebBackend(config, secrets, stats)
    elif config.backend == "retriever":
        from .backends.retriever import RetrieverBackend

        stats = _stats(RetrieverBackend.upstream_names)
        # the passages a search returns live in the response cache, so a cached search and its visits agree
        backend = RetrieverBackend(config, stats, passages=cache)
    else:
        stats = _stats(LocalBackend.upstream_names)
        # --budget-search caps the search upstream of every backend (build_config puts it in each upstream's limits)
        backend = LocalBackend(config.corpus, index_dir=config.index_dir, stats=stats, budget=config.retriever.budget)
    redactor = Redactor([*(secrets.values() if secrets else []), *keys.values()])
    return ToolService(config, backend, cache, stats, redact=redactor, endpoints=tool_endpoints(config, stats, keys))


def _stats(backend_upstreams: list[str]) -> Stats:
    """Stats over the backend's upstreams and those of the tools that call an outside service themselves."""
    names = [tool.upstream for tool in tools.upstream_tools()]
    clash = sorted(set(names) & set(backend_upstreams))
    if clash:
        raise ConfigError(f"the tools' upstream names {clash} are also upstreams of the backend; rename the tools' "
                          "upstreams (their prices and /stats lines would mix)")
    return Stats([*backend_upstreams, *names])


def tool_endpoints(config: ServerConfig, stats: Stats, keys: dict[str, str]) -> dict[str, Endpoint]:
    """One guarded ``Upstream`` per registered tool that calls an outside service, with its base URL
    (``config.endpoints``, else the tool's default), its budget (``config.budgets``) and its key."""
    endpoints = {}
    for tool in tools.upstream_tools():
        base_url = config.endpoints.get(tool.upstream) or tool.default_base_url
        if not base_url:
            raise ConfigError(f"the {tool.name} tool has no base URL for its service {tool.upstream!r}; set "
                              f"{tool.base_url_env} in the environment or the --env-file")
        (budget,) = tool.budgets
        allowed = {origin_of(urlsplit(base_url))} if config.allow_private_upstreams else set()
        guard = TargetGuard(allowed, max_url_chars=config.max_url_chars + len(base_url))
        limits = replace(tool.limits, budget=config.budgets.get(budget.name))
        limits.validate(tool.upstream)
        endpoints[tool.upstream] = Endpoint(base_url.rstrip("/"), keys.get(tool.upstream),
                                            Upstream(tool.upstream, limits, guard=guard, stats=stats,
                                                     budget_flag=budget.flag))
    return endpoints


def check_latency_tools(config: ServerConfig) -> None:
    """Every ``--latency`` tool is one this server serves (the registry, ``--tool-module`` tools included)."""
    for spec in config.latency.tools:
        if spec.tool not in tools.names():
            raise ConfigError(f"{spec.flag}: this server serves no tool named {spec.tool!r}; name one of the served "
                              f"tools: {', '.join(tools.names())}")


def check_python_sandbox(config: ServerConfig) -> None:
    """Refuse to start when the python tool's kernel sandbox cannot be built here (unless the operator chose
    ``unsafe`` or ``off``); warn at every start in the unsafe mode."""
    if config.python_sandbox == "bwrap":
        try:
            sandbox = bwrap_sandbox()
        except SandboxUnavailable as exc:
            raise ConfigError(f"python_sandbox='bwrap': {exc}") from None
        log.info("python tool: bubblewrap sandbox %s; the code sees / as %s", sandbox.bwrap,
                 ", ".join(sandbox.visible_root))
    elif config.python_sandbox == "unsafe":
        log.warning("python tool: --python-sandbox unsafe: model-written code runs WITHOUT kernel isolation and can "
                    "read every file this server can (.env included); use it only with a trusted model, and install "
                    "bubblewrap to drop this flag (docs/guide/security.md)")


def create_app(service: ToolService) -> FastAPI:
    config = service.config

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await service.aclose()
        service.cache.close()

    app = FastAPI(title="IGPO tool server", lifespan=lifespan, docs_url=None, redoc_url=None)

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

    for tool in tools.names():
        app.post(f"/tools/{tool}")(_tool_route(service, tools.get(tool)))

    async def compat_search(queries: list[str], topk: int) -> list[list[tuple[dict, float | None]]]:
        """Per query, (document, score) pairs; raises ToolError for failures other than "no results"."""
        topk = tools.get("search").check(queries, topk, config)
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


def _tool_route(service: ToolService, tool: tools.Tool):
    """``POST /tools/<name>``: the body validated by the tool's request model (FastAPI reads the parameter's
    annotation, set here because the model differs per tool), then run by the service."""
    async def route(req):
        # JSONResponse directly: the body is plain JSON types already, FastAPI's recursive encoder is pure cost
        return JSONResponse((await service.call(tool.name, req)).to_dict())

    route.__signature__ = inspect.Signature(
        [inspect.Parameter("req", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=tool.request_model)])
    route.__name__ = f"tools_{tool.name}"
    return route


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
