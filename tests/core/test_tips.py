"""TIPS's shaped turn rewards (igpo.core.tips): r_j = γ·Φ_{j+1} − Φ_prev per scored tool turn, Φ_last for the
terminal term, the authors' batch scale, and the config section. Checked against a loop over the turns written here;
a shift by one turn or another γ fails them."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from igpo.core.tips import TIPSConfig, batch_scale, shaped_turn_rewards

REPO = Path(__file__).resolve().parents[2]
NAN = math.nan


def loop_rewards(phi: list[float], scored: list[bool], n: int, gamma: float) -> tuple[dict[int, float], float]:
    """Per tool turn j with a reward position: γ·Φ_{j+1} − Φ_prev, by a plain loop; and Φ_last."""
    if not (scored[0] and math.isfinite(phi[0])):
        return {}, NAN
    out, prev = {}, phi[0]
    for s in range(1, n):
        if not scored[s]:
            continue
        if math.isfinite(phi[s]):
            out[s - 1] = gamma * phi[s] - prev
            prev = phi[s]
        else:
            out[s - 1] = 0.0
    return out, (prev if out else NAN)


def test_each_turn_gets_gamma_times_the_next_potential_minus_the_previous_one():
    phi = torch.tensor([[-3.0, -2.0, -0.5, -0.25, NAN], [-1.0, -4.0, NAN, -0.5, -2.0]], dtype=torch.float64)
    scored = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
    num_turns = torch.tensor([4, 5])
    for gamma in (1.0, 0.9, 0.5):
        out = shaped_turn_rewards(phi, scored, num_turns, gamma)
        for i in range(2):
            expected, last = loop_rewards(phi[i].tolist(), scored[i].tolist(), int(num_turns[i]), gamma)
            assert {j: out.reward[i, j].item() for j in range(4) if out.mask[i, j]} == pytest.approx(expected,
                                                                                                      abs=1e-15)
            assert out.terminal[i].item() == last
    # Row 0 by hand, at γ = 0.9: the turn ending at boundary 1 is rewarded 0.9·(−2) − (−3) = 1.2.
    out = shaped_turn_rewards(phi, scored, num_turns, 0.9)
    assert out.reward[0, :3].tolist() == pytest.approx([1.2, 0.9 * -0.5 + 2.0, 0.9 * -0.25 + 0.5], abs=1e-15)
    # Row 1's boundary 2 failed: a position of value 0, and turn 2 telescopes from boundary 1.
    assert out.reward[1].tolist() == pytest.approx([0.9 * -4 + 1, 0.0, 0.9 * -0.5 + 4, 0.9 * -2 + 0.5], abs=1e-15)
    assert out.stats["ig_failed"] == 1 and out.terminal.tolist() == [-0.25, -2.0]


def test_a_shift_by_one_turn_or_another_gamma_is_not_the_shaping():
    phi = torch.tensor([[-3.0, -2.0, -0.5, -0.25]], dtype=torch.float64)
    out = shaped_turn_rewards(phi, torch.ones(1, 4, dtype=torch.bool), torch.tensor([4]), 0.9)
    right = [0.9 * phi[0, j + 1].item() - phi[0, j].item() for j in range(3)]
    shifted = [0.9 * phi[0, j].item() - phi[0, j - 1].item() if j else 0.0 for j in range(3)]
    undiscounted = [phi[0, j + 1].item() - phi[0, j].item() for j in range(3)]
    assert out.reward[0].tolist() == pytest.approx(right, abs=1e-15)
    assert out.reward[0].tolist() != pytest.approx(shifted, abs=1e-6)
    assert out.reward[0].tolist() != pytest.approx(undiscounted, abs=1e-6)


def test_at_gamma_one_the_shaping_with_the_terminal_term_sums_to_minus_the_first_potential():
    torch.manual_seed(0)
    phi = -torch.rand(6, 5, dtype=torch.float64) * 4
    scored = torch.rand(6, 5) < 0.7
    scored[:, 0] = True
    scored[:, 1] = True
    num_turns = torch.tensor([5, 4, 3, 5, 2, 5])
    out = shaped_turn_rewards(phi, scored, num_turns, 1.0)
    total = out.reward.sum(1) - out.terminal
    assert total.tolist() == pytest.approx((-phi[:, 0]).tolist(), abs=1e-12)


def test_a_row_without_a_baseline_or_a_scored_turn_gets_no_shaping():
    phi = torch.tensor([[NAN, -1.0, -0.5], [-2.0, NAN, NAN], [-2.0, -1.0, -0.5]], dtype=torch.float64)
    scored = torch.tensor([[True, True, True], [True, False, False], [True, True, True]])
    out = shaped_turn_rewards(phi, scored, torch.tensor([3, 3, 1]), 1.0)
    assert not bool(out.mask.any()) and out.reward.abs().sum() == 0 and bool(out.terminal.isnan().all())
    assert out.stats["samples_without_baseline"] == 1 and out.stats["ig_requested"] == 2


def test_the_batch_scale_brings_the_mean_absolute_reward_to_the_target():
    reward = torch.tensor([[0.5, -1.5, 0.0], [2.0, 0.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    c = batch_scale(reward, mask, 0.11)
    assert c == pytest.approx(0.11 / ((0.5 + 1.5 + 2.0) / 3))  # zeros and unmasked rewards do not count
    assert batch_scale(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.11) is None


def test_inputs_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="scored must be bool"):
        shaped_turn_rewards(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool), torch.tensor([3, 3]), 1.0)
    with pytest.raises(ValueError, match="num_turns must lie in"):
        shaped_turn_rewards(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), torch.tensor([4]), 1.0)
    with pytest.raises(ValueError, match="gamma"):
        shaped_turn_rewards(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), torch.tensor([3]), 1.5)


def test_config_refuses_bad_values_and_matches_the_base_yaml():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.tips.\['gama'\]"):
        TIPSConfig.from_dict({"gama": 0.9})
    for key, bad in (("teacher", "moving"), ("refresh_every", -1), ("gamma", 1.5), ("terminal", "one"),
                     ("scale_mode", "auto"), ("scale", 0), ("norm_order", "never")):
        with pytest.raises(ValueError, match=f"algorithm.tips.{key}"):
            TIPSConfig.from_dict({key: bad})
    with pytest.raises(ValueError, match="a frozen teacher is never refreshed"):
        TIPSConfig.from_dict({"refresh_every": 10})
    assert TIPSConfig.from_dict({"gamma": 1}).gamma == 1 and TIPSConfig.from_dict({"gamma": None}) == TIPSConfig()
    section = yaml.safe_load((REPO / "configs" / "igpo_base.yaml").read_text())["algorithm"]["tips"]
    assert TIPSConfig.from_dict(section) == TIPSConfig()


def test_the_authors_alias_reduction_is_the_log_of_the_summed_probabilities():
    from igpo.core.info_gain import reduce_alias_logprobs

    values = torch.tensor([[[-1.0, -2.0, NAN], [NAN, NAN, NAN]]], dtype=torch.float64)
    alias_ok = torch.tensor([[True, True, False]])
    out = reduce_alias_logprobs(values, alias_ok, "logsumexp")
    assert out[0, 0].item() == pytest.approx(math.log(math.exp(-1.0) + math.exp(-2.0)), abs=1e-15)
    assert math.isnan(out[0, 1].item())
