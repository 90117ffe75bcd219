"""BM25 backend at scale: streamed index build, cached reload and query latency on a synthetic corpus.

Writes a synthetic Search-R1/FlashRAG corpus of ``--passages`` N (1,000,000) passages to a temporary folder (never
into the repository): ~100 words each (normal, sd 15, at least 20), drawn from a Zipf-like vocabulary (p(rank r) ∝
1/r^1.07 over ``--vocab`` words, the most frequent ranks being real English stop words, as in running text), a
2-3 word title first. Then, in this process, ``--rounds`` (3) times (a fresh index each round):

    build_s  -- first ``LocalBackend`` start: streamed build + cache write + memory-mapped load
    load_s   -- second start: the cached index, memory-mapped
    query    -- ``--queries`` (200) searches of 2-5 words taken from random passages, topk 5, one at a time
    peak_rss -- this process's peak resident memory (the corpus is generated in a child process)

Each figure is printed as median (min, max) over the rounds; peak_rss is over the whole run. The 21M figure is a
linear extrapolation of the median build_s (N → 21,015,324 passages of wiki-18), not a measurement. Last line (medians): ``bm25: passages=<n> build_s=<t> load_s=<t> query_p50_ms=<x> query_p95_ms=<y> peak_rss_gb=<m>
extrapolated_21M_build_h=<h>``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmark_report import Rounds, check_rounds, machine_line  # noqa: E402

WIKI18_PASSAGES = 21_015_324  # psgs_w100 / wiki-18 as used by Search-R1 and FlashRAG


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


def rss_gb(peak: bool) -> float:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def query_latencies(backend, n: int, seed: int) -> tuple[np.ndarray, int]:
    """Milliseconds of ``n`` searches of 2-5 words taken from random passages (topk 5, one at a time), and how many
    had hits; closes the backend."""
    rng = np.random.default_rng(seed + 1)
    queries = []
    for i in rng.integers(0, len(backend), n):
        words = backend._record(int(i))[1].split("\n", 1)[1].rstrip(".").split()
        k = int(rng.integers(2, 6))
        j = int(rng.integers(0, len(words) - k))
        queries.append(" ".join(words[j:j + k]))

    async def run() -> tuple[list[float], int]:
        await backend.search_one(queries[0], 5, float("inf"))  # first touch of the mapped files
        times, found = [], 0
        for q in queries:
            t0 = time.perf_counter()
            hits = await backend.search_one(q, 5, float("inf"))
            times.append(time.perf_counter() - t0)
            found += bool(hits)
        await backend.aclose()
        return times, found

    times, found = asyncio.run(run())
    return np.array(times) * 1000, found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=1_000_000)
    p.add_argument("--vocab", type=int, default=500_000, help="distinct words of the synthetic language")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="index builds, each loaded and queried (>= 3)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="folder for the corpus and index (default: a fresh temporary folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--generate-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate_only:
        generate(args.generate_only, args.passages, args.vocab, args.seed)
        return

    check_rounds(args.rounds)
    print(machine_line("1 (build and queries in this process)"))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from tool_server.backends.local import LocalBackend

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
        index_dir = workdir / "index"
        build, load, p50, p95 = Rounds(), Rounds(), Rounds(), Rounds()
        for _ in range(args.rounds):
            shutil.rmtree(index_dir, ignore_errors=True)
            t = time.perf_counter()
            backend = LocalBackend(corpus, index_dir=index_dir, progress_every_s=15)
            build.append(time.perf_counter() - t)
            assert backend.built
            meta = json.loads((backend.index_path / "meta.json").read_text())
            index_gb = sum(f.stat().st_size for f in backend.index_path.iterdir()) / 2**30
            del backend

            t = time.perf_counter()
            backend = LocalBackend(corpus, index_dir=index_dir)
            load.append(time.perf_counter() - t)
            assert not backend.built
            rss_loaded = rss_gb(peak=False)
            lat_ms, found = query_latencies(backend, args.queries, args.seed)
            p50.append(np.percentile(lat_ms, 50))
            p95.append(np.percentile(lat_ms, 95))
        peak = rss_gb(peak=True)
        extrap_h = build.median * WIKI18_PASSAGES / args.passages / 3600
        print(f"corpus {corpus.stat().st_size / 2**30:.2f} GiB, {meta['vocabulary']} terms, {meta['nonzeros']} "
              f"postings; index {index_gb:.2f} GiB on disk; pass 1 (read+tokenise) {meta['pass1_s']:.1f} s of "
              f"{meta['build_s']:.1f} s build (last round); RSS after cached load {rss_loaded:.2f} GiB; {found} of "
              f"{args.queries} "
              "queries had hits (the rest were all stop words)")
        print(f"extrapolated_21M_build_h is linear in passages: build_s x {WIKI18_PASSAGES:,} / {args.passages:,} "
              "(an estimate, not a measurement)")
        print(f"build_s {build.describe('.1f')}; load_s {load.describe('.2f')}; query_p50_ms {p50.describe('.1f')}; "
              f"query_p95_ms {p95.describe('.1f')}")
        print(f"bm25: passages={args.passages} build_s={build.median:.1f} load_s={load.median:.2f} "
              f"query_p50_ms={p50.median:.1f} query_p95_ms={p95.median:.1f} peak_rss_gb={peak:.2f} "
              f"extrapolated_21M_build_h={extrap_h:.2f}")
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
