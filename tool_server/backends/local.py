"""Offline backend: BM25 (``bm25s``) over a Search-R1/FlashRAG JSONL corpus; ``visit`` returns a stored passage.

Corpus line: ``{"id": str, "contents": "\\"<Title>\\"\\n<text>"}``; the title is the first line without its quotes.
Search results carry ``corpus://<id>`` URLs so a visit can follow a search.

Scale (wiki-18 has 21M passages, 14 GB): the index is built in one streamed pass over the file (one passage in
memory at a time, tokenised in chunks, progress on the log every ``progress_every_s``), written to disk and loaded
memory-mapped on later starts. Passage texts are never all held in memory: the index keeps each passage's byte
span in the JSONL and reads the line back for a snippet or a visit.

Index cache: ``<index_dir>/<corpus file name>.bm25/<key>/`` (``index_dir`` defaults to the corpus's folder). The
key is a sha256 over the corpus file's size, mtime (ns) and sha256 of its first and last MiB, plus the index format,
the bm25s version, the BM25 parameters and the tokenizer settings; any change to those rebuilds the index, and a
finished build removes the other keys' folders. An edit that keeps size and mtime and touches only the middle of
the file is not seen (editors and ``cp`` change the mtime). The corpus must not change while a server reads it.

Scores and order are those of ``bm25s.BM25().index(bm25s.tokenize(contents, stopwords="en"))``: the streamed
build computes the same float32 matrix with bm25s's own idf and term-frequency functions.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import bm25s
import numpy as np
from bm25s import scoring as bm25s_scoring
from bm25s.stopwords import STOPWORDS_EN

logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its logger to DEBUG on import

from ..errors import ToolError
from ..limits import Budget
from ..stats import Stats
from .base import PageResult, SearchHit

log = logging.getLogger(__name__)

CORPUS_SCHEME = "corpus://"
_SNIPPET_CHARS = 600

INDEX_FORMAT = 1  # bump when the files below or their meaning change
# bm25s.BM25() defaults, written out so the cache key names them
BM25_PARAMS = {"k1": 1.5, "b": 0.75, "delta": 0.5, "method": "lucene", "idf_method": "lucene", "dtype": "float32",
               "int_dtype": "int32"}
# bm25s.tokenize(..., stopwords="en") defaults; queries are tokenised by bm25s.tokenize itself
TOKEN_PATTERN = r"(?u)\b\w\w+\b"
_STOPWORDS = frozenset(STOPWORDS_EN)
_SAMPLE_BYTES = 1 << 20  # the key hashes the corpus's first and last MiB
_CHUNK_DOCS = 65_536  # passages tokenised per chunk before their (token, tf) pairs go to disk


def corpus_doc_id(url: str, backend: str) -> str:
    """The document id of a ``corpus://<id>`` URL (what search results link to); any other URL is a bad request of
    the ``backend`` named in the message (the corpus backends cannot fetch the web)."""
    if not url.startswith(CORPUS_SCHEME):
        raise ToolError("bad_request", f"the {backend} backend can only visit {CORPUS_SCHEME}<id> URLs taken from "
                                       f"search results, not {url[:200]!r}")
    return url[len(CORPUS_SCHEME):]


class CorpusError(ValueError):
    """The corpus file breaks the format (the message names the line), or its index cannot be written."""


def split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG convention: title = first line stripped of quotes, text = the remaining lines."""
    first, _, rest = contents.partition("\n")
    return first.strip().strip('"'), rest.strip()


def index_key(corpus_path: str | Path) -> str:
    """Cache key of the corpus's index: see the module docstring for what it covers."""
    path = Path(corpus_path)
    st = path.stat()
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(_SAMPLE_BYTES)).hexdigest()
        f.seek(max(0, st.st_size - _SAMPLE_BYTES))
        tail = hashlib.sha256(f.read(_SAMPLE_BYTES)).hexdigest()
    settings = {"format": INDEX_FORMAT, "bm25s": bm25s.__version__, "bm25": BM25_PARAMS,
                "tokenizer": {"pattern": TOKEN_PATTERN, "lower": True, "stopwords": sorted(_STOPWORDS)},
                "corpus": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_sha256": head, "tail_sha256": tail}}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _id_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")


