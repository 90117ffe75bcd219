"""scripts/experiments/compare_methods.py without training: parsing verl's console lines, the seed aggregation, the
sample-efficiency line and the files it writes (the runs themselves are what `bash train_igpo.sh` does)."""

import argparse
import csv
import math
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "experiments"))

import arms  # noqa: E402
import compare_methods as compare  # noqa: E402  (the command line)
import comparison_report as report  # noqa: E402  (the outputs)
import comparison_runs as runs_io  # noqa: E402  (one run, its log)

LOG = """\
(TaskRunner pid=1) step:0 - val-core/all/f1:0.10 - val-core/all/score:0.1
(TaskRunner pid=1) step:1 - critic/score/mean:0.25 - igpo/turns_mean:2.5 - timing_s/step:4.5 - actor/grad_norm:nan
(TaskRunner pid=1) step:2 - critic/score/mean:0.5 - igpo/turns_mean:3.0 - timing_s/step:5.0
(TaskRunner pid=1) step:2 - val-core/all/f1:0.30 - num_turns/mean:np.float64(4.0)
some other line step:x
"""


def test_parse_log_merges_a_steps_training_and_validation_lines():
    steps = runs_io.parse_log(LOG)
    assert sorted(steps) == [0, 1, 2]
    assert steps[0] == {"val-core/all/f1": 0.10, "val-core/all/score": 0.1}
    assert steps[2]["val-core/all/f1"] == 0.30 and steps[2]["critic/score/mean"] == 0.5
    assert math.isnan(steps[1]["actor/grad_norm"])
    assert runs_io.tool_calls_per_trajectory(steps[2]) == 2.0
    assert math.isnan(runs_io.tool_calls_per_trajectory(steps[0]))


def _run(method, seed, tmp_path, curve, score=0.5):
    run = runs_io.Run(method, seed, tmp_path / f"{method}-s{seed}", wall_s=100.0)
    for step, f1 in curve.items():
        run.steps[step] = {"val-core/all/f1": f1}
        if step > 0:
            run.steps[step].update({"critic/score/mean": score, "igpo/turns_mean": 2.0})
    return run


def test_curves_keep_only_steps_every_seed_validated_and_sample_efficiency_is_read_from_the_mean(tmp_path):
    grpo = [_run("grpo", s, tmp_path, {0: 0.1, 2: 0.2, 4: 0.3}) for s in range(3)]
    igpo = [_run("igpo", s, tmp_path, {0: 0.1, 2: 0.2 + 0.1 * s, 4: 0.5}) for s in range(3)]
    igpo[0].steps.pop(4)  # one seed did not validate at step 4: the step is left out of the mean curve
    curve = report.mean_curve(igpo, "val-core/all/f1")
    assert list(curve) == [0, 2]
    # GRPO ends at 0.3; IGPO's mean at step 2 is 0.3 (0.2, 0.3, 0.4): reached at step 2.
    assert report.steps_to_reach(curve, 0.3) == 2
    assert report.steps_to_reach(curve, 0.31) is None
    assert report.steps_to_reach(report.mean_curve(grpo, "val-core/all/f1"), 0.05) == 2  # step 0 never counts


@pytest.fixture(autouse=True)
def no_demo_world(monkeypatch):
    """The summary names the demo world's data hash; these tests need no built world."""
    monkeypatch.setattr(report, "data_hash", lambda task="hops": f"hash-of-{task}")


