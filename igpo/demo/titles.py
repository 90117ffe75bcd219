"""Demo questions that the local corpus can answer: "which article contains this passage?" (CPU demo data).

For a corpus passage with title T and body text, the question quotes a window of ``min_words..max_words`` words of
the body and the ground truth is T:

    Which Wikipedia article contains this passage: '<snippet>'?        ->  T

Searching the snippet with the local BM25 backend returns the passage (every kept question is checked: its snippet
ranks the source passage first), and the search result shows ``[T](corpus://<id>)``. So a search turn really raises
the policy's probability of the answer, and information gain has something to measure on the tiny CPU model.

Passages are split once, by a seeded permutation, into training passages and held-out validation passages, so a
warm-started model (``igpo.demo.warmstart``, which trains on training passages only) is measured on passages it never saw.
Output: verl RL parquet files with the schema of ``data/train_nq_256.parquet``.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_SOURCE = "corpus_title"
ABILITY = "search & question answering"
QUESTION_TEMPLATE = "Which Wikipedia article contains this passage: '{snippet}'?"

# A snippet is copied into a JSON string inside the tool call. Characters that JSON escapes (quotes, backslashes),
# that end the quoted snippet, that look like markup (<, >: left-over HTML) or that are not printable ASCII (many
# byte-level tokens each) make that copy harder than the task, so windows containing them are skipped.
_AWKWARD = re.compile(r"[^\x20-\x7e]|[\"'\\`<>]")


@dataclass(frozen=True)
class DemoDataConfig:
    """How the demo questions are drawn.

    min_words / max_words: snippet length in words (inclusive). Longer snippets retrieve more reliably but make a
        longer tool call: at 12 words a call is ~55 tokens of the tiny BPE, so ``max_tokens_per_turn`` must be >= 64.
    val_passages: passages held out for validation (and never seen by the warm-start).
    attempts: random windows tried per passage before it is skipped (a window must avoid quotes and the title).
    seed: the passage split and the windows.
    """

    min_words: int = 8
    max_words: int = 10
    val_passages: int = 64
    attempts: int = 8
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.min_words, int) and 3 <= self.min_words <= self.max_words):
            raise ValueError(f"demo data: min_words={self.min_words!r}, max_words={self.max_words!r}: need "
                             "3 <= min_words <= max_words (integers); fix the word range")
        if not (isinstance(self.val_passages, int) and self.val_passages >= 1):
            raise ValueError(f"demo data: val_passages={self.val_passages!r} must be an integer >= 1")
        if not (isinstance(self.attempts, int) and self.attempts >= 1):
            raise ValueError(f"demo data: attempts={self.attempts!r} must be an integer >= 1")


@dataclass(frozen=True)
class Passage:
    doc_id: str
    title: str
    body: str


@dataclass(frozen=True)
class DemoQuestion:
    question: str
    snippet: str
    answer: str
    doc_id: str


def load_passages(corpus: str | Path) -> list[Passage]:
    """Passages of a Search-R1/FlashRAG JSONL corpus (title = first line of ``contents`` without its quotes)."""
    from tool_server.backends.local import split_contents

    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"demo data: corpus {corpus} not found; pass a JSONL corpus such as "
                                "data/wiki_passages_1000.jsonl")
    passages = []
    for lineno, line in enumerate(corpus.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "id" not in record or not isinstance(record.get("contents"), str):
            raise ValueError(f"demo data: {corpus}:{lineno} lacks 'id' or string 'contents' (FlashRAG format)")
        title, body = split_contents(record["contents"])
        # The tokenizers normalise text to NFC, so a model can only ever write the NFC form of a title.
        passages.append(Passage(str(record["id"]), unicodedata.normalize("NFC", title), body))
    if not passages:
        raise ValueError(f"demo data: corpus {corpus} has no passages")
    return passages


def split_passages(passages: list[Passage], config: DemoDataConfig) -> tuple[list[Passage], list[Passage]]:
    """(training passages, held-out validation passages) by a seeded permutation; deterministic in the config."""
    if config.val_passages >= len(passages):
        raise ValueError(f"demo data: val_passages={config.val_passages} leaves no training passage out of "
                         f"{len(passages)}; lower val_passages")
    order = list(range(len(passages)))
    random.Random(config.seed).shuffle(order)
    held_out = set(order[: config.val_passages])
    train = [p for i, p in enumerate(passages) if i not in held_out]
    val = [p for i, p in enumerate(passages) if i in held_out]
    return train, val


def pick_snippet(passage: Passage, rng: random.Random, config: DemoDataConfig) -> str | None:
    """A random window of the body's words without quotes and without the title; None when no try succeeds."""
    words = passage.body.split()
    title = passage.title.lower()
    for _ in range(config.attempts):
        length = rng.randint(config.min_words, config.max_words)
        if len(words) < length:
            return None
        start = rng.randint(0, len(words) - length)
        snippet = " ".join(words[start: start + length])
        if not _AWKWARD.search(snippet) and title not in snippet.lower():
            return snippet
    return None


