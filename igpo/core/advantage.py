"""The IGPO turn-level advantage (igpo.md §2), vectorized over the batch.

Per trajectory i the rewarded positions ("boundaries") are, in token order, the IG positions I (one per scored turn,
at the turn's last token), optional format-penalty positions, and the outcome position F (the last response token).
With K_i boundaries carrying normalized rewards N_{i,1..K_i} (Ñ = z-scored within the prompt group, below), the
advantage of every token of segment k (the tokens after boundary k-1 up to and including boundary k) is the
discounted sum of its own and all later normalized rewards (paper: Ã_{i,t} = Σ_{k≥t} γ^{k−t} A_{i,k}):

    A_{i,k} = N_{i,k} + γ_i · A_{i,k+1},   A_{i,K_i+1} = 0,
    γ_i = γ, or w^(1/K_i) with adaptive_gamma_min_weight w > 0 (so the first turn keeps weight w of the outcome).

Group z-score of rewards r over a mask M, per prompt group g (positions of all rollouts of g pooled):
    μ_g = mean_{M ∩ g} r,  σ_g = sqrt(mean_{M ∩ g} (r − μ_g)² + 1e-8)  (σ_g := 1 if |M ∩ g| ≤ 1),
    ẑ(M) = (r − μ_g) / (σ_g + ε)   (no division when norm_adv_by_std is False).

Implementation: boundaries are compacted to padded per-trajectory turn slots [B, K_max] (index tensors from
``nonzero``), normalized and scanned there in float64, then broadcast back to tokens with one gather over the
exclusive cumulative boundary count. No Python loop over samples or boundaries; the scan loops over K_max only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

NORM_MODES = ("joint", "separate", "scaled_separate", "raw_ig")
NORM_ORDERS = ("before_discount", "after_discount")
NORM_GROUPS = ("group", "group_turn")


@dataclass(frozen=True)
class AdvantageConfig:
    """Options of the IGPO advantage. Defaults reproduce DR-Venus ``train_igpo.sh`` (scaled_separate, γ = 0.95).

    norm_mode: how outcome (F) and IG (I) rewards are z-scored within a group (§2.3):
        ``joint``: one z-score over F ∪ I (closest to the paper; IG and outcome compete for the same scale).
        ``separate``: ẑ(F) and ẑ(I) independently.
        ``scaled_separate``: as separate, then IG is rescaled by one batch scalar
            s = min(max(mean|ẑ(F)|, scale_floor) / (mean|ẑ(I)| + ε), scale_cap) so IG and outcome have similar
            magnitude (DR-Venus default). Couples groups through the batch scalar.
        ``raw_ig``: IG is not mean-centred: N[I] = r / (σ_g(I) + ε) · ig_weight + ẑ(F) of the same trajectory;
            γ is forced to 0 (each turn sees its own IG plus the outcome). The reference divides by σ even when
            norm_adv_by_std is False; kept for fidelity. Use against "turn shortening" (a mean-centred IG summed
            over many turns drifts with depth).
    gamma: turn-level discount γ ∈ [0, 1] (over boundaries, not tokens).
    norm_adv_by_std: divide by σ_g + ε (GRPO); False gives Dr.GRPO-style mean-centring only.
    ig_weight: multiplier of normalized IG rewards (raw_ig: applied before adding the outcome term).
    adaptive_gamma_min_weight: w in [0, 1); w > 0 sets γ_i = w^(1/K_i) per trajectory (disabled in raw_ig).
    epsilon: ε added to σ.
    norm_order: ``before_discount`` (paper order; DR-Venus) z-scores rewards then discounts. ``after_discount``
        reproduces the originally released IGPO code (GuoqingWang1/IGPO#5): discount raw rewards into per-boundary
        returns, then z-score the returns with the same mode and broadcast them without a second discount. Only for
        reproducing old runs.
    norm_group: ``group`` pools all positions of a prompt group (reference; long trajectories dominate μ/σ of IG).
        ``group_turn`` z-scores the k-th IG position of each rollout against the k-th IG positions of the other
        rollouts of the prompt (against the depth bias, A²TGPO-style); outcome stays pooled per group.
        Not defined for ``joint`` (outcome and IG share one pool there).
    scale_floor, scale_cap: the 0.3 floor and 10 cap of scaled_separate's batch scalar.
    """

    norm_mode: str = "scaled_separate"
    gamma: float = 0.95
    norm_adv_by_std: bool = True
    ig_weight: float = 1.0
    adaptive_gamma_min_weight: float = 0.0
    epsilon: float = 1e-6
    norm_order: str = "before_discount"
    norm_group: str = "group"
    scale_floor: float = 0.3
    scale_cap: float = 10.0

    def __post_init__(self):
        if self.norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode={self.norm_mode!r} is unknown; use one of {NORM_MODES}.")
        if self.norm_order not in NORM_ORDERS:
            raise ValueError(f"norm_order={self.norm_order!r} is unknown; use one of {NORM_ORDERS}.")
        if self.norm_group not in NORM_GROUPS:
            raise ValueError(f"norm_group={self.norm_group!r} is unknown; use one of {NORM_GROUPS}.")
        if self.norm_mode == "joint" and self.norm_group == "group_turn":
            raise ValueError("norm_group='group_turn' is not defined for norm_mode='joint' (outcome and IG share one "
                             "pool); use norm_mode='separate' or 'scaled_separate' with it, or norm_group='group'.")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma!r} must lie in [0, 1] (turn-level discount).")
        if not math.isfinite(self.ig_weight):
            raise ValueError(f"ig_weight={self.ig_weight!r} must be finite.")
        if not 0.0 <= self.adaptive_gamma_min_weight < 1.0:
            raise ValueError(f"adaptive_gamma_min_weight={self.adaptive_gamma_min_weight!r} must lie in [0, 1); "
                             "0 disables adaptive gamma.")
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon={self.epsilon!r} must be a small positive number (e.g. 1e-6).")
        if not (0 < self.scale_floor <= self.scale_cap < math.inf):
            raise ValueError(f"scale_floor={self.scale_floor!r} and scale_cap={self.scale_cap!r} must satisfy "
                             "0 < scale_floor <= scale_cap < inf.")


def masks_from_token_rewards(token_level_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Reference convention (§2.1): outcome at the last valid token, IG at the other non-zero valid positions.

    Only for callers that cannot pass explicit masks (stock verl): a zero IG is invisible here.
    """
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must share one [B, L] shape.")
    m = response_mask.bool()
    L = m.shape[1]
    has_any = m.any(dim=1)
    last = (L - 1) - m.flip(1).to(torch.uint8).argmax(dim=1)
    outcome = torch.zeros_like(m)
    rows = torch.nonzero(has_any, as_tuple=True)[0]
    outcome[rows, last[rows]] = True
    ig = m & ~outcome & (token_level_rewards != 0)
    return outcome, ig


def _group_z(v: Tensor, M: Tensor, key: Tensor, num_keys: int, divide: bool, eps: float) -> tuple[Tensor, Tensor]:
    """ẑ(M) of slot values v (0 outside M) and σ of each slot's key; pools by ``key`` (see module docstring)."""
    vals, keys = v[M], key[M]
    n = torch.bincount(keys, minlength=num_keys).to(v.dtype)
    mu = torch.zeros(num_keys, dtype=v.dtype).index_add_(0, keys, vals) / n.clamp(min=1)
    d = vals - mu[keys]
    var = torch.zeros(num_keys, dtype=v.dtype).index_add_(0, keys, d * d) / n.clamp(min=1)
    sigma = torch.where(n <= 1, torch.ones_like(var), torch.sqrt(var + 1e-8))
    z = torch.zeros_like(v)
    z[M] = d / (sigma[keys] + eps) if divide else d
    return z, sigma[key]


def _discounted_scan(values: Tensor, gamma: Tensor) -> Tensor:
    """A_k = v_k + γ_i A_{k+1} over padded slots [B, K]; returns [B, K+1] with a zero last column."""
    B, K = values.shape
    out = torch.zeros(K + 1, B, dtype=values.dtype)
    cols = values.t().contiguous()
    for k in range(K - 1, -1, -1):
        out[k] = cols[k] + gamma * out[k + 1]
    return out.t()


def _check_inputs(rewards, outcome_mask, ig_mask, response_mask, group, penalty, outcome_weight, ig_weight_schedule):
    if rewards.dim() != 2 or not torch.is_floating_point(rewards):
        raise ValueError(f"rewards must be a float [B, L] tensor; got {rewards.dtype} {tuple(rewards.shape)}.")
    shape = tuple(rewards.shape)
    for name, t in (("outcome_mask", outcome_mask), ("ig_mask", ig_mask), ("response_mask", response_mask)):
        if tuple(t.shape) != shape or t.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor of the rewards' shape {shape}; got {t.dtype} {tuple(t.shape)}.")
    if penalty is not None and (tuple(penalty.shape) != shape or not torch.is_floating_point(penalty)):
        raise ValueError(f"penalty must be a float tensor of shape {shape}; got {penalty.dtype} {tuple(penalty.shape)}.")
    if group.shape != (shape[0],) or group.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group must be an integer [B] = ({shape[0]},) tensor of group ids; got {group.dtype} "
                         f"{tuple(group.shape)}.")
    for name, w in (("outcome_weight", outcome_weight), ("ig_weight_schedule", ig_weight_schedule)):
        if not math.isfinite(w):
            raise ValueError(f"{name}={w!r} must be finite.")


