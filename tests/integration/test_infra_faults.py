"""Fault-injection matrix (issue 25): a real HTTP fake retriever that is down, slow, answers garbage, or fails a share
of its queries, behind the real tool server, called by the real tool client. For each fault: what the start-up
probe says, what each tool call becomes (infra failure or result, retried or not, within one deadline), what
/health reports, whether the infra breaker stops the run, and that no trajectory with an infrastructure failure
reaches the loss under the masking policies.
"""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import httpx
import pytest
import torch

from fake_upstreams import FakeUpstream, InProcessServer, Reply
from fault_retriever import ShareFailing, static_reply
import method_harness as harness
from test_trainer import TURN_TOKENS, _run, _trainer
from igpo.agent.agent_loop import _STATUS_OF_ERROR_KIND
from igpo.integration.infra_breaker import InfraBreaker, InfraBreakerConfig, describe_failures
from igpo.integration.tool_spend import step_metrics
from tool_server import ToolClient
from tool_server.app import build_service
from tool_server.config import ServerConfig, UpstreamLimits
from tool_server.probe import probe_backend

LIMITS = UpstreamLimits(concurrency=32, rate_per_s=1000.0, burst=100, attempt_timeout_s=1.0, max_attempts=3,
                        backoff_base_s=0.01, backoff_max_s=0.02)
DEADLINE_S = 2.5  # per search, retries included
# Faults that answer at once are counted attempt by attempt, so no attempt may time out on a loaded machine (a CI
# run beside training): they get a wide attempt timeout and deadline. Only the slow retriever needs the tight ones.
WIDE = (dataclasses.replace(LIMITS, attempt_timeout_s=10.0), 30.0)
TIMING = {"slow": (LIMITS, DEADLINE_S)}
CALLS = 20        # one search per trajectory; groups of four trajectories


def dead_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there any more
    return f"http://127.0.0.1:{port}"


