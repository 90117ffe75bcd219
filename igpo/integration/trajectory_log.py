"""Every training step's trajectories as JSON lines (``trainer.trajectory_dir: <dir>``; off by default).

verl's ``trainer.rollout_data_dir`` keeps the decoded text and the score. Checking a method by hand needs what the
advantage was computed from and what it came to: the exact token ids, the agent loop's turn record, and the advantage
the trainer applied with the method's own per-turn terms. Per step, one file ``<dir>/step_<n>.jsonl``, one line per
trajectory:

    step, uid              the training step and the prompt's group id
    prompt_ids             the prompt as the policy saw it (chat template applied), unpadded
    response_ids           the response: the policy's turns and the observations between them, unpadded
    response_mask          1 on the tokens the policy generated (the loss mask before infra masking)
    score                  the outcome reward (the sum of the row's rm_scores)
    record                 the turn record (``igpo.agent.records.TurnRecord.to_extra_fields``: turn ends,
                           boundaries, tools called and their status, the answer log-probs per boundary when the
                           rollout scored them, ``algorithm.igpo.score_on=rollout``, ...);
                           ``TurnRecord.from_extra_fields`` reads it back
    advantage              the advantage the actor trained this row with, as runs ``[start, end, value]`` over
                           response token offsets (end exclusive): every token of the final loss mask (after the
                           infra-failure policy and ARPO's hard attribution) lies in exactly one run, consecutive
                           tokens with one value share a run, and a token in no run is outside the loss (it trains
                           nothing). A turn-level method gives one run per turn.
    turn_spans             per turn the method saw, ``[start, end]``: the response offsets of its generated tokens
                           (from its boundary to its last generated token + 1; start null when the record has no
                           boundary for it)
    terms                  the method's own terms (``MethodResult.terms``), by name: a number per trajectory or a
                           list with one entry per turn, null where the term has no value. IGPO: ``answer_logprob``
                           (v at each boundary, from whichever side scored it), ``information_gain`` (IG of the turns
                           credited), ``format_penalty``, ``outcome`` (after the answer-format penalty),
                           ``outcome_weight`` and ``ig_weight`` (the step's curriculum and warm-up weights);
                           GiGPO: ``episode_advantage`` (A^E), ``step_advantage`` (A^S before ω),
                           ``step_return`` (G), ``step_group`` (dense id within the step, -1: no step row),
                           ``similarity_joined`` (1 where a turn joined its step group by similarity, not
                           identity), ``invalid``; InfoPO: ``intrinsic`` (the counterfactual term I_t, credited to
                           the turn whose observation it measures), ``gate`` (the variance gate of the row's group),
                           ``beta`` and ``magnitude_ratio`` (the step's β_t and m). verl's own estimators: none.

Written by the trainer after the step's advantage and its masking, so a line describes exactly what trained; the
terms are the method's, before ARPO's hard attribution (which changes only the applied advantage). Cost when on: the
ids of the step fetched once more from TransferQueue and a few kB of JSON per trajectory; nothing when off.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from igpo.agent.records import TurnRecord


def trajectory_dir(trainer_config: Any) -> Path | None:
    """``trainer.trajectory_dir`` (absent or null: off); created at start so that a bad path fails before step 1."""
    value = trainer_config.get("trajectory_dir", None)
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ValueError(f"trainer.trajectory_dir={value!r} must be a directory path (every step's trajectories as "
                         "JSON lines) or null.")
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"trainer.trajectory_dir={value}: cannot create it ({error}); choose a writable "
                         "directory or leave it null.") from error
    return path


@dataclass(frozen=True)
class Applied:
    """What trained a step, for the log: ``advantages`` and ``loss_mask`` [B, L] as the actor gets them,
    ``num_turns`` [B] (the turns the method saw) and the method's ``terms`` ([B] or [B, T] tensors)."""

    advantages: torch.Tensor
    loss_mask: torch.Tensor
    num_turns: torch.Tensor
    terms: dict[str, torch.Tensor]


