"""BM25 backend at scale against plain bm25s: index build, memory and query latency on a synthetic corpus.

Writes a synthetic Search-R1/FlashRAG corpus of ``--passages`` N (1,000,000) passages to a temporary folder (never
into the repository): ~100 words each (normal, sd 15, at least 20), drawn from a Zipf-like vocabulary (p(rank r) ∝
1/r^1.07 over ``--vocab`` words, the most frequent ranks being real English stop words, as in running text), a
2-3 word title first. The queries are ``--queries`` (200) runs of 2-5 words taken from random passages, not all
stop words.

The baseline is bm25s in memory, as a Python user would run it (FlashRAG's bm25s retriever does the same): the JSONL
read into a list, ``bm25s.tokenize(contents, stopwords="en")``, ``BM25().index(...)``, and per query
``bm25s.tokenize`` + ``retrieve(k=5)`` with the hits' texts taken from the list. The index is built twice, by
``BM25()`` (its numpy index builder) and by ``BM25(backend="numba")`` with the numba index builder, and the faster
counts. bm25s 0.3.16's ``backend="numba"`` alone keeps the numpy builder (its NUMBA_DISABLE_JIT check is inverted), so
the script switches it on with ``activate_numba_csc()`` and compiles it before the timing. Queries use the numba
retrieval, compiled beforehand (the default numpy
backend partitions the whole score array per query, ~15 ms at 100K passages here; printed, not in the ratios).
Ours is ``tool_server``'s ``LocalBackend``: streamed build to disk, memory-mapped load, ``search_one(topk=5)``.
``--rounds`` (3) times, each side in a fresh process (ours first):

    ours     -- a fresh index: build_s (streamed build + cache write + memory-mapped load), then load_s (second
                start, the cached index), and the process's peak RSS (which counts the touched pages of the
                memory-mapped scratch and index files, where bm25s's memory is all heap)
    baseline -- build_s (read + tokenise + the faster index) and the process's peak RSS after the numpy build; then,
                in the same process, ours loaded from the cache, and the queries timed one at a time on both,
                alternating which side goes first; their top-5 hits are compared (scores, and the ids above each
                query's tie at the 5th score)

A machine's speed moves absolute times (on the same 2-core machine type our build of 200K passages took 15-28 s from
one run to the next), and both sides are pure-Python tokenisation at heart, so the headline is ours / baseline
measured side by side: build_s, query p50 and p95, peak RSS. Each figure is the median (min, max) over the rounds of
the per-round ratio. The absolute figures are printed on the line above the last, with the 21M build time a linear
extrapolation of ours (N → 21,015,324 passages of wiki-18), not a measurement. Exits 1 when a query's top-5 differs
(``compare_topk``), when a score differs by more than SCORE_TOL, or when no hit was compared by id.
Last line (medians): ``bm25: passages=<n> build_vs_bm25s=<r> query_p50_vs_bm25s=<r> query_p95_vs_bm25s=<r>
peak_rss_vs_bm25s=<r> topk_max_abs_diff=<d> topk_mismatches=<m>``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark_report import Rounds, check_rounds, machine_line  # noqa: E402

WIKI18_PASSAGES = 21_015_324  # psgs_w100 / wiki-18 as used by Search-R1 and FlashRAG
TOPK = 5
SCORE_TOL = 2e-6  # both sides sum the same float32 matrix entries; ours rounds its scores to 6 decimals


def generate(path: Path, n: int, vocab_size: int, seed: int) -> None:
    from bm25s.stopwords import STOPWORDS_EN

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    stop = list(dict.fromkeys(STOPWORDS_EN))
    words = set(stop)
    vocab = list(stop)
    while len(vocab) < vocab_size:
        w = "".join(rng.choice(letters, rng.integers(3, 11)))
        if w not in words:
            words.add(w)
            vocab.append(w)
    p = 1.0 / np.arange(1, vocab_size + 1) ** 1.07
    cdf = np.cumsum(p / p.sum())
    with path.open("w", encoding="utf-8") as f:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            lens = np.maximum(20, rng.normal(100, 15, m).astype(int))
            title_lens = rng.integers(2, 4, m)
            ids = np.searchsorted(cdf, rng.random(int(lens.sum() + title_lens.sum()))).tolist()
            pos, lines = 0, []
            for i in range(m):
                title = " ".join(vocab[j].capitalize() for j in ids[pos:pos + title_lens[i]])
                pos += title_lens[i]
                text = " ".join(map(vocab.__getitem__, ids[pos:pos + lens[i]]))
                pos += lens[i]
                lines.append(json.dumps({"id": str(start + i), "contents": f'"{title}"\n{text}.'}))
            f.write("\n".join(lines) + "\n")


def make_queries(corpus: Path, n_passages: int, n: int, seed: int) -> list[str]:
    """``n`` runs of 2-5 words from random passages' texts, each with at least one word that is not a stop word."""
    from bm25s.stopwords import STOPWORDS_EN

    from tool_server.backends.local import split_contents

    stop = frozenset(STOPWORDS_EN)
    rng = np.random.default_rng(seed + 1)
    wanted = rng.integers(0, n_passages, 2 * n)
    lines = set(wanted.tolist())
    texts = {}
    with corpus.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            if lineno in lines:
                texts[lineno] = split_contents(json.loads(line)["contents"])[1].rstrip(".").split()
    queries = []
    for i in wanted:
        words = texts[int(i)]
        k = int(rng.integers(2, 6))
        j = int(rng.integers(0, len(words) - k))
        if any(w not in stop for w in words[j:j + k]):
            queries.append(" ".join(words[j:j + k]))
        if len(queries) == n:
            return queries
    raise SystemExit(f"only {len(queries)} of {n} queries had a word that is not a stop word; raise --vocab")


