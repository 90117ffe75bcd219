"""Tool server with the local BM25 backend, the HTTP API (ours and the compatible dialects), the async client,
and the CLI (subprocess on port 0)."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fake_upstreams import FakeUpstream, InProcessServer, Reply, Reset
from tool_server import ToolClient
from tool_server.config import ServerConfig
from tool_server.process import start_tool_server

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"


def corpus_doc(doc_id: str) -> dict:
    with CORPUS.open() as f:
        for line in f:
            doc = json.loads(line)
            if doc["id"] == doc_id:
                return doc
    raise KeyError(doc_id)


@pytest.fixture(scope="module")
def server():
    with InProcessServer(ServerConfig(backend="local", corpus=CORPUS, max_queries=4,
                                      max_request_bytes=20_000)) as s:
        yield s


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=10)


def test_search_finds_the_titled_passage_and_visit_follows_its_url(server):
    r = post(server, "/tools/search", {"queries": ["Horatio Hale ethnologist philologist"], "topk": 3}).json()
    assert r["ok"] and r["error"] is None
    top = r["results"][0]["hits"][0]
    assert (top["title"], top["url"]) == ("Horatio Hale", "corpus://1")
    assert r["text"].startswith("A search for 'Horatio Hale ethnologist philologist' found")
    page = post(server, "/tools/visit", {"urls": [top["url"]], "goal": "who was he"}).json()
    assert page["ok"]
    stored_text = corpus_doc("1")["contents"].split("\n", 1)[1]
    assert stored_text in page["text"]


def test_rendering_is_deterministic_and_results_are_ordered_by_score(server):
    body = {"queries": ["United States expedition", "comics publisher"], "topk": 5}
    first, second = post(server, "/tools/search", body).json(), post(server, "/tools/search", body).json()
    assert first["text"] == second["text"]
    assert "\n=======\n" in first["text"]
    for result in first["results"]:
        scores = [h["score"] for h in result["hits"]]
        assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)


def test_no_results_and_bad_requests_are_structured(server):
    r = post(server, "/tools/search", {"queries": ["the of and"]}).json()
    assert not r["ok"] and r["error"]["kind"] == "no_results"
    r = post(server, "/tools/search", {"queries": ["a"] * 5})
    assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_request"
    r = post(server, "/tools/search", {"queries": ["x"], "topk": 0})
    assert r.status_code == 400 and "topk=0" in r.json()["error"]["message"]
    r = post(server, "/tools/visit", {"urls": ["corpus://no-such-id"], "goal": "g"}).json()
    assert r["error"]["kind"] == "no_results"
    r = post(server, "/tools/visit", {"urls": ["https://example.com"], "goal": "g"}).json()
    assert r["error"]["kind"] == "bad_request" and "corpus://" in r["text"]
    r = post(server, "/tools/search", {"queries": ["x" * 30_000]})
    assert r.status_code == 413 and r.json()["error"]["kind"] == "bad_request"


def test_search_r1_retrieve_dialect(server):
    with_scores = post(server, "/retrieve", {"queries": ["Evan Morris lobbyist"], "topk": 2,
                                            "return_scores": True}).json()
    hit = with_scores["result"][0][0]
    assert hit["document"] == corpus_doc("0") and isinstance(hit["score"], float)
    bare = post(server, "/retrieve", {"queries": ["Evan Morris lobbyist", "Horatio Hale"], "topk": 1}).json()
    assert bare["result"][0] == [corpus_doc("0")] and bare["result"][1] == [corpus_doc("1")]


def test_flashrag_dialect(server):
    docs = post(server, "/search", {"query": "Evan Morris lobbyist", "top_n": 2}).json()
    assert docs[0] == corpus_doc("0") and len(docs) == 2
    docs, scores = post(server, "/search", {"query": "Evan Morris lobbyist", "top_n": 2,
                                            "return_score": True}).json()
    assert len(docs) == len(scores) == 2 and scores[0] >= scores[1]
    batch = post(server, "/batch_search", {"query": ["Evan Morris", "Horatio Hale"], "top_n": 1}).json()
    assert batch == [[corpus_doc("0")], [corpus_doc("1")]]
    assert post(server, "/search", {"query": "  ", "top_n": 2}).status_code == 400


def test_health_stats_and_metrics(server):
    health = httpx.get(server.url + "/health").json()
    assert (health["status"], health["backend"]) == ("ok", "local")
    post(server, "/tools/search", {"queries": ["Evan Morris"]})
    stats = httpx.get(server.url + "/stats").json()
    assert stats["calls"]["search"] >= 1 and stats["latency"]["search"]["p95_s"] >= stats["latency"]["search"]["p50_s"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'tool_server_calls_total{tool="search"}' in metrics and "tool_server_errors_total" in metrics


def test_client_round_trip_without_mutating_arguments(server):
    async def go():
        async with ToolClient(server.url) as client:
            args = {"query": ["Evan Morris lobbyist", "Horatio Hale"]}
            before = copy.deepcopy(args)
            results = await asyncio.gather(*(client.call("search", args) for _ in range(8)))
            assert args == before
            assert all(r.ok and r.error_kind is None and "Evan Morris" in r.text for r in results)
            visit = await client.call("visit", {"url": "corpus://0", "goal": "who"})
            assert visit.ok and "Genentech" in visit.text and visit.latency_s > 0
            empty = await client.call("search", {"query": "the"})
            assert not empty.ok and empty.error_kind == "no_results" and "No results" in empty.text
    asyncio.run(go())


@pytest.mark.parametrize("name,args,needle", [
    ("shell", {"cmd": "ls"}, "unknown tool"),
    ("search", {}, "'query'"),
    ("search", {"query": ["ok", 3]}, "'query'"),
    ("search", {"query": "x", "params": {}}, "unknown argument"),
    ("search", {"query": "x", "topk": "3"}, "topk"),
    ("visit", {"url": "corpus://1"}, "goal"),
    ("visit", {"url": [], "goal": "g"}, "'url'"),
])
def test_client_rejects_bad_calls_without_network(name, args, needle):
    async def go():
        # nothing listens on port 9 of loopback: a network attempt would come back as "infra", not "bad_request"
        async with ToolClient("http://127.0.0.1:9", timeout_s=2) as client:
            before = copy.deepcopy(args)
            result = await client.call(name, args)
            assert args == before
            return result
    result = asyncio.run(go())
    assert not result.ok and result.error_kind == "bad_request" and needle in result.text


def test_client_reports_unreachable_server_as_infra():
    async def go():
        async with ToolClient("http://127.0.0.1:9", timeout_s=2) as client:
            return await client.call("search", {"query": "x"})
    result = asyncio.run(go())
    assert not result.ok and result.error_kind == "infra" and "not your mistake" in result.text


def test_client_retries_a_dropped_connection_once():
    ok_body = {"ok": True, "text": "fine", "results": [], "error": None}
    with FakeUpstream() as fake:
        fake.queue("/tools/search", Reset(), Reply(body=ok_body), Reset(), Reset())

        async def go():
            async with ToolClient(fake.url, timeout_s=5) as client:
                return [await client.call("search", {"query": "x"}) for _ in range(2)]
        first, second = asyncio.run(go())
    assert first.ok and first.text == "fine"
    assert not second.ok and second.error_kind == "infra"
    assert len(fake.calls("/tools/search")) == 4


def _cli(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "tool_server", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_port_zero_announces_url_and_serves(tmp_path):
    log = tmp_path / "tool_server.log"
    with start_tool_server(["--backend", "local", "--corpus", "data/wiki_passages_1000.jsonl", "--host", "127.0.0.1",
                            "--port", "0"], log_path=log, cwd=ROOT) as url:
        assert url.startswith("http://127.0.0.1:"), url
        assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"
    assert f"tool_server listening on {url} (latency: off)\n" in log.read_text()


def test_cli_web_backend_names_every_missing_secret():
    env = {k: v for k, v in os.environ.items()
           if k not in ("SERPER_KEY_ID", "JINA_API_KEYS", "API_KEY", "API_BASE", "SUMMARY_MODEL_NAME")}
    env["JINA_API_KEYS"] = "jina-present"
    proc = _cli("--backend", "web", "--port", "0", env=env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    for var in ("SERPER_KEY_ID", "API_KEY", "API_BASE", "SUMMARY_MODEL_NAME"):
        assert var in err
    assert "JINA_API_KEYS" not in err and "jina-present" not in err
