"""``python -m tool_server --backend local|web|retriever …``: start the tool service.

Once it accepts connections it prints exactly one line on stdout, ``tool_server listening on http://HOST:PORT
(latency: off)`` (with ``--port 0`` the OS picks the port; launchers parse the URL, which a space ends; the
parenthesis is the ``--latency`` setting). Logs go to stderr, secrets masked.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

from . import tools
from .config import ConfigError, LatencyConfig, Secrets, ServerConfig, ToolLatency, read_env_file
from .errors import ToolError
from .redact import RedactingFilter, Redactor
from .safety import check_url_syntax


def import_tool_modules(argv: list[str] | None = None) -> list[str]:
    """Import every ``--tool-module`` of ``argv`` (each registers its tools in ``tool_server.tools``) before the
    other flags are read: their budget flags are among them. Returns the module names."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--tool-module", action="append", default=[])
    modules = pre.parse_known_args(argv)[0].tool_module
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--tool-module {module}: cannot import it ({exc}); put its folder on PYTHONPATH or "
                              "fix the name") from None
    return modules


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; the ``--tool-module`` modules must be imported first (``import_tool_modules``)."""
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="python -m tool_server", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=["local", "web", "retriever"], required=True)
    p.add_argument("--corpus", type=Path, help="JSONL corpus for --backend local ({'id','contents'} per line)")
    p.add_argument("--index-dir", type=Path, default=None,
                   help="--backend local: folder for the cached BM25 index, built once per corpus version and "
                        "memory-mapped on later starts (default: the corpus's folder)")
    p.add_argument("--retriever-url", default=None,
                   help="--backend retriever: the retrieval server, base or endpoint URL (default: $RETRIEVER_URL); "
                        "e.g. http://127.0.0.1:8000 (Search-R1) or http://127.0.0.1:8000/batch_search (FlashRAG)")
    p.add_argument("--retriever-dialect", choices=["auto", "search_r1", "flashrag"], default=d.retriever_dialect,
                   help="auto: flashrag when the URL ends in /batch_search, else search_r1 (POST /retrieve)")
    p.add_argument("--retriever-passage-chars", type=int, default=d.retriever_passage_chars,
                   help="cut each retrieved passage to N characters (default 0: whole passages, as Search-R1 shows "
                        "them); cuts are counted in /stats (passages_cut)")
    p.add_argument("--retriever-concurrency", type=int, default=d.retriever.concurrency)
    p.add_argument("--retriever-rate", type=float, default=d.retriever.rate_per_s,
                   help="retriever requests per second")
    p.add_argument("--retriever-timeout-s", type=float, default=d.retriever.attempt_timeout_s,
                   help="timeout of one retriever request (retried within --search-deadline-s)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    p.add_argument("--cache", dest="cache_path", default=None,
                   help="SQLite cache file shared by all workers of a job (default: in-memory, lost at exit)")
    p.add_argument("--cache-ttl-s", type=float, default=None, help="refetch cached answers older than this")
    for budget in tools.budget_flags():  # one per budget the registered tools declare
        p.add_argument(budget.flag, dest=f"budget_{budget.name}", type=int, default=None, help=budget.help)
    p.add_argument("--search-concurrency", type=int, default=d.serper.concurrency)
    p.add_argument("--search-rate", type=float, default=d.serper.rate_per_s, help="Serper requests per second")
    p.add_argument("--visit-concurrency", type=int, default=d.jina.concurrency)
    p.add_argument("--visit-rate", type=float, default=d.jina.rate_per_s, help="Jina requests per second")
    p.add_argument("--summary-concurrency", type=int, default=d.summarizer.concurrency)
    p.add_argument("--summary-rate", type=float, default=d.summarizer.rate_per_s)
    p.add_argument("--max-attempts", type=int, default=d.serper.max_attempts, help="attempts per upstream call")
    p.add_argument("--search-deadline-s", type=float, default=d.search_deadline_s)
    p.add_argument("--visit-deadline-s", type=float, default=d.visit_deadline_s)
    p.add_argument("--page-token-budget", type=int, default=d.page_token_budget)
    p.add_argument("--default-topk", type=int, default=d.default_topk)
    p.add_argument("--serper-base-url", default=None, help="default: $SERPER_BASE_URL or " + d.serper_base_url)
    p.add_argument("--jina-base-url", default=None, help="default: $JINA_BASE_URL or " + d.jina_base_url)
    p.add_argument("--allow-private-upstreams", action="store_true",
                   help="let the configured upstream base URLs be loopback/private (test fakes, in-cluster LLM); "
                        "model-chosen URLs are still refused")
    p.add_argument("--python-sandbox", choices=["bwrap", "unsafe", "off"], default=d.python_sandbox,
                   help="bwrap: run the python tool's code in bubblewrap's namespaces (read-only standard library and "
                        "scratch only, no network, own PID namespace); the server refuses to start where they "
                        "cannot be built. unsafe: without them (the code can read what the server reads; a warning "
                        "at every start). off: no python tool (docs/guide/security.md)")
    p.add_argument("--latency", action="append", default=[], metavar="TOOL=P50:P99",
                   help="rehearsals and benchmarks: after each call of TOOL, wait a seeded log-normal delay with this "
                        "median and 99th percentile in seconds (e.g. --latency search=1:10 --latency visit=3:30); "
                        "repeatable, one per tool; a call answered wholly from the cache does not wait "
                        "(docs/guide/tool_server.md). Default: no delay")
    p.add_argument("--latency-seed", type=int, default=d.latency.seed,
                   help="seed of the --latency draws: a call's delay depends on the seed, the tool, its arguments "
                        "and how often that same call came before, not on the order calls arrive")
    p.add_argument("--latency-cap-s", type=float, default=d.latency.cap_s,
                   help="no --latency delay is longer than this; 0: no cap (the default stays below the agent's "
                        "150 s tool timeout)")
    p.add_argument("--tool-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE before serving: the tools it registers (tool_server.tools.register) are "
                        "served too, with their budget flags; repeatable")
    p.add_argument("--env-file", type=Path, default=None,
                   help="KEY=VALUE file with secrets; variables already in the environment win")
    p.add_argument("--probe", action="store_true",
                   help="before serving, call each upstream once (tool_server.probe); a failure prints "
                        "'tool_server: upstream error: <which> at <url>: <what came back>; <fix>' and exits 2")
    p.add_argument("--probe-only", action="store_true", help="probe the upstreams as --probe does, then exit")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, env: dict[str, str]) -> ServerConfig:
    d = ServerConfig()
    budgets = {budget.name: getattr(args, f"budget_{budget.name}") for budget in tools.budget_flags()}
    endpoints = {tool.upstream: env[tool.base_url_env].strip() for tool in tools.upstream_tools()
                 if env.get(tool.base_url_env, "").strip()}
    return ServerConfig(
        backend=args.backend, corpus=args.corpus, index_dir=args.index_dir, host=args.host, port=args.port,
        cache_path=args.cache_path, cache_ttl_s=args.cache_ttl_s, default_topk=args.default_topk,
        search_deadline_s=args.search_deadline_s,
        visit_deadline_s=args.visit_deadline_s, page_token_budget=args.page_token_budget,
        serper_base_url=args.serper_base_url or env.get("SERPER_BASE_URL") or d.serper_base_url,
        jina_base_url=args.jina_base_url or env.get("JINA_BASE_URL") or d.jina_base_url,
        allow_private_upstreams=args.allow_private_upstreams, python_sandbox=args.python_sandbox,
        budgets=budgets, endpoints=endpoints,
        latency=LatencyConfig(tools=tuple(ToolLatency.parse(text) for text in args.latency), seed=args.latency_seed,
                              cap_s=args.latency_cap_s or None),
        # the backends' upstreams read the search and visit tools' budgets from their limits
        serper=replace(d.serper, concurrency=args.search_concurrency, rate_per_s=args.search_rate,
                       max_attempts=args.max_attempts, budget=budgets["search"]),
        jina=replace(d.jina, concurrency=args.visit_concurrency, rate_per_s=args.visit_rate,
                     max_attempts=args.max_attempts, budget=budgets["visit"]),
        summarizer=replace(d.summarizer, concurrency=args.summary_concurrency, rate_per_s=args.summary_rate,
                           max_attempts=args.max_attempts, budget=budgets["summary"]),
        retriever_url=args.retriever_url or env.get("RETRIEVER_URL") or None,
        retriever_dialect=args.retriever_dialect,
        retriever_passage_chars=args.retriever_passage_chars,
        retriever=replace(d.retriever, concurrency=args.retriever_concurrency, rate_per_s=args.retriever_rate,
                          attempt_timeout_s=args.retriever_timeout_s, max_attempts=args.max_attempts,
                          budget=budgets["search"]),
    )


def setup_logging(level: str, redactor: Redactor) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter(redactor))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request URL at INFO; our own per-call line is enough
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def start_line(config: ServerConfig, sock: socket.socket) -> str:
    """The one line printed once the server accepts connections: its URL (launchers take it up to the space), then
    the injected latency, ``(latency: off)`` unless ``--latency`` is given."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    return f"tool_server listening on http://{shown}:{port} ({config.latency.describe()})"


