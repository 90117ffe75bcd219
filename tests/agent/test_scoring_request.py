"""Scoring requests in the asynchronous trainer modes (``igpo.agent.scoring_request``): through verl's own
``FullyAsyncLLMServerClient`` (its load balancer and Ray actor replaced by one in-process server, its ``generate``
untouched), ``prompt_logprobs`` is lost; through the single-request path ARPO's entropy and IGPO's rollout scores
arrive, and an answer aborted by a weight-sync pause is resent and measured by the weights after the pause."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray
from omegaconf import OmegaConf
from ray._private import auto_init_hook
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
from verl.workers.rollout.replica import TokenOutput

from igpo.agent import scoring_request
from igpo.agent.answer_scoring import RolloutScoringUnavailable
from igpo.agent.arpo_loop import ARPOSetupError
from igpo.agent.scoring_request import request_prompt_logprobs, single_request
from test_agent_loop import ANSWER as IGPO_ANSWER, FakeServer, rollout, scripted, search, visit
from test_arpo_loop import TreeServer, Tools, config, meta, run_prompt


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """A session that raises is recorded in the trainer's TransferQueue (``igpo.agent.failures.record``), whose client
    would start a whole local Ray runtime on first use and leave it running for the worker's later tests (one that then
    starts its own cluster fails). Here there is no trainer: Ray's automatic start is off, the record is not made (the
    function logs and goes on, as when the store is gone), and no Ray runtime may be left behind."""
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", False)
    yield
    assert not ray.is_initialized()


class FullyAsyncClient(FullyAsyncLLMServerClient):
    """verl's fully asynchronous client over one in-process server: ``_acquire_server`` hands out the server as a
    Ray handle looks (``handle.generate.remote(...)`` awaited); ``generate`` is verl's, resume loop and all."""

    def __init__(self, server, response_length: int = 4096):
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "hf",
                                                                     "response_length": response_length}}})
        super().__init__(config=config, load_balancer_handle=None)
        self.server = server

    async def _acquire_server(self, request_id, **extra):
        return "server-0", SimpleNamespace(generate=SimpleNamespace(remote=self.server.generate))

    def _release_server(self, server_id, request_id=None):
        pass


class Pausing:
    """Wraps a fake server: the first ``aborts`` answers to each distinct scoring request (by its tokens) are
    ``stop_reason="aborted"`` from weight version 3, carrying prompt log-probs of the old weights (all ``stale``); the
    answer after the pause comes from version 4."""

    def __init__(self, inner, aborts: int = 1, stale: float = 0.0):
        self.inner, self.aborts, self.stale = inner, aborts, stale
        self.seen: dict[tuple, int] = {}
        self.scoring_sent = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        k = sampling_params.get("prompt_logprobs")
        if k is None:
            return await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        self.scoring_sent += 1
        key = (tuple(prompt_ids), k)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= self.aborts:
            rows = [[self.stale] * max(k, 1) for _ in range(len(prompt_ids))]
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted",
                               extra_fields={"global_steps": 3, "prompt_logprobs": rows})
        out = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        out.extra_fields["global_steps"] = 4
        return out


@pytest.fixture
def quick_resend(monkeypatch):
    monkeypatch.setattr(scoring_request, "RESEND_WAIT_S", 0.001)


@pytest.fixture
def before_the_fix(monkeypatch):
    """Scoring requests sent through the client's own ``generate``, as before ``single_request`` existed."""
    monkeypatch.setattr(scoring_request, "single_request", lambda server: server.generate)


