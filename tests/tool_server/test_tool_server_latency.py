"""Web-like latency (``--latency TOOL=P50:P99``, ``tool_server.latency``): the flags and their errors, the
distribution of the draws, their independence from call order, the cache and deadline rules, a real server waiting
the drawn delay, /stats, and the start line (``latency: off`` by default)."""
from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from fake_upstreams import InProcessServer
from tool_server.__main__ import build_config, parse_args
from tool_server.app import build_service
from tool_server.backends.base import SearchHit
from tool_server.cache import ResponseCache
from tool_server.config import Z_99, ConfigError, LatencyConfig, ServerConfig, ToolLatency
from tool_server.errors import ToolError
from tool_server.latency import LatencyDraws, call_key, draw
from tool_server.process import start_tool_server
from tool_server.service import ToolService
from tool_server.stats import Stats

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"
# small delays keep the tests fast; sigma = ln 2 / z_0.99 = 0.30, so draws fall in about 0.08..0.5 s
FAST = ToolLatency("search", 0.2, 0.4)


def _config(*flags: str) -> ServerConfig:
    return build_config(parse_args(["--backend", "local", "--corpus", str(CORPUS), *flags]), env={})


# --- flags and errors ---

def test_flags_parse_into_the_stated_log_normal():
    config = _config("--latency", "search=1:10", "--latency", "visit=3:30", "--latency-seed", "5")
    config.validate()
    search, visit = config.latency.tools
    assert (search.tool, search.p50_s, search.p99_s) == ("search", 1.0, 10.0)
    assert (visit.tool, visit.p50_s, visit.p99_s) == ("visit", 3.0, 30.0)
    assert config.latency.seed == 5 and config.latency.cap_s == 120.0
    assert math.exp(search.mu) == pytest.approx(1.0)
    assert math.exp(search.mu + Z_99 * search.sigma) == pytest.approx(10.0)
    assert search.sigma == pytest.approx(math.log(10) / 2.3263478740408408)
    assert config.latency.describe() == ("latency: search lognormal p50 1s p99 10s, visit lognormal p50 3s p99 30s; "
                                         "cap 120s; seed 5")
    assert _config("--latency", "search=0.5:0.5", "--latency-cap-s", "0").latency.cap_s is None


@pytest.mark.parametrize("flag, words", [
    ("search", "expected TOOL=P50:P99"),
    ("search=1", "expected TOOL=P50:P99"),
    ("=1:10", "expected TOOL=P50:P99"),
    ("search=one:10", "must be numbers of seconds"),
    ("search=10:1", "must be p99 >= p50 > 0"),
    ("search=0:1", "must be p99 >= p50 > 0"),
    ("search=-1:1", "must be p99 >= p50 > 0"),
    ("search=nan:1", "must be p99 >= p50 > 0"),
    ("search=1:inf", "must be p99 >= p50 > 0"),
])
def test_a_malformed_latency_flag_is_named_with_its_fix(flag, words):
    with pytest.raises(ConfigError) as err:
        _config("--latency", flag)
    assert f"--latency {flag.split('=')[0]}" in str(err.value) and words in str(err.value)
    assert "e.g. --latency" in str(err.value)


@pytest.mark.parametrize("flags, words", [
    (["--latency", "search=1:10", "--latency", "search=2:20"], "--latency search=2:20: must be given once per tool"),
    (["--latency", "visit=3:30", "--latency-cap-s", "20"], "raise --latency-cap-s to 30 or more, or lower the p99"),
    (["--latency", "visit=3:30", "--latency-cap-s", "-1"], "--latency-cap-s -1: must be > 0 seconds"),
])
def test_inconsistent_latency_flags_are_refused(flags, words):
    with pytest.raises(ConfigError, match=words.replace("+", r"\+")):
        _config(*flags).validate()


def test_a_tool_that_is_not_served_is_refused_with_the_served_ones():
    config = ServerConfig(backend="local", corpus=CORPUS, latency=LatencyConfig(tools=(ToolLatency("serach", 1, 10),)))
    with pytest.raises(ConfigError) as err:
        build_service(config)
    # other test modules may have registered more tools in this process; the built-in ones are always served
    assert str(err.value).startswith("--latency serach=1:10: this server serves no tool named 'serach'; name one of "
                                     "the served tools: search, visit, python")


