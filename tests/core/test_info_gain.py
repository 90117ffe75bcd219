"""IG recurrence (vs the slow reference), boundary selection, format penalties and reward placement."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from reference_advantage import reference_advantage, reference_info_gain  # noqa: E402

from igpo.core.advantage import AdvantageConfig, advantage_at_boundaries, compute_igpo_advantage  # noqa: E402
from igpo.core.info_gain import (  # noqa: E402
    InfoGainConfig,
    reduce_alias_logprobs,
    scored_boundaries,
    turn_boundaries,
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
    cfg = InfoGainConfig(info_gain_type=ig_type, ig_tool_filter=filt, ig_compute_freq=freq, ig_turns="all")
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
    cfg = InfoGainConfig(ig_tool_filter=("visit",), ig_compute_freq=1, ig_turns="all")
    assert scored_boundaries([["search", "Visit", None, "visit"]], cfg) == [[True, False, True, False]]
    cfg = InfoGainConfig(ig_tool_filter=(), ig_compute_freq=2, ig_turns="all")
    assert scored_boundaries([["a", "b", "c", "d", "e"], []], cfg) == [[True, False, True, False, True], []]


def test_reached_rule_scores_only_after_calls_that_reached_a_tool():
    """ig_turns=reached (default): a malformed call (name None), an unknown tool, a repeated call and an
    infrastructure failure leave the next boundary unscored; ok and no_results score it."""
    names = [["search", None, "serch", "search", "search", "search", None]]
    status = [["ok", "malformed", "bad_request", "duplicate", "infra_error", "no_results", "answer"]]
    assert scored_boundaries(names, InfoGainConfig(), status) == [[True, True, False, False, False, False, True]]
    assert scored_boundaries(names, InfoGainConfig(ig_turns="all"), status) == [[True] * 7]
    with pytest.raises(ValueError, match="tool_status"):
        scored_boundaries(names, InfoGainConfig())
    with pytest.raises(ValueError, match="ig_turns"):
        InfoGainConfig(ig_turns="some")


def test_baseline_failure_gives_no_ig_and_failed_boundary_is_zero():
    cfg = InfoGainConfig(ig_tool_filter=())
    lp = torch.tensor([[float("nan"), -1.0, -0.5], [-2.0, float("nan"), -0.5]])
    scored = torch.ones(2, 3, dtype=torch.bool)
    ig, mask, stats = turn_information_gain(lp, scored, torch.tensor([3, 3]), cfg)
    assert mask.tolist() == [[False, False], [True, True]]
    # Row 1: boundary 1 failed -> IG 0, v_prev stays at the baseline; boundary 2 gains -0.5 - (-2).
    assert ig[1].tolist() == [0.0, 1.5]
    assert stats["samples_without_baseline"] == 1 and stats["ig_failed"] == 1


def test_a_sample_without_a_scored_turn_needs_no_baseline():
    # Row 0 answered at once, row 1's only tool turn is unscored: neither has a gain that a baseline would feed, so an
    # unscored (NaN) baseline is no missing baseline; row 2's scored turn lost its baseline.
    lp = torch.tensor([[float("nan"), float("nan")], [float("nan"), -1.0], [float("nan"), -1.0]])
    scored = torch.tensor([[True, False], [True, False], [True, True]])
    ig, mask, stats = turn_information_gain(lp, scored, torch.tensor([1, 2, 2]), InfoGainConfig())
    assert not bool(mask.any()) and stats["samples_without_baseline"] == 1 and stats["ig_requested"] == 1


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


def _dense_placement(ig, ig_mask, penalty, ends, outcome, outcome_pos, m):
    """The reward tensors the boundaries stand for, built token by token (the documented placement rules)."""
    B, L = m.shape
    rewards, F, I, pen = torch.zeros(B, L), torch.zeros(B, L, dtype=torch.bool), torch.zeros(B, L, dtype=torch.bool), \
        torch.zeros(B, L)
    for i in range(B):
        if outcome_pos[i] >= 0:
            F[i, outcome_pos[i]] = True
            rewards[i, outcome_pos[i]] = outcome[i]
        for j in range(ig.shape[1]):
            t = int(ends[i, j])
            if not m[i, t]:
                continue
            if ig_mask[i, j] and t != outcome_pos[i]:
                I[i, t] = True
                rewards[i, t] = ig[i, j]
            pen[i, t] = penalty[i, j]
    return rewards, F, I, pen


def test_turn_boundaries_place_ig_penalty_and_outcome():
    ig = torch.tensor([[0.0, 0.5, 7.0], [1.0, 2.0, 3.0]])
    ig_mask = torch.tensor([[True, True, False], [False, True, True]])
    penalty = torch.tensor([[0.0, 0.0, -1.0], [-1.0, 0.0, -1.0]])
    ends = torch.tensor([[0, 3, 4], [0, 4, 5]])
    m = torch.ones(2, 6, dtype=torch.bool)
    # Row 1's second turn ends on an untrained token (an empty turn): it stays a reward position, outside the mask.
    m[1, 4] = False
    b = turn_boundaries(ig, ig_mask, penalty, ends, torch.tensor([1.0, 0.0]), torch.tensor([5, 5]), m)
    assert b.flat.tolist() == [0, 3, 4, 5, 6, 10, 11]
    assert b.K.tolist() == [4, 3]
    assert b.r.tolist() == [0.0, 0.5, 0.0, 1.0, 0.0, 2.0, 0.0]  # the zero IG at token 0 keeps its position
    assert b.is_i.tolist() == [True, True, False, False, False, True, False]
    assert b.is_f.tolist() == [False, False, False, True, False, False, True]
    assert b.pen.tolist() == [0.0, 0.0, -1.0, 0.0, -1.0, 0.0, -1.0]  # row 1's turn on the outcome token: penalty joins
    assert b.in_mask.tolist() == [True] * 5 + [False, True]
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        turn_boundaries(ig, ig_mask, penalty, ends + 3, torch.zeros(2), torch.tensor([5, 5]), m)
    for bad_ends in ([[1, 1, 2], [0, 1, 2]], [[0, 3, 4], [5, 5, 1]]):  # two turns on one token (also the outcome's)
        with pytest.raises(ValueError, match="same token"):
            turn_boundaries(ig, torch.ones_like(ig_mask), penalty, torch.tensor(bad_ends), torch.zeros(2),
                            torch.tensor([5, 5]), m)
    with pytest.raises(ValueError, match="response_mask must be bool"):
        turn_boundaries(ig, ig_mask, penalty, ends, torch.zeros(2), torch.tensor([5, 5]), m.long())


def test_turn_boundaries_give_the_advantage_of_the_dense_tensors():
    gen = torch.Generator().manual_seed(31)
    B, T, L = 16, 9, 300
    ends = torch.stack([torch.randperm(L - 1, generator=gen)[:T].sort().values for _ in range(B)])
    ig = torch.randn(B, T, generator=gen)
    ig_mask = torch.rand(B, T, generator=gen) < 0.7
    penalty = torch.where(torch.rand(B, T, generator=gen) < 0.2, -0.5, 0.0)
    resp = torch.randint(L // 2, L + 1, (B,), generator=gen)
    m = torch.arange(L)[None, :] < resp[:, None]
    m &= torch.rand(B, L, generator=gen) < 0.9  # holes (tool tokens) that some turn ends fall into
    m[:3] = False  # trajectories without tokens
    has = m.any(1)
    outcome_pos = torch.where(has, (m * torch.arange(L)).argmax(1), -1)
    ends[3] = torch.linspace(0, int(outcome_pos[3]), T).long()  # its last tool turn ends on the outcome token
    outcome = torch.rand(B, generator=gen).round()
    group = torch.arange(B) // 4
    # Turn entries on untrained tokens are reward positions the dense tensors cannot carry (the dense entry refuses
    # them); compare on the turns that end on trained tokens.
    inside = m.gather(1, ends)
    ig_mask &= inside
    penalty = torch.where(inside, penalty, 0.0)
    b = turn_boundaries(ig, ig_mask, penalty, ends, outcome, outcome_pos, m)
    cfg = AdvantageConfig(norm_group="group_turn")
    adv, _, metrics = advantage_at_boundaries(b, m, group, cfg)
    rewards, F, I, pen = _dense_placement(ig, ig_mask, penalty, ends, outcome, outcome_pos, m)
    dense, _, dense_metrics = compute_igpo_advantage(rewards, F, I, m, group, cfg, penalty=pen)
    assert torch.equal(adv, dense)
    assert metrics == dense_metrics
    assert adv.abs().max() > 0


def test_chain_with_nan_logprobs_matches_reference():
    """Rollout -> IG (with NaN boundaries) -> placement -> advantage equals the per-sample reference chain."""
    B, S, L = 12, 7, 80
    cfg = InfoGainConfig(ig_tool_filter=("visit",), ig_turns="all")
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
    m = torch.arange(L)[None, :] < resp[:, None]
    outcome = torch.rand(B, generator=gen).round()
    bounds = turn_boundaries(ig.float(), ig_mask, torch.zeros(B, S - 1), ends[:, : S - 1], outcome, resp - 1, m)
    group = torch.arange(B) // 4
    adv, _, _ = advantage_at_boundaries(bounds, m, group, AdvantageConfig())
    outcome_mask = torch.zeros(B, L, dtype=torch.bool)
    outcome_mask[torch.arange(B), resp - 1] = True
    rewards = torch.zeros(B, L)
    rewards[outcome_mask] = outcome
    dense_ig_mask = torch.zeros(B, L, dtype=torch.bool)
    dense_ig_mask.view(-1)[bounds.flat[torch.from_numpy(bounds.is_i)]] = True

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


def test_ig_by_answer_seen_splits_applied_turns_and_never_reports_an_empty_mean_as_zero():
    from igpo.core.info_gain import ig_by_answer_seen

    ig = torch.tensor([[1.5, 0.0], [-0.5, 0.25]])
    mask = torch.tensor([[True, False], [True, True]])
    seen = torch.tensor([[True, True], [False, False]])
    out = ig_by_answer_seen(ig, mask, seen)
    assert out["ig_count_answer_seen"] == 1.0 and out["ig_mean_answer_seen"] == 1.5
    assert out["ig_count_answer_unseen"] == 2.0 and out["ig_mean_answer_unseen"] == pytest.approx(-0.125)
    empty = ig_by_answer_seen(ig, mask, torch.zeros_like(seen))
    assert empty["ig_count_answer_seen"] == 0.0 and math.isnan(empty["ig_mean_answer_seen"])
    with pytest.raises(ValueError, match="answer_seen must be bool"):
        ig_by_answer_seen(ig, mask, seen.float())


def test_ig_by_hop_reports_each_tool_calls_rank_and_never_an_empty_mean_as_zero():
    from igpo.core.info_gain import ig_by_hop

    ig = torch.tensor([[-0.5, -0.2, 2.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    hop = torch.tensor([[1, 2, 3], [1, 0, 0]])
    out = ig_by_hop(ig, mask, hop, max_hop=4)
    assert out["ig_hop1_count"] == 2.0 and out["ig_hop1_mean"] == pytest.approx(-0.1)
    assert out["ig_hop1_negative_share"] == 0.5 and out["ig_hop2_negative_share"] == 1.0
    assert out["ig_hop3_mean"] == pytest.approx(2.0) and out["ig_hop4_count"] == 0.0
    assert math.isnan(out["ig_hop4_mean"]) and math.isnan(out["ig_hop4_negative_share"])
    assert "ig_hop1_right_mean" not in out  # no split without the hop record
    # Split by correct and wrong hop, over the rows whose sample names its chain (row 1 does not).
    right = torch.tensor([[True, False, True], [True, False, False]])
    split = ig_by_hop(ig, mask, hop, max_hop=4, right=right, known=torch.tensor([True, False]))
    assert (split["ig_hop1_right_count"], split["ig_hop1_right_mean"]) == (1.0, -0.5)
    assert split["ig_hop1_wrong_count"] == 0.0 and math.isnan(split["ig_hop1_wrong_mean"])
    assert (split["ig_hop2_wrong_count"], split["ig_hop2_wrong_mean"]) == (1.0, pytest.approx(-0.2))
    assert split["ig_hop3_right_mean"] == pytest.approx(2.0) and split["ig_hop1_count"] == 2.0
    with pytest.raises(ValueError, match="right must be bool"):
        ig_by_hop(ig, mask, hop, right=right.long())
    with pytest.raises(ValueError, match="hop must be"):
        ig_by_hop(ig, mask, hop[:, :2])


def test_same_outcome_share_counts_groups_without_a_signal():
    from igpo.core.advantage import same_outcome_share

    outcome = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 0.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    assert same_outcome_share(outcome, group) == pytest.approx(2 / 3)
    # leaving row 3 out makes group 1 a one-row group (same outcome); a group with no kept row is not counted
    keep = torch.tensor([True, True, True, False, False, False])
    assert same_outcome_share(outcome, group, keep) == 1.0
    assert math.isnan(same_outcome_share(outcome, group, torch.zeros(6, dtype=torch.bool)))
