"""Independent slow reference of IGPO's information gain and advantage, written from docs/design/reference_igpo.md §1.2
and §2.

Per-sample Python loops in float64, one boundary at a time, in the shape of the original implementation (which
is what makes it slow). Used by the golden tests and by scripts/bench/bench_advantage.py; not part of the package.
"""

from __future__ import annotations

import math

import torch


def reference_info_gain(logprobs: list[float], scored: list[bool], num_turns: int, info_gain_type: str):
    """§1.2 recurrence for one trajectory: a list of N-1 entries, IG float or None (turn not scored)."""
    out = [None] * max(num_turns - 1, 0)
    if num_turns == 0 or not scored[0] or not math.isfinite(logprobs[0]):
        return out

    def value(lp):
        return lp if info_gain_type == "log_prob_diff" else math.exp(lp)

    v_prev = value(logprobs[0])
    for s in range(1, num_turns):
        if not scored[s]:
            continue
        lp = logprobs[s]
        if not math.isfinite(lp):
            out[s - 1] = 0.0
            continue
        v = value(lp)
        gain = v - v_prev
        if not math.isfinite(gain):
            out[s - 1] = 0.0
            continue
        out[s - 1] = gain
        v_prev = v
    return out


def _pool_stats(entries):
    """entries: list of (key, value) -> {key: (mean, sigma)} with population variance, sigma=1 for n<=1."""
    by_key = {}
    for key, val in entries:
        by_key.setdefault(key, []).append(val)
    stats = {}
    for key, vals in by_key.items():
        n = len(vals)
        mean = sum(vals) / n
        if n <= 1:
            sigma = 1.0
        else:
            sigma = math.sqrt(sum((x - mean) ** 2 for x in vals) / n + 1e-8)
        stats[key] = (mean, sigma)
    return stats


def reference_advantage(
    rewards,
    outcome_mask,
    ig_mask,
    response_mask,
    group,
    *,
    norm_mode="scaled_separate",
    gamma=0.95,
    norm_adv_by_std=True,
    ig_weight=1.0,
    adaptive_gamma_min_weight=0.0,
    epsilon=1e-6,
    norm_order="before_discount",
    norm_group="group",
    scale_floor=0.3,
    scale_cap=10.0,
    outcome_weight=1.0,
    ig_weight_schedule=1.0,
    penalty=None,
):
    """Advantages [B, L] float64 by per-sample loops (§2.1-§2.5 plus this package's documented options)."""
    B, L = rewards.shape
    r_all = rewards.double()
    groups = [int(x) for x in group.tolist()]

    # Boundaries per sample: list of [pos, kind, raw reward, penalty], kind "F", "I" or "P" (penalty only).
    samples = []
    for i in range(B):
        items = []
        row = outcome_mask[i] | ig_mask[i]
        if penalty is not None:
            row = row | (penalty[i] != 0)
        for p in torch.nonzero(row).flatten().tolist():
            f, g_ = bool(outcome_mask[i, p].item()), bool(ig_mask[i, p].item())
            pen = float(penalty[i, p].item()) if penalty is not None else 0.0
            kind = "F" if f else ("I" if g_ else "P")
            items.append([p, kind, float(r_all[i, p].item()), pen])
        samples.append(items)

    raw_ig = norm_mode == "raw_ig"

    def gamma_of(k_count):
        if raw_ig:
            return 0.0
        if adaptive_gamma_min_weight > 0 and k_count > 1:
            return adaptive_gamma_min_weight ** (1.0 / k_count)
        return gamma

    def discount(values, gam):
        acc, out = 0.0, [0.0] * len(values)
        for k in range(len(values) - 1, -1, -1):
            acc = values[k] + gam * acc
            out[k] = acc
        return out

    # Values to normalize: raw rewards, or (after_discount) per-boundary discounted raw returns.
    vals = []
    for i, items in enumerate(samples):
        raw = [it[2] if it[1] in ("F", "I") else 0.0 for it in items]
        vals.append(discount(raw, gamma_of(len(items))) if norm_order == "after_discount" else raw)

    def ig_key(i, k):
        if norm_group == "group":
            return groups[i]
        ordinal = sum(1 for it in samples[i][:k] if it[1] == "I")
        return (groups[i], ordinal)

    def z(v, stat):
        mean, sigma = stat
        return (v - mean) / (sigma + epsilon) if norm_adv_by_std else v - mean

    normed = [[0.0] * len(items) for items in samples]
    if norm_mode == "joint":
        st = _pool_stats([(groups[i], vals[i][k]) for i, it in enumerate(samples) for k, x in enumerate(it) if x[1] in "FI"])
        for i, items in enumerate(samples):
            for k, x in enumerate(items):
                if x[1] in ("F", "I"):
                    normed[i][k] = z(vals[i][k], st[groups[i]])
    else:
        stF = _pool_stats([(groups[i], vals[i][k]) for i, it in enumerate(samples) for k, x in enumerate(it) if x[1] == "F"])
        stI = _pool_stats([(ig_key(i, k), vals[i][k]) for i, it in enumerate(samples) for k, x in enumerate(it) if x[1] == "I"])
        outcome_z = [0.0] * B
        for i, items in enumerate(samples):
            for k, x in enumerate(items):
                if x[1] == "F":
                    normed[i][k] = z(vals[i][k], stF[groups[i]])
                    outcome_z[i] = normed[i][k]
        for i, items in enumerate(samples):
            for k, x in enumerate(items):
                if x[1] == "I":
                    if raw_ig:
                        sigma = stI[ig_key(i, k)][1]
                        normed[i][k] = vals[i][k] / (sigma + epsilon) * ig_weight + outcome_z[i]
                    else:
                        normed[i][k] = z(vals[i][k], stI[ig_key(i, k)])
        if norm_mode == "scaled_separate":
            f_abs = [abs(normed[i][k]) for i, it in enumerate(samples) for k, x in enumerate(it) if x[1] == "F"]
            i_abs = [abs(normed[i][k]) for i, it in enumerate(samples) for k, x in enumerate(it) if x[1] == "I"]
            numerator = max(sum(f_abs) / len(f_abs), scale_floor) if f_abs else 1.0
            denominator = sum(i_abs) / len(i_abs) + epsilon if i_abs else 1.0
            scale = min(numerator / denominator, scale_cap)
            for i, items in enumerate(samples):
                for k, x in enumerate(items):
                    if x[1] == "I":
                        normed[i][k] *= scale

    for i, items in enumerate(samples):
        for k, x in enumerate(items):
            if x[1] == "I":
                if not raw_ig:
                    normed[i][k] *= ig_weight
                normed[i][k] *= ig_weight_schedule
            elif x[1] == "F":
                normed[i][k] *= outcome_weight

    adv = torch.zeros(B, L, dtype=torch.float64)
    m = response_mask.double()
    for i, items in enumerate(samples):
        if not items:
            continue
        gam = gamma_of(len(items))
        pens = [x[3] for x in items]
        if norm_order == "before_discount":
            turn_adv = discount([normed[i][k] + pens[k] for k in range(len(items))], gam)
        else:
            pen_disc = discount(pens, gam)
            turn_adv = [normed[i][k] + pen_disc[k] for k in range(len(items))]
        prev = 0
        for k, x in enumerate(items):
            pos = x[0]
            adv[i, prev : pos + 1] = turn_adv[k] * m[i, prev : pos + 1]
            prev = pos + 1
    return adv