class Rows:
    """A server that answers scoring requests with row i = [-(i + 1) / 10] and generates one token."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        rows = [[-(i + 1) / 10] for i in range(len(prompt_ids))]
        return TokenOutput(token_ids=[0], log_probs=[0.0], stop_reason="length",
                           extra_fields={"global_steps": 7, "prompt_logprobs": rows})


# ------------------------------------------------------------------------------------------- the request itself


async def test_verl_fully_async_client_drops_prompt_logprobs_and_the_single_request_path_keeps_them():
    client = FullyAsyncClient(Rows())
    params = scoring_request.scoring_params(0)
    out = await client.generate("r", prompt_ids=[1, 2, 3], sampling_params=params)
    assert "prompt_logprobs" not in out.extra_fields  # verl's resume loop rebuilds the output
    assert sorted(out.extra_fields) == ["global_steps", "max_global_steps", "min_global_steps", "num_cached_tokens"]
    out = await single_request(client)(request_id="r", prompt_ids=[1, 2, 3], sampling_params=params)
    assert out.extra_fields["prompt_logprobs"] == [[-0.1], [-0.2], [-0.3]]
    answer = await request_prompt_logprobs(client, "r", [1, 2, 3], 0)
    assert answer == scoring_request.ScoringAnswer([[-0.1], [-0.2], [-0.3]], 7, 0)
    assert single_request(Rows) is Rows.generate  # any other server: its own generate


async def test_an_answer_without_prompt_logprobs_raises_with_the_keys(before_the_fix):
    with pytest.raises(scoring_request.PromptLogprobsMissing, match=r"keys: \['global_steps', 'max_global_steps'"):
        await request_prompt_logprobs(FullyAsyncClient(Rows()), "r", [1, 2, 3], 0)


async def test_an_aborted_answer_is_resent_and_measured_by_the_weights_after_the_pause(quick_resend):
    server = Pausing(Rows(), aborts=2, stale=-9.0)
    answer = await request_prompt_logprobs(FullyAsyncClient(server), "r", [1, 2], 0)
    assert answer.prompt_logprobs == [[-0.1], [-0.2]]  # not the aborted answer's rows, although it carried some
    assert (answer.version, answer.resent, server.scoring_sent) == (4, 2, 3)


async def test_a_request_aborted_past_the_resend_window_is_given_up(quick_resend, monkeypatch):
    monkeypatch.setattr(scoring_request, "RESEND_FOR_S", 0.02)
    server = Pausing(Rows(), aborts=10 ** 9)
    assert await request_prompt_logprobs(FullyAsyncClient(server), "r", [1, 2], 0) is None
    assert server.scoring_sent > 1


# ------------------------------------------------------------------------------------------- ARPO's entropy


def grow_async(tokenizer, m=4, aborts=0, **kw):
    """An ARPO prompt tree whose loop talks to verl's fully asynchronous client (the asynchronous modes' client)."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tree_server = TreeServer(tokenizer, eot, seed=0, answer_p=0.0, max_calls=1)
    server = Pausing(tree_server, aborts=aborts, stale=-2.302585) if aborts else tree_server
    outs = asyncio.run(run_prompt(tokenizer, config(m, **kw), FullyAsyncClient(server), Tools()))
    return outs, server


def test_arpo_entropy_is_lost_through_the_fully_async_client_before_the_fix(tiny_tokenizer, before_the_fix):
    with pytest.raises(ARPOSetupError, match="without 'prompt_logprobs'"):
        grow_async(tiny_tokenizer, branch_probability=1.0)


def test_arpo_entropy_arrives_through_the_fully_async_client(tiny_tokenizer):
    # first turn peaked (H_init ~ 0), turns after an observation uniform: every ΔH is ~ +1, as in igpo_sync
    outs, server = grow_async(tiny_tokenizer, branch_probability=0.0, entropy_weight=1.0)
    deltas = [d for o in outs for d in o.extra_fields["arpo_delta_h"]]
    assert deltas and all(d == pytest.approx(1.0, abs=1e-3) for d in deltas)
    assert all(o.extra_fields["arpo_h_init"] == pytest.approx(0.0, abs=1e-3) for o in outs)
    assert all(o.extra_fields["arpo_unmeasured"] == 0 for o in outs)
    assert sum(r[1] >= 0 for r in meta(outs)) > 0  # P = clip(0 + 1 * ΔH) = 1: the measured turns branched
    assert all(k == 10 for _, k in server.measures)


