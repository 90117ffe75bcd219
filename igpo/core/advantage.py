"""The IGPO turn-level advantage (docs/design/reference_igpo.md §2).

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
With ARPO branches a turn shared by |S| trajectories is one position: the means are weighted, w = 1/|S| on each copy
(w = 1 otherwise), μ_g = Σ w r / Σ w, σ_g² = Σ w (r − μ_g)² / Σ w + 1e-8, |M ∩ g| = Σ w: the de-duplicated pool's.

Implementation, three stages, none of them a Python loop over samples, turns or tokens:
    1. reward positions: found in dense [B, L] masks (``compute_igpo_advantage``, one streaming pass in
       ``igpo.core.token_passes``), in dense token rewards by the reference convention (stock verl's estimator call:
       ``boundaries_from_token_rewards``, also one pass) or given directly (``advantage_at_boundaries`` with
       ``Boundaries.at``, e.g. from the turn ends the rollout recorded: ``igpo.core.info_gain.turn_boundaries``);
    2. the turn-level math above, in float64 over the flat list of boundaries (row-major, K_i per row):
       ``_turn_advantages``, compiled with numba (a few linear passes; ~20 K boundaries take well under 1 ms);
    3. each segment's advantage written onto its tokens (``token_passes.spread``, one streaming pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor

from igpo.core.token_passes import Boundaries, find_boundaries, spread, token_reward_boundaries, token_reward_masks

NORM_MODES = ("joint", "separate", "scaled_separate", "raw_ig", "uncentred", "potential", "state_grouped")
# The designs in which the turn reward is not centred over the group's turns, so that a trajectory that makes more
# progress can earn more turn credit in total (docs/methods/turn_credit.md).
PROGRESS_MODES = ("uncentred", "potential", "state_grouped")
STATE_ANCHORS = ("hops", "turn")
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
            over many turns drifts with depth). A pool whose turn rewards are all equal (σ² = 0) divides by
            √1e-8 = 1e-4 here, as in the reference: a constant turn reward (the oracle's 1 per correct hop) is then
            multiplied by 10⁴.
        The three designs below keep the turn reward uncentred, so progress can pay (docs/methods/turn_credit.md):
        ``uncentred``: N[F] = ẑ(F), N[I] = ig_weight · r (÷ σ_g(I) with ``turn_std``, where the pool has spread),
            then the discount as configured: A_k = N_k + γ A_{k+1}. No batch scalar, no mean-centring of r (DR-Venus's
            ``raw_ig`` generalised, without forcing γ = 0 and without adding the outcome at every turn).
        ``potential``: for turn rewards that are potential differences r_j = Φ_{j+1} − Φ_j: γ is forced to 1, so
            A_k = ẑ(F) + ig_weight · (Φ_end − Φ_k): the outcome's GRPO advantage on every turn plus the progress made
            from turn k to the end (telescoped shaping with the outcome kept).
        ``state_grouped``: GiGPO's two-level advantage with turn rewards in the step return. A_k = ẑ(F) + A^S_k,
            A^S_k = R_k − mean{R_k' : k' taken from the same state} (÷ their σ with ``turn_std``; 0 for a state seen
            once), R_k = Σ_{k'≥k} γ^{k'−k} x_{k'} with x = ig_weight · r at turn positions, the raw outcome at the
            outcome position, plus penalties. The state of each boundary comes from the method (``Boundaries.anchor``;
            ``state_anchor`` chooses it where the method offers several).
    gamma: turn-level discount γ ∈ [0, 1] (over boundaries, not tokens).
    norm_adv_by_std: divide by σ_g + ε (GRPO); False gives Dr.GRPO-style mean-centring only.
    ig_weight: multiplier of normalized IG rewards (raw_ig: applied before adding the outcome term).
    adaptive_gamma_min_weight: w in [0, 1); w > 0 sets γ_i = w^(1/K_i) per trajectory (disabled in raw_ig).
    epsilon: ε added to σ.
    norm_order: ``before_discount`` (paper order; DR-Venus) z-scores rewards then discounts.
        ``after_discount`` (ours, not any released code): discount raw rewards into per-boundary returns (γ, turn
        level), z-score the returns with ``norm_mode`` and broadcast them without a second discount; penalties are
        added after. An experiment on the order question of GuoqingWang1/IGPO#5.
        (``original_code`` was removed, issue 24: it cut the token return at every observation, while the released
        IGPO trainer sums it over every response token, observations included, with IG on the observation's
        closing token; it never reproduced that trainer end to end.)
    norm_group: ``group`` pools all positions of a prompt group (reference; long trajectories dominate μ/σ of IG).
        ``group_turn`` z-scores the k-th IG position of each rollout against the k-th IG positions of the other
        rollouts of the prompt (against the depth bias, A²TGPO-style); outcome stays pooled per group.
        Not defined for ``joint`` (outcome and IG share one pool there).
    scale_floor, scale_cap: the 0.3 floor and 10 cap of scaled_separate's batch scalar.
    turn_std: ``uncentred`` and ``state_grouped`` only: divide the turn term by its pool's σ (the group's turn
        rewards; the state's step returns, GiGPO's ``mean_std_norm``); off by default (GiGPO's ``mean_norm``).
    std_ddof: σ of every z-score over n pooled values as √(Σ(r − μ)²/(n − std_ddof) + 1e-8): 0, the population σ
        (DR-Venus, the default), or 1, the sample σ of verl's GRPO (``torch.std``), so that a comparison against
        ``adv_estimator=grpo`` gives the outcome channel the same scale.
    state_anchor: ``state_grouped`` only: which state a turn was taken from, where the method offers a choice:
        ``hops`` (the correct hops made so far; the demo world's truth, TurnBatch.hop_right) or ``turn`` (the turn's
        index, available everywhere); None: the method's own (the oracle: hops; information-gain methods: turn).
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
    turn_std: bool = False
    std_ddof: int = 0
    state_anchor: str | None = None

    def __post_init__(self):
        if self.norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode={self.norm_mode!r} is unknown; use one of {NORM_MODES}.")
        if self.norm_order == "original_code":
            raise ValueError("norm_order='original_code' was removed: it was not the released IGPO trainer end to "
                             "end (README, 'Reference vs our default'); use 'before_discount' (the paper's order) "
                             "or 'after_discount'.")
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
        if self.std_ddof not in (0, 1) or isinstance(self.std_ddof, bool):
            raise ValueError(f"std_ddof={self.std_ddof!r} must be 0 (population σ, DR-Venus) or 1 (sample σ, verl's "
                             "GRPO).")
        progress = self.norm_mode in PROGRESS_MODES
        if progress and self.norm_order != "before_discount":
            raise ValueError(f"norm_mode={self.norm_mode!r} with norm_order={self.norm_order!r}: after_discount z-scores "
                             "the returns, which centres the turn rewards this design leaves uncentred; use "
                             "norm_order=before_discount (the default).")
        if progress and self.norm_group != "group":
            raise ValueError(f"norm_mode={self.norm_mode!r} with norm_group={self.norm_group!r}: the turn reward is not "
                             "pooled per turn index in this design; use norm_group=group (the default).")
        if self.turn_std and self.norm_mode not in ("uncentred", "state_grouped"):
            raise ValueError(f"turn_std=true with norm_mode={self.norm_mode!r}: only uncentred and state_grouped divide "
                             "the turn term by a σ (potential must not: the sum would no longer telescope); set "
                             "turn_std=false or choose one of those modes.")
        if self.state_anchor is not None and (self.norm_mode != "state_grouped" or
                                              self.state_anchor not in STATE_ANCHORS):
            raise ValueError(f"state_anchor={self.state_anchor!r} with norm_mode={self.norm_mode!r}: a state anchor is "
                             f"one of {STATE_ANCHORS} and is read by norm_mode=state_grouped only; remove the key or "
                             "set norm_mode=state_grouped.")
        if self.norm_mode in ("potential", "state_grouped") and self.adaptive_gamma_min_weight > 0:
            raise ValueError(f"adaptive_gamma_min_weight with norm_mode={self.norm_mode!r} is not defined (potential "
                             "telescopes with γ = 1; state_grouped compares returns of one state across rows, which "
                             "needs one γ); set it to 0.")


def last_response_token(response_mask: Tensor) -> Tensor:
    """[B] index of each row's last response token (where the outcome sits), -1 for a row without any."""
    m = response_mask.bool()
    last = (m.shape[1] - 1) - m.flip(1).to(torch.uint8).argmax(dim=1)
    return torch.where(m.any(dim=1), last, -1)