# fault -> (fake's /retrieve handler or None for a dead port, the probe's finding, failed calls of CALLS,
#           attempts per failed call, /health state, does the breaker (0.2, 2 steps) stop, failure class)
MATRIX = {
    "down": (None, "connection error", CALLS, None, "down", True, "connection"),
    "slow": (lambda r: Reply(body={"result": [[]]}, delay_s=10), "timed out", CALLS, 2, "down", True, "timeout"),
    "garbage": (lambda r: Reply(body=b"<html>502 Bad Gateway</html>"), "malformed JSON", CALLS, 1, "down", True,
                "bad_reply"),
    "fails_half": ("share:0.5", None, CALLS // 2, LIMITS.max_attempts, "failing", True, "http_503"),
    "fails_5pct": ("share:0.05", None, 1, LIMITS.max_attempts, "ok", False, "http_503"),
}


def records_from(statuses: list[str]):
    """One trajectory per tool call (search, search, answer; the first search's status is the call's), as the agent
    loop records them; groups of four rollouts per prompt."""
    extras = [{"igpo_num_turns": 3, "igpo_turn_ends": [2, 7, 11], "igpo_tool_names": ["search", "search", None],
               "igpo_tool_status": [status, "ok", "answer"], "igpo_turn_format_ok": [True, True, True],
               "igpo_answer_logprobs": [[-3.0 + 0.1 * (i % 4)], [-2.0], [-1.0 - 0.2 * (i % 3)]],
               "igpo_answer_seen": [False, False, False], "igpo_infra_errors": int(status == "infra_error")}
              for i, status in enumerate(statuses)]
    mask = torch.zeros(len(statuses), 12, dtype=torch.bool)
    for start, end in TURN_TOKENS:
        mask[:, start:end] = True
    scores = torch.zeros(len(statuses), 12)
    scores[:, 11] = torch.tensor([float(i % 2) for i in range(len(statuses))])
    return extras, [f"q{i // 4}" for i in range(len(statuses))], mask, scores


@pytest.mark.parametrize("fault", list(MATRIX))
def test_fault_matrix(fault):
    handler, probe_finding, failed_calls, attempts, state, stops, failure_class = MATRIX[fault]
    share = None
    limits, deadline_s = TIMING.get(fault, WIDE)
    with FakeUpstream() as fake:
        if handler is None:
            url = dead_url()
        else:
            if isinstance(handler, str):
                share = ShareFailing(float(handler.split(":")[1]), static_reply)
                handler = share
            fake.defaults["/retrieve"] = handler
            url = fake.url
        config = ServerConfig(backend="retriever", retriever_url=url, retriever=limits, search_deadline_s=deadline_s)

        # 1. The start-up probe: one attempt, a line naming the retriever, its URL, what came back and the fix.
        failures = asyncio.run(_probe(config, deadline_s))
        if probe_finding is None:
            assert failures == [], [f.line() for f in failures]
        else:
            (failure,) = failures
            line = failure.line()
            assert line.startswith(f"upstream error: retriever at {url}/retrieve: ") and probe_finding in line, line
            assert "; start the retrieval server" in line or "; check --retriever-url" in line, line
        probe_requests = len(fake.calls("/retrieve"))
        assert probe_requests == (0 if handler is None else 1)  # the probe never retries

        # 2. The tool calls of one step, through the real server and client.
        with InProcessServer(config) as server:
            started = time.monotonic()
            results = asyncio.run(_search_all(server.url, [f"question {i}" for i in range(CALLS)]))
            elapsed = time.monotonic() - started
            stats = httpx.get(server.url + "/stats").json()
            health = httpx.get(server.url + "/health").json()
        statuses = [_STATUS_OF_ERROR_KIND.get(None if r.ok else r.error_kind, "infra_error") for r in results]
        assert statuses.count("infra_error") == failed_calls, statuses
        assert set(statuses) <= {"ok", "infra_error"}  # nothing is charged to the model
        assert elapsed < deadline_s + 2.0  # one deadline bounds every call, retries included (they run at once)
        if attempts is not None:  # retried within the deadline, never past it; a slow server is not hit 3 times
            assert len(fake.calls("/retrieve")) - probe_requests == failed_calls * attempts + (CALLS - failed_calls)
        # /health: the upstream's state from its recent calls, with the failure class
        upstream = health["upstreams"]["retriever"]
        assert upstream["state"] == state, upstream
        assert health["status"] == ("ok" if state == "ok" else "degraded")
        assert failure_class in upstream["failure_classes"], upstream

    # 3. Masking: no trajectory with an infrastructure failure reaches the loss (mask_trajectory: no loss token, no
    #    advantage, no weight in its group; mask_turn: the failed turn has no loss token).
    records = records_from(statuses)
    failed = torch.tensor([s == "infra_error" for s in statuses])
    for policy in ("mask_trajectory", "mask_turn"):
        trainer = _trainer(infra_failure=policy)
        metrics = {}
        infra = harness.infra(records[0], records[2], trainer.policy, metrics)
        if policy == "mask_trajectory":
            assert not infra.loss_mask[failed].any() and torch.equal(infra.loss_mask[~failed], records[2][~failed])
            assert metrics["igpo/infra_masked_trajectories"] == float(failed.sum())
            if not failed.all():
                adv, _ = _run(trainer, records)
                assert adv[failed].abs().max() == 0
        else:
            assert not infra.loss_mask[failed, 0:3].any() and metrics["igpo/infra_masked_turns"] == float(failed.sum())

    # 4. The breaker: the same failures for two steps stop the run, naming the upstream and the failure class.
    breaker = InfraBreaker(InfraBreakerConfig(max_share=0.2, steps=2))
    stop = [breaker.update(CALLS, failed_calls) for _ in range(2)]
    assert stop == [False, stops]
    described = describe_failures(step_metrics(None, stats, {}), "http://tool-server")
    assert described.startswith("retriever: ") and failure_class in described, described


async def _probe(config: ServerConfig, deadline_s: float = DEADLINE_S):
    service = build_service(config)
    try:
        return await probe_backend(service.backend, timeout_s=deadline_s)
    finally:
        await service.backend.aclose()


async def _search_all(url: str, queries: list[str]):
    async with ToolClient(url, timeout_s=30) as client:
        return await asyncio.gather(*(client.call("search", {"query": q}) for q in queries))


def test_what_the_model_wrote_that_cannot_be_sent_is_its_malformed_call_not_infra():
    """A lone surrogate ("caf\\udcff", valid in a Python str, not in UTF-8) or arguments far beyond every limit is
    refused by the client as the model's call (bad_request): no request goes out, nothing is masked."""
    with FakeUpstream() as fake:
        fake.defaults["/retrieve"] = static_reply
        config = ServerConfig(backend="retriever", retriever_url=fake.url, retriever=LIMITS)
        with InProcessServer(config) as server:
            results = asyncio.run(_calls(server.url, [{"query": "caf\udcff"}, {"query": ["ok", "x" * 200_000]},
                                                      {"query": "café"}]))
        assert [r.error_kind for r in results] == ["bad_request", "bad_request", None]
        assert "unpaired UTF-16 surrogate" in results[0].text and "200002 characters" in results[1].text
        assert [_STATUS_OF_ERROR_KIND[r.error_kind] for r in results] == ["bad_request", "bad_request", "ok"]
        assert [c.json()["queries"] for c in fake.calls("/retrieve")] == [["café"]]


async def _calls(url: str, arguments: list[dict]):
    async with ToolClient(url, timeout_s=30) as client:
        return [await client.call("search", a) for a in arguments]


@pytest.mark.parametrize("status", [400, 422])
def test_a_retriever_refusal_only_configuration_causes_is_ours_and_the_probe_names_it(status):
    with FakeUpstream() as fake:
        fake.defaults["/retrieve"] = lambda r: Reply(status, {"detail": "field required: query"})
        config = ServerConfig(backend="retriever", retriever_url=fake.url, retriever=LIMITS)
        (failure,) = asyncio.run(_probe(config))
        assert f"HTTP {status}" in failure.what and "configuration mismatch" in failure.what
        assert failure.fix.startswith("check --retriever-url and --retriever-dialect")
        with InProcessServer(config) as server:
            (result,) = asyncio.run(_calls(server.url, [{"query": "q"}]))
            health = httpx.get(server.url + "/health").json()["upstreams"]["retriever"]
        assert result.error_kind == "infra" and health["failure_classes"] == {"config": 1}
        assert len(fake.calls("/retrieve")) == 2  # one for the probe, one for the call: no retry of a refusal


def test_the_cli_probe_exits_2_with_the_line_and_masks_secrets(tmp_path):
    """``python -m tool_server --probe-only`` against a fake Serper that refuses the key: exit 2, the line names
    Serper, its URL and the fix, and the key itself never appears."""
    import os
    import subprocess
    import sys

    from fake_upstreams import CHAT_PATH, JINA_PATH, SERPER_PATH

    key = "sk-serper-secret-0123456789"
    with FakeUpstream() as fake:
        fake.defaults[SERPER_PATH] = lambda r: Reply(403, {"message": f"Unauthorized key {key}"})
        fake.defaults[CHAT_PATH] = lambda r: Reply(body={"choices": [{"message": {"role": "assistant",
                                                                                  "content": "OK"}}]})
        env = {**os.environ, "SERPER_KEY_ID": key, "JINA_API_KEYS": "jina-key-0123456789", "API_KEY": "llm-key",
               "API_BASE": fake.url + CHAT_PATH, "SUMMARY_MODEL_NAME": "m"}
        proc = subprocess.run([sys.executable, "-m", "tool_server", "--backend", "web", "--probe-only",
                               "--allow-private-upstreams", "--serper-base-url", fake.url + SERPER_PATH,
                               "--jina-base-url", fake.url + JINA_PATH], env=env, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "upstream error" in line]
    assert len(lines) == 1 and lines[0].startswith(f"tool_server: upstream error: serper at {fake.url}{SERPER_PATH}"
                                                   "/search: HTTP 403"), proc.stderr
    assert "check SERPER_KEY_ID" in lines[0] and key not in proc.stderr
