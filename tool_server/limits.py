"""Rate limit (token bucket with 429 pauses), retry back-off, per-run budgets and in-flight de-duplication."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable, TypeVar

from .errors import ToolError

T = TypeVar("T")


class TokenBucket:
    """Token bucket: ``rate`` tokens/s refill up to ``burst``; ``acquire`` takes one token, waiting if needed.

    ``pause(s)`` blocks every acquirer for ``s`` seconds (an upstream's 429 ``Retry-After`` applies to all our
    requests, not only the one that got it). Waits that would end after ``deadline`` fail at once with an infra
    error instead of sleeping past the caller's deadline.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._updated = time.monotonic()
        self._paused_until = 0.0
        self._lock = asyncio.Lock()

    def pause(self, seconds: float) -> None:
        self._paused_until = max(self._paused_until, time.monotonic() + seconds)

    async def acquire(self, deadline: float) -> None:
        # the lock makes waiters queue in FIFO order, so a burst is served fairly at `rate`
        async with self._lock:
            while True:
                now = time.monotonic()
                if now < self._paused_until:
                    wait = self._paused_until - now
                else:
                    self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
                    self._updated = now
                    if self._tokens >= 1.0:
                        self._tokens -= 1.0
                        return
                    wait = (1.0 - self._tokens) / self.rate
                if now + wait > deadline:
                    raise ToolError("infra", f"rate limited: the next request slot is {wait:.1f}s away, past this "
                                             "call's deadline", retryable=True)
                await asyncio.sleep(wait)


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter exponential back-off: U(0, min(max_s, base_s * 2**attempt)), attempt = 0 for the first retry."""
    return rng.uniform(0.0, min(max_s, base_s * (2.0 ** attempt)))


class Budget:
    """Counts upstream calls of this run; ``charge`` raises a ``budget`` error once ``limit`` calls are spent."""

    def __init__(self, name: str, limit: int | None, flag: str) -> None:
        self.name = name
        self.limit = limit
        self.flag = flag
        self.spent = 0

    def charge(self) -> None:
        if self.limit is not None and self.spent >= self.limit:
            raise ToolError("budget", f"the {self.name} budget of {self.limit} upstream calls for this run is spent; "
                                      f"restart the tool server with a larger {self.flag}", retryable=False)
        self.spent += 1


class InflightDedup:
    """Concurrent calls with the same key share one execution (the first caller's); later ones await its result.

    The shared task is shielded, so a caller that is cancelled (its own deadline, a dropped connection) does not
    cancel the work the others wait for. The key is released when the task finishes, success or failure.
    """

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self.joined = 0

    async def run(self, key: str, factory: Callable[[], Awaitable[T]]) -> T:
        task = self._tasks.get(key)
        if task is None:
            task = asyncio.ensure_future(factory())
            self._tasks[key] = task
            task.add_done_callback(lambda t, k=key: self._release(k, t))
        else:
            self.joined += 1
        return await asyncio.shield(task)

    def _release(self, key: str, task: asyncio.Task) -> None:
        self._tasks.pop(key, None)
        # every waiter may have been cancelled; retrieving the outcome here keeps asyncio from logging it as lost
        if not task.cancelled():
            task.exception()

    def __len__(self) -> int:
        return len(self._tasks)