def test_write_outputs_writes_the_csv_plot_and_summary(tmp_path):
    runs = {"grpo": [_run("grpo", s, tmp_path, {0: 0.1, 2: 0.2}) for s in range(3)],
            "igpo": [_run("igpo", s, tmp_path, {0: 0.1, 2: 0.1 + 0.1 * s}) for s in range(3)]}
    args = argparse.Namespace(steps=2, val_every=2, seeds=[0, 1, 2], extra=[], target=0.25, jobs=1)
    summary = report.write_outputs(tmp_path, runs, args, trajectories=8)
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert len(rows) == 12 and rows[0]["method"] == "grpo" and rows[1]["tool_calls_per_trajectory"] == "1.0000"
    assert (tmp_path / "val_f1.png").stat().st_size > 1000
    assert "| grpo | 0.100 ± 0.000 | 0.200 ± 0.000 |" in summary
    assert "| igpo | 0.100 ± 0.000 | 0.200 ± 0.100 |" in summary
    assert "IGPO's mean curve reaches it at step 2 of 2." in summary
    assert "Wall time of all 6 runs: 600 s (0.17 h)" in summary
    # Target 0.25: GRPO's seeds end at 0.2 (never), IGPO's at 0.1, 0.2, 0.3 (seed 2 at step 2; mean 0.2: not reached).
    assert "| grpo | not in 2 steps | -, -, - | 0.200 (0.200-0.200) |" in summary
    assert "| igpo | not in 2 steps | -, -, 2 | 0.200 (0.100-0.300) |" in summary
    assert summary == (tmp_path / "summary.md").read_text()


def test_unknown_method_is_refused_with_the_choices(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["compare_methods.py", "--methods", "grpo,ppo"])
    with pytest.raises(SystemExit):
        compare.main()
    assert "unknown ['ppo']; choose from grpo, igpo, infopo, gigpo, arpo" in capsys.readouterr().err


def test_trajectories_per_step_come_from_the_demo_config_and_its_overrides():
    assert compare._trajectories_per_step([]) == 64  # configs/cpu_demo.yaml: 16 prompts x 4 rollouts
    assert compare._trajectories_per_step(["data.train_batch_size=8", "actor_rollout_ref.rollout.n=2"]) == 16


def test_summary_reports_single_outcome_groups_per_step_and_pooled_information_gain_by_hop(tmp_path):
    runs = {"grpo": [_run("grpo", s, tmp_path, {0: 0.0, 1: 0.1, 2: 0.3}) for s in range(2)],
            "igpo": [_run("igpo", s, tmp_path, {0: 0.0, 1: 0.2, 2: 0.4}) for s in range(2)]}
    for method, group in runs.items():
        for seed, run in enumerate(group):
            run.steps[1]["outcome/same_outcome_group_share"] = 0.75 + 0.25 * seed
            run.steps[2]["outcome/same_outcome_group_share"] = 0.5
    # IGPO's hop 1: 30 turns at +1.0 (10% negative) and 10 at -1.0 (90%); hop 2 only in one step; a NaN mean (no
    # such turn that step) is skipped.
    runs["igpo"][0].steps[1].update({"igpo/ig_hop1_mean": 1.0, "igpo/ig_hop1_negative_share": 0.1,
                                     "igpo/ig_hop1_count": 30.0, "igpo/ig_hop2_mean": -0.5,
                                     "igpo/ig_hop2_negative_share": 1.0, "igpo/ig_hop2_count": 4.0})
    runs["igpo"][1].steps[2].update({"igpo/ig_hop1_mean": -1.0, "igpo/ig_hop1_negative_share": 0.9,
                                     "igpo/ig_hop1_count": 10.0, "igpo/ig_hop2_mean": math.nan,
                                     "igpo/ig_hop2_negative_share": math.nan, "igpo/ig_hop2_count": 0.0})
    args = argparse.Namespace(steps=2, val_every=1, seeds=[0, 1], extra=[], target=0.2, jobs=1)
    summary = report.write_outputs(tmp_path, runs, args, trajectories=8)
    assert "| grpo | step 2 | 2, 2 | 0.300 (0.300-0.300) |" in summary
    assert "| igpo | step 1 | 1, 1 | 0.400 (0.400-0.400) |" in summary
    assert "| method | step 1 | step 2 | all steps |" in summary
    assert "| grpo | 0.88 | 0.50 | 0.69 |" in summary
    assert "| igpo | 1 | 40 | +0.500 | 0.30 |" in summary  # (30 x 1.0 + 10 x -1.0) / 40; (3 + 9) / 40
    assert "| igpo | 2 | 4 | -0.500 | 1.00 |" in summary
    assert "| grpo | 1 |" not in summary  # no IG logged: no hop rows


