"""Benchmark similarity step groups: ``similarity_clusters`` against the rule applied literally
(``similarity_clusters_reference``), on the anchor texts of one long-horizon training step.

Batch: 64 prompts x 8 rollouts x 200 turns = 102,400 step rows in row order (prompt group by prompt group,
trajectory by trajectory, turn by turn), threshold τ = 0.9 (verl-agent's search recipe). The anchors look like the
local search tool's observations, built from data/wiki_passages_1000.jsonl (passages of 518-931 characters):
    turn 0:     the group's question (one text per group);
    turns >= 1, drawn per row:
        30%  an earlier observation of the group again, exactly (the same call repeated);
        15%  a near duplicate: an earlier observation with 1-3 characters substituted;
         5%  "No results found for '<3 words>'. Try a more general query.";
        10%  a page visit, "Page corpus://<id> (Title: ...)" and one of the group's 40 topic passages;
        40%  a new search result, "A search for '<2-4 words>' found k results:" and k = 1-3 passages, each one of the
             group's 40 topic passages (80%) or any passage (20%): results of one question often share a passage.
The realised mix and the lengths are printed.

Sides, same input, same τ:
    fast:      ``similarity_clusters`` (one clustering per distinct text, upper bounds of difflib's ratio, difflib
               indices kept per representative; igpo/core/anchor_similarity.py).
    reference: ``similarity_clusters_reference``: one difflib ratio per (row, representative) until the first match.
The reference makes about one difflib call per (row, earlier cluster of its group): hundreds of thousands per prompt
group here, minutes per group, hours per step. So it runs on a prefix of prompt group 0 (``--reference-rows``). A
prefix is a valid input with the same answer: a row's cluster depends only on the rows before it, so the prefix's
partition must equal the first rows of the fast side's full-batch partition (checked). The reference's time for the
whole batch is scaled from the prefix by the number of difflib calls it makes, which a partition gives exactly: a row
that joins the c-th cluster of its group (in order of creation, from 0) costs c + 1 calls, a row that starts a
cluster one per cluster its group has then.

Timing: R rounds (3), each the reference and the fast side on the prefix, in alternating order, then the fast side
on the full batch once (a minute or more of one core). Each time is taken in wall seconds and in this process's CPU
seconds: the machine is shared, and the CPU time leaves out the waits for other load (printed at the start).
speedup_on_prefix = reference / fast per round, median (min, max); speedup_per_step = the reference's scaled
full-batch time (median round) / the fast side's full-batch time; each also in CPU time (_cpu). Difflib calls of
each side on prompt group 0 are counted in an extra, untimed run. Exits 1 if a partition differs. Last line:
    similarity: seconds_per_step=<fast, full batch, wall> cpu_seconds_per_step=<same, CPU>
    reference_cpu_seconds_per_step_scaled=<s> speedup_per_step=<x>x speedup_per_step_cpu=<x>x
    speedup_on_prefix=<y>x speedup_on_prefix_cpu=<y>x rows=<n> clusters=<k> threshold=<τ> same_partition=<bool>
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import Counter
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmark_report, its neighbour

from benchmark_report import Rounds, check_rounds, machine_line, timed  # noqa: E402

from igpo.core import anchor_similarity  # noqa: E402
from igpo.core.anchor_similarity import similarity_clusters, similarity_clusters_reference  # noqa: E402

PASSAGES = ROOT / "data" / "wiki_passages_1000.jsonl"
KINDS = ("question", "repeat", "near_duplicate", "no_results", "page", "search")


def read_passages() -> list[tuple[str, str]]:
    """(title, body) of each passage (``"Title"\\nbody`` in its ``contents``)."""
    out = []
    for line in PASSAGES.read_text().splitlines():
        title, _, body = json.loads(line)["contents"].partition("\n")
        out.append((title.strip('"'), body))
    return out


def batch(seed: int, prompts: int, rollouts: int, turns: int) -> tuple[list[str], list[int], list[str]]:
    """(anchor texts, prompt group per row, kind per row) in row order, drawn as the module docstring says."""
    rng = random.Random(seed)
    passages = read_passages()
    words = [w for _, body in passages[:200] for w in body.split() if w.isalpha() and len(w) > 3]
    texts, groups, kinds = [], [], []
    for g in range(prompts):
        topic = rng.sample(range(len(passages)), 40)
        question = (f"Answer the question, searching as needed: what is known about {passages[topic[0]][0]} and "
                    f"{rng.choice(words)}?")
        seen: list[str] = []
        for _ in range(rollouts):
            for t in range(turns):
                u = rng.random()
                if t == 0:
                    text, kind = question, "question"
                elif seen and u < 0.30:
                    text, kind = rng.choice(seen), "repeat"
                elif seen and u < 0.45:
                    chars = list(rng.choice(seen))
                    for _ in range(rng.randint(1, 3)):
                        chars[rng.randrange(len(chars))] = rng.choice("0123456789abcdefghij")
                    text, kind = "".join(chars), "near_duplicate"
                elif u < 0.50:
                    query = " ".join(rng.sample(words, 3))
                    text, kind = f"No results found for '{query}'. Try a more general query.", "no_results"
                elif u < 0.60:
                    d = rng.choice(topic)
                    text, kind = f"Page corpus://{d} (Title: {passages[d][0]})\n{passages[d][1]}", "page"
                else:
                    k = rng.randint(1, 3)
                    docs = [rng.choice(topic) if rng.random() < 0.8 else rng.randrange(len(passages)) for _ in range(k)]
                    query = " ".join(rng.sample(words, rng.randint(2, 4)))
                    text = f"A search for '{query}' found {k} results:\n\n" + "\n\n".join(
                        f"{n + 1}. [{passages[d][0]}](corpus://{d})\n{passages[d][1]}" for n, d in enumerate(docs))
                    kind = "search"
                if t > 0 and text not in seen:
                    seen.append(text)
                texts.append(text)
                groups.append(g)
                kinds.append(kind)
    return texts, groups, kinds


def reference_calls(groups: list[int], ids: list[int]) -> int:
    """difflib calls the literal rule makes for this partition (module docstring)."""
    created: dict[int, dict[int, int]] = {}  # group -> cluster id -> its rank in the group
    calls = 0
    for g, cluster in zip(groups, ids):
        ranks = created.setdefault(g, {})
        if cluster in ranks:
            calls += ranks[cluster] + 1
        else:
            calls += len(ranks)
            ranks[cluster] = len(ranks)
    return calls


def relabel(ids: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    return [seen.setdefault(i, len(seen)) for i in ids]


def fast_difflib_calls(texts: list[str], groups: list[int], threshold: float) -> int:
    """How many difflib ratios the fast side computes on this input (an untimed run with a counting matcher)."""
    calls = 0

    class Counting(SequenceMatcher):
        def ratio(self):
            nonlocal calls
            calls += 1
            return super().ratio()

    anchor_similarity.SequenceMatcher = Counting
    try:
        similarity_clusters(texts, groups, threshold)
    finally:
        anchor_similarity.SequenceMatcher = SequenceMatcher
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--reference-rows", type=int, default=250,
                        help="rows of prompt group 0 the reference clusters each round (its cost grows about "
                             "quadratically: 250 take 20-40 s on two shared cores)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds on the prefix (>= 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    check_rounds(args.rounds)
    torch.set_num_threads(1)
    print(machine_line(1))

    texts, groups, kinds = batch(args.seed, args.prompts, args.rollouts, args.turns)
    n = len(texts)
    lengths = np.array([len(t) for t in texts])
    mix = Counter(kinds)
    print(f"batch: {args.prompts} prompts x {args.rollouts} rollouts x {args.turns} turns = {n} step rows, "
          f"{len(set(zip(groups, texts)))} distinct (group, text) pairs; threshold {args.threshold}")
    print("  mix: " + ", ".join(f"{k} {mix[k] / n:.1%}" for k in KINDS))
    print(f"  lengths (characters): min {lengths.min()}, median {int(np.median(lengths))}, p90 "
          f"{int(np.percentile(lengths, 90))}, max {lengths.max()}; mean {lengths.mean():.0f}")

    prefix = min(args.reference_rows, groups.count(0))
    sub_texts, sub_groups = texts[:prefix], groups[:prefix]
    assert set(sub_groups) == {0}, "the batch is in row order: prompt group 0 first"
    similarity_clusters(sub_texts[:20], sub_groups[:20], args.threshold)  # warm-up (imports, first allocations)
    seconds = {"reference": [], "fast": []}
    cpu = {"reference": [], "fast": []}
    results = {}
    for r in range(args.rounds):
        sides = [("reference", similarity_clusters_reference), ("fast", similarity_clusters)]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            results[name], s, c = timed(lambda fn=fn: fn(sub_texts, sub_groups, args.threshold))
            seconds[name].append(s)
            cpu[name].append(c)
    full, fast_seconds, fast_cpu = timed(lambda: similarity_clusters(texts, groups, args.threshold))
    full = full.tolist()

    same_prefix = torch.equal(results["fast"], results["reference"])
    same_as_full = relabel(results["reference"].tolist()) == relabel(full[:prefix])
    calls_prefix = reference_calls(sub_groups, results["reference"].tolist())
    calls_full = reference_calls(groups, full)
    group0 = groups.count(0)
    calls_group0 = reference_calls(groups[:group0], full[:group0])
    fast_calls_group0 = fast_difflib_calls(texts[:group0], groups[:group0], args.threshold)
    ratio_prefix = [ref / fast for ref, fast in zip(seconds["reference"], seconds["fast"])]
    ratio_prefix_cpu = [ref / fast for ref, fast in zip(cpu["reference"], cpu["fast"])]
    reference_step = [s * calls_full / calls_prefix for s in seconds["reference"]]
    reference_step_cpu = [c * calls_full / calls_prefix for c in cpu["reference"]]
    sizes = np.bincount(np.asarray(full))
    first: dict[int, str] = {}
    joined = sum(first.setdefault(c, text) != text for text, c in zip(texts, full))

    for name, values in seconds.items():
        print(f"  {name} on the prefix ({prefix} rows of group 0) per round: "
              f"{', '.join(f'{s:.3f}' for s in values)} s wall, {', '.join(f'{c:.3f}' for c in cpu[name])} s CPU")
    print(f"  speedup on the prefix {Rounds(ratio_prefix).describe('.0f', 'x')}; in CPU time "
          f"{Rounds(ratio_prefix_cpu).describe('.0f', 'x')}")
    print(f"  fast side, full batch: {fast_seconds:.1f} s wall, {fast_cpu:.1f} s CPU ({fast_cpu / args.prompts:.2f} s "
          f"CPU per prompt group of {n // args.prompts} rows); {len(sizes)} clusters, sizes 1..{sizes.max()}, "
          f"{(sizes >= 2).sum()} of size >= 2 holding {sizes[sizes >= 2].sum() / n:.1%} of the rows, "
          f"{joined} rows joined by similarity (their text differs from the representative's)")
    print(f"  reference difflib calls: prefix {calls_prefix:,}, group 0 {calls_group0:,}, full batch {calls_full:,} "
          f"(~{statistics.median(cpu['reference']) / calls_prefix * 1e3:.2f} ms CPU each on the prefix); "
          f"the fast side computes {fast_calls_group0:,} difflib ratios on group 0 "
          f"({calls_group0 / max(fast_calls_group0, 1):.0f}x fewer)")
    print(f"  reference for the full batch, scaled by calls: {Rounds(reference_step).describe('.0f', ' s')} wall, "
          f"{Rounds(reference_step_cpu).describe('.0f', ' s')} CPU "
          f"(= {statistics.median(reference_step_cpu) / 3600:.1f} h of CPU per step)")
    print(f"  partitions: fast == reference on the prefix: {same_prefix}; reference prefix == first rows of the fast "
          f"full-batch partition: {same_as_full}")
    speedup_step = statistics.median(reference_step) / fast_seconds
    speedup_step_cpu = statistics.median(reference_step_cpu) / fast_cpu
    print(f"similarity: seconds_per_step={fast_seconds:.1f} cpu_seconds_per_step={fast_cpu:.1f} "
          f"reference_cpu_seconds_per_step_scaled={statistics.median(reference_step_cpu):.0f} "
          f"speedup_per_step={speedup_step:.0f}x speedup_per_step_cpu={speedup_step_cpu:.0f}x "
          f"speedup_on_prefix={statistics.median(ratio_prefix):.0f}x speedup_on_prefix_cpu="
          f"{statistics.median(ratio_prefix_cpu):.0f}x rows={n} clusters={len(sizes)} threshold={args.threshold} "
          f"same_partition={same_prefix and same_as_full}")
    if not (same_prefix and same_as_full):
        print("FAIL: the fast and the literal clustering disagree; run tests/core/test_gigpo_similarity.py.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
