"""InfoPO: counterfactual information gain with variance-gated fusion (docs/methods/infopo.md).

Symbols (per trajectory b of prompt group g, turns k = 0..N_b-1; turn t's action a_t, its tool observation o_t):

    intrinsic   I_t = (1/L_{t+1}) Σ_{j∈a_{t+1}} [log π(a_j | h, o_t, a_<j) − log π(a_j | h, ∅, a_<j)]   (sampled_logratio)
                I_t = (1/L_{t+1}) Σ_{j∈a_{t+1}} KL(π(· | h, o_t, a_<j) || π(· | h, ∅, a_<j))               (kl)
                ∅ = the observation's content replaced by the placeholder ids (chat-template tokens kept);
                I_t is credited to turn t, the action that PRODUCED o_t. The last turn gets none.
    outcome     R_b = Σ_k r_k (sum) or Σ_k γ^k r_k (r2g); here r_k = 0 except r_{N-1} = the outcome reward.
                Â_b = (R_b − μ_g) / (σ_g + ε)  (μ_g, σ_g: mean, unbiased std of R over g; singleton g: (0, 1)).
                A^out_{b,i} = Â_b · c_{k(i)} · N_b / Σ_i c_{k(i)}   on the N_b action tokens i of b (c: turn credits).
    intrinsic   Â^I = (x − μ^I_g) / (σ^I_g + ε) over the group's pool of x, where the pool is one x = I_t per scored turn
                (``turn``) or, as the reference, L_t copies of x = I_t / L_t per scored turn (``token``); a scored turn
                with I_t = 0 is in the pool (``zero_intrinsic=pool``) or, as the reference, left out with Â^I = 0 on
                its tokens (``drop``). With ARPO branches each pool entry has a weight w (1/|S| on each copy of a turn
                |S| trajectories share, else 1): μ^I_g = Σ w x / Σ w, σ^I_g² = Σ w (x − μ^I_g)² / (Σ w − 1), the
                de-duplicated pool's (frequency weights).
    fusion      m = min(1, max(σ_out, 1) / σ_int)   (σ_out: std of A^out over action tokens; σ_int: std of Â^I over
                the tokens that carry it (``cap_std_over=carrying``; with ARPO, the copies of a shared turn's tokens
                weigh 1/|S|) or, as the reference, over every action token, zeros included (``all_action_tokens``)),
                gate g_b = sigmoid(−σ_g / T), β_t = β_0 · exp(−λ · epoch),
                A_{b,i} = A^out_{b,i} + β_t · g_b · m · Â^I_{b,i}       (intrinsic_only: A = m · Â^I).

Everything here is tensors in, tensors out; the counterfactual sequence construction is here too, so that the trainer
and the tests build the same sequences the actor scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

SCORES = ("sampled_logratio", "kl")
POOLS = ("turn", "token")
CAP_STD_OVER = ("carrying", "all_action_tokens")
ZERO_INTRINSIC = ("pool", "drop")
TRAJECTORY_SCORES = ("sum", "r2g")
TURN_CREDITS = ("equalized", "r2g", "em")


@dataclass(frozen=True)
class InfoPOConfig:
    """``algorithm.infopo``: every InfoPO knob (configs/igpo_base.yaml documents the same keys).

    intrinsic_weight: β_0, the weight of the gated intrinsic advantage (reference YAML 0.5; its code default 0.1).
    decay: λ in β_t = β_0 · exp(−λ · epoch); applied here only (the reference applied it twice).
    gate_temperature: T of the gate sigmoid(−σ_g / T). Required to be explicit: the reference's code (0.05, a near
        hard switch "intrinsic only where all outcomes tie") and its YAML (0.5, β·g in 0.125–0.25 for binary rewards)
        disagree. 0.5 here.
    normalize_intrinsic: group z-score of the intrinsic values (reference True); False uses them raw.
    intrinsic_pool: ``turn`` (one value per scored turn, broadcast to its tokens: no double length normalisation) or
        ``token`` (the reference: I_t / L_t on each of turn t's L_t tokens, pooled per token).
    intrinsic_only: ablation, A = m · Â^I (no outcome, no gate, no β).
    cap_std_over: the tokens whose Â^I spread σ_int the magnitude cap m = min(1, max(σ_out, 1) / σ_int) measures:
        ``carrying`` (ours: the tokens of scored turns, so m does not depend on how many tokens carry no intrinsic
        value) or ``all_action_tokens`` (the reference: every action token, the zeros of unscored turns included; the
        more zeros, the smaller σ_int, so the cap rarely acts).
    zero_intrinsic: a scored turn whose I_t is exactly 0: ``pool`` (ours: a measured "no information" is a value,
        it enters μ^I/σ^I and gets its z-score, negative when the group's mean is positive) or ``drop`` (the
        reference, which pools only non-zero values: such a turn is left out of the pool and its tokens get Â^I = 0).
    placeholder: the text that replaces an observation's content in the counterfactual.
    score: ``sampled_logratio`` (the reference: mean log-ratio of the sampled next action, can be negative) or ``kl``
        (mean full-vocabulary KL at the next action's positions, ≥ 0; needs a factual pass on the actor).
    reuse_old_log_probs: take the factual term from the old log-probs the trainer computes anyway (same θ, context
        and temperature), which halves the pass. Used only with score=sampled_logratio and when the actor recomputed
        them (not rollout_correction.bypass_mode); otherwise the factual continuation is scored beside the
        counterfactual one.
    trajectory_score: ``sum`` (R = Σ r_k) or ``r2g`` (R = Σ γ^k r_k with γ = algorithm.gamma).
    turn_credit: ``equalized`` (c_k = 1), ``r2g`` (c_k = Σ_{j≥k} γ^{j−k} r_j; a trajectory whose credits sum to 0 falls
        back to equalized, counted in infopo/credit_fallbacks) or ``em`` (c_k = 0.5 + 0.5(1 − e^{−2 r_k})/(1 − e^{−2})).
    max_failed_turn_ratio: a step whose failed turns (no content span found, non-finite score) exceed this share of
        the turns that should have been scored stops the run.
    epsilon: ε of the z-scores (reference 1e-6).
    """

    intrinsic_weight: float = 0.5
    decay: float = 0.0
    gate_temperature: float = 0.5
    normalize_intrinsic: bool = True
    intrinsic_pool: str = "turn"
    intrinsic_only: bool = False
    cap_std_over: str = "carrying"
    zero_intrinsic: str = "pool"
    placeholder: str = "No information found."
    score: str = "sampled_logratio"
    reuse_old_log_probs: bool = True
    trajectory_score: str = "sum"
    turn_credit: str = "equalized"
    max_failed_turn_ratio: float = 0.05
    epsilon: float = 1e-6
    # Not under algorithm.infopo: algorithm.gamma and algorithm.norm_adv_by_std_in_grpo.
    gamma: float = 1.0
    norm_adv_by_std: bool = True

    def __post_init__(self):
        for name, allowed in (("score", SCORES), ("intrinsic_pool", POOLS), ("trajectory_score", TRAJECTORY_SCORES),
                              ("turn_credit", TURN_CREDITS), ("cap_std_over", CAP_STD_OVER),
                              ("zero_intrinsic", ZERO_INTRINSIC)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"algorithm.infopo.{name}={getattr(self, name)!r} is unknown; use one of {allowed}.")
        for name in ("intrinsic_weight", "decay", "epsilon"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"algorithm.infopo.{name}={value!r} must be a finite number >= 0.")
        if not (isinstance(self.gate_temperature, (int, float)) and math.isfinite(self.gate_temperature)
                and self.gate_temperature > 0):
            raise ValueError(f"algorithm.infopo.gate_temperature={self.gate_temperature!r} must be > 0 (0.5: the "
                             "reference's shipped YAML; 0.05: its code default, a near hard switch).")
        if not 0.0 <= self.max_failed_turn_ratio <= 1.0:
            raise ValueError(f"algorithm.infopo.max_failed_turn_ratio={self.max_failed_turn_ratio!r} must be in "
                             "[0, 1] (0 stops at the first failed turn, 1 never stops).")
        if not isinstance(self.placeholder, str) or not self.placeholder:
            raise ValueError("algorithm.infopo.placeholder must be a non-empty string, e.g. 'No information found.'.")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], **outside: Any) -> "InfoPOConfig":
        """From the ``algorithm.infopo`` mapping; unknown keys raise with the known ones. ``outside``: gamma,
        norm_adv_by_std (they live elsewhere in verl's algorithm config)."""
        own = [f for f in cls.__dataclass_fields__ if f not in ("gamma", "norm_adv_by_std")]
        unknown = sorted(set(section) - set(own))
        if unknown:
            raise ValueError(f"unknown key(s) algorithm.infopo.{unknown}: check the spelling; known keys are "
                             f"{sorted(own)} (see configs/igpo_base.yaml).")
        values = dict(section)
        for name, value in list(values.items()):
            if isinstance(getattr(cls, name), float) and isinstance(value, int) and not isinstance(value, bool):
                values[name] = float(value)
        return cls(**values, **{k: v for k, v in outside.items() if v is not None})


# ---------------------------------------------------------------------------------------- counterfactual sequences


def observation_content_span(ids: Sequence[int], after_action: int, next_boundary: int, eot_id: int,
                             prefix_ids: Sequence[int], suffixes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The content of the observation between two turns: [start, end) in ``ids``, template tokens excluded.

    The agent loop closes turn t as ``[eot if the engine did not sample it] + prefix + content + suffix`` and turn t+1
    starts at ``next_boundary``; ``after_action`` is the first position after turn t's generated tokens. The suffix is
    the longest of ``suffixes`` (plain or with an answer-now instruction) that ends exactly at ``next_boundary``.
    Raises ``ValueError`` when the tokens do not have that shape (the turn cannot be scored: a counted failure).
    """
    start = after_action
    if list(ids[start:start + len(prefix_ids)]) != list(prefix_ids):
        if start < len(ids) and ids[start] == eot_id and \
                list(ids[start + 1:start + 1 + len(prefix_ids)]) == list(prefix_ids):
            start += 1
        else:
            raise ValueError(f"no observation prefix {list(prefix_ids)} after the action ending at {after_action}")
    content_start = start + len(prefix_ids)
    for suffix in sorted(suffixes, key=len, reverse=True):
        end = next_boundary - len(suffix)
        if end >= content_start and list(ids[end:next_boundary]) == list(suffix):
            return content_start, end
    raise ValueError(f"no known observation suffix ends at the boundary {next_boundary}")


def counterfactual_sequence(ids: torch.Tensor, content: tuple[int, int],
                            placeholder_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
    """x' = x[:cs] + placeholder + x[ce:] and the shift len(placeholder) − (ce − cs) of every position after ce.

    The exact placeholder replaces the content (no length matching by repeated tokens), the template tokens around it
    stay, and the tokens after it sit at recomputed positions (their index plus the shift); no padding is added.
    """
    cs, ce = content
    if not 0 <= cs <= ce <= ids.numel():
        raise ValueError(f"content span {content} is not inside a sequence of {ids.numel()} tokens")
    replacement = torch.as_tensor(list(placeholder_ids), dtype=ids.dtype, device=ids.device)
    return torch.cat([ids[:cs], replacement, ids[ce:]]), replacement.numel() - (ce - cs)


@dataclass
class ContinuationRequest:
    """One trajectory's counterfactual work for the actor's paired scorer (``igpo.core.scoring.score_continuations``).

    Copy q is ``continuations[q]`` (token ids, span of the next action inside them) fed after ``ids[:boundaries[q]]``.
    ``turns[i] = (t, factual copy or None, counterfactual copy)``; identical copies are stored once, so an
    observation replaced by itself scores the very same copy twice and gives exactly I_t = 0.
    """

    trajectory_ids: list[int]
    boundaries: list[int] = field(default_factory=list)
    continuations: list[tuple[list[int], tuple[int, int]]] = field(default_factory=list)
    turns: list[tuple[int, int | None, int]] = field(default_factory=list)

    def _copy(self, boundary: int, token_ids: list[int], span: tuple[int, int]) -> int:
        for q, (b, (ids, s)) in enumerate(zip(self.boundaries, self.continuations)):
            if b == boundary and s == span and ids == token_ids:
                return q
        self.boundaries.append(boundary)
        self.continuations.append((token_ids, span))
        return len(self.boundaries) - 1

    def add_turn(self, turn: int, content: tuple[int, int], action: tuple[int, int], placeholder_ids: Sequence[int],
                 factual: bool) -> None:
        """Turn ``turn``'s observation content [cs, ce) and the next action [as, ae) (indices into trajectory_ids).

        Counterfactual copy: placeholder + ids[ce:ae] after ids[:cs], next action at [len(ph) + as − ce, ...).
        Factual copy (when asked): ids[cs:ae] after ids[:cs], next action at [as − cs, ae − cs).
        """
        (cs, ce), (a_s, a_e) = content, action
        if not 0 < cs <= ce <= a_s < a_e <= len(self.trajectory_ids):
            raise ValueError(f"content {content} and next action {action} are not ordered inside the trajectory of "
                             f"{len(self.trajectory_ids)} tokens")
        ph = list(placeholder_ids)
        cf = self._copy(cs, ph + self.trajectory_ids[ce:a_e],
                        (len(ph) + a_s - ce, len(ph) + a_e - ce))
        f = self._copy(cs, self.trajectory_ids[cs:a_e], (a_s - cs, a_e - cs)) if factual else None
        self.turns.append((turn, f, cf))

    def as_dict(self, kl: bool) -> dict:
        """The worker's wire format; with ``kl`` the pairs (factual, counterfactual) whose KL is read out."""
        prefix = max(self.boundaries)
        out = {"trajectory_ids": self.trajectory_ids[:prefix], "boundaries": list(self.boundaries),
               "continuations": [{"token_ids": ids, "span": list(span)} for ids, span in self.continuations]}
        if kl:
            out["pairs"] = [[f, c] for _, f, c in self.turns]
        return out


# ------------------------------------------------------------------------------------------------- the estimator


def group_mean_std(values: torch.Tensor, group: torch.Tensor, num_groups: int,
                   weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ_g, σ_g) per group [G]: mean and unbiased std; a group of one gets (0, 1), an empty one (0, 1).

    ``weight`` [N] (optional): frequency weights, e.g. 1/|S| on each copy of an entry |S| ARPO branches share:
    μ_g = Σ w x / Σ w, σ_g² = Σ w (x − μ_g)² / (Σ w − 1), "one" meaning Σ w ≤ 1. None: every weight 1 (bit-identical
    to the unweighted statistics)."""
    values = values.double()
    w = torch.ones_like(values) if weight is None else weight.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, w)
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, w * values)
    mean = torch.where(count > 0, total / torch.where(count > 0, count, 1.0), 0.0)
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, w * (values - mean[group]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count <= 1 + 1e-9  # the copies of one shared entry weigh 1 together, up to rounding
    return torch.where(single, 0.0, mean), torch.where(single, 1.0, std)


def trajectory_scores(turn_rewards: torch.Tensor, num_turns: torch.Tensor, method: str, gamma: float) -> torch.Tensor:
    """R_b [B] from per-turn rewards r [B, T] (entries k >= N_b ignored): Σ_k r_k (sum) or Σ_k γ^k r_k (r2g)."""
    T = turn_rewards.shape[1]
    valid = torch.arange(T)[None, :] < num_turns[:, None]
    r = torch.where(valid, turn_rewards.double(), 0.0)
    if method == "sum":
        return r.sum(1)
    return (r * gamma ** torch.arange(T, dtype=torch.float64)[None, :]).sum(1)


def turn_credits(turn_rewards: torch.Tensor, num_turns: torch.Tensor, method: str,
                 gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn credits c [B, T] (0 beyond N_b) and a [B] mask of trajectories whose r2g credits summed to 0 and fell back
    to equalized (the reference wiped such trajectories' outcome advantage)."""
    B, T = turn_rewards.shape
    valid = torch.arange(T)[None, :] < num_turns[:, None]
    r = torch.where(valid, turn_rewards.double(), 0.0)
    fallback = torch.zeros(B, dtype=torch.bool)
    if method == "equalized":
        credit = torch.ones_like(r)
    elif method == "em":
        credit = 0.5 + 0.5 * (1 - torch.exp(-2 * r)) / (1 - math.exp(-2))
    else:
        credit = torch.zeros_like(r)
        running = torch.zeros(B, dtype=torch.float64)
        for k in range(T - 1, -1, -1):
            running = r[:, k] + gamma * running
            credit[:, k] = running
        credit = torch.where(valid, credit, 0.0)
        fallback = (credit.sum(1) == 0) & (num_turns > 0)
        credit = torch.where(fallback[:, None], 1.0, credit)
    return torch.where(valid, credit, 0.0), fallback


def outcome_token_advantage(advantage: torch.Tensor, token_turn: torch.Tensor, credit: torch.Tensor,
                            action_mask: torch.Tensor) -> torch.Tensor:
    """A^out_{b,i} = Â_b · c_{k(i)} · N_b / Σ_i c_{k(i)} on action tokens (0 elsewhere and where Σ c = 0)."""
    c_tok = torch.where(action_mask, credit.gather(1, token_turn.clamp(min=0)), 0.0)
    total = c_tok.sum(1, keepdim=True)
    n = action_mask.sum(1, keepdim=True).double()
    scale = torch.where(total != 0, n / torch.where(total != 0, total, 1.0), 0.0)
    return advantage.double()[:, None] * c_tok * scale


def normalize_intrinsic(values: torch.Tensor, group: torch.Tensor, num_groups: int, eps: float,
                        norm_by_std: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Â^I of a pool [N] of intrinsic values with their groups [N]: (x − μ^I_g) / (σ^I_g + ε) (unbiased σ; a pool
    of one item gives (x, 1), i.e. 0); only centering when ``norm_by_std`` is False. ``weight`` [N]: frequency
    weights of the entries (``group_mean_std``; ARPO's shared turns), None for all 1."""
    if values.numel() == 0:
        return values.double()
    mean, std = group_mean_std(values, group, num_groups, weight)
    w = torch.ones_like(values, dtype=torch.float64) if weight is None else weight.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, w)
    one = (count - 1).abs() <= 1e-9
    own = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, w * values.double())
    mean = torch.where(one, own / torch.where(one, count, 1.0), mean)
    centred = values.double() - mean[group]
    return centred / (std[group] + eps) if norm_by_std else centred


def _weighted_std(values: torch.Tensor, weight: torch.Tensor) -> float:
    """Unbiased std with frequency weights: sqrt(Σ w (x − μ)² / (Σ w − 1)), μ = Σ w x / Σ w; 0 for Σ w ≤ 1."""
    n = float(weight.sum())
    if n <= 1 + 1e-9:
        return 0.0
    mean = float((weight * values).sum()) / n
    return math.sqrt(float((weight * (values - mean) ** 2).sum()) / (n - 1))


def variance_gate(group_std: torch.Tensor, temperature: float) -> torch.Tensor:
    """g = sigmoid(−σ_g / T): 0.5 where a group's outcomes all tie, → 0 as they spread."""
    return torch.sigmoid(-group_std.double() / temperature)


@dataclass(frozen=True)
class InfoPOInputs:
    """One batch, already in turn coordinates.

    turn_rewards [B, T]: r_k (outcome on the last turn); num_turns [B]; token_turn [B, L]: the turn k(i) of each action
    token (anything where action_mask is False); action_mask [B, L]; intrinsic [B, T]: I_t credited to turn t;
    intrinsic_mask [B, T]: which I_t exist; group [B]: dense prompt-group ids; epoch: for β_t; pool_weight [B, T]
    (optional): each I_t's weight in its group's pool, 1/|S| for a turn |S| ARPO branches share
    (``igpo.core.arpo.shared_turn_weights``), None for all 1.
    """

    turn_rewards: torch.Tensor
    num_turns: torch.Tensor
    token_turn: torch.Tensor
    action_mask: torch.Tensor
    intrinsic: torch.Tensor
    intrinsic_mask: torch.Tensor
    group: torch.Tensor
    epoch: int = 0
    pool_weight: torch.Tensor | None = None


def outcome_group_stats(x: InfoPOInputs, cfg: InfoPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R [B]: each trajectory's score, μ_g and σ_g [num_groups]: its prompt group's mean and std)."""
    R = trajectory_scores(x.turn_rewards, x.num_turns, cfg.trajectory_score, cfg.gamma)
    num_groups = int(x.group.max()) + 1 if x.group.numel() else 0
    mean_g, std_g = group_mean_std(R, x.group, num_groups)
    return R, mean_g, std_g


def row_gate(x: InfoPOInputs, cfg: InfoPOConfig) -> torch.Tensor:
    """[B] the variance gate g_b = sigmoid(−σ_g / T) of each trajectory's group, as ``infopo_advantage`` applies it."""
    _, _, std_g = outcome_group_stats(x, cfg)
    return variance_gate(std_g[x.group], cfg.gate_temperature)


def infopo_advantage(x: InfoPOInputs, cfg: InfoPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Fused token advantages A [B, L] (float64; returns = advantages) and the ``infopo/*`` statistics."""
    mask = x.action_mask.bool()
    B, L = mask.shape
    if x.pool_weight is not None and (x.pool_weight.shape != x.intrinsic.shape or bool(
            ((x.pool_weight <= 0) | (x.pool_weight > 1))[x.intrinsic_mask.bool()].any())):
        raise ValueError(f"pool_weight must be [B, T] = {tuple(x.intrinsic.shape)} like intrinsic, in (0, 1] on the "
                         f"scored turns (1/|S| for a turn |S| branches share); got {tuple(x.pool_weight.shape)}.")
    num_groups = int(x.group.max()) + 1 if B else 0
    eps = cfg.epsilon

    R, mean_g, std_g = outcome_group_stats(x, cfg)
    centred = R - mean_g[x.group]
    adv_b = centred / (std_g[x.group] + eps) if cfg.norm_adv_by_std else centred
    credit, fallback = turn_credits(x.turn_rewards, x.num_turns, cfg.turn_credit, cfg.gamma)
    token_turn = torch.where(mask, x.token_turn, 0).clamp(max=max(credit.shape[1] - 1, 0))
    a_out = outcome_token_advantage(adv_b, token_turn, credit, mask)

    # Intrinsic: one value per scored turn, on that turn's action tokens.
    on_turn = mask[:, :, None] & (token_turn[:, :, None] == torch.arange(x.intrinsic.shape[1])[None, None, :])
    turn_len = on_turn.sum(1)  # [B, T]
    scored = x.intrinsic_mask.bool() & (turn_len > 0)
    measured = x.intrinsic.double()[scored]  # every scored value, zeros included (for the statistics)
    if cfg.zero_intrinsic == "drop":
        scored = scored & (x.intrinsic != 0)
    b_idx, t_idx = scored.nonzero(as_tuple=True)
    values = x.intrinsic.double()[b_idx, t_idx]
    turn_weight = x.pool_weight.double() if x.pool_weight is not None else None
    carries = (on_turn & scored[:, None, :]).any(-1)  # [B, L] tokens that carry an intrinsic value
    if cfg.intrinsic_pool == "turn":
        pooled = normalize_intrinsic(values, x.group[b_idx], num_groups, eps, cfg.norm_adv_by_std,
                                     turn_weight[b_idx, t_idx] if turn_weight is not None else None) \
            if cfg.normalize_intrinsic else values
        per_turn = torch.zeros(B, x.intrinsic.shape[1], dtype=torch.float64)
        per_turn[b_idx, t_idx] = pooled
        a_int = torch.where(carries, per_turn.gather(1, token_turn), 0.0)
    else:  # the reference: I_t / L_t on each of turn t's tokens, the pool is every such token
        per_turn = torch.zeros(B, x.intrinsic.shape[1], dtype=torch.float64)
        per_turn[b_idx, t_idx] = values / turn_len[b_idx, t_idx]
        raw = torch.where(carries, per_turn.gather(1, token_turn), 0.0)
        tb, ti = carries.nonzero(as_tuple=True)
        token_weight = turn_weight.gather(1, token_turn)[tb, ti] if turn_weight is not None else None
        pooled = normalize_intrinsic(raw[tb, ti], x.group[tb], num_groups, eps, cfg.norm_adv_by_std, token_weight) \
            if cfg.normalize_intrinsic else raw[tb, ti]
        a_int = torch.zeros(B, L, dtype=torch.float64)
        a_int[tb, ti] = pooled

    def std(v: torch.Tensor) -> float:
        return float(v.std()) if v.numel() > 1 else 0.0

    sigma_out = std(a_out[mask]) + eps
    if cfg.cap_std_over == "all_action_tokens":
        sigma_int = std(a_int[mask]) + eps
    elif turn_weight is None:
        sigma_int = std(a_int[carries]) + eps
    else:  # ARPO: the copies of a shared turn's tokens weigh 1/|S| (the de-duplicated tokens' spread)
        sigma_int = _weighted_std(a_int[carries], turn_weight.gather(1, token_turn)[carries]) + eps
    m = min(1.0, max(sigma_out, 1.0) / sigma_int)
    gate = variance_gate(std_g[x.group], cfg.gate_temperature)
    beta = cfg.intrinsic_weight * math.exp(-cfg.decay * x.epoch)
    if cfg.intrinsic_only:
        intrinsic_part = m * a_int
        advantages = intrinsic_part
    else:
        intrinsic_part = beta * gate[:, None] * m * a_int
        advantages = a_out + intrinsic_part
    advantages = torch.where(mask, advantages, 0.0)

    out_abs = float(a_out[mask].abs().sum()) if not cfg.intrinsic_only else 0.0
    int_abs = float(intrinsic_part[mask].abs().sum())
    stats = {
        "gate_mean": float(gate.mean()) if B else 0.0,
        "gate_min": float(gate.min()) if B else 0.0,
        "gate_max": float(gate.max()) if B else 0.0,
        "group_std_mean": float(std_g[x.group].mean()) if B else 0.0,
        "intrinsic_raw_mean": float(measured.mean()) if measured.numel() else 0.0,
        "intrinsic_raw_std": std(measured),
        "intrinsic_std": std(a_int[carries]),
        "magnitude_ratio": m,
        "beta_t": beta,
        "contribution_ratio": int_abs / (out_abs + int_abs) if out_abs + int_abs > 0 else 0.0,
        "scored_turns": float(measured.numel()),
        "pooled_turns": float(values.numel()),
        "credit_fallbacks": float(fallback.sum()),
        "adv_abs_mean": float(advantages[mask].abs().mean()) if bool(mask.any()) else 0.0,
    }
    return advantages, stats
