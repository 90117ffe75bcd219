"""A fault with groups in flight, end to end: the standalone rollout's server killed in the middle of an
``igpo_separate_async`` run (scripts/experiments/faults_in_flight.py, whose report is
results/async/2026-12-07-faults.md with every fault in both asynchronous modes).

The run must end, not wait for generations that never come; the launcher must name the process that died as an
infrastructure failure and say from which checkpoint the run goes on; and no step may have trained a group that was
cut short (every trained group has its ``rollout.n`` samples, in our trajectory log, written before verl's own end of
the step)."""

import json
import sys

import pytest

from guarded_run import REPO

sys.path.insert(0, str(REPO / "scripts" / "experiments"))  # the script and the comparison modules it imports
import faults_in_flight as faults  # noqa: E402

pytestmark = pytest.mark.e2e


def test_a_killed_standalone_rollout_ends_the_run_naming_it_and_trains_no_cut_group(tmp_path):
    result = faults.scenario("igpo_separate_async", "rollout", at=1, steps=4, out=tmp_path, timeout=600)
    first = result["first"]
    assert result["injected"] and "process(es) matching" in result["injected"], result
    assert first["exit"] not in (0, None), json.dumps(result, indent=1)  # it ended, and not as a success
    console = (tmp_path / "first.console.log").read_text()
    assert "igpo: a process of the run died (Ray actor HFRolloutServer" in console, console[-3000:]
    assert "an infrastructure failure, not a training error" in console
    checkpoint = first["checkpoint"]
    assert checkpoint is not None and checkpoint >= 1, result
    assert (f"igpo: the newest checkpoint is step {checkpoint} ({tmp_path}/run/checkpoints/global_step_{checkpoint}); "
            "to go on from it, rerun with trainer.resume_mode=auto") in console, console[-3000:]
    trained = first["trained"]
    assert trained and all(step["groups_complete"] and step["trajectories"] == faults.PROMPTS * faults.SAMPLES
                           for step in trained.values()), trained
    # Only the step in progress when the run failed can be past the newest checkpoint (its update is lost with it).
    assert max(map(int, trained)) <= checkpoint + 1, (trained, checkpoint)