def masks_from_token_rewards(token_level_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Reference convention (§2.1): outcome at the last valid token, IG at the other non-zero valid positions.

    Only for callers that cannot pass explicit masks (stock verl): a zero IG is invisible here.
    """
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must share one [B, L] shape.")
    return token_reward_masks(token_level_rewards.contiguous(), response_mask.bool().contiguous())


def boundaries_from_token_rewards(token_level_rewards: Tensor, response_mask: Tensor) -> tuple[Boundaries, int, int]:
    """The reward positions of ``masks_from_token_rewards`` for ``advantage_at_boundaries``, found in one pass without
    building the masks, and the non-zero rewards outside ``response_mask`` that the advantage would not see: (positions,
    how many, flat index i·L + t of the first or -1)."""
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must share one [B, L] shape.")
    if not torch.is_floating_point(token_level_rewards):
        raise ValueError(f"token_level_rewards must be a float tensor; got {token_level_rewards.dtype}.")
    return token_reward_boundaries(token_level_rewards.contiguous(), response_mask.bool().contiguous())


def _check_inputs(rewards, outcome_mask, ig_mask, response_mask, group, penalty, outcome_weight, ig_weight_schedule):
    if rewards.dim() != 2 or not torch.is_floating_point(rewards):
        raise ValueError(f"rewards must be a float [B, L] tensor; got {rewards.dtype} {tuple(rewards.shape)}.")
    shape = tuple(rewards.shape)
    for name, t in (("outcome_mask", outcome_mask), ("ig_mask", ig_mask), ("response_mask", response_mask)):
        if tuple(t.shape) != shape or t.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor of the rewards' shape {shape}; got {t.dtype} {tuple(t.shape)}.")
    if penalty is not None and (tuple(penalty.shape) != shape or not torch.is_floating_point(penalty)):
        raise ValueError(f"penalty must be a float tensor of shape {shape}; got {penalty.dtype} {tuple(penalty.shape)}.")
    _check_group_and_weights(shape[0], group, outcome_weight, ig_weight_schedule)


def _check_group_and_weights(B: int, group: Tensor, outcome_weight: float, ig_weight_schedule: float) -> None:
    if group.shape != (B,) or group.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group must be an integer [B] = ({B},) tensor of group ids; got {group.dtype} "
                         f"{tuple(group.shape)}.")
    for name, w in (("outcome_weight", outcome_weight), ("ig_weight_schedule", ig_weight_schedule)):
        if not math.isfinite(w):
            raise ValueError(f"{name}={w!r} must be finite.")


_POSITION_ERRORS = {
    1: "rewards contain NaN or inf at outcome/IG positions; a failed reward must be handled upstream (e.g. a failed IG "
       "boundary is not placed), never passed to the advantage.",
    2: "penalty contains NaN or inf.",
    3: "a token is marked both outcome and IG (outcome_mask and ig_mask overlap); a token carries either the outcome "
       "or an IG reward.",
    4: "a reward position lies outside response_mask; outcome, IG and penalty positions must be valid response tokens. "
       "An IG placed reference-style on an observation's end token is lost when observation tokens are masked: put "
       "it on the turn's last generated token (the igpo_sync trainer mode does).",
    5: "a trajectory has more than one outcome position; at most one per row (the last response token).",
}


@numba.njit(cache=True, nogil=True)
def _position_error(K, r, is_f, is_i, in_mask, pen, masked_turns_ok):
    """The first of ``_POSITION_ERRORS`` (by its number) that the reward positions show, 0 for none: one pass over
    what lies at the boundaries (O(#boundaries), never O(B·L)). ``pen`` of length 0: no penalties."""
    found = 0
    p = 0
    for i in range(K.shape[0]):
        outcomes = 0
        for _ in range(K[i]):
            f, ig = is_f[p], is_i[p]
            if (f or ig) and not np.isfinite(r[p]):
                error = 1
            elif pen.shape[0] and not np.isfinite(pen[p]):
                error = 2
            elif f and ig:
                error = 3
            elif not in_mask[p] and (f or not masked_turns_ok):
                error = 4
            else:
                error = 0
            outcomes += f
            if outcomes > 1 and error == 0:
                error = 5
            if error and (found == 0 or error < found):
                found = error
            p += 1
    return found


def _check_positions(r: np.ndarray, is_f: np.ndarray, is_i: np.ndarray, in_mask: np.ndarray, pen: np.ndarray | None,
                     K: np.ndarray, masked_turns_ok: bool = False) -> None:
    """Value checks on the reward positions only (K_i positions per row, row-major)."""
    error = _position_error(K.astype(np.int64, copy=False), r, is_f, is_i, in_mask,
                            pen if pen is not None else _NO_VALUES, masked_turns_ok)
    if error:
        raise ValueError(_POSITION_ERRORS[error])


_NO_VALUES = np.zeros(0)  # an optional per-boundary array left out (no penalty, every pool weight 1)


@numba.njit(cache=True, nogil=True)
def _dense_ids(x):
    """np.unique(x, return_inverse=True)'s inverse (ids in the order of the sorted distinct values) and their count,
    compiled: np.unique costs ~50 us of Python for a batch's few hundred group ids."""
    order = np.argsort(x, kind="mergesort")
    ids = np.empty(x.shape[0], np.int64)
    k = -1
    for j in range(order.shape[0]):
        if j == 0 or x[order[j]] != x[order[j - 1]]:
            k += 1
        ids[order[j]] = k
    return ids, k + 1


def _zero_tokens(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zero-filled output. On CPU numpy allocates it: a large ``np.zeros`` is fresh zero pages from the kernel (no
    memset), numpy advises transparent huge pages for it and torch's allocator does not (faulting a 32 MiB tensor in
    by 4 KiB pages costs ~15 ms, more than filling it); the spread then writes only the tokens up to each row's last
    boundary, so the padding after a row's response is never written twice."""
    np_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}.get(dtype)
    if device.type != "cpu" or np_dtype is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype))


