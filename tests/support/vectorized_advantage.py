"""The IGPO advantage as a competent user would vectorise it in plain torch: the baseline of
scripts/bench/bench_advantage.py, beside the per-sample loop of reference_advantage.py. Not part of the package.

Same inputs as the loop (explicit outcome / IG masks, so it does not have to find the reward positions) and, for the
modes it covers (joint, separate, scaled_separate; γ fixed; before_discount; no penalties or weights), the same
result. tests/bench/test_bench_baselines.py checks it against the loop.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def vectorized_advantage(rewards, outcome_mask, ig_mask, response_mask, group, *, norm_mode="scaled_separate",
                         gamma=0.95, epsilon=1e-6, scale_floor=0.3, scale_cap=10.0):
    """Advantages [B, L] in the rewards' dtype; the turn-level math in float64."""
    B, L = rewards.shape
    hit = outcome_mask | ig_mask
    rows, cols = hit.nonzero(as_tuple=True)  # row-major: each row's boundaries in token order
    r = rewards[rows, cols].double()
    is_f = outcome_mask[rows, cols]
    _, g = torch.unique(group, return_inverse=True)
    G, key = int(g.max()) + 1, g[rows]

    def zscore(sel):  # ẑ of every boundary against the pool `sel` of its prompt group
        k, v = key[sel], r[sel]
        n = torch.bincount(k, minlength=G).double()
        mu = torch.bincount(k, weights=v, minlength=G) / n.clamp(min=1)
        var = torch.bincount(k, weights=(v - mu[k]) ** 2, minlength=G) / n.clamp(min=1)
        sigma = torch.where(n > 1, (var + 1e-8).sqrt(), torch.ones_like(var))
        return (r - mu[key]) / (sigma[key] + epsilon)

    if norm_mode == "joint":
        N = zscore(torch.ones_like(is_f))
    else:
        z_f, z_i = zscore(is_f), zscore(~is_f)
        if norm_mode == "scaled_separate":
            num = z_f[is_f].abs().mean().clamp(min=scale_floor).item() if is_f.any() else 1.0
            den = z_i[~is_f].abs().mean().item() + epsilon if (~is_f).any() else 1.0
            z_i = z_i * min(num / den, scale_cap)
        N = torch.where(is_f, z_f, z_i)

    # A_k = Σ_{j≥k} γ^{j−k} N_j: the boundaries on a [B, K_max + 1] grid (a zero column past every row's last), times
    # the [K_max + 1]² discount matrix W[j, k] = γ^{j−k} (j ≥ k).
    K = torch.bincount(rows, minlength=B)
    slot = torch.arange(rows.numel()) - (torch.cumsum(K, 0) - K)[rows]
    grid = torch.zeros(B, int(K.max()) + 1, dtype=torch.float64)
    grid[rows, slot] = N
    j = torch.arange(grid.shape[1])
    W = torch.where(j[:, None] >= j[None, :], gamma ** (j[:, None] - j[None, :]).clamp(min=0).double(), 0.0)
    A = (grid @ W).to(rewards.dtype)

    # Token t of row i is in the segment of the first boundary at or after t: the number of boundaries before t.
    segment = torch.cumsum(hit, dim=1) - hit.long()
    return A.gather(1, segment) * response_mask
