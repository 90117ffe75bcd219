"""Similarity step groups: anchor texts clustered as verl-agent's similarity mode clusters them, exactly and fast.

The rule (verl-agent's ``build_step_group(..., enable_similarity=True, similarity_thresh=τ)``, which its search
recipe runs with τ = 0.9; ``docs/methods/gigpo.md``). Within each prompt group, rows are visited in the given order;
row k with text x_k joins the first existing cluster c, in order of creation, whose representative r_c (the text of
the cluster's first row) satisfies

    ratio(x_k, r_c) ≥ τ,    ratio(a, b) = difflib.SequenceMatcher(None, a, b).ratio() = 2·M(a, b) / (|a| + |b|),

and otherwise starts a new cluster with x_k as its representative. M(a, b) is the number of characters in difflib's
matching blocks (ratio('', '') = 1), τ is in (0, 1). difflib's default ``autojunk`` is on: when |b| ≥ 200, a
character occurring more than |b| // 100 + 1 times in b is "popular" and cannot seed a match (a match can still
extend over it). So ratio is not symmetric, and the order is the rule's: the row's text first, the representative
second. Clusters never cross prompt groups, and membership is not transitive (a text close to a later member but not
to the representative starts its own cluster).

``similarity_clusters_reference`` applies the rule literally: one difflib comparison per (row, representative) pair
until the first match, O(rows × clusters) comparisons per group, each about O(|a|·|b|/100). ``similarity_clusters``
gives the same partition; difflib's own ratio still makes every decision it is asked for, but it is asked far less:

1. Identical texts. ratio(x, x) = 1 for every x: with no junk function, the longest match difflib finds of a string
   against itself lies on the diagonal and extends over the whole string. Clusters are only appended and their
   representatives never change, so a text equal to an earlier text of its group sees the same ratios to the same
   earlier clusters and lands where its first copy landed: only the first copy of each text is clustered.
2. Upper bounds. With N = |a| + |b|, ratio(a, b) ≥ τ exactly when M ≥ m_τ, the least integer m with 2.0·m / N ≥ τ
   in floating point (difflib's own expression), so a representative whose upper bound of M is below m_τ is skipped.
   The matching blocks are a common subsequence, and autojunk only removes matches, so
       (a) M ≤ min(|a|, |b|)                        difflib's real_quick_ratio;
       (b) M ≤ Σ_c min(n_a(c), n_b(c))              difflib's quick_ratio: the multiset intersection of characters;
       (c) M ≤ (I₃ + 2·(N + 1)) / 5                 I₃ the multiset intersection of the two texts' trigrams;
       (d) M ≤ the seed cover, whenever M ≥ m_τ     (below).
   (c): a trigram of a whose characters are matched to three adjacent characters of b is a trigram of b. Of a's
   |a| − 2 trigrams at most 3·(|a| − M) contain an unmatched character, and at most 2·(|b| − M) contain two adjacent
   matched characters whose partners are not adjacent (an unmatched character of b lies between them, a different one
   for each such pair, and a pair lies in at most two trigrams): I₃ ≥ |a| − 2 − 3·(|a| − M) − 2·(|b| − M).
   (b) and (c) count over buckets (non-ASCII characters and all trigrams are hashed into a fixed number), which can
   only raise an intersection. They are computed for all representatives of the group at once with numpy.
   (d) catches what (a)-(c), blind to order, let through: two search results sharing one passage of three pass them
   at τ = 0.9. It follows how difflib builds its blocks (the longest match of a range first, then the same left and
   right of it). A block either contains a seed, a pair a[i] = b[j] with b[j] not popular (the only pairs its
   longest-match search starts from), or grows from the corner of a range that has no seed; a range's corner is
   (0, 0) or the first pair after an earlier block, where a and b differ, so such a block is empty or the common
   prefix of a and b. If M ≥ m_τ, every matched pair (i, j) lies in the band m_τ − |a| ≤ j − i ≤ |b| − m_τ (with
   k pairs matched before it, i − k ≤ |a| − M and j − k ≤ |b| − M characters are unmatched). A block lies in the
   maximal run of equal characters along the diagonal of its pairs, so M ≤ the seed cover: the number of positions
   of a in the common prefix or in the diagonal run through a seed in the band. A cover below m_τ means M < m_τ.
   The seeds come from each representative's sorted (character, position) index; runs are followed along their
   diagonal with numpy, a run through several seeds once. (Where that would take too much memory, long texts of
   many distinct characters at a low τ, the bound is skipped: difflib decides, as without it.)
3. The representative is always difflib's second sequence, whose index (``set_seq2``) is built once per
   representative and kept; only the first sequence changes between comparisons.

Every representative that survives the bounds is compared with difflib itself, in order of creation, until the first
match. Pure functions (numpy, torch, difflib): no verl, no Ray, no I/O. ``tests/core/test_gigpo_similarity.py`` checks
both functions against partitions recorded from verl-agent's own ``build_step_group``, against each other, and the
bounds against difflib; ``scripts/bench/bench_gigpo_similarity.py`` times them.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from difflib import SequenceMatcher

import numpy as np
import torch
from torch import Tensor

# Character-count columns: one per ASCII character, the other characters hashed into the rest.
_ASCII = 128
_CHAR_COLUMNS = _ASCII + 64
# Trigram buckets: fewer buckets merge more trigrams and weaken bound (c) (at 1024 it passed about 35 times as many
# pairs of unrelated search results as at 4096, measured on wiki passages); more cost memory and time per
# representative (8 KiB each at uint16).
_TRIGRAM_BUCKETS = 4096
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads the codes over the top bits
_PRIME = np.uint64(1_000_003)
# Seed keys pack (candidate, character, position) into one int64, so one searchsorted finds every seed.
_POSITION_BITS = 32
_CODE_BITS = 21  # Unicode code points are below 2**21
_CANDIDATE_SHIFT = _POSITION_BITS + _CODE_BITS
_MAX_CANDIDATES = 2 ** (63 - _CANDIDATE_SHIFT)
_DIAGONAL_BITS = 40  # diagonals j − i of texts below 2**39 characters, under the candidate in one sort key
_PAD = 256  # sentinels around every text in the seed cover: the widest window a run is followed by
# Work limits of the seed cover: (candidate, position of a) pairs per call, and seeds per call. Past the second (long
# texts of many distinct characters at a low threshold) the bound is skipped for those candidates, which is safe:
# difflib then decides, as without the bound.
_CHUNK = 1 << 22
_MAX_SEEDS = 1 << 23


def similarity_clusters(texts: Sequence[str], group: Sequence[int] | Tensor, threshold: float) -> Tensor:
    """[N] long cluster ids of ``texts`` under the rule of the module docstring: ``texts[k]`` belongs to prompt group
    ``group[k]``; rows are visited in the given order; ids are dense, numbered by first appearance in ``texts``, and
    never shared across groups. ``threshold`` τ is in (0, 1). The same partition as
    ``similarity_clusters_reference``, with difflib called only where the bounds leave a representative in play."""
    texts, groups, threshold = _checked(texts, group, threshold)
    local = np.zeros(len(texts), dtype=np.int64)
    for rows in _rows_by_group(groups):
        distinct: dict[str, int] = {}
        copy_of = np.array([distinct.setdefault(texts[k], len(distinct)) for k in rows], dtype=np.int64)
        clusters = _Clusters(threshold, longest=max(map(len, distinct)))
        local[rows] = np.array([clusters.place(text) for text in distinct], dtype=np.int64)[copy_of]
    return _dense_by_first_appearance(groups, local)


def similarity_clusters_reference(texts: Sequence[str], group: Sequence[int] | Tensor, threshold: float) -> Tensor:
    """The rule as written, one difflib comparison per (row, representative) pair until the first match: the
    readable version that ``similarity_clusters`` must agree with. Same arguments and result."""
    texts, groups, threshold = _checked(texts, group, threshold)
    clusters: dict[int, list[tuple[str, int]]] = {}  # prompt group -> [(representative, cluster id)] by creation
    count = 0
    ids = []
    for text, g in zip(texts, groups.tolist()):
        reps = clusters.setdefault(g, [])
        found = next((cid for rep, cid in reps if SequenceMatcher(None, text, rep).ratio() >= threshold), None)
        if found is None:
            found, count = count, count + 1
            reps.append((text, found))
        ids.append(found)
    return torch.tensor(ids, dtype=torch.long)


def _checked(texts: Sequence[str], group: Sequence[int] | Tensor,
             threshold: float) -> tuple[list[str], np.ndarray, float]:
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold={threshold!r} must be a number in (0, 1), as in verl-agent's similarity mode: a "
                         "ratio of 1 means identical texts (use exact step groups for that), 0 would join everything.")
    texts = list(texts)
    for k, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{k}] is a {type(text).__name__}, not a str: similarity step groups compare "
                            "decoded text; decode token ids (or bytes) before grouping.")
    groups = group.detach().cpu().numpy() if isinstance(group, Tensor) else np.asarray(group)
    if groups.ndim != 1 or len(groups) != len(texts):
        raise ValueError(f"group has shape {tuple(groups.shape)} but texts has {len(texts)} entries: pass one prompt-"
                         "group id per text.")
    if len(groups) and not np.issubdtype(groups.dtype, np.integer):
        raise ValueError(f"group must hold integer prompt-group ids; got dtype {groups.dtype}. Map uids to integers "
                         "first (equal uid, equal id).")
    return texts, groups.astype(np.int64), float(threshold)


def _rows_by_group(groups: np.ndarray) -> list[np.ndarray]:
    """The row indices of each prompt group, in row order (groups are independent: each is clustered alone)."""
    order = np.argsort(groups, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(groups[order])) + 1) if len(order) else []


def _dense_by_first_appearance(groups: np.ndarray, local: np.ndarray) -> Tensor:
    """Global ids for the (prompt group, local cluster) pairs, numbered by the pair's first row."""
    if not len(groups):
        return torch.zeros(0, dtype=torch.long)
    _, first, inverse = np.unique(np.stack([groups, local], axis=1), axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(first))
    return torch.from_numpy(rank[inverse.reshape(-1)])


