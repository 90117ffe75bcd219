"""The seam for a tool that calls an outside service: ``weather_tool.py`` beside this file, a module outside
``tool_server/`` with one ``register`` line, served by the real HTTP tool server (``python -m tool_server
--tool-module weather_tool``) in front of a fake weather service over real HTTP. Its budget flag and its line in
``/stats``, ``/health`` and ``/metrics`` come from its registration alone.

The test process never imports ``weather_tool``: the registry of this process stays the built-in tools'."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fake_upstreams import FakeUpstream, Reply
from tool_server import tools
from tool_server.process import start_tool_server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"
WEATHER_PATH = "/weather"
KEY = "weather-key-123"


def weather_reply(request):
    city = request.json()["city"]
    if city == "Atlantis":
        return Reply(404, {"error": "unknown city"})
    return Reply(body={"city": city, "forecast": f"sunny in {city}"})


@pytest.fixture
def fake():
    with FakeUpstream() as fake:
        fake.defaults[WEATHER_PATH] = weather_reply
        yield fake


def plugin_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(HERE), **extra}


def serve(fake: FakeUpstream, tmp_path: Path, *flags: str):
    env = plugin_env(WEATHER_BASE_URL=fake.url + WEATHER_PATH, WEATHER_KEY=KEY)
    return start_tool_server(["--backend", "local", "--corpus", str(CORPUS), "--python-sandbox", "off",
                              "--tool-module", "weather_tool", "--allow-private-upstreams", *flags],
                             log_path=tmp_path / "tool_server.log", env=env)


def forecast(url: str, city: str) -> dict:
    return httpx.post(url + "/tools/forecast", json={"city": city}, timeout=30).json()


def test_a_tool_module_outside_the_package_is_served_with_its_budget_and_its_spend_counted(fake, tmp_path):
    with serve(fake, tmp_path, "--budget-weather", "2") as url:
        paris, atlantis, rome = forecast(url, "Paris"), forecast(url, "Atlantis"), forecast(url, "Rome")
        search = httpx.post(url + "/tools/search", json={"queries": ["Evan Morris lobbyist"]}, timeout=30).json()
        stats = httpx.get(url + "/stats").json()
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text
    assert paris["ok"] and paris["text"] == "The forecast for Paris: sunny in Paris"
    assert paris["results"] == [{"city": "Paris", "forecast": "sunny in Paris"}]
    assert not atlantis["ok"] and atlantis["error"]["kind"] == "no_results"  # the tool's own classification
    assert not rome["ok"] and rome["error"]["kind"] == "budget" and "--budget-weather" in rome["error"]["message"]
    sent = fake.calls(WEATHER_PATH)
    assert [(r.path, r.json()["city"]) for r in sent] == [("/weather/forecast", "Paris"),
                                                           ("/weather/forecast", "Atlantis")]
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in sent)
    assert stats["upstream"]["weather"] == {"calls": 2, "budget": 2, "retries": 0, "failures": {}}
    assert stats["calls"]["forecast"] == 3 and stats["upstream"]["local"]["calls"] == 1 and search["ok"]
    assert health["upstreams"]["weather"]["recent_calls"] == 3  # two answers and the spent budget
    assert 'tool_server_upstream_calls_total{upstream="weather"} 2' in metrics
    assert KEY not in (tmp_path / "tool_server.log").read_text()


def test_its_error_classification_and_the_upstream_guards(fake, tmp_path):
    fake.queue(WEATHER_PATH, Reply(403, "denied"), Reply(503), Reply(503), Reply(body={"no": "forecast"}))
    with serve(fake, tmp_path) as url:
        refused, down, malformed = forecast(url, "Paris"), forecast(url, "Oslo"), forecast(url, "Rome")
        health = httpx.get(url + "/health").json()["upstreams"]["weather"]
        stats = httpx.get(url + "/stats").json()["upstream"]["weather"]
    assert refused["error"]["kind"] == "infra" and "WEATHER_KEY" in refused["error"]["message"]
    assert "not your mistake" in refused["text"]
    assert down["error"]["kind"] == "infra" and "HTTP 503" in down["error"]["message"]  # retried once (2 attempts)
    assert malformed["error"]["kind"] == "infra" and "no 'forecast'" in malformed["error"]["message"]
    assert health["failure_classes"] == {"credentials": 1, "http_503": 1}
    assert stats == {"calls": 4, "budget": None, "retries": 1, "failures": {"credentials": 1, "http_503": 2}}


def test_the_cli_flags_and_start_checks_come_from_the_registered_tool(tmp_path):
    def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tool_server", *args], cwd=ROOT, env=plugin_env(**env),
                              capture_output=True, text=True, timeout=120)

    helped = cli("--tool-module", "weather_tool", "--help")
    assert helped.returncode == 0 and "--budget-weather" in helped.stdout and "max weather service" in helped.stdout
    assert "--budget-search" in helped.stdout and "--budget-summary" in helped.stdout
    plain = cli("--backend", "local", "--corpus", str(CORPUS), "--budget-weather", "2")
    assert plain.returncode == 2 and "unrecognized arguments: --budget-weather 2" in plain.stderr
    keyless = cli("--tool-module", "weather_tool", "--backend", "local", "--corpus", str(CORPUS))
    assert keyless.returncode == 2 and "WEATHER_KEY: needed by the forecast tool" in keyless.stderr
    private = cli("--tool-module", "weather_tool", "--backend", "local", "--corpus", str(CORPUS),
                  WEATHER_KEY=KEY, WEATHER_BASE_URL="http://127.0.0.1:9")
    assert private.returncode == 2 and "WEATHER_BASE_URL" in private.stderr and "--allow-private-upstreams" in \
        private.stderr
    missing = cli("--tool-module", "no_such_tool_module", "--backend", "local", "--corpus", str(CORPUS))
    assert missing.returncode == 2 and "--tool-module no_such_tool_module: cannot import it" in missing.stderr
    assert "forecast" not in tools.names()  # nothing here imported the plug-in


def test_the_registry_refuses_a_budget_that_is_taken_or_not_one():
    class Twice(tools.UpstreamTool):
        name = "twice"
        schema = {"type": "function", "function": {"name": "twice"}}
        upstream, base_url_env = "twice", "TWICE_BASE_URL"
        budgets = (tools.BudgetFlag("twice", "a"), tools.BudgetFlag("twice_more", "b"))

    with pytest.raises(ValueError, match="exactly one BudgetFlag"):
        tools.register(Twice())
    Twice.budgets = (tools.BudgetFlag("search", "the search tool's"),)
    with pytest.raises(ValueError, match="the budget 'search' is already the 'search' tool's"):
        tools.register(Twice())
    assert "twice" not in tools.names() and "--budget-twice" not in [b.flag for b in tools.budget_flags()]