def make_question(passage: Passage, snippet: str) -> DemoQuestion:
    return DemoQuestion(QUESTION_TEMPLATE.format(snippet=snippet), snippet, passage.title, passage.doc_id)


async def _top_doc_ids(backend: Any, queries: list[str]) -> list[str | None]:
    """The doc id BM25 ranks first for each query (None when nothing matches)."""
    results = []
    for query in queries:
        hits = await backend.search_one(query, 1, deadline=float("inf"))
        results.append(hits[0].doc_id if hits else None)
    return results


def build_questions(
    passages: list[Passage], backend: Any, config: DemoDataConfig, *, salt: int = 0
) -> list[DemoQuestion]:
    """One question per passage whose snippet ranks the passage first under the local BM25 backend.

    Passages without a usable window, or whose snippet retrieves another passage first, are skipped: their search
    result would not show the answer. ``salt`` varies the windows (e.g. per warm-start example) deterministically.
    """
    rng = random.Random(f"{config.seed}:{salt}")
    candidates = [(p, s) for p in passages if (s := pick_snippet(p, rng, config)) is not None]
    top = asyncio.run(_top_doc_ids(backend, [s for _, s in candidates]))
    return [make_question(p, s) for (p, s), doc_id in zip(candidates, top) if doc_id == p.doc_id]


def parquet_schema():
    """The arrow schema of ``data/train_nq_256.parquet`` (plain ``string`` columns, as verl's RL dataset reads)."""
    import pyarrow as pa

    text = pa.string()
    return pa.schema([
        ("data_source", text),
        ("prompt", pa.list_(pa.struct([("content", text), ("role", text)]))),
        ("ability", text),
        ("reward_model", pa.struct([("ground_truth", text), ("style", text)])),
        ("extra_info", pa.struct([("index", text), ("split", text)])),
    ])


def to_table(questions: list[DemoQuestion], split: str):
    """One verl RL row per question, as a pyarrow table with :func:`parquet_schema`."""
    import pyarrow as pa

    rows = [{
        "data_source": DATA_SOURCE,
        "prompt": [{"content": q.question, "role": "user"}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": q.answer, "style": "rule"},
        "extra_info": {"index": f"{DATA_SOURCE}_{q.doc_id}", "split": split},
    } for q in questions]
    return pa.Table.from_pylist(rows, schema=parquet_schema())


def write_demo_data(
    corpus: str | Path, out_dir: str | Path, config: DemoDataConfig | None = None
) -> tuple[Path, Path]:
    """Write ``demo_train.parquet`` (training passages) and ``demo_val.parquet`` (held-out passages) to ``out_dir``."""
    import pyarrow.parquet as pq

    from tool_server.backends.local import LocalBackend

    config = config or DemoDataConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = LocalBackend(corpus)
    train, val = split_passages(load_passages(corpus), config)
    paths = []
    for name, passages in (("train", train), ("val", val)):
        questions = build_questions(passages, backend, config)
        if not questions:
            raise ValueError(f"demo data: no {name} passage of {corpus} gives a snippet that retrieves it; "
                             "check the corpus or widen min_words/max_words")
        path = out_dir / f"demo_{name}.parquet"
        pq.write_table(to_table(questions, name), path)
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="JSONL corpus, e.g. data/wiki_passages_1000.jsonl")
    parser.add_argument("--out-dir", required=True, help="directory for demo_train.parquet and demo_val.parquet")
    parser.add_argument("--seed", type=int, default=DemoDataConfig.seed)
    args = parser.parse_args()
    train, val = write_demo_data(args.corpus, args.out_dir, DemoDataConfig(seed=args.seed))
    print(train)
    print(val)


if __name__ == "__main__":
    main()