async def serve(app, config: ServerConfig, sock: socket.socket) -> None:
    import uvicorn

    # long keep-alive: agent clients hold pooled connections between turns; uvicorn's 5 s default closes them
    # mid-run and races with requests being sent on them
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, timeout_keep_alive=120,
                                           timeout_graceful_shutdown=5))

    async def announce():
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.01)
        print(start_line(config, sock), flush=True)

    announcer = asyncio.create_task(announce())
    await server.serve(sockets=[sock])
    announcer.cancel()


async def _probe(service, close: bool) -> int:
    """Probe every upstream once; print each failure (secrets masked) or one "probe ok" line. 2 on a failure."""
    from .probe import probe_backend

    try:
        failures = await probe_backend(service.backend)
    finally:
        if close:
            await service.aclose()
    for failure in failures:
        print(f"tool_server: {service.redact(failure.line())}", file=sys.stderr, flush=True)
    if not failures:
        upstreams = ", ".join(service.stats.upstream_names)
        print(f"tool_server: probe ok ({service.backend.name} backend; upstreams: {upstreams})", file=sys.stderr,
              flush=True)
    return 2 if failures else 0


def tool_keys(env: dict[str, str]) -> dict[str, str]:
    """The keys of the registered tools' outside services, by upstream name; every missing one is named at once."""
    wanted = {tool.upstream: tool for tool in tools.upstream_tools() if tool.key_env}
    missing = [f"  {tool.key_env}: needed by the {tool.name} tool" for tool in wanted.values()
               if not env.get(tool.key_env, "").strip()]
    if missing:
        raise ConfigError("these environment variables (set them in .env or pass --env-file) are missing or "
                          "empty:\n" + "\n".join(missing))
    return {upstream: env[tool.key_env].strip() for upstream, tool in wanted.items()}


