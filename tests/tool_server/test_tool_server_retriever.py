"""``--backend retriever``: our API on top of a Search-R1 / FlashRAG retrieval server, over real HTTP on 127.0.0.1.

The well-behaved upstream is our own tool server with the local BM25 backend (it speaks both dialects); the faulty
one is the scripted fake of fake_upstreams.py (5xx, resets, stalls past the deadline, malformed JSON, wrong shapes).
Every call must end in hits or a structured error of the right kind within its deadline; nothing silently empty.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fake_upstreams import FakeUpstream, InProcessServer, Reply, Reset
from tool_server import ToolClient
from tool_server.backends.retriever import title_and_text
from tool_server.config import split_retriever_url
from tool_server.config import ConfigError, ServerConfig, UpstreamLimits
from tool_server.process import start_tool_server

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"
FAST = UpstreamLimits(concurrency=8, rate_per_s=1000.0, burst=100, attempt_timeout_s=0.5, max_attempts=3,
                      backoff_base_s=0.01, backoff_max_s=0.05)


@pytest.fixture(scope="module")
def upstream():
    """Our local BM25 server playing the Search-R1 / FlashRAG retrieval server."""
    with InProcessServer(ServerConfig(backend="local", corpus=CORPUS)) as server:
        yield server


@pytest.fixture(scope="module")
def fake():
    with FakeUpstream() as f:
        yield f


@pytest.fixture(autouse=True)
def clean_fake(fake):
    fake.reset()


def retriever_server(url: str, limits: UpstreamLimits = FAST, **overrides) -> InProcessServer:
    settings = {"search_deadline_s": 3.0, **overrides}
    return InProcessServer(ServerConfig(backend="retriever", retriever_url=url, retriever=limits, **settings))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def search(server, *queries, topk=3) -> dict:
    return post(server, "/tools/search", {"queries": list(queries), "topk": topk}).json()


def upstream_calls(server) -> int:
    return httpx.get(server.url + "/stats").json()["upstream"]["retriever"]["calls"]


# ------------------------------------------------------------------------------ against our own /retrieve server


def test_passages_come_whole_by_default_and_a_configured_cut_is_counted(upstream):
    """Search-R1 shows the model whole passages; a cap is an option, and every cut shows in /stats."""
    query = "Horatio Hale ethnologist philologist"
    documents = httpx.post(upstream.url + "/retrieve", json={"queries": [query], "topk": 3, "return_scores": True},
                           timeout=30).json()["result"][0]
    texts = [title_and_text(d["document"])[1] for d in documents]
    assert max(len(t) for t in texts) > 200, texts
    with retriever_server(upstream.url) as server:
        hits = search(server, query)["results"][0]["hits"]
        assert [h["snippet"] for h in hits] == texts
        assert httpx.get(server.url + "/stats").json()["passages_cut"] == 0
    with retriever_server(upstream.url, retriever_passage_chars=200) as server:
        hits = search(server, query)["results"][0]["hits"]
        assert [h["snippet"] for h in hits] == [t[:200] for t in texts]
        assert httpx.get(server.url + "/stats").json()["passages_cut"] == sum(len(t) > 200 for t in texts)



def test_the_cache_key_names_the_passage_length():
    """A persistent cache written with cut passages (or with the old key, when every passage was cut at 600
    characters) must not answer a server that shows whole passages."""
    from tool_server.backends.retriever import RetrieverBackend
    from tool_server.stats import Stats

    def namespace(chars: int) -> str:
        config = ServerConfig(backend="retriever", retriever_url="http://127.0.0.1:8000",
                              retriever_passage_chars=chars)
        return RetrieverBackend(config, Stats(["retriever"]), passages=None).namespace("search")

    whole, cut = namespace(0), namespace(600)
    assert whole.endswith(":search:whole") and cut.endswith(":search:cut600")
    assert whole != "retriever:search_r1:http://127.0.0.1:8000/retrieve:search"  # the key before passages came whole


@pytest.mark.parametrize("suffix", ["", "/retrieve", "/batch_search"])
def test_same_hits_as_the_upstream_and_visit_serves_the_returned_passage(upstream, suffix):
    queries = ["Horatio Hale ethnologist philologist", "Evan Morris lobbyist"]
    direct = search(upstream, *queries)
    # The local backend shows the first 600 characters of a passage; cut the retrieved ones alike to compare.
    with retriever_server(upstream.url + suffix, retriever_passage_chars=600) as server:
        forwarded = search(server, *queries)
        assert forwarded["ok"], forwarded
        for ours, theirs in zip(forwarded["results"], direct["results"]):
            assert [(h["title"], h["url"], h["snippet"]) for h in ours["hits"]] == \
                   [(h["title"], h["url"], h["snippet"]) for h in theirs["hits"]]
            assert all(isinstance(h["score"], float) for h in ours["hits"])
        assert forwarded["text"] == direct["text"]  # the model sees the same observation either way
        url = forwarded["results"][0]["hits"][0]["url"]
        assert url == "corpus://1"
        ours, theirs = (post(s, "/tools/visit", {"urls": [url], "goal": "who"}).json() for s in (server, upstream))
        assert ours["ok"] and ours["text"] == theirs["text"]


def test_compatible_endpoints_on_top_return_the_upstream_documents(upstream):
    body = {"queries": ["Evan Morris lobbyist", "Horatio Hale"], "topk": 2, "return_scores": True}
    with retriever_server(upstream.url) as server:
        assert post(server, "/retrieve", body).json() == post(upstream, "/retrieve", body).json()
        flash = {"query": ["Evan Morris", "Horatio Hale"], "top_n": 1}
        assert post(server, "/batch_search", flash).json() == post(upstream, "/batch_search", flash).json()
        health = httpx.get(server.url + "/health").json()
        assert (health["status"], health["backend"], health["upstreams"]["retriever"]["state"]) == ("ok", "retriever", "ok")


def test_cache_and_in_flight_dedup_spare_the_upstream(upstream, tmp_path):
    cache = str(tmp_path / "tools.sqlite")
    with retriever_server(upstream.url, cache_path=cache) as server:
        async def burst():
            async with ToolClient(server.url) as client:
                return await asyncio.gather(*(client.call("search", {"query": "Genentech lobbyist"})
                                              for _ in range(16)))
        results = asyncio.run(burst())
        assert all(r.ok for r in results) and len({r.text for r in results}) == 1
        assert upstream_calls(server) == 1
        again = search(server, "  genentech   LOBBYIST ", topk=5)  # normalised: the same entry
        assert again["results"][0]["cached"] and upstream_calls(server) == 1
    # a restarted server with the same cache answers the search and its visit without asking the upstream
    with retriever_server(upstream.url, cache_path=cache) as server:
        hit = search(server, "Genentech lobbyist", topk=5)["results"][0]
        assert hit["cached"]
        page = post(server, "/tools/visit", {"urls": [hit["hits"][0]["url"]], "goal": "g"}).json()
        assert page["ok"] and upstream_calls(server) == 0
        stats = httpx.get(server.url + "/stats").json()
        assert stats["cache"]["hits"] >= 1


def test_empty_result_is_no_results_and_visits_are_checked(upstream):
    with retriever_server(upstream.url) as server:
        r = search(server, "the of and")
        assert not r["ok"] and r["error"]["kind"] == "no_results" and "No results found" in r["text"]
        r = post(server, "/tools/visit", {"urls": ["corpus://999999"], "goal": "g"}).json()
        assert r["error"]["kind"] == "no_results" and "earlier search" in r["error"]["message"]
        r = post(server, "/tools/visit", {"urls": ["https://example.com/"], "goal": "g"}).json()
        assert r["error"]["kind"] == "bad_request" and "corpus://" in r["text"]


# ------------------------------------------------------------------------------------ against a faulty upstream


def test_5xx_is_retried_then_reported_as_infra_and_not_cached(fake):
    fake.queue("/retrieve", *[Reply(503, "overloaded")] * FAST.max_attempts)
    with retriever_server(fake.url) as server:
        r = search(server, "q")
        assert r["error"]["kind"] == "infra" and r["error"]["retryable"] and "HTTP 503" in r["error"]["message"]
        assert "not your mistake" in r["text"] and len(fake.calls("/retrieve")) == FAST.max_attempts
        fake.queue("/retrieve", Reply(500), Reset(), Reply(body={"result": [[
            {"document": {"id": "7", "contents": '"T"\nbody'}, "score": 1.5}]]}))
        r = search(server, "q")  # the failure was not cached; two faults are retried away
        assert r["ok"] and r["results"][0]["hits"][0]["url"] == "corpus://7"
        failures = httpx.get(server.url + "/stats").json()["upstream"]["retriever"]["failures"]
        assert failures == {"http_503": 3, "http_500": 1, "connection": 1}
        # the compatible endpoint tells its clients to retry
        fake.queue("/retrieve", *[Reply(502)] * FAST.max_attempts)
        assert post(server, "/retrieve", {"queries": ["down"]}).status_code == 503


def test_a_stalled_upstream_ends_within_the_deadline(fake):
    fake.queue("/retrieve", *[Reply(body={"result": [[]]}, delay_s=30)] * 10)
    patient = UpstreamLimits(attempt_timeout_s=5.0, max_attempts=10, backoff_base_s=0.01, backoff_max_s=0.02)
    with retriever_server(fake.url, limits=patient, search_deadline_s=0.8) as server:
        start = time.monotonic()
        r = search(server, "stall")
        assert r["error"]["kind"] == "infra" and r["error"]["retryable"]
        assert time.monotonic() - start < 0.8 + 0.7
        # the server still answers, and says which upstream is failing and how
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "degraded" and health["upstreams"]["retriever"]["state"] == "down"
        assert health["upstreams"]["retriever"]["failure_classes"] == {"timeout": 1}


@pytest.mark.parametrize("reply,needle", [
    (Reply(body=b"{not json"), "malformed JSON"),
    (Reply(body=b"<html>Bad Gateway</html>", headers={"content-type": "text/html"}), "malformed JSON"),
    (Reply(body={"results": []}), "'result' list"),
    (Reply(body=[[{"id": "1", "contents": "x"}]]), "'result' list"),
    (Reply(body={"result": "doc"}), "'result' list"),
    (Reply(body={"result": []}), "one list for our one query"),
    (Reply(body={"result": [[], []]}), "one list for our one query"),
    (Reply(body={"result": [{"document": {}}]}), "one list for our one query"),
    (Reply(body={"result": [[{"document": {"id": "1"}, "score": 1.0}]]}), "string 'contents'"),
    (Reply(body={"result": [["just a string"]]}), "string 'contents'"),
    (Reply(body={"result": [[{"document": {"id": "1", "contents": "x"}, "score": "high"}]]}), "numeric scores"),
    (Reply(body=b'{"result": [[{"document": {"id": "1", "contents": "x"}, "score": NaN}]]}'), "numeric scores"),
])
def test_malformed_replies_are_infra_errors_never_empty_results(fake, reply, needle):
    fake.queue("/retrieve", reply)
    with retriever_server(fake.url) as server:
        r = search(server, "malformed")
        assert not r["ok"] and r["results"][0]["hits"] == []
        assert r["error"]["kind"] == "infra" and needle in r["error"]["message"], r["error"]
        assert len(fake.calls("/retrieve")) == 1  # a well-delivered bad reply is not retried by the transport


def test_flashrag_shape_errors(fake):
    fake.queue("/batch_search", Reply(body=[[{"id": "1", "contents": "x"}]]),
               Reply(body=[[[{"id": "1", "contents": "x"}]], [[0.5, 0.4]]]),
               Reply(body=[[[{"id": "1", "contents": '"A"\nb'}]], [[0.5]]]))
    with retriever_server(fake.url + "/batch_search") as server:
        for needle in ("documents per query", "equally long"):
            r = search(server, f"flash {needle}")
            assert r["error"]["kind"] == "infra" and needle in r["error"]["message"]
        r = search(server, "flash ok")
        assert r["ok"] and r["results"][0]["hits"][0]["title"] == "A"
        assert fake.calls("/batch_search")[-1].json() == {"query": ["flash ok"], "top_n": 3, "return_score": True}


@pytest.mark.parametrize("status,kind,needle", [
    # our server checked the query already and the body is the dialect's fixed schema: only configuration can
    # make a retriever refuse it, so the failure is ours (infra), never the model's
    (400, "infra", "configuration mismatch"),
    (422, "infra", "configuration mismatch"),
    (404, "infra", "--retriever-dialect"),
    (401, "infra", "credentials"),
])
def test_client_errors_are_classified(fake, status, kind, needle):
    fake.queue("/retrieve", Reply(status, {"detail": "no"}))
    with retriever_server(fake.url) as server:
        r = search(server, "refused")
        assert r["error"]["kind"] == kind and needle in r["error"]["message"] and not r["error"]["retryable"]
        assert len(fake.calls("/retrieve")) == 1


def test_documents_without_id_and_bare_documents(fake):
    """Search-R1's BM25 server stores {title, text, contents} without an id; some servers ignore return_scores."""
    doc = {"title": "Alpha", "text": "alpha text", "contents": '"Alpha"\nalpha text'}
    fake.queue("/retrieve", Reply(body={"result": [[{"document": doc, "score": 2}]]}),
               Reply(body={"result": [[doc]]}))
    with retriever_server(fake.url) as server:
        first = search(server, "alpha")["results"][0]["hits"][0]
        second = search(server, "alpha bare")["results"][0]["hits"][0]
        assert first["url"] == second["url"] and first["url"].startswith("corpus://sha256-")
        assert (first["title"], first["snippet"], first["score"], second["score"]) == ("Alpha", "alpha text", 2.0, None)
        page = post(server, "/tools/visit", {"urls": [first["url"]], "goal": "g"}).json()
        assert page["ok"] and page["results"][0]["page"]["content"] == "alpha text"
    sent = fake.calls("/retrieve")[0].json()
    assert sent == {"queries": ["alpha"], "topk": 3, "return_scores": True}


