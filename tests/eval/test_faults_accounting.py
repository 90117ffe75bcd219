"""The counting of scripts/experiments/faults_in_flight.py (results/async/2026-12-07-faults.md): across a stopped run
and its resume, which prompt groups trained twice, were carried over from the first run, or were never trained."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "experiments"))  # the script and the comparison modules it imports

import faults_in_flight as faults  # noqa: E402


def _groups(*numbers, fetch=1):
    return [f"s{fetch:07d}p{n:09d}" for n in numbers for _ in range(faults.SAMPLES)]


def test_a_clean_resume_trains_each_fetched_group_once_and_counts_the_carried_ones():
    first = {1: _groups(0, 1), 2: _groups(2, 3)}
    second = {3: _groups(4, 5, fetch=2), 4: _groups(6, 7, fetch=3)}  # 4, 5 were in flight at the checkpoint
    counted = faults.accounting(first, second, checkpoint=2, fetched=6, completed=True)
    assert counted["groups_trained_in_two_steps"] == []
    assert counted["groups_in_flight_at_the_checkpoint_trained_by_the_resume"] == 2
    assert counted["prompts_fetched_before_the_checkpoint_not_trained_by_the_end"] == []


def test_a_group_trained_again_after_the_checkpoint_is_caught_and_a_lost_step_is_named():
    first = {1: _groups(0, 1), 2: _groups(2, 3), 3: _groups(4, 5)}  # step 3 trained after the last checkpoint
    second = {3: _groups(1, 4)}  # the resume trains group 1 again (a bug) and group 4 (its step 3 update was lost)
    counted = faults.accounting(first, second, checkpoint=2, fetched=6, completed=True)
    assert counted["groups_trained_in_two_steps"] == [_groups(1)[0]]
    assert counted["first_run_steps_after_its_checkpoint"] == [3]
    assert counted["groups_of_those_steps"] == 2
    # Group 5 was fetched before the checkpoint and trained only by the lost step 3: nobody kept its update.
    assert counted["prompts_fetched_before_the_checkpoint_not_trained_by_the_end"] == [5]


def test_step_counts_flag_a_group_cut_short():
    counts = faults.step_counts({1: _groups(0, 1) + _groups(2)[:1]}, {1: 3.0})
    assert counts["1"] == {"trajectories": 5, "groups": 3, "groups_complete": False, "infra_masked_trajectories": 3.0}