def test_sample_efficiency_is_not_claimed_when_grpo_did_not_improve(tmp_path):
    runs = {"grpo": [_run("grpo", s, tmp_path, {0: 0.0, 2: 0.0}) for s in range(2)],
            "igpo": [_run("igpo", s, tmp_path, {0: 0.0, 2: 0.0}) for s in range(2)]}
    args = argparse.Namespace(steps=2, val_every=2, seeds=[0, 1], extra=[], target=0.25, jobs=1)
    summary = report.write_outputs(tmp_path, runs, args, trajectories=8)
    assert "Sample efficiency: not defined here: GRPO's final mean validation F1 (0.000) is not above its first" in summary
    assert "reaches it at step" not in summary


def test_the_comparisons_wall_time_counts_overlapping_runs_once_and_gaps_not_at_all(tmp_path):
    def run(started, ended, wall):
        return runs_io.Run("grpo", 0, tmp_path, wall_s=wall, intervals=[(started, ended)])

    # Two at a time: 0-100 and 10-120 overlap (120 s in all); a later session resumes at 1000-1050 (the gap does not
    # count); a run kept from before intervals were recorded adds its own wall time (30 s).
    runs = [run(10.0, 120.0, 110.0), run(0.0, 100.0, 100.0), run(1000.0, 1050.0, 50.0), run(20.0, 30.0, 10.0),
            runs_io.Run("igpo", 0, tmp_path, wall_s=30.0)]
    assert runs_io.comparison_wall_s(runs) == pytest.approx(120.0 + 50.0 + 30.0)
    assert runs_io.comparison_wall_s([run(0.0, 100.0, 100.0), run(100.0, 150.0, 50.0)]) == pytest.approx(150.0)
    # A run continued over two sessions: its two segments, the gap between them not counted.
    continued = runs_io.Run("grpo", 1, tmp_path, wall_s=150.0, intervals=[(0.0, 100.0), (5000.0, 5050.0)])
    assert runs_io.comparison_wall_s([continued, run(20.0, 120.0, 100.0)]) == pytest.approx(120.0 + 50.0)


def test_a_continued_runs_log_keeps_each_step_from_the_segment_that_trained_it_last():
    # Segment 1 validated at 0, trained 1-3 and was stopped; its last checkpoint was step 2, so segment 2 trains step
    # 3 again (different numbers) and then step 4.
    log = LOG.replace("step:2 - val-core/all/f1:0.30", "step:2 - val-core/all/f1:0.31") + (
        "(TaskRunner pid=1) step:3 - critic/score/mean:0.9 - extra/only_in_segment_1:1.0\n"
        + runs_io.RESUMED.format(2) + "\n"
        "(TaskRunner pid=2) step:3 - critic/score/mean:0.7\n"
        "(TaskRunner pid=2) step:4 - critic/score/mean:0.8\n")
    steps = runs_io.parse_log(log)
    assert sorted(steps) == [0, 1, 2, 3, 4]
    assert steps[2]["val-core/all/f1"] == 0.31 and steps[2]["critic/score/mean"] == 0.5
    assert steps[3] == {"critic/score/mean": 0.7}  # nothing of segment 1's step 3 is left
    # A resume line quoted inside another line is not a segment boundary.
    assert 3 in runs_io.parse_log("step:3 - a:1\nsaid " + runs_io.RESUMED.format(2) + "\n")


