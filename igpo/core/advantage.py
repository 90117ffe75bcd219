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

Implementation: the [B, L] work is a few passes over W-token blocks. Per-block word sums of the masks (and the
penalty's max/min) find the blocks holding a boundary or a response-mask edge; only those are gathered and resolved
token by token, giving the boundaries as index tensors. Boundaries are compacted to padded per-trajectory turn slots
[B, K_max], normalized and scanned there in float64, then written back: one constant per plain block, a gather per
token in the resolved blocks. No Python loop over samples or boundaries; the scan loops over K_max only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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


def _group_z(v: Tensor, sel: Tensor, keys: Tensor, num_keys: int, divide: bool, eps: float) -> tuple[Tensor, Tensor]:
    """ẑ(M) of slot values v [B, K] (0 outside M) and σ of every key [num_keys]; M is given as ascending flat slot
    indices ``sel`` and pooled by ``keys`` [len(sel)] (see module docstring)."""
    vals = v.reshape(-1).index_select(0, sel)
    n = torch.bincount(keys, minlength=num_keys).to(v.dtype)
    mu = torch.zeros(num_keys, dtype=v.dtype, device=v.device).index_add_(0, keys, vals) / n.clamp(min=1)
    d = vals - mu[keys]
    var = torch.zeros(num_keys, dtype=v.dtype, device=v.device).index_add_(0, keys, d * d) / n.clamp(min=1)
    sigma = torch.where(n <= 1, torch.ones_like(var), torch.sqrt(var + 1e-8))
    z = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    z.view(-1).index_copy_(0, sel, d / (sigma[keys] + eps) if divide else d)
    return z, sigma


def _discounted_scan(values: Tensor, gamma: Tensor) -> Tensor:
    """A_k = v_k + γ_i A_{k+1} over padded slots [B, K]; returns [B, K+1] with a zero last column."""
    B, K = values.shape
    out = torch.zeros(K + 1, B, dtype=values.dtype, device=values.device)
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


def _check_positions(at: dict[str, Tensor | None], rows: Tensor, B: int) -> None:
    """Value checks on the reward positions only (gathered, so they cost O(#boundaries), not O(B·L))."""
    f, i = at["F"], at["I"]
    if not bool(torch.isfinite(at["r"][f | i]).all()):
        raise ValueError("rewards contain NaN or inf at outcome/IG positions; a failed reward must be handled "
                         "upstream (e.g. a failed IG boundary is not placed), never passed to the advantage.")
    if at["P"] is not None and not bool(torch.isfinite(at["P"]).all()):
        raise ValueError("penalty contains NaN or inf.")
    if bool((f & i).any()):
        raise ValueError("outcome_mask and ig_mask overlap; a token carries either the outcome or an IG reward.")
    if not bool(at["M"].all()):
        raise ValueError("a reward position lies outside response_mask; outcome, IG and penalty positions must be "
                         "valid response tokens.")
    if bool((torch.bincount(rows[f], minlength=B) > 1).any()):
        raise ValueError("a trajectory has more than one outcome position; outcome_mask allows at most one per row.")


# Block width W (tokens): the [B, L] passes run per block (cost ∝ B·L/W) and only blocks holding a boundary or a
# response-mask edge are resolved token by token (cost ∝ #boundaries·W). Must stay below 255 so that byte-wise sums
# of bool words neither carry nor wrap mod 255 (see _block_sums and the token counts in _broadcast).
_BLOCK_TOKENS = 32


def _block_width(L: int) -> int:
    """Largest power of two ≤ _BLOCK_TOKENS dividing L, so that no block spans two rows (1 for odd L: slower only)."""
    w = _BLOCK_TOKENS
    while w > 1 and L % w:
        w //= 2
    return w


class _Arena:
    """Bump allocator for the per-block temporaries of one call, carved out of the not-yet-written output.

    Why: a fresh tensor from torch's CPU allocator is faulted in by 4 KiB pages (~0.4 ms per MiB, more than the
    passes over it cost), while the output is backed by huge pages (``_empty_tokens``). Everything taken from the
    arena is dead before the output is filled. Falls back to ordinary allocation when the output is too small.
    """

    def __init__(self, out: Tensor):
        self.buf = out.view(-1).view(torch.uint8)
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        begin = -(-self.used // 64) * 64
        if begin + nbytes > self.buf.numel():
            return torch.empty(shape, dtype=dtype, device=self.buf.device)
        self.used = begin + nbytes
        return self.buf[begin:begin + nbytes].view(dtype).view(shape)


def _words(x: Tensor) -> Tensor:
    """The bytes of each row of a contiguous [nb, W] tensor, viewed as the widest integer words that tile the row."""
    b = x.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if b.shape[1] % dtype.itemsize == 0 and b.storage_offset() % dtype.itemsize == 0:
            return b.view(dtype)
    return b


def _block_sums(x: Tensor, arena: _Arena) -> Tensor:
    """Σ of the integer words of each block of a bool [nb, W] tensor. Bytes are 0/1 and W < 256, so no byte carries
    into the next: the sum is 0 iff the block is all False, and (#words · 0x0101..) iff it is all True. The sum goes
    to the arena (see _Arena)."""
    return torch.sum(_words(x), dim=1, out=arena.take((x.shape[0],), torch.int64))


def _all_true_sum(x: Tensor) -> int:
    """_block_sums of an all-True block of x's width."""
    w = _words(x)
    return w.shape[1] * int.from_bytes(b"\x01" * w.element_size(), "little")


def _empty_tokens(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Uninitialized output. On CPU numpy allocates it: numpy advises transparent huge pages for large arrays and
    torch's allocator does not, and faulting a 32 MiB tensor in by 4 KiB pages costs ~15 ms, more than filling it."""
    np_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}.get(dtype)
    if device.type != "cpu" or np_dtype is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.empty(shape, dtype=np_dtype))


@dataclass
class _Blocks:
    """The [B, L] token grid cut into nb = B·L/W blocks of W tokens (W divides L: no block spans two rows).

    fix_idx: [n_fix] blocks holding a boundary candidate or a response-mask edge, resolved token by token;
    bits, mask: [n_fix, W] their boundary and response-mask bits; bnd_block, bnd_offset: [nnz] index into fix_idx
    and offset in the block of each boundary; mask_words: [nb] the response-mask word sums (_block_sums).
    Arena memory except fix_idx and the boundary indices: use it before the output is filled.
    """

    W: int
    fix_idx: Tensor
    bits: Tensor
    mask: Tensor
    bnd_block: Tensor
    bnd_offset: Tensor
    mask_words: Tensor


def _find_boundaries(outcome_mask: Tensor, ig_mask: Tensor, response_mask: Tensor, penalty: Tensor | None, W: int,
                     arena: _Arena) -> tuple[Tensor, _Blocks]:
    """Flat token positions [nnz] of all boundaries in row-major order, and the block structure for ``_broadcast``.

    Blocks are classified by word sums (no [B, L] temporaries); the few that hold a boundary candidate or a mask edge
    are gathered and their bits resolved exactly.
    """
    nb = outcome_mask.numel() // W
    F, I, M = (t.view(nb, W) for t in (outcome_mask, ig_mask, response_mask))
    candidate = _block_sums(F, arena).add_(_block_sums(I, arena)) != 0
    if penalty is not None:
        P = penalty.view(nb, W)
        # A block holds a penalty position iff its max or min is != 0 (NaN propagates through both, so it counts).
        candidate |= (P.amax(dim=1) != 0) | (P.amin(dim=1) != 0)
    m_sum = _block_sums(M, arena)
    fix_idx = torch.nonzero(candidate | ~((m_sum == 0) | (m_sum == _all_true_sum(M))), as_tuple=True)[0]
    n_fix = fix_idx.numel()
    bits = torch.index_select(F, 0, fix_idx, out=arena.take((n_fix, W), torch.bool))
    bits |= torch.index_select(I, 0, fix_idx, out=arena.take((n_fix, W), torch.bool))
    if penalty is not None:
        # NaN != 0: a NaN penalty becomes a boundary and fails the checks.
        bits |= torch.index_select(P, 0, fix_idx, out=arena.take((n_fix, W), P.dtype)) != 0
    blk, off = torch.nonzero(bits, as_tuple=True)
    mask = torch.index_select(M, 0, fix_idx, out=arena.take((n_fix, W), torch.bool))
    return fix_idx[blk] * W + off, _Blocks(W, fix_idx, bits, mask, blk, off, m_sum)


def _broadcast(A: Tensor, rows: Tensor, slot: Tensor, blocks: _Blocks, out: Tensor, arena: _Arena) -> Tensor:
    """Fill ``out`` [B, L]: token t of row i gets A[i, s] · response_mask with s = #boundaries of row i before t (slot
    K_i is the tail after the last boundary, A = 0). Returns the response tokens of each segment [B, K_max + 1]
    (0 for the tail), exact integers in A's dtype.

    A block without boundary or mask edge is one constant: A at the slot of its first token (an exclusive cumsum of
    boundaries per block along the row); a fix block adds the exclusive in-block count per token. Segment token
    counts are differences of the response-token prefix count C at consecutive boundaries, C = (exclusive cumsum of
    block token counts along the row) + (inclusive in-block count).
    """
    B, Kp = A.shape
    W, fix_idx, bits, fix_mask = blocks.W, blocks.fix_idx, blocks.bits, blocks.mask
    nb, dev, dtype = blocks.mask_words.shape[0], A.device, out.dtype
    R = nb // max(B, 1)
    V = A.to(dtype).reshape(-1)
    per_block = arena.take((B, R), torch.int32).zero_()
    per_block.view(-1).index_put_((fix_idx,), torch.bincount(blocks.bnd_block, minlength=fix_idx.numel()).int())
    vidx = torch.cumsum(per_block, dim=1, dtype=torch.int32, out=arena.take((B, R), torch.int32))
    vidx.sub_(per_block).add_(torch.arange(0, B * Kp, Kp, dtype=torch.int32, device=dev)[:, None])
    vidx = vidx.view(-1)
    # Fresh memory (not the arena): the fill below overwrites the arena. An empty block's A is masked to 0.
    block_val = V.index_select(0, vidx).masked_fill_(blocks.mask_words == 0, 0)
    excl = torch.cumsum(bits, dim=1, dtype=torch.int32, out=arena.take(tuple(bits.shape), torch.int32)).sub_(bits.int())
    tidx = excl.add_(vidx[fix_idx][:, None])
    fix_val = V.index_select(0, tidx.view(-1)).view_as(tidx).masked_fill_(~fix_mask, 0)

    # Byte sums of mask words have no carries, so the block's token count is their base-256 digit sum = value mod 255.
    block_tokens = torch.remainder(blocks.mask_words, 255, out=arena.take((nb,), torch.int64)).view(B, R)
    before = torch.cumsum(block_tokens, dim=1, dtype=torch.int32, out=arena.take((B, R), torch.int32))
    before = before.sub_(block_tokens).view(-1)
    in_block = torch.cumsum(fix_mask, dim=1, dtype=torch.int32, out=arena.take(tuple(fix_mask.shape), torch.int32))
    C = before[fix_idx[blocks.bnd_block]] + in_block[blocks.bnd_block, blocks.bnd_offset]
    C_prev = torch.zeros_like(C)
    C_prev[1:] = torch.where(slot[1:] > 0, C[:-1], 0)
    tokens = torch.zeros(B, Kp, dtype=A.dtype, device=dev)
    tokens[rows, slot] = (C - C_prev).to(A.dtype)

    out.view(nb, W).copy_(block_val[:, None].expand(nb, W))
    out.view(nb, W).index_copy_(0, fix_idx, fix_val)
    return tokens


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
    dev = rewards.device
    f64 = torch.float64
    rewards, outcome_mask, ig_mask, response_mask = (
        t.contiguous() for t in (rewards, outcome_mask, ig_mask, response_mask))
    penalty = penalty.contiguous() if penalty is not None else None
    out = _empty_tokens((B, L), rewards.dtype, dev)
    arena = _Arena(out)
    flat, blocks = _find_boundaries(outcome_mask, ig_mask, response_mask, penalty, _block_width(L), arena)
    at = {name: t.view(-1).index_select(0, flat) for name, t in (("r", rewards), ("F", outcome_mask),
                                                                ("I", ig_mask), ("M", response_mask))}
    at["P"] = penalty.view(-1).index_select(0, flat) if penalty is not None else None
    rows = flat // max(L, 1)
    _check_positions(at, rows, B)

    # Compact boundaries to turn slots: slot k of row i is the k-th boundary of trajectory i in token order.
    K = torch.bincount(rows, minlength=B)
    K_max = int(K.max()) if B else 0
    start = torch.cumsum(K, 0) - K
    slot = torch.arange(rows.numel(), device=dev) - start[rows]
    r = torch.zeros(B, K_max, dtype=f64, device=dev)
    r[rows, slot] = torch.where(at["F"] | at["I"], at["r"].to(f64), 0.0)
    isF = torch.zeros(B, K_max, dtype=torch.bool, device=dev)
    isF[rows, slot] = at["F"]
    isI = torch.zeros(B, K_max, dtype=torch.bool, device=dev)
    isI[rows, slot] = at["I"]
    isP = torch.zeros(B, K_max, dtype=torch.bool, device=dev)
    pen = torch.zeros(B, K_max, dtype=f64, device=dev)
    if penalty is not None:
        pen[rows, slot] = at["P"].to(f64)
        isP = pen != 0

    _, g = torch.unique(group, return_inverse=True)
    num_groups = int(g.max()) + 1 if B else 0
    g_key = g[:, None].expand(B, K_max)
    if cfg.norm_group == "group_turn":
        ordinal = torch.cumsum(isI.long(), dim=1) - 1
        i_key, i_keys = g_key * max(K_max, 1) + ordinal.clamp(min=0), num_groups * max(K_max, 1)
    else:
        i_key, i_keys = g_key, num_groups

    # Flat slot indices (ascending) of the F, I and F ∪ I slots: one nonzero each instead of one per masked read.
    slot_flat = rows * K_max + slot
    sel_F, sel_I, sel_FI = (slot_flat[x] for x in (at["F"], at["I"], at["F"] | at["I"]))
    keys_F, keys_FI = g[sel_F // max(K_max, 1)], g[sel_FI // max(K_max, 1)]
    keys_I = i_key.reshape(-1).index_select(0, sel_I)

    raw_ig = cfg.norm_mode == "raw_ig"
    gamma = torch.full((B,), 0.0 if raw_ig else cfg.gamma, dtype=f64, device=dev)
    if cfg.adaptive_gamma_min_weight > 0 and not raw_ig:
        adaptive = cfg.adaptive_gamma_min_weight ** (1.0 / K.clamp(min=1).to(f64))
        gamma = torch.where(K > 1, adaptive, gamma)

    metrics: dict[str, float] = {}

    def normalize(v: Tensor) -> Tensor:
        """N over slots from values v at F and I slots: mode, then ig_weight and curriculum weights."""
        eps, divide = cfg.epsilon, cfg.norm_adv_by_std
        N = torch.zeros_like(v)
        if cfg.norm_mode == "joint":
            z, _ = _group_z(v, sel_FI, keys_FI, num_groups, divide, eps)
            N = torch.where(isF | isI, z, N)
            zF, zI = torch.where(isF, z, N), torch.where(isI, z, N)
        else:
            zF, _ = _group_z(v, sel_F, keys_F, num_groups, divide, eps)
            if raw_ig:
                _, sigma = _group_z(v, sel_I, keys_I, i_keys, True, eps)
                sigma_I = sigma[i_key]
                outcome_of_row = zF.sum(dim=1, keepdim=True)  # at most one F slot per row
                zI = torch.where(isI, v / (sigma_I + eps) * cfg.ig_weight + outcome_of_row, N)
                if sel_I.numel():
                    ig_over_std = (v / (sigma_I + eps)).reshape(-1)[sel_I]
                    metrics["igpo/ig_mean_over_std"] = float(ig_over_std.mean())
            else:
                zI, _ = _group_z(v, sel_I, keys_I, i_keys, divide, eps)
            if cfg.norm_mode == "scaled_separate":
                zF_abs_mean = float(zF.view(-1)[sel_F].abs().mean()) if sel_F.numel() else None
                num = max(zF_abs_mean, cfg.scale_floor) if zF_abs_mean is not None else 1.0
                den = float(zI.view(-1)[sel_I].abs().mean()) + eps if sel_I.numel() else 1.0
                scale = min(num / den, cfg.scale_cap)
                metrics["igpo/ig_scale"] = scale
                metrics["igpo/outcome_norm_abs_mean"] = zF_abs_mean if zF_abs_mean is not None else 0.0
                zI = zI * scale
                metrics["igpo/ig_norm_abs_mean"] = float(zI.view(-1)[sel_I].abs().mean()) if sel_I.numel() else 0.0
            N = torch.where(isF, zF, torch.where(isI, zI, N))
        if not raw_ig:
            N = torch.where(isI, N * cfg.ig_weight, N)
        return torch.where(isF, N * outcome_weight, torch.where(isI, N * ig_weight_schedule, N))

    if cfg.norm_order == "before_discount":
        A = _discounted_scan(normalize(r) + pen, gamma)
    else:
        returns_raw = _discounted_scan(torch.where(isF | isI, r, torch.zeros_like(r)), gamma)[:, :K_max]
        A = torch.zeros(B, K_max + 1, dtype=f64, device=dev)
        A[:, :K_max] = normalize(returns_raw)
        A = A + _discounted_scan(pen, gamma)
    if not bool(torch.isfinite(A).all()):
        raise RuntimeError("IGPO advantage became non-finite (overflow in rewards or weights); refusing to return NaN.")

    tokens = _broadcast(A, rows, slot, blocks, out, arena)
    advantages = out

    # Metrics (§2.7), computed on the slot tensors; token statistics through per-segment token counts.
    _metrics_into(metrics, r, isF, isI, isP, sel_F, sel_I, g, num_groups, K, gamma, A, tokens)
    return advantages, advantages, metrics


def _metrics_into(metrics, r, isF, isI, isP, sel_F, sel_I, g, num_groups, K, gamma, A, tokens):
    B = r.shape[0]
    ig_vals = r.view(-1)[sel_I]
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
    outcome = r.view(-1)[sel_F]
    metrics["igpo/outcome_reward_mean"] = float(outcome.mean()) if outcome.numel() else 0.0
    # Groups with more than one outcome whose outcomes are all equal: GRPO gives them no signal, IG still does.
    og = g[sel_F // max(isF.shape[1], 1)]
    n = torch.bincount(og, minlength=num_groups).to(r.dtype)
    mu = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, og, outcome) / n.clamp(min=1)
    var = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, og, (outcome - mu[og]) ** 2)
    var = var / n.clamp(min=1)
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
    if sel_I.numel():
        metrics["igpo/adv_ig_positions_mean"] = float(A[:, :K_max].reshape(-1)[sel_I].mean())
    if sel_F.numel():
        metrics["igpo/adv_f1_positions_mean"] = float(A[:, :K_max].reshape(-1)[sel_F].mean())


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
