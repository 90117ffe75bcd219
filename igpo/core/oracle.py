"""The oracle's turn reward (docs/methods/oracle.md): the demo world's own truth about each turn, as a potential over
the boundaries, so that IGPO's information-gain rule turns it into per-turn rewards unchanged.

Trajectory i has turns 0..N−1; boundary s is the context before turn s. With the agent loop's record of each turn,

    r_j = u_i    turn j made its chain's next correct hop (``TurnBatch.hop_right``): u_i = 1 (``progress_unit=hop``)
                 or 1/L_i for a chain of L_i hops (``progress_unit=chain``: Φ = hops/L, a finished chain is worth 1)
    r_j = −p     turn j is a tool call that did not (p = ``wrong_call_penalty``, 0 by default)
    r_j = 0      otherwise (an answer or a turn without a parsable call)

    Φ_s = Σ_{j<s} r_j                                      (Φ_0 = 0: the question alone has made no hop)

and the reward of a turn that ends at a scored boundary s is Φ_s − Φ_prev (``igpo.core.info_gain`` with
v_s := Φ_s): its own r_{s−1} when every boundary is scored, the sum over the turns since the previous scored
boundary otherwise. A row whose sample names no chain (``TurnBatch.hop_known`` False) has no truth: Φ is NaN there
and the caller gives it no turn reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from igpo.core.sections import section_values


@dataclass(frozen=True)
class OracleConfig:
    """``algorithm.oracle``.

    wrong_call_penalty: p ≥ 0, the turn reward of a tool call that did not make the chain's next correct hop (a wrong
        entity, a repeat of a reached one, a call that found nothing). 0 (default): only correct hops are rewarded,
        so a wrong call is worth what an unrewarded turn is; p > 0 makes it worse than that, the shape of a tool
        price.

    progress_unit: ``hop`` (default): a correct hop is worth 1; ``chain``: 1/L for a chain of L hops, so that the
        hop potential is the share of the chain made (Φ = hops/L) and two- and three-hop questions weigh alike (the
        potential of norm_mode=potential; docs/methods/turn_credit.md).
    """

    wrong_call_penalty: float = 0.0
    progress_unit: str = "hop"

    def __post_init__(self):
        if self.progress_unit not in PROGRESS_UNITS:
            raise ValueError(f"algorithm.oracle.progress_unit={self.progress_unit!r} is unknown; use one of "
                             f"{PROGRESS_UNITS} (1 per correct hop, or 1/L of a chain of L hops).")
        p = self.wrong_call_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and p >= 0):
            raise ValueError(f"algorithm.oracle.wrong_call_penalty={p!r} must be a finite number >= 0 (0 rewards "
                             "correct hops only; e.g. 0.5 also charges every call that made no correct hop).")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "OracleConfig":
        """From the ``algorithm.oracle`` mapping; unknown keys raise with the known ones, None keeps a default."""
        return cls(**section_values(cls, section, "oracle"))


PROGRESS_UNITS = ("hop", "chain")


def turn_truth(hop_right: Tensor, called: Tensor, wrong_call_penalty: float, unit: Tensor | None = None) -> Tensor:
    """r [B, T] float64 (module docstring): u_i for a correct hop (``unit`` [B] float, default 1), −p for another
    tool call, 0 otherwise.

    ``hop_right``, ``called`` [B, T] bool: turn j made its chain's next correct hop / is a tool call. A correct hop is
    a tool call by definition; a hop flag on a turn that called no tool is an inconsistent record and raises."""
    if hop_right.shape != called.shape or hop_right.dtype != torch.bool or called.dtype != torch.bool:
        raise ValueError(f"hop_right and called must be bool tensors of one [B, T] shape; got {hop_right.dtype} "
                         f"{tuple(hop_right.shape)} and {called.dtype} {tuple(called.shape)}.")
    if bool((hop_right & ~called).any()):
        row, turn = (int(v) for v in torch.nonzero(hop_right & ~called)[0])
        raise ValueError(f"trajectory {row}, turn {turn} is recorded as a correct hop but called no tool; the agent "
                         "loop's hop_right and tool_names disagree (records from another loop version?).")
    hop = torch.ones(hop_right.shape[0], dtype=torch.float64) if unit is None else unit.double()
    if hop.shape != hop_right.shape[:1] or not bool(torch.isfinite(hop).all()):
        raise ValueError(f"unit must be a finite [B] = ({hop_right.shape[0]},) tensor; got {tuple(hop.shape)}.")
    return torch.where(hop_right, hop[:, None], torch.where(called, -float(wrong_call_penalty), 0.0)).double()


def hop_potential(truth: Tensor, known: Tensor) -> Tensor:
    """Φ [B, T] float64, Φ_s = Σ_{j<s} r_j from the turn truth r [B, T]; NaN on the rows ``known`` [B] bool marks
    False (their sample names no chain). Entries at s ≥ N_i are sums over padding (r = 0 there) that no caller reads."""
    if truth.dim() != 2 or known.shape != truth.shape[:1] or known.dtype != torch.bool:
        raise ValueError(f"truth must be [B, T] and known bool [B]; got {tuple(truth.shape)} and {known.dtype} "
                         f"{tuple(known.shape)}.")
    # Exclusive sums (turn s comes after boundary s), shifted rather than cumsum − r, so that Φ is exact.
    before = torch.zeros_like(truth, dtype=torch.float64)
    before[:, 1:] = torch.cumsum(truth.double(), dim=1)[:, :-1]
    return torch.where(known[:, None], before, float("nan"))