def test_a_stopped_runs_files_move_in_front_of_the_next_segment_and_join_after_it(tmp_path):
    (tmp_path / "train.log").write_text("step:1 - a:1\nstep:2 - a:2\n")
    (tmp_path / "console.log").write_text("first\n")
    (tmp_path / "interval.txt").write_text("100.0 200.0\n300.0\n")  # the second segment was stopped from outside
    stopped_at = (tmp_path / "train.log").stat().st_mtime
    for step in (1, 2, 3):  # 3: saved, then stopped before its step was logged
        _checkpoint(tmp_path, step)
    intervals = runs_io._begin_segment(tmp_path, 1)
    # Only the checkpoint the run continues from is left: verl prunes only what it saved in this segment.
    assert [p.name for p in (tmp_path / "checkpoints").glob("global_step_*")] == ["global_step_1"]
    assert intervals == [(100.0, 200.0), (300.0, pytest.approx(stopped_at, abs=0.1))]
    assert not (tmp_path / "train.log").exists() and not (tmp_path / "tool_server.log").exists()
    (tmp_path / "train.log").write_text("step:2 - a:5\n")
    (tmp_path / "console.log").write_text("second\n")
    runs_io._join_segments(tmp_path)
    assert runs_io.parse_log((tmp_path / "train.log").read_text()) == {1: {"a": 1.0}, 2: {"a": 5.0}}
    assert (tmp_path / "console.log").read_text() == "first\n" + runs_io.RESUMED.format(1) + "\nsecond\n"
    assert not list(tmp_path.glob("*.earlier"))


def _checkpoint(run, step, actor=True, state=True):
    folder = run / "checkpoints" / f"global_step_{step}"
    folder.mkdir(parents=True)
    if actor:
        (folder / "actor").mkdir()
    if state:
        (folder / "igpo_state.json").write_text("{}")


def test_a_stopped_run_continues_from_its_newest_complete_checkpoint_whose_step_it_logged(tmp_path):
    assert runs_io.resume_point(tmp_path) == 0  # never checkpointed: it starts over
    # Checkpoints at 5 (verl removed its actor files, keeping two), 10 and 15; the pointer says 15.
    _checkpoint(tmp_path, 5, actor=False)
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 15)
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("15\n")
    line = "step:{} - critic/score/mean:0.5 - timing_s/step:80.0\n"
    # Stopped while validating step 15 (saved, not yet logged): back to 10, and step 15 is trained again.
    (tmp_path / "train.log").write_text("".join(line.format(k) for k in range(1, 15)))
    assert runs_io.resume_point(tmp_path) == 10
    (tmp_path / "train.log").write_text("".join(line.format(k) for k in range(1, 17)))
    assert runs_io.resume_point(tmp_path) == 15
    # A save under way (its folder there, the pointer not yet moved to it) is not a checkpoint.
    _checkpoint(tmp_path, 20, state=False)
    (tmp_path / "train.log").write_text("".join(line.format(k) for k in range(1, 21)))
    assert runs_io.resume_point(tmp_path) == 15
    # An earlier segment's log counts, up to its resume line.
    (tmp_path / "train.log.earlier").write_text("".join(line.format(k) for k in range(1, 16))
                                               + runs_io.RESUMED.format(10) + "\n")
    (tmp_path / "train.log").write_text("".join(line.format(k) for k in range(11, 15)))
    assert runs_io.resume_point(tmp_path) == 10