def random_batch(num_groups, group_size, length, max_turns, seed, *, outcome="binary", ig_none_frac=0.2,
                 ig_zero_frac=0.1, penalty_frac=0.0, empty_ig=False, padding_rows=0):
    """A random multi-turn batch in token layout: (rewards, outcome_mask, ig_mask, response_mask, group, penalty).

    Each trajectory has a random response length and 1..max_turns turns ending at distinct random tokens; the last
    turn ends at the last valid token (outcome). IG entries are sometimes absent (unscored) or exactly zero.
    """
    gen = torch.Generator().manual_seed(seed)
    B = num_groups * group_size
    rewards = torch.zeros(B, length)
    F = torch.zeros(B, length, dtype=torch.bool)
    I = torch.zeros(B, length, dtype=torch.bool)
    m = torch.zeros(B, length, dtype=torch.bool)
    pen = torch.zeros(B, length)
    group = torch.arange(num_groups).repeat_interleave(group_size) * 7 + 3  # arbitrary, non-contiguous ids
    group_outcome = torch.rand(num_groups, generator=gen).round()
    for i in range(B - padding_rows):
        turns = int(torch.randint(1, max_turns + 1, (1,), generator=gen))
        resp = int(torch.randint(min(turns + 1, length), length + 1, (1,), generator=gen))
        turns = min(turns, resp)
        m[i, :resp] = True
        ends = torch.randperm(resp - 1, generator=gen)[: turns - 1].sort().values
        if outcome == "binary":
            rewards[i, resp - 1] = float(torch.rand(1, generator=gen).round())
        elif outcome == "equal":
            rewards[i, resp - 1] = float(group_outcome[i // group_size])
        else:
            rewards[i, resp - 1] = float(torch.rand(1, generator=gen) * 2 - 0.5)
        F[i, resp - 1] = True
        for e in ends.tolist():
            u = float(torch.rand(1, generator=gen))
            if not empty_ig and u >= ig_none_frac:
                I[i, e] = True
                rewards[i, e] = 0.0 if u < ig_none_frac + ig_zero_frac else float(torch.randn(1, generator=gen) * 0.7)
            if float(torch.rand(1, generator=gen)) < penalty_frac:
                pen[i, e] = -1.0
    return rewards, F, I, m, group, (pen if penalty_frac > 0 else None)
