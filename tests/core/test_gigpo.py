"""igpo.core.gigpo against verl-agent's own functions (tests/golden/gigpo_reference.json, written by
scripts/golden/golden_gigpo.py from its gigpo/core_gigpo.py), and unit tests of the formulas worked out by hand."""

import json
import math
from pathlib import Path

import pytest
import torch

from igpo.core.gigpo import (GiGPOConfig, GiGPOInputs, discounted_returns, episode_advantage, gigpo_advantage,
                             step_advantage, step_groups)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((REPO / "tests" / "golden" / "gigpo_reference.json").read_text())
TOLERANCE = 1e-6


def inputs_of(trajectories: list[dict]) -> GiGPOInputs:
    """The golden case's trajectories as our tensors (anchor strings -> ids, equal strings equal ids)."""
    B, T = len(trajectories), max(t["num_turns"] for t in trajectories)
    rows = torch.zeros(B, T, dtype=torch.bool)
    invalid = torch.zeros(B, T, dtype=torch.bool)
    anchor = torch.full((B, T), -1, dtype=torch.long)
    ids: dict[str, int] = {}
    for i, traj in enumerate(trajectories):
        n = traj["num_turns"]
        rows[i, :n] = torch.tensor(traj["rows"])
        invalid[i, :n] = torch.tensor(traj["invalid"])
        anchor[i, :n] = torch.tensor([ids.setdefault(a, len(ids)) for a in traj["anchors"]])
    return GiGPOInputs(outcome=torch.tensor([t["outcome"] for t in trajectories], dtype=torch.float64),
                       num_turns=torch.tensor([t["num_turns"] for t in trajectories]), rows=rows, invalid=invalid,
                       anchor=anchor, group=torch.tensor([t["group"] for t in trajectories]))


