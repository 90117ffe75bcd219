"""The response runs that stock verl's estimator call records in its position pass, and the write pass that fills a
one-run row without reading the mask: kernels against the plain version (``response_runs``, the tensor path) and
against the reference loop."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import igpo.core.token_passes as token_passes
from igpo.core.advantage import (
    AdvantageConfig,
    advantage_at_boundaries,
    boundaries_from_token_rewards,
    masks_from_token_rewards,
)
from igpo.core.token_passes import response_runs, spread, token_reward_boundaries

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from reference_advantage import reference_advantage  # noqa: E402


def _runs_by_definition(mask: torch.Tensor) -> np.ndarray:
    """Per row: the set tokens' one run [t_0, t_1 + 1), (0, 0) for none, (-1, -1) for several; a loop over tokens."""
    out = []
    for row in mask.tolist():
        starts = [t for t, v in enumerate(row) if v and (t == 0 or not row[t - 1])]
        if not starts:
            out.append((0, 0))
        elif len(starts) > 1:
            out.append((-1, -1))
        else:
            end = starts[0]
            while end < len(row) and row[end]:
                end += 1
            out.append((starts[0], end))
    return np.array(out, np.int64).reshape(-1, 2)


def _layouts(L: int, seed: int) -> torch.Tensor:
    """Rows of every kind the write pass tells apart: empty, one run from token 0, one run after a prompt-like offset,
    the whole row, one token (first, last), two runs split by one token, tool spans masked out, and a run whose ends
    sit on 64-token chunk edges."""
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def row(*spans):
        m = torch.zeros(L, dtype=torch.bool)
        for a, b in spans:
            m[max(a, 0):min(b, L)] = True
        rows.append(m)

    row()
    row((0, L))
    row((0, max(1, L // 2)))
    row((L // 3, L - L // 5))
    row((0, 1))
    row((L - 1, L))
    if L >= 3:
        row((0, L // 2), (L // 2 + 1, L))
    if L >= 64:
        row((64, min(L, 192)))
        row((63, L - 1))
    for _ in range(3):
        m = torch.rand(L, generator=gen) < 0.8
        a = int(torch.randint(0, L, (1,), generator=gen))
        m[a:a + max(1, L // 7)] = False
        rows.append(m)
    return torch.stack(rows)


def _rewards(mask: torch.Tensor, seed: int, dtype=torch.float32, off_mask: bool = False) -> torch.Tensor:
    """Sparse non-zero rewards on response tokens (and, with off_mask, on a few tokens outside the mask)."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(mask.shape, generator=gen, dtype=dtype)
    keep = torch.rand(mask.shape, generator=gen) < 0.1
    inside = keep & mask
    if off_mask:
        inside |= keep & (torch.rand(mask.shape, generator=gen) < 0.2)
    return torch.where(inside, r, torch.zeros_like(r))


@pytest.mark.parametrize("L", [1, 2, 7, 63, 64, 65, 200, 1000])
def test_kernel_runs_match_the_plain_version_and_the_definition(L):
    mask = _layouts(L, seed=L)
    expected = _runs_by_definition(mask)
    assert np.array_equal(response_runs(mask), expected)
    for dtype in (torch.float32, torch.float64):
        bounds, _, _ = token_reward_boundaries(_rewards(mask, seed=L, dtype=dtype, off_mask=True), mask)
        assert np.array_equal(bounds.runs, expected), dtype
    if L >= 3:  # every kind of row occurs
        kinds = set(map(tuple, expected.tolist()))
        assert (0, 0) in kinds and (-1, -1) in kinds and any(a > 0 for a, _ in kinds)


@pytest.mark.parametrize("L", [1, 7, 64, 65, 200, 1000])
def test_positions_with_runs_match_the_tensor_path(L, monkeypatch):
    """Rewards off the mask (before a run, after it, in a hole between runs) are counted, not placed: the kernel's
    mask lookups give the tensor path's positions, count and first index."""
    mask = _layouts(L, seed=10 + L)
    _matches_the_tensor_path(_rewards(mask, seed=10 + L, off_mask=True), mask, monkeypatch)


def _matches_the_tensor_path(rewards, mask, monkeypatch):
    """token_reward_boundaries through the kernels equals the tensor path, field by field; returns the kernels'."""
    fast = token_reward_boundaries(rewards, mask)
    with monkeypatch.context() as patch:
        patch.setattr(token_passes, "_use_kernels", lambda *tensors: False)
        plain = token_reward_boundaries(rewards, mask)
    assert fast[1:] == plain[1:]
    for name in ("flat", "K"):
        assert torch.equal(getattr(fast[0], name), getattr(plain[0], name)), name
    for name in ("r", "is_f", "is_i", "in_mask", "runs"):
        assert np.array_equal(getattr(fast[0], name), getattr(plain[0], name)), name
    return fast


@pytest.mark.parametrize("L", [1, 7, 64, 65, 200, 1000])
def test_spread_by_runs_matches_the_mask_read(L):
    """The write pass with the recorded runs (one-run rows filled without the mask), without them (every row reads
    the mask) and the tensor path write the same advantages and count the same tokens per segment."""
    mask = _layouts(L, seed=20 + L)
    rewards = _rewards(mask, seed=20 + L)
    bounds, outside, _ = token_reward_boundaries(rewards, mask)
    assert outside == 0
    A = np.random.default_rng(L).normal(size=bounds.r.shape[0])
    outs = {}
    for name, runs, kernels in (("runs", bounds.runs, True), ("mask", None, True), ("tensor", bounds.runs, False)):
        bounds.runs = runs
        out = torch.zeros(mask.shape)
        if kernels:
            tokens = spread(A, bounds, mask, out)
        else:
            use = token_passes._use_kernels
            token_passes._use_kernels = lambda *tensors: False
            try:
                tokens = spread(A, bounds, mask, out)
            finally:
                token_passes._use_kernels = use
        outs[name] = (out, tokens)
    for name in ("mask", "tensor"):
        assert torch.equal(outs["runs"][0], outs[name][0]), name
        assert np.array_equal(outs["runs"][1], outs[name][1]), name
    assert torch.count_nonzero(outs["runs"][0][~mask]) == 0


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("L", [7, 65, 1000])
def test_stock_call_on_every_layout_matches_the_reference(L, use_kernels, monkeypatch):
    """Positions from token rewards, then the advantage, on rows with one run, several runs and none, against the
    reference loop on the masks of the same convention."""
    if not use_kernels:
        monkeypatch.setattr(token_passes, "_use_kernels", lambda *tensors: False)
    mask = _layouts(L, seed=30 + L)
    rewards = _rewards(mask, seed=30 + L)
    F, I = masks_from_token_rewards(rewards, mask)
    rewards = torch.where(F, (torch.arange(mask.shape[0]) % 2).float()[:, None], rewards)  # binary outcomes
    B = mask.shape[0]
    group = torch.arange(B) // 4
    cfg = AdvantageConfig(gamma=0.9)
    bounds, outside, _ = boundaries_from_token_rewards(rewards, mask)
    assert outside == 0
    adv, _, _ = advantage_at_boundaries(bounds, mask, group, cfg)
    ref = reference_advantage(rewards, F, I, mask, group, norm_mode=cfg.norm_mode, gamma=cfg.gamma)
    assert (adv.double() - ref).abs().max().item() <= 1e-5
    assert ref.abs().max() > 0


@pytest.mark.parametrize("L", [64 * 11 + 1, 4096])
def test_rewards_in_skipped_stretches_are_counted(L, monkeypatch):
    """After a chunk without response tokens the kernel tests the next chunks several at a time and skips them when
    mask and rewards are 0 there: a reward anywhere in such a stretch (after the response, in a hole between runs, in
    an empty row) is still counted off the mask with the tensor path's first index, and the rows' positions and runs
    are the tensor path's."""
    B = 4
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, :100] = True
    mask[1, :64] = True
    mask[1, 640:645] = True  # a hole of nine chunks, then a short run
    mask[3, 5:70] = True  # row 2 stays empty
    rewards = torch.zeros(B, L)
    rewards[0, 99], rewards[0, 64 * 3], rewards[0, L - 1] = 1.0, 3.0, 2.0
    rewards[1, 64 * 5 + 7], rewards[1, 642] = 4.0, 0.5
    rewards[2, 64 * 8 - 1] = 5.0
    rewards[3, 69], rewards[3, 64 * 7] = 1.0, -0.0  # -0.0 is no reward
    fast = _matches_the_tensor_path(rewards, mask, monkeypatch)
    assert fast[1] == 4 and fast[2] == 64 * 3