# Mode codes passed to the compiled turn-level kernel.
_MODE_CODE = {mode: code for code, mode in enumerate(NORM_MODES)}
_JOINT, _SCALED_SEPARATE, _RAW_IG = _MODE_CODE["joint"], _MODE_CODE["scaled_separate"], _MODE_CODE["raw_ig"]
_UNCENTRED, _POTENTIAL = _MODE_CODE["uncentred"], _MODE_CODE["potential"]


@numba.njit(cache=True, nogil=True)
def _discount_in_place(values, K, gamma):
    """values[p] := A_p = v_p + γ_i A_{p+1} within each trajectory (boundaries in flat row-major order, K_i per row)."""
    end = 0
    for i in range(K.shape[0]):
        end += K[i]
        acc = 0.0
        for p in range(end - 1, end - K[i] - 1, -1):
            acc = values[p] + gamma[i] * acc
            values[p] = acc


@numba.njit(cache=True, nogil=True)
def _add_discounted(out, values, K, gamma):
    """out[p] += the discounted sum of values from p to the end of its trajectory (``values`` is left as it is)."""
    end = 0
    for i in range(K.shape[0]):
        end += K[i]
        acc = 0.0
        for p in range(end - 1, end - K[i] - 1, -1):
            acc = values[p] + gamma[i] * acc
            out[p] = out[p] + acc


