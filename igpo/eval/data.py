"""The test set of an evaluation: a verl RL-schema parquet read and validated into ``EvalRow`` records."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from igpo.core.ground_truth import parse_ground_truth
from igpo.eval import data_schema
from igpo.eval.settings import EvalInputError

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model", "extra_info")


@dataclass(frozen=True)
class EvalRow:
    """One valid test-set row. ``number`` is its 1-based row number in the file (for messages)."""

    number: int
    data_source: str
    index: str
    messages: tuple[dict[str, str], ...]
    ground_truth: Any
    aliases: tuple[str, ...]

    @property
    def key(self) -> tuple[str, str]:
        return (self.data_source, self.index)

    def run_key(self, run: int) -> tuple[str, str, int]:
        """The trace key of this row's ``run``-th answer (0-based)."""
        return (self.data_source, self.index, run)

    @property
    def uid(self) -> str:
        """The question's identity in its sampling seeds (``request_seed``): stable across runs and machines."""
        return json.dumps([self.data_source, self.index])

    @property
    def question(self) -> str:
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


def _parse_row(number: int, row: Mapping[str, Any], allowed_sources: set[str] | None
               ) -> tuple[list[str], EvalRow | None]:
    """Every problem of one row that stops it from being evaluated; the parsed row when there is none."""
    problems = data_schema.row_problems(row, for_training=False, allowed_sources=allowed_sources)
    if problems:
        return problems, None
    truth = row["reward_model"]["ground_truth"]
    messages = tuple({"role": m["role"], "content": m["content"]} for m in row["prompt"])
    return [], EvalRow(number, row["data_source"], row["extra_info"]["index"], messages, truth,
                       tuple(parse_ground_truth(truth)))


def load_rows(
    path: Path,
    *,
    limit_per_source: int | None = None,
    sources: Iterable[str] | None = None,
    allowed_sources: Iterable[str] | None = None,
) -> tuple[list[EvalRow], list[str]]:
    """Read and validate a test parquet; keep the first ``limit_per_source`` valid rows of each selected source.

    Returns (rows, problems) with problems as ``row N (index): message``. Raises ``EvalInputError`` for a missing
    file, an unreadable file, missing columns, or a requested source that has no row.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise EvalInputError(f"data file {str(path)!r} does not exist; pass --data with a test parquet such as "
                             "data/qa_test_7src.parquet.")
    if limit_per_source is not None and limit_per_source < 1:
        raise EvalInputError(f"limit_per_source={limit_per_source!r}: must be >= 1 (or unset for every row).")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise EvalInputError(f"cannot read {str(path)!r} as parquet ({err}); the test set must be a parquet file.")
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise EvalInputError(
            f"{str(path)!r} lacks the column(s) {missing} (it has {table.column_names}); the test set needs "
            f"{list(REQUIRED_COLUMNS)} (verl RL schema; convert raw QA files with python -m igpo.prepare_data)."
        )
    wanted = set(sources) if sources is not None else None
    allowed = set(allowed_sources) if allowed_sources is not None else None
    rows, problems, taken, seen, present = [], [], Counter(), {}, set()
    for number, record in enumerate(table.select(list(REQUIRED_COLUMNS)).to_pylist(), start=1):
        source = record.get("data_source")
        if wanted is not None and source not in wanted:
            continue
        present.add(source)
        if limit_per_source is not None and taken[source] >= limit_per_source:
            continue
        row_problems, row = _parse_row(number, record, allowed)
        extra = record.get("extra_info")
        label = extra.get("index") if isinstance(extra, Mapping) else None
        if row is not None and row.key in seen:
            row_problems, row = [f"duplicate (data_source, extra_info.index) {row.key} (first at row {seen[row.key]})"
                                 ], None
        if row is None:
            problems.extend(f"row {number}" + (f" ({label})" if label else "") + f": {p}" for p in row_problems)
            continue
        seen[row.key] = number
        taken[row.data_source] += 1
        rows.append(row)
    if wanted is not None:
        absent = sorted(wanted - present)
        if absent:
            raise EvalInputError(f"data_source(s) {absent} have no row in {str(path)!r}; it has "
                                 f"{sorted(s for s in set(table.column('data_source').to_pylist()) if s)}.")
    return rows, problems


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