def test_server_stays_healthy_under_mixed_faults(fake):
    good = Reply(body={"result": [[{"document": {"id": "1", "contents": '"T"\nx'}, "score": 1.0}]]})
    fake.queue("/retrieve", Reset(), Reply(500), Reply(body=b"<html>"), Reply(429, headers={"retry-after": "0.05"}),
               Reply(body={"result": [[]]}, delay_s=5), *[good] * 20)
    with retriever_server(fake.url) as server:
        async def storm():
            async with ToolClient(server.url, timeout_s=10) as client:
                return await asyncio.gather(*(client.call("search", {"query": f"storm {i}"}) for i in range(12)))
        start = time.monotonic()
        results = asyncio.run(storm())
        assert time.monotonic() - start < 5.0
        assert all(r.text for r in results)
        assert all(r.ok or r.error_kind == "infra" for r in results) and sum(r.ok for r in results) >= 10


# ----------------------------------------------------------------------------------------------- configuration


def test_url_and_dialect_resolution():
    assert split_retriever_url("http://h:8000/", None) == ("http://h:8000", "search_r1")
    assert split_retriever_url("http://h:8000/retrieve", "auto") == ("http://h:8000", "search_r1")
    assert split_retriever_url("http://h/api/batch_search", None) == ("http://h/api", "flashrag")
    assert split_retriever_url("http://h", "flashrag") == ("http://h", "flashrag")
    with pytest.raises(ValueError, match="drop the path or the dialect"):
        split_retriever_url("http://h/retrieve", "flashrag")