def check_private_upstreams(config: ServerConfig, secrets: Secrets | None) -> None:
    """Fail at start-up, not on the first call, when a configured upstream is local but the flag is missing."""
    if config.allow_private_upstreams:
        return
    configured = [(tool.base_url_env, config.endpoints[tool.upstream]) for tool in tools.upstream_tools()
                  if tool.upstream in config.endpoints]
    if config.backend == "web":
        configured += [("--serper-base-url", config.serper_base_url), ("--jina-base-url", config.jina_base_url),
                       ("API_BASE", secrets.api_base)]
    for name, url in configured:
        try:
            check_url_syntax(url, max_chars=config.max_url_chars)
        except ToolError as exc:
            raise ConfigError(f"{name}={url!r}: {exc.message}; pass --allow-private-upstreams if this upstream "
                              "is meant to be local (a test fake, an in-cluster LLM)") from None


def main(argv: list[str] | None = None) -> int:
    try:
        import_tool_modules(argv)
    except ConfigError as exc:
        print(f"tool_server: configuration error: {exc}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    env = dict(os.environ)
    if args.env_file is not None:
        env = {**read_env_file(args.env_file), **env}
    try:
        secrets = Secrets.from_env(env) if args.backend == "web" else None
        keys = tool_keys(env)
        config = build_config(args, env)
        config.validate()
        check_private_upstreams(config, secrets)
    except ConfigError as exc:
        print(f"tool_server: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, Redactor([*(secrets.values() if secrets else []), *keys.values()]))
    from .app import build_service, create_app
    from .backends.local import CorpusError

    try:
        service = build_service(config, secrets, keys)
    except CorpusError as exc:
        print(f"tool_server: corpus error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"tool_server: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.probe_only:
        return asyncio.run(_probe(service, close=True))
    app = create_app(service)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets, and without it Nagle + delayed
    # ACK add ~40 ms to every response uvicorn writes in two pieces
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        print(f"tool_server: cannot listen on {config.host}:{config.port} ({exc.strerror}); pick another --port "
              "or use --port 0 for a free one", file=sys.stderr)
        return 2
    return asyncio.run(_probe_and_serve(service, app, config, sock, args.probe))


async def _probe_and_serve(service, app, config: ServerConfig, sock: socket.socket, probe: bool) -> int:
    # the probe runs in the server's event loop: the upstreams' HTTP pools are bound to the loop that used them
    if probe and await _probe(service, close=False):
        await service.aclose()
        sock.close()
        return 2
    await serve(app, config, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