def test_the_cli_exits_2_naming_the_flag():
    proc = subprocess.run([sys.executable, "-m", "tool_server", "--backend", "local", "--corpus", str(CORPUS),
                           "--port", "0", "--latency", "visit=3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "configuration error: --latency visit=3: expected TOOL=P50:P99" in proc.stderr


# --- the draws ---

def test_the_draws_have_the_stated_p50_and_p99_and_respect_the_cap():
    for spec in (ToolLatency("search", 1.0, 10.0), ToolLatency("visit", 3.0, 30.0)):
        delays = np.array([draw(spec, 0, call_key({"queries": [f"query {i}"]}), 0, None) for i in range(20_000)])
        p50, p99 = np.percentile(delays, [50, 99])
        # standard errors at n = 20,000: about 1% (p50) and 2.6% (p99)
        assert p50 == pytest.approx(spec.p50_s, rel=0.03)
        assert p99 == pytest.approx(spec.p99_s, rel=0.06)
    capped = [draw(ToolLatency("visit", 3.0, 30.0), 0, str(i), 0, 31.0) for i in range(20_000)]
    assert max(capped) == 31.0 and np.percentile(capped, 99) == pytest.approx(30.0, rel=0.06)


def test_a_draw_depends_on_seed_tool_arguments_and_occurrence_only():
    spec = ToolLatency("search", 1.0, 10.0)
    key = call_key({"queries": ["q"], "topk": None})
    assert draw(spec, 0, key, 0, None) == draw(spec, 0, call_key({"topk": None, "queries": ["q"]}), 0, None)
    others = [draw(spec, 1, key, 0, None), draw(spec, 0, key, 1, None),
              draw(ToolLatency("visit", 1.0, 10.0), 0, key, 0, None), draw(spec, 0, call_key({"queries": ["r"]}), 0,
                                                                            None)]
    assert len({draw(spec, 0, key, 0, None), *others}) == 5
    assert draw(ToolLatency("search", 2.0, 2.0), 0, key, 0, None) == pytest.approx(2.0)


WEB_LIKE = (ToolLatency("search", 1, 10), ToolLatency("visit", 3, 30))


def _delays_by_call(calls, seed=0, specs=WEB_LIKE) -> dict[str, list[float]]:
    """Each distinct call's delays, in the order its repeats arrived."""
    draws = LatencyDraws(LatencyConfig(tools=specs, seed=seed))
    by_call: dict[str, list[float]] = {}
    for tool, arguments in calls:
        by_call.setdefault(f"{tool} {call_key(arguments)}", []).append(draws.next_delay(tool, arguments))
    return by_call


def test_the_same_seed_gives_the_same_delays_whatever_the_call_order():
    calls = [("search", {"queries": [f"q{i % 7}"], "topk": None}) for i in range(30)]
    calls += [("visit", {"urls": [f"corpus://{i % 5}"], "goal": "g"}) for i in range(20)]
    first = _delays_by_call(calls)
    shuffled = list(calls)
    random.Random(1).shuffle(shuffled)
    assert shuffled != calls
    assert _delays_by_call(shuffled) == first
    assert len(set(first["search " + call_key({"queries": ["q0"], "topk": None})])) == 5  # a repeat draws afresh
    assert _delays_by_call(calls, seed=1) != first
    assert LatencyDraws(LatencyConfig(tools=(FAST,))).next_delay("visit", {"urls": ["u"], "goal": "g"}) is None


def test_concurrent_calls_in_either_order_inject_the_same_seconds():
    bodies = [{"queries": [f"Horatio Hale {i % 3}"]} for i in range(9)]
    spec = ToolLatency("search", 0.01, 0.02)
    config = ServerConfig(backend="local", corpus=CORPUS, latency=LatencyConfig(tools=(spec,), seed=9))

    async def run(order):
        service = build_service(config)
        try:
            await asyncio.gather(*(service.call("search", body) for body in order))
        finally:
            await service.aclose()
        return service.stats.injected_s["search"]

    forward, backward = asyncio.run(run(bodies)), asyncio.run(run(bodies[::-1]))
    by_call = _delays_by_call([("search", {**body, "topk": None}) for body in bodies], seed=9, specs=(spec,))
    expected = sum(sum(by_call.values(), []))
    assert forward == pytest.approx(expected) and backward == pytest.approx(expected)


# --- the service: cache and deadlines ---

class CachedBackend:
    """A cacheable backend answering at once, like a web backend whose upstream is instant."""

    name = "stub"
    upstream_names: list[str] = []
    cacheable = True

    def __init__(self) -> None:
        self.searches = 0

    def namespace(self, tool: str) -> str:
        return f"stub/{tool}"

    async def search_one(self, query: str, topk: int, deadline: float) -> list[SearchHit]:
        if time.monotonic() > deadline:  # as upstream code does: a delay spent before the work fails here
            raise ToolError("infra", "deadline passed", retryable=True)
        self.searches += 1
        return [SearchHit(title=query, url="corpus://1", snippet="s")]

    async def aclose(self) -> None:
        pass


def _stub_service(latency: LatencyConfig, **config) -> ToolService:
    config = ServerConfig(backend="local", corpus=CORPUS, latency=latency, **config)
    return ToolService(config, CachedBackend(), ResponseCache(None), Stats([]))


async def _timed(service: ToolService, body: dict) -> tuple[dict, float]:
    start = time.monotonic()
    response = await service.call("search", body)
    return response.to_dict(), time.monotonic() - start


def test_a_call_answered_wholly_from_the_cache_does_not_wait():
    service = _stub_service(LatencyConfig(tools=(ToolLatency("search", 0.3, 0.3),)))

    async def go():
        return [await _timed(service, {"queries": queries})
                for queries in (["a"], ["a"], ["a", "b"], ["a", "b"])]

    (first, t1), (again, t2), (partly, t3), (both, t4) = asyncio.run(go())
    assert first["ok"] and again["results"][0]["cached"] and service.backend.searches == 2
    assert t1 >= 0.3 and t2 < 0.25        # the repeat came from the cache: no wait
    assert t3 >= 0.3 and t4 < 0.25        # "b" was new: the call waited; then both were cached
    assert service.stats.injected_calls["search"] == 2
    assert service.stats.injected_s["search"] == pytest.approx(0.6)


def test_the_delay_does_not_count_against_the_tools_deadline():
    # 1.2 s: beyond the deadline plus the service's 1 s guard, so a delay inside either would fail the call
    service = _stub_service(LatencyConfig(tools=(ToolLatency("search", 1.2, 1.2),)), search_deadline_s=0.05)
    response, elapsed = asyncio.run(_timed(service, {"queries": ["a"]}))
    assert response["ok"] and response["error"] is None and elapsed >= 1.2


def test_a_refused_call_does_not_wait():
    service = _stub_service(LatencyConfig(tools=(ToolLatency("search", 0.5, 0.5),)))
    start = time.monotonic()
    with pytest.raises(ToolError, match="topk=0"):
        asyncio.run(service.call("search", {"queries": ["a"], "topk": 0}))
    assert time.monotonic() - start < 0.4 and not service.stats.injected_calls


# --- a real server ---

def test_a_real_server_waits_the_drawn_delay_and_counts_it_in_stats():
    latency = LatencyConfig(tools=(FAST,), seed=3)
    body = {"queries": ["Horatio Hale ethnologist philologist"]}
    expected = [draw(FAST, 3, call_key({**body, "topk": None}), n, latency.cap_s) for n in range(2)]
    # the drawn delays are far above the local index's milliseconds, so a missing wait fails the test
    assert min(expected) > 0.1, expected
    with InProcessServer(ServerConfig(backend="local", corpus=CORPUS, latency=latency)) as server:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            client.get("/health")  # connection set up outside the timed calls
            measured = []
            for _ in expected:
                start = time.monotonic()
                answer = client.post("/tools/search", json=body).json()
                measured.append(time.monotonic() - start)
                assert answer["ok"] and answer["results"][0]["hits"][0]["url"] == "corpus://1"
            start = time.monotonic()
            assert client.post("/tools/visit", json={"urls": ["corpus://1"], "goal": "g"}).json()["ok"]
            visit_s = time.monotonic() - start
            stats = client.get("/stats").json()
    for drawn, took in zip(expected, measured):
        assert drawn <= took < drawn + 0.25, (expected, measured)
    assert visit_s < min(expected)  # visit has no latency
    assert stats["injected_latency"] == {"search": {"calls": 2, "seconds": round(sum(expected), 6)}}


def test_latency_is_off_by_default():
    assert ServerConfig().latency == LatencyConfig() and LatencyConfig().tools == ()
    assert LatencyConfig().describe() == "latency: off"
    assert _config().latency == LatencyConfig()
    with InProcessServer(ServerConfig(backend="local", corpus=CORPUS)) as server:
        for _ in range(3):
            assert httpx.post(server.url + "/tools/search", json={"queries": ["Horatio Hale"]}, timeout=10).json()["ok"]
        stats = httpx.get(server.url + "/stats", timeout=10).json()
    assert stats["injected_latency"] == {} and stats["calls"]["search"] == 3


def test_the_start_line_states_the_latency(tmp_path):
    log = tmp_path / "tool_server.log"
    with start_tool_server(["--backend", "local", "--corpus", str(CORPUS), "--latency", "search=0.2:0.4",
                            "--latency-seed", "7"], log_path=log, cwd=ROOT) as url:
        stats = httpx.get(url + "/stats", timeout=5).json()
    assert stats["injected_latency"] == {}
    assert (f"tool_server listening on {url} (latency: search lognormal p50 0.2s p99 0.4s; cap 120s; seed 7)\n"
            in log.read_text())
