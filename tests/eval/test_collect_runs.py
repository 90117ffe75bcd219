"""scripts/experiments/collect_runs.py: a comparison's finished runs go from its clone into the checkout in the form
kept in git (scrubbed logs, gzipped tool-server log, per-turn rows), read back as finished; unfinished and collected
runs are left alone."""

import gzip
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("collect_runs", ROOT / "scripts" / "experiments" / "collect_runs.py")
collect_runs = importlib.util.module_from_spec(spec)
sys.modules["collect_runs"] = collect_runs
spec.loader.exec_module(collect_runs)

COMMITTED = ROOT / "results" / "turn_credit" / "gate_A" / "runs" / "grpo-s0"
COMPARISON = Path("results") / "turn_credit" / "X"


def _clone_with_runs(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    runs = clone / COMPARISON / "runs"
    for name in ("grpo-s0", "oracle-s0"):
        shutil.copytree(COMMITTED.parent / name, runs / name)
        (runs / name / "console.log").write_text((COMMITTED / "console.log").read_text()
                                                 + f"igpo: tiny model at {clone.resolve()}/results/model_A2\n")
        (runs / name / "tool_server.log").write_text(f"serving {clone.resolve()}/.cache/demo_world_chain\n")
        (runs / name / "tool_cache.sqlite").write_bytes(b"\xf8 binary")
        (runs / name / "model").mkdir()
    (runs / "oracle-s0" / "wall_s.txt").unlink()  # still running
    return clone


def test_finished_runs_are_copied_in_the_kept_form_and_read_back(tmp_path):
    clone, into = _clone_with_runs(tmp_path), tmp_path / "checkout"
    assert collect_runs.collect(clone, COMPARISON, 12, into=into) == ["grpo-s0"]
    kept = into / COMPARISON / "runs" / "grpo-s0"
    assert sorted(p.name for p in kept.iterdir()) == ["console.log", "interval.txt", "tool_server.log.gz",
                                                      "train.log", "turns.csv.gz", "wall_s.txt"]
    assert str(clone.resolve()) not in (kept / "console.log").read_text()
    assert "tiny model at <clone>/results/model_A2" in (kept / "console.log").read_text()
    with gzip.open(kept / "tool_server.log.gz", "rt") as handle:
        assert handle.read() == "serving <clone>/.cache/demo_world_chain\n"
    run = collect_runs.Run("grpo", 0, kept)
    assert collect_runs.load_finished(run, 12)
    turns = collect_runs.stc.run_turns(run)  # nan where a method logs no turn reward: compared as text
    assert turns and repr(turns) == repr(collect_runs.stc.run_turns(collect_runs.Run("grpo", 0, COMMITTED)))
    # again: nothing new until the other run finishes
    assert collect_runs.collect(clone, COMPARISON, 12, into=into) == []
    shutil.copy(COMMITTED.parent / "oracle-s0" / "wall_s.txt", clone / COMPARISON / "runs" / "oracle-s0")
    assert collect_runs.collect(clone, COMPARISON, 12, into=into) == ["oracle-s0"]


def test_a_wrong_clone_or_folder_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no runs/ folder at"):
        collect_runs.collect(tmp_path, COMPARISON, 12, into=tmp_path / "checkout")
