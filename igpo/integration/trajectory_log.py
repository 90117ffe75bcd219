"""Every training step's trajectories as JSON lines (``trainer.trajectory_dir: <dir>``; off by default).

verl's ``trainer.rollout_data_dir`` keeps the decoded text and the score. Checking information gain by hand needs
what the advantage was computed from: the exact token ids and the agent loop's turn record. Per step, one file
``<dir>/step_<n>.jsonl``, one line per trajectory:

    step, uid              the training step and the prompt's group id
    prompt_ids             the prompt as the policy saw it (chat template applied), unpadded
    response_ids           the response: the policy's turns and the observations between them, unpadded
    response_mask          1 on the tokens the policy generated (the loss mask before infra masking)
    score                  the outcome reward (the sum of the row's rm_scores)
    record                 the turn record (``igpo.agent.records.TurnRecord.to_extra_fields``: turn ends,
                           boundaries, tools called and their status, the answer log-probs per boundary when the
                           rollout scored them, ``algorithm.igpo.score_on=rollout``, ...);
                           ``TurnRecord.from_extra_fields`` reads it back

Written by the trainer after the step's advantage, so a line describes exactly the batch that trained. Cost when on:
the ids of the step fetched once more from TransferQueue and a few kB of JSON per trajectory; nothing when off.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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


def write_step(directory: Path, step: int, uids: Sequence, prompts: Sequence[torch.Tensor],
               responses: Sequence[torch.Tensor], response_mask: torch.Tensor, scores: torch.Tensor,
               records: Sequence[TurnRecord]) -> Path:
    """One line per trajectory into ``directory/step_<step>.jsonl`` (written whole, then renamed into place).
    ``prompts`` and ``responses``: one id tensor per row, unpadded; ``response_mask`` and ``scores``: [B, L],
    padded."""
    if not len(uids) == len(prompts) == len(responses) == len(records) == response_mask.shape[0]:
        raise ValueError(f"trajectory log: step {step} has {len(uids)} uids, {len(prompts)} prompts, "
                         f"{len(responses)} responses, {len(records)} records and {response_mask.shape[0]} mask rows")
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
            out.write(json.dumps(line) + "\n")
    os.replace(partial, path)
    return path


def read_step(path: Path) -> list[dict[str, Any]]:
    """The lines of one step's file, each with its ``record`` as a ``TurnRecord``."""
    rows = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        row["record"] = TurnRecord.from_extra_fields(row["record"])
        rows.append(row)
    return rows
