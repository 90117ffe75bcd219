"""TIPS's turn reward (Xie et al., ICLR 2026, arXiv 2603.22293; docs/methods/tips.md): potential-based shaping with
the teacher's log-likelihood of the gold answer as the potential.

Trajectory i has turns 0..N−1; boundary s is the context before turn s (s = 0: the prompt alone). With Φ_s the
teacher's answer log-probability after boundary s (NaN where not scored or not finite) and γ the shaping's discount,
a tool turn j whose end boundary j+1 is scored gets

    r_j = γ · Φ_{j+1} − Φ_prev           Φ_prev: the latest finite scored boundary ≤ j (as IGPO's v_prev)

and, with ``terminal='zero'`` (the potential of the terminal state is 0, as in the authors' release), the answer
turn's outcome gains

    r_T = γ · 0 − Φ_last                 Φ_last: the latest finite scored boundary < N

so that along the reward positions the shaping sums to −Φ_0 at γ = 1 (Ng, Harada and Russell, 1999). Both are then
multiplied by one scale c per step: ``scale_mode='batch'`` (the authors' scale control) sets c so that the mean |c·r_j|
over the step's shaped turns with r_j ≠ 0 equals ``scale``; ``fixed`` uses c = ``scale``.

A row without a finite Φ_0 gets no shaping (as IGPO gives it no information gain). A scored boundary whose Φ is not
finite is a reward position of value 0 (counted as failed); the next turn's Φ_prev falls back past it, so at γ = 1
the sum still telescopes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from igpo.core.sections import section_values

TEACHERS = ("frozen", "refreshed")
TERMINALS = ("zero", "none")
SCALE_MODES = ("batch", "fixed")
NORM_ORDERS = ("after_discount", "before_discount")


@dataclass(frozen=True)
class TIPSConfig:
    """``algorithm.tips`` (docs/methods/tips.md, "Knobs").

    teacher: ``frozen``: the potentials come from verl's reference policy (the initial weights, never trained).
        ``refreshed`` is refused (docs/methods/tips.md, "What is refused").
    refresh_every: steps between refreshes of a refreshed teacher; must stay 0 with ``frozen``.
    gamma: the shaping's γ; None (default): ``algorithm.gamma``, the discount of the returns, which the invariance
        needs.
    terminal: ``zero`` (the authors'): the answer turn's outcome gains −c·Φ_last, so the shaping of a trajectory sums
        to −c·Φ_0 at γ = 1; ``none``: no terminal term, the shaping sums to c·(Φ_last − Φ_0) (rewards reaching a
        context in which the answer is likely; not invariant).
    scale_mode, scale: ``batch`` (the authors' scale control): c = scale / mean|r_j| over the step's non-zero shaped
        turns (the previous step's c when there is none); ``fixed``: c = scale. The authors' target is the middle of
        [0.02, 0.2], 0.11.
    norm_order: the order of the group normalisation and the discount for this method (it replaces
        ``algorithm.igpo.norm_order``, which TIPS does not read): ``after_discount`` normalises the discounted returns,
        in which the shaping telescopes; ``before_discount`` z-scores each turn's reward on its own, which breaks the
        telescoping (an ablation).
    """

    teacher: str = "frozen"
    refresh_every: int = 0
    gamma: float | None = None
    terminal: str = "zero"
    scale_mode: str = "batch"
    scale: float = 0.11
    norm_order: str = "after_discount"

    def __post_init__(self):
        if self.teacher not in TEACHERS:
            raise ValueError(f"algorithm.tips.teacher={self.teacher!r} is unknown; use one of {TEACHERS}.")
        if isinstance(self.refresh_every, bool) or not isinstance(self.refresh_every, int) or self.refresh_every < 0:
            raise ValueError(f"algorithm.tips.refresh_every={self.refresh_every!r} must be an integer >= 0.")
        if self.teacher == "frozen" and self.refresh_every:
            raise ValueError(f"algorithm.tips.refresh_every={self.refresh_every} with teacher=frozen: a frozen teacher "
                             "is never refreshed; remove refresh_every (or set it to 0).")
        g = self.gamma
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g <= 1.0):
            raise ValueError(f"algorithm.tips.gamma={g!r} must be a number in [0, 1], or null for algorithm.gamma.")
        if self.terminal not in TERMINALS:
            raise ValueError(f"algorithm.tips.terminal={self.terminal!r} is unknown; use one of {TERMINALS}.")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"algorithm.tips.scale_mode={self.scale_mode!r} is unknown; use one of {SCALE_MODES}.")
        s = self.scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
            raise ValueError(f"algorithm.tips.scale={s!r} must be a finite number > 0 (the authors' target: 0.11).")
        if self.norm_order not in NORM_ORDERS:
            raise ValueError(f"algorithm.tips.norm_order={self.norm_order!r} is unknown; use one of {NORM_ORDERS}.")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "TIPSConfig":
        """From the ``algorithm.tips`` mapping; unknown keys raise with the known ones, None keeps a default."""
        return cls(**section_values(cls, section, "tips"))


@dataclass
class Shaping:
    """``shaped_turn_rewards``'s result. ``reward`` [B, S−1] float64: r_j of tool turn j (0 where ``mask`` is False);
    ``mask`` [B, S−1] bool: the turns that carry a reward position (a reward of 0 is still one); ``terminal`` [B]
    float64: Φ_last of each shaped row, NaN for a row without a shaped turn; ``stats``: counts, as IGPO's."""

    reward: Tensor
    mask: Tensor
    terminal: Tensor
    stats: dict[str, float]


def shaped_turn_rewards(potential: Tensor, scored: Tensor, num_turns: Tensor, gamma: float) -> Shaping:
    """r_j = γ·Φ_{j+1} − Φ_prev per tool turn, and Φ_last per row (module docstring).

    Args:
        potential: [B, S] float, Φ_s; NaN where not scored or the scoring failed.
        scored: [B, S] bool, the boundaries meant to be scored (IGPO's ``scored_boundaries``).
        num_turns: [B] integer, N_i; boundaries s ≥ N_i are ignored.
        gamma: γ ∈ [0, 1].
    """
    if potential.dim() != 2 or not torch.is_floating_point(potential):
        raise ValueError(f"potential must be a float [B, S] tensor; got {potential.dtype} {tuple(potential.shape)}.")
    B, S = potential.shape
    if scored.shape != (B, S) or scored.dtype != torch.bool:
        raise ValueError(f"scored must be bool [B, S] = {(B, S)}; got {scored.dtype} {tuple(scored.shape)}.")
    if num_turns.shape != (B,) or num_turns.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_turns must be an integer [B] = ({B},) tensor; got {num_turns.dtype} "
                         f"{tuple(num_turns.shape)}.")
    if S < 1 or bool(((num_turns < 0) | (num_turns > S)).any()):
        raise ValueError(f"num_turns must lie in [0, S={S}] (one boundary per turn); got {num_turns.tolist()}.")
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma={gamma!r} must lie in [0, 1].")

    phi = potential.double()
    steps = torch.arange(S, device=phi.device)
    asked = scored & (steps[None, :] < num_turns[:, None])
    finite = torch.isfinite(phi)
    valid = asked & finite
    has_baseline = valid[:, 0]
    # Index of the latest valid boundary at or before s (-1 if none): a running max over masked step indices.
    last_valid = torch.where(valid, steps[None, :], torch.full_like(steps[None, :], -1)).cummax(dim=1).values
    phi_prev = phi.gather(1, last_valid[:, :-1].clamp(min=0))
    mask = asked[:, 1:] & has_baseline[:, None]
    reward = float(gamma) * phi[:, 1:] - phi_prev
    ok = mask & finite[:, 1:] & torch.isfinite(reward)
    reward = torch.where(ok, reward, torch.zeros_like(reward))
    shaped_row = mask.any(dim=1)
    last = last_valid.gather(1, (num_turns.long() - 1).clamp(min=0)[:, None]).squeeze(1)
    terminal = phi.gather(1, last.clamp(min=0)[:, None]).squeeze(1)
    terminal = torch.where(shaped_row & (last >= 0), terminal, torch.full_like(terminal, math.nan))
    stats = {"ig_requested": float(asked[:, 1:].sum()), "ig_applied": float(mask.sum()),
             "ig_failed": float((mask & ~ok).sum()),
             "samples_without_baseline": float((asked[:, 1:].any(dim=1) & ~has_baseline).sum())}
    return Shaping(reward, mask, terminal, stats)


def batch_scale(reward: Tensor, mask: Tensor, target: float) -> float | None:
    """The authors' scale control: c = target / mean |r| over the masked rewards with |r| > 1e-8; None when there is
    none (the caller keeps its previous c)."""
    chosen = reward[mask & (reward.abs() > 1e-8)].abs()
    if chosen.numel() == 0:
        return None
    return float(target) / max(float(chosen.double().mean()), 1e-8)
