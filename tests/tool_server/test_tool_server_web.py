"""Web backend fault tests against fake Serper / Jina / chat upstreams served over real HTTP on 127.0.0.1.

Every call must end in a result or a structured error within its deadline, the server must stay healthy, and the
API keys must never appear in a response body or a log record.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

import httpx
import pytest

from fake_upstreams import CHAT_PATH, JINA_PATH, SERPER_PATH, FakeUpstream, InProcessServer, Reply, Reset
from tool_server import ToolClient
from tool_server.config import Secrets, ServerConfig, UpstreamLimits
from tool_server.process import start_tool_server

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("serper-SECRET-1a2b", "jina-SECRET-3c4d", "llm-SECRET-5e6f")
FAST = UpstreamLimits(concurrency=8, rate_per_s=1000.0, burst=100, attempt_timeout_s=0.5, max_attempts=3,
                      backoff_base_s=0.01, backoff_max_s=0.05)


@pytest.fixture(scope="module")
def fake():
    with FakeUpstream() as f:
        yield f


@pytest.fixture(autouse=True)
def no_secret_in_logs(caplog, fake):
    fake.reset()
    caplog.set_level(logging.DEBUG)
    yield
    for key in KEYS:
        assert key not in caplog.text


def web_server(fake, cache_path=None, serper=FAST, jina=FAST, summarizer=FAST, **overrides) -> InProcessServer:
    secrets = Secrets(serper_key=KEYS[0], jina_key=KEYS[1], api_key=KEYS[2], api_base=fake.url + CHAT_PATH,
                      summary_model="fake-model")
    settings = dict(search_deadline_s=3.0, visit_deadline_s=4.0, page_token_budget=1000, chars_per_token=4)
    config = ServerConfig(backend="web", serper_base_url=fake.url + SERPER_PATH, jina_base_url=fake.url + JINA_PATH,
                          allow_private_upstreams=True, cache_path=cache_path, serper=serper, jina=jina,
                          summarizer=summarizer, **{**settings, **overrides})
    return InProcessServer(config, secrets)


def call(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=30)
    for key in KEYS:
        assert key not in response.text
    return response.json()


def search(server, *queries, topk=3):
    return call(server, "/tools/search", {"queries": list(queries), "topk": topk})


def visit(server, *urls, goal="find the answer"):
    return call(server, "/tools/visit", {"urls": list(urls), "goal": goal})


def test_search_sends_key_and_locale_renders_and_caches(fake):
    with web_server(fake) as server:
        r = search(server, "capital of France", "法国的首都")
        assert r["ok"] and r["results"][0]["hits"][0]["url"] == "https://example.com/1"
        assert "1. [Result 1 for capital of France](https://example.com/1)\nDate published: Jan 1, 2020" in r["text"]
        sent = fake.calls(SERPER_PATH)
        assert [c.headers["x-api-key"] for c in sent] == [KEYS[0]] * 2
        bodies = {c.json()["q"]: c.json() for c in sent}
        assert bodies["capital of France"]["gl"] == "us" and bodies["法国的首都"]["gl"] == "cn"
        assert bodies["capital of France"]["num"] == 3
        again = search(server, "  Capital of   FRANCE ")  # normalised: same cache entry
        assert again["ok"] and again["results"][0]["cached"] and len(fake.calls(SERPER_PATH)) == 2
        stats = httpx.get(server.url + "/stats").json()
        assert stats["cache"]["hits"] == 1 and stats["upstream"]["serper"]["calls"] == 2


def test_identical_concurrent_searches_share_one_upstream_call(fake):
    fake.queue(SERPER_PATH, Reply(body={"organic": [{"title": "t", "link": "https://a.org", "snippet": "s"}]},
                                  delay_s=0.5))
    # A generous attempt deadline: on a loaded CI machine the 0.5 s of FAST expired and the retry made a second call.
    patient = UpstreamLimits(concurrency=8, rate_per_s=1000.0, burst=100, attempt_timeout_s=10.0, max_attempts=1)
    with web_server(fake, serper=patient) as server:
        async def burst():
            async with ToolClient(server.url) as client:
                return await asyncio.gather(*(client.call("search", {"query": "same"}) for _ in range(20)))
        results = asyncio.run(burst())
        assert all(r.ok for r in results) and len({r.text for r in results}) == 1
        assert len(fake.calls(SERPER_PATH)) == 1


def test_concurrency_limit_and_rate_limit_bound_upstream_load(fake):
    slow = Reply(body={"organic": [{"title": "t", "link": "https://a.org", "snippet": "s"}]}, delay_s=0.1)
    fake.queue(SERPER_PATH, *[slow] * 12)
    limited = UpstreamLimits(concurrency=3, rate_per_s=1000.0, burst=100, attempt_timeout_s=1.0, max_attempts=1)
    with web_server(fake, serper=limited) as server:
        r = search(server, *[f"distinct {i}" for i in range(12)])
        assert r["ok"] and fake.peak_in_flight == 3
    fake.reset()
    metered = UpstreamLimits(concurrency=8, rate_per_s=20.0, burst=1, attempt_timeout_s=1.0, max_attempts=1)
    with web_server(fake, serper=metered) as server:
        start = time.monotonic()
        assert search(server, *[f"metered {i}" for i in range(6)])["ok"]
        assert time.monotonic() - start >= 5 / 20.0 - 0.02  # 1 token at once, then 20 per second


def test_429_burst_honours_retry_after_then_succeeds(fake):
    limits = UpstreamLimits(concurrency=8, rate_per_s=1000.0, burst=100, attempt_timeout_s=0.5, max_attempts=4,
                            backoff_base_s=0.01, backoff_max_s=0.02)
    fake.queue(SERPER_PATH, *[Reply(429, {"message": "rate"}, headers={"retry-after": "0.15"})] * 3)
    with web_server(fake, serper=limits) as server:
        start = time.monotonic()
        r = search(server, "q429")
        elapsed = time.monotonic() - start
        assert r["ok"] and len(fake.calls(SERPER_PATH)) == 4
        assert elapsed >= 0.45  # three Retry-After pauses of 0.15 s, not the 0.02 s back-off
        failures = httpx.get(server.url + "/stats").json()["upstream"]["serper"]["failures"]
        assert failures == {"http_429": 3}


def test_retry_after_beyond_deadline_fails_fast(fake):
    fake.queue(SERPER_PATH, Reply(429, {"message": "rate"}, headers={"retry-after": "120"}))
    with web_server(fake) as server:
        start = time.monotonic()
        r = search(server, "slow down")
        assert time.monotonic() - start < 1.0
        assert r["error"]["kind"] == "infra" and r["error"]["retryable"] and "deadline" in r["error"]["message"]


def test_persistent_500s_end_in_retryable_infra_error(fake):
    fake.queue(SERPER_PATH, *[Reply(500, "boom")] * 5)
    with web_server(fake) as server:
        r = search(server, "q500")
        assert not r["ok"] and r["error"] == {"kind": "infra", "retryable": True, "message": r["error"]["message"]}
        assert "HTTP 500" in r["error"]["message"] and len(fake.calls(SERPER_PATH)) == FAST.max_attempts
        assert "not your mistake" in r["text"]
        # an infra failure is not cached: the next call goes upstream again and now succeeds
        assert search(server, "q500")["ok"]


def test_hanging_upstream_times_out_within_deadline(fake):
    fake.queue(SERPER_PATH, *[Reply(body={"organic": []}, delay_s=30)] * 2)
    limits = UpstreamLimits(attempt_timeout_s=0.3, max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02)
    with web_server(fake, serper=limits) as server:
        start = time.monotonic()
        r = search(server, "hang")
        elapsed = time.monotonic() - start
        assert r["error"]["kind"] == "infra" and "timed out" in r["error"]["message"]
        assert 0.6 <= elapsed < 1.5  # 2 attempts x 0.3 s, far inside the 3 s deadline
    # with many attempts allowed, the item's deadline is what ends the call
    fake.queue(SERPER_PATH, *[Reply(body={"organic": []}, delay_s=30)] * 20)
    many = UpstreamLimits(attempt_timeout_s=0.3, max_attempts=20, backoff_base_s=0.01, backoff_max_s=0.02)
    with web_server(fake, serper=many, search_deadline_s=0.8) as server:
        start = time.monotonic()
        r = search(server, "hang longer")
        assert r["error"]["kind"] == "infra" and time.monotonic() - start < 0.8 + 0.5
        health = httpx.get(server.url + "/health").json()  # the server answers and names the failing upstream
        assert health["status"] == "degraded" and health["upstreams"]["serper"]["state"] == "down"
        assert health["upstreams"]["jina"]["state"] == "unknown"


def test_connection_resets_are_retried(fake):
    fake.queue(SERPER_PATH, Reset(), Reset())
    with web_server(fake) as server:
        r = search(server, "reset")
        assert r["ok"] and len(fake.calls(SERPER_PATH)) == 3
        failures = httpx.get(server.url + "/stats").json()["upstream"]["serper"]["failures"]
        assert failures == {"connection": 2}


def test_malformed_json_and_wrong_shapes_are_infra_errors(fake):
    fake.queue(SERPER_PATH, Reply(body=b"{not json"), Reply(body={"organic": "nope"}),
               Reply(body={"organic": [{"title": "no link"}]}))
    with web_server(fake) as server:
        messages = []
        for _ in range(3):
            r = search(server, "malformed")
            assert r["error"]["kind"] == "infra" and r["error"]["retryable"]
            messages.append(r["error"]["message"])
        assert "malformed JSON" in messages[0] and "organic" in messages[1] and "without links" in messages[2]
        empty = search(server, "nothing here")
        assert empty["error"]["kind"] == "no_results" and "No results found for 'nothing here'" in empty["text"]


def test_bad_credentials_are_reported_without_echoing_the_key(fake):
    fake.queue(SERPER_PATH, Reply(403, {"message": f"Unauthorized key {KEYS[0]}"}))
    with web_server(fake) as server:
        r = search(server, "auth")  # call() asserts the key is absent from the body
        assert r["error"]["kind"] == "infra" and not r["error"]["retryable"]
        assert "SERPER_KEY_ID" in r["error"]["message"] and len(fake.calls(SERPER_PATH)) == 1


def test_a_non_credential_4xx_is_a_configuration_failure_not_the_models(fake):
    """Serper's and Jina Reader's refusals of our request itself (a wrong base URL, a request the API does not take)
    are infra failures of class config, not retried and charged to our configuration; Reader's answers about the
    target page (422, 451) stay "the page could not be read"."""
    fake.queue(SERPER_PATH, Reply(404, {"message": "no such route"}), Reply(400, {"message": "bad request"}))
    fake.queue(JINA_PATH, Reply(400, "unsupported request"), Reply(404, "not found"), Reply(451, "blocked domain"))
    with web_server(fake) as server:
        for status in (404, 400):
            r = search(server, f"config {status}")
            assert r["error"]["kind"] == "infra" and not r["error"]["retryable"], r
            assert f"HTTP {status}" in r["error"]["message"] and "--serper-base-url" in r["error"]["message"]
            assert "not your mistake" in r["text"]
        assert len(fake.calls(SERPER_PATH)) == 2  # no retry
        for status in (400, 404):
            r = visit(server, f"https://example.org/{status}")
            assert r["error"]["kind"] == "infra" and not r["error"]["retryable"], r
            assert f"HTTP {status}" in r["error"]["message"] and "--jina-base-url" in r["error"]["message"]
        blocked = visit(server, "https://example.org/blocked")
        assert blocked["error"]["kind"] == "no_results" and "HTTP 451" in blocked["error"]["message"]
        upstreams = httpx.get(server.url + "/health").json()["upstreams"]
        assert upstreams["serper"]["state"] == "down" and upstreams["jina"]["state"] != "ok", upstreams
        failures = httpx.get(server.url + "/stats").json()["upstream"]
        assert failures["serper"]["failures"] == {"config": 2} and failures["jina"]["failures"] == {"config": 2}


def test_visit_fetches_with_jina_and_summarises(fake):
    with web_server(fake) as server:
        r = visit(server, "https://example.org/page", goal="what is the answer")
        assert r["ok"], r
        page = r["results"][0]["page"]
        assert page["title"] == "Page at https://example.org/page" and "The answer is 42" in page["evidence"]
        assert r["text"].startswith("The useful information in https://example.org/page for user goal "
                                    "what is the answer as follows:")
        (jina,) = fake.calls(JINA_PATH)
        assert jina.path == JINA_PATH + "/https://example.org/page"
        assert jina.headers["authorization"] == f"Bearer {KEYS[1]}" and "x-timeout" in jina.headers
        (chat,) = fake.calls(CHAT_PATH)
        assert chat.headers["authorization"] == f"Bearer {KEYS[2]}" and chat.json()["model"] == "fake-model"


def test_huge_page_is_truncated_before_summarising(fake):
    jina = UpstreamLimits(concurrency=4, attempt_timeout_s=2.0, max_attempts=2, backoff_base_s=0.01,
                          backoff_max_s=0.02, max_response_bytes=200_000)
    fake.queue(JINA_PATH, Reply(body="Markdown Content:\n" + "x" * 5_000_000,
                                headers={"content-type": "text/plain"}))
    with web_server(fake, jina=jina) as server:
        r = visit(server, "https://example.org/huge")
        assert r["ok"] and r["results"][0]["page"]["truncated"]
        prompt = fake.calls(CHAT_PATH)[0].json()["messages"][0]["content"]
        page = prompt.split("<page>")[1].split("</page>")[0].strip()
        assert len(page) == 1000 * 4  # page_token_budget * chars_per_token


def test_non_utf8_page_is_decoded_not_fatal(fake):
    fake.queue(JINA_PATH, Reply(body="Markdown Content:\nCaf\xe9 na\xefve \x80\x81".encode("latin-1"),
                                headers={"content-type": "text/plain"}),
               Reply(body="Markdown Content:\nCaf\xe9".encode("latin-1"),
                     headers={"content-type": "text/plain; charset=iso-8859-1"}))
    with web_server(fake) as server:
        r = visit(server, "https://example.org/latin1", "https://example.org/declared")
        assert r["ok"]
        prompts = [c.json()["messages"][0]["content"] for c in fake.calls(CHAT_PATH)]
        assert any("Caf\ufffd" in p for p in prompts)  # undeclared charset: replaced, not crashed
        assert any("Café" in p for p in prompts)       # declared charset honoured


def test_unreadable_page_is_no_results_and_bad_summaries_are_infra(fake):
    fake.queue(JINA_PATH, Reply(422, "cannot load"))
    fake.queue(CHAT_PATH, *[Reply(body={"choices": [{"message": {"content": "I cannot produce JSON here."}}]})] * 3)
    with web_server(fake) as server:
        r = visit(server, "https://example.org/gone", "https://example.org/ok")
        kinds = [res["error"]["kind"] if res["error"] else None for res in r["results"]]
        assert sorted(kinds) == ["infra", "no_results"]
        assert r["error"]["kind"] == "infra"  # the most severe item decides the response


def test_visit_refuses_private_targets_even_with_the_upstream_escape_hatch(fake):
    with web_server(fake) as server:
        for url in (f"{fake.url}/jina/x", "http://localhost/admin", "http://10.0.0.1/", "http://[::1]/",
                    "http://169.254.169.254/latest/meta-data", "file:///etc/passwd", "ftp://example.org/"):
            r = visit(server, url)
            assert r["error"]["kind"] == "bad_request", url
        assert fake.calls(JINA_PATH) == []


def test_redirect_to_a_private_address_is_refused_and_keys_not_forwarded(fake):
    fake.queue(JINA_PATH, Reply(302, "", headers={"location": "http://127.0.0.2:9/steal"}))
    fake.queue(SERPER_PATH, Reply(307, "", headers={"location": f"http://localhost:{fake.port}/serper"}))
    with web_server(fake) as server:
        r = visit(server, "https://example.org/redirects")
        assert r["error"]["kind"] == "bad_request" and "127.0.0.2" in r["error"]["message"]
        r = search(server, "redirected")
        assert r["error"]["kind"] == "bad_request" and "localhost" in r["error"]["message"]
        assert len(fake.calls(SERPER_PATH)) == 1  # the redirect target was never contacted


def test_budget_caps_give_a_clear_error(fake):
    capped = UpstreamLimits(concurrency=8, rate_per_s=1000.0, burst=100, attempt_timeout_s=0.5, max_attempts=3,
                            backoff_base_s=0.01, backoff_max_s=0.05, budget=2)
    with web_server(fake, serper=capped) as server:
        assert search(server, "one")["ok"] and search(server, "two")["ok"]
        r = search(server, "three")
        assert r["error"]["kind"] == "budget" and "--budget-search" in r["error"]["message"]
        assert search(server, "one")["ok"]  # cached answers stay free
        assert len(fake.calls(SERPER_PATH)) == 2

        async def via_client():
            async with ToolClient(server.url) as client:
                return await client.call("search", {"query": "four"})
        result = asyncio.run(via_client())
        assert not result.ok and result.error_kind == "infra"


def test_cache_persists_across_server_restarts(fake, tmp_path):
    cache = str(tmp_path / "tools.sqlite")
    with web_server(fake, cache_path=cache) as server:
        assert search(server, "persist me")["ok"]
    with web_server(fake, cache_path=cache) as server:
        r = search(server, "persist me")
        assert r["ok"] and r["results"][0]["cached"]
    assert len(fake.calls(SERPER_PATH)) == 1


def test_retrieve_dialect_over_web_results(fake):
    with web_server(fake) as server:
        r = call(server, "/retrieve", {"queries": ["paris"], "topk": 2, "return_scores": True})
        doc = r["result"][0][0]["document"]
        assert doc == {"id": "https://example.com/1", "contents": '"Result 1 for paris"\nsnippet 1 about paris'}
        fake.queue(SERPER_PATH, *[Reply(503)] * 3)
        assert httpx.post(server.url + "/retrieve", json={"queries": ["down"]}).status_code == 503  # clients retry


def test_proxy_is_used_for_jina(fake):
    """With PROXY set, Jina requests go to the proxy in absolute form; the fake plays the proxy."""
    jina_origin = "http://jina.example.test"
    fake.queue(jina_origin, Reply(body="Markdown Content:\nvia proxy", headers={"content-type": "text/plain"}))
    secrets = Secrets(serper_key=KEYS[0], jina_key=KEYS[1], api_key=KEYS[2], api_base=fake.url + CHAT_PATH,
                      summary_model="fake-model", proxy=fake.url)
    config = ServerConfig(backend="web", serper_base_url=fake.url + SERPER_PATH, jina_base_url=jina_origin,
                          allow_private_upstreams=True, serper=FAST, jina=FAST, summarizer=FAST)
    with InProcessServer(config, secrets) as server:
        r = visit(server, "https://example.org/p")
        assert r["ok"], r
        (proxied,) = fake.calls(jina_origin)
        assert proxied.path == jina_origin + "/https://example.org/p"


def test_cli_web_server_never_prints_keys(fake, tmp_path):
    """The real CLI in a subprocess: secrets from the environment, faults that echo the key, then grep all output."""
    env = {**os.environ, "SERPER_KEY_ID": KEYS[0], "JINA_API_KEYS": KEYS[1], "API_KEY": KEYS[2],
           "API_BASE": fake.url + CHAT_PATH, "SUMMARY_MODEL_NAME": "fake-model",
           "SERPER_BASE_URL": fake.url + SERPER_PATH, "JINA_BASE_URL": fake.url + JINA_PATH}
    fake.queue(SERPER_PATH, Reply(401, {"message": f"bad key {KEYS[0]}"}), Reply(500, f"trace {KEYS[0]}"))
    fake.queue(JINA_PATH, Reply(403, f"denied {KEYS[1]}"))
    log = tmp_path / "tool_server.log"  # the server's stdout and stderr
    with start_tool_server(["--backend", "web", "--port", "0", "--allow-private-upstreams", "--max-attempts", "2",
                            "--log-level", "DEBUG"], log_path=log, env=env, cwd=ROOT) as url:
        bodies = [httpx.post(url + "/tools/search", json={"queries": [q]}, timeout=30).text
                  for q in ("first", "second")]
        bodies.append(httpx.post(url + "/tools/visit", json={"urls": ["https://example.org/"], "goal": "g"},
                                 timeout=30).text)
        bodies += [httpx.get(url + p).text for p in ("/stats", "/metrics", "/health")]
    output = log.read_text()
    assert json.loads(bodies[0])["error"]["kind"] == "infra" and json.loads(bodies[2])["error"]["kind"] == "infra"
    assert "tool_server" in output  # the log was captured, so the check below is not vacuous
    for key in KEYS:
        assert all(key not in b for b in bodies) and key not in output


def test_server_stays_healthy_under_mixed_faults(fake):
    fake.queue(SERPER_PATH, Reset(), Reply(500), Reply(body=b"<html>"), Reply(429, headers={"retry-after": "0.05"}),
               Reply(body={"organic": []}, delay_s=5))
    with web_server(fake) as server:
        async def storm():
            async with ToolClient(server.url, timeout_s=10) as client:
                calls = [client.call("search", {"query": f"storm {i}"}) for i in range(12)]
                calls += [client.call("visit", {"url": f"https://example.org/{i}", "goal": "g"}) for i in range(4)]
                return await asyncio.gather(*calls)
        start = time.monotonic()
        results = asyncio.run(storm())
        assert time.monotonic() - start < 5.0
        assert all(r.text for r in results)
        assert all(r.ok or r.error_kind in ("infra", "no_results") for r in results)
        assert sum(r.ok for r in results) >= 10
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        metrics = httpx.get(server.url + "/metrics").text
        for key in KEYS:
            assert key not in metrics
