"""scripts/experiments/summarize_real_model.py on hand-made runs: per-question avg@k and pass@k from verl's validation
dumps, the before figure borrowed from the baseline at the same seed, paired bootstrap changes and the plan's learning
rule."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("summarize_real_model",
                                              ROOT / "scripts" / "experiments" / "summarize_real_model.py")
summary = importlib.util.module_from_spec(spec)
sys.modules["summarize_real_model"] = summary
spec.loader.exec_module(summary)

QUESTIONS = [f"question {i}" for i in range(20)]


def dump(path: Path, exact: dict[str, list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"input": q, "output": "...", "score": float(e), "em": float(e), "step": 0})
             for q, values in exact.items() for e in values]
    path.write_text("\n".join(lines) + "\n")


def make_run(folder: Path, name: str, dumps: dict[int, dict[str, list[int]]]) -> None:
    run = folder / "runs" / name
    for step, exact in dumps.items():
        dump(run / "validation" / f"{step}.jsonl", exact)
    (run / "train.log").write_text("(TaskRunner pid=1) step:1 - critic/score/mean:0.25 - igpo/turns_mean:2.0 - "
                                   "timing_s/step:90\n(TaskRunner pid=1) step:2 - critic/score/mean:0.5 - "
                                   "timing_s/step:80\n")
    (run / "console.log").write_text("igpo: demo model sha256 a8eb51a63f99a6d8 (SmolLM2 warm-started)\n")
    (run / "peak_rss_mb.txt").write_text("5000\n")


def test_per_question_avg_and_pass_and_the_paired_change():
    before = summary.question_scores({"a": [0, 0, 0, 1], "b": [0, 0, 0, 0]})
    after = summary.question_scores({"a": [1, 1, 0, 1], "b": [0, 1, 0, 0]})
    assert before == {"a": (0.25, 1.0), "b": (0.0, 0.0)}
    mean, low, high = summary.paired_change(before, after, 0)
    assert mean == pytest.approx(0.375) and low <= mean <= high
    assert summary.paired_change(before, after, 1)[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="different questions"):
        summary.paired_change(before, {"a": (1.0, 1.0)}, 0)


def test_the_summary_borrows_the_baselines_before_and_applies_the_learning_rule(tmp_path, monkeypatch):
    low = {q: [0, 0, 0, 1] if i < 5 else [0, 0, 0, 0] for i, q in enumerate(QUESTIONS)}
    high = {q: [1, 1, 0, 1] if i < 15 else [0, 0, 0, 0] for i, q in enumerate(QUESTIONS)}
    make_run(tmp_path, "grpo-s0", {0: low, 2: low})
    make_run(tmp_path, "grpo-s1", {0: low, 2: low})
    make_run(tmp_path, "igpo-s0", {2: high})
    make_run(tmp_path, "igpo-s1", {2: low})
    log = tmp_path / "runs" / "igpo-s1" / "train.log"
    log.write_text(log.read_text() + "(TaskRunner pid=1) igpo: warning: well-formed tool calls fell to 0.10 of turns "
                   "at step 2\n")
    monkeypatch.setattr("sys.argv", ["summarize_real_model.py", "--folder", str(tmp_path)])
    summary.main()
    text = (tmp_path / "summary.md").read_text()
    assert "- igpo: seed 0 +0.500" in text and "**shown**" in text.split("- igpo:")[1].splitlines()[0]
    assert "**not shown**" in text.split("- grpo:")[1].splitlines()[0]
    assert "Model digest: a8eb51a63f99a6d8 (expected a8eb51a63f99a6d8): as expected." in text
    assert "held at every seed" in text
    runs_table = text.split("## Runs")[1]
    assert "| igpo | 1 | 2 | 80.0 | 5000 | - | well-formed tool calls fell to 0.10 of turns at step 2 |" in runs_table
    assert "| grpo | 0 | 2 | 80.0 | 5000 | - | none |" in runs_table
    rows = (tmp_path / "validation.csv").read_text().splitlines()
    assert any(r.startswith("igpo,0,0,0.0625") for r in rows)  # before: grpo's step-0 dump at seed 0
    assert (tmp_path / "val_avg.png").is_file() and (tmp_path / "training.png").is_file()

    runs = summary.load(tmp_path)
    curves = summary.avg_curves(runs, {r.seed: r for r in runs["grpo"]})
    seeds, mean = curves["igpo"]
    assert sorted(seeds) == [0, 1] and sorted(seeds[0]) == [0, 2]  # step 0 borrowed from grpo at the seed
    value, low, high = seeds[0][2]
    assert value == pytest.approx(0.5625) and low < value < high  # the plot's band: an interval, not a point
    assert mean == {0: pytest.approx(0.0625), 2: pytest.approx((0.5625 + 0.0625) / 2)}
    single = summary.avg_curves({"grpo": runs["grpo"][:1]}, {})
    assert single["grpo"][1] == {}  # one seed: no mean line


def pilot_run(folder: Path, rate: str, success: list[float], wellformed: list[float], warning: bool = False) -> None:
    run = folder / f"lr{rate}" / "runs" / "grpo-s0"
    run.mkdir(parents=True)
    lines = [f"(TaskRunner pid=1) step:{s} - critic/score/mean:{ok} - outcome/success_share:{ok} - "
             f"health/wellformed_call_share:{form} - outcome/same_outcome_group_share:0.5 - actor/kl_loss:0.001 - "
             f"actor/entropy:1.0 - timing_s/step:{100 + s} - timing_s/gen:60 - timing_s/update_actor:30"
             for s, (ok, form) in enumerate(zip(success, wellformed), start=1)]
    if warning:
        lines.insert(5, "(TaskRunner pid=1) igpo: warning: step 5: the well-formed call share fell")
    (run / "train.log").write_text("\n".join(lines) + "\n")
    (run / "peak_rss_mb.txt").write_text("6000\n")


def test_the_pilot_rule_takes_the_higher_rate_only_when_it_gains_keeps_its_form_and_stays_healthy(tmp_path):
    figures = summary.pilot_figures  # read back from hand-made logs
    pilot_run(tmp_path / "a", "1e-5", [0.1] * 10, [0.8] * 10)
    pilot_run(tmp_path / "a", "5e-5", [0.1] * 5 + [0.14] * 5, [0.8] * 5 + [0.41] * 5)
    rate, steps, why = summary.pilot_rule(figures(tmp_path / "a" / "lr1e-5" / "runs" / "grpo-s0"),
                                          figures(tmp_path / "a" / "lr5e-5" / "runs" / "grpo-s0"))
    # Median step over steps 2-10 = 106 s; a validation = 16 x 60 s: (3600 - 120 - 2880) // 106 = 5 -> at least 16.
    assert rate == "5e-5" and steps == 16, why
    # Below the margin, form lost, or a warning: the lower rate.
    pilot_run(tmp_path / "b", "1e-5", [0.1] * 10, [0.8] * 10)
    pilot_run(tmp_path / "b", "5e-5", [0.1] * 5 + [0.125] * 5, [0.8] * 10)
    pilot_run(tmp_path / "c", "1e-5", [0.1] * 10, [0.8] * 10)
    pilot_run(tmp_path / "c", "5e-5", [0.1] * 5 + [0.2] * 5, [0.8] * 5 + [0.39] * 5)
    pilot_run(tmp_path / "d", "1e-5", [0.1] * 10, [0.8] * 10)
    pilot_run(tmp_path / "d", "5e-5", [0.1] * 5 + [0.2] * 5, [0.8] * 10, warning=True)
    for case, reason in (("b", "success gain +0.025"), ("c", "well-formed share 0.390"), ("d", "1 health warning")):
        lines = summary.pilot(tmp_path / case)
        assert "learning rate 1e-5: 5e-5 fails the rule" in "\n".join(lines) and reason in "\n".join(lines), lines
    assert (tmp_path / "d" / "summary.md").read_text().count("| 5e-5 | 10 |") == 1


def test_the_step_count_fills_the_hour():
    fast = {"step_s": 40.0, "gen_s": 20.0, "success_window": 0.1, "wellformed_window": 0.8, "wellformed_1": 0.8,
            "warnings": 0}
    _, steps, _ = summary.pilot_rule(fast, dict(fast))
    assert steps == 62  # (3600 - 120 - 3 x 320) // 40 = 63 -> the largest even, 62
