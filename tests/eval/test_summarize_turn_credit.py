"""scripts/experiments/summarize_turn_credit.py on the committed logs of the oracle gate's regime A
(results/turn_credit/gate_A): its figures come back to the digit from the runs' own train.log files, the repeat check
against chain_compare_v2 applies only to runs of the same batch layout, and the per-turn table reads each method's
logged turn reward."""

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("summarize_turn_credit",
                                              ROOT / "scripts" / "experiments" / "summarize_turn_credit.py")
summary = importlib.util.module_from_spec(spec)
sys.modules["summarize_turn_credit"] = summary
spec.loader.exec_module(summary)

COMMITTED = ROOT / "results" / "turn_credit"


def _summarise(tmp_path: Path, monkeypatch, comparison: str) -> str:
    folder = tmp_path / "turn_credit"
    folder.mkdir()
    for name in ("plan.md", "calibration.json", "calibration.txt"):
        shutil.copy(COMMITTED / name, folder / name)
    shutil.copytree(COMMITTED / "gate_A" / "runs", folder / comparison / "runs")
    monkeypatch.setattr("sys.argv", ["summarize_turn_credit.py", "--folder", str(folder), "--comparisons", comparison])
    summary.main()
    return (folder / "summary.md").read_text()


def test_gate_a_is_summarised_again_from_its_committed_logs(tmp_path, monkeypatch, capsys):
    text = _summarise(tmp_path, monkeypatch, "gate_A")
    committed = (COMMITTED / "summary.md").read_text()
    gate = next(line for line in committed.splitlines() if line.startswith("- Difference "))
    assert gate.startswith("- Difference -0.037 [-0.061, -0.014]") and gate in text, text
    assert "**The gate does not pass**" in text
    assert "seed 0: identical; seed 1: identical" in text  # GRPO seeds 0-1 repeat chain_compare_v2 (8x8 both)
    assert "Model digest: 607a9ea80d998160 (expected 607a9ea80d998160): **as expected**" in text
    # The per-turn table, read now from each run's kept turns.csv.gz (the trajectory logs are not in git), is the one
    # the committed summary wrote from the trajectory logs themselves.
    table = [line for line in committed.split("## What the turns did")[1].splitlines() if line.startswith("| ")]
    assert len(table) == 5 and all(line in text.split("## What the turns did")[1] for line in table), text


def test_the_repeat_check_is_not_applied_across_batch_layouts(tmp_path):
    run = tmp_path / "grpo-s0"
    run.mkdir()
    (run / "console.log").write_text("igpo: plan: CPU backend (FSDP2 on gloo, rollout hf); batch 16x4; ...\n")
    assert summary.batch_layout(run) == "16x4"
    assert summary.batch_layout(COMMITTED / "gate_A" / "runs" / "grpo-s0") == "8x8"
    assert summary.batch_layout(tmp_path) is None


def test_the_repeat_check_against_chain_compare_v2_is_not_applied_to_another_model(tmp_path):
    """A run of the same layout on another demo model (built on another CPU type, or pinned) is not a repeat of
    chain_compare_v2's; the committed gate_A run at seed 0 still is."""
    used = summary.Run("grpo", 0, COMMITTED / "gate_A" / "runs" / "grpo-s0")
    assert summary.load_finished(used, 12)
    assert summary.earlier_repeat(used, "grpo", 12) == "seed 0: identical"
    other = tmp_path / "grpo-s0"
    shutil.copytree(used.directory, other)
    console = (other / "console.log").read_text()
    (other / "console.log").write_text(console.replace("demo model sha256 607a9ea80d998160",
                                                       "demo model sha256 ab3e9e6bcc97c34a (MODEL_PATH)"))
    run = summary.Run("grpo", 0, other)
    assert summary.load_finished(run, 12)
    assert summary.earlier_repeat(run, "grpo", 12) == (
        "seed 0: not applicable (model ab3e9e6bcc97c34a here, 607a9ea80d998160 there)")
    assert summary.earlier_repeat(summary.Run("grpo", 2, other), "grpo", 12) is None


