"""Keeping infrastructure failures out of the learning signal (issue #16, verl#6978).

A tool call that timed out, got a 5xx or hit a spent budget is our outage, not the policy's mistake: its observation
is an error text, so the information gain of that turn (and often the outcome) measures the outage. The policy
``algorithm.igpo.infra_failure`` decides what trains:

    mask_trajectory  every trajectory with a failed tool call: no reward position (so it takes no part in the group
                     mean/std of any sibling) and no loss token (response mask zero: no policy-gradient, no KL term)
    mask_turn        only the failed turn t: no IG reward on it, its generated tokens no loss; the rest of the
                     trajectory trains. A failed turn that is the last kept one (the response was cut after it)
                     carries the outcome, so its whole trajectory is masked instead.
    keep             train on everything (the behaviour before this knob); failures are only counted

Pure tensor functions; the trainer reads the failed turns from the agent loop's ``igpo_tool_status`` records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INFRA_FAILURE_POLICIES = ("mask_trajectory", "mask_turn", "keep")


@dataclass(frozen=True)
class InfraMask:
    """rows [B]: trajectories out of the signal; turns [B, T]: single turns out of it (mask_turn only);
    loss_mask [B, L]: the response mask with both removed (what the actor's loss and the advantage may use)."""

    rows: Tensor
    turns: Tensor
    loss_mask: Tensor

    @property
    def changed(self) -> bool:
        return bool(self.rows.any() or self.turns.any())


def token_turns(turn_ends: Tensor, num_turns: Tensor, length: int) -> Tensor:
    """[B, L] the turn of each response token: the first turn whose end is >= the token (tokens past the last kept
    turn, cut by the response length, to the last kept turn; rows without turns to 0)."""
    B, T = turn_ends.shape
    positions = torch.arange(length)[None, :].expand(B, length).contiguous()
    ends = torch.where(torch.arange(T)[None, :] < num_turns[:, None], turn_ends, length + 1)
    turn = torch.searchsorted(ends.contiguous(), positions)
    return torch.minimum(turn, (num_turns - 1).clamp(min=0)[:, None])


def infra_mask(failed: Tensor, num_turns: Tensor, turn_ends: Tensor, response_mask: Tensor, policy: str) -> InfraMask:
    """What ``policy`` takes out of training, from ``failed`` [B, T] (turn t's tool call failed for infrastructure
    reasons), ``num_turns`` [B], ``turn_ends`` [B, T] (last generated token of each turn) and ``response_mask``
    [B, L] bool."""
    if policy not in INFRA_FAILURE_POLICIES:
        raise ValueError(f"infra_failure={policy!r} is unknown; use one of {INFRA_FAILURE_POLICIES}.")
    if failed.shape != turn_ends.shape or failed.dtype != torch.bool:
        raise ValueError(f"failed must be a bool [B, T] tensor shaped like turn_ends {tuple(turn_ends.shape)}; got "
                         f"{failed.dtype} {tuple(failed.shape)}.")
    B, T = failed.shape
    kept = torch.arange(T)[None, :] < num_turns[:, None]
    failed = failed & kept
    none_rows = torch.zeros(B, dtype=torch.bool)
    none_turns = torch.zeros(B, T, dtype=torch.bool)
    if policy == "keep" or not failed.any():
        return InfraMask(none_rows, none_turns, response_mask)
    if policy == "mask_trajectory":
        rows, turns = failed.any(dim=1), none_turns
    else:
        last_turn = torch.arange(T)[None, :] == (num_turns - 1)[:, None]
        rows = (failed & last_turn).any(dim=1)
        turns = failed & ~last_turn & ~rows[:, None]
    loss_mask = response_mask & ~rows[:, None]
    if turns.any():
        owner = token_turns(turn_ends, num_turns, response_mask.shape[1])
        loss_mask = loss_mask & ~turns.gather(1, owner)
    return InfraMask(rows, turns, loss_mask)