def relabel(ids: list[int]) -> list[int]:
    """Dense ids by first appearance (a partition compared as such)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(i, len(seen)) for i in ids]


def test_golden_file_covers_what_the_issue_asks():
    cases = GOLDEN["cases"]
    configs = [c["config"] for c in cases]
    assert {c["mode"] for c in configs} == {"mean_norm", "mean_std_norm"}
    assert {c["episode_pool"] for c in configs} == {"step_rows", "trajectories"}
    assert any(c["gamma"] < 1 for c in configs) and any(c["step_advantage_weight"] != 1 for c in configs)
    assert any(c["invalid_action_penalty"] > 0 for c in configs)
    sizes = [size for c in cases for size in _group_sizes(c["expected"]["step_group"])]
    assert 1 in sizes and max(sizes) >= 3, "the cases need unique and repeated anchor states"
    equal_groups = 0
    for case in cases:
        by_group: dict[int, set] = {}
        for traj in case["trajectories"]:
            by_group.setdefault(traj["group"], set()).add(traj["outcome"])
        equal_groups += sum(len(v) == 1 for v in by_group.values())
    assert equal_groups > 0
    assert any(not all(r) for c in cases for r in (t["rows"] for t in c["trajectories"])), "no masked rows"


def _group_sizes(ids: list[int]) -> list[int]:
    return [ids.count(g) for g in set(ids)]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_matches_verl_agent(case):
    cfg = GiGPOConfig(**case["config"])
    out = gigpo_advantage(inputs_of(case["trajectories"]), cfg)
    expected = case["expected"]
    rows = torch.tensor(expected["rows"], dtype=torch.long).reshape(-1, 2)
    assert int(out.step_group.ge(0).sum()) == rows.shape[0], "a different set of step rows"
    for name in ("returns", "episode", "step", "advantage"):
        ours = getattr(out, name)[rows[:, 0], rows[:, 1]]
        diff = (ours - torch.tensor(expected[name], dtype=torch.float64)).abs().max().item() if len(rows) else 0.0
        assert diff <= TOLERANCE, f"{name}: max |diff| {diff:.3g}"
    assert relabel(out.step_group[rows[:, 0], rows[:, 1]].tolist()) == relabel(expected["step_group"])


def test_golden_max_abs_diff_overall():
    """One figure for the whole file (printed with -s): the largest |ours - verl-agent| over every case and field."""
    worst, count = 0.0, 0
    for case in GOLDEN["cases"]:
        out = gigpo_advantage(inputs_of(case["trajectories"]), GiGPOConfig(**case["config"]))
        rows = torch.tensor(case["expected"]["rows"], dtype=torch.long).reshape(-1, 2)
        for name in ("returns", "episode", "step", "advantage"):
            ours = getattr(out, name)[rows[:, 0], rows[:, 1]]
            if len(rows):
                theirs = torch.tensor(case["expected"][name], dtype=torch.float64)
                worst = max(worst, (ours - theirs).abs().max().item())
                count += len(rows)
    print(f"gigpo golden: {len(GOLDEN['cases'])} cases, {count} values, max |diff| {worst:.3g}")
    assert worst <= TOLERANCE


# ---- by hand -----------------------------------------------------------------------------------------------------


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    got = discounted_returns(rewards, torch.tensor([3, 1]), gamma=0.5)
    assert torch.allclose(got, torch.tensor([[0.25, 0.5, 1.0], [2.0, 0.0, 0.0]], dtype=torch.float64))


def test_step_groups_are_per_prompt_group_and_anchor():
    anchor = torch.tensor([[0, 7], [0, 7], [0, 7]])
    group = torch.tensor([0, 0, 1])
    rows = torch.tensor([[True, True], [True, True], [True, False]])
    ids = step_groups(anchor, group, rows)
    # Same anchor in another prompt group is another step group; a row outside ``rows`` is -1.
    assert ids.tolist() == [[0, 1], [0, 1], [2, -1]]


def test_episode_advantage_counts_a_trajectory_once_per_turn_by_default():
    # Trajectory 0: 3 turns, outcome 1; trajectory 1: 1 turn, outcome 0.
    scores = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    rows = torch.tensor([[True, True, True], [True, False, False]])
    group = torch.tensor([0, 0])
    per_row = episode_advantage(scores, rows, group, pool="step_rows")
    per_traj = episode_advantage(scores, rows, group, pool="trajectories")
    assert per_row[0, 0].item() == pytest.approx(0.25) and per_row[1, 0].item() == pytest.approx(-0.75)
    assert per_traj[0, 0].item() == pytest.approx(0.5) and per_traj[1, 0].item() == pytest.approx(-0.5)
    assert per_row[1, 1:].abs().sum() == 0  # not a step row


def test_a_lone_episode_value_is_its_own_advantage_and_a_lone_step_row_gets_none():
    scores = torch.tensor([[0.7]])
    rows = torch.tensor([[True]])
    assert episode_advantage(scores, rows, torch.tensor([0])).item() == pytest.approx(0.7)  # mu 0, sigma 1
    lone = episode_advantage(scores, rows, torch.tensor([0]), mode="mean_std_norm")
    assert lone.item() == pytest.approx(0.7 / (1 + 1e-6))
    assert step_advantage(torch.tensor([[0.7]]), torch.tensor([[0]])).item() == 0.0
    assert step_advantage(torch.tensor([[0.7]]), torch.tensor([[0]]), mode="mean_std_norm").item() == 0.0


def test_mean_std_norm_uses_the_unbiased_std():
    got = step_advantage(torch.tensor([[1.0], [0.0]]), torch.tensor([[0], [0]]), mode="mean_std_norm", epsilon=0.0)
    # mean 0.5, unbiased std sqrt(0.5): (1 - 0.5) / 0.7071
    assert got[:, 0].tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])


def test_combination_with_omega_and_penalty_by_hand():
    # One prompt group of two trajectories. Traj 0: turns from q then o (2 turns), outcome 1, turn 1 malformed.
    # Traj 1: 1 turn from q, outcome 0. gamma 0.5, omega 2, c 0.1, mean_norm.
    inputs = GiGPOInputs(outcome=torch.tensor([1.0, 0.0]), num_turns=torch.tensor([2, 1]),
                         rows=torch.tensor([[True, True], [True, False]]),
                         invalid=torch.tensor([[False, True], [False, False]]),
                         anchor=torch.tensor([[0, 1], [0, 0]]), group=torch.tensor([0, 0]))
    out = gigpo_advantage(inputs, GiGPOConfig(step_advantage_weight=2.0, invalid_action_penalty=0.1, gamma=0.5))
    # episode scores: 1, 0.9, 0; mean 1.9/3
    mu = 1.9 / 3
    assert out.episode[0].tolist() == pytest.approx([1 - mu, 0.9 - mu])
    assert out.episode[1, 0].item() == pytest.approx(-mu)
    # returns: traj 0: 0.5, 1 - 0.1 = 0.9; traj 1: 0. Step group {q}: 0.5 and 0 -> +-0.25; {o}: alone -> 0.
    assert out.returns[0].tolist() == pytest.approx([0.5, 0.9])
    assert out.step[:, 0].tolist() == pytest.approx([0.25, -0.25]) and out.step[0, 1].item() == 0.0
    assert out.advantage[0, 0].item() == pytest.approx(1 - mu + 2 * 0.25)
    assert out.stats["grouped_row_share"] == pytest.approx(2 / 3)
    assert out.stats["grouped_row_share_after_first"] == 0.0  # the one later turn is alone in its state
    assert out.stats["step_group_size_max"] == 2 and out.stats["step_groups_size_1"] == 1


def test_equal_outcomes_and_equal_returns_give_zero():
    inputs = GiGPOInputs(outcome=torch.tensor([1.0, 1.0]), num_turns=torch.tensor([2, 2]),
                         rows=torch.ones(2, 2, dtype=torch.bool), invalid=torch.zeros(2, 2, dtype=torch.bool),
                         anchor=torch.tensor([[0, 1], [0, 1]]), group=torch.tensor([0, 0]))
    for mode in ("mean_norm", "mean_std_norm"):
        out = gigpo_advantage(inputs, GiGPOConfig(mode=mode, gamma=0.9))
        assert out.advantage.abs().max().item() == 0.0


def test_rows_beyond_the_turns_are_refused():
    with pytest.raises(ValueError, match="beyond num_turns"):
        GiGPOInputs(outcome=torch.zeros(1), num_turns=torch.tensor([1]), rows=torch.ones(1, 2, dtype=torch.bool),
                    invalid=torch.zeros(1, 2, dtype=torch.bool), anchor=torch.zeros(1, 2, dtype=torch.long),
                    group=torch.zeros(1, dtype=torch.long))


def test_config_refuses_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.gigpo.\['step_advantage_w'\]"):
        GiGPOConfig.from_dict({"step_advantage_w": 1.0})
    with pytest.raises(ValueError, match="algorithm.gigpo.mode='std'"):
        GiGPOConfig.from_dict({"mode": "std"})
    with pytest.raises(ValueError, match="algorithm.gigpo.anchor"):
        GiGPOConfig.from_dict({"anchor": "full"})
    with pytest.raises(ValueError, match="step_advantage_weight=-1.0"):
        GiGPOConfig.from_dict({"step_advantage_weight": -1})
    cfg = GiGPOConfig.from_dict({"step_advantage_weight": 2, "mode": None}, gamma=0.95)
    assert cfg.step_advantage_weight == 2.0 and isinstance(cfg.step_advantage_weight, float)
    assert cfg.mode == "mean_norm" and cfg.gamma == 0.95
