"""Offline backend: BM25 (``bm25s``) over a Search-R1/FlashRAG JSONL corpus; ``visit`` returns a stored passage.

Corpus line: ``{"id": str, "contents": "\\"<Title>\\"\\n<text>"}``; the title is the first line without its quotes.
Search results carry ``corpus://<id>`` URLs so a visit can follow a search.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import bm25s
import numpy as np

logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its logger to DEBUG on import

from ..errors import ToolError
from .base import PageResult, SearchHit

CORPUS_SCHEME = "corpus://"
_SNIPPET_CHARS = 600


class CorpusError(ValueError):
    """The corpus file breaks the format; the message names the line."""


def split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG convention: title = first line stripped of quotes, text = the remaining lines."""
    first, _, rest = contents.partition("\n")
    return first.strip().strip('"'), rest.strip()


class LocalBackend:
    name = "local"
    upstream_names: list[str] = []
    cacheable = False

    def __init__(self, corpus_path: str | Path) -> None:
        self.corpus_path = Path(corpus_path)
        raw = self.corpus_path.read_bytes()
        self._digest = hashlib.sha256(raw).hexdigest()[:16]
        self.ids: list[str] = []
        self.contents: list[str] = []
        self._index_of: dict[str, int] = {}
        for lineno, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise CorpusError(f"{self.corpus_path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str) or "id" not in doc:
                raise CorpusError(f"{self.corpus_path}:{lineno}: expected an object with 'id' and string "
                                  "'contents' (Search-R1/FlashRAG corpus format)")
            doc_id = str(doc["id"])
            if doc_id in self._index_of:
                raise CorpusError(f"{self.corpus_path}:{lineno}: duplicate id {doc_id!r}; ids must be unique")
            self._index_of[doc_id] = len(self.ids)
            self.ids.append(doc_id)
            self.contents.append(doc["contents"])
        if not self.ids:
            raise CorpusError(f"{self.corpus_path}: the corpus is empty")
        self._retriever = bm25s.BM25()
        self._retriever.index(bm25s.tokenize(self.contents, stopwords="en", show_progress=False),
                              show_progress=False)
        self._position = np.arange(len(self.ids))

    def namespace(self, tool: str) -> str:
        return f"local:{self._digest}:{tool}"

    def document(self, doc_id: str) -> dict:
        return {"id": doc_id, "contents": self.contents[self._index_of[doc_id]]}

    async def search_one(self, query: str, topk: int, deadline: float) -> list[SearchHit]:
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        if not tokens:
            return []  # only stop words or punctuation: nothing to match
        scores = self._retriever.get_scores(tokens)
        # best score first; equal scores in corpus order, so results are deterministic
        order = np.lexsort((self._position, -scores))[:topk]
        hits = []
        for i in order[scores[order] > 0]:
            title, text = split_contents(self.contents[i])
            hits.append(SearchHit(title=title, url=CORPUS_SCHEME + self.ids[i], snippet=text[:_SNIPPET_CHARS],
                                  score=round(float(scores[i]), 6), doc_id=self.ids[i]))
        return hits

    async def visit_one(self, url: str, goal: str, deadline: float) -> PageResult:
        if not url.startswith(CORPUS_SCHEME):
            raise ToolError("bad_request", f"the local backend can only visit {CORPUS_SCHEME}<id> URLs taken from "
                                           f"search results, not {url[:200]!r}")
        doc_id = url[len(CORPUS_SCHEME):]
        index = self._index_of.get(doc_id)
        if index is None:
            raise ToolError("no_results", f"no corpus document has id {doc_id[:100]!r}")
        title, text = split_contents(self.contents[index])
        return PageResult(url=url, title=title, content=text)

    async def aclose(self) -> None:
        return None
