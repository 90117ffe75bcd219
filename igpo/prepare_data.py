"""Convert QA records into verl's RL parquet schema, validate every row, and split; or check an existing parquet.

Run as ``python -m igpo.prepare_data``; ``--help`` explains every flag.

Input: JSONL (one record a line) or a JSON array, in FlashRAG form ``{"id", "question", "golden_answers": [...]}``
or a similar one (question in ``question``/``query``; answers in ``golden_answers``/``answers``/``answer``/
``ground_truth`` as a string or a list of strings; id in ``id``/``_id``/``qid``; an optional per-record
``data_source``). Records already in the verl schema are validated and passed through.

Output rows (the schema of the IGPO / DeepResearcher QA parquet, docs/design/reference_igpo.md §7)::

    data_source   str                         drives reward routing (igpo.reward)
    prompt        [{"role": "user", "content": question}]
    ability       "search & question answering"
    reward_model  {"ground_truth": aliases joined by "<|answer_split|>", "style": "rule"}
    extra_info    {"index": "<data_source>_<id>", "split": "train" | "val" | ...}

Every row is validated; problems are reported as ``row N (index): message`` and nothing is written unless
``--skip-bad`` drops the bad rows (and says how many).

Examples::

    python -m igpo.prepare_data nq_test.jsonl --data-source nq --name train_nq --output-dir data \\
        --limit 256 --val-fraction 0 --split-name train --exclude data/qa_test_7src.parquet
    python -m igpo.prepare_data --check data/qa_test_7src.parquet --allowed-sources nq,tq,popqa
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from igpo.core.ground_truth import ANSWER_SPLIT, parse_ground_truth
from igpo.eval.data_schema import row_problems

ABILITY = "search & question answering"
QUESTION_FIELDS = ("question", "query")
ANSWER_FIELDS = ("golden_answers", "answers", "answer", "ground_truth")
ID_FIELDS = ("id", "_id", "qid")
MAX_PRINTED_ERRORS = 50

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string()), ("split", pa.string())])),
])


@dataclass(frozen=True)
class RowError:
    """One problem with one input row; ``row`` is the 1-based line (JSONL) or position (JSON array, parquet)."""

    row: int
    message: str
    index: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        where = (f"{self.file} " if self.file else "") + f"row {self.row}" + (f" ({self.index})" if self.index else "")
        return f"{where}: {self.message}"


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def read_records(path: Path) -> Iterator[tuple[int, dict | RowError]]:
    """(row number, record) pairs; a line that is not a JSON object becomes a ``RowError``."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        records = json.loads(text)
        for position, record in enumerate(records, start=1):
            yield position, record if isinstance(record, dict) else RowError(
                position, f"record is a JSON {_type(record)}, expected an object"
            )
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            yield line_no, RowError(line_no, f"not valid JSON ({err.msg} at column {err.colno})")
            continue
        yield line_no, record if isinstance(record, dict) else RowError(
            line_no, f"record is a JSON {_type(record)}, expected an object"
        )


def _aliases(record: dict) -> list[str]:
    for name in ANSWER_FIELDS:
        if name not in record:
            continue
        value = record[name]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"{name} is {_type(value)}, expected a string or a list of strings")
        for k, alias in enumerate(value):
            if not isinstance(alias, str):
                raise ValueError(f"{name}[{k}] is {_type(alias)} {alias!r}, expected a string")
        aliases = list(dict.fromkeys(a.strip() for a in value if a.strip()))
        if not aliases:
            raise ValueError(f"missing ground truth: {name} has no non-empty answer")
        return aliases
    raise ValueError(f"missing ground truth: none of the fields {', '.join(ANSWER_FIELDS)} is present")