def advantage_runs(values: torch.Tensor, mask: torch.Tensor) -> list[list]:
    """``[[start, end, value], ...]``: the maximal runs of consecutive tokens of one row's ``mask`` [L] that share a
    value of ``values`` [L] (end exclusive; tokens outside ``mask`` are in no run)."""
    where = torch.nonzero(mask.bool()).flatten()
    if where.numel() == 0:
        return []
    held = values[where]
    starts = torch.ones(where.numel(), dtype=torch.bool)
    starts[1:] = (where[1:] != where[:-1] + 1) | (held[1:] != held[:-1])
    first = torch.nonzero(starts).flatten().tolist()
    last = [*first[1:], where.numel()]
    at, value = where.tolist(), held.tolist()
    return [[at[a], at[b - 1] + 1, value[a]] for a, b in zip(first, last)]


def _plain(value: float) -> float | None:
    """A JSON number, or null for NaN (JSON has no NaN)."""
    return None if math.isnan(value) else value


def _terms_of_row(terms: dict[str, torch.Tensor], i: int, turns: int) -> dict[str, Any]:
    row = {}
    for name, values in terms.items():
        if values.dim() == 1:
            row[name] = _plain(float(values[i]))
        elif values.dim() == 2:
            row[name] = [_plain(float(v)) for v in values[i, :turns].tolist()]
        else:
            raise ValueError(f"trajectory log: the method's term {name!r} is {tuple(values.shape)}; a term is [B] (per "
                             "trajectory) or [B, T] (per turn).")
    return row


def turn_spans(record: TurnRecord, prompt_length: int, turns: int) -> list[list]:
    """``[[start, end], ...]`` of the first ``turns`` turns: their generated tokens as response offsets."""
    spans = []
    for t, end in enumerate(record.turn_ends[:turns]):
        start = record.boundaries[t] - prompt_length if t < len(record.boundaries) else None
        spans.append([start, int(end) + 1])
    return spans


def write_step(directory: Path, step: int, uids: Sequence, prompts: Sequence[torch.Tensor],
               responses: Sequence[torch.Tensor], response_mask: torch.Tensor, scores: torch.Tensor,
               records: Sequence[TurnRecord], applied: Applied | None = None) -> Path:
    """One line per trajectory into ``directory/step_<step>.jsonl`` (written whole, then renamed into place).
    ``prompts`` and ``responses``: one id tensor per row, unpadded; ``response_mask`` and ``scores``: [B, L],
    padded; ``applied``: the advantage that trained and the method's terms (the trainer always passes it; without it
    a line has no ``advantage``, ``turn_spans`` or ``terms``)."""
    if not len(uids) == len(prompts) == len(responses) == len(records) == response_mask.shape[0]:
        raise ValueError(f"trajectory log: step {step} has {len(uids)} uids, {len(prompts)} prompts, "
                         f"{len(responses)} responses, {len(records)} records and {response_mask.shape[0]} mask rows")
    if applied is not None and applied.advantages.shape != response_mask.shape:
        raise ValueError(f"trajectory log: step {step}'s advantages are {tuple(applied.advantages.shape)}, its "
                         f"response mask {tuple(response_mask.shape)}")
    path = directory / f"step_{step:05d}.jsonl"
    partial = path.with_suffix(".jsonl.partial")
    with partial.open("w") as out:
        for i, record in enumerate(records):
            response = responses[i].tolist()
            line = {
                "step": step, "uid": str(uids[i]), "prompt_ids": prompts[i].tolist(), "response_ids": response,
                "response_mask": response_mask[i, :len(response)].int().tolist(),
                "score": float(scores[i].sum()), "record": record.to_extra_fields(),
            }
            if applied is not None:
                turns = int(applied.num_turns[i])
                line["advantage"] = advantage_runs(applied.advantages[i].double(), applied.loss_mask[i])
                line["turn_spans"] = turn_spans(record, int(prompts[i].numel()), turns)
                line["terms"] = _terms_of_row(applied.terms, i, turns)
            out.write(json.dumps(line, allow_nan=False) + "\n")
    os.replace(partial, path)
    return path


def token_advantages(row: dict[str, Any]) -> list[float | None]:
    """A logged line's advantage per response token (None: outside the loss), from its runs."""
    out: list[float | None] = [None] * len(row["response_ids"])
    for start, end, value in row["advantage"]:
        out[start:end] = [value] * (end - start)
    return out


def read_step(path: Path) -> list[dict[str, Any]]:
    """The lines of one step's file, each with its ``record`` as a ``TurnRecord``."""
    rows = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        row["record"] = TurnRecord.from_extra_fields(row["record"])
        rows.append(row)
    return rows