def compare_topk(mine: list[tuple[str, float]], theirs: list[tuple[str, float]]) -> tuple[float, bool, int]:
    """One query's (url, score) hits, best first, on both sides: the largest score difference by rank, whether they
    differ, and how many of ours were compared by id. Hits tied (within SCORE_TOL) with the lower of the two last
    scores may be any of the tied passages, so only the ids scoring above that are compared, as sets."""
    if len(mine) != len(theirs):
        return float("inf"), True, 0
    if not mine:
        return 0.0, False, 0
    diff = max(abs(a[1] - b[1]) for a, b in zip(mine, theirs))
    cut = min(mine[-1][1], theirs[-1][1]) + SCORE_TOL
    above = {url for url, score in mine if score > cut}
    return diff, above != {url for url, score in theirs if score > cut}, len(above)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def side_ours(corpus: Path, index_dir: Path) -> dict:
    """A fresh index: build, then a second start from the cache; this process's peak RSS."""
    from tool_server.backends.local import LocalBackend

    shutil.rmtree(index_dir, ignore_errors=True)
    t = time.perf_counter()
    backend = LocalBackend(corpus, index_dir=index_dir, progress_every_s=15)
    build_s = time.perf_counter() - t
    assert backend.built
    meta = json.loads((backend.index_path / "meta.json").read_text())
    index_gb = sum(f.stat().st_size for f in backend.index_path.iterdir()) / 2**30
    asyncio.run(backend.aclose())
    del backend
    t = time.perf_counter()
    backend = LocalBackend(corpus, index_dir=index_dir)
    load_s = time.perf_counter() - t
    assert not backend.built
    asyncio.run(backend.aclose())
    return {"build_s": build_s, "load_s": load_s, "peak_rss_gb": peak_rss_gb(), "index_gb": index_gb,
            "pass1_s": meta["pass1_s"], "vocabulary": meta["vocabulary"], "nonzeros": meta["nonzeros"]}