@numba.njit(cache=True, nogil=True)
def _pooled_z(v, sel, w, K, g, turn_stride, num_keys, divide, eps, z, ddof):
    """z[p] = ẑ of v[p] for the selected boundaries (other entries of z are not written), pooled by key with weights w
    (module docstring; w = 1 except for the copies of a turn that ARPO branches share, 1/|S| each; w of length 0: all
    1, the same arithmetic); returns σ per key, √(Σ w (v − μ)² / (Σ w − ddof) + 1e-8) (1 for a key of one position).
    A boundary of row i has key g[i] (turn_stride 0), or g[i] · turn_stride + its rank among the row's selected
    boundaries (norm_group=group_turn: one pool per group and turn).

    Each key's sums are added in position order, carried in registers along a row (a store and reload per position,
    not the arithmetic, set the speed of these passes), so the result does not depend on how rows are visited."""
    B = K.shape[0]
    weighted = w.shape[0] != 0
    n = np.zeros(num_keys)
    mu = np.zeros(num_keys)
    start = 0
    for i in range(B):
        end = start + K[i]
        if turn_stride == 0:
            k = g[i]
            n_k, sum_k = n[k], mu[k]
            for p in range(start, end):
                if sel[p]:
                    w_p = w[p] if weighted else 1.0
                    n_k += w_p
                    sum_k += w_p * v[p]
            n[k], mu[k] = n_k, sum_k
        else:
            k = g[i] * turn_stride
            for p in range(start, end):
                if sel[p]:
                    w_p = w[p] if weighted else 1.0
                    n[k] += w_p
                    mu[k] += w_p * v[p]
                    k += 1
        start = end
    for k in range(num_keys):
        if n[k] > 0:
            mu[k] /= n[k]
    var = np.zeros(num_keys)
    start = 0
    for i in range(B):
        end = start + K[i]
        if turn_stride == 0:
            k = g[i]
            mu_k, var_k = mu[k], var[k]
            for p in range(start, end):
                if sel[p]:
                    d = v[p] - mu_k
                    var_k += (w[p] if weighted else 1.0) * d * d
            var[k] = var_k
        else:
            k = g[i] * turn_stride
            for p in range(start, end):
                if sel[p]:
                    d = v[p] - mu[k]
                    var[k] += (w[p] if weighted else 1.0) * d * d
                    k += 1
        start = end
    sigma = np.ones(num_keys)
    for k in range(num_keys):
        if n[k] > 1.0 + 1e-9:  # more than one distinct position (weights of shared copies sum to ~1)
            sigma[k] = math.sqrt(var[k] / (n[k] - ddof) + 1e-8)
    start = 0
    for i in range(B):
        end = start + K[i]
        k = g[i] * turn_stride if turn_stride else g[i]
        for p in range(start, end):
            if sel[p]:
                d = v[p] - mu[k]
                z[p] = d / (sigma[k] + eps) if divide else d
                k += turn_stride != 0
        start = end
    return sigma


