"""One paid upstream API behind every guard: URL safety on each redirect hop, a concurrency limit, a token bucket
that honours 429 ``Retry-After``, a per-run budget, bounded body reads, hard per-attempt timeouts, and retries
with full-jitter exponential back-off on 429/5xx/timeouts/connection errors only.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urljoin, urlsplit

import httpx

from .config import UpstreamLimits
from .errors import ToolError
from .limits import Budget, TokenBucket, backoff_delay
from .safety import TargetGuard, origin_of
from .stats import Stats

MAX_REDIRECTS = 5
_REDIRECT_CODES = (301, 302, 303, 307, 308)


@dataclass
class UpstreamResponse:
    status: int
    headers: httpx.Headers
    body: bytes
    truncated: bool  # the body was longer than the byte limit and was cut
    url: str         # final URL after redirects
    upstream: str

    def text(self) -> str:
        """Decode with the declared charset, else UTF-8; undecodable bytes become U+FFFD instead of failing."""
        charset = "utf-8"
        for param in self.headers.get("content-type", "").split(";")[1:]:
            key, _, value = param.strip().partition("=")
            if key.lower() == "charset" and value.strip("\"' "):
                charset = value.strip("\"' ")
        try:
            return self.body.decode(charset, errors="replace")
        except LookupError:  # an unknown charset name in the header
            return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        if self.truncated:
            raise ToolError("infra", f"{self.upstream} sent a reply larger than the configured limit; "
                                     "raise its max_response_bytes if this is legitimate", retryable=False)
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            raise ToolError("infra", f"{self.upstream} sent malformed JSON (HTTP {self.status}, "
                                     f"{len(self.body)} bytes)", retryable=True) from None


class Upstream:
    def __init__(self, name: str, limits: UpstreamLimits, *, guard: TargetGuard, stats: Stats, budget_flag: str,
                 proxy: str | None = None, seed: int | None = None) -> None:
        self.name = name
        self.limits = limits
        self.guard = guard
        self.stats = stats
        self.budget = Budget(name, limits.budget, budget_flag)
        stats.upstream_budget[name] = limits.budget
        self.bucket = TokenBucket(limits.rate_per_s, limits.burst)
        self._slots = asyncio.Semaphore(limits.concurrency)
        self._rng = random.Random(seed)
        # trust_env=False: only the explicit PROXY applies; redirects are followed by hand so each hop is checked
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(limits.attempt_timeout_s), follow_redirects=False, trust_env=False, proxy=proxy,
            limits=httpx.Limits(max_connections=limits.concurrency, max_keepalive_connections=limits.concurrency))

    async def aclose(self) -> None:
        await self.client.aclose()

    def blame(self, error: ToolError, reason: str) -> ToolError:
        """Record that the call just answered was unusable (``reason``: ``bad_reply``, ``config``, ``credentials``)
        for /stats and /health, and return ``error`` for the caller to raise."""
        self.stats.blame_last_ok(self.name, reason, error.message)
        return error

    async def request(self, method: str, url: str, *, deadline: float, headers: dict[str, str] | None = None,
                      json_body: Any = None, oversize: Literal["error", "truncate"] = "error",
                      attempts: int | None = None) -> UpstreamResponse:
        """Send with retries until a non-retryable answer, ``max_attempts`` (or ``attempts``) or ``deadline``.

        One deadline (time.monotonic()) bounds the call, retries included: a retry starts only when its back-off
        (full jitter) ends before the deadline, and after a timed-out attempt only when the retry would get a whole
        ``attempt_timeout_s`` (a shorter retry of a request that just took too long mostly adds load to a slow
        server). Returns any response that is not 429/5xx (callers interpret 4xx); raises ToolError otherwise.
        """
        try:
            response = await self._request(method, url, deadline, headers, json_body, oversize,
                                           attempts or self.limits.max_attempts)
        except ToolError as error:
            if error.kind != "bad_request":  # a refused model-chosen URL says nothing about the upstream
                self.stats.call_outcome(self.name, False, error.reason or error.kind, error.message)
            raise
        self.stats.call_outcome(self.name, True)
        return response

    async def _request(self, method: str, url: str, deadline: float, headers: dict[str, str] | None,
                       json_body: Any, oversize: str, max_attempts: int) -> UpstreamResponse:
        last, reason = "no attempt was made before the deadline", "deadline"
        for attempt in range(max_attempts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            retry_after: float | None = None
            try:
                async with asyncio.timeout(remaining):
                    await self._slots.acquire()
            except TimeoutError:
                last = f"waited {remaining:.1f}s for one of {self.limits.concurrency} {self.name} slots"
                reason = "busy"
                break
            response = None
            try:
                await self.bucket.acquire(deadline)
                self.budget.charge()
                self.stats.upstream_calls[self.name] += 1
                timeout = min(self.limits.attempt_timeout_s, deadline - time.monotonic())
                async with asyncio.timeout(timeout):
                    response = await self._send(method, url, headers or {}, json_body, oversize)
            except (TimeoutError, httpx.TimeoutException):
                last, reason = f"attempt {attempt + 1} timed out after {timeout:.1f}s", "timeout"
            except httpx.TransportError as exc:
                last, reason = f"attempt {attempt + 1}: connection error ({type(exc).__name__})", "connection"
            finally:
                self._slots.release()
            if response is not None:
                if response.status == 429:
                    last, reason = f"attempt {attempt + 1}: HTTP 429 (rate limited)", "http_429"
                    retry_after = _retry_after_s(response.headers.get("retry-after"))
                elif response.status >= 500:
                    last, reason = f"attempt {attempt + 1}: HTTP {response.status}", f"http_{response.status}"
                else:
                    # let the next queued request take the freed slot and go out before our caller spends CPU on
                    # parsing and rendering: this hand-over delay is what separates throughput from C / latency
                    await asyncio.sleep(0)
                    return response
            self.stats.upstream_failures[(self.name, reason)] += 1
            if attempt + 1 == max_attempts:
                break
            delay = backoff_delay(attempt, self.limits.backoff_base_s, self.limits.backoff_max_s, self._rng)
            if retry_after is not None:
                # the upstream told everyone to wait: pause the shared bucket, not only this caller
                self.bucket.pause(retry_after)
                delay = max(delay, retry_after)
            if time.monotonic() + delay >= deadline:
                last += f"; the next retry (in {delay:.1f}s) would pass the deadline"
                break
            if reason == "timeout" and deadline - time.monotonic() - delay < self.limits.attempt_timeout_s:
                last += f"; a retry would get less than the {self.limits.attempt_timeout_s:.1f}s attempt timeout"
                break
            self.stats.upstream_retries[self.name] += 1
            await asyncio.sleep(delay)
        # the failure class of the last attempt goes with the error, for /health and the trainer's breaker
        raise ToolError("infra", f"{self.name} is unavailable: {last}", retryable=True, reason=reason)

    async def _send(self, method: str, url: str, headers: dict[str, str], json_body: Any,
                    oversize: str) -> UpstreamResponse:
        start_origin = origin_of(urlsplit(url))
        for _hop in range(MAX_REDIRECTS + 1):
            await self.guard.check(url)
            if origin_of(urlsplit(url)) != start_origin:
                headers = {}  # credentials are for the upstream only, never for whatever it redirects to
            request = self.client.build_request(method, url, headers=headers, json=json_body)
            response = await self.client.send(request, stream=True)
            try:
                location = response.headers.get("location")
                if response.status_code in _REDIRECT_CODES and location:
                    url = urljoin(url, location)
                    if response.status_code == 303 or (response.status_code in (301, 302) and method == "POST"):
                        method, json_body = "GET", None
                    continue
                body, truncated = await _read_bounded(response, self.limits.max_response_bytes)
            finally:
                await response.aclose()
            if truncated and oversize == "error":
                raise ToolError("infra", f"{self.name} sent more than {self.limits.max_response_bytes} bytes; "
                                         "raise its max_response_bytes if this is legitimate", retryable=False)
            return UpstreamResponse(response.status_code, response.headers, body, truncated, url, self.name)
        raise ToolError("bad_request", f"{self.name}: more than {MAX_REDIRECTS} redirects", retryable=False)


async def _read_bounded(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        if size + len(chunk) > limit:
            chunks.append(chunk[: limit - size])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After is either delta-seconds or an HTTP date; unparsable values are ignored (back-off applies)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
