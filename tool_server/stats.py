"""Counters behind ``GET /stats`` (JSON) and ``GET /metrics`` (Prometheus text format 0.0.4)."""
from __future__ import annotations

import time
from collections import Counter, defaultdict, deque

import numpy as np

from .errors import ERROR_KINDS

_LATENCY_WINDOW = 8192  # percentiles over the most recent calls per tool; bounded memory for long runs
# /health judges each upstream by its most recent calls: enough to see a share failing, few enough to recover fast
HEALTH_WINDOW = 50
# an upstream whose recent calls fail at least this often is "failing"; every recent call failed: "down"
FAILING_SHARE = 0.2


class Stats:
    def __init__(self, upstream_names: list[str]) -> None:
        self.upstream_names = list(upstream_names)
        self.calls: Counter[str] = Counter()            # tool -> items served (one query / one URL each)
        self.latencies: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=_LATENCY_WINDOW))
        self.latency_sum: Counter[str] = Counter()
        self.cache_hits = 0
        self.cache_misses = 0
        self.dedup_joins = 0
        self.errors: Counter[str] = Counter({k: 0 for k in ERROR_KINDS})
        self.upstream_calls: Counter[str] = Counter({n: 0 for n in self.upstream_names})
        self.upstream_failures: Counter[tuple[str, str]] = Counter()  # (upstream, reason) -> attempts
        self.upstream_budget: dict[str, int | None] = {}
        self.upstream_retries: Counter[str] = Counter()  # failed attempts followed by another attempt
        self.passages_cut = 0  # retrieved passages cut to a configured length (--retriever-passage-chars)
        # --latency: calls that waited an injected delay, and the seconds waited, per tool (not in `latencies`,
        # which time the tool's own work)
        self.injected_calls: Counter[str] = Counter()
        self.injected_s: Counter[str] = Counter()
        # per upstream, the outcome of its most recent calls (retries folded in): [ok, reason, message, time]
        self.recent: dict[str, deque[list]] = {n: deque(maxlen=HEALTH_WINDOW) for n in self.upstream_names}

    def call_outcome(self, upstream: str, ok: bool, reason: str | None = None, message: str = "") -> None:
        """One upstream call ended (after its retries): ok, or failed with ``reason`` (a failure class such as
        ``connection``, ``timeout``, ``http_503``, ``bad_reply``, ``config``) and a message safe to show."""
        self.recent.setdefault(upstream, deque(maxlen=HEALTH_WINDOW)).append([ok, reason, message, time.time()])

    def blame_last_ok(self, upstream: str, reason: str, message: str) -> None:
        """A call the upstream answered with HTTP 2xx-4xx turned out unusable (malformed reply, a refusal only
        configuration can cause): its most recent "ok" becomes this failure, and the class is counted."""
        self.upstream_failures[(upstream, reason)] += 1
        window = self.recent.setdefault(upstream, deque(maxlen=HEALTH_WINDOW))
        for entry in reversed(window):
            if entry[0]:
                entry[:] = [False, reason, message, time.time()]
                return
        window.append([False, reason, message, time.time()])

    def health(self) -> dict:
        """Each upstream's state from its recent calls: ``unknown`` (none yet), ``ok``, ``failing`` (at least
        FAILING_SHARE of them failed) or ``down`` (every one failed), with counts and the last error."""
        upstreams = {}
        for name in self.upstream_names:
            window = list(self.recent.get(name, ()))
            failed = [e for e in window if not e[0]]
            if not window:
                state = "unknown"
            elif len(failed) == len(window):
                state = "down"
            elif len(failed) >= FAILING_SHARE * len(window):
                state = "failing"
            else:
                state = "ok"
            entry = {"state": state, "recent_calls": len(window), "recent_failures": len(failed),
                     "failure_classes": dict(Counter(e[1] for e in failed))}
            if failed:
                entry["last_error"] = failed[-1][2]
                entry["last_error_age_s"] = round(time.time() - failed[-1][3], 1)
            upstreams[name] = entry
        return upstreams

    def record(self, tool: str, latency_s: float, error_kind: str | None) -> None:
        self.calls[tool] += 1
        self.latencies[tool].append(latency_s)
        self.latency_sum[tool] += latency_s
        if error_kind is not None:
            self.errors[error_kind] += 1

    def record_injected(self, tool: str, delay_s: float) -> None:
        """A call of ``tool`` waited ``delay_s`` of injected latency (``tool_server.latency``)."""
        self.injected_calls[tool] += 1
        self.injected_s[tool] += delay_s

    def snapshot(self) -> dict:
        lookups = self.cache_hits + self.cache_misses
        latency = {}
        for tool, window in self.latencies.items():
            p50, p95 = np.percentile(np.fromiter(window, float), [50, 95]) if window else (None, None)
            latency[tool] = {"count": self.calls[tool], "p50_s": _round(p50), "p95_s": _round(p95)}
        return {
            "calls": dict(self.calls),
            "cache": {"hits": self.cache_hits, "misses": self.cache_misses,
                      "hit_rate": self.cache_hits / lookups if lookups else None, "dedup_joins": self.dedup_joins},
            "latency": latency,
            "errors": dict(self.errors),
            "passages_cut": self.passages_cut,
            "injected_latency": {t: {"calls": n, "seconds": _round(self.injected_s[t])}
                                 for t, n in self.injected_calls.items()},
            "upstream": {n: {"calls": self.upstream_calls[n], "budget": self.upstream_budget.get(n),
                             "retries": self.upstream_retries[n],
                             "failures": {r: c for (u, r), c in self.upstream_failures.items() if u == n}}
                         for n in self.upstream_names},
        }

    def prometheus(self) -> str:
        lines = ["# HELP tool_server_calls_total Tool items served (one query or one URL each).",
                 "# TYPE tool_server_calls_total counter"]
        lines += [f'tool_server_calls_total{{tool="{t}"}} {n}' for t, n in sorted(self.calls.items())]
        lines += ["# HELP tool_server_latency_seconds Tool item latency (sum and count over the run).",
                  "# TYPE tool_server_latency_seconds summary"]
        for tool in sorted(self.calls):
            window = self.latencies[tool]
            if window:
                for q, v in zip((0.5, 0.95), np.percentile(np.fromiter(window, float), [50, 95])):
                    lines.append(f'tool_server_latency_seconds{{tool="{tool}",quantile="{q}"}} {v:.6f}')
            lines.append(f'tool_server_latency_seconds_sum{{tool="{tool}"}} {self.latency_sum[tool]:.6f}')
            lines.append(f'tool_server_latency_seconds_count{{tool="{tool}"}} {self.calls[tool]}')
        lines += ["# HELP tool_server_cache_lookups_total Cache lookups by outcome.",
                  "# TYPE tool_server_cache_lookups_total counter",
                  f'tool_server_cache_lookups_total{{outcome="hit"}} {self.cache_hits}',
                  f'tool_server_cache_lookups_total{{outcome="miss"}} {self.cache_misses}',
                  "# HELP tool_server_dedup_joins_total Requests that joined an identical in-flight request.",
                  "# TYPE tool_server_dedup_joins_total counter",
                  f"tool_server_dedup_joins_total {self.dedup_joins}",
                  "# HELP tool_server_errors_total Tool items that ended in an error, by kind.",
                  "# TYPE tool_server_errors_total counter"]
        lines += [f'tool_server_errors_total{{kind="{k}"}} {n}' for k, n in sorted(self.errors.items())]
        lines += ["# HELP tool_server_injected_latency_seconds_total Seconds of --latency delay waited by calls.",
                  "# TYPE tool_server_injected_latency_seconds_total counter"]
        lines += [f'tool_server_injected_latency_seconds_total{{tool="{t}"}} {s:.6f}'
                  for t, s in sorted(self.injected_s.items())]
        lines += ["# HELP tool_server_upstream_calls_total Upstream HTTP attempts (what a paid API may bill).",
                  "# TYPE tool_server_upstream_calls_total counter"]
        lines += [f'tool_server_upstream_calls_total{{upstream="{u}"}} {n}'
                  for u, n in sorted(self.upstream_calls.items())]
        lines += ["# HELP tool_server_upstream_failures_total Failed upstream attempts by reason.",
                  "# TYPE tool_server_upstream_failures_total counter"]
        lines += [f'tool_server_upstream_failures_total{{upstream="{u}",reason="{r}"}} {n}'
                  for (u, r), n in sorted(self.upstream_failures.items())]
        lines += ["# HELP tool_server_upstream_retries_total Failed upstream attempts that were retried.",
                  "# TYPE tool_server_upstream_retries_total counter"]
        lines += [f'tool_server_upstream_retries_total{{upstream="{u}"}} {self.upstream_retries[u]}'
                  for u in sorted(self.upstream_names)]
        return "\n".join(lines) + "\n"


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)
