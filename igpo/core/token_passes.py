"""The [B, L] passes of the IGPO advantage: find the reward positions, and spread turn advantages over tokens.

Everything else in ``igpo.core.advantage`` works on the few boundaries per trajectory; these passes touch every
token, so they set the estimator's cost at long horizons (B = 256, L = 32768 is 8.4 M tokens per step).

    token_reward_masks: outcome / IG masks from token rewards by the reference convention (stock verl's call, which
                      has no masks to give): outcome at the last response token, IG at the other non-zero ones.
    token_reward_boundaries: the same positions as ``find_boundaries`` would return for those masks, straight from
                      the rewards in one pass (no masks built), with the non-zero rewards outside the response mask.
    find_boundaries:  the positions of outcome_mask | ig_mask | (penalty != 0), row-major, with what lies there
                      (reward, kind, response mask, penalty) and K_i, the number of them in row i.
    response_runs:    per row, the response mask's one run of tokens [start, end), or (-1, -1) where it has several;
                      ``token_reward_boundaries`` records it, so that ``spread`` fills such a row without reading the
                      mask again.
    spread:           out[i, t] = A_(i,s) · response_mask[i, t], s = the first boundary of row i at or after t (0 after
                      the last one, left as the zeros ``out`` starts with); also the response tokens of every segment.

Two implementations with identical results. CPU tensors of float32/float64 (the normal case: verl computes advantages
on the driver) go through numba kernels that stream each row once, testing 64 tokens at a time for anything set.
Anything else (CUDA tensors, half-precision rewards) goes through plain tensor ops; on CPU those cost several times
more, as torch's kernels for a cumsum along 32 K tokens, large gathers and nonzero run far below memory speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros
from torch import Tensor

# Bits of a float that are set iff the value is != 0 (all but the sign, so -0.0 counts as zero; NaN counts as set).
_NONZERO_BITS = {torch.float64: np.int64(0x7FFF_FFFF_FFFF_FFFF), torch.float32: np.int32(0x7FFF_FFFF)}
_KERNEL_DTYPES = (torch.float32, torch.float64)
_KIND_F, _KIND_I, _KIND_IN_MASK = 1, 2, 4


@dataclass
class Boundaries:
    """The reward positions of a [B, L] batch, row-major, and what lies there (host arrays, [nnz] unless noted).

    flat: token index i·L + t (a tensor on the batch's device); K: [B] int64 count per row (tensor, same device);
    r: reward (float64); is_f, is_i: outcome / IG flags; in_mask: response_mask there; pen: penalty (float64) or
    None when no penalty was given; w: weight in the group statistics (float64; None: all 1; ARPO's shared turns).
    runs: [B, 2] int64 ``response_runs`` of the response mask these positions were found in (None: not recorded; the
    write pass then reads the mask). It describes that mask: write with the same one.
    anchor: int64, the state each position's turn was taken from (−1: none), for ``norm_mode=state_grouped``; None
    when the caller named no states.
    """

    flat: Tensor
    K: Tensor
    r: np.ndarray
    is_f: np.ndarray
    is_i: np.ndarray
    in_mask: np.ndarray
    pen: np.ndarray | None
    w: np.ndarray | None = None
    runs: np.ndarray | None = None
    anchor: np.ndarray | None = None

    @classmethod
    def at(cls, rows: np.ndarray, positions: np.ndarray, rewards: np.ndarray, is_f: np.ndarray, is_i: np.ndarray,
           penalty: np.ndarray | None, response_mask: Tensor, weight: np.ndarray | None = None,
           anchor: np.ndarray | None = None) -> "Boundaries":
        """Reward positions given explicitly, one entry per token in any order (host arrays [n]): trajectory ``rows``,
        token ``positions``, and what lies there (reward, outcome / IG flags, penalty or None, weight in the group
        statistics or None for all 1, the state the turn was taken from or None). O(n log n); no pass over the
        [B, L] tokens."""
        if response_mask.dim() != 2 or response_mask.dtype != torch.bool:
            raise ValueError(f"response_mask must be a bool [B, L] tensor; got {response_mask.dtype} "
                             f"{tuple(response_mask.shape)}.")
        B, L = response_mask.shape
        n = rows.shape[0]
        for name, x in (("positions", positions), ("rewards", rewards), ("is_f", is_f), ("is_i", is_i),
                        ("penalty", penalty), ("weight", weight), ("anchor", anchor)):
            if x is not None and x.shape != (n,):
                raise ValueError(f"{name} must be a [n] = ({n},) array like rows; got {x.shape}.")
        for name, x in (("rows", rows), ("positions", positions)):
            if not np.issubdtype(x.dtype, np.integer):
                raise ValueError(f"{name} must be an integer array; got {x.dtype}.")
        rows, positions = rows.astype(np.int64), positions.astype(np.int64)
        if n and (rows.min() < 0 or rows.max() >= B or positions.min() < 0 or positions.max() >= L):
            raise ValueError(f"reward positions must lie in the [{B}, {L}] response grid; got rows {rows.min()}.."
                             f"{rows.max()}, tokens {positions.min()}..{positions.max()}.")
        flat = rows * L + positions
        order = np.argsort(flat, kind="stable")
        flat = flat[order]
        same = np.flatnonzero(flat[1:] == flat[:-1])
        if same.size:
            row, token = divmod(int(flat[same[0]]), L)
            raise ValueError(f"two reward entries on one token (trajectory {row}, token {token}); turn ends must be "
                             "distinct per trajectory, and a token carries one outcome or IG reward and one penalty.")
        if response_mask.device.type == "cpu":
            in_mask = response_mask.reshape(-1).view(torch.uint8).numpy()[flat] != 0
        else:
            in_mask = response_mask.reshape(-1)[torch.from_numpy(flat).to(response_mask.device)].cpu().numpy()
        device = response_mask.device
        return cls(torch.from_numpy(flat).to(device), torch.from_numpy(np.bincount(rows, minlength=B)).to(device),
                   rewards[order].astype(np.float64), is_f[order].astype(bool), is_i[order].astype(bool), in_mask,
                   penalty[order].astype(np.float64) if penalty is not None else None,
                   _pool_weight(weight[order]) if weight is not None else None,
                   anchor=anchor[order].astype(np.int64) if anchor is not None else None)


def _pool_weight(weight: np.ndarray) -> np.ndarray:
    w = weight.astype(np.float64)
    if not (np.isfinite(w).all() and (w > 0).all() and (w <= 1).all()):
        raise ValueError(f"pool weights must lie in (0, 1] (1/|S| for a turn |S| trajectories share); got min "
                         f"{w.min()}, max {w.max()}.")
    return w


def _use_kernels(*tensors: Tensor | None) -> bool:
    """The numba kernels take CPU tensors whose floating-point ones are float32 or float64."""
    return all(t is None or (t.device.type == "cpu" and (not torch.is_floating_point(t) or t.dtype in _KERNEL_DTYPES))
               for t in tensors)


def token_reward_masks(rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Outcome and IG masks by the reference convention from token rewards alone (stock verl's estimator call): the
    outcome at each row's last response token, IG at the other response tokens whose reward is != 0 (NaN counts as
    set, for the caller's finiteness check; -0.0 does not). Inputs are contiguous [B, L], response_mask bool."""
    B, L = rewards.shape
    if rewards.dtype not in _KERNEL_DTYPES or not _use_kernels(rewards, response_mask):
        m = response_mask
        last = (L - 1) - m.flip(1).to(torch.uint8).argmax(dim=1)
        outcome = torch.zeros_like(m)
        rows = torch.nonzero(m.any(dim=1), as_tuple=True)[0]
        outcome[rows, last[rows]] = True
        return outcome, m & ~outcome & (rewards != 0)
    outcome, ig = np.zeros((B, L), np.bool_), np.zeros((B, L), np.bool_)
    nonzero_bits = _NONZERO_BITS[rewards.dtype]
    _reward_masks_kernel(rewards.numpy().view(nonzero_bits.dtype), nonzero_bits,
                         response_mask.view(torch.uint8).numpy(), outcome.view(np.uint8), ig.view(np.uint8))
    return torch.from_numpy(outcome), torch.from_numpy(ig)


def response_runs(response_mask: Tensor) -> np.ndarray:
    """Per row of a bool [B, L] mask whose set tokens form one run t_0 .. t_1 (no unset token between them): that run
    as (t_0, t_1 + 1); (0, 0) for a row with none; (-1, -1) for a row with several runs (e.g. tool tokens masked out
    between turns). A row is one run iff its count of set tokens is t_1 - t_0 + 1. [B, 2] int64 host array.

    The readable version of what ``token_reward_boundaries``' kernel records in its one pass; the tests hold the two
    equal."""
    m = response_mask
    L = m.shape[1]
    start = m.to(torch.uint8).argmax(dim=1)
    end = L - m.flip(1).to(torch.uint8).argmax(dim=1)
    count = m.sum(dim=1)
    runs = torch.stack([start, end], dim=1)
    runs[count != end - start] = -1
    runs[count == 0] = 0
    return runs.cpu().numpy().astype(np.int64)


def token_reward_boundaries(rewards: Tensor, response_mask: Tensor) -> tuple[Boundaries, int, int]:
    """The reward positions of ``token_reward_masks`` (outcome at each row's last response token, IG at the other
    response tokens whose reward is != 0), as ``find_boundaries`` returns them for those masks, and the non-zero
    rewards outside ``response_mask``: (boundaries, how many, flat index i·L + t of the first or -1). Inputs are
    contiguous [B, L], response_mask bool.

    The positions also carry ``response_runs(response_mask)`` (``Boundaries.runs``), for the write pass.

    On the kernels' path one pass per row finds all of it, reading the mask and the rewards once each: no [B, L] mask
    is built, and no second pass looks for rewards outside the mask.
    """
    B, L = rewards.shape
    if rewards.dtype not in _KERNEL_DTYPES or not _use_kernels(rewards, response_mask):
        outcome, ig = token_reward_masks(rewards, response_mask)
        outside = ((rewards != 0) & ~response_mask).view(-1)
        count = int(outside.sum())
        first = int(torch.argmax(outside.to(torch.uint8))) if count else -1
        bounds = find_boundaries(rewards, outcome, ig, response_mask, None)
        bounds.runs = response_runs(response_mask)
        return bounds, count, first
    nonzero_bits = _NONZERO_BITS[rewards.dtype]
    flat, K, r, kind, outside, runs = _token_reward_kernel(rewards.numpy().view(nonzero_bits.dtype), nonzero_bits,
                                                           rewards.numpy(), response_mask.view(torch.uint8).numpy(),
                                                           _words(response_mask))
    is_f = (kind & _KIND_F) != 0
    bounds = Boundaries(torch.from_numpy(flat), torch.from_numpy(K), r, is_f, ~is_f, np.ones(r.shape[0], bool), None,
                        runs=runs)
    return bounds, int(outside[0]), int(outside[1])


def find_boundaries(rewards: Tensor, outcome_mask: Tensor, ig_mask: Tensor, response_mask: Tensor,
                    penalty: Tensor | None) -> Boundaries:
    """The tokens where outcome_mask, ig_mask or penalty != 0 is set (a NaN penalty counts as set, so that the
    caller's finiteness check sees it). Inputs are contiguous [B, L]."""
    B, L = rewards.shape
    if not _use_kernels(rewards, outcome_mask, penalty):
        hit = outcome_mask | ig_mask
        if penalty is not None:
            hit |= penalty != 0
        flat = torch.nonzero(hit.view(-1), as_tuple=True)[0]
        K = torch.bincount(flat // max(L, 1), minlength=B)

        def at(t: Tensor) -> np.ndarray:
            x = t.view(-1).index_select(0, flat)
            return (x.double() if torch.is_floating_point(x) else x).cpu().numpy()

        return Boundaries(flat, K, at(rewards), at(outcome_mask), at(ig_mask), at(response_mask),
                          at(penalty) if penalty is not None else None)

    f, i = _words(outcome_mask), _words(ig_mask)
    if penalty is None:  # placeholders of the kernels' types, never read
        values, bits, nonzero_bits = np.zeros((B, 0), np.float32), np.zeros((B, 0), np.int32), np.int32(0)
    else:
        nonzero_bits = _NONZERO_BITS[penalty.dtype]
        values = _padded(penalty).numpy()
        bits = values.view(nonzero_bits.dtype)
    flat, K = _find_kernel(f, i, bits, nonzero_bits, penalty is not None, L)
    r, kind, pen = _gather_kernel(flat, rewards.view(-1).numpy(), _bytes(outcome_mask), _bytes(ig_mask),
                                  _bytes(response_mask), penalty.view(-1).numpy() if penalty is not None else
                                  values.ravel(), penalty is not None)
    return Boundaries(torch.from_numpy(flat), torch.from_numpy(K), r, (kind & _KIND_F) != 0, (kind & _KIND_I) != 0,
                      (kind & _KIND_IN_MASK) != 0, pen if penalty is not None else None)


def spread(A: np.ndarray, bounds: Boundaries, response_mask: Tensor, out: Tensor,
           count_tokens: bool = True) -> np.ndarray | None:
    """Fill ``out`` [B, L] from the boundary advantages A [nnz] (float64, in the order of ``bounds``): the tokens up
    to and including boundary k of row i get A of that boundary, the tail after the last boundary 0, tokens outside
    ``response_mask`` 0. ``out`` must hold zeros: the kernel does not write the tails (on a fresh zeroed allocation
    that saves writing the padding, about half of a long-horizon batch). Returns the response tokens of each
    boundary's segment [nnz] (float64, exact integers), or None with ``count_tokens=False``.

    Where ``bounds.runs`` gives a row's response as one run [t_0, t_1), the kernel fills each segment's part of it
    without reading the mask (its response tokens are that part's length); other rows read the mask."""
    B, L = response_mask.shape
    nnz = A.shape[0]
    flat, K = bounds.flat, bounds.K
    if _use_kernels(out, response_mask, flat):
        first = np.zeros(B, np.int64)
        np.cumsum(K.numpy()[:-1], out=first[1:])
        tokens = np.zeros(nnz if count_tokens else 0)
        runs = bounds.runs if bounds.runs is not None else np.full((B, 2), -1, np.int64)
        _spread_kernel(A, flat.numpy(), K.numpy(), first, runs, response_mask.view(torch.uint8).numpy(), out.numpy(),
                       tokens)
        return tokens if count_tokens else None
    # Segment of every token as an index into [A, 0 per row]: boundaries strictly before it in its row (an exclusive
    # cumsum of the boundary indicator) offset by the row's first boundary; the tail maps to the row's 0.
    dev = out.device
    hit = torch.zeros(B * L, dtype=torch.int32, device=dev)
    hit[flat] = 1
    hit = hit.view(B, L)
    slot = torch.cumsum(hit, dim=1, dtype=torch.int32).sub_(hit).long()
    first = (torch.cumsum(K, 0) - K)[:, None]
    segment = torch.where(slot < K[:, None], first + slot, nnz + torch.arange(B, device=dev)[:, None])
    A_ext = torch.cat([torch.from_numpy(A).to(dev), torch.zeros(B, dtype=torch.float64, device=dev)])
    out.copy_(A_ext[segment].masked_fill_(~response_mask, 0.0))
    if not count_tokens:
        return None
    return torch.bincount(segment[response_mask], minlength=nnz + B)[:nnz].double().cpu().numpy()


def _padded(x: Tensor) -> Tensor:
    """x [B, L] zero-padded on the right to a multiple of 8 columns (a copy only when L is not one already)."""
    L = x.shape[1]
    return x if L % 8 == 0 else torch.nn.functional.pad(x, (0, 8 - L % 8))


def _bytes(mask: Tensor) -> np.ndarray:
    """A bool tensor as a flat uint8 array (no copy)."""
    return mask.view(-1).view(torch.uint8).numpy()


def _words(mask: Tensor) -> np.ndarray:
    """A bool [B, L] tensor as int64 words [B, ceil(L / 8)], 8 tokens (bytes, each 0 or 1) per word."""
    return _padded(mask.view(torch.uint8)).numpy().view(np.int64)


_CHUNK_WORDS = 8  # 64 tokens per skip test


@numba.njit(cache=True, nogil=True)
def _find_kernel(f, i, bits, nonzero_bits, has_penalty, L):
    """Per row: OR-reduce each 64-token chunk of the flags and of the penalty's value bits (streaming loops over
    slice views, which LLVM vectorizes), then resolve only the chunks where something is set, word by word; a word's
    set tokens are appended without branches (write all 8 candidates, advance by each token's 0/1 flag). Kept free of
    value reads on purpose: reading what lies at each boundary in here makes it ~2x slower (_gather_kernel does it).
    """
    B, n_words = f.shape
    cap = max(1024, 16 * B)
    flat = np.empty(cap, np.int64)
    K = np.zeros(B, np.int64)
    n = 0
    CW = _CHUNK_WORDS
    n_chunks = (n_words + CW - 1) // CW
    any_set = np.zeros(n_chunks, np.int64)
    any_penalty = np.zeros(n_chunks, np.int64)
    for b in range(B):
        fr, ir, pr = f[b], i[b], bits[b]
        for c in range(n_chunks):
            fv, iv = fr[CW * c:CW * c + CW], ir[CW * c:CW * c + CW]
            x = 0
            for j in range(fv.shape[0]):
                x |= fv[j] | iv[j]
            any_set[c] = x
        if has_penalty:
            for c in range(n_chunks):
                pv = pr[8 * CW * c:8 * CW * (c + 1)]
                p = nonzero_bits & 0
                for j in range(pv.shape[0]):
                    p |= pv[j] & nonzero_bits
                any_penalty[c] = p
                any_set[c] |= p
        first = n
        for c in range(n_chunks):
            if any_set[c] == 0:
                continue
            for w in range(CW * c, min(CW * c + CW, n_words)):
                x = fr[w] | ir[w]
                if has_penalty and any_penalty[c] != 0:
                    pv = pr[8 * w:8 * w + 8]
                    for j in range(8):
                        x |= ((pv[j] & nonzero_bits) != 0) << (8 * j)
                if x == 0:
                    continue
                if n + 8 > cap:
                    cap *= 2
                    grown = np.empty(cap, np.int64)
                    grown[:n] = flat[:n]
                    flat = grown
                for j in range(8):
                    flat[n] = b * L + 8 * w + j
                    n += (x >> (8 * j)) & 1
        K[b] = n - first
    return flat[:n], K


@numba.njit(cache=True, nogil=True)
def _last_response_token(m, C):
    """Index of the last non-zero byte of m, -1 if none: a backward scan in C-token chunks, so only the padding after
    the last response token is read."""
    end = m.shape[0]
    while end > 0:
        start = max(0, end - C)
        mv = m[start:end]
        x = 0
        for t in range(mv.shape[0]):
            x |= mv[t]
        if x:
            for t in range(mv.shape[0] - 1, -1, -1):
                if mv[t]:
                    return start + t
        end = start
    return -1


@numba.njit(cache=True, nogil=True)
def _reward_masks_kernel(bits, nonzero_bits, mask, outcome, ig):
    """Per row: the last response token from a backward scan of the mask in 64-token chunks (so only the padding
    after it is read), then one branch-free pass over the tokens before it that LLVM vectorizes; nothing after the
    last response token is read or written (the mask is 0 there, the outputs stay 0). Writing every IG byte before
    it beats skipping reward-free chunks (1.5 vs 2.3 ms at B=256, L=32768): the skip test's branches cost more than
    the bytes."""
    for b in range(mask.shape[0]):
        m = mask[b]
        last = _last_response_token(m, 64)
        if last < 0:
            continue
        rv, mv, gv = bits[b, :last], m[:last], ig[b, :last]
        for t in range(rv.shape[0]):
            gv[t] = ((rv[t] & nonzero_bits) != 0) & (mv[t] != 0)
        outcome[b, last] = 1


_BYTE_SUM = np.int64(0x0101_0101_0101_0101)  # w * this >> 56: the sum of w's 8 bytes (each <= 64 here, no carry)
# Bit j of a 64-bit word, as a table: OR-ing _BIT[j] & -flag vectorizes where (flag << j) does not (0.16 vs 0.21-0.39 ms
# for the ~16 K chunks with a reward at B=256, L=32768).
_BIT = np.array([1 << j for j in range(63)] + [-(1 << 63)], np.int64)


_GAP_CHUNKS = 8  # chunks tested at once after a chunk without response tokens (padding, holes between turns)


@numba.njit(cache=True, nogil=True)
def _token_reward_kernel(bits, nonzero_bits, rewards, mask, words):
    """Per row, one forward loop over 64-token chunks that reads each chunk's mask words and rewards side by side (two
    streams at once, as the floor's read pass does); ``response_runs`` and ``token_reward_boundaries``' tensor path
    are the readable version.
    - The chunk's 8 mask words summed (bytes 0 or 1; one multiply folds the byte sums into its count of response
      tokens); the first and last chunk with a response token noted.
    - Its rewards' value bits OR-reduced (LLVM vectorizes both reductions). A chunk with a non-zero reward is resolved
      at once, while in L1, through a 64-bit map of its set tokens and a bit scan; each set token is looked up in the
      mask (in L1 too): in the mask it is an IG boundary, off it it is counted.
    - After a chunk without response tokens, the next 8 chunks are tested at once (one OR over their mask words, one
      over their rewards) and skipped when both are 0: the padding after the response costs a streaming read, not a
      test per chunk.
    After the loop: t_0 and t_1 from their chunks, one run iff the count is t_1 - t_0 + 1, and the outcome at t_1 (the
    last response token; an IG boundary recorded there, necessarily the row's last, becomes the outcome). Returns
    (flat, K, r, kind, [count off the mask, first flat index or -1], runs [B, 2]).

    Measured at B=256, L=32768 (~82 rewards per row; thread CPU time on a 2-core AMD EPYC shared with other work, 41
    interleaved rounds, caches flushed between calls): 2.04 ms median against 2.41 ms for the previous kernel (a pass
    over the mask words, then one over the rewards) and 1.69 ms for the floor's read of the same bytes. Tried and
    dropped: t_0, t_1 by scans from both ends and the padding's rewards in one streaming OR (2.2-2.6 ms: the
    descending scan reads memory slowly); chunks with a reward listed branch-free and resolved after the row (no
    gain); the output arrays grown inside the chunk loop (numba then counts references on every resolved chunk, +0.13
    ms; they are grown once per row instead); int64 views of the rewards per chunk (3.5 ms); inner loops of a literal
    count (LLVM unrolls them to scalar code, +0.25 ms)."""
    B, L = mask.shape
    C, CW, G = 64, 8, _GAP_CHUNKS
    n_chunks = (L + C - 1) // C
    cap = max(1024, 16 * B) + L
    flat = np.empty(cap, np.int64)
    r = np.empty(cap, np.float64)
    kind = np.empty(cap, np.uint8)
    K = np.zeros(B, np.int64)
    runs = np.zeros((B, 2), np.int64)
    outside, first_outside = 0, -1
    n = 0
    for b in range(B):
        m, bv, rv, mw = mask[b], bits[b], rewards[b], words[b]
        while n + L > cap:  # a row adds at most L boundaries
            flat, r, kind, cap = _grown(flat, r, kind, n)
        row_start, base = n, b * L
        total, first_chunk, last_chunk = 0, -1, -1
        c, gap = 0, False
        while c < n_chunks:
            if gap and c + G <= n_chunks:
                wv, chunk = mw[CW * c:CW * (c + G)], bv[C * c:C * (c + G)]
                y = 0
                for j in range(wv.shape[0]):
                    y |= wv[j]
                x = nonzero_bits & 0
                for j in range(chunk.shape[0]):
                    x |= chunk[j]
                if y == 0 and x & nonzero_bits == 0:
                    c += G
                    continue
            wv = mw[CW * c:CW * c + CW]
            w = 0
            for j in range(wv.shape[0]):
                w += wv[j]
            count = (w * _BYTE_SUM) >> 56
            total += count
            gap = count == 0
            if count != 0:
                last_chunk = c
                if first_chunk < 0:
                    first_chunk = c
            start, chunk = C * c, bv[C * c:C * c + C]
            c += 1
            x = nonzero_bits & 0
            for j in range(chunk.shape[0]):
                x |= chunk[j]
            if x & nonzero_bits == 0:
                continue
            set_tokens = 0
            for j in range(chunk.shape[0]):
                set_tokens |= _BIT[j] & -np.int64((chunk[j] & nonzero_bits) != 0)
            while set_tokens != 0:
                t = start + trailing_zeros(set_tokens)
                set_tokens &= set_tokens - 1
                if m[t] != 0:
                    flat[n], r[n], kind[n] = base + t, rv[t], _KIND_I | _KIND_IN_MASK
                    n += 1
                else:
                    first_outside = base + t if outside == 0 else first_outside
                    outside += 1
        if total == 0:  # an empty row: one run of no tokens (runs (0, 0)), no boundary (K 0)
            continue
        first = C * first_chunk
        while m[first] == 0:
            first += 1
        last = min(C * last_chunk + C, L) - 1
        while m[last] == 0:
            last -= 1
        if total == last - first + 1:
            runs[b, 0], runs[b, 1] = first, last + 1
        else:
            runs[b, 0], runs[b, 1] = -1, -1
        if n > row_start and flat[n - 1] == base + last:
            kind[n - 1] = _KIND_F | _KIND_IN_MASK
        else:
            flat[n], r[n], kind[n] = base + last, rv[last], _KIND_F | _KIND_IN_MASK
            n += 1
        K[b] = n - row_start
    return flat[:n], K, r[:n], kind[:n], np.array([outside, first_outside], np.int64), runs


@numba.njit(cache=True, nogil=True)
def _grown(flat, r, kind, n):
    """The three output arrays of _token_reward_kernel at twice their capacity, the first n entries kept."""
    cap = 2 * flat.shape[0]
    flat2, r2, kind2 = np.empty(cap, np.int64), np.empty(cap, np.float64), np.empty(cap, np.uint8)
    flat2[:n], r2[:n], kind2[:n] = flat[:n], r[:n], kind[:n]
    return flat2, r2, kind2, cap


@numba.njit(cache=True, nogil=True)
def _gather_kernel(flat, rewards, outcome_mask, ig_mask, mask, values, has_penalty):
    """What lies at each boundary: reward, kind bits, penalty (inputs flattened to [B·L])."""
    n = flat.shape[0]
    r = np.empty(n, np.float64)
    kind = np.empty(n, np.uint8)
    pen = np.zeros(n, np.float64)
    for k in range(n):
        t = flat[k]
        r[k] = rewards[t]
        kind[k] = outcome_mask[t] * _KIND_F + ig_mask[t] * _KIND_I + mask[t] * _KIND_IN_MASK
        if has_penalty:
            pen[k] = values[t]
    return r, kind, pen


@numba.njit(cache=True, nogil=True)
def _spread_kernel(A, flat, K, first, runs, mask, out, tokens):
    """Row by row, segment by segment, one loop that writes and counts (into ``tokens``, unless it has length 0); the
    tail after the last boundary is left as it is (zeros). A row whose response is one run [t_0, t_1) (runs[b, 0] >= 0)
    is filled from t_0 to t_1 without reading the mask (B=256, L=32768, every row one run, fresh zero pages: 3.9-4.05
    ms against 4.3-4.45 ms reading it; the floor's writes of the same bytes cost ~3.9 ms). Loops run over slice views:
    indexing a 2-D array from a computed start defeats LLVM's vectorizer (numba's negative-index wraparound), a view's
    0-based index does not."""
    B, L = mask.shape
    count = tokens.shape[0] != 0
    for b in range(B):
        start = 0
        run_start, run_end = runs[b, 0], runs[b, 1]
        if run_start >= 0:
            for p in range(first[b], first[b] + K[b]):
                end, a = flat[p] - b * L + 1, A[p]
                o = out[b, max(start, run_start):min(end, run_end)]
                for t in range(o.shape[0]):
                    o[t] = a
                if count:
                    tokens[p] = o.shape[0]
                start = end
            continue
        for p in range(first[b], first[b] + K[b]):
            end, a = flat[p] - b * L + 1, A[p]
            m = mask[b, start:end]
            o = out[b, start:end]
            n_tokens = 0
            for t in range(m.shape[0]):
                o[t] = a if m[t] else 0.0
                n_tokens += m[t]
            if count:
                tokens[p] = n_tokens
            start = end