def test_the_primary_measure_is_the_second_half_mean_paired_by_seed_against_grpo(tmp_path):
    # 4 steps: the second half is steps 3-4. GRPO's success there: 0.10, 0.20, 0.30 by seed; IGPO's 0.05 more at
    # every seed but seed 2 (0.10 more): differences 0.05, 0.05, 0.10.
    runs = {"grpo": [_run("grpo", s, tmp_path, {0: 0.0, 4: 0.1}) for s in range(3)],
            "igpo": [_run("igpo", s, tmp_path, {0: 0.0, 4: 0.1}) for s in range(3)]}
    for method, group in runs.items():
        for seed, run in enumerate(group):
            for step in range(1, 5):
                late = 0.1 * (seed + 1) + (method == "igpo") * (0.10 if seed == 2 else 0.05)
                run.steps.setdefault(step, {})["outcome/success_share"] = late if step > 2 else 0.5
    runs["igpo"][1].steps[1].pop("outcome/success_share")  # the first half is not read
    args = argparse.Namespace(steps=4, val_every=4, seeds=[0, 1, 2], extra=[], target=0.25, jobs=1)
    summary = report.write_outputs(tmp_path, runs, args, trajectories=8)
    assert "## Primary measure: `outcome/success_share` over steps 3-4, paired by seed against grpo" in summary
    assert "| grpo | 0.100, 0.200, 0.300 | 0.200 [-0.048, 0.448] | (the baseline) |" in summary
    # differences 0.05, 0.05, 0.10: mean 0.0667, sd 0.0289, t(0.975, 2) = 4.303: half-width 0.0717
    assert "| igpo | 0.150, 0.250, 0.400 | 0.267 [" in summary and "| +0.067 [-0.005, +0.138] (bootstrap [" in summary
    rows = list(csv.DictReader((tmp_path / "paired.csv").open()))
    assert [(r["method"], r["seed"], r["difference"]) for r in rows[3:]] == [
        ("igpo", "0", "0.0500"), ("igpo", "1", "0.0500"), ("igpo", "2", "0.1000")]
    assert (tmp_path / "train_success.png").stat().st_size > 1000
    steps = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert steps[1]["success_share"] == "0.5000" and steps[0]["success_share"] == ""


def test_a_run_missing_the_primary_metric_in_the_second_half_is_not_averaged_over_fewer_steps(tmp_path):
    run = _run("grpo", 0, tmp_path, {0: 0.0})
    run.steps.update({3: {"outcome/success_share": 0.2}, 4: {}})
    assert math.isnan(report.second_half_mean(run, "outcome/success_share", 4))
    run.steps[4]["outcome/success_share"] = 0.4
    assert report.second_half_mean(run, "outcome/success_share", 4) == pytest.approx(0.3)
    lines = report.primary_section({"grpo": [math.nan, math.nan]}, "outcome/success_share", "grpo", 4, [0, 1])
    assert "| grpo | -, - | n/a (the runs did not log `outcome/success_share`) | n/a |" in lines


def test_chain_progress_and_information_gain_by_correct_and_wrong_hop(tmp_path):
    runs = {"igpo": [_run("igpo", s, tmp_path, {0: 0.0, 1: 0.1}) for s in range(2)]}
    for seed, run in enumerate(runs["igpo"]):
        run.steps[1].update({"hop/reach1": 0.4 + 0.2 * seed, "hop/call1_right": 0.5, "hop/call1_wrong": 0.3,
                             "hop/reach2": 0.1, "hop/call2_right": 0.1, "hop/call2_wrong": 0.2,
                             "igpo/ig_hop1_right_mean": 2.0, "igpo/ig_hop1_right_count": 3.0 * (seed + 1),
                             "igpo/ig_hop1_wrong_mean": -1.0, "igpo/ig_hop1_wrong_count": 5.0,
                             "igpo/ig_hop2_right_mean": math.nan, "igpo/ig_hop2_right_count": 0.0})
    args = argparse.Namespace(steps=1, val_every=1, seeds=[0, 1], extra=[], target=0.2, jobs=1)
    summary = report.write_outputs(tmp_path, runs, args, trajectories=8)
    assert "| igpo | 1 | 0.500 | 0.500 | 0.300 |" in summary and "| igpo | 2 | 0.100 | 0.100 | 0.200 |" in summary
    assert "| igpo | 1 | right | 9 | +2.000 |" in summary and "| igpo | 1 | wrong | 10 | -1.000 |" in summary
    assert "| igpo | 2 | right |" not in summary  # no such turn: no row


def test_sampled_validation_and_the_telescoped_igpo_row_are_overrides(monkeypatch, capsys):
    assert runs_io.validation_overrides(1, 0.0) == []
    assert runs_io.validation_overrides(4, 1.0) == ["actor_rollout_ref.rollout.val_kwargs.n=4",
                                                    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                                                    "actor_rollout_ref.rollout.val_kwargs.do_sample=true"]
    assert arms.METHODS["igpo_telescoped"] == ["algorithm.adv_estimator=igpo",
                                                  "algorithm.igpo.norm_order=after_discount", "algorithm.gamma=1.0"]
    assert arms.METHODS["oracle_after_discount"] == ["algorithm.adv_estimator=oracle",
                                                        "algorithm.igpo.norm_order=after_discount"]
    monkeypatch.setattr("sys.argv", ["compare_methods.py", "--val-samples", "0"])
    with pytest.raises(SystemExit):
        compare.main()
    assert "--val-samples/--val-temperature: validation: 0 samples" in capsys.readouterr().err


