"""Rollout-side answer scoring for the ``igpo_agent`` loop (``algorithm.igpo.score_on=rollout``;
docs/design/reference_igpo.md §1.1-1.3).

After every scored boundary b_s the loop asks the rollout engine for the log-probabilities of the pseudo answer
P(gt), one request per gold-alias probe:

    l_s = (1/|G|) * sum_{k in G} log pi(y_k | context[:b_s], y_<k)

as a background request that overlaps the next generation and tool call. A request that would not fit
``rollout.max_model_len`` is not sent; a boundary whose request fails is left unscored and counted; a server that
cannot answer scoring requests at all stops the run (``RolloutScoringUnavailable``).

Each request goes through ``igpo.agent.scoring_request`` (shared with ARPO's entropy): in the asynchronous trainer
modes it bypasses the resume loop of verl's ``FullyAsyncLLMServerClient``, which drops ``prompt_logprobs``, and a
request aborted by a weight-sync pause is sent again after it, so that boundary is scored by the weights loaded
during the pause. A boundary is always scored by one weight version, but the boundaries of one trajectory may be
scored by different versions (the trajectory itself spans them; ``TurnRecord.turn_versions``). A request aborted
for longer than ``scoring_request.RESEND_FOR_S`` leaves its boundary unscored and counted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from igpo.agent.records import TurnRecord
from igpo.agent.scoring_request import PromptLogprobsMissing, request_prompt_logprobs
from igpo.core.ground_truth import Probe
from igpo.core.info_gain import InfoGainConfig, scored_boundaries

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


class RolloutScoringUnavailable(RuntimeError):
    """The rollout server cannot answer scoring requests; raised to stop the run (never counted per boundary)."""


@dataclass
class AnswerScoring:
    """The scoring requests of one trajectory: one background task per scored boundary (keyed by turn), sent to
    ``server_manager`` under the trajectory's ``request_id``."""

    server_manager: Any
    request_id: str
    probes: list[Probe]
    info_gain: InfoGainConfig
    max_model_len: int | None
    tasks: dict[int, asyncio.Task] = field(default_factory=dict)

    def schedule(self, record: TurnRecord, context: list[int], turn: int, boundary: int) -> None:
        """Start scoring boundary ``turn`` (at ``boundary`` tokens of ``context``) when the method scores it."""
        # Boundary s depends only on turn s-1's tool; the placeholder stands for turn s (not known yet).
        scored = scored_boundaries([record.tool_names[:turn] + [None]], self.info_gain,
                                   [record.tool_status[:turn] + ["none"]])[0][turn]
        if not scored:
            return
        longest = boundary + max(len(p.token_ids) for p in self.probes)
        if self.max_model_len is not None and longest >= self.max_model_len:
            # The engine needs one token of room after the prompt; sent, the request would only be refused.
            logger.warning("igpo_agent: boundary %d is not scored: context %d + probe reaches %d tokens >= "
                           "rollout.max_model_len=%d", turn, boundary, longest, self.max_model_len)
            record.scoring_errors += 1
            return
        # The context list itself and the boundary, not a copy of the prefix: copying 95 K tokens costs ~1 ms per turn
        # late in a trajectory, and the context only grows by appends, so its first `boundary` tokens stay as they are.
        self.tasks[turn] = asyncio.create_task(self._score_boundary(context, boundary))

    def cancel(self, turn: int | None = None) -> None:
        """Cancel the request of boundary ``turn`` (a boundary that got no turn), or every request (None)."""
        if turn is None:
            for task in self.tasks.values():
                task.cancel()
            return
        task = self.tasks.pop(turn, None)
        if task is not None:
            task.cancel()

    async def collect(self, record: TurnRecord) -> None:
        """Wait for every request; ``record.answer_logprobs`` gets one entry per boundary (None: not scored)."""
        results: list[list[float] | None] = [None] * len(record.boundaries)
        for turn, task in self.tasks.items():
            try:
                results[turn] = await task
            except RolloutScoringUnavailable:
                raise
            except Exception as err:  # noqa: BLE001 - a failed boundary is recorded as unscored and counted
                logger.warning("igpo_agent: answer scoring of boundary %d failed: %s", turn, err)
                record.scoring_errors += 1
        self.tasks.clear()
        record.answer_logprobs = results

    async def _score_boundary(self, context: list[int], boundary: int) -> list[float]:
        """l_s for every alias probe: mean of log p(y_k | context[:boundary], y_<k) over the probe's ground-truth span
        G. ``context`` is the trajectory's live, append-only token list."""

        async def one(probe: Probe) -> float:
            try:
                answer = await request_prompt_logprobs(
                    self.server_manager, self.request_id, PrefixPlusProbe(context, boundary, probe.token_ids), 0)
            except PromptLogprobsMissing as error:
                raise RolloutScoringUnavailable(
                    f"algorithm.igpo.score_on=rollout: {error}, so no boundary's information gain can be computed. "
                    "Use a server that returns them (vLLM, or the CPU hf rollout), or algorithm.igpo.score_on=actor."
                ) from None
            if answer is None:  # aborted by pauses for longer than scoring_request.RESEND_FOR_S
                raise RuntimeError("the scoring request was aborted by weight-sync pauses and given up")  # counted
            rows = answer.prompt_logprobs
            start, end = probe.span
            # rows[i] holds log p(token_{i+1} | tokens_<=i): probe token k sits at boundary + k.
            values = [_first(rows[boundary + k - 1]) for k in range(start, end)]
            return sum(values) / len(values)

        return list(await asyncio.gather(*(one(p) for p in self.probes)))


class PrefixPlusProbe(Sequence[int]):
    """The ``prompt_ids`` of a scoring request, ``context[:boundary] + probe``, without copying the context.

    The trajectory keeps appending to ``context`` while the request waits, so the view reads only its first
    ``boundary`` tokens, which appends never change. The copy is made where the engine needs one and not per turn in
    the loop: ``tolist()`` (verl's servers normalize ``prompt_ids`` with it) and pickling (a Ray call sends a plain
    list) build the list; an in-process engine may also iterate or index it.
    """

    __slots__ = ("_context", "_boundary", "_probe")

    def __init__(self, context: list[int], boundary: int, probe: list[int]):
        if not 0 <= boundary <= len(context):
            raise ValueError(f"scoring boundary {boundary} lies outside the context of {len(context)} tokens; a "
                             "boundary is the context length before a turn, so it cannot exceed the context.")
        self._context, self._boundary, self._probe = context, boundary, probe

    def __len__(self) -> int:
        return self._boundary + len(self._probe)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.tolist()[index]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"token index {index} out of range for a scoring prompt of {n} tokens")
        return self._context[i] if i < self._boundary else self._probe[i - self._boundary]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(itertools.islice(self._context, self._boundary), self._probe)

    def tolist(self) -> list[int]:
        return self._context[: self._boundary] + list(self._probe)

    def __reduce__(self) -> tuple[Any, tuple[list[int]]]:
        return list, (self.tolist(),)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, PrefixPlusProbe)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # a view of a growing list: equality by content, so not hashable

    def __repr__(self) -> str:
        return f"PrefixPlusProbe(context[:{self._boundary}] + {len(self._probe)} probe tokens)"


def _first(row: Any) -> float:
    """A prompt-logprob row is ``[logprob]`` (top-0 list) or a bare float, depending on the server."""
    return float(row[0] if isinstance(row, (list, tuple)) else row)