def test_arpo_entropy_after_a_pause_is_the_resent_measurement(tiny_tokenizer, quick_resend):
    # every scoring answer is first aborted with flat rows (H = 1 everywhere, ΔH = 0); the resent answers give
    # ΔH ~ +1, so the deltas show which answer was measured
    outs, server = grow_async(tiny_tokenizer, aborts=1, branch_probability=0.0, entropy_weight=1.0)
    deltas = [d for o in outs for d in o.extra_fields["arpo_delta_h"]]
    assert deltas and all(d == pytest.approx(1.0, abs=1e-3) for d in deltas)
    assert all(o.extra_fields["arpo_unmeasured"] == 0 for o in outs)
    assert server.scoring_sent == len(server.measures) + len(server.seen)  # one aborted answer per distinct request


def test_arpo_turns_aborted_past_the_resend_window_are_unmeasured_and_do_not_branch(tiny_tokenizer, quick_resend,
                                                                                   monkeypatch):
    monkeypatch.setattr(scoring_request, "RESEND_FOR_S", 0.01)
    outs, _ = grow_async(tiny_tokenizer, aborts=10 ** 9, branch_probability=1.0)
    assert sum(o.extra_fields["arpo_unmeasured"] for o in outs) > 0
    assert all(o.extra_fields["arpo_h_init"] is None and o.extra_fields["arpo_delta_h"] == [] for o in outs)
    assert [r[1] for r in meta(outs)] == [-1] * 4  # nothing measured, nothing branched: the free slots are top-ups


# ------------------------------------------------------------------------------------------- IGPO's rollout scores


def fully_async(server_cls=FakeServer, **pausing):
    """A ``server_cls`` for ``test_agent_loop.rollout``: the fake server behind verl's fully asynchronous client."""

    def build(tokenizer, policy, eot):
        inner = server_cls(tokenizer, policy, eot)
        return FullyAsyncClient(Pausing(inner, **pausing) if pausing else inner)

    return build


TURNS = (search("q"), visit("http://x"), IGPO_ANSWER)
SCORED = {"score_on": "rollout", "ig_tool_filter": "visit", "answer_alias": "max"}


async def test_igpo_rollout_scores_are_lost_through_the_fully_async_client_before_the_fix(tiny_tokenizer,
                                                                                           before_the_fix):
    with pytest.raises(RolloutScoringUnavailable, match="without 'prompt_logprobs'"):
        await rollout(tiny_tokenizer, scripted(*TURNS), server_cls=fully_async(), igpo=SCORED)


async def test_igpo_rollout_scores_arrive_through_the_fully_async_client(tiny_tokenizer):
    direct, *_ = await rollout(tiny_tokenizer, scripted(*TURNS), igpo=SCORED)
    through, client, _, _ = await rollout(tiny_tokenizer, scripted(*TURNS), server_cls=fully_async(), igpo=SCORED)
    lps = through.extra_fields["igpo_answer_logprobs"]
    assert lps == direct.extra_fields["igpo_answer_logprobs"] and lps[0] is not None and lps[2] is not None
    assert through.extra_fields["igpo_scoring_errors"] == 0 and client.server.scoring  # the server scored


async def test_igpo_rollout_scores_after_a_pause_are_the_resent_ones(tiny_tokenizer, quick_resend):
    direct, *_ = await rollout(tiny_tokenizer, scripted(*TURNS), igpo=SCORED)
    paused, client, _, _ = await rollout(tiny_tokenizer, scripted(*TURNS), server_cls=fully_async(aborts=1, stale=-9.0),
                                         igpo=SCORED)
    assert paused.extra_fields["igpo_answer_logprobs"] == direct.extra_fields["igpo_answer_logprobs"]
    assert paused.extra_fields["igpo_scoring_errors"] == 0
    assert client.server.scoring_sent == len(client.server.inner.scoring) + len(client.server.seen)


async def test_igpo_boundaries_aborted_past_the_resend_window_are_unscored_and_counted(tiny_tokenizer, quick_resend,
                                                                                      monkeypatch):
    monkeypatch.setattr(scoring_request, "RESEND_FOR_S", 0.01)
    out, *_ = await rollout(tiny_tokenizer, scripted(*TURNS), server_cls=fully_async(aborts=10 ** 9), igpo=SCORED)
    ex = out.extra_fields
    assert ex["igpo_answer_logprobs"] == [None, None, None] and ex["igpo_scoring_errors"] == 2  # boundaries 0, 2
