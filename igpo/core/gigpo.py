"""GiGPO: group-in-group policy optimisation (Feng et al., NeurIPS 2025; the verl-agent project), on turn tensors.

Trajectory i of prompt group g has turns t = 0..N_i−1; turn t acts from an anchor state s_{i,t} (what the agent
observed before acting; the integration layer decides what that is, ``docs/methods/gigpo.md``). Every turn is one
"step row", as verl-agent's environment steps are. With R_i the trajectory's outcome, c the invalid-action penalty
and v_{i,t} = 1 for a malformed turn (else 0):

    episode score    e_{i,t} = R_i − c·v_{i,t}
    step reward      r_{i,t} = R_i at the last turn N_i−1, else 0
    step return      G_{i,t} = Σ_{k≥t} γ^{k−t} r_{i,k} − c·v_{i,t}      (the penalty is added after discounting)

    episode advantage  A^E_{i,t} = (e_{i,t} − μ_g) / (σ_g + ε)   (mean_std_norm)  or  e_{i,t} − μ_g   (mean_norm)
        μ_g, σ_g over the episode pool of group g: every step row of g (``step_rows``: a trajectory counts once per
        turn, verl-agent's default) or one value per trajectory, the score of its first step row (``trajectories``);
        a pool of one value has μ = 0, σ = 1 (so A^E = e).
    step group       S = the step rows of group g whose anchor states are identical (rows of one trajectory too)
    step advantage   A^S_{i,t} = (G_{i,t} − μ_S) / (σ_S + ε)   (mean_std_norm)  or  G_{i,t} − μ_S   (mean_norm)
        a step group of one row has μ_S = G (so A^S = 0).
    advantage        A_{i,t} = A^E_{i,t} + ω · A^S_{i,t}

σ is the unbiased standard deviation (divisor n − 1). Rows outside ``rows`` (masked trajectories and turns) are in
no pool and get 0. Pure tensor functions: no verl, no Ray, no I/O. ``tests/core/test_gigpo.py`` checks them against
outputs of verl-agent's own functions recorded in ``tests/golden/gigpo_reference.json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from igpo.core.sections import section_values

MODES = ("mean_norm", "mean_std_norm")
ANCHORS = ("last_observation", "observation_history")
EPISODE_POOLS = ("step_rows", "trajectories")


@dataclass(frozen=True)
class GiGPOConfig:
    """``algorithm.gigpo``: every GiGPO knob (configs/igpo_base.yaml documents the same keys).

    step_advantage_weight: ω, the weight of the step-level advantage (verl-agent ``step_advantage_w``, default 1).
    mode: ``mean_norm`` (subtract the group mean: verl-agent's default) or ``mean_std_norm`` (also divide by σ + ε),
        for both levels.
    anchor: the state a turn acts from. ``last_observation`` (verl-agent's search environment: the question for the
        first turn, then the content of the latest tool observation alone) or ``observation_history`` (the question
        plus every observation so far: two turns share a state only when their whole histories match).
    episode_pool: what the episode mean/std counts. ``step_rows`` (verl-agent's default,
        ``compute_mean_std_cross_all_data=True``: each trajectory once per turn, so long trajectories weigh more) or
        ``trajectories`` (each trajectory once, with the score of its first step row).
    invalid_action_penalty: c, subtracted from a malformed turn's episode score and step return before normalisation
        (verl-agent's ``invalid_action_penalty_coef``, 0.1 in its config); 0 turns it off.
    similarity: false (default): one step group per identical anchor state; true: anchor texts that are merely
        similar share a step group, as verl-agent's ``enable_similarity`` (``igpo.core.anchor_similarity``: a text
        joins the first step group of its prompt group whose first text it matches with ``difflib`` ratio >=
        ``similarity_threshold``).
    similarity_threshold: the ratio a text must reach, in (0, 1) (verl-agent's config default 0.95; its search
        recipe 0.9). Read only with ``similarity: true``.
    epsilon: ε of the divisions (verl-agent 1e-6).
    gamma: γ of the step returns (``algorithm.gamma``, not a key of this section).
    """

    step_advantage_weight: float = 1.0
    mode: str = "mean_norm"
    anchor: str = "last_observation"
    episode_pool: str = "step_rows"
    invalid_action_penalty: float = 0.1
    similarity: bool = False
    similarity_threshold: float = 0.95
    epsilon: float = 1e-6
    gamma: float = 1.0

    def __post_init__(self):
        for name, allowed in (("mode", MODES), ("anchor", ANCHORS), ("episode_pool", EPISODE_POOLS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"algorithm.gigpo.{name}={getattr(self, name)!r} is unknown; use one of {allowed}.")
        for name in ("step_advantage_weight", "invalid_action_penalty", "epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"algorithm.gigpo.{name}={value!r} must be a finite number >= 0.")
        if not isinstance(self.similarity, bool):
            raise ValueError(f"algorithm.gigpo.similarity={self.similarity!r} must be true or false.")
        threshold = self.similarity_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < 1.0:
            raise ValueError(f"algorithm.gigpo.similarity_threshold={threshold!r} must be a number in (0, 1) (a ratio "
                             "of 1 is identity: set algorithm.gigpo.similarity=false for exact step groups).")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"algorithm.gamma={self.gamma!r}: GiGPO's step returns need a discount in [0, 1].")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], gamma: float | None = None) -> "GiGPOConfig":
        """From the ``algorithm.gigpo`` mapping (unknown keys raise with the known ones) and ``algorithm.gamma``."""
        values = section_values(cls, section, "gigpo", exclude=("gamma",))
        if gamma is not None:
            values["gamma"] = float(gamma)
        return cls(**values)


@dataclass
class GiGPOInputs:
    """One step's turns. ``outcome`` [B]: R_i; ``num_turns`` [B]: N_i (the reward sits on turn N_i−1); ``rows`` [B, T]
    bool: the step rows that take part (turns t < N_i of trajectories that are not masked, minus masked turns);
    ``invalid`` [B, T] bool: malformed turns; ``anchor`` [B, T] long: ids of the anchor states, equal ids = identical
    states (compared within a prompt group only); ``group`` [B] long: dense prompt-group ids."""

    outcome: Tensor
    num_turns: Tensor
    rows: Tensor
    invalid: Tensor
    anchor: Tensor
    group: Tensor

    def __post_init__(self):
        B, T = self.rows.shape
        for name, shape in (("outcome", (B,)), ("num_turns", (B,)), ("invalid", (B, T)), ("anchor", (B, T)),
                            ("group", (B,))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"GiGPOInputs.{name} must be {shape} like rows [B, T]; got "
                                 f"{tuple(getattr(self, name).shape)}.")
        for name in ("rows", "invalid"):
            if getattr(self, name).dtype != torch.bool:
                raise ValueError(f"GiGPOInputs.{name} must be a bool tensor; got {getattr(self, name).dtype}.")
        beyond = self.rows & (torch.arange(T)[None, :] >= self.num_turns[:, None])
        if bool(beyond.any()):
            raise ValueError(f"GiGPOInputs.rows marks turns at or beyond num_turns (rows "
                             f"{torch.nonzero(beyond.any(1)).flatten().tolist()}): a step row must be a turn.")


@dataclass
class GiGPOOutput:
    """Per turn [B, T] float64 (0 outside the rows): ``advantage`` A = A^E + ω·A^S, ``episode`` A^E, ``step`` A^S
    (before ω), ``returns`` G (penalty included); ``step_group`` [B, T] long, dense ids (−1 outside the rows);
    ``stats``: the step-group and magnitude figures the method logs."""

    advantage: Tensor
    episode: Tensor
    step: Tensor
    returns: Tensor
    step_group: Tensor
    stats: dict[str, float]


def discounted_returns(rewards: Tensor, num_turns: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ·G_{t+1} over turns t < N_i of each row of ``rewards`` [B, T] (G = 0 from turn N_i on)."""
    B, T = rewards.shape
    inside = torch.arange(T)[None, :] < num_turns[:, None]
    rewards = torch.where(inside, rewards.double(), 0.0)
    returns = torch.zeros(B, T, dtype=torch.float64)
    running = torch.zeros(B, dtype=torch.float64)
    for t in reversed(range(T)):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(inside, returns, 0.0)


def step_groups(anchor: Tensor, group: Tensor, rows: Tensor) -> Tensor:
    """[B, T] long: one dense id per (prompt group, anchor state) pair among ``rows``, numbered in row-major order of
    first appearance; −1 outside ``rows``."""
    B, T = anchor.shape
    pairs = torch.stack([group[:, None].expand(B, T)[rows], anchor[rows]], dim=1)
    ids = torch.full((B, T), -1, dtype=torch.long)
    if pairs.numel():
        _, inverse = torch.unique(pairs, dim=0, return_inverse=True)
        # Renumber by first appearance so ids do not depend on the anchor ids' values.
        first = torch.full((int(inverse.max()) + 1,), pairs.shape[0], dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(inverse.numel()), reduce="amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(first.numel())
        ids[rows] = rank[inverse]
    return ids


def pool_statistics(values: Tensor, pool: Tensor, num_pools: int) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, unbiased std, count) [num_pools] of flat ``values`` [N] by dense ``pool`` ids [N] (std 0 for a pool of
    fewer than two values, mean 0 for an empty one)."""
    values = values.double()
    count = torch.zeros(num_pools, dtype=torch.float64).index_add_(0, pool, torch.ones_like(values))
    total = torch.zeros(num_pools, dtype=torch.float64).index_add_(0, pool, values)
    mean = total / count.clamp(min=1)
    squares = torch.zeros(num_pools, dtype=torch.float64).index_add_(0, pool, (values - mean[pool]) ** 2)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return mean, std, count


def episode_advantage(scores: Tensor, rows: Tensor, group: Tensor, *, pool: str = "step_rows",
                      mode: str = "mean_norm", epsilon: float = 1e-6) -> Tensor:
    """A^E [B, T] from the episode scores e [B, T] of the step ``rows`` of prompt ``group`` [B] (module docstring).
    ``pool``: ``step_rows`` (every step row in μ_g, σ_g) or ``trajectories`` (the first step row of each trajectory);
    a pool of one value: μ = 0, σ = 1."""
    if pool not in EPISODE_POOLS or mode not in MODES:
        raise ValueError(f"episode_advantage: pool={pool!r} / mode={mode!r}; use one of {EPISODE_POOLS} / {MODES}.")
    B, T = scores.shape
    scores = scores.double()
    num_groups = int(group.max()) + 1 if group.numel() else 0
    row_group = group[:, None].expand(B, T)
    if pool == "step_rows":
        pooled = rows
    else:
        first = torch.argmax(rows.int(), dim=1)  # the first step row of each trajectory
        pooled = torch.zeros_like(rows)
        has = rows.any(dim=1)
        pooled[has, first[has]] = True
    mean, std, count = pool_statistics(scores[pooled], row_group[pooled], num_groups)
    lone = count == 1
    mean, std = torch.where(lone, 0.0, mean), torch.where(lone, 1.0, std)
    centred = scores - mean[row_group]
    advantage = centred if mode == "mean_norm" else centred / (std[row_group] + epsilon)
    return torch.where(rows, advantage, 0.0)


def step_advantage(returns: Tensor, step_group: Tensor, *, mode: str = "mean_norm", epsilon: float = 1e-6) -> Tensor:
    """A^S [B, T] from the step returns G [B, T] and ``step_group`` ids [B, T] (−1: not a step row). A step group of one
    row has μ_S = G, so A^S = 0."""
    if mode not in MODES:
        raise ValueError(f"step_advantage: mode={mode!r}; use one of {MODES}.")
    rows = step_group >= 0
    returns = returns.double()
    num_groups = int(step_group.max()) + 1 if bool(rows.any()) else 0
    mean, std, count = pool_statistics(returns[rows], step_group[rows], num_groups)
    std = torch.where(count == 1, 1.0, std)
    ids = step_group.clamp(min=0)
    centred = returns - mean[ids]
    advantage = centred if mode == "mean_norm" else centred / (std[ids] + epsilon)
    return torch.where(rows, advantage, 0.0)


def gigpo_advantage(inputs: GiGPOInputs, cfg: GiGPOConfig) -> GiGPOOutput:
    """Per-turn GiGPO advantages A = A^E + ω·A^S (module docstring) and the step's group figures:
    ``step_rows``, ``step_groups``, ``step_group_size_{mean,max}`` (over step groups), ``step_groups_size_{1,2,3_4,
    5_plus}`` (how many groups of each size), ``grouped_row_share`` (share of step rows in a group of ≥ 2),
    ``grouped_row_share_after_first`` (the same over turns t ≥ 1: a prompt's first turns always share the question,
    so this says whether later states repeat), ``episode_adv_abs_mean``, ``step_adv_abs_mean`` (|ω·A^S| over all step rows) and ``step_adv_abs_mean_grouped``
    (over rows in groups of ≥ 2, the only ones A^S can move)."""
    rows, invalid = inputs.rows, inputs.invalid
    B, T = rows.shape
    penalty = cfg.invalid_action_penalty * invalid.double()
    outcome = inputs.outcome.double()
    scores = outcome[:, None].expand(B, T) - penalty
    rewards = torch.zeros(B, T, dtype=torch.float64)
    has_turns = inputs.num_turns > 0
    rewards[has_turns, inputs.num_turns[has_turns] - 1] = outcome[has_turns]
    returns = torch.where(rows, discounted_returns(rewards, inputs.num_turns, cfg.gamma) - penalty, 0.0)
    episode = episode_advantage(scores, rows, inputs.group, pool=cfg.episode_pool, mode=cfg.mode, epsilon=cfg.epsilon)
    groups = step_groups(inputs.anchor, inputs.group, rows)
    step = step_advantage(returns, groups, mode=cfg.mode, epsilon=cfg.epsilon)
    advantage = episode + cfg.step_advantage_weight * step
    return GiGPOOutput(advantage, episode, step, returns, groups,
                       _stats(groups, episode, cfg.step_advantage_weight * step))


def _stats(groups: Tensor, episode: Tensor, weighted_step: Tensor) -> dict[str, float]:
    rows = groups >= 0
    later = rows & (torch.arange(rows.shape[1])[None, :] >= 1)
    n_rows, n_later = int(rows.sum()), int(later.sum())
    sizes = torch.bincount(groups[rows]) if n_rows else torch.zeros(0, dtype=torch.long)
    grouped = rows & (sizes[groups.clamp(min=0)] >= 2) if n_rows else rows
    nan = float("nan")

    def abs_mean(values: Tensor, where: Tensor) -> float:
        return float(values[where].abs().mean()) if bool(where.any()) else nan

    return {
        "step_rows": float(n_rows),
        "step_groups": float(sizes.numel()),
        "step_group_size_mean": float(sizes.double().mean()) if sizes.numel() else nan,
        "step_group_size_max": float(sizes.max()) if sizes.numel() else nan,
        "step_groups_size_1": float((sizes == 1).sum()),
        "step_groups_size_2": float((sizes == 2).sum()),
        "step_groups_size_3_4": float(((sizes >= 3) & (sizes <= 4)).sum()),
        "step_groups_size_5_plus": float((sizes >= 5).sum()),
        "grouped_row_share": float(grouped.sum()) / n_rows if n_rows else nan,
        "grouped_row_share_after_first": float((grouped & later).sum()) / n_later if n_later else nan,
        "episode_adv_abs_mean": abs_mean(episode, rows),
        "step_adv_abs_mean": abs_mean(weighted_step, rows),
        "step_adv_abs_mean_grouped": abs_mean(weighted_step, grouped),
    }