def _check_positions(rows, cols, rewards, outcome_mask, ig_mask, response_mask, penalty, B):
    """Value checks on the reward positions only (gathered, so they cost O(#boundaries), not O(B·L))."""
    f, i = outcome_mask[rows, cols], ig_mask[rows, cols]
    if not bool(torch.isfinite(rewards[rows, cols][f | i]).all()):
        raise ValueError("rewards contain NaN or inf at outcome/IG positions; a failed reward must be handled "
                         "upstream (e.g. a failed IG boundary is not placed), never passed to the advantage.")
    if penalty is not None and not bool(torch.isfinite(penalty[rows, cols]).all()):
        raise ValueError("penalty contains NaN or inf.")
    if bool((f & i).any()):
        raise ValueError("outcome_mask and ig_mask overlap; a token carries either the outcome or an IG reward.")
    if not bool(response_mask[rows, cols].all()):
        raise ValueError("a reward position lies outside response_mask; outcome, IG and penalty positions must be "
                         "valid response tokens.")
    if bool((torch.bincount(rows[f], minlength=B) > 1).any()):
        raise ValueError("a trajectory has more than one outcome position; outcome_mask allows at most one per row.")


@torch.no_grad()
def compute_igpo_advantage(
    rewards: Tensor,
    outcome_mask: Tensor,
    ig_mask: Tensor,
    response_mask: Tensor,
    group: Tensor,
    cfg: AdvantageConfig,
    *,
    outcome_weight: float = 1.0,
    ig_weight_schedule: float = 1.0,
    penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """IGPO advantages (module docstring). Returns (advantages [B, L], returns [B, L] (the same values), metrics).

    Args:
        rewards: [B, L] token rewards: outcome at ``outcome_mask``, IG at ``ig_mask``; other entries ignored.
        outcome_mask, ig_mask, response_mask: [B, L] bool, explicit (a zero IG is still an IG position).
        group: [B] integer prompt-group ids (rollouts of one prompt share an id).
        outcome_weight, ig_weight_schedule: curriculum weights w_f1, w_ig multiplied onto normalized outcome / IG
            (§1.7; raw_ig: w_ig also scales the added outcome term, as in the reference).
        penalty: [B, L] format penalties, added after normalization and weighting; non-zero entries are reward
            positions of their own (a penalised turn without IG still ends a segment, as in the reference).
    """
    _check_inputs(rewards, outcome_mask, ig_mask, response_mask, group, penalty, outcome_weight, ig_weight_schedule)
    B, L = rewards.shape
    f64 = torch.float64
    bnd = outcome_mask | ig_mask
    if penalty is not None:
        bnd |= penalty != 0  # NaN != 0 too, so a NaN penalty is caught below

    # Compact boundaries to turn slots: slot k of row i is the k-th boundary of trajectory i in token order.
    rows, cols = torch.nonzero(bnd, as_tuple=True)
    _check_positions(rows, cols, rewards, outcome_mask, ig_mask, response_mask, penalty, B)
    K = torch.bincount(rows, minlength=B)
    K_max = int(K.max()) if B else 0
    start = torch.cumsum(K, 0) - K
    slot = torch.arange(rows.numel()) - start[rows]
    r = torch.zeros(B, K_max, dtype=f64)
    r[rows, slot] = rewards[rows, cols].to(f64)
    isF = torch.zeros(B, K_max, dtype=torch.bool)
    isF[rows, slot] = outcome_mask[rows, cols]
    isI = torch.zeros(B, K_max, dtype=torch.bool)
    isI[rows, slot] = ig_mask[rows, cols]
    isP = torch.zeros(B, K_max, dtype=torch.bool)
    pen = torch.zeros(B, K_max, dtype=f64)
    if penalty is not None:
        pen[rows, slot] = penalty[rows, cols].to(f64)
        isP = pen != 0

    _, g = torch.unique(group, return_inverse=True)
    num_groups = int(g.max()) + 1 if B else 0
    g_key = g[:, None].expand(B, K_max)
    if cfg.norm_group == "group_turn":
        ordinal = torch.cumsum(isI.long(), dim=1) - 1
        i_key, i_keys = g_key * max(K_max, 1) + ordinal.clamp(min=0), num_groups * max(K_max, 1)
    else:
        i_key, i_keys = g_key, num_groups

    raw_ig = cfg.norm_mode == "raw_ig"
    gamma = torch.full((B,), 0.0 if raw_ig else cfg.gamma, dtype=f64)
    if cfg.adaptive_gamma_min_weight > 0 and not raw_ig:
        adaptive = cfg.adaptive_gamma_min_weight ** (1.0 / K.clamp(min=1).to(f64))
        gamma = torch.where(K > 1, adaptive, gamma)

    metrics: dict[str, float] = {}

    def normalize(v: Tensor) -> Tensor:
        """N over slots from values v at F and I slots: mode, then ig_weight and curriculum weights."""
        eps, divide = cfg.epsilon, cfg.norm_adv_by_std
        N = torch.zeros_like(v)
        if cfg.norm_mode == "joint":
            z, _ = _group_z(v, isF | isI, g_key, num_groups, divide, eps)
            N = torch.where(isF | isI, z, N)
            zF, zI = torch.where(isF, z, N), torch.where(isI, z, N)
        else:
            zF, _ = _group_z(v, isF, g_key, num_groups, divide, eps)
            if raw_ig:
                _, sigma_I = _group_z(v, isI, i_key, i_keys, True, eps)
                outcome_of_row = zF.sum(dim=1, keepdim=True)  # at most one F slot per row
                zI = torch.where(isI, v / (sigma_I + eps) * cfg.ig_weight + outcome_of_row, N)
                if bool(isI.any()):
                    ig_over_std = (v / (sigma_I + eps))[isI]
                    metrics["igpo/ig_mean_over_std"] = float(ig_over_std.mean())
            else:
                zI, _ = _group_z(v, isI, i_key, i_keys, divide, eps)
            if cfg.norm_mode == "scaled_separate":
                num = max(float(zF[isF].abs().mean()), cfg.scale_floor) if bool(isF.any()) else 1.0
                den = float(zI[isI].abs().mean()) + eps if bool(isI.any()) else 1.0
                scale = min(num / den, cfg.scale_cap)
                metrics["igpo/ig_scale"] = scale
                metrics["igpo/outcome_norm_abs_mean"] = float(zF[isF].abs().mean()) if bool(isF.any()) else 0.0
                zI = zI * scale
                metrics["igpo/ig_norm_abs_mean"] = float(zI[isI].abs().mean()) if bool(isI.any()) else 0.0
            N = torch.where(isF, zF, torch.where(isI, zI, N))
        if not raw_ig:
            N = torch.where(isI, N * cfg.ig_weight, N)
        return torch.where(isF, N * outcome_weight, torch.where(isI, N * ig_weight_schedule, N))

    if cfg.norm_order == "before_discount":
        A = _discounted_scan(normalize(r) + pen, gamma)
    else:
        returns_raw = _discounted_scan(torch.where(isF | isI, r, torch.zeros_like(r)), gamma)[:, :K_max]
        A = torch.zeros(B, K_max + 1, dtype=f64)
        A[:, :K_max] = normalize(returns_raw)
        A = A + _discounted_scan(pen, gamma)
    if not bool(torch.isfinite(A).all()):
        raise RuntimeError("IGPO advantage became non-finite (overflow in rewards or weights); refusing to return NaN.")

    # Broadcast: segment k of row i (tokens P_{k-1}+1 .. P_k) gets A[i, k]; a tail segment after the last boundary
    # gets 0. Segments of all rows, in row-major order, tile the flattened [B*L] tensor exactly once.
    nnz = rows.numel()
    flat_slot = torch.arange(nnz) + rows  # each earlier row contributes one extra (tail) segment
    tail_slot = torch.cumsum(K, 0) + torch.arange(B)
    seg_vals = torch.zeros(nnz + B, dtype=f64)
    seg_vals[flat_slot] = A[rows, slot]
    prev_col = torch.full_like(cols, -1)
    if nnz > 1:
        prev_col[1:] = torch.where(rows[1:] == rows[:-1], cols[:-1], prev_col[1:])
    last_col = torch.where(K > 0, cols[(start + K - 1).clamp(min=0, max=max(nnz - 1, 0))] if nnz else -1, -1)
    seg_len = torch.zeros(nnz + B, dtype=torch.long)
    seg_len[flat_slot] = cols - prev_col
    seg_len[tail_slot] = L - 1 - last_col
    advantages = torch.repeat_interleave(seg_vals.to(rewards.dtype), seg_len, output_size=B * L).view(B, L)
    # Masked tokens per segment (exact in float32: a segment is shorter than 2**24 tokens): for the metrics, and to
    # skip the masking pass when no segment has a hole.
    seg_tokens = torch.segment_reduce(response_mask.reshape(-1).to(torch.float32), "sum",
                                      lengths=seg_len).to(f64)
    if bool((seg_tokens[flat_slot] != seg_len[flat_slot]).any()):
        advantages = torch.where(response_mask, advantages, torch.zeros((), dtype=rewards.dtype))
    tokens = torch.zeros(B, K_max + 1, dtype=f64)
    tokens[rows, slot] = seg_tokens[flat_slot]

    # Metrics (§2.7), computed on the slot tensors; token statistics through per-segment token counts.
    _metrics_into(metrics, r, isF, isI, isP, g, num_groups, K, gamma, A, tokens)
    return advantages, advantages, metrics


def _metrics_into(metrics, r, isF, isI, isP, g, num_groups, K, gamma, A, tokens):
    B = r.shape[0]
    ig_vals = r[isI]
    active = isI.any(dim=1)
    metrics["igpo/ig_active_samples"] = float(active.sum())
    metrics["igpo/ig_active_ratio"] = float(active.sum()) / max(B, 1)
    metrics["igpo/ig_total_positions"] = float(isI.sum())
    metrics["igpo/f1_total_positions"] = float(isF.sum())
    metrics["igpo/penalty_positions"] = float(isP.sum())
    if ig_vals.numel():
        metrics["igpo/raw_ig_mean"] = float(ig_vals.mean())
        metrics["igpo/raw_ig_std"] = float(ig_vals.std(unbiased=False))
        metrics["igpo/raw_ig_positive_ratio"] = float((ig_vals > 0).to(r.dtype).mean())
        metrics["igpo/raw_ig_negative_count"] = float((ig_vals < 0).sum())
        metrics["igpo/raw_ig_abs_mean"] = float(ig_vals.abs().mean())
    outcome = r[isF]
    metrics["igpo/outcome_reward_mean"] = float(outcome.mean()) if outcome.numel() else 0.0
    # Groups with more than one outcome whose outcomes are all equal: GRPO gives them no signal, IG still does.
    og = g[:, None].expand_as(isF)[isF]
    n = torch.bincount(og, minlength=num_groups).to(r.dtype)
    mu = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, og, outcome) / n.clamp(min=1)
    var = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, og, (outcome - mu[og]) ** 2) / n.clamp(min=1)
    multi = n > 1
    metrics["igpo/all_same_outcome_ratio"] = (
        float((multi & (var.sqrt() < 1e-6)).sum()) / float(multi.sum()) if bool(multi.any()) else 0.0
    )
    metrics["igpo/num_groups"] = float(num_groups)
    has = K > 0
    if bool(has.any()):
        metrics["igpo/effective_gamma_mean"] = float(gamma[has].mean())
        metrics["igpo/effective_gamma_min"] = float(gamma[has].min())
        metrics["igpo/effective_gamma_max"] = float(gamma[has].max())
        k = K[has].to(r.dtype)
        metrics["igpo/num_turns_mean"] = float(k.mean())
        metrics["igpo/num_turns_min"] = float(k.min())
        metrics["igpo/num_turns_max"] = float(k.max())
    total = float(tokens.sum())
    if total > 0:
        mean = float((tokens * A).sum()) / total
        metrics["igpo/adv_abs_mean"] = float((tokens * A.abs()).sum()) / total
        metrics["igpo/adv_std"] = math.sqrt(max(float((tokens * (A - mean) ** 2).sum()) / total, 0.0))
        metrics["igpo/adv_positive_ratio"] = float((tokens * (A > 0)).sum()) / total
    K_max = isF.shape[1]
    if bool(isI.any()):
        metrics["igpo/adv_ig_positions_mean"] = float(A[:, :K_max][isI].mean())
    if bool(isF.any()):
        metrics["igpo/adv_f1_positions_mean"] = float(A[:, :K_max][isF].mean())


