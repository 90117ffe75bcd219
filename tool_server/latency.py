"""Seeded web-like latency added to tool calls (``--latency TOOL=P50:P99``), so that a rehearsal or an
asynchronous-trainer benchmark on a local backend (milliseconds a call) sees the waits of real web tools (1 to
150 s). The distribution and its flags are ``tool_server.config.LatencyConfig``; this module makes the draws.

A call's delay is a pure function of (seed, tool, the call's canonical arguments, how many times that same call came
before): hash -> uniform u in (0, 1) -> z = Phi^-1(u) -> delay = exp(mu + sigma * z) = p50 * exp(sigma * z), cut at
the cap. No shared random stream is consumed, so two calls that arrive in the other order get the same delays, and a
repeated call gets a fresh draw rather than its first one again.

``tool_server.service.ToolService`` waits the delay with ``asyncio.sleep`` after the tool's own work, outside its
deadlines, and not at all for a call answered wholly from the cache (``docs/guide/tool_server.md``).
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from statistics import NormalDist
from typing import Any

from .config import LatencyConfig, ToolLatency

_STANDARD_NORMAL = NormalDist()
# 52 bits of the hash make u: (k + 0.5) / 2**52 is exact in a double and lies strictly inside (0, 1), where the
# inverse normal CDF is finite (|z| <= 8.1)
_UNIFORM_BITS = 52


def call_key(arguments: Any) -> str:
    """The canonical JSON of a call's arguments: sorted keys, no spaces, non-ASCII escaped (so a lone surrogate in
    a query cannot break the hash)."""
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def uniform(seed: int, tool: str, key: str, occurrence: int) -> float:
    """u in (0, 1) from a BLAKE2b hash of the call: stable across processes and Python versions, unlike hash()."""
    digest = hashlib.blake2b(f"{seed}\0{tool}\0{occurrence}\0{key}".encode(), digest_size=8).digest()
    k = int.from_bytes(digest, "big") >> (64 - _UNIFORM_BITS)
    return (k + 0.5) / 2 ** _UNIFORM_BITS


def draw(spec: ToolLatency, seed: int, key: str, occurrence: int, cap_s: float | None) -> float:
    """The delay in seconds of the ``occurrence``-th call (0 for the first) of ``spec.tool`` with canonical
    arguments ``key``: log-normal, median ``spec.p50_s``, 99th percentile ``spec.p99_s``, at most ``cap_s``."""
    z = _STANDARD_NORMAL.inv_cdf(uniform(seed, spec.tool, key, occurrence))
    delay = math.exp(spec.mu + spec.sigma * z)
    return delay if cap_s is None else min(delay, cap_s)


class LatencyDraws:
    """The delays of one server's calls: counts how many times each (tool, arguments) was called, and draws.

    Memory: one 16-byte digest and a count per distinct call of a delayed tool (about 100 bytes), for the
    server's lifetime; a million distinct calls hold about 100 MB.
    """

    def __init__(self, config: LatencyConfig) -> None:
        self.config = config
        self._seen: Counter[bytes] = Counter()

    def next_delay(self, tool: str, arguments: Any) -> float | None:
        """The delay of a call of ``tool`` with ``arguments`` (JSON-able) arriving now; None when ``tool`` has no
        latency (the call is then not counted)."""
        spec = self.config.for_tool(tool)
        if spec is None:
            return None
        key = call_key(arguments)
        seen = hashlib.blake2b(f"{tool}\0{key}".encode(), digest_size=16).digest()
        occurrence = self._seen[seen]
        self._seen[seen] += 1
        return draw(spec, self.config.seed, key, occurrence, self.config.cap_s)