class _Clusters:
    """The clusters of one prompt group while its distinct texts are placed in order: per representative its text,
    length, character and trigram counts (rows of matrices that double when full: about 8 KiB per cluster), code
    points, seed index and, once it has been compared, its difflib matcher."""

    def __init__(self, threshold: float, longest: int):
        # A bucket count is at most the text's length: uint16 halves the memory traffic while it fits.
        self.dtype = np.uint16 if longest < 2 ** 16 else np.int64
        self.threshold = threshold
        self.length = np.empty(0, dtype=np.int64)
        self.chars = np.empty((0, _CHAR_COLUMNS), dtype=self.dtype)
        self.trigrams = np.empty((0, _TRIGRAM_BUCKETS), dtype=self.dtype)
        self.texts: list[str] = []
        self.codes: list[np.ndarray] = []
        self.seeds: list[np.ndarray] = []
        self.matchers: list[SequenceMatcher | None] = []

    def place(self, text: str) -> int:
        """The cluster ``text`` joins (a new one if none): its id, 0, 1, ... in order of creation."""
        codes = _codes(text)
        columns = _char_columns(codes)
        chars = np.bincount(columns, minlength=_CHAR_COLUMNS).astype(self.dtype)
        trigrams = _trigram_counts(codes).astype(self.dtype)
        for c in self._candidates(codes, columns, chars, trigrams).tolist():  # in order of creation
            if self.matchers[c] is None:
                self.matchers[c] = SequenceMatcher(None, "", self.texts[c])
            self.matchers[c].set_seq1(text)
            if self.matchers[c].ratio() >= self.threshold:
                return c
        c = len(self.texts)
        if c == len(self.length):
            self.length, self.chars, self.trigrams = (_grown(x, max(64, 2 * c))
                                                      for x in (self.length, self.chars, self.trigrams))
        self.length[c] = len(text)
        self.chars[c] = chars
        self.trigrams[c] = trigrams
        self.texts.append(text)
        self.codes.append(codes)
        self.seeds.append(_seed_index(codes))
        self.matchers.append(None)  # built on its first comparison: most representatives are never compared
        return c

    def _candidates(self, codes: np.ndarray, columns: np.ndarray, chars: np.ndarray,
                    trigrams: np.ndarray) -> np.ndarray:
        """The representatives whose upper bounds of M reach m_τ, in order of creation (bounds (a)-(d))."""
        n, la = len(self.texts), len(codes)
        total = la + self.length[:n]
        need = _needed_matches(total, self.threshold)
        bound = np.minimum(la, self.length[:n])  # (a)
        alive = np.flatnonzero(bound >= need)
        if alive.size:  # (b)
            bound[alive] = np.minimum(bound[alive], _intersection(self.chars[alive], chars))
            alive = alive[bound[alive] >= need[alive]]
        if alive.size:  # (c)
            shared = _intersection(self.trigrams[alive], trigrams)
            bound[alive] = np.minimum(bound[alive], (shared + 2 * (total[alive] + 1)) // 5)
            alive = alive[bound[alive] >= need[alive]]
        if alive.size:  # (d), the dearest, on the few candidates left
            # Candidates at a time: at most _MAX_CANDIDATES (the key packing) and _CHUNK (candidate, position) pairs.
            size = max(1, min(_MAX_CANDIDATES, _CHUNK // max(la, 1)))
            for part in np.split(alive, range(size, alive.size, size)):
                listed = part.tolist()
                cover = _seed_cover(codes, [self.codes[c] for c in listed], [self.seeds[c] for c in listed],
                                    need[part], _may_seed(columns, self.chars[part], self.length[part]))
                bound[part] = np.minimum(bound[part], cover)
            alive = alive[bound[alive] >= need[alive]]
        return alive


def _grown(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with room for ``rows`` rows, its rows kept."""
    out = np.empty((rows, *array.shape[1:]), dtype=array.dtype)
    out[:len(array)] = array
    return out


def _needed_matches(total: np.ndarray, threshold: float) -> np.ndarray:
    """m_τ per pair: the least integer m with 2.0·m / N ≥ τ as difflib evaluates it (N = |a| + |b|; 0 when N = 0,
    where difflib's ratio is 1)."""
    need = np.ceil(threshold * total / 2).astype(np.int64)
    safe = np.maximum(total, 1)
    # τ·N/2 is rounded once: step to the exact least m, each way, until difflib's expression agrees.
    while True:
        lower = (need > 0) & (2.0 * (need - 1) / safe >= threshold)
        if not lower.any():
            break
        need -= lower
    while True:
        higher = (total > 0) & (2.0 * need / safe < threshold)
        if not higher.any():
            break
        need += higher
    return np.where(total > 0, need, 0)


def _intersection(rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Σ_bucket min(rows[r], counts): the multiset intersection of each row with one text, per row."""
    return np.minimum(rows, counts).sum(axis=1, dtype=np.int64)


def _codes(text: str) -> np.ndarray:
    """Code points as int64 (lone surrogates included: Python strings may hold them, and difflib compares them)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)


def _char_columns(codes: np.ndarray) -> np.ndarray:
    """The character-count column of each code point: itself for ASCII, one of 64 hashed columns otherwise."""
    hashed = _ASCII + ((codes.astype(np.uint64) * _MIX) >> np.uint64(58)).astype(np.int64)
    return np.where(codes < _ASCII, codes, hashed)


def _trigram_counts(codes: np.ndarray) -> np.ndarray:
    if len(codes) < 3:
        return np.zeros(_TRIGRAM_BUCKETS, dtype=np.int64)
    c = codes.astype(np.uint64)
    code = (c[:-2] * _PRIME + c[1:-1]) * _PRIME + c[2:]
    return np.bincount(((code * _MIX) >> np.uint64(64 - 12)).astype(np.int64), minlength=_TRIGRAM_BUCKETS)


def _seed_index(codes: np.ndarray) -> np.ndarray:
    """Sorted keys (character << 32 | position) of the positions of b that can seed a difflib match: all of them
    below 200 characters, else those whose character occurs at most |b| // 100 + 1 times (autojunk's popular rule)."""
    positions = np.arange(len(codes), dtype=np.int64)
    if len(codes) >= 200:
        _, inverse, counts = np.unique(codes, return_inverse=True, return_counts=True)
        positions = positions[counts[inverse.reshape(-1)] <= len(codes) // 100 + 1]
    return np.sort((codes[positions] << _POSITION_BITS) | positions)


def _may_seed(columns: np.ndarray, counts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[candidates, |a|] bool: False where a's character cannot seed a match in b_c, being absent from b_c or popular
    there (from b_c's character ``counts`` and ``lengths``); a hashed non-ASCII column only says "maybe", which is
    safe. Spares the seed search most positions of a: in English text most characters are popular."""
    in_b = counts[:, columns].astype(np.int64)
    popular = np.where(lengths >= 200, lengths // 100 + 1, np.iinfo(np.int64).max)
    return (in_b > 0) & ((in_b <= popular[:, None]) | (columns >= _ASCII)[None, :])


def _seed_cover(a: np.ndarray, bs: list[np.ndarray], seeds: list[np.ndarray], need: np.ndarray,
                maybe: np.ndarray) -> np.ndarray:
    """Bound (d) of the module docstring for the text with code points ``a`` against each candidate representative
    (code points ``bs[c]``, seed index ``seeds[c]``, m_τ ``need[c]`` ≤ min(|a|, |b_c|)): the number of positions of a
    in the common prefix or in the diagonal run of a seed in the band. An upper bound of M(a, b_c) whenever
    M(a, b_c) ≥ need[c]; so M < need[c] when it is smaller. ``maybe`` [candidates, |a|]: False where a[i] cannot
    seed in b_c (True is always safe)."""
    m, la = len(bs), len(a)
    lb = np.array([len(b) for b in bs], dtype=np.int64)
    # Every text between _PAD sentinels that match nothing (a's differ from b's): a run stops at the first, and a
    # window of at most _PAD characters read from there stays inside the padding.
    pad_a, pad_b = np.full(_PAD, -2), np.full(_PAD, -1)
    A = np.concatenate([pad_a, a, pad_a])
    B = np.concatenate([x for b in bs for x in (pad_b, b)] + [pad_b])
    b_start = _PAD + np.concatenate([[0], np.cumsum(lb[:-1] + _PAD)])  # index in B of b_c[0]

    # Seeds in the band: one searchsorted on the packed keys for every (candidate, position of a) that may seed.
    keys = np.concatenate([(c << _CANDIDATE_SHIFT) | s for c, s in enumerate(seeds)])
    cand, i = np.nonzero(maybe)
    first_j = np.maximum(i + (need - la)[cand], 0)
    last_j = np.minimum(i + (lb - need)[cand], lb[cand] - 1)
    base = (cand << _CANDIDATE_SHIFT) | (a[i] << _POSITION_BITS)
    lo = np.searchsorted(keys, base | first_j)
    count = np.maximum(np.searchsorted(keys, base | last_j, side="right") - lo, 0)
    if count.sum() > _MAX_SEEDS:
        return np.full(m, la, dtype=np.int64)
    within = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    j = keys[np.repeat(lo, count) + within] & (2 ** _POSITION_BITS - 1)
    cand, i = np.repeat(cand, count), np.repeat(i, count)
    # The common prefix, as a run from (0, 0); first, so that the order below keeps i ascending per diagonal.
    corner = np.flatnonzero((lb > 0) & (la > 0) & (B[b_start] == A[_PAD]))
    cand, i, j = np.concatenate([corner, cand]), np.concatenate([0 * corner, i]), np.concatenate([0 * corner, j])
    if not len(cand):
        return np.zeros(m, dtype=np.int64)

    # Along each diagonal, seed by seed: a seed links to the next one on its diagonal when every character between
    # them matches (one run), so a long shared passage is walked once, not once per seed. The seeds are in order of
    # (candidate, i) per part: a stable sort by (candidate, diagonal) orders them by (candidate, diagonal, i).
    order = np.argsort((cand << _DIAGONAL_BITS) + (j - i + 2 ** (_DIAGONAL_BITS - 1)), kind="stable")
    cand, i, j = cand[order], i[order], j[order]
    same = (cand[1:] == cand[:-1]) & (j[1:] - i[1:] == j[:-1] - i[:-1])
    never = np.iinfo(np.int64).max
    gap = np.where(same, i[1:] - i[:-1], never)
    ia, jb, n = _PAD + i, b_start[cand] + j, len(i)
    # Rightwards up to the next seed of the diagonal and leftwards down to the previous one, in one walk.
    steps = np.repeat([1, -1], n)
    reach, linked = _walk(A, B, np.tile(ia, 2), np.tile(jb, 2), steps, np.concatenate([gap, [never], [never], gap]))
    head, last = ~linked[n:], ~linked[:n]
    starts, ends, owner = i[head] - reach[n:][head], i[last] + 1 + reach[:n][last], cand[last]

    # The union of the runs per candidate: sort by (candidate, start), sweep with the running end.
    order = np.argsort((owner << _POSITION_BITS) | starts)
    starts, ends, owner = starts[order], ends[order], owner[order]
    running = np.maximum.accumulate((owner << _POSITION_BITS) | ends)
    before = np.append(-1, running[:-1])
    covered = np.where((before >> _POSITION_BITS) == owner, before & (2 ** _POSITION_BITS - 1), 0)
    added = np.maximum(ends - np.maximum(starts, covered), 0)
    return np.bincount(owner, weights=added, minlength=m).astype(np.int64)


def _walk(A: np.ndarray, B: np.ndarray, ia: np.ndarray, jb: np.ndarray, step: np.ndarray,
          gap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """From each pair (A[ia], B[jb]), how many further characters match in direction ``step`` (±1 per pair) before
    the first mismatch, and whether the first ``gap − 1`` of them all match (the pair is linked to the seed ``gap``
    away; its count is then not needed). The window grows each round up to _PAD, so a long run costs few rounds; the
    sentinels end every run."""
    length = np.zeros(len(ia), dtype=np.int64)
    # First the next character alone: most seeds of unrelated texts stop there.
    equal = A[ia + step] == B[jb + step]
    linked = equal | (gap <= 1)
    active = np.flatnonzero(equal & (gap > 1))
    offset, width = 2, 4
    while active.size:
        t = step[active, None] * np.arange(offset, offset + width)
        equal = A[ia[active, None] + t] == B[jb[active, None] + t]
        miss = np.where(equal.all(axis=1), offset + width, offset + np.argmin(equal, axis=1))  # first mismatch
        joins = miss >= gap[active]  # every character strictly before the next seed matched
        done = joins | (miss < offset + width)
        length[active[done & ~joins]] = miss[done & ~joins] - 1
        linked[active[done & ~joins]] = False
        active = active[~done]
        offset, width = offset + width, min(4 * width, _PAD)
    return length, linked
