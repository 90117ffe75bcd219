"""Tool spend and health per training step, from the tool server's ``GET /stats`` (issue #16).

The trainer reads ``/stats`` once per step and logs the change since the previous step as ``tools/*`` metrics, plus
running totals (``tools/*_total``) that the launcher's final summary prints:

    tools/calls/<tool>, tools/calls_total        tool items served (one query / one URL each), by tool
    tools/upstream_calls/<upstream>              upstream HTTP attempts (what a paid API bills), by upstream
    tools/cache_hit_ratio, ..._total             hits / (hits + misses) of the response cache (absent: no lookups)
    tools/retries                                upstream attempts that were retried after a failure
    tools/failures/<kind>                        items that ended in an error, by class (infra, budget, bad_request)
    tools/upstream_failures/<upstream>/<class>   failed upstream attempts by class (connection, timeout, http_503,
                                                 bad_reply, config, credentials); only the classes that occurred
    tools/cost_usd, tools/cost_usd_total         upstream attempts x ``tools.price_per_1k.<upstream>`` / 1000
    tools/budget_spent                           1 when an upstream with a budget (--budget-search ...) has spent it

Prices live in the ``tools`` section of the training config (``configs/igpo_base.yaml``), keyed by upstream name as
``/stats`` reports it (serper, jina, summarizer for the web backend; retriever; local): USD per 1,000 attempts. The
price of an upstream left out is 0. Pure functions on two snapshots; ``fetch_stats`` is the one HTTP call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from igpo.integration.infra_breaker import InfraBreakerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolSpendConfig:
    """The ``tools`` config section: ``price_per_1k`` (upstream -> USD per 1,000 upstream attempts) and
    ``stop_on_budget`` (end the run cleanly, checkpoint saved, once a tool budget is spent)."""

    price_per_1k: dict[str, float] = field(default_factory=dict)
    stop_on_budget: bool = True
    infra_breaker: InfraBreakerConfig = field(default_factory=InfraBreakerConfig)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> "ToolSpendConfig":
        section = dict(section or {})
        unknown = sorted(set(section) - {"price_per_1k", "stop_on_budget", "infra_breaker"})
        if unknown:
            raise ValueError(f"unknown key(s) tools.{unknown}: known keys are ['infra_breaker', 'price_per_1k', "
                             "'stop_on_budget'] (see configs/igpo_base.yaml).")
        prices = {}
        for name, value in dict(section.get("price_per_1k") or {}).items():
            try:
                prices[str(name)] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"tools.price_per_1k.{name}={value!r} is not a number; give USD per 1,000 upstream "
                                 "calls, e.g. tools.price_per_1k.serper=1.0") from None
            if prices[str(name)] < 0:
                raise ValueError(f"tools.price_per_1k.{name}={value} is negative; prices are >= 0.")
        return cls(price_per_1k=prices, stop_on_budget=bool(section.get("stop_on_budget", True)),
                   infra_breaker=InfraBreakerConfig.from_dict(section.get("infra_breaker")))


def fetch_stats(url: str, timeout_s: float = 5.0) -> dict | None:
    """``GET <url>/stats`` as a dict; None (with a warning) when the server does not answer: spend monitoring must
    not stop training, but a missing step is visible (its tools/* metrics are absent)."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/stats", timeout=timeout_s)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as error:
        logger.warning("igpo: could not read the tool server's /stats at %s (%s); this step has no tools/* metrics",
                       url, type(error).__name__)
        return None


def _upstreams(stats: Mapping) -> dict[str, dict]:
    return dict(stats.get("upstream") or {})


def step_metrics(previous: Mapping | None, current: Mapping, prices: Mapping[str, float]) -> dict[str, float]:
    """The ``tools/*`` metrics of one step: ``current - previous`` (``previous`` None: since the server started),
    plus running totals from ``current``."""
    previous = previous or {}

    def delta(now: float, before: float) -> float:
        return float(now or 0) - float(before or 0)

    metrics: dict[str, float] = {}
    calls_now, calls_before = dict(current.get("calls") or {}), dict(previous.get("calls") or {})
    for tool, n in calls_now.items():
        metrics[f"tools/calls/{tool}"] = delta(n, calls_before.get(tool))
    metrics["tools/calls"] = delta(sum(calls_now.values()), sum(calls_before.values()))
    metrics["tools/calls_total"] = float(sum(calls_now.values()))
    cache_now, cache_before = dict(current.get("cache") or {}), dict(previous.get("cache") or {})
    hits = delta(cache_now.get("hits"), cache_before.get("hits"))
    lookups = hits + delta(cache_now.get("misses"), cache_before.get("misses"))
    if lookups:
        metrics["tools/cache_hit_ratio"] = hits / lookups
    total_lookups = float(cache_now.get("hits") or 0) + float(cache_now.get("misses") or 0)
    if total_lookups:
        metrics["tools/cache_hit_ratio_total"] = float(cache_now.get("hits") or 0) / total_lookups
    errors_now, errors_before = dict(current.get("errors") or {}), dict(previous.get("errors") or {})
    for kind, n in errors_now.items():
        metrics[f"tools/failures/{kind}"] = delta(n, errors_before.get(kind))
    cost = cost_total = retries = upstream_total = 0.0
    before_up = _upstreams(previous)
    for name, entry in _upstreams(current).items():
        made = delta(entry.get("calls"), (before_up.get(name) or {}).get("calls"))
        metrics[f"tools/upstream_calls/{name}"] = made
        upstream_total += float(entry.get("calls") or 0)
        price = float(prices.get(name, 0.0)) / 1000.0
        cost += made * price
        cost_total += float(entry.get("calls") or 0) * price
        retries += delta(entry.get("retries"), (before_up.get(name) or {}).get("retries"))
        failed_before = dict((before_up.get(name) or {}).get("failures") or {})
        for reason, n in dict(entry.get("failures") or {}).items():
            failed = delta(n, failed_before.get(reason))
            if failed:  # failure classes of the step (read by the infra breaker's message); absent when none
                metrics[f"tools/upstream_failures/{name}/{reason}"] = failed
    metrics["tools/upstream_calls_total"] = upstream_total
    metrics["tools/retries"] = retries
    metrics["tools/cost_usd"] = cost
    metrics["tools/cost_usd_total"] = cost_total
    metrics["tools/budget_spent"] = float(bool(spent_budgets(current)))
    return metrics


def spent_budgets(stats: Mapping) -> list[str]:
    """One line per upstream whose budget is spent (its attempts reached ``budget``: the next call is refused)."""
    lines = []
    for name, entry in _upstreams(stats).items():
        budget = entry.get("budget")
        if budget is not None and int(entry.get("calls") or 0) >= int(budget):
            lines.append(f"{name}: {int(entry.get('calls') or 0)} of a budget of {int(budget)} upstream calls")
    return lines


def totals(stats: Mapping | None, prices: Mapping[str, float], before: Mapping | None = None) -> dict[str, Any] | None:
    """A run's tool totals (for evaluate.py's settings.json): calls, cache hit ratio, upstream calls, retries,
    failures and the estimated cost in USD, since ``before`` (None: since the server started); None without stats."""
    if not stats:
        return None
    m = step_metrics(before, stats, prices)

    def by(prefix: str) -> dict[str, float]:
        return {k[len(prefix):]: v for k, v in m.items() if k.startswith(prefix)}

    return {"calls": m["tools/calls"], "cache_hit_ratio": m.get("tools/cache_hit_ratio"),
            "upstream_calls": by("tools/upstream_calls/"), "retries": m["tools/retries"],
            "failures": by("tools/failures/"), "estimated_cost_usd": round(m["tools/cost_usd"], 6),
            "price_per_1k": dict(prices), "budget_spent": spent_budgets(stats)}


def parse_prices(values: list[str] | None) -> dict[str, float]:
    """``["serper=1.0", "jina=0.02"]`` (command-line ``--tool-price``) -> {upstream: USD per 1,000 attempts}."""
    prices = {}
    for value in values or []:
        name, sep, price = value.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--tool-price {value!r} is not UPSTREAM=USD_PER_1K, e.g. --tool-price serper=1.0")
        prices[name.strip()] = price
    return ToolSpendConfig.from_dict({"price_per_1k": prices}).price_per_1k