def record_to_row(record: dict, *, data_source: str | None, split: str, row: int) -> dict:
    """One verl row from one QA record; raises ``ValueError`` describing the first problem found."""
    if "prompt" in record and "reward_model" in record:
        return record  # already in the verl schema; validate_rows checks it
    source = record.get("data_source", data_source)
    if not isinstance(source, str) or not source:
        raise ValueError("no data_source: give --data-source or a data_source field in the record")
    question = next((record[name] for name in QUESTION_FIELDS if name in record), None)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question is {_type(question)} {question!r}, expected a non-empty string")
    raw_id = next((record[name] for name in ID_FIELDS if name in record), row)
    if not isinstance(raw_id, (str, int)):
        raise ValueError(f"id is {_type(raw_id)}, expected a string or an integer")
    return {
        "data_source": source,
        "prompt": [{"content": question.strip(), "role": "user"}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": ANSWER_SPLIT.join(_aliases(record)), "style": "rule"},
        "extra_info": {"index": f"{source}_{raw_id}", "split": split},
    }


def _index(row: Any) -> str | None:
    extra = row.get("extra_info") if isinstance(row, dict) else None
    return extra.get("index") if isinstance(extra, dict) and isinstance(extra.get("index"), str) else None


def validate_rows(
    rows: Iterable[tuple[int, Any]], allowed_sources: set[str] | None = None
) -> tuple[list[tuple[int, dict]], list[RowError]]:
    """(good rows, errors) over (row number, row) pairs; a repeated extra_info.index is an error too."""
    good, errors, seen = [], [], {}
    for number, row in rows:
        problems = row_problems(row, for_training=True, allowed_sources=allowed_sources)
        index = _index(row)
        if index is not None and index in seen:
            problems.append(f"duplicate extra_info.index (first at row {seen[index]})")
        if problems:
            errors.extend(RowError(number, p, index) for p in problems)
            continue
        seen[index] = number
        good.append((number, row))
    return good, errors


def convert_records(
    numbered: Iterable[tuple[int, dict | RowError]],
    *,
    data_source: str | None,
    split: str,
    allowed_sources: set[str] | None = None,
) -> tuple[list[dict], list[RowError]]:
    """Convert and validate; returns (valid rows in input order, every problem found)."""
    converted, errors = [], []
    for number, record in numbered:
        if isinstance(record, RowError):
            errors.append(record)
            continue
        try:
            converted.append((number, record_to_row(record, data_source=data_source, split=split, row=number)))
        except ValueError as err:
            errors.append(RowError(number, str(err)))
    good, invalid = validate_rows(converted, allowed_sources)
    return [row for _, row in good], errors + invalid


def normalize_question(question: str) -> str:
    return " ".join(question.lower().split())


def question_of(row: dict) -> str:
    return next(m["content"] for m in row["prompt"] if m["role"] == "user")


def split_rows(rows: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle with ``seed`` and cut off round(val_fraction * n) validation rows; sets extra_info.split."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1).")
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    n_val = round(val_fraction * len(shuffled))
    val, train = shuffled[:n_val], shuffled[n_val:]
    for row in val:
        row["extra_info"] = {**row["extra_info"], "split": "val"}
    return train, val


def write_parquet(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=SCHEMA)  # drops no field: validate_rows checked every key
    pq.write_table(table, path)


def read_parquet_rows(path: Path) -> list[dict]:
    table = pq.read_table(path)
    missing = [name for name in SCHEMA.names if name not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; expected {SCHEMA.names}")
    return table.to_pylist()


def summarize(rows: list[dict]) -> str:
    sources = Counter(row["data_source"] for row in rows)
    alias_counts = [len(parse_ground_truth(row["reward_model"]["ground_truth"])) for row in rows]
    lines = [f"{len(rows)} rows; per data_source: " + ", ".join(f"{s}={n}" for s, n in sorted(sources.items()))]
    if alias_counts:
        multi = sum(c > 1 for c in alias_counts)
        lines.append(
            f"aliases per row: mean {sum(alias_counts) / len(alias_counts):.2f}, max {max(alias_counts)}; "
            f"{multi} multi-alias rows"
        )
    return "\n".join(lines)


def _print_errors(errors: list[RowError]) -> None:
    for error in errors[:MAX_PRINTED_ERRORS]:
        print(f"  {error}", file=sys.stderr)
    if len(errors) > MAX_PRINTED_ERRORS:
        print(f"  ... and {len(errors) - MAX_PRINTED_ERRORS} more", file=sys.stderr)


def check(path: Path, allowed_sources: set[str] | None) -> int:
    try:
        rows = read_parquet_rows(path)
    except (ValueError, OSError, pa.ArrowException) as err:
        print(f"ERROR {err}", file=sys.stderr)
        return 1
    good, errors = validate_rows(enumerate(rows, start=1), allowed_sources)
    print(f"{path}: {summarize([row for _, row in good])}")
    if errors:
        print(f"ERROR {len(errors)} problems in {len(rows) - len(good)} of {len(rows)} rows:", file=sys.stderr)
        _print_errors(errors)
        return 1
    print("OK: every row is valid")
    return 0


def convert(args: argparse.Namespace, allowed_sources: set[str] | None) -> int:
    rows, errors = [], []
    for path in args.inputs:
        part, part_errors = convert_records(
            read_records(path), data_source=args.data_source, split=args.split_name, allowed_sources=allowed_sources
        )
        rows.extend(part)
        errors.extend(dataclasses.replace(e, file=path.name) for e in part_errors)
    if errors:
        print(f"{'WARNING' if args.skip_bad else 'ERROR'} {len(errors)} bad rows:", file=sys.stderr)
        _print_errors(errors)
        if not args.skip_bad:
            print("nothing written; fix the rows or pass --skip-bad to drop them", file=sys.stderr)
            return 1
    indices = Counter(row["extra_info"]["index"] for row in rows)
    repeated = sorted(i for i, n in indices.items() if n > 1)
    if repeated:
        print(f"ERROR extra_info.index repeats across inputs: {repeated[:10]}", file=sys.stderr)
        return 1
    if args.exclude:
        excluded = {normalize_question(question_of(r)) for path in args.exclude for r in read_parquet_rows(path)}
        before = len(rows)
        rows = [row for row in rows if normalize_question(question_of(row)) not in excluded]
        print(f"excluded {before - len(rows)} rows whose question appears in {', '.join(map(str, args.exclude))}")
    if args.limit is not None:
        random.Random(args.seed).shuffle(rows)
        rows = rows[: args.limit]
    train, val = split_rows(rows, args.val_fraction, args.seed)
    outputs = {args.name: train} if not val else {f"{args.name}_train": train, f"{args.name}_val": val}
    for name, part in outputs.items():
        path = args.output_dir / f"{name}.parquet"
        write_parquet(part, path)
        print(f"wrote {path}: {summarize(part)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m igpo.prepare_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path, help="JSONL / JSON files of QA records")
    parser.add_argument("--check", type=Path, help="validate this parquet instead of converting")
    parser.add_argument("--data-source", help="data_source of records that do not carry one")
    parser.add_argument("--allowed-sources", help="comma-separated data_source values; any other is a row error")
    parser.add_argument("--output-dir", type=Path, default=Path("data"),
                        help="where the parquet files go (default data)")
    parser.add_argument("--name", help="output file stem: NAME.parquet, or NAME_train/NAME_val.parquet with a split")
    parser.add_argument("--split-name", default="train", help="extra_info.split of the non-validation rows")
    parser.add_argument("--val-fraction", type=float, default=0.0,
                        help="share of rows split off as NAME_val.parquet (extra_info.split val), in [0, 1); "
                             "default 0: one file")
    parser.add_argument("--limit", type=int, help="keep a random sample of this many rows (after --exclude)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --limit's sample and of the split (default 0)")
    parser.add_argument("--exclude", type=Path, nargs="*", default=[],
                        help="parquet files whose questions must not appear in the output (e.g. the test set)")
    parser.add_argument("--skip-bad", action="store_true", help="drop bad rows (reported) instead of failing")
    args = parser.parse_args(argv)
    allowed = {s.strip() for s in args.allowed_sources.split(",") if s.strip()} if args.allowed_sources else None
    if args.check is not None:
        if args.inputs:
            parser.error("--check takes no input files")
        return check(args.check, allowed)
    if not args.inputs or not args.name:
        parser.error("give input files and --name (or --check FILE.parquet)")
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit {args.limit} must be positive")
    if not 0.0 <= args.val_fraction < 1.0:
        parser.error(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    return convert(args, allowed)


if __name__ == "__main__":
    sys.exit(main())
