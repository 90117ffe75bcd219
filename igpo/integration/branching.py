"""ARPO's tree in the trainer: the check that verl stored the tree the rollout built, and hard attribution."""

from __future__ import annotations

import torch

from igpo.agent.records import TurnBatch
from igpo.core import arpo as arpo_core


def arpo_tree_check(responses: torch.Tensor, response_mask: torch.Tensor, uids: list, turns: TurnBatch,
                    m: int) -> tuple[float, float]:
    """(branches whose response ids or mask differ from their parent's before their branch position, prompts whose
    rows are not exactly tree indices 0..m−1)."""
    meta = turns.branch_meta()
    group = arpo_core.soft_group_ids(uids)
    args = (group, meta["index"], meta["parent"], meta["branch_pos"])
    ok = arpo_core.prefix_identical(responses, *args) & arpo_core.prefix_identical(response_mask, *args)
    indices: dict = {}
    for u, i in zip(uids, meta["index"].tolist()):
        indices.setdefault(u, []).append(i)
    incomplete = sum(sorted(v) != list(range(m)) for v in indices.values())
    return float((~ok).sum()), float(incomplete)


def hard_attribution(advantages: torch.Tensor, response_mask: torch.Tensor, uids: list, turns: TurnBatch,
                     metrics: dict | None = None) -> torch.Tensor:
    """ARPO's hard attribution (``algorithm.arpo.attribution=hard``): every copy of a token that |S| branches share
    gets the mean advantage of the trajectories sharing it divided by |S|, so the copies train the token once
    (``igpo.core.arpo.hard_attribution``, from the rollout's tree records and its own response mask; soft trains it
    |S| times); ``arpo/hard_shared_tokens`` counts the trained tokens shared."""
    group = arpo_core.soft_group_ids(uids)
    meta = turns.branch_meta()
    if metrics is not None:
        shared = arpo_core.share_counts(group, meta["index"], meta["parent"], meta["branch_pos"],
                                        advantages.shape[1]) > 1
        metrics["arpo/hard_shared_tokens"] = float((shared & response_mask.bool()).sum())
    return arpo_core.hard_attribution(advantages, response_mask.bool(), group, meta["index"], meta["parent"],
                                      meta["branch_pos"])