@pytest.mark.parametrize("url,needle", [(None, "--retriever-url"), ("ftp://h/x", "absolute http(s) URL")])
def test_config_errors_name_the_fix(url, needle):
    with pytest.raises(ConfigError, match="retriever_url") as info:
        ServerConfig(backend="retriever", retriever_url=url).validate()
    assert needle in str(info.value)


def _cli(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "tool_server", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_serves_on_top_of_a_search_r1_server(upstream, tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text(f"RETRIEVER_URL={upstream.url}\n")  # the URL may come from .env instead of the flag
    with start_tool_server(["--backend", "retriever", "--env-file", str(env_file), "--port", "0"],
                           log_path=tmp_path / "tool_server.log") as url:
        assert url.startswith("http://127.0.0.1:"), url
        r = httpx.post(url + "/tools/search", json={"queries": ["Horatio Hale"], "topk": 1}, timeout=10).json()
        assert r["ok"] and r["results"][0]["hits"][0]["url"] == "corpus://1"


def test_cli_without_url_exits_2_with_the_fix():
    env = {k: v for k, v in os.environ.items() if k != "RETRIEVER_URL"}
    proc = _cli("--backend", "retriever", "--port", "0", env=env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == "" and "--retriever-url" in err and "RETRIEVER_URL" in err
