"""The three turn-credit designs that leave the turn reward uncentred (``norm_mode`` uncentred, potential,
state_grouped; docs/methods/turn_credit.md): each checked against its formula computed here by plain loops over one
small batch, and ``std_ddof=1`` against verl's own GRPO estimator."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from igpo.core.advantage import AdvantageConfig, advantage_at_boundaries
from igpo.core.token_passes import Boundaries

EPS = 1e-6
# Two prompt groups. Each row: its turn rewards (one per tool turn, in order), its outcome, and the state (anchor)
# each turn and the final answer were taken from.
ROWS = [
    # group 0
    ([1.0, 1.0], 1.0, [0, 1, 2]),
    ([1.0], 0.0, [0, 1]),
    ([], 0.0, [0]),
    ([1.0, 0.0, 1.0], 1.0, [0, 1, 1, 2]),
    # group 1
    ([0.5, -0.25], 0.5, [0, 1, 2]),
    ([2.0], 0.0, [0, 1]),
]
GROUP = [0, 0, 0, 0, 1, 1]


def batch():
    """Boundaries (turn k of a row on token 2k, the outcome on the row's last token), the response mask, group ids."""
    rows, positions, rewards, is_f, is_i, anchors = [], [], [], [], [], []
    L = 2 * max(len(r) for r, _, _ in ROWS) + 2
    mask = torch.zeros(len(ROWS), L, dtype=torch.bool)
    for i, (turns, outcome, states) in enumerate(ROWS):
        for k, r in enumerate(turns):
            rows.append(i), positions.append(2 * k), rewards.append(r), is_f.append(False), is_i.append(True)
            anchors.append(states[k])
        last = 2 * len(turns) + 1
        rows.append(i), positions.append(last), rewards.append(outcome), is_f.append(True), is_i.append(False)
        anchors.append(states[-1])
        mask[i, :last + 1] = True
    arrays = [np.array(x) for x in (rows, positions, rewards, is_f, is_i, anchors)]
    bounds = Boundaries.at(arrays[0], arrays[1], arrays[2].astype(float), arrays[3], arrays[4], None, mask,
                           anchor=arrays[5])
    return bounds, mask, torch.tensor(GROUP)


def z_outcomes(ddof: int) -> list[float]:
    """ẑ(F) per row: (r − μ_g) / (√(Σ(r − μ_g)² / (n − ddof) + 1e-8) + ε)."""
    out = []
    for i, (_, outcome, _) in enumerate(ROWS):
        pool = [ROWS[j][1] for j in range(len(ROWS)) if GROUP[j] == GROUP[i]]
        mu = sum(pool) / len(pool)
        sigma = math.sqrt(sum((v - mu) ** 2 for v in pool) / (len(pool) - ddof) + 1e-8)
        out.append((outcome - mu) / (sigma + EPS))
    return out


def per_boundary(advantages: torch.Tensor) -> list[list[float]]:
    """Each row's advantage at its turns' tokens and at its outcome token."""
    out = []
    for i, (turns, _, _) in enumerate(ROWS):
        out.append([float(advantages[i, 2 * k]) for k in range(len(turns))] + [float(advantages[i, 2 * len(turns) + 1])])
    return out


def run(cfg: AdvantageConfig):
    bounds, mask, group = batch()
    advantages, _, metrics = advantage_at_boundaries(bounds, mask, group, cfg, dtype=torch.float64)
    return per_boundary(advantages), metrics, advantages, mask


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("gamma, weight", [(0.95, 0.25), (1.0, 1.0), (0.5, 2.0)])
def test_uncentred_adds_the_weighted_raw_turn_rewards_to_the_outcome_z_score_and_discounts(gamma, weight, ddof):
    got, metrics, _, _ = run(AdvantageConfig(norm_mode="uncentred", gamma=gamma, ig_weight=weight, std_ddof=ddof))
    z = z_outcomes(ddof)
    for i, (turns, _, _) in enumerate(ROWS):
        values = [weight * r for r in turns] + [z[i]]
        expected, acc = [], 0.0
        for v in reversed(values):
            acc = v + gamma * acc
            expected.insert(0, acc)
        assert got[i] == pytest.approx(expected, abs=1e-9)
    assert "igpo/ig_scale" not in metrics  # no batch scalar


def test_uncentred_turn_std_divides_by_the_pools_sigma_only_where_the_pool_has_spread():
    got, _, _, _ = run(AdvantageConfig(norm_mode="uncentred", gamma=1.0, turn_std=True))
    z = z_outcomes(0)
    # group 0's turn rewards: 1, 1, 1, 1, 0, 1 (spread); group 1's: 0.5, -0.25, 2.0.
    sigma = {}
    for g in (0, 1):
        pool = [r for i, (turns, _, _) in enumerate(ROWS) if GROUP[i] == g for r in turns]
        mu = sum(pool) / len(pool)
        sigma[g] = math.sqrt(sum((v - mu) ** 2 for v in pool) / len(pool) + 1e-8)
    for i, (turns, _, _) in enumerate(ROWS):
        values = [r / sigma[GROUP[i]] for r in turns] + [z[i]]
        assert got[i] == pytest.approx([sum(values[k:]) for k in range(len(values))], abs=1e-9)
    # A pool of equal rewards (σ² = 0) is left undivided, not multiplied by 10⁴ as raw_ig's division would.
    same = [([1.0], 1.0, [0, 1]), ([1.0, 1.0], 0.0, [0, 1, 2])]
    rows = np.array([0, 0, 1, 1, 1]); positions = np.array([0, 1, 0, 2, 3])
    rewards = np.array([1.0, 1.0, 1.0, 1.0, 0.0]); is_f = np.array([False, True, False, False, True])
    mask = torch.ones(2, 4, dtype=torch.bool)
    bounds = Boundaries.at(rows, positions, rewards, is_f, ~is_f, None, mask)
    cfg = AdvantageConfig(norm_mode="uncentred", gamma=1.0, turn_std=True)
    adv, _, _ = advantage_at_boundaries(bounds, mask, torch.tensor([0, 0]), cfg, dtype=torch.float64)
    assert len(same) == 2 and float(adv[1, 0]) == pytest.approx(2.0 + z_of([1.0, 0.0])[1], abs=1e-9)
    raw, _, _ = advantage_at_boundaries(bounds, mask, torch.tensor([0, 0]), AdvantageConfig(norm_mode="raw_ig"),
                                        dtype=torch.float64)
    assert float(raw[1, 0]) > 1e3  # the reference's raw_ig on the same batch


def z_of(pool: list[float]) -> list[float]:
    mu = sum(pool) / len(pool)
    sigma = math.sqrt(sum((v - mu) ** 2 for v in pool) / len(pool) + 1e-8)
    return [(v - mu) / (sigma + EPS) for v in pool]


@pytest.mark.parametrize("gamma", [0.95, 1.0])
def test_potential_is_the_outcome_z_score_plus_the_progress_still_to_come_whatever_gamma(gamma):
    got, metrics, _, _ = run(AdvantageConfig(norm_mode="potential", gamma=gamma, ig_weight=0.5))
    z = z_outcomes(0)
    for i, (turns, _, _) in enumerate(ROWS):
        expected = [z[i] + 0.5 * sum(turns[k:]) for k in range(len(turns))] + [z[i]]
        assert got[i] == pytest.approx(expected, abs=1e-9)
    assert metrics["igpo/effective_gamma_min"] == metrics["igpo/effective_gamma_max"] == 1.0


@pytest.mark.parametrize("turn_std", [False, True])
@pytest.mark.parametrize("gamma, weight", [(0.95, 1.0), (1.0, 0.25)])
def test_state_grouped_adds_the_step_returns_difference_from_its_states_mean(gamma, weight, turn_std):
    got, metrics, _, _ = run(AdvantageConfig(norm_mode="state_grouped", gamma=gamma, ig_weight=weight,
                                             turn_std=turn_std))
    z = z_outcomes(0)
    returns = []
    for turns, outcome, states in ROWS:
        values = [weight * r for r in turns] + [outcome]
        row, acc = [], 0.0
        for v in reversed(values):
            acc = v + gamma * acc
            row.insert(0, acc)
        returns.append(row)
    pools: dict[tuple[int, int], list[float]] = {}
    for i, (_, _, states) in enumerate(ROWS):
        for k, s in enumerate(states):
            pools.setdefault((GROUP[i], s), []).append(returns[i][k])
    shared = 0
    for i, (_, _, states) in enumerate(ROWS):
        expected = []
        for k, s in enumerate(states):
            pool = pools[(GROUP[i], s)]
            mu = sum(pool) / len(pool)
            step = returns[i][k] - mu if len(pool) > 1 else 0.0
            if turn_std and len(pool) > 1:
                step /= math.sqrt(sum((v - mu) ** 2 for v in pool) / len(pool) + 1e-8) + EPS
            shared += len(pool) > 1
            expected.append(z[i] + step)
        assert got[i] == pytest.approx(expected, abs=1e-9)
    total = sum(len(states) for _, _, states in ROWS)
    assert metrics["igpo/state_shared_share"] == pytest.approx(shared / total)


def test_state_grouped_without_anchors_is_refused():
    bounds, mask, group = batch()
    bounds = dataclasses.replace(bounds, anchor=None)
    with pytest.raises(ValueError, match="needs the state each turn was taken from"):
        advantage_at_boundaries(bounds, mask, group, AdvantageConfig(norm_mode="state_grouped"))


def test_sample_sigma_gives_verls_grpo_advantage_exactly_when_there_is_no_turn_reward():
    """``std_ddof=1`` makes the outcome channel verl's GRPO's (torch.std, n − 1): with the turn rewards weighted 0,
    norm_mode=potential is GRPO, token for token, against verl's own ``compute_grpo_outcome_advantage``."""
    rng = np.random.default_rng(0)
    B, L = 24, 12
    scores = rng.choice([0.0, 0.5, 1.0], size=B)
    group = torch.tensor(np.repeat(np.arange(6), 4))
    mask = torch.zeros(B, L, dtype=torch.bool)
    lengths = rng.integers(3, L + 1, size=B)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    token_rewards = torch.zeros(B, L)
    token_rewards[torch.arange(B), torch.tensor(lengths - 1)] = torch.tensor(scores, dtype=torch.float32)
    theirs, _ = compute_grpo_outcome_advantage(token_rewards, mask.float(), group.numpy(), epsilon=EPS)
    # Every answer from its own state (no two share one): state_grouped's step term is 0, its episode term GRPO's.
    bounds = Boundaries.at(np.arange(B), lengths - 1, scores, np.ones(B, bool), np.zeros(B, bool), None, mask,
                           anchor=np.arange(B))
    for mode in ("potential", "uncentred", "state_grouped"):
        ours, _, _ = advantage_at_boundaries(bounds, mask, group, AdvantageConfig(norm_mode=mode, std_ddof=1,
                                                                                gamma=1.0), dtype=torch.float32)
        assert torch.allclose(ours, theirs, atol=2e-6), (mode, (ours - theirs).abs().max())
    population, _, _ = advantage_at_boundaries(bounds, mask, group, AdvantageConfig(norm_mode="potential"),
                                               dtype=torch.float32)
    assert not torch.allclose(population, theirs, atol=1e-3)  # the default (population σ) is 15% larger at n = 4


@pytest.mark.parametrize("kwargs, message", [
    ({"norm_mode": "uncentred", "norm_order": "after_discount"}, "centres the turn rewards"),
    ({"norm_mode": "potential", "norm_group": "group_turn"}, "use norm_group=group"),
    ({"norm_mode": "potential", "turn_std": True}, "no longer telescope"),
    ({"norm_mode": "uncentred", "state_anchor": "hops"}, "read by norm_mode=state_grouped only"),
    ({"norm_mode": "state_grouped", "state_anchor": "observation"}, "one of"),
    ({"norm_mode": "state_grouped", "adaptive_gamma_min_weight": 0.5}, "set it to 0"),
    ({"std_ddof": 2}, "std_ddof=2 must be 0"),
])
def test_settings_a_design_cannot_honour_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdvantageConfig(**kwargs)
