"""Data preparation: conversion to the verl schema, row-level errors, splits, and --check."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import igpo.prepare_data as prepare_data
from igpo.core.ground_truth import parse_ground_truth

REPO = Path(__file__).resolve().parents[2]
TEST_SET = REPO / "data" / "qa_test_7src.parquet"
SOURCES_7 = "nq,tq,popqa,hotpotqa,2wiki,musique,Bamboogle"


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


GOOD = [
    {"id": "q1", "question": "Who wrote Hamlet?", "golden_answers": ["William Shakespeare", "Shakespeare"]},
    {"id": "q2", "question": " What is the capital of France? ", "golden_answers": ["Paris"]},
    {"_id": "hp7", "question": "Which river?", "answer": "the Nile", "data_source": "hotpotqa"},
    {"qid": 4, "query": "Largest planet?", "answers": ["Jupiter", " ", "Jupiter"]},
]


def test_converts_flashrag_and_similar_records(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    rc = prepare_data.main([str(src), "--data-source", "nq", "--name", "out", "--output-dir", str(tmp_path)])
    assert rc == 0
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.equals(pq.read_table(TEST_SET).schema, check_metadata=False)
    rows = {r["extra_info"]["index"]: r for r in table.to_pylist()}
    assert set(rows) == {"nq_q1", "nq_q2", "hotpotqa_hp7", "nq_4"}
    hamlet = rows["nq_q1"]
    assert hamlet["data_source"] == "nq"
    assert hamlet["prompt"] == [{"content": "Who wrote Hamlet?", "role": "user"}]
    assert hamlet["reward_model"] == {"ground_truth": "William Shakespeare<|answer_split|>Shakespeare", "style": "rule"}
    assert hamlet["extra_info"]["split"] == "train"
    assert rows["nq_q2"]["prompt"][0]["content"] == "What is the capital of France?"
    assert rows["hotpotqa_hp7"]["data_source"] == "hotpotqa"
    assert parse_ground_truth(rows["nq_4"]["reward_model"]["ground_truth"]) == ["Jupiter"]  # blanks, repeats dropped


BAD = [
    {"id": "b1", "question": "No answer field?"},  # row 1
    {"id": "b2", "question": "Empty answers?", "golden_answers": ["", "  "]},  # row 2
    {"id": "b3", "question": "Typed answers?", "golden_answers": ["ok", 1999]},  # row 3
    {"id": "b4", "question": 42, "golden_answers": ["x"]},  # row 4
    "{not json",  # row 5
    ["a", "list"],  # row 6
    {"id": "b7", "question": "Unknown source?", "golden_answers": ["x"], "data_source": "nqq"},  # row 7
    {"id": "q1", "question": "Duplicate id?", "golden_answers": ["x"]},  # row 8 (q1 repeats row 9)
    {"id": "q1", "question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare"]},  # row 9
    {"id": "b10", "question": "Answers as a dict?", "golden_answers": {"a": 1}},  # row 10
]


def test_bad_rows_are_reported_by_row_and_nothing_is_written(tmp_path, capsys):
    src = write_jsonl(tmp_path / "bad.jsonl", BAD)
    args = [str(src), "--data-source", "nq", "--allowed-sources", "nq,tq", "--name", "out",
            "--output-dir", str(tmp_path)]
    assert prepare_data.main(args) == 1
    err = capsys.readouterr().err
    assert not (tmp_path / "out.parquet").exists()
    expected = {
        "row 1": "missing ground truth",
        "row 2": "missing ground truth",
        "row 3": "golden_answers[1] is int",
        "row 4": "question is int",
        "row 5": "not valid JSON",
        "row 6": "JSON list",
        "row 7 (nqq_b7)": "unknown data_source 'nqq'",
        "row 9 (nq_q1)": "duplicate extra_info.index (first at row 8)",
        "row 10": "golden_answers is dict",
    }
    for where, message in expected.items():
        assert any(where in line and message in line for line in err.splitlines()), (where, message, err)
    assert not any("row 8:" in line or "row 8 (" in line for line in err.splitlines())  # the first one is fine
    assert "bad.jsonl row 1: missing ground truth" in err


def test_skip_bad_keeps_the_good_rows(tmp_path, capsys):
    src = write_jsonl(tmp_path / "mixed.jsonl", GOOD[:2] + BAD[:2])
    rc = prepare_data.main([str(src), "--data-source", "nq", "--name", "out", "--output-dir", str(tmp_path),
                            "--skip-bad"])
    assert rc == 0
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 2
    assert "2 bad rows" in capsys.readouterr().err


def test_split_limit_and_exclude(tmp_path):
    records = [{"id": i, "question": f"Question number {i}?", "golden_answers": [f"a{i}"]} for i in range(20)]
    src = write_jsonl(tmp_path / "many.jsonl", records)
    held_out = tmp_path / "held.parquet"
    prepare_data.write_parquet(
        [prepare_data.record_to_row({"question": "question NUMBER 3?", "golden_answers": ["x"]},
                                    data_source="nq", split="test", row=1)],
        held_out,
    )
    args = [str(src), "--data-source", "nq", "--name", "s", "--output-dir", str(tmp_path), "--limit", "16",
            "--val-fraction", "0.25", "--exclude", str(held_out), "--seed", "3"]
    assert prepare_data.main(args) == 0
    train = pq.read_table(tmp_path / "s_train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "s_val.parquet").to_pylist()
    assert (len(train), len(val)) == (12, 4)
    assert {r["extra_info"]["split"] for r in train} == {"train"} and {r["extra_info"]["split"] for r in val} == {"val"}
    indices = [r["extra_info"]["index"] for r in train + val]
    assert len(set(indices)) == 16 and "nq_3" not in indices  # disjoint, and the held-out question is gone

    (tmp_path / "again").mkdir()
    args[args.index("--output-dir") + 1] = str(tmp_path / "again")
    assert prepare_data.main(args) == 0  # the same seed gives the same split
    assert pq.read_table(tmp_path / "again" / "s_val.parquet").to_pylist() == val


def test_check_accepts_the_shipped_test_set(capsys):
    assert prepare_data.main(["--check", str(TEST_SET), "--allowed-sources", SOURCES_7]) == 0
    out = capsys.readouterr().out
    assert "3197 rows" in out and "Bamboogle=125" in out and "nq=512" in out


def test_check_reports_bad_parquet_rows(tmp_path, capsys):
    rows = pq.read_table(TEST_SET).slice(0, 4).to_pylist()
    rows[1]["reward_model"]["ground_truth"] = "<|answer_split|> "
    rows[2]["data_source"] = "webquestions"
    rows[3]["extra_info"]["index"] = rows[0]["extra_info"]["index"]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad)
    assert prepare_data.main(["--check", str(bad), "--allowed-sources", SOURCES_7]) == 1
    err = capsys.readouterr().err
    assert "row 2" in err and "missing ground truth" in err
    assert "row 3" in err and "unknown data_source 'webquestions'" in err
    assert "row 4" in err and "duplicate extra_info.index (first at row 1)" in err

    typed = tmp_path / "typed.parquet"
    pq.write_table(pa.table({
        "data_source": ["nq"], "prompt": [[{"content": "q?", "role": "user"}]], "ability": ["qa"],
        "reward_model": [{"ground_truth": 1999, "style": "rule"}], "extra_info": [{"index": "nq_1", "split": "t"}],
    }), typed)
    assert prepare_data.main(["--check", str(typed)]) == 1
    assert "row 1 (nq_1): reward_model.ground_truth is int" in capsys.readouterr().err

    missing = tmp_path / "missing.parquet"
    pq.write_table(pa.table({"data_source": ["nq"]}), missing)
    assert prepare_data.main(["--check", str(missing)]) == 1
    assert "missing columns" in capsys.readouterr().err


def test_shipped_train_sample_is_valid_and_disjoint_from_the_test_set():
    train = pq.read_table(REPO / "data" / "train_nq_256.parquet").to_pylist()
    test_questions = {prepare_data.normalize_question(prepare_data.question_of(r))
                      for r in pq.read_table(TEST_SET).to_pylist()}
    good, errors = prepare_data.validate_rows(enumerate(train, start=1), {"nq"})
    assert errors == [] and len(good) == 256
    assert not any(prepare_data.normalize_question(prepare_data.question_of(r)) in test_questions for r in train)


def test_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "igpo.prepare_data", "--check", str(TEST_SET)], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("OK: every row is valid")


@pytest.mark.parametrize("fraction", ["-0.1", "1.0"])
def test_bad_val_fraction_is_a_usage_error(tmp_path, fraction):
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    with pytest.raises(SystemExit):
        prepare_data.main([str(src), "--data-source", "nq", "--name", "o", "--val-fraction", fraction])