def test_a_run_repeated_in_another_clone_is_compared_in_every_metric_but_timings(tmp_path):
    """The plan's amendment reuses gate_A's GRPO arm for the rows only if GRPO seed 0, run again in the rows' clone
    (``rows_A_check``), logs the same metrics at every step: a copy of the committed run is identical; one changed
    training metric, or a run not finished, is reported as such."""
    used = summary.Run("grpo", 0, COMMITTED / "gate_A" / "runs" / "grpo-s0")
    assert summary.load_finished(used, 12)
    used.comparison = "gate_A"
    check = tmp_path / "rows_A_check" / "runs" / "grpo-s0"
    shutil.copytree(used.directory, check)
    log = (check / "train.log").read_text()
    # another machine's timings: not a difference
    (check / "train.log").write_text(log.replace("timing_s/step:", "timing_s/step:1").replace("perf/throughput:",
                                                                                              "perf/throughput:9"))
    [line] = summary.repeat_lines(tmp_path, {"grpo": [used]}, 12)
    assert "grpo seed 0 repeated in `rows_A_check` against `gate_A`'s run" in line and "**identical**" in line, line
    first = next(l for l in log.splitlines() if "step:1 - " in l and "critic/score/mean:" in l)
    value = first.split("critic/score/mean:")[1].split()[0]
    (check / "train.log").write_text(log.replace(first, first.replace(f"critic/score/mean:{value}",
                                                                      "critic/score/mean:0.999")))
    [line] = summary.repeat_lines(tmp_path, {"grpo": [used]}, 12)
    assert "**different** in 1 metrics (critic/score/mean)" in line, line
    (check / "wall_s.txt").unlink()
    [line] = summary.repeat_lines(tmp_path, {"grpo": [used]}, 12)
    assert "**not compared** (not finished here)" in line, line


def test_the_per_turn_table_reads_tips_shaping_reward_as_its_turn_reward(tmp_path):
    # One line of a TIPS run's trajectory log (rows_A, tips seed 0, step 1), token ids left out.
    record = {"igpo_turn_ends": [20, 102, 166, 231], "igpo_boundaries": [77, 159, 241, 299],
              "igpo_tool_names": ["search", "search", None, None],
              "igpo_tool_status": ["ok", "ok", "malformed", "answer"],
              "igpo_turn_format_ok": [True, True, False, False], "igpo_answer_seen": [False, True, False],
              "igpo_hop_right": [True, True, False, False], "igpo_question": "Mentor of the mentor of @Tuskfi",
              "igpo_stop_reason": "answer", "igpo_num_turns": 4}
    line = {"step": 1, "uid": "s0000001p000000000", "prompt_ids": [], "response_ids": [0] * 232,
            "response_mask": [], "score": 0.0, "record": record,
            "advantage": [[0, 21, -0.822], [82, 103, -1.041], [164, 167, -0.831], [222, 232, -0.831]],
            "turn_spans": [[0, 21], [82, 103], [164, 167], [222, 232]],
            "terms": {"teacher_potential": [-7.531, -4.322, -0.079, None],
                      "shaping_reward": [0.087, 0.108, None, None], "outcome": 0.0}}
    run_dir = tmp_path / "tips-s0"
    (run_dir / "trajectories").mkdir(parents=True)
    (run_dir / "trajectories" / "step_000001.jsonl").write_text(json.dumps(line) + "\n")
    rows = summary.turn_rows(SimpleNamespace(method="tips", seed=0, directory=run_dir))
    assert [row[6] for row in rows][:2] == ["next_hop", "answer_hop"]
    assert [row[7] for row in rows] == pytest.approx([-0.822, -1.041, -0.831, -0.831])
    assert rows[0][8] == 0.087 and rows[1][8] == 0.108 and math.isnan(rows[2][8]) and math.isnan(rows[3][8])
    # The run's rows are kept beside its logs and read back from there once the trajectory log is gone.
    assert summary.run_turns(SimpleNamespace(method="tips", seed=0, directory=run_dir)) == rows
    shutil.rmtree(run_dir / "trajectories")
    again = summary.run_turns(SimpleNamespace(method="tips", seed=0, directory=run_dir))
    assert [r[:7] for r in again] == [r[:7] for r in rows]
    assert [r[7] for r in again] == pytest.approx([r[7] for r in rows], rel=1e-4)
    assert again[0][8] == 0.087 and math.isnan(again[2][8])
    with pytest.raises(SystemExit, match="another run than tips seed 1"):
        summary.run_turns(SimpleNamespace(method="tips", seed=1, directory=run_dir))
    assert summary.run_turns(SimpleNamespace(method="tips", seed=0, directory=tmp_path)) == []


