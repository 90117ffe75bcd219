"""Scoring requests: the prompt log-probabilities of a token sequence, asked of the rollout server outside any
trajectory. Two callers: ARPO's entropy after a tool result (``igpo.agent.arpo_loop``) and IGPO's answer
log-probabilities with ``algorithm.igpo.score_on=rollout`` (``igpo.agent.answer_scoring``).

A scoring request is ``max_tokens=1`` with ``prompt_logprobs=K`` (``scoring_params``): the server runs one prefill
and returns the log-probabilities of every prompt position in its output's ``extra_fields["prompt_logprobs"]``
(vLLM's layout). The one token it generates is thrown away; the request joins no trajectory.

Why not ``server.generate``. In the asynchronous trainer modes the agent loop's server is verl's
``FullyAsyncLLMServerClient``. Its ``generate`` sends an aborted request again after the pause and builds a fresh
output across the attempts that keeps the token ids, the log-probs and four ``extra_fields`` (``global_steps``,
``min_global_steps``, ``max_global_steps``, ``num_cached_tokens``): ``prompt_logprobs`` never reaches the caller.
A scoring request therefore goes through the base class's ``LLMServerClient.generate`` (``single_request``): one
request to one server, whose output comes back with all its fields. The synchronous mode's client is the base
class already, so every mode takes the same path.

A weight-sync pause. The asynchronous modes pause the rollout for every weight update: the server answers the
requests in flight with ``stop_reason="aborted"``, and in ``igpo_separate_async`` also the requests that arrive
during the pause. An aborted answer is never used, even one that carries prompt log-probs (its prefill may have
run on the weights being replaced): the request is sent again ``RESEND_WAIT_S`` later, as verl's client resends an
aborted generation, until a server answers it. Every measurement is thus one prefill by one weight version, the
version loaded during the pause when there was one; ``ScoringAnswer.version`` is the answer's ``global_steps``.
A request still aborted after ``RESEND_FOR_S`` is given up (``None``), and the caller counts it: ARPO as an
unmeasured turn (``arpo_unmeasured``), IGPO as an unscored boundary (``igpo_scoring_errors``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

# The wait before an aborted scoring request is sent again: verl's client waits 1 s before it resends an aborted
# generation, and a request sent into a closed gate either waits for it (igpo_colocate_async) or is aborted again.
RESEND_WAIT_S = 1.0
# How long aborted answers are resent before the request is given up and counted: a pause lasts one weight sync,
# far shorter than this; a rollout that keeps aborting for longer gets counted requests, not a hung trajectory.
RESEND_FOR_S = 600.0

ABORTED = ("aborted", "abort")  # vLLM's and the CPU hf server's stop reason, SGLang's


class PromptLogprobsMissing(RuntimeError):
    """The server answered a scoring request without ``prompt_logprobs``: it cannot score, so every request would
    fail alike. Each caller turns it into its own error with its fix."""

    def __init__(self, keys: Sequence[str]):
        self.keys = sorted(keys)
        super().__init__(f"the rollout server answered a prompt_logprobs request without 'prompt_logprobs' in "
                         f"extra_fields (keys: {self.keys})")


@dataclass(frozen=True)
class ScoringAnswer:
    """``prompt_logprobs``: the server's rows (row i: position i+1 given the tokens up to i); ``version``: the
    weight version that computed them (the answer's ``global_steps``; None when the server names none);
    ``resent``: how many aborted answers were thrown away before this one."""

    prompt_logprobs: list
    version: int | None
    resent: int


def scoring_params(top_k: int) -> dict[str, Any]:
    """The sampling parameters of a scoring request: top-``top_k`` prompt log-probs (0: the prompt token's own),
    untempered like vLLM's, one generated token."""
    return {"max_tokens": 1, "prompt_logprobs": int(top_k), "temperature": 1.0}


def single_request(server: Any) -> Callable[..., Awaitable[Any]]:
    """The ``generate`` that sends one request and returns the server's own output: the base client's for verl's
    fully asynchronous client (module docstring), the server's ``generate`` for anything else."""
    if isinstance(server, FullyAsyncLLMServerClient):
        return functools.partial(LLMServerClient.generate, server)
    return server.generate


async def request_prompt_logprobs(server: Any, request_id: str, prompt_ids: Sequence[int],
                                  top_k: int) -> ScoringAnswer | None:
    """Send one scoring request through ``single_request(server)``; resend it while it is aborted by a pause, for up to
    ``RESEND_FOR_S`` (then None). Raises ``PromptLogprobsMissing`` for an answer without prompt log-probs, and
    whatever the server raises (a context the engine refuses, a dead engine)."""
    send = single_request(server)
    deadline = time.monotonic() + RESEND_FOR_S
    resent = 0
    while True:
        out = await send(request_id=request_id, prompt_ids=prompt_ids, sampling_params=scoring_params(top_k))
        if out.stop_reason not in ABORTED:
            break
        if time.monotonic() + RESEND_WAIT_S > deadline:
            logger.warning("scoring request of %d tokens aborted %d times over %.0f s; given up and counted",
                           len(prompt_ids), resent + 1, RESEND_FOR_S)
            return None
        resent += 1
        await asyncio.sleep(RESEND_WAIT_S)
    fields = out.extra_fields or {}
    rows = fields.get("prompt_logprobs")
    if rows is None:
        raise PromptLogprobsMissing(list(fields))
    return ScoringAnswer(rows, fields.get("global_steps"), resent)
