"""The one top-k core: every selection of "the k best keys" in sparseattn goes through these kernels.

Policy (shared by every function here and by every caller):

* An entry is a (score, id) pair.  Entry a ranks above entry b when ``a.score > b.score``, or the scores
  are equal and ``a.id < b.id``: ties are broken by the smaller key id, whatever order the entries
  arrive in.
* Only scores ``> -inf`` are candidates: NaN (e.g. ``inf + -inf`` from overflowing products) and
  ``-inf`` (masked keys) are never selected.  ``+inf`` is a candidate.
* A row with fewer than k candidates is padded with id ``-1`` and score ``-inf``.
* Output ids are always a given key id or ``-1``; candidate ids outside ``[0, S)`` are ignored by the
  re-rank, so no id is ever read or written out of range.

Selection is a size-k heap whose root is the worst kept entry, in a per-row scratch array of which only
the filled slots are ever read; an entry is compared with the root first, so on typical data a row costs
about one comparison per score.  Outputs are written in one of three orders: ``ORDER_NONE`` (heap
order), ``ORDER_BEST`` (best first) or ``ORDER_ID`` (ids ascending).

Entry points: :func:`block_topk` (rows of a score block, optional causal mask by positions, key-id map,
running accumulation), :func:`rerank_topk` (exact re-rank of candidate id lists, de-duplicating),
:func:`rows_topk` / :func:`merge_topk` (the cluster selector's per-cluster top-k and per-query merge,
same signatures as in ``kernels/cluster.py``).  Kernels that gather their own candidates (e.g.
``kernels/lsh.window_topk``) build on :func:`heap_offer`, :func:`rerank_ids`, :func:`heap_finish` and
:func:`pad_row`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .options import FASTMATH
from .pattern_ops import csr_alloc

__all__ = ["ORDER_BEST", "ORDER_ID", "ORDER_NONE", "block_topk", "heap_finish", "heap_offer", "merge_topk",
           "pad_row", "rerank_ids", "rerank_topk", "rows_topk"]

ORDER_NONE = 0  # heap order (unordered)
ORDER_BEST = 1  # best first: score descending, ids ascending among equal scores
ORDER_ID = 2  # ids ascending


# ----------------------------------------------------------------------------------------- heap helpers


@njit(cache=True, inline="always")
def _worse(sa, ia, sb, ib):
    """Entry a ranks below entry b: lower score, or equal score and larger id."""
    return sa < sb or (sa == sb and ia > ib)


@njit(cache=True, inline="always")
def _after(mode, sa, ia, sb, ib):
    """Entry a comes after entry b in output order ``mode`` (ORDER_ID: by id, else best first)."""
    if mode == ORDER_ID:
        return ia > ib
    return _worse(sa, ia, sb, ib)


@njit(cache=True, nogil=True, inline="always")
def _sift_down(hs, hi, n, c, v, j, mode):
    """Place (v, j) at slot c of the heap hs[:n]/hi[:n] whose root is the entry coming last in ``mode``."""
    while True:
        left = 2 * c + 1
        if left >= n:
            break
        child = left
        right = left + 1
        if right < n and _after(mode, hs[right], hi[right], hs[left], hi[left]):
            child = right
        if _after(mode, hs[child], hi[child], v, j):
            hs[c] = hs[child]
            hi[c] = hi[child]
            c = child
        else:
            break
    hs[c] = v
    hi[c] = j


@njit(cache=True, nogil=True, inline="always")
def _push(hs, hi, n, v, j):
    """Add (v, j) to the heap hs[:n]/hi[:n] (root = worst entry), which has room; return n + 1."""
    c = n
    while c > 0:
        parent = (c - 1) // 2
        if not _worse(v, j, hs[parent], hi[parent]):
            break
        hs[c] = hs[parent]
        hi[c] = hi[parent]
        c = parent
    hs[c] = v
    hi[c] = j
    return n + 1


@njit(cache=True, nogil=True, inline="always")
def heap_offer(hs, hi, n, k, v, j):
    """Offer entry (v, j) to the size-k heap hs[:n]/hi[:n]; return the new count.

    Scores that are not candidates (NaN, -inf) are rejected; with a full heap, (v, j) replaces the root
    only when it ranks strictly above it.
    """
    if not (v > -np.inf):
        return n
    if n < k:
        return _push(hs, hi, n, v, j)
    if k > 0 and _worse(hs[0], hi[0], v, j):
        _sift_down(hs, hi, n, 0, v, j, ORDER_BEST)
    return n


@njit(cache=True, nogil=True)
def heap_finish(hs, hi, n, mode):
    """Reorder the selection heap hs[:n]/hi[:n] in place into output order ``mode``."""
    if mode == ORDER_NONE or n < 2:
        return
    if mode == ORDER_ID:  # heapify with the largest id at the root
        for c in range((n - 2) // 2, -1, -1):
            _sift_down(hs, hi, n, c, hs[c], hi[c], mode)
    # heapsort: the root (last in output order) goes to the end
    for m in range(n - 1, 0, -1):
        vs = hs[m]
        vi = hi[m]
        hs[m] = hs[0]
        hi[m] = hi[0]
        _sift_down(hs, hi, m, 0, vs, vi, mode)


@njit(cache=True, nogil=True)
def pad_row(hs, hi, n):
    """Pad hs[n:] with -inf and hi[n:] with -1."""
    for t in range(n, hs.shape[0]):
        hs[t] = -np.inf
        hi[t] = -1


@njit(cache=True, nogil=True, inline="always")
def _store(hs, hi, n, out_s, out_i, r):
    """Write the n entries hs[:n]/hi[:n] to row r of out_s/out_i, padded with -inf / -1."""
    for t in range(n):
        out_s[r, t] = hs[t]
        out_i[r, t] = hi[t]
    for t in range(n, out_s.shape[1]):
        out_s[r, t] = -np.inf
        out_i[r, t] = -1


# ------------------------------------------------------------------------------------------ kernels


@njit(cache=True, nogil=True, inline="always")
def _row_topk(scores, r, k, is_causal, limit, key_positions, key_ids, hs, hi, n):
    """Offer row r of ``scores`` (allowed columns only) to the size-k heap hs[:n]/hi[:n]; return n."""
    if k <= 0:
        return n
    for c in range(scores.shape[1]):
        if is_causal and key_positions[c] > limit:
            continue
        v = scores[r, c]
        if not (v > -np.inf):
            continue
        j = key_ids[c]
        if n < k:
            n = _push(hs, hi, n, v, j)
        elif v > hs[0] or (v == hs[0] and j < hi[0]):
            _sift_down(hs, hi, n, 0, v, j, ORDER_BEST)
    return n


@njit(cache=True, parallel=True)
def block_topk(scores, k, is_causal, query_positions, key_positions, key_ids, out_s, out_i, order,
               accumulate):
    """Top-k of each row of a block of scores, written into ``out_s`` / ``out_i``.

    scores (b, n) float; k int (``k <= out_s.shape[1]``; slots past the selection are padded);
    is_causal bool: column c is allowed for row r only when ``key_positions[c] <= query_positions[r]``
    (query_positions (b,) int64, key_positions (n,) int64; ignored when not causal);
    key_ids (n,) integer: the key id of each column (ties are broken by these ids);
    out_s (b, K) float (scores' dtype), out_i (b, K) int32/int64: rows of ``min(k, candidates)`` entries
    padded with ``-inf`` / ``-1``, in ``order`` (ORDER_NONE / ORDER_BEST / ORDER_ID);
    accumulate bool: the valid entries already in out_s/out_i (id >= 0, score > -inf) compete too, so
    a running top-k can be merged with one new score block after another (ids must not repeat).
    Returns (b,) int64: the number of entries kept per row.
    """
    b = scores.shape[0]
    counts = np.zeros(b, dtype=np.int64)
    kk = min(k, out_s.shape[1])
    for r in prange(b):
        # per-row scratch heap (views of the shared output would contend on its reference count)
        hs = np.empty(max(kk, 1), dtype=out_s.dtype)
        hi = np.empty(max(kk, 1), dtype=out_i.dtype)
        n = 0
        if accumulate:
            for t in range(out_s.shape[1]):
                if out_i[r, t] >= 0:
                    n = heap_offer(hs, hi, n, kk, out_s[r, t], out_i[r, t])
        limit = query_positions[r] if is_causal else 0
        n = _row_topk(scores, r, kk, is_causal, limit, key_positions, key_ids, hs, hi, n)
        heap_finish(hs, hi, n, order)
        _store(hs, hi, n, out_s, out_i, r)
        counts[r] = n
    return counts


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _dot(q, i, keys, j, zero):
    s = zero
    for e in range(q.shape[1]):
        s += q[i, e] * keys[j, e]
    return s


@njit(cache=True, nogil=True, inline="always")
def rerank_ids(q, i, keys, row, sorted_row, k, hs, hi):
    """Offer candidate ids ``row`` (-1 / out of range skipped) scored by ``q[i] . keys[j]``; return n.

    ``sorted_row``: row is ascending, so repeated ids are adjacent and dropped.
    """
    S = keys.shape[0]
    zero = q.dtype.type(0.0)
    n = 0
    prev = -1
    for p in range(row.shape[0]):
        j = row[p]
        if j < 0 or j >= S or (sorted_row and j == prev):
            continue
        prev = j
        n = heap_offer(hs, hi, n, k, _dot(q, i, keys, j, zero), j)
    return n


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def rerank_topk(q, keys, cand, k, unique):
    """Exact re-rank of candidate key ids: the top-k of each row's candidates by ``q_i . keys_j``.

    q (L, E), keys (S, E) same float dtype; cand (L, C) integer ids, -1 = none (ids outside [0, S) are
    ignored too); unique bool: the caller guarantees no id repeats within a row (skips a per-row sort;
    with ``False`` duplicates are dropped).  Scores are accumulated in q's dtype.
    Returns (scores (L, k) in q's dtype, best first, -inf padded; ids (L, k) int64, -1 padded).
    """
    L = cand.shape[0]
    out_ids = np.empty((L, k), dtype=np.int64)
    out_scores = np.empty((L, k), dtype=q.dtype)
    for i in prange(L):
        hs = np.empty(max(k, 1), dtype=q.dtype)  # per-row scratch heap
        hi = np.empty(max(k, 1), dtype=np.int64)
        if unique:
            n = rerank_ids(q, i, keys, cand[i], False, k, hs, hi)
        else:
            n = rerank_ids(q, i, keys, np.sort(cand[i]), True, k, hs, hi)
        heap_finish(hs, hi, n, ORDER_BEST)
        _store(hs, hi, n, out_scores, out_ids, i)
    return out_scores, out_ids


# ----------------------------------------------------------------- cluster-selector building blocks


@njit(cache=True, nogil=True)
def _count_ge(vals, n, t):
    c = 0
    for j in range(n):
        c += vals[j] >= t
    return c


@njit(cache=True, nogil=True)
def _kth_threshold(vals, n, k):
    """A value t with ``#(vals[:n] > t) < k <= #(vals[:n] >= t)`` (1 <= k < n; no NaN or -inf).

    Bisection on the value with a branch-free (SIMD) count per step: on rows of a few hundred scores this
    is several times faster than a heap or ``np.partition`` (the per-cluster rows of ``mode=topk``).
    Compiled without fastmath so the midpoint ``0.5*lo + 0.5*hi`` cannot overflow and adjacent floats
    end the search.
    """
    lo = np.inf
    hi = -np.inf
    n_inf = 0
    for j in range(n):
        v = vals[j]
        if v == np.inf:
            n_inf += 1
            continue
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    if n_inf >= k:  # +inf scores: the bisection below runs over the finite ones only
        return vals.dtype.type(np.inf)
    if _count_ge(vals, n, hi) >= k:
        return hi
    for _ in range(4096):  # invariant: #(>= lo) > k and #(>= hi) < k; lo, hi finite
        mid = 0.5 * lo + 0.5 * hi
        if not (lo < mid and mid < hi):
            break  # adjacent floats: the values in [lo, hi) all equal lo
        c = _count_ge(vals, n, mid)
        if c == k:
            return mid
        if c > k:
            lo = mid
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def _select(vals, ids, m, kk, out_s, out_i, r):
    """Write the top-kk of ``vals[:m]`` (ties: smallest id) into row r of out_s/out_i; returns the count.

    The k-th largest value by bisection, then the values above it, then the ties at it by smallest id
    (the same result as the heap of :func:`block_topk`).  ``vals`` is scratch: taken ties are
    overwritten.
    """
    if m <= kk:
        for j in range(m):
            out_s[r, j] = vals[j]
            out_i[r, j] = ids[j]
        return m
    cnt = 0
    thr = _kth_threshold(vals, m, kk)
    for j in range(m):
        if vals[j] > thr and cnt < kk:  # (cnt < kk always holds: bounds kept explicit)
            out_s[r, cnt] = vals[j]
            out_i[r, cnt] = ids[j]
            cnt += 1
    while cnt < kk:  # ties at the threshold: smallest id first (rarely more than one pass)
        best = -1
        for j in range(m):
            if vals[j] == thr and (best < 0 or ids[j] < ids[best]):
                best = j
        out_s[r, cnt] = vals[best]
        out_i[r, cnt] = ids[best]
        vals[best] = -np.inf  # taken
        cnt += 1
    return cnt


@njit(cache=True, nogil=True)
def rows_topk(S, k, key_ids, out_s, out_i):
    """Top-k entries of each row of a score block; serial and ``nogil`` (for worker threads).

    S (R, n) scores (NaN / ``-inf`` never selected); key_ids (n,) int64 id of each column (ties broken
    by the smaller id); writes out_s (R, k) scores and out_i (R, k) int32 ids, unordered, padded with
    ``-inf`` / -1.  Selection by bisection on the k-th value (:func:`_select`).
    """
    R, n = S.shape
    kk = min(k, out_s.shape[1])
    vals = np.empty(n, dtype=S.dtype)
    ids = np.empty(n, dtype=np.int64)
    for r in range(R):
        m = 0
        for c in range(n):
            s = S[r, c]
            if s > -np.inf:  # drops NaN and -inf
                vals[m] = s
                ids[m] = key_ids[c]
                m += 1
        cnt = _select(vals, ids, m, kk, out_s, out_i, r)
        for t2 in range(cnt, out_s.shape[1]):
            out_s[r, t2] = -np.inf
            out_i[r, t2] = -1


@njit(parallel=True, cache=True)
def merge_topk(cand_s, cand_i, slot, p, k):
    """Per query, the top-k of its p candidate lists, as canonical CSR (ids sorted ascending).

    cand_s (n_pairs, w) float, cand_i (n_pairs, w) int32 (-1 = none); slot (L*p,) int64: query i's lists
    are rows ``slot[i*p : (i+1)*p]``.  Ids must be unique across a query's lists (no deduplication).
    Returns indptr (L+1,) int64 and indices (nnz,) int32.  Selection by bisection (:func:`_select`).
    """
    L = slot.shape[0] // p if p > 0 else 0
    w = cand_i.shape[1]
    kk = max(k, 1)
    top_s = np.empty((L, kk), dtype=cand_s.dtype)
    top_i = np.empty((L, kk), dtype=np.int32)
    counts = np.zeros(L, dtype=np.int64)
    for i in prange(L):
        vals = np.empty(max(p * w, 1), dtype=cand_s.dtype)
        ids = np.empty(max(p * w, 1), dtype=np.int32)
        m = 0
        for t in range(p):
            s = slot[i * p + t]
            for c in range(w):
                j = cand_i[s, c]
                if j >= 0 and cand_s[s, c] > -np.inf:
                    vals[m] = cand_s[s, c]
                    ids[m] = j
                    m += 1
        counts[i] = _select(vals, ids, m, k, top_s, top_i, i) if k > 0 else 0
    indptr, indices = csr_alloc(counts)
    for i in prange(L):
        row = np.sort(top_i[i, :counts[i]])
        indices[indptr[i]:indptr[i + 1]] = row
    return indptr, indices