@numba.njit(cache=True, nogil=True)
def _turn_advantages(K, g, num_groups, r, is_f, is_i, pen, w, mode, gamma, adaptive_w, after_discount, group_turn,
                     divide, eps, ig_weight, scale_floor, scale_cap, outcome_weight, ig_schedule, ddof, turn_std):
    """Per-boundary advantages A (flat, row-major) from rewards r, outcome / IG flags, penalties and pool weights w
    (group statistics and scaled_separate's batch means are w-weighted): normalize (mode), weight, discount (order).
    Returns (A, γ_i per row, [ig_scale, |ẑ(F)| mean, |scaled ẑ(I)| mean, mean r/σ over I]).

    One array of n boundaries is allocated (A, which holds ẑ(F) at the outcomes and ẑ(I) at the IG positions, as they
    are disjoint), two with after_discount: each temporary of this size costs page faults on a fresh allocation.
    ``pen`` or ``w`` of length 0: no penalties, every weight 1 (the same arithmetic as zeros and ones)."""
    B, n = K.shape[0], r.shape[0]
    weighted = w.shape[0] != 0
    raw_ig = mode == _RAW_IG
    uncentred = mode == _UNCENTRED or mode == _POTENTIAL
    gam = np.full(B, 0.0 if raw_ig else 1.0 if mode == _POTENTIAL else gamma)
    if adaptive_w > 0 and not raw_ig:
        for i in range(B):
            if K[i] > 1:
                gam[i] = adaptive_w ** (1.0 / K[i])
    # The values normalised: r where an outcome or IG lies (the pools read nothing else), discounted first with
    # after_discount (a penalty-only boundary then carries 0 into the sum).
    v = r
    if after_discount:
        v = np.zeros(n)
        for p in range(n):
            if is_f[p] or is_i[p]:
                v[p] = r[p]
        _discount_in_place(v, K, gam)

    stats = np.full(4, np.nan)
    N = np.zeros(n)
    if mode == _JOINT:
        _pooled_z(v, is_f | is_i, w, K, g, 0, num_groups, divide, eps, N, ddof)
    else:
        _pooled_z(v, is_f, w, K, g, 0, num_groups, divide, eps, N, ddof)
        ig_max = 1  # the most IG boundaries in one row: the stride of group_turn's keys
        if group_turn:
            start = 0
            for i in range(B):
                seen = 0
                for p in range(start, start + K[i]):
                    seen += is_i[p]
                ig_max = max(ig_max, seen)
                start += K[i]
        stride = ig_max if group_turn else 0
        sigma_i = _pooled_z(v, is_i, w, K, g, stride, num_groups * ig_max if group_turn else num_groups, divide, eps,
                            N, ddof)
        n_f, n_i, abs_f, abs_i, over_std = 0.0, 0.0, 0.0, 0.0, 0.0
        start = 0
        for i in range(B):
            end = start + K[i]
            outcome_z = 0.0  # at most one outcome per row, its last boundary
            if raw_ig:
                for p in range(start, end):
                    if is_f[p]:
                        outcome_z = N[p]
            k = g[i] * stride if stride else g[i]
            for p in range(start, end):
                w_p = w[p] if weighted else 1.0
                if is_i[p]:
                    if raw_ig:
                        scaled = v[p] / (sigma_i[k] + eps)
                        over_std += w_p * scaled
                        N[p] = scaled * ig_weight + outcome_z
                    elif uncentred:
                        # Not centred; divided by σ only where the pool has spread (σ² above the 1e-8 every σ
                        # carries): a constant reward over a pool stays as it is rather than times 10⁴.
                        spread = turn_std and sigma_i[k] * sigma_i[k] > 2e-8
                        N[p] = v[p] / sigma_i[k] if spread else v[p]
                        over_std += w_p * N[p]
                    n_i += w_p
                    abs_i += w_p * abs(N[p])
                    k += stride != 0
                elif is_f[p]:
                    n_f += w_p
                    abs_f += w_p * abs(N[p])
            start = end
        if (raw_ig or uncentred) and n_i:
            stats[3] = over_std / n_i
        if mode == _SCALED_SEPARATE:
            numerator = max(abs_f / n_f, scale_floor) if n_f else 1.0
            denominator = abs_i / n_i + eps if n_i else 1.0
            scale = min(numerator / denominator, scale_cap)
            stats[0], stats[1] = scale, abs_f / n_f if n_f else 0.0
            stats[2] = scale * abs_i / n_i if n_i else 0.0
            for p in range(n):
                if is_i[p]:
                    N[p] *= scale
    for p in range(n):
        if is_i[p]:
            N[p] *= ig_schedule if raw_ig else ig_weight * ig_schedule
        elif is_f[p]:
            N[p] *= outcome_weight
    has_pen = pen.shape[0] != 0
    if after_discount:
        if has_pen:
            _add_discounted(N, pen, K, gam)
        else:
            for p in range(n):
                N[p] += 0.0  # as adding a zero penalty's discounted sum: -0.0 becomes 0.0
        return N, gam, stats
    for p in range(n):
        N[p] += pen[p] if has_pen else 0.0
    _discount_in_place(N, K, gam)
    return N, gam, stats