def test_a_comparison_on_another_model_is_summarised_apart(tmp_path, monkeypatch):
    """A2 (plan amendment 2: a pinned model, digest ab3e9e6bcc97c34a) summarised into a folder of its own: the digest
    check takes the pinned model, a repeat made on the plan's first model (rows_A_check) is not compared to its runs,
    and --repeats names the check folders to read."""
    folder = tmp_path / "turn_credit"
    shutil.copytree(COMMITTED / "A2" / "runs", folder / "A2" / "runs")
    shutil.copytree(COMMITTED / "rows_A_check" / "runs", folder / "rows_A_check" / "runs")
    out = tmp_path / "A2_summary"
    argv = ["summarize_turn_credit.py", "--folder", str(folder), "--comparisons", "A2", "--out", str(out),
            "--expected-model", "ab3e9e6bcc97c34a"]
    monkeypatch.setattr("sys.argv", argv)
    summary.main()
    text = (out / "summary.md").read_text()
    assert "Model digest: ab3e9e6bcc97c34a (expected ab3e9e6bcc97c34a): **as expected**" in text, text
    assert ("grpo seed 0 repeated in `rows_A_check`: **not compared** (another model: 607a9ea80d998160 there, "
            "ab3e9e6bcc97c34a in `A2`)") in text, text
    assert {p.name for p in out.iterdir()} >= {"summary.md", "paired.csv", "steps.csv", "turns.csv.gz"}
    assert not (folder / "summary.md").exists()
    monkeypatch.setattr("sys.argv", argv + ["--repeats", ""])
    summary.main()
    assert "repeated in" not in (out / "summary.md").read_text()


def test_several_gate_arms_are_tested_together_with_holm(tmp_path, monkeypatch):
    """results/turn_credit2's gate (several arms, Holm across them), run here on A2's committed runs with the oracle
    and IGPO as two gate arms: each arm's difference and raw p are the paired t's on the per-seed primaries A2's own
    summary wrote (paired.csv), and the Holm-adjusted p of the two comes out as Holm's rule computed by hand."""
    folder = tmp_path / "turn_credit"
    for arm in ("grpo", "oracle", "igpo"):  # the three arms read, not A2's other three
        for run in (COMMITTED / "A2" / "runs").glob(f"{arm}-s*"):
            shutil.copytree(run, folder / "A2" / "runs" / run.name)
    out = tmp_path / "gate"
    monkeypatch.setattr("sys.argv", ["summarize_turn_credit.py", "--folder", str(folder), "--comparisons", "A2",
                                     "--out", str(out), "--expected-model", "ab3e9e6bcc97c34a", "--repeats", "",
                                     "--gate", "oracle,igpo", "--family", "", "--successors", "",
                                     "--title", "a gate of two arms"])
    summary.main()
    text = (out / "summary.md").read_text()
    assert text.startswith("# a gate of two arms") and "## The gate: each of oracle, igpo − grpo, Holm across 2" in text
    primaries: dict[str, dict[int, float]] = {}
    for line in (COMMITTED / "A2" / "paired.csv").read_text().splitlines()[1:]:
        method, seed, primary = line.split(",")[:3]
        primaries.setdefault(method, {})[int(seed)] = float(primary)
    raw = {}
    for arm in ("oracle", "igpo"):
        diffs = [primaries[arm][s] - primaries["grpo"][s] for s in range(10)]
        mean = sum(diffs) / 10
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 9)
        raw[arm] = summary.paired_t_p([primaries[arm][s] for s in range(10)], [primaries["grpo"][s] for s in range(10)])
        assert f"| {arm} | 10 |" in text and f"{sd:.4f}" in text, (arm, sd, text)
    low, high = sorted(raw, key=raw.get)
    holm = {low: min(1.0, 2 * raw[low])}
    holm[high] = max(holm[low], min(1.0, raw[high]))
    primary = text.split("(primary)")[1].split("###")[0]
    for arm in ("oracle", "igpo"):
        row = next(line for line in primary.splitlines() if line.startswith(f"| {arm} |"))
        assert f"| {raw[arm]:.4f} | {holm[arm]:.4f} |" in row, (row, raw, holm)
    assert "**The gate does not pass**" in text
    assert "(learning speed)" in text and "answer-revealing hop reached" in text
