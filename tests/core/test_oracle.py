"""The oracle's turn truth and hop potential (igpo.core.oracle) and its config section."""

from pathlib import Path

import pytest
import torch
import yaml

from igpo.core.oracle import OracleConfig, hop_potential, turn_truth

REPO = Path(__file__).resolve().parents[2]


def test_a_correct_hop_earns_one_another_call_the_penalty_and_a_turn_without_a_call_nothing():
    hop = torch.tensor([[True, False, False, True], [False, False, False, False]])
    called = torch.tensor([[True, True, False, True], [True, False, True, False]])
    assert turn_truth(hop, called, 0.0).tolist() == [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert turn_truth(hop, called, 0.25).tolist() == [[1.0, -0.25, 0.0, 1.0], [-0.25, 0.0, -0.25, 0.0]]


def test_a_hop_on_a_turn_without_a_tool_call_is_an_inconsistent_record():
    with pytest.raises(ValueError, match="trajectory 1, turn 0 is recorded as a correct hop but called no tool"):
        turn_truth(torch.tensor([[False], [True]]), torch.tensor([[False], [False]]), 0.0)


def test_the_potential_is_the_truth_of_the_turns_before_each_boundary_exactly():
    truth = torch.tensor([[1.0, -0.1, -0.1, 1.0, 0.0], [-0.3, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    potential = hop_potential(truth, torch.tensor([True, True]))
    for i in range(2):
        running = 0.0
        for s in range(5):
            assert potential[i, s].item() == running  # bit-exact: the sums a loop over the turns makes
            running += truth[i, s].item()


def test_a_row_whose_sample_names_no_chain_has_no_potential():
    potential = hop_potential(torch.ones(2, 3, dtype=torch.float64), torch.tensor([True, False]))
    assert potential[0].tolist() == [0.0, 1.0, 2.0] and bool(potential[1].isnan().all())


def test_config_refuses_unknown_keys_and_bad_penalties_and_matches_the_base_yaml():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.oracle.\['wrong_call_penalt'\].*"
                                         r"known keys are \['wrong_call_penalty', 'progress_unit'\]"):
        OracleConfig.from_dict({"wrong_call_penalt": 0.5})
    for bad in (-0.1, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match="algorithm.oracle.wrong_call_penalty"):
            OracleConfig.from_dict({"wrong_call_penalty": bad})
    assert OracleConfig.from_dict({"wrong_call_penalty": 1}).wrong_call_penalty == 1.0
    assert OracleConfig.from_dict({"wrong_call_penalty": None}) == OracleConfig()
    section = yaml.safe_load((REPO / "configs" / "igpo_base.yaml").read_text())["algorithm"]["oracle"]
    assert OracleConfig.from_dict(section) == OracleConfig()
