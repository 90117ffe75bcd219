"""Per-turn information gain (IG) of IGPO, vectorized over the batch (docs/design/reference_igpo.md §1.2-§1.6).

Notation (per trajectory i with N_i assistant turns): boundary s (s = 0..N_i-1) is the context before the
policy generates turn s; boundary 0 is the prompt alone (the baseline). For a scored boundary s,

    l_s = (1/|G|) * sum_{j in G} log pi_theta_old(y_j | c_s, y_<j)        (mean log-prob of the ground-truth span)
    v_s = l_s                 if info_gain_type == "log_prob_diff"          (DR-Venus default)
    v_s = exp(l_s)            if info_gain_type == "prob_diff"              (paper: geometric-mean token probability)

and the IG credited to turn j = s - 1 is  IG_j = v_s - v_prev,  where v_prev is the value at the previous *valid*
scored boundary (so with a tool filter or ig_compute_freq > 1, IG_j also covers the unscored turns since then).
Rules of the reference: a non-finite or unscored baseline gives the trajectory no IG at all; a non-finite l_s at a
later scored boundary records IG_j = 0 (still a boundary) and leaves v_prev unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from igpo.core.ground_truth import ALIAS_MODES
from igpo.core.health import REACHED_STATUSES
from igpo.core.token_passes import Boundaries

INFO_GAIN_TYPES = ("log_prob_diff", "prob_diff")
IG_TURNS = ("reached", "all")
FORMAT_PENALTY_MODES = ("separate_channel", "in_ig_pool")


@dataclass(frozen=True)
class InfoGainConfig:
    """What is scored and how a boundary score becomes a per-turn reward.

    info_gain_type: ``log_prob_diff`` (DR-Venus default; differences of mean log-probs, unbounded) or ``prob_diff``
        (the paper's formula; differences of geometric-mean probabilities, in (-1, 1)).
    ig_tool_filter: lower-case tool names; a boundary s >= 1 is scored only if turn s-1 called one of them.
        Empty (our default) = every turn: each search and visit is credited with what it added. DR-Venus ships
        ``("visit",)``: search turns are credited only through the next visit.
    ig_compute_freq: score only boundaries s with s % ig_compute_freq == 0 (cost control; 1 = every boundary).
    use_format_penalty / format_penalty_scale: a malformed turn gets -scale (§1.5).
    format_penalty_mode: where a malformed tool turn's -scale goes.
        ``separate_channel`` (ours): the turn keeps its IG; -scale is added after normalization, so a penalty
            neither shifts the group's IG mean/std nor the scaled_separate batch scalar, and a malformed turn that
            gained information still gets that credit (docs/design/reference_igpo.md §10 item 5).
        ``in_ig_pool`` (reference, DR-Venus ``ray_trainer.py``): -scale REPLACES the turn's IG before normalization
            (also on a turn the tool filter left unscored) and is z-scored with the IG values: it enters μ/σ of the
            group's IG positions and the batch scale of scaled_separate.
    answer_alias: ``first`` scores the first alias (paper); ``max`` / ``mean`` reduce l_s over all aliases;
        ``logsumexp``: l_s = log Σ_a exp l_s^(a), the log-probability of any alias (TIPS's release).
    ig_turns: which turns may carry IG. ``reached`` (ours): only a turn whose tool call reached a tool and came back
        with its result (status ok or no_results); a turn that wrote no parsable call, named an unknown tool, repeated
        a call or hit an infrastructure failure has no IG position, and the next scored turn's IG is measured from
        the last scored boundary. ``all`` (reference): every turn, also one whose "observation" is our own error
        message. Why (results/collapse/2026-12-01-collapse.md): once a policy stops writing well-formed calls, every
        group has
        the same outcome, the outcome advantage is zero, and IG over malformed turns is the only signal left —
        noise the update then trains on.
    """

    info_gain_type: str = "log_prob_diff"
    ig_tool_filter: tuple[str, ...] = ()
    ig_compute_freq: int = 1
    use_format_penalty: bool = True
    format_penalty_scale: float = 1.0
    format_penalty_mode: str = "separate_channel"
    answer_alias: str = "first"
    ig_turns: str = "reached"

    def __post_init__(self):
        if self.ig_turns not in IG_TURNS:
            raise ValueError(f"ig_turns={self.ig_turns!r} is unknown; use one of {IG_TURNS} (reached: only turns whose "
                             "tool call reached a tool; all: every turn, as the reference).")
        if self.info_gain_type not in INFO_GAIN_TYPES:
            raise ValueError(f"info_gain_type={self.info_gain_type!r} is unknown; use one of {INFO_GAIN_TYPES}.")
        if isinstance(self.ig_tool_filter, str) or not all(
            isinstance(t, str) and t == t.strip().lower() and t for t in self.ig_tool_filter
        ):
            raise ValueError(
                f"ig_tool_filter={self.ig_tool_filter!r} must be a tuple of non-empty lower-case tool names "
                "(e.g. ('visit',)); use () to score every turn."
            )
        if not isinstance(self.ig_compute_freq, int) or self.ig_compute_freq < 1:
            raise ValueError(f"ig_compute_freq={self.ig_compute_freq!r} must be an integer >= 1 (1 scores every boundary).")
        if not (self.format_penalty_scale >= 0 and self.format_penalty_scale < float("inf")):
            raise ValueError(f"format_penalty_scale={self.format_penalty_scale!r} must be a finite number >= 0.")
        if self.answer_alias not in ALIAS_MODES:
            raise ValueError(f"answer_alias={self.answer_alias!r} is unknown; use one of {ALIAS_MODES}.")
        if self.format_penalty_mode not in FORMAT_PENALTY_MODES:
            raise ValueError(f"format_penalty_mode={self.format_penalty_mode!r} is unknown; use one of "
                             f"{FORMAT_PENALTY_MODES}.")


def scored_boundaries(tool_names: list[list[str | None]], cfg: InfoGainConfig,
                      tool_status: list[list[str]] | None = None) -> list[list[bool]]:
    """Which boundaries to score, per trajectory (§1.3).

    ``tool_names[i][t]`` is the tool called by turn t of trajectory i (None for an answer or malformed turn); the
    trajectory has ``len(tool_names[i])`` turns and as many boundaries. Boundary s is scored iff s == 0 (the baseline)
    or (s % ig_compute_freq == 0 and (the filter is empty or tool_names[i][s-1].lower() is in it) and, with
    ``ig_turns=reached``, turn s-1's call reached a tool: ``tool_status[i][s-1]`` in ``REACHED_STATUSES``).
    """
    if cfg.ig_turns == "reached" and tool_status is None:
        raise ValueError("scored_boundaries: ig_turns='reached' needs each turn's tool_status (the agent loop's "
                         "igpo_tool_status)")
    filt = frozenset(cfg.ig_tool_filter)
    out = []
    for i, names in enumerate(tool_names):
        statuses = tool_status[i] if tool_status is not None else []
        row = []
        for s in range(len(names)):
            if s == 0:
                row.append(True)
                continue
            prev = names[s - 1]
            tool_ok = not filt or (prev is not None and prev.lower() in filt)
            reached = cfg.ig_turns == "all" or (s - 1 < len(statuses) and statuses[s - 1] in REACHED_STATUSES)
            row.append(s % cfg.ig_compute_freq == 0 and tool_ok and reached)
        out.append(row)
    return out


def reduce_alias_logprobs(alias_logprob: Tensor, alias_mask: Tensor, mode: str) -> Tensor:
    """Reduce per-alias boundary scores l_s^(a) [B, S, A] to l_s [B, S] for ``answer_alias`` = max, mean or logsumexp
    (log Σ_a exp l_s^(a)).

    ``alias_mask[B, A]`` marks real aliases (trajectories have different alias counts). Non-finite scores of an
    alias are ignored; a boundary where every alias failed stays NaN (and is then treated as a failed boundary).
    """
    if alias_logprob.dim() != 3 or alias_mask.shape != (alias_logprob.shape[0], alias_logprob.shape[2]):
        raise ValueError(
            f"alias_logprob must be [B, S, A] and alias_mask [B, A]; got {tuple(alias_logprob.shape)} and "
            f"{tuple(alias_mask.shape)}."
        )
    ok = torch.isfinite(alias_logprob) & alias_mask[:, None, :]
    count = ok.sum(-1)
    if mode == "max":
        red = torch.where(ok, alias_logprob, torch.full_like(alias_logprob, -torch.inf)).amax(-1)
    elif mode == "mean":
        red = torch.where(ok, alias_logprob, torch.zeros_like(alias_logprob)).sum(-1) / count.clamp(min=1)
    elif mode == "logsumexp":
        red = torch.where(ok, alias_logprob, torch.full_like(alias_logprob, -torch.inf)).logsumexp(-1)
    elif mode == "first":
        red = alias_logprob[..., 0]
        return torch.where(alias_mask[:, None, 0], red, torch.full_like(red, torch.nan))
    else:
        raise ValueError(f"answer_alias={mode!r} is unknown; use one of {ALIAS_MODES}.")
    return torch.where(count > 0, red, torch.full_like(red, torch.nan))


def turn_information_gain(
    boundary_logprob: Tensor, scored: Tensor, num_turns: Tensor, cfg: InfoGainConfig
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """IG per turn from per-boundary answer log-probs (module docstring for the formula and rules).

    Args:
        boundary_logprob: [B, S] float, l_s of trajectory i at boundary s; NaN where not scored or scoring failed.
        scored: [B, S] bool, boundaries that were meant to be scored (from ``scored_boundaries``).
        num_turns: [B] long, N_i (0 for a crashed trajectory); boundaries s >= N_i are ignored.
    Returns:
        ig: [B, S-1], IG_j of turn j (measured at boundary j+1); 0 where ``ig_mask`` is False.
        ig_mask: [B, S-1] bool, turns that carry an IG reward (a zero IG is still a reward position).
        stats: ig_requested (scored non-baseline boundaries), ig_applied, ig_failed (non-finite l_s, IG set to 0),
            samples_without_baseline (samples with a scored turn whose baseline is missing or non-finite: their turns
            get no IG; a sample without a scored turn needs no baseline, and the actor does not score it).
    """
    if boundary_logprob.dim() != 2 or not torch.is_floating_point(boundary_logprob):
        raise ValueError(f"boundary_logprob must be a float [B, S] tensor; got {boundary_logprob.dtype} "
                         f"{tuple(boundary_logprob.shape)}.")
    B, S = boundary_logprob.shape
    if scored.shape != (B, S) or scored.dtype != torch.bool:
        raise ValueError(f"scored must be bool [B, S] = {(B, S)}; got {scored.dtype} {tuple(scored.shape)}.")
    if num_turns.shape != (B,) or num_turns.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_turns must be an integer [B] = ({B},) tensor; got {num_turns.dtype} {tuple(num_turns.shape)}.")
    if S < 1 or bool(((num_turns < 0) | (num_turns > S)).any()):
        raise ValueError(f"num_turns must lie in [0, S={S}] (one boundary per turn); got {num_turns.tolist()}.")

    steps = torch.arange(S, device=boundary_logprob.device)
    in_range = steps[None, :] < num_turns[:, None]
    asked = scored & in_range
    finite = torch.isfinite(boundary_logprob)
    value = boundary_logprob if cfg.info_gain_type == "log_prob_diff" else torch.exp(boundary_logprob)
    valid = asked & finite
    has_baseline = valid[:, 0]

    # Index of the latest valid boundary at or before s (-1 if none): a running max over masked step indices.
    last_valid = torch.where(valid, steps[None, :], torch.full_like(valid, -1, dtype=torch.long)).cummax(dim=1).values
    prev_idx = last_valid[:, :-1].clamp(min=0)  # for boundary s = j+1: latest valid boundary <= j
    v_prev = value.gather(1, prev_idx)
    v_now = value[:, 1:]
    ig_mask = asked[:, 1:] & has_baseline[:, None]
    ok = ig_mask & finite[:, 1:]
    ig = torch.where(ok, v_now - v_prev, torch.zeros_like(v_now))
    # A difference of finite values can still overflow; the reference treats that like a failed boundary.
    ok = ok & torch.isfinite(ig)
    ig = torch.where(ok, ig, torch.zeros_like(ig))
    stats = {
        "ig_requested": float(asked[:, 1:].sum()),
        "ig_applied": float(ig_mask.sum()),
        "ig_failed": float((ig_mask & ~ok).sum()),
        "samples_without_baseline": float((asked[:, 1:].any(dim=1) & ~has_baseline).sum()),
    }
    return ig, ig_mask, stats


def turn_format_penalty(turn_format_ok: Tensor, num_turns: Tensor, cfg: InfoGainConfig) -> tuple[Tensor, Tensor]:
    """Turn-level format penalties as their own channel (§1.5, fixing §10 item 5).

    Turns 0..N_i-2 are tool turns, turn N_i-1 is the answer turn. A malformed tool turn j gets
    ``penalty[i, j] = -format_penalty_scale``; a malformed answer turn gets ``answer_penalty[i] = -scale``.
    Everything else, and everything when ``use_format_penalty`` is off, is 0 (no penalty). The penalty is not
    mixed into the IG statistics: the advantage adds it after normalization.
    """
    if turn_format_ok.dim() != 2 or turn_format_ok.dtype != torch.bool:
        raise ValueError(f"turn_format_ok must be a bool [B, T] tensor; got {turn_format_ok.dtype} {tuple(turn_format_ok.shape)}.")
    B, T = turn_format_ok.shape
    if num_turns.shape != (B,) or bool(((num_turns < 0) | (num_turns > T)).any()):
        raise ValueError(f"num_turns must be [B] = ({B},) with values in [0, T={T}]; got {num_turns.tolist()}.")
    penalty = torch.zeros(B, T, dtype=torch.float32, device=turn_format_ok.device)
    answer_penalty = torch.zeros(B, dtype=torch.float32, device=turn_format_ok.device)
    if not cfg.use_format_penalty:
        return penalty, answer_penalty
    turn = torch.arange(T, device=turn_format_ok.device)[None, :]
    tool_turn = turn < (num_turns[:, None] - 1)
    penalty = torch.where(tool_turn & ~turn_format_ok, -cfg.format_penalty_scale, 0.0).to(torch.float32)
    has_answer = num_turns > 0
    answer_ok = turn_format_ok.gather(1, (num_turns - 1).clamp(min=0)[:, None]).squeeze(1)
    answer_penalty = torch.where(has_answer & ~answer_ok, -cfg.format_penalty_scale, 0.0).to(torch.float32)
    return penalty, answer_penalty


def penalty_into_ig_pool(ig: Tensor, ig_mask: Tensor, penalty: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``format_penalty_mode=in_ig_pool``: a penalised turn's IG becomes its penalty and is an IG position (even where
    the filter left it unscored), so it is normalized with the IG values; the separate channel is then empty.
    Returns (ig, ig_mask, penalty) of the same shapes."""
    penalised = penalty != 0
    return (torch.where(penalised, penalty.to(ig.dtype), ig), ig_mask | penalised, torch.zeros_like(penalty))


def turn_boundaries(ig: Tensor, ig_mask: Tensor, penalty: Tensor, turn_ends: Tensor, outcome: Tensor,
                    outcome_pos: Tensor, response_mask: Tensor, weight: Tensor | None = None,
                    anchor: Tensor | None = None, outcome_anchor: Tensor | None = None) -> Boundaries:
    """The advantage's reward positions from the turn ends the rollout recorded (§1.6, fixing §10 item 14): no text
    is re-parsed and no [B, L] reward tensor is built.

    Tool turn j of trajectory i ends on token ``turn_ends[i, j]`` ([B, T'] like ``ig``, ``ig_mask``, ``penalty``): its
    IG sits there where ``ig_mask`` (a zero IG included), its format penalty where ``penalty != 0``. The outcome
    ``outcome[i]`` sits on ``outcome_pos[i]`` (the last response token; -1: no tokens, no outcome). A turn entry on a
    token outside ``response_mask`` (an empty turn, whose end is the untrained end-of-turn token the loop appended)
    stays a reward position: it takes part in the group statistics and the discount of the earlier turns like the
    reference's observation-end positions, and its own segment has no trained token. On the outcome's token a turn's
    IG is dropped and its penalty joins the outcome's position. ``weight`` [B, T] (optional): each IG's weight in the
    group statistics (``igpo.core.arpo.shared_turn_weights``: 1/|S| for a turn |S| ARPO branches share); outcomes
    weigh 1. ``anchor`` [B, T] and ``outcome_anchor`` [B] (optional, together): the state each tool turn and the
    final turn were taken from (int, −1: none), for ``norm_mode=state_grouped``; a turn whose position is the
    outcome's keeps the final turn's. Raises on token indices outside the response or turn ends that do not increase.
    """
    if not (ig.shape == ig_mask.shape == penalty.shape == turn_ends.shape) or ig.dim() != 2:
        raise ValueError(f"ig, ig_mask, penalty and turn_ends must share one [B, T] shape; got {tuple(ig.shape)}, "
                         f"{tuple(ig_mask.shape)}, {tuple(penalty.shape)}, {tuple(turn_ends.shape)}.")
    for name, t in (("ig_mask", ig_mask), ("response_mask", response_mask)):
        if t.dtype != torch.bool:
            raise ValueError(f"{name} must be bool; got {t.dtype}.")
    B, L = response_mask.shape
    # Turn-level data is small: work on host arrays (numpy's per-call overhead is a fraction of torch's).
    if weight is not None and weight.shape != ig.shape:
        raise ValueError(f"weight {tuple(weight.shape)} must have the [B, T] shape of ig {tuple(ig.shape)}.")
    if (anchor is None) != (outcome_anchor is None) or (anchor is not None and (
            anchor.shape != ig.shape or outcome_anchor.shape != (B,))):
        raise ValueError(f"anchor [B, T] = {tuple(ig.shape)} and outcome_anchor [B] = ({B},) go together; got "
                         f"{None if anchor is None else tuple(anchor.shape)} and "
                         f"{None if outcome_anchor is None else tuple(outcome_anchor.shape)}.")
    ig, ig_mask, penalty, turn_ends, outcome, outcome_pos = (
        t.detach().cpu().numpy() for t in (ig, ig_mask, penalty, turn_ends, outcome, outcome_pos))
    row, col = np.nonzero(ig_mask | (penalty != 0))
    pos = turn_ends[row, col]
    if pos.size and (pos.min() < 0 or pos.max() >= L):
        raise ValueError(f"turn-end token indices must lie in [0, {L}); got min {pos.min()}, max {pos.max()}. "
                         "The rollout recorded them against a different response length.")
    # np.nonzero lists each trajectory's turns in order; their ends must increase (so no two share a token).
    stuck = np.flatnonzero((row[1:] == row[:-1]) & (pos[1:] <= pos[:-1]))
    if stuck.size:
        k = stuck[0]
        raise ValueError(f"two turns were placed on the same token or out of order: trajectory {row[k]}, turn "
                         f"{col[k]} ends on token {pos[k]} and turn {col[k + 1]} on token {pos[k + 1]}; turn-end "
                         "indices must increase within a trajectory.")
    at_outcome = pos == outcome_pos[row]
    is_i = ig_mask[row, col] & ~at_outcome
    pen = penalty[row, col].astype(np.float64)
    outcome_pen = np.bincount(row[at_outcome], weights=pen[at_outcome], minlength=B)
    keep = (is_i | (pen != 0)) & ~at_outcome
    rows_f = np.flatnonzero(outcome_pos >= 0)
    pool_weight = None
    if weight is not None:
        w = weight.detach().cpu().numpy().astype(np.float64)[row, col]
        pool_weight = np.concatenate([np.where(is_i, w, 1.0)[keep], np.ones(rows_f.size)])
    states = None
    if anchor is not None:
        a = anchor.detach().cpu().numpy().astype(np.int64)
        states = np.concatenate([a[row, col][keep], outcome_anchor.detach().cpu().numpy().astype(np.int64)[rows_f]])
    return Boundaries.at(
        rows=np.concatenate([row[keep], rows_f]),
        positions=np.concatenate([pos[keep], outcome_pos[rows_f]]),
        rewards=np.concatenate([np.where(is_i, ig[row, col], 0.0)[keep], outcome[rows_f]]),
        is_f=np.concatenate([np.zeros(int(keep.sum()), bool), np.ones(rows_f.size, bool)]),
        is_i=np.concatenate([is_i[keep], np.zeros(rows_f.size, bool)]),
        penalty=np.concatenate([pen[keep], outcome_pen[rows_f]]),
        response_mask=response_mask, weight=pool_weight, anchor=states)


def ig_by_answer_seen(ig: Tensor, ig_mask: Tensor, answer_seen: Tensor) -> dict[str, float]:
    """Does information gain track information? Mean IG of the turns whose observation contained a gold alias vs those
    whose observation did not.

    Args: ig, ig_mask [B, S-1] from ``turn_information_gain``; answer_seen [B, S-1] bool, turn j's observation
    contains an alias (``igpo.core.outcome.contains_answer``). Returns ig_mean_answer_seen / _unseen (NaN when no
    such turn carries IG: an empty mean is not a zero) and ig_count_answer_seen / _unseen.
    """
    if answer_seen.shape != ig.shape or answer_seen.dtype != torch.bool:
        raise ValueError(f"answer_seen must be bool {tuple(ig.shape)} like ig; got {answer_seen.dtype} "
                         f"{tuple(answer_seen.shape)}.")
    out = {}
    for name, rows in (("seen", ig_mask & answer_seen), ("unseen", ig_mask & ~answer_seen)):
        count = int(rows.sum())
        out[f"ig_mean_answer_{name}"] = float(ig[rows].double().mean()) if count else float("nan")
        out[f"ig_count_answer_{name}"] = float(count)
    return out


def ig_by_hop(ig: Tensor, ig_mask: Tensor, hop: Tensor, max_hop: int = 4, right: Tensor | None = None,
              known: Tensor | None = None) -> dict[str, float]:
    """Information gain of the k-th tool call of a trajectory, k = 1..``max_hop``: on a chain task, where IG credits
    a necessary step that does not yet show the answer (the first searches of a chain lower the answer's
    probability while they name only the next entity).

    Args: ig, ig_mask [B, S-1] from ``turn_information_gain``; hop [B, S-1] long, turn j's rank among the
    trajectory's tool calls (1 = its first; 0 = not a tool call); right [B, S-1] bool (optional), turn j made its
    chain's next correct hop (``TurnBatch.hop_right``), over the rows ``known`` [B] bool (default: every row) whose
    sample names its chain. Returns ig_hop<k>_mean (NaN when no such turn carries IG), ig_hop<k>_negative_share (of
    those turns, IG < 0) and ig_hop<k>_count; with ``right`` also ig_hop<k>_right_mean / _right_count and
    ig_hop<k>_wrong_mean / _wrong_count, the k-th calls that were a correct hop and those that were not.
    """
    if hop.shape != ig.shape:
        raise ValueError(f"hop must be {tuple(ig.shape)} like ig; got {tuple(hop.shape)}.")
    if right is not None and (right.shape != ig.shape or right.dtype != torch.bool):
        raise ValueError(f"right must be bool {tuple(ig.shape)} like ig; got {right.dtype} {tuple(right.shape)}.")
    out = {}
    for k in range(1, max_hop + 1):
        rows = ig_mask & (hop == k)
        count = int(rows.sum())
        values = ig[rows].double()
        out[f"ig_hop{k}_mean"] = float(values.mean()) if count else float("nan")
        out[f"ig_hop{k}_negative_share"] = float((values < 0).double().mean()) if count else float("nan")
        out[f"ig_hop{k}_count"] = float(count)
        if right is None:
            continue
        split = rows if known is None else rows & known[:, None]
        for name, part in (("right", split & right), ("wrong", split & ~right)):
            n = int(part.sum())
            out[f"ig_hop{k}_{name}_mean"] = float(ig[part].double().mean()) if n else float("nan")
            out[f"ig_hop{k}_{name}_count"] = float(n)
    return out