def side_bm25s(corpus: Path, index_dir: Path, queries: list[str]) -> dict:
    """bm25s in memory: the corpus read and tokenised, then indexed by both backends (numpy, its default, then numba,
    compiled beforehand), the faster counting; this process's peak RSS after the first. Then ours from the cache,
    and the queries timed on ours and on bm25s's numba retrieval, alternating which goes first, their top-5 hits
    compared; then the numpy backend's retrieval timed alone."""
    import bm25s

    from tool_server.backends.local import CORPUS_SCHEME, LocalBackend, split_contents

    def tokenize(texts):
        return bm25s.tokenize(texts, stopwords="en", show_progress=False)

    t = time.perf_counter()
    ids, contents = [], []
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            ids.append(record["id"])
            contents.append(record["contents"])
    tokens = tokenize(contents)
    read_tokenise_s = time.perf_counter() - t
    t = time.perf_counter()
    plain = bm25s.BM25()
    plain.index(tokens, show_progress=False)
    index_s = {"numpy": time.perf_counter() - t}
    peak = peak_rss_gb()
    warm = bm25s.BM25(backend="numba")  # compile the numba kernels outside the timing
    warm.activate_numba_csc()  # backend="numba" alone leaves the numpy index builder in place (bm25s 0.3.16)
    warm.index(tokenize(contents[:100]), show_progress=False)
    warm.retrieve(bm25s.tokenize(contents[0], stopwords="en", return_ids=False, show_progress=False), k=TOPK,
                  show_progress=False)
    t = time.perf_counter()
    fast = bm25s.BM25(backend="numba")
    fast._np_csc = warm._np_csc  # the numba index builder, already compiled (activate_numba_csc would njit it anew)
    if not hasattr(fast._np_csc, "py_func"):  # a numba dispatcher; a bm25s that renamed or dropped it must not pass
        raise SystemExit(f"bm25s {bm25s.__version__}: activate_numba_csc() did not install a numba index builder; "
                         "update this script's baseline to the installed bm25s")
    fast.index(tokens, show_progress=False)
    index_s["numba"] = time.perf_counter() - t
    del tokens, warm

    def baseline(retriever, query: str) -> list[dict]:
        docs, scores = retriever.retrieve([bm25s.tokenize(query, stopwords="en", return_ids=False,
                                                          show_progress=False)[0]], k=TOPK, show_progress=False)
        hits = []
        for i, s in zip(docs[0].tolist(), scores[0].tolist()):
            if s > 0:
                title, text = split_contents(contents[i])
                hits.append({"title": title, "url": CORPUS_SCHEME + ids[i], "snippet": text[:600], "score": s})
        return hits

    ours = LocalBackend(corpus, index_dir=index_dir)
    assert not ours.built

    async def run() -> tuple[list[float], list[float], float, int, int]:
        await ours.search_one(queries[0], TOPK, float("inf"))  # first touch of the mapped files
        baseline(fast, queries[0])
        t_ours, t_base, max_diff, mismatches, compared = [], [], 0.0, 0, 0
        for n, q in enumerate(queries):
            for side in ((0, 1) if n % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if side == 0:
                    mine = await ours.search_one(q, TOPK, float("inf"))
                    t_ours.append(time.perf_counter() - t0)
                else:
                    theirs = baseline(fast, q)
                    t_base.append(time.perf_counter() - t0)
            diff, differs, n_ids = compare_topk([(h.url, h.score) for h in mine],
                                                [(h["url"], h["score"]) for h in theirs])
            max_diff, mismatches, compared = max(max_diff, diff), mismatches + differs, compared + n_ids
        await ours.aclose()
        return t_ours, t_base, max_diff, mismatches, compared

    t_ours, t_base, max_diff, mismatches, compared = asyncio.run(run())
    t_plain = []
    for q in queries:
        t0 = time.perf_counter()
        baseline(plain, q)
        t_plain.append(time.perf_counter() - t0)
    ms_ours, ms_base, ms_plain = (np.array(x) * 1000 for x in (t_ours, t_base, t_plain))
    return {"build_s": read_tokenise_s + min(index_s.values()), "read_tokenise_s": read_tokenise_s,
            "index_s": index_s, "peak_rss_gb": peak,
            "query_p50_ms": [float(np.percentile(ms_ours, 50)), float(np.percentile(ms_base, 50))],
            "query_p95_ms": [float(np.percentile(ms_ours, 95)), float(np.percentile(ms_base, 95))],
            "numpy_backend_query_p50_ms": float(np.percentile(ms_plain, 50)),
            "topk_max_abs_diff": max_diff, "topk_mismatches": mismatches, "topk_ids_compared": compared}


def run_side(side: str, corpus: Path, index_dir: Path, queries_file: Path) -> dict:
    out = queries_file.with_name(f"{side}.json")
    subprocess.run([sys.executable, __file__, "--side", side, "--corpus", str(corpus), "--index-dir", str(index_dir),
                    "--queries-file", str(queries_file), "--side-out", str(out)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=1_000_000)
    p.add_argument("--vocab", type=int, default=500_000, help="distinct words of the synthetic language")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="rounds of both sides, each building afresh (>= 3)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="folder for the corpus and index (default: a fresh temporary folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--generate-only", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--side", choices=["ours", "bm25s"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--index-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--queries-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--side-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate_only:
        generate(args.generate_only, args.passages, args.vocab, args.seed)
        return
    if args.side:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        if args.side == "ours":
            facts = side_ours(args.corpus, args.index_dir)
        else:
            facts = side_bm25s(args.corpus, args.index_dir, json.loads(args.queries_file.read_text()))
        args.side_out.write_text(json.dumps(facts))
        return

    check_rounds(args.rounds)
    print(machine_line("1 (each side in its own process, one at a time)"))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_bm25_"))
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / f"synthetic_{args.passages}.jsonl"
    try:
        if not corpus.exists():
            t = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--generate-only", str(corpus), "--passages",
                            str(args.passages), "--vocab", str(args.vocab), "--seed", str(args.seed)], check=True)
            print(f"generated {corpus} ({corpus.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)
        queries_file = workdir / "queries.json"
        queries_file.write_text(json.dumps(make_queries(corpus, args.passages, args.queries, args.seed)))
        index_dir = workdir / "index"
        names = ["build_s", "query_p50_ms", "query_p95_ms", "peak_rss_gb"]
        ratio = {k: Rounds() for k in names}
        absolute = {k: (Rounds(), Rounds()) for k in names}  # ours, bm25s
        load, diffs, mismatches, compared = Rounds(), [], 0, 0
        read_tok, idx_numpy, idx_numba, numpy_p50 = Rounds(), Rounds(), Rounds(), Rounds()
        for _ in range(args.rounds):
            ours = run_side("ours", corpus, index_dir, queries_file)
            base = run_side("bm25s", corpus, index_dir, queries_file)
            pairs = {"build_s": (ours["build_s"], base["build_s"]), "peak_rss_gb": (ours["peak_rss_gb"],
                     base["peak_rss_gb"]), "query_p50_ms": base["query_p50_ms"], "query_p95_ms": base["query_p95_ms"]}
            for k, (a, b) in pairs.items():
                ratio[k].append(a / b)
                absolute[k][0].append(a)
                absolute[k][1].append(b)
            load.append(ours["load_s"])
            read_tok.append(base["read_tokenise_s"])
            idx_numpy.append(base["index_s"]["numpy"])
            idx_numba.append(base["index_s"]["numba"])
            numpy_p50.append(base["numpy_backend_query_p50_ms"])
            diffs.append(base["topk_max_abs_diff"])
            mismatches += base["topk_mismatches"]
            compared += base["topk_ids_compared"]
        print(f"corpus {corpus.stat().st_size / 2**30:.2f} GiB, {ours['vocabulary']} terms, {ours['nonzeros']} "
              f"postings; our index {ours['index_gb']:.2f} GiB on disk; our pass 1 (read+tokenise) "
              f"{ours['pass1_s']:.1f} s of the build (last round); {args.queries} queries per round, 2-5 words")
        for k in names:
            print(f"{k}: ours / bm25s {ratio[k].describe('.3f')}; ours {absolute[k][0].describe('.2f')}; bm25s "
                  f"{absolute[k][1].describe('.2f')}")
        print(f"bm25s's build: read + tokenise {read_tok.describe('.2f')} s; index, numpy backend "
              f"{idx_numpy.describe('.2f')} s, numba backend {idx_numba.describe('.2f')} s (the faster counts); "
              f"query p50 with its default numpy backend (timed alone, not in the ratios) {numpy_p50.describe('.2f')} "
              "ms")
        print(f"our cached load_s {load.describe('.2f')}; top-{TOPK} hits over {args.rounds} x {args.queries} "
              f"queries: max |score diff| {max(diffs):.2e}, {mismatches} queries with different hits ({compared} hits "
              "compared by id, above each query's tie at the 5th score)")
        extrap_h = absolute["build_s"][0].median * WIKI18_PASSAGES / args.passages / 3600
        print(f"absolute (this machine, moves with its speed): passages={args.passages} build_s="
              f"{absolute['build_s'][0].median:.1f} bm25s_build_s={absolute['build_s'][1].median:.1f} load_s="
              f"{load.median:.2f} query_p50_ms={absolute['query_p50_ms'][0].median:.2f} query_p95_ms="
              f"{absolute['query_p95_ms'][0].median:.2f} peak_rss_gb={absolute['peak_rss_gb'][0].median:.2f} "
              f"bm25s_peak_rss_gb={absolute['peak_rss_gb'][1].median:.2f} extrapolated_21M_build_h={extrap_h:.2f} "
              f"(linear in passages, an estimate)")
        print(f"bm25: passages={args.passages} build_vs_bm25s={ratio['build_s'].median:.3f} "
              f"query_p50_vs_bm25s={ratio['query_p50_ms'].median:.3f} "
              f"query_p95_vs_bm25s={ratio['query_p95_ms'].median:.3f} "
              f"peak_rss_vs_bm25s={ratio['peak_rss_gb'].median:.3f} topk_max_abs_diff={max(diffs):.2e} "
              f"topk_mismatches={mismatches}")
        if mismatches or compared == 0 or max(diffs) > SCORE_TOL:
            print(f"FAILED: {mismatches} queries' top-{TOPK} hits differ from bm25s's, max score diff {max(diffs):.2e} "
                  f"(tolerance {SCORE_TOL}), {compared} hits compared by id (must be > 0)", file=sys.stderr)
            sys.exit(1)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
