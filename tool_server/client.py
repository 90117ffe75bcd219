"""Async client for the agent loop: one shared connection pool, argument validation before any network call,
and a result that always carries text the model can read.

    client = ToolClient("http://127.0.0.1:8765")
    result = await client.call("search", {"query": ["who wrote Hamlet", "Hamlet date"]})
    result = await client.call("visit", {"url": "corpus://12", "goal": "when was it written"})
    await client.aclose()
"""
from __future__ import annotations

import ssl
import time
from dataclasses import dataclass

import certifi
import httpx

from . import tools
from .tools import BadToolCall

# The most text one call may carry (all its string arguments together); the server's own limits are smaller
# (ServerConfig.max_query_chars, max_goal_chars, max_url_chars) and answer bad_request, but a call far beyond them
# is refused here, as the model's mistake, without sending a megabyte to learn that.
MAX_ARGUMENT_CHARS = 100_000
# httpcore 1.0's pool rescans every (queued request x connection) pair on each state change, so one pool of 256
# busy connections spends most of the CPU in that scan (measured: ~10 ms per call at 256 in flight; still ~60% of
# the client's CPU with pools of 32). Small pools, used round-robin, keep the scan cheap.
_CONNECTIONS_PER_POOL = 8


@dataclass(frozen=True)
class ToolResult:
    """ok: the call produced usable output. text: what the model sees (an error observation when not ok).

    error_kind: None | "infra" (timeout, 5xx, connection, budget: not the model's fault) | "bad_request" (bad
    arguments or unknown tool: the model's fault) | "no_results".
    """

    ok: bool
    text: str
    error_kind: str | None
    latency_s: float


class ToolClient:
    def __init__(self, base_url: str, *, timeout_s: float = 60.0, max_connections: int = 256) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        n_pools = -(-max_connections // _CONNECTIONS_PER_POOL)
        per_pool = -(-max_connections // n_pools)
        tls = ssl.create_default_context(cafile=certifi.where())  # built once, shared: each costs ~10 ms
        self._pools = [httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout_s), trust_env=False,
                                         verify=tls, limits=httpx.Limits(max_connections=per_pool,
                                                                         max_keepalive_connections=per_pool))
                       for _ in range(n_pools)]
        self._next_pool = 0

    async def call(self, name: str, arguments: dict) -> ToolResult:
        """Validate, then POST to ``/tools/<name>``. ``arguments`` is read, never mutated."""
        start = time.monotonic()
        try:
            path, payload = tool_request(name, arguments)
        except BadToolCall as exc:
            return ToolResult(False, f"[{name} call rejected: {exc}]", "bad_request", time.monotonic() - start)
        for attempt in (1, 2):
            try:
                response = await self._pool().post(path, json=payload)
                break
            except httpx.TimeoutException:
                return self._infra(name, start, f"the tool server did not answer within {self.timeout_s:.0f}s")
            except httpx.TransportError as exc:
                # one retry: a pooled connection the server just closed fails like this; calls are idempotent
                # (and cached server-side), so repeating one costs nothing upstream
                if attempt == 2:
                    return self._infra(name, start, f"could not reach the tool server ({type(exc).__name__})")
            except httpx.HTTPError as exc:
                return self._infra(name, start, f"could not reach the tool server ({type(exc).__name__})")
        latency = time.monotonic() - start
        try:
            body = response.json()
            ok, text, error = bool(body["ok"]), str(body["text"]), body["error"]
        except (ValueError, KeyError, TypeError):
            return self._infra(name, start, f"the tool server sent an unreadable reply (HTTP {response.status_code})")
        kind = None if error is None else str(error.get("kind"))
        if kind == "budget":  # for the trainer a spent budget is an infrastructure limit, not a model mistake
            kind = "infra"
        return ToolResult(ok, text, kind, latency)

    async def get_json(self, path: str) -> dict:
        """GET a server endpoint such as ``/stats`` or ``/health`` (raises httpx errors; for monitoring only)."""
        response = await self._pool().get(path)
        response.raise_for_status()
        return response.json()

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def __aenter__(self) -> "ToolClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _pool(self) -> httpx.AsyncClient:
        pool = self._pools[self._next_pool]
        self._next_pool = (self._next_pool + 1) % len(self._pools)
        return pool

    def _infra(self, name: str, start: float, why: str) -> ToolResult:
        text = f"[{name} failed: {why}. This is a temporary service problem, not your mistake.]"
        return ToolResult(False, text, "infra", time.monotonic() - start)


def tool_request(name: str, arguments: dict) -> tuple[str, dict]:
    """The HTTP path and JSON body of a tool call, validated by the registered tool ``name``; shared by
    ``ToolClient`` and in-process callers. Raises ``BadToolCall`` (the model's mistake)."""
    tool = tools.get(name)
    if not isinstance(arguments, dict):
        raise BadToolCall(f"arguments must be a JSON object, got {type(arguments).__name__}")
    unknown = sorted(str(k) for k in arguments if k not in tool.arguments)
    if unknown:
        raise BadToolCall(f"unknown argument(s) {unknown}; {name} takes {sorted(tool.arguments)}")
    _check_sendable(tool, arguments)
    return f"/tools/{name}", tool.request(arguments)


def _check_sendable(tool: tools.Tool, arguments: dict) -> None:
    """Text the model wrote that no request can carry is the model's malformed call, not an outage: a lone UTF-16
    surrogate ("caf\\udcff", valid in a Python str, refused by every UTF-8 encoder) or arguments beyond
    MAX_ARGUMENT_CHARS."""
    total = 0
    for key, value in arguments.items():
        for text in (value if isinstance(value, list) else [value]):
            if not isinstance(text, str):
                continue
            total += len(text)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise BadToolCall(f"'{key}' contains an unpaired UTF-16 surrogate at character {err.start} "
                                  f"(\\u{ord(text[err.start]):04x}); write valid Unicode text") from None
    if total > MAX_ARGUMENT_CHARS:
        raise BadToolCall(f"the {tool.name} arguments hold {total} characters; at most {MAX_ARGUMENT_CHARS} can be "
                          f"sent, so shorten {tool.argument_words}")
