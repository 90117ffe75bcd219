"""IG recurrence (vs the slow reference), boundary selection, format penalties and token placement."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from reference_advantage import reference_advantage, reference_info_gain  # noqa: E402

from igpo.core.advantage import AdvantageConfig, compute_igpo_advantage  # noqa: E402
from igpo.core.info_gain import (  # noqa: E402
    InfoGainConfig,
    place_on_tokens,
    reduce_alias_logprobs,
    scored_boundaries,
    turn_format_penalty,
    turn_information_gain,
)

TOOLS = ["search", "visit", None, "Visit", "python"]


def _random_rollouts(B, S, seed, nan_frac=0.15):
    gen = torch.Generator().manual_seed(seed)
    num_turns = torch.randint(0, S + 1, (B,), generator=gen)
    tool_names = [[TOOLS[int(torch.randint(0, 5, (1,), generator=gen))] for _ in range(int(n))] for n in num_turns]
    lp = -torch.rand(B, S, generator=gen, dtype=torch.float64) * 4
    u = torch.rand(B, S, generator=gen)
    lp[u < nan_frac] = float("nan")
    lp[(u >= nan_frac) & (u < nan_frac + 0.03)] = -float("inf")
    return num_turns, tool_names, lp


@pytest.mark.parametrize("ig_type", ["log_prob_diff", "prob_diff"])
@pytest.mark.parametrize("filt,freq", [((), 1), (("visit",), 1), ((), 2), (("visit", "search"), 3)])
def test_recurrence_matches_reference(ig_type, filt, freq):
    B, S = 40, 9
    cfg = InfoGainConfig(info_gain_type=ig_type, ig_tool_filter=filt, ig_compute_freq=freq)
    num_turns, tool_names, lp = _random_rollouts(B, S, seed=len(filt) * 10 + freq)
    scored_lists = scored_boundaries(tool_names, cfg)
    scored = torch.zeros(B, S, dtype=torch.bool)
    for i, row in enumerate(scored_lists):
        scored[i, : len(row)] = torch.tensor(row, dtype=torch.bool)
    # Values at unscored boundaries must be ignored.
    lp_in = torch.where(scored, lp, torch.full_like(lp, 123.0))
    ig, ig_mask, stats = turn_information_gain(lp_in, scored, num_turns, cfg)
    applied = 0
    for i in range(B):
        ref = reference_info_gain(lp[i].tolist(), scored_lists[i], int(num_turns[i]), ig_type)
        for j in range(S - 1):
            expected = ref[j] if j < len(ref) else None
            assert bool(ig_mask[i, j]) == (expected is not None), (i, j)
            if expected is not None:
                applied += 1
                assert ig[i, j].item() == pytest.approx(expected, abs=1e-12)
            else:
                assert ig[i, j].item() == 0.0
    assert stats["ig_applied"] == applied > 0
    assert torch.isfinite(ig).all()


def test_scored_boundaries_rule():
    cfg = InfoGainConfig(ig_tool_filter=("visit",), ig_compute_freq=1)
    assert scored_boundaries([["search", "Visit", None, "visit"]], cfg) == [[True, False, True, False]]
    cfg = InfoGainConfig(ig_tool_filter=(), ig_compute_freq=2)
    assert scored_boundaries([["a", "b", "c", "d", "e"], []], cfg) == [[True, False, True, False, True], []]


def test_baseline_failure_gives_no_ig_and_failed_boundary_is_zero():
    cfg = InfoGainConfig(ig_tool_filter=())
    lp = torch.tensor([[float("nan"), -1.0, -0.5], [-2.0, float("nan"), -0.5]])
    scored = torch.ones(2, 3, dtype=torch.bool)
    ig, mask, stats = turn_information_gain(lp, scored, torch.tensor([3, 3]), cfg)
    assert mask.tolist() == [[False, False], [True, True]]
    # Row 1: boundary 1 failed -> IG 0, v_prev stays at the baseline; boundary 2 gains -0.5 - (-2).
    assert ig[1].tolist() == [0.0, 1.5]
    assert stats["samples_without_baseline"] == 1 and stats["ig_failed"] == 1


def test_prob_diff_uses_geometric_mean_probability():
    cfg = InfoGainConfig(info_gain_type="prob_diff", ig_tool_filter=())
    lp = torch.tensor([[math.log(0.2), math.log(0.5)]], dtype=torch.float64)
    ig, _, _ = turn_information_gain(lp, torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]), cfg)
    assert ig.item() == pytest.approx(0.3)


def test_bad_inputs():
    cfg = InfoGainConfig()
    with pytest.raises(ValueError, match="num_turns"):
        turn_information_gain(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor([4, 1]), cfg)
    with pytest.raises(ValueError, match="scored"):
        turn_information_gain(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool), torch.tensor([1, 1]), cfg)
    with pytest.raises(ValueError, match="info_gain_type"):
        InfoGainConfig(info_gain_type="kl")
    with pytest.raises(ValueError, match="ig_tool_filter"):
        InfoGainConfig(ig_tool_filter="visit")
    with pytest.raises(ValueError, match="ig_compute_freq"):
        InfoGainConfig(ig_compute_freq=0)
    with pytest.raises(ValueError, match="answer_alias"):
        InfoGainConfig(answer_alias="all")


def test_alias_reduction():
    x = torch.tensor([[[-1.0, -3.0, 0.0], [float("nan"), -2.0, 0.0], [float("nan"), float("nan"), 0.0]]])
    mask = torch.tensor([[True, True, False]])
    assert reduce_alias_logprobs(x, mask, "max")[0, :2].tolist() == [-1.0, -2.0]
    assert reduce_alias_logprobs(x, mask, "mean")[0, :2].tolist() == [-2.0, -2.0]
    assert math.isnan(reduce_alias_logprobs(x, mask, "max")[0, 2].item())
    assert reduce_alias_logprobs(x, mask, "first")[0, 0].item() == -1.0


def test_format_penalty_channel():
    ok = torch.tensor([[True, False, False, True], [True, True, False, False], [False, False, False, False]])
    cfg = InfoGainConfig(format_penalty_scale=0.5)
    pen, ans = turn_format_penalty(ok, torch.tensor([4, 3, 0]), cfg)
    assert pen.tolist() == [[0, -0.5, -0.5, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert ans.tolist() == [0.0, -0.5, 0.0]
    pen, ans = turn_format_penalty(ok, torch.tensor([4, 3, 0]), InfoGainConfig(use_format_penalty=False))
    assert not pen.any() and not ans.any()


def test_place_on_tokens():
    values = torch.tensor([[0.5, 0.0, 7.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    index = torch.tensor([[3, 0, 99], [0, 4, 5]])
    dense, dmask = place_on_tokens(values, mask, index, 6)
    assert dense.tolist() == [[0.0, 0, 0, 0.5, 0, 0], [0, 0, 0, 0, 2.0, 3.0]]
    assert dmask.nonzero().tolist() == [[0, 0], [0, 3], [1, 4], [1, 5]]  # the zero IG keeps its position
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        place_on_tokens(values, torch.ones_like(mask), index, 6)
    with pytest.raises(ValueError, match="same token"):
        place_on_tokens(values, torch.ones_like(mask), torch.tensor([[1, 1, 2], [0, 1, 2]]), 6)


def test_chain_with_nan_logprobs_matches_reference():
    """Rollout -> IG (with NaN boundaries) -> placement -> advantage equals the per-sample reference chain."""
    B, S, L = 12, 7, 80
    cfg = InfoGainConfig(ig_tool_filter=("visit",))
    num_turns, tool_names, lp = _random_rollouts(B, S, seed=99)
    num_turns = num_turns.clamp(min=1)
    tool_names = [(names + ["visit"] * S)[: int(n)] for names, n in zip(tool_names, num_turns)]
    scored_lists = scored_boundaries(tool_names, cfg)
    scored = torch.zeros(B, S, dtype=torch.bool)
    for i, row in enumerate(scored_lists):
        scored[i, : len(row)] = torch.tensor(row)
    ig, ig_mask, _ = turn_information_gain(lp, scored, num_turns, cfg)
    gen = torch.Generator().manual_seed(5)
    ends = torch.zeros(B, S, dtype=torch.long)
    resp = torch.zeros(B, dtype=torch.long)
    for i in range(B):
        n = int(num_turns[i])
        e = torch.randperm(L - 1, generator=gen)[:n].sort().values
        ends[i, :n] = e
        resp[i] = e[-1] + 1
    dense_ig, dense_ig_mask = place_on_tokens(ig.float(), ig_mask, ends[:, : S - 1], L)
    m = torch.arange(L)[None, :] < resp[:, None]
    outcome_mask = torch.zeros(B, L, dtype=torch.bool)
    outcome_mask[torch.arange(B), resp - 1] = True
    rewards = dense_ig.clone()
    rewards[outcome_mask] = torch.rand(B, generator=gen).round()
    group = torch.arange(B) // 4
    adv, _, _ = compute_igpo_advantage(rewards, outcome_mask, dense_ig_mask, m, group, AdvantageConfig())

    ref_rewards = torch.zeros(B, L, dtype=torch.float64)
    ref_ig_mask = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        for j, v in enumerate(reference_info_gain(lp[i].tolist(), scored_lists[i], int(num_turns[i]), "log_prob_diff")):
            if v is not None:
                ref_rewards[i, ends[i, j]] = v
                ref_ig_mask[i, ends[i, j]] = True
    ref_rewards[outcome_mask] = rewards[outcome_mask].double()
    assert torch.equal(ref_ig_mask, dense_ig_mask) and ref_ig_mask.any()
    ref = reference_advantage(ref_rewards, outcome_mask, ref_ig_mask, m, group)
    assert (adv.double() - ref).abs().max() <= 1e-5