class WarmupGate:
    """IG warm-up gate (§1.7): pure GRPO until the EMA of the batch-mean outcome reaches ``threshold``, then IG on
    for good (one-way latch). ``threshold`` = 0 disables the gate (IG always on).

    EMA_t = α · mean_outcome_t + (1 − α) · EMA_{t−1}, started at the first observed batch mean.
    """

    def __init__(self, threshold: float = 0.0, ema_alpha: float = 0.1):
        if not math.isfinite(threshold):
            raise ValueError(f"ig_warmup_threshold={threshold!r} must be finite (0 disables the gate).")
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ig_warmup_ema_alpha={ema_alpha!r} must lie in (0, 1].")
        self.threshold = threshold
        self.ema_alpha = ema_alpha
        self.ema: float | None = None
        self.graduated = threshold <= 0

    def update(self, batch_outcome_mean: float) -> bool:
        """Fold in this step's batch-mean outcome; return whether IG is active for this step."""
        if not math.isfinite(batch_outcome_mean):
            raise ValueError(f"batch outcome mean {batch_outcome_mean!r} is not finite; check the outcome rewards.")
        a = self.ema_alpha
        self.ema = batch_outcome_mean if self.ema is None else a * batch_outcome_mean + (1 - a) * self.ema
        if self.ema >= self.threshold:
            self.graduated = True
        return self.graduated

    @property
    def active(self) -> bool:
        return self.graduated

    def state_dict(self) -> dict:
        return {"ema": self.ema, "graduated": self.graduated, "threshold": self.threshold, "ema_alpha": self.ema_alpha}

    def load_state_dict(self, state: dict) -> None:
        """Restore EMA and latch; the threshold and α of the current config win (they are config, not state)."""
        ema = state.get("ema")
        self.ema = None if ema is None else float(ema)
        self.graduated = bool(state.get("graduated", False)) or self.threshold <= 0


@dataclass(frozen=True)
class CurriculumConfig:
    """Linear curriculum of the outcome and IG weights over training (§1.7; off by default).

    w_f1 = f1_init + (f1_final − f1_init) · p,  w_ig = ig_init + (ig_final − ig_init) · p,
    p = min(step / total_steps, 1): start IG-heavy (dense guidance), end outcome-heavy.
    """

    enabled: bool = False
    f1_init: float = 0.5
    f1_final: float = 1.0
    ig_init: float = 1.0
    ig_final: float = 0.5

    def __post_init__(self):
        for name in ("f1_init", "f1_final", "ig_init", "ig_final"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"curriculum {name}={getattr(self, name)!r} must be finite.")


def curriculum_weights(step: int, total_steps: int, cfg: CurriculumConfig) -> tuple[float, float]:
    """(w_outcome, w_ig) at ``step``; (1, 1) when the curriculum is off."""
    if not cfg.enabled:
        return 1.0, 1.0
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps!r} must be positive when the curriculum is enabled.")
    p = min(max(step, 0) / total_steps, 1.0)
    return cfg.f1_init + (cfg.f1_final - cfg.f1_init) * p, cfg.ig_init + (cfg.ig_final - cfg.ig_init) * p