def test_a_runs_overrides_name_its_validation_before_training_and_its_own_trajectory_folder(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        (tmp_path / "oracle-s3" / "train.log").write_text("(TaskRunner pid=1) step:1 - critic/score/mean:0.5\n")
        return argparse.Namespace(returncode=0, stdout="")

    monkeypatch.setattr(runs_io.subprocess, "run", fake_run)
    run = runs_io.Run("oracle", 3, tmp_path / "oracle-s3")
    runs_io.run_one(run, 1, 1, ["demo.task=chain"], 60.0, val_before=False, trajectories=True)
    overrides = calls[0][2:]
    assert "trainer.val_before_train=false" in overrides and "seed=3" in overrides
    assert f"trainer.trajectory_dir={tmp_path / 'oracle-s3' / 'trajectories'}" in overrides
    assert overrides[-1] == "demo.task=chain"  # the caller's overrides come last and win
    runs_io.run_one(run, 1, 1, [], 60.0, validation_dumps=True)
    assert "trainer.val_before_train=true" in calls[1] and not any("trajectory_dir" in c for c in calls[1])
    assert f"trainer.validation_data_dir={tmp_path / 'oracle-s3' / 'validation'}" in calls[1]


def test_peak_memory_follows_the_runs_own_process_tree_only(tmp_path):
    import os
    import subprocess

    hog = "import time; b = bytearray(150 * 2**20); time.sleep(0.8)"
    small = "import time; time.sleep(0.8)"
    mine = tmp_path / "mine"
    with runs_io.PeakMemory(mine, every_s=0.05) as memory:
        other = subprocess.Popen([sys.executable, "-S", "-c", hog], env={**os.environ, "OUTPUT_DIR": str(tmp_path / "x")})
        subprocess.run(["bash", "-c", f"{sys.executable} -S -c '{small}'"], env={**os.environ, "OUTPUT_DIR": str(mine)})
        other.wait()
    assert 0 < memory.peak_bytes < 120 * 2**20  # the other run's 150 MB is not counted
    mine.mkdir()
    with runs_io.PeakMemory(mine, every_s=0.05) as memory:
        subprocess.run(["bash", "-c", f"{sys.executable} -S -c '{hog}'"], env={**os.environ, "OUTPUT_DIR": str(mine)})
    assert memory.peak_bytes > 150 * 2**20  # a grandchild (bash -> python) is counted
    # Written while the run goes (a run stopped from outside keeps it); a later, smaller segment keeps the larger.
    assert float((mine / "peak_rss_mb.txt").read_text()) == round(memory.peak_bytes / 2**20)
    with runs_io.PeakMemory(mine, every_s=0.05) as memory:
        subprocess.run(["bash", "-c", f"{sys.executable} -S -c '{small}'"], env={**os.environ, "OUTPUT_DIR": str(mine)})
    assert 0 < memory.peak_bytes < 120 * 2**20
    assert float((mine / "peak_rss_mb.txt").read_text()) > 150


def test_runs_finishing_together_export_their_policies_one_at_a_time(tmp_path, monkeypatch):
    active, peak, done = [0], [0], []
    guard = threading.Lock()

    def export(actor_dir, target):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with guard:
            active[0] -= 1
        done.append(target)

    monkeypatch.setattr(runs_io, "export_actor", export)
    threads = [threading.Thread(target=runs_io.export_policy, args=(tmp_path / f"a{i}", tmp_path / f"m{i}"))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(done) == [tmp_path / f"m{i}" for i in range(4)] and peak[0] == 1
