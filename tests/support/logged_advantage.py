"""Recompute a step's GiGPO advantages from its trajectory log (``trainer.trajectory_dir``) alone, to check that the
log says what trained: each turn's logged advantage (the runs over its generated tokens) against GiGPO's formula
applied to the logged inputs (score, prompt uid, step group and invalid flag of every turn)."""

from __future__ import annotations

import math

import torch

from igpo.core.advantage import group_ids
from igpo.core.gigpo import GiGPOConfig, GiGPOInputs, gigpo_advantage
from igpo.integration.trajectory_log import token_advantages


def logged_turn_advantages(row: dict) -> list[float]:
    """One value per turn of a logged line: the advantage on its generated tokens inside the loss (NaN when none
    of them is). A turn whose tokens carry two values is an error: a turn-level method gives one per turn."""
    tokens = token_advantages(row)
    out = []
    for t, (start, end) in enumerate(row["turn_spans"]):
        values = {v for v in tokens[start:end] if v is not None}
        if len(values) > 1:
            raise AssertionError(f"uid {row['uid']} turn {t}: {len(values)} advantage values on one turn: {values}")
        out.append(values.pop() if values else math.nan)
    return out


def gigpo_from_log(rows: list[dict], cfg: GiGPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(recomputed, logged) [B, T] per-turn advantages of one GiGPO step's lines (NaN where a turn has no step row
    or no trained token)."""
    B, T = len(rows), max(len(r["turn_spans"]) for r in rows)
    num_turns = torch.tensor([len(r["turn_spans"]) for r in rows])
    step_group = torch.full((B, T), -1, dtype=torch.long)
    invalid = torch.zeros(B, T, dtype=torch.bool)
    logged = torch.full((B, T), math.nan, dtype=torch.float64)
    for i, row in enumerate(rows):
        n = int(num_turns[i])
        step_group[i, :n] = torch.tensor([int(g) for g in row["terms"]["step_group"]], dtype=torch.long)
        invalid[i, :n] = torch.tensor([bool(v) for v in row["terms"]["invalid"]])
        logged[i, :n] = torch.tensor(logged_turn_advantages(row), dtype=torch.float64)
    steps = step_group >= 0
    inputs = GiGPOInputs(outcome=torch.tensor([r["score"] for r in rows], dtype=torch.float64), num_turns=num_turns,
                         rows=steps, invalid=invalid & (torch.arange(T)[None, :] < num_turns[:, None]),
                         anchor=step_group, group=group_ids([r["uid"] for r in rows]))
    recomputed = gigpo_advantage(inputs, cfg).advantage
    return torch.where(steps, recomputed, math.nan), logged


def max_gigpo_log_error(rows: list[dict], cfg: GiGPOConfig) -> float:
    """max |recomputed − logged| over the turns that have both (inf when a turn has only one of the two)."""
    recomputed, logged = gigpo_from_log(rows, cfg)
    if not torch.equal(recomputed.isnan(), logged.isnan()):
        return math.inf
    both = ~recomputed.isnan()
    return float((recomputed - logged)[both].abs().max()) if bool(both.any()) else 0.0
