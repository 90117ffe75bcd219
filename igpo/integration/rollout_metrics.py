"""Rollout health metrics of one training step, from the agent loop's turn records (every method, verl's too)."""

from __future__ import annotations

import numpy as np
import torch

from igpo.agent.records import TreeBatch, TurnBatch
from igpo.core import arpo as arpo_core
from igpo.core.health import turn_health


def rollout_metrics(turns: TurnBatch) -> dict[str, float]:
    """Infra errors (not the model's fault), forced finals, cut-offs, truncations, boundaries the rollout could not
    score (score_on=rollout), trajectories the engine refused as too long, tool calls, and ``arpo/*`` when the
    arpo_agent loop branched."""
    records = turns.records

    def share(flag: str) -> float:
        return float(np.mean([bool(getattr(r, flag)) for r in records])) if records else 0.0

    def total(count: str) -> float:
        return float(sum(int(getattr(r, count) or 0) for r in records))

    # Every turn that called a tool (malformed and answer turns excluded): what ARPO claims to halve vs GRPO, and
    # the infra breaker's denominator.
    calls = [sum(name is not None for name in r.tool_names) for r in records]
    # Turns the protocol's format check passed (tool and answer turns alike): "the protocol is known".
    checked = [bool(ok) for r in records for ok in r.format_ok]
    return {
        **arpo_metrics(turns.tree),
        "igpo/turns_mean": float(turns.num_turns.float().mean()) if len(turns.num_turns) else 0.0,
        "igpo/tool_calls_per_trajectory": float(np.mean(calls)) if records else 0.0,
        "igpo/infra_errors": total("infra_errors"),
        "igpo/tool_calls": float(sum(calls)),
        "igpo/scoring_errors": total("scoring_errors"),
        "igpo/forced_final_ratio": share("forced_final"),
        "igpo/cutoff_ratio": share("cutoff"),
        "igpo/truncated_ratio": share("truncated"),
        "igpo/context_overflow_ratio": share("context_overflow"),
        "health/format_ok_turn_share": float(np.mean(checked)) if checked else 0.0,
        **turn_health(r.tool_status for r in records),
        **hop_metrics(turns),
    }


def hop_metrics(turns: TurnBatch, max_hop: int = 4) -> dict[str, float]:
    """Chain progress of the rows whose sample names its chain (``TurnBatch.hop_known``; empty when none does), for
    k = 1..``max_hop``: ``hop/reach<k>``, the share of those trajectories that made k correct hops; and, by the k-th
    tool call of a trajectory, ``hop/call<k>_right`` and ``hop/call<k>_wrong``, the share of trajectories whose k-th
    call made the chain's next correct hop or did not (their sum: the share that made a k-th call); and
    ``hop/chain_complete``, the share that made every hop of their chain (reached the passage naming the answer), where
    the records carry the chain's length."""
    rows = turns.hop_known
    count = int(rows.sum())
    if not count:
        return {}
    called = torch.tensor([[name is not None for name in names] + [False] * (turns.width - len(names))
                           for names in turns.tool_names], dtype=torch.bool)[rows]
    right = turns.hop_right[rows] & called
    rank = torch.where(called, called.long().cumsum(1), 0)  # the turn's rank among the row's tool calls
    reached = right.sum(1)
    out = {}
    for k in range(1, max_hop + 1):
        out[f"hop/reach{k}"] = float((reached >= k).sum()) / count
        out[f"hop/call{k}_right"] = float((right & (rank == k)).sum()) / count
        out[f"hop/call{k}_wrong"] = float((~right & (rank == k)).sum()) / count
    if turns.hop_total is not None and bool((turns.hop_total[rows] > 0).all()):
        out["hop/chain_complete"] = float((reached >= turns.hop_total[rows]).sum()) / count
    return out


def arpo_metrics(tree: TreeBatch) -> dict[str, float]:
    """``arpo/*`` of the rows the arpo_agent loop recorded a tree for (``igpo.core.arpo.step_metrics``); empty
    without ARPO."""
    rows = tree.recorded
    deltas = [d for kept, measured in zip(rows.tolist(), tree.delta_h) if kept for d in measured]
    return arpo_core.step_metrics(tree.group[rows], tree.index[rows], tree.parent[rows], tree.branch_pos[rows],
                                  tree.is_topup[rows], tree.unmeasured[rows], deltas)