def _state_grouped(K, g, num_groups, r, is_f, is_i, pen, w, anchor, cfg: AdvantageConfig, outcome_weight: float,
                   ig_schedule: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``state_grouped`` (AdvantageConfig): A_k = w_f · ẑ(F)_i + A^S_k per boundary k of row i (flat, row-major),
    with A^S the step return's difference from the mean over the boundaries of the same (prompt group, anchor) key
    (``anchor`` [n] int64, −1: no state, A^S = 0). Returns (A, γ per row, stats [share of boundaries whose state was
    seen more than once, mean |A^S| over them, NaN, NaN]).

    Vectorised over boundaries (np.bincount per key); the discount is the compiled one of the other modes."""
    B, n = K.shape[0], r.shape[0]
    gam = np.full(B, cfg.gamma)
    weights = w if w is not None else np.ones(n)
    # The episode term: the outcome's group z-score, the same on every boundary of its row (GiGPO's A^E).
    z = np.zeros(n)
    _pooled_z(r, is_f, w if w is not None else _NO_VALUES, K, g, 0, num_groups, cfg.norm_adv_by_std, cfg.epsilon,
              z, cfg.std_ddof)
    rows = np.repeat(np.arange(B), K)
    outcome_z = np.zeros(B)
    outcome_z[rows[is_f]] = z[is_f]
    # The step return: turn rewards (weighted), the raw outcome and penalties, discounted to each boundary.
    x = np.where(is_i, r * (cfg.ig_weight * ig_schedule), 0.0) + np.where(is_f, r, 0.0)
    if pen is not None:
        x = x + pen
    _discount_in_place(x, K, gam)
    step = np.zeros(n)
    stats = np.full(4, np.nan)
    has = anchor >= 0
    if has.any():
        top = int(anchor[has].max()) + 1
        key, num_keys = _dense_ids(np.where(has, g[rows] * top + anchor, -1))
        count = np.bincount(key[has], weights=weights[has], minlength=num_keys)
        mean = np.bincount(key[has], weights=weights[has] * x[has], minlength=num_keys) / np.maximum(count, 1e-12)
        dev = x - mean[key]
        shared = has & (count[key] > 1.0 + 1e-9)  # a state reached once has nothing to be compared with
        step = np.where(shared, dev, 0.0)
        if cfg.turn_std:
            var = np.bincount(key[has], weights=weights[has] * dev[has] ** 2, minlength=num_keys)
            sigma = np.sqrt(var / np.maximum(count - cfg.std_ddof, 1e-12) + 1e-8)
            step = np.where(shared, step / (sigma[key] + cfg.epsilon), 0.0)
        stats[0] = float(weights[shared].sum() / weights.sum())
        stats[1] = float(np.abs(step[shared]).mean()) if shared.any() else 0.0
    A = outcome_weight * outcome_z[rows] + step
    return A, gam, stats


def _metrics(stats, r, is_f, is_i, is_p, rows, g, num_groups, K, gamma, A, tokens, mode: str = ""):
    """igpo/* metrics (§2.7) from the boundary arrays; token statistics (adv_*) over the response tokens of the
    segments, through per-segment token counts (tokens after a row's last boundary, advantage 0, are not counted)."""
    B = K.shape[0]
    metrics: dict[str, float] = {}
    names = (("state_shared_share", "state_step_abs_mean", "", "") if mode == "state_grouped" else
             ("ig_scale", "outcome_norm_abs_mean", "ig_norm_abs_mean", "ig_mean_over_std"))
    for name, value in zip(names, stats):
        if name and not math.isnan(value):
            metrics[f"igpo/{name}"] = float(value)
    active = int((np.bincount(rows[is_i], minlength=B) > 0).sum())
    metrics["igpo/ig_active_samples"] = float(active)
    metrics["igpo/ig_active_ratio"] = active / max(B, 1)
    metrics["igpo/ig_total_positions"] = float(is_i.sum())
    metrics["igpo/f1_total_positions"] = float(is_f.sum())
    metrics["igpo/penalty_positions"] = float(is_p.sum())
    ig = r[is_i]
    if ig.size:
        metrics["igpo/raw_ig_mean"] = float(ig.mean())
        metrics["igpo/raw_ig_std"] = float(ig.std())
        metrics["igpo/raw_ig_positive_ratio"] = float((ig > 0).mean())
        metrics["igpo/raw_ig_negative_count"] = float((ig < 0).sum())
        metrics["igpo/raw_ig_abs_mean"] = float(np.abs(ig).mean())
    outcome = r[is_f]
    metrics["igpo/outcome_reward_mean"] = float(outcome.mean()) if outcome.size else 0.0
    # Groups with more than one outcome whose outcomes are all equal: GRPO gives them no signal, IG still does.
    og = g[rows[is_f]]
    n = np.bincount(og, minlength=num_groups)
    mu = np.bincount(og, weights=outcome, minlength=num_groups) / np.maximum(n, 1)
    var = np.bincount(og, weights=(outcome - mu[og]) ** 2, minlength=num_groups) / np.maximum(n, 1)
    multi = n > 1
    metrics["igpo/all_same_outcome_ratio"] = (
        float((multi & (np.sqrt(var) < 1e-6)).sum()) / float(multi.sum()) if multi.any() else 0.0)
    metrics["igpo/num_groups"] = float(num_groups)
    has = K > 0
    if has.any():
        metrics["igpo/effective_gamma_mean"] = float(gamma[has].mean())
        metrics["igpo/effective_gamma_min"] = float(gamma[has].min())
        metrics["igpo/effective_gamma_max"] = float(gamma[has].max())
        metrics["igpo/num_turns_mean"] = float(K[has].mean())
        metrics["igpo/num_turns_min"] = float(K[has].min())
        metrics["igpo/num_turns_max"] = float(K[has].max())
    total = float(tokens.sum())
    if total > 0:
        # Sums of products, not `tokens @ A`: numpy hands a dot product of this size to BLAS threads, which on a busy
        # machine cost milliseconds per call to wake (measured 4-8 ms each against ~20 us here).
        mean = float((tokens * A).sum()) / total
        metrics["igpo/adv_abs_mean"] = float((tokens * np.abs(A)).sum()) / total
        metrics["igpo/adv_std"] = math.sqrt(max(float((tokens * (A - mean) ** 2).sum()) / total, 0.0))
        metrics["igpo/adv_positive_ratio"] = float(tokens[A > 0].sum()) / total
    if is_i.any():
        metrics["igpo/adv_ig_positions_mean"] = float(A[is_i].mean())
    if is_f.any():
        metrics["igpo/adv_f1_positions_mean"] = float(A[is_f].mean())
    return metrics


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
    rewards, outcome_mask, ig_mask, response_mask = (
        t.contiguous() for t in (rewards, outcome_mask, ig_mask, response_mask))
    penalty = penalty.contiguous() if penalty is not None else None
    bounds = find_boundaries(rewards, outcome_mask, ig_mask, response_mask, penalty)
    return advantage_at_boundaries(bounds, response_mask, group, cfg, outcome_weight=outcome_weight,
                                   ig_weight_schedule=ig_weight_schedule, dtype=rewards.dtype)


@torch.no_grad()
def advantage_at_boundaries(
    bounds: Boundaries,
    response_mask: Tensor,
    group: Tensor,
    cfg: AdvantageConfig,
    *,
    outcome_weight: float = 1.0,
    ig_weight_schedule: float = 1.0,
    dtype: torch.dtype = torch.float32,
    masked_turns_ok: bool = False,
    with_metrics: bool = True,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``compute_igpo_advantage`` from reward positions given directly (``Boundaries.at``, e.g. built from the turn
    ends the rollout recorded), which skips the pass over [B, L] masks that finds them. Output in ``dtype``.

    ``bounds.w`` (pool weights, ``Boundaries.at(weight=...)``): each position's weight in the group statistics and in
    scaled_separate's batch means, for turns shared by ARPO branches (``igpo.core.arpo.shared_turn_weights``: 1/|S| on
    each copy, so a shared turn counts once); None: every position 1, bit-identical to an unweighted pool.
    ``masked_turns_ok``: IG / penalty positions may lie outside ``response_mask`` (an empty turn's end: a reward
    position for the statistics and the discount whose own segment has no trained token); outcomes never may.
    ``with_metrics=False`` returns no metrics (an empty dict) for a caller that has nowhere to log them (stock verl's
    estimator call); ~0.6 ms at B=256 and ~80 boundaries per row."""
    B, L = response_mask.shape
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be a bool [B, L] tensor; got {response_mask.dtype}.")
    _check_group_and_weights(B, group, outcome_weight, ig_weight_schedule)
    n = bounds.r.shape[0]
    K = bounds.K.cpu().numpy()
    flat_max = (int(_max_int(bounds.flat.numpy())) if bounds.flat.device.type == "cpu" else
                int(bounds.flat.max())) if n else -1
    if K.shape != (B,) or int(K.sum()) != n or flat_max >= B * L:
        raise ValueError(f"the reward positions were built for another batch layout than response_mask [{B}, {L}] "
                         f"(K {tuple(K.shape)} summing to {int(K.sum())}, {n} entries); build them against this "
                         "response_mask.")
    response_mask = response_mask.contiguous()
    out = _zero_tokens((B, L), dtype, response_mask.device)

    # The turn-level work is O(#boundaries), on host arrays; no array of that size is built here that the kernels
    # do not need (each is fresh memory, and its page faults cost more than the work on it).
    r, is_f, is_i, pen, w = bounds.r, bounds.is_f, bounds.is_i, bounds.pen, bounds.w
    _check_positions(r, is_f, is_i, bounds.in_mask, pen, K, masked_turns_ok)
    g, num_groups = _dense_ids(group.cpu().numpy())
    if cfg.norm_mode == "state_grouped":
        if bounds.anchor is None:
            raise ValueError("norm_mode='state_grouped' needs the state each turn was taken from (Boundaries.anchor); "
                             "this caller built its reward positions without one: use a method that names its states "
                             "(igpo, oracle, ig_search, ...) or another norm_mode.")
        A, gamma, stats = _state_grouped(K, g, num_groups, r, is_f, is_i, pen, w, bounds.anchor, cfg,
                                         float(outcome_weight), float(ig_weight_schedule))
    else:
        A, gamma, stats = _turn_advantages(
            K, g, num_groups, r, is_f, is_i, pen if pen is not None else _NO_VALUES,
            w if w is not None else _NO_VALUES, _MODE_CODE[cfg.norm_mode], cfg.gamma, cfg.adaptive_gamma_min_weight,
            cfg.norm_order == "after_discount", cfg.norm_group == "group_turn", cfg.norm_adv_by_std, cfg.epsilon,
            cfg.ig_weight, cfg.scale_floor, cfg.scale_cap, float(outcome_weight), float(ig_weight_schedule),
            cfg.std_ddof, cfg.turn_std)
    if not np.isfinite(A).all():
        raise RuntimeError("IGPO advantage became non-finite (overflow in rewards or weights); refusing to return NaN.")

    tokens = spread(A, bounds, response_mask, out, count_tokens=with_metrics)
    if not with_metrics:
        return out, out, {}
    rows = np.repeat(np.arange(B), K)
    is_p = pen != 0 if pen is not None else np.zeros(n, bool)
    return out, out, _metrics(stats, r, is_f, is_i, is_p, rows, g, num_groups, K, gamma, A, tokens, cfg.norm_mode)


@numba.njit(cache=True, nogil=True)
def _max_int(x):
    top = x[0]
    for j in range(1, x.shape[0]):
        top = max(top, x[j])
    return top


WARMUP_TIMINGS = ("update_then_decide", "decide_then_update")


class WarmupGate:
    """IG warm-up gate (§1.7): pure GRPO until the EMA of the batch-mean outcome reaches ``threshold``, then IG on
    for good (one-way latch). ``threshold`` = 0 disables the gate (IG always on).

    EMA_t = α · mean_outcome_t + (1 − α) · EMA_{t−1}, started at the first observed batch mean.

    timing: when step t's own outcome counts.
        ``update_then_decide`` (ours): fold in step t's mean, then open if EMA_t ≥ threshold, so the step whose
            outcomes cross the threshold already trains with IG (the earliest the evidence allows).
        ``decide_then_update`` (reference, DR-Venus ``ray_trainer.py``): open if EMA_{t−1} ≥ threshold (closed at
            the first step, where there is no EMA yet), then fold in step t's mean; opens one step later.
    """

    def __init__(self, threshold: float = 0.0, ema_alpha: float = 0.1, timing: str = "update_then_decide"):
        if not math.isfinite(threshold):
            raise ValueError(f"ig_warmup_threshold={threshold!r} must be finite (0 disables the gate).")
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ig_warmup_ema_alpha={ema_alpha!r} must lie in (0, 1].")
        if timing not in WARMUP_TIMINGS:
            raise ValueError(f"ig_warmup_timing={timing!r} is unknown; use one of {WARMUP_TIMINGS}.")
        self.threshold = threshold
        self.ema_alpha = ema_alpha
        self.timing = timing
        self.ema: float | None = None
        self.graduated = threshold <= 0

    def update(self, batch_outcome_mean: float) -> bool:
        """Fold in this step's batch-mean outcome; return whether IG is active for this step (``timing``)."""
        if not math.isfinite(batch_outcome_mean):
            raise ValueError(f"batch outcome mean {batch_outcome_mean!r} is not finite; check the outcome rewards.")
        if self.timing == "decide_then_update" and self.ema is not None and self.ema >= self.threshold:
            self.graduated = True
        active = self.graduated
        a = self.ema_alpha
        self.ema = batch_outcome_mean if self.ema is None else a * batch_outcome_mean + (1 - a) * self.ema
        if self.timing == "update_then_decide" and self.ema >= self.threshold:
            self.graduated = True
            active = True
        return active

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

    scope: ``always`` (ours): the weights apply at every step, also while the warm-up gate keeps IG off, so the
        outcome's weight follows one schedule through training. ``ig_active`` (reference): only steps with IG active
        are weighted; while the gate is closed the outcome keeps weight 1.
    """

    enabled: bool = False
    scope: str = "always"
    f1_init: float = 0.5
    f1_final: float = 1.0
    ig_init: float = 1.0
    ig_final: float = 0.5

    def __post_init__(self):
        for name in ("f1_init", "f1_final", "ig_init", "ig_final"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"curriculum {name}={getattr(self, name)!r} must be finite.")
        if self.scope not in CURRICULUM_SCOPES:
            raise ValueError(f"curriculum_scope={self.scope!r} is unknown; use one of {CURRICULUM_SCOPES}.")


CURRICULUM_SCOPES = ("always", "ig_active")


def curriculum_weights(step: int, total_steps: int, cfg: CurriculumConfig, ig_active: bool = True) -> tuple[float, float]:
    """(w_outcome, w_ig) at ``step``; (1, 1) when the curriculum is off, or with scope ``ig_active`` while IG is off."""
    if not cfg.enabled or (cfg.scope == "ig_active" and not ig_active):
        return 1.0, 1.0
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps!r} must be positive when the curriculum is enabled.")
    p = min(max(step, 0) / total_steps, 1.0)
    return cfg.f1_init + (cfg.f1_final - cfg.f1_init) * p, cfg.ig_init + (cfg.ig_final - cfg.ig_init) * p



def group_ids(uids: Sequence[Any]) -> Tensor:
    """[B] dense group ids, one per prompt uid (any hashable), in order of first appearance."""
    ids: dict[Any, int] = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.long)


def same_outcome_share(outcome: Tensor, group: Tensor, keep: Tensor | None = None) -> float:
    """The share of prompt groups whose kept trajectories all scored the same outcome: under a group-relative
    (GRPO-style) outcome advantage such a group carries no learning signal. ``outcome`` [B], ``group`` [B] long (dense
    ids), ``keep`` [B] bool (default all); groups with no kept row are not counted. NaN when none is counted."""
    keep = torch.ones_like(group, dtype=torch.bool) if keep is None else keep
    if not bool(keep.any()):
        return float("nan")
    values, ids = outcome[keep].double(), group[keep]
    size = int(group.max()) + 1
    low = torch.full((size,), float("inf"), dtype=torch.float64).scatter_reduce(0, ids, values, "amin")
    high = torch.full((size,), float("-inf"), dtype=torch.float64).scatter_reduce(0, ids, values, "amax")
    present = torch.zeros(size, dtype=torch.bool).index_fill_(0, ids, True)
    return float((low[present] == high[present]).double().mean())