def _parse_line(path: Path, lineno: int, line: bytes) -> tuple[str, str]:
    try:
        doc = json.loads(line.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str) or "id" not in doc:
        raise CorpusError(f"{path}:{lineno}: expected an object with 'id' and string 'contents' "
                          "(Search-R1/FlashRAG corpus format)")
    return str(doc["id"]), doc["contents"]


def _fmt_s(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def build_index(corpus_path: str | Path, out_dir: str | Path, progress_every_s: float = 10.0) -> dict:
    """Stream the corpus into a bm25s index in ``out_dir`` (which must be empty or absent); returns build facts.

    Pass 1 reads the JSONL line by line, tokenises each passage and writes its distinct (token id, tf) pairs to
    scratch files, keeping per passage only its byte span, id hash, length and distinct-token count. Pass 2, once
    the document frequencies and the mean length are known, scores the pairs chunk by chunk with bm25s's functions
    and places them by a counting sort straight into the memory-mapped CSC arrays that ``bm25s.BM25.load`` reads.
    """
    path, out = Path(corpus_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    size = max(1, path.stat().st_size)
    split = re.compile(TOKEN_PATTERN).findall
    stop = _STOPWORDS
    vocab: dict[str, int] = {}
    setdefault = vocab.setdefault
    spans, hashes, lengths, n_distinct = [], [], [], []  # per chunk arrays
    df = np.zeros(0, dtype=np.int64)
    n_docs = nnz = 0
    tok_file, tf_file = out / "pairs_tok.tmp", out / "pairs_tf.tmp"
    chunk_spans: list[tuple[int, int]] = []
    chunk_hashes: list[int] = []
    chunk_lens: list[int] = []
    flat: list[int] = []
    last_log = t0

    def flush() -> None:
        nonlocal df, nnz
        if not chunk_lens:
            return
        lens = np.asarray(chunk_lens, dtype=np.int64)
        tok = np.asarray(flat, dtype=np.int64)
        doc = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
        pairs, tf = np.unique((doc << 32) | tok, return_counts=True)  # sorted by passage, then token id
        u_tok = (pairs & 0xFFFFFFFF).astype(np.int32)
        n_distinct.append(np.bincount(pairs >> 32, minlength=len(lens)).astype(np.int32))
        u_tok.tofile(ftok)
        tf.astype(np.uint32).tofile(ftf)
        nnz += len(u_tok)
        if len(df) < len(vocab):
            df = np.concatenate([df, np.zeros(len(vocab) - len(df), dtype=np.int64)])
        df += np.bincount(u_tok, minlength=len(df))
        spans.append(np.asarray(chunk_spans, dtype=np.int64).reshape(-1, 2))
        hashes.append(np.asarray(chunk_hashes, dtype=np.uint64))
        lengths.append(lens)
        chunk_spans.clear(), chunk_hashes.clear(), chunk_lens.clear(), flat.clear()

    with path.open("rb") as f, tok_file.open("wb") as ftok, tf_file.open("wb") as ftf:
        offset = 0
        for lineno, line in enumerate(f, 1):
            start = offset
            offset += len(line)
            if not line.strip():
                continue
            doc_id, contents = _parse_line(path, lineno, line)
            chunk_spans.append((start, offset))
            chunk_hashes.append(_id_hash(doc_id))
            ids = [setdefault(t, len(vocab)) for t in split(contents.lower()) if t not in stop]
            chunk_lens.append(len(ids))
            flat.extend(ids)
            n_docs += 1
            if len(chunk_lens) == _CHUNK_DOCS:
                flush()
                now = time.perf_counter()
                if now - last_log >= progress_every_s:
                    last_log = now
                    rate, frac = n_docs / (now - t0), offset / size
                    log.info("BM25 index of %s: %d passages read, %.0f passages/s, %.1f%% of the file, ETA %s "
                             "(pass 1 of 2)", path.name, n_docs, rate, 100 * frac,
                             _fmt_s((now - t0) * (1 - frac) / max(frac, 1e-9)))
        flush()
    if n_docs == 0:
        raise CorpusError(f"{path}: the corpus is empty")
    t_pass1 = time.perf_counter() - t0

    spans_a = np.concatenate(spans)
    hashes_a = np.concatenate(hashes)
    lengths_a = np.concatenate(lengths)
    n_distinct_a = np.concatenate(n_distinct)
    del spans, hashes, lengths, n_distinct
    order = np.argsort(hashes_a, kind="stable")
    sorted_hashes = hashes_a[order]
    _check_unique_ids(path, spans_a, sorted_hashes, order)

    n_vocab = len(vocab)
    avg_doc_len = lengths_a.mean()  # as bm25s: float64 mean of the token counts
    idf = bm25s_scoring._build_idf_array(  # bm25s's own loop (math.log), so idf matches to the bit
        doc_frequencies={i: int(d) for i, d in enumerate(df[:n_vocab])}, n_docs=n_docs,
        compute_idf_fn=bm25s_scoring._select_idf_scorer(BM25_PARAMS["idf_method"]), dtype=BM25_PARAMS["dtype"])
    tfc_fn = bm25s_scoring._select_tfc_scorer(BM25_PARAMS["method"])
    indptr = np.zeros(n_vocab + 1, dtype=np.int64)
    np.cumsum(df[:n_vocab], out=indptr[1:])
    data_out = _npy_out(out / "data.csc.index.npy", np.float32, nnz)
    indices_out = _npy_out(out / "indices.csc.index.npy", np.int32, nnz)
    heads = indptr[:-1].copy()  # next free slot of each token's column
    pair_end = np.cumsum(n_distinct_a)
    tok_all = np.memmap(tok_file, dtype=np.int32, mode="r", shape=(nnz,)) if nnz else np.zeros(0, np.int32)
    tf_all = np.memmap(tf_file, dtype=np.uint32, mode="r", shape=(nnz,)) if nnz else np.zeros(0, np.uint32)
    for d0 in range(0, n_docs, _CHUNK_DOCS):
        d1 = min(n_docs, d0 + _CHUNK_DOCS)
        a, b = (int(pair_end[d0 - 1]) if d0 else 0), int(pair_end[d1 - 1])
        tok = np.asarray(tok_all[a:b])
        doc = np.repeat(np.arange(d0, d1, dtype=np.int32), n_distinct_a[d0:d1])
        tfc = tfc_fn(tf_array=tf_all[a:b].astype(np.float32), l_d=lengths_a[doc], l_avg=avg_doc_len,
                     k1=BM25_PARAMS["k1"], b=BM25_PARAMS["b"], delta=BM25_PARAMS["delta"])
        scores = (idf[tok] * tfc).astype(np.float32)
        # stable counting sort by token: within a column, passages stay in corpus order (bm25s's CSC order)
        by_tok = np.argsort(tok, kind="stable")
        tok_sorted = tok[by_tok]
        new_group = np.r_[True, tok_sorted[1:] != tok_sorted[:-1]]
        group_start = np.maximum.accumulate(np.where(new_group, np.arange(len(tok_sorted)), 0))
        slots = heads[tok_sorted] + (np.arange(len(tok_sorted)) - group_start)
        data_out[slots] = scores[by_tok]
        indices_out[slots] = doc[by_tok]
        heads += np.bincount(tok, minlength=n_vocab)
        now = time.perf_counter()
        if now - last_log >= progress_every_s:
            last_log = now
            log.info("BM25 index of %s: %d of %d passages scored (pass 2 of 2)", path.name, d1, n_docs)
    del tok_all, tf_all
    data_out.flush(), indices_out.flush()
    del data_out, indices_out
    tok_file.unlink(), tf_file.unlink()

    np.save(out / "indptr.csc.index.npy", indptr)
    vocab.setdefault("", n_vocab)  # bm25s adds the empty token at the end of the vocabulary
    (out / "vocab.index.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    params = {**BM25_PARAMS, "num_docs": n_docs, "version": bm25s.__version__, "backend": "numpy"}
    (out / "params.index.json").write_text(json.dumps(params, indent=4), encoding="utf-8")
    np.save(out / "spans.npy", spans_a)
    np.save(out / "id_hash.npy", sorted_hashes)
    np.save(out / "id_order.npy", order.astype(np.int64))
    facts = {"passages": n_docs, "vocabulary": n_vocab, "nonzeros": nnz, "pass1_s": round(t_pass1, 3),
             "build_s": round(time.perf_counter() - t0, 3)}
    log.info("BM25 index of %s: %d passages, %d terms, built in %.1f s", path.name, n_docs, n_vocab,
             facts["build_s"])
    return facts


def _npy_out(path: Path, dtype, n: int) -> np.ndarray:
    if n == 0:  # a zero-length file cannot be memory-mapped
        np.save(path, np.zeros(0, dtype=dtype))
        return np.zeros(0, dtype=dtype)
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(n,))


def _line_number(path: Path, offset: int) -> int:
    count, done = 1, 0
    with path.open("rb") as f:
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            count += block.count(b"\n")
            done += len(block)
    return count


def _check_unique_ids(path: Path, spans: np.ndarray, sorted_hashes: np.ndarray, order: np.ndarray) -> None:
    """Equal 64-bit id hashes are rare; read those passages back and fail on a true duplicate id."""
    same = np.flatnonzero(sorted_hashes[1:] == sorted_hashes[:-1])
    if not len(same):
        return
    with path.open("rb") as f:
        def doc_id(i: int) -> str:
            f.seek(int(spans[i, 0]))
            return _parse_line(path, 0, f.read(int(spans[i, 1] - spans[i, 0])))[0]

        dups = [max(int(order[j]), int(order[j + 1])) for j in same if doc_id(order[j]) == doc_id(order[j + 1])]
        if dups:
            later = min(dups)  # the first line that repeats an earlier id
            raise CorpusError(f"{path}:{_line_number(path, int(spans[later, 0]))}: duplicate id "
                              f"{doc_id(later)!r}; ids must be unique")


_INDEX_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy", "vocab.index.json",
                "params.index.json", "spans.npy", "id_hash.npy", "id_order.npy", "meta.json")


class LocalBackend:
    """BM25 over a JSONL corpus, its index cached on disk (see the module docstring).

    corpus_path: the JSONL file. index_dir: folder for the index cache (default: the corpus's folder).
    progress_every_s: seconds between progress lines on the log while an index is built.
    """

    name = "local"
    # Index searches are counted like an upstream's calls, so that /stats, the trainer's tools/* metrics and a
    # --budget-search cap (a rehearsal of a paid run's budget on the free index) behave as with the web backend.
    upstream_names: list[str] = ["local"]
    cacheable = False

    def __init__(self, corpus_path: str | Path, index_dir: str | Path | None = None,
                 progress_every_s: float = 10.0, stats: Stats | None = None, budget: int | None = None) -> None:
        self.stats = stats
        self.budget = Budget("local index search", budget, "--budget-search")
        if stats is not None:
            stats.upstream_budget["local"] = budget
        self.corpus_path = Path(corpus_path)
        key = index_key(self.corpus_path)
        self._digest = key[:16]
        root = Path(index_dir) if index_dir is not None else self.corpus_path.parent
        self.index_root = root / f"{self.corpus_path.name}.bm25"
        self.index_path = self.index_root / key[:16]
        self.built = False  # True when this start built the index, False when it loaded a cached one
        t0 = time.perf_counter()
        if not self._is_complete(key):
            self._build(key, progress_every_s)
            self.built = True
        self._retriever = bm25s.BM25.load(self.index_path, mmap=True)
        self._spans = np.load(self.index_path / "spans.npy", mmap_mode="r")
        self._id_hash = np.load(self.index_path / "id_hash.npy", mmap_mode="r")
        self._id_order = np.load(self.index_path / "id_order.npy", mmap_mode="r")
        self._fd = os.open(self.corpus_path, os.O_RDONLY)
        self.load_s = time.perf_counter() - t0
        log.info("BM25 index of %s (%d passages) %s %s in %.1f s", self.corpus_path.name, len(self._spans),
                 "built into" if self.built else "loaded from", self.index_path, self.load_s)

    def _is_complete(self, key: str) -> bool:
        try:
            meta = json.loads((self.index_path / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return meta.get("key") == key and all((self.index_path / name).is_file() for name in _INDEX_FILES)

    def _build(self, key: str, progress_every_s: float) -> None:
        tmp = self.index_root / f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise CorpusError(f"cannot write the BM25 index of {self.corpus_path} under {self.index_root} "
                              f"({exc.strerror or exc}); pass --index-dir DIR with a writable folder") from None
        try:
            facts = build_index(self.corpus_path, tmp, progress_every_s)
            facts["key"] = key
            facts["corpus"] = str(self.corpus_path.resolve())
            (tmp / "meta.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")
            if not self._is_complete(key):  # else another server finished first: keep theirs
                shutil.rmtree(self.index_path, ignore_errors=True)  # a partial folder of an interrupted build
                try:
                    tmp.rename(self.index_path)
                except OSError:  # another server renamed its build in between
                    if not self._is_complete(key):
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for stale in self.index_root.iterdir():  # indexes of earlier versions of the corpus
            if stale.is_dir() and not stale.name.startswith(".") and stale.name != self.index_path.name:
                shutil.rmtree(stale, ignore_errors=True)

    def __len__(self) -> int:
        return len(self._spans)

    def namespace(self, tool: str) -> str:
        return f"local:{self._digest}:{tool}"

    def _record(self, i: int) -> tuple[str, str]:
        start, end = self._spans[i]
        line = os.pread(self._fd, int(end - start), int(start))
        try:
            return _parse_line(self.corpus_path, 0, line)
        except CorpusError:
            raise ToolError("infra", f"{self.corpus_path} changed after the server indexed it; restart the "
                                     "server to rebuild the index") from None

    def _find(self, doc_id: str) -> int | None:
        h = np.uint64(_id_hash(doc_id))
        j = int(np.searchsorted(self._id_hash, h))
        while j < len(self._id_hash) and self._id_hash[j] == h:
            i = int(self._id_order[j])
            if self._record(i)[0] == doc_id:
                return i
            j += 1
        return None

    def document(self, doc_id: str) -> dict:
        index = self._find(doc_id)
        if index is None:
            raise KeyError(doc_id)
        return {"id": doc_id, "contents": self._record(index)[1]}

    def _top(self, scores: np.ndarray, topk: int) -> np.ndarray:
        """Indices of the ``topk`` best positive scores, best first; equal scores in corpus order."""
        positive = np.flatnonzero(scores > 0)
        values = scores[positive]
        if len(positive) > topk:  # keep everything tied with the k-th best, then order exactly
            kth = np.partition(values, len(values) - topk)[len(values) - topk]
            keep = values >= kth
            positive, values = positive[keep], values[keep]
        return positive[np.lexsort((positive, -values))][:topk]

    async def search_one(self, query: str, topk: int, deadline: float) -> list[SearchHit]:
        self.budget.charge()
        if self.stats is not None:
            self.stats.upstream_calls["local"] += 1
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        if not tokens:
            return []  # only stop words or punctuation: nothing to match
        scores = self._retriever.get_scores(tokens)
        hits = []
        for i in self._top(scores, topk):
            doc_id, contents = self._record(int(i))
            title, text = split_contents(contents)
            hits.append(SearchHit(title=title, url=CORPUS_SCHEME + doc_id, snippet=text[:_SNIPPET_CHARS],
                                  score=round(float(scores[i]), 6), doc_id=doc_id))
        return hits

    async def visit_one(self, url: str, goal: str, deadline: float) -> PageResult:
        doc_id = corpus_doc_id(url, self.name)
        index = self._find(doc_id)
        if index is None:
            raise ToolError("no_results", f"no corpus document has id {doc_id[:100]!r}")
        title, text = split_contents(self._record(index)[1])
        return PageResult(url=url, title=title, content=text)

    async def aclose(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
