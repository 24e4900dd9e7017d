"""Numba kernels of the two LSH selectors: hash codes, multi-probe sequences, bucket windows.

Plain functions over arrays and scalars (no closures), so ``cache=True`` works.  The random projections
themselves are one BLAS product done by the caller (``X @ W``); these kernels turn projections into
codes and gather candidates.

Hash families (``proj`` holds ``X @ W`` for the rows to hash):

* SimHash (signed random projections, Charikar 2002): value = ``n_bits`` sign bits packed into an integer;
  two vectors at angle ``theta`` agree on one bit with probability ``1 - theta/pi``.
* Cross-polytope (Andoni et al. 2015; the Reformer's "angular LSH"): value = ``argmax`` over the
  ``2 * n_dirs`` signed projections ``[xR, -xR]``; an id in ``[0, 2 * n_dirs)``.  Scale-invariant, so
  normalising the vectors first changes nothing.

Candidate gathering for ``angular-lsh`` works on each round's sorted key order (by bucket, then by
decreasing norm or by id): a query has a *slot* in that order (computed by :func:`query_slots`) and
gathers a window of it (:func:`_window`); duplicates across rounds are dropped with a stamp array,
future keys (causal) are skipped while gathering.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .options import FASTMATH
from .topk import ORDER_BEST, heap_finish, pad_row, rerank_ids

# ------------------------------------------------------------------------------------------ hash codes


@njit(cache=True, inline="always")
def _simhash_code(proj, i, base, n_bits):
    """Sign bits of ``proj[i, base : base + n_bits]`` packed into an integer (bit b: ``> 0``)."""
    code = 0
    for b in range(n_bits):
        if proj[i, base + b] > 0:
            code |= 1 << b
    return code


@njit(cache=True, inline="always")
def _crosspolytope_code(proj, i, base, n_dirs):
    """(id, value) of the first maximum over ``[x, -x]``, ``x = proj[i, base : base + n_dirs]``."""
    best = 0
    best_val = proj[i, base]
    for a in range(n_dirs):
        x = proj[i, base + a]
        if x > best_val:
            best_val = x
            best = a
        if -x > best_val:
            best_val = -x
            best = n_dirs + a
    return best, best_val


@njit(parallel=True, cache=True)
def simhash_values(proj, n_values, n_bits):
    """Pack sign bits into hash values.

    proj (N, n_values * n_bits) float; returns (N, n_values) uint32 where bit b of value v is
    ``proj[:, v * n_bits + b] > 0``.
    """
    N = proj.shape[0]
    out = np.empty((N, n_values), dtype=np.uint32)
    for i in prange(N):
        for v in range(n_values):
            out[i, v] = _simhash_code(proj, i, v * n_bits, n_bits)
    return out


@njit(parallel=True, cache=True)
def crosspolytope_values(proj, n_values, n_dirs):
    """Cross-polytope hash values: argmax over the signed projections of each group.

    proj (N, n_values * n_dirs) float; returns (N, n_values) uint32 in ``[0, 2 * n_dirs)``: id ``a`` for
    ``+proj[:, v*n_dirs + a]`` and ``n_dirs + a`` for ``-proj[:, v*n_dirs + a]`` (first maximum wins).
    """
    N = proj.shape[0]
    out = np.empty((N, n_values), dtype=np.uint32)
    for i in prange(N):
        for v in range(n_values):
            out[i, v] = _crosspolytope_code(proj, i, v * n_dirs, n_dirs)[0]
    return out


@njit(cache=True)
def _insert_cheapest(costs, tab_pos, alts, n_kept, cost, pos, alt):
    """Keep the ``len(costs)`` cheapest (cost, pos, alt) triples, sorted ascending by cost."""
    cap = costs.shape[0]
    if n_kept == cap and cost >= costs[cap - 1]:
        return n_kept
    p = n_kept if n_kept < cap else cap - 1
    while p > 0 and costs[p - 1] > cost:
        costs[p] = costs[p - 1]
        tab_pos[p] = tab_pos[p - 1]
        alts[p] = alts[p - 1]
        p -= 1
    costs[p] = cost
    tab_pos[p] = pos
    alts[p] = alt
    return n_kept + 1 if n_kept < cap else cap


@njit(cache=True)
def _probe_scratch(n_probes):
    """Scratch of :func:`_insert_cheapest` for ``n_probes`` probes: (costs, tab_pos, alts)."""
    cap = max(n_probes, 1)
    return np.empty(cap, dtype=np.float64), np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)


@njit(parallel=True, cache=True)
def simhash_probes(proj, n_tables, per_table, n_bits, n_probes):
    """Multi-probe sequences for SimHash tables (single-bit perturbations, Lv et al. 2007).

    A table key is ``per_table`` hash values of ``n_bits`` bits each.  Probe 0 is the query's own code;
    probe t >= 1 flips, in every table at once, the t-th least confident bit of that table (smallest
    ``|projection|``).

    proj (N, n_tables * per_table * n_bits); returns (N, n_probes + 1, n_tables * per_table) uint32.
    Requires ``n_probes <= per_table * n_bits``.
    """
    N = proj.shape[0]
    H = n_tables * per_table
    out = np.empty((N, n_probes + 1, H), dtype=np.uint32)
    for i in prange(N):
        for v in range(H):
            out[i, :, v] = _simhash_code(proj, i, v * n_bits, n_bits)
        costs, tab_pos, alts = _probe_scratch(n_probes)
        for tb in range(n_tables if n_probes > 0 else 0):  # n_probes == 0: the own codes only
            n_kept = 0
            for v in range(tb * per_table, (tb + 1) * per_table):
                for b in range(n_bits):
                    n_kept = _insert_cheapest(costs, tab_pos, alts, n_kept,
                                              abs(np.float64(proj[i, v * n_bits + b])), v, b)
            for t in range(n_kept):
                v = tab_pos[t]
                out[i, t + 1, v] = out[i, 0, v] ^ np.uint32(1 << alts[t])
    return out


@njit(parallel=True, cache=True)
def crosspolytope_probes(proj, n_tables, per_table, n_dirs, n_probes):
    """Multi-probe sequences for cross-polytope tables (single-value perturbations).

    Probe 0 is the query's own code; probe t >= 1 replaces, in every table at once, the one hash value
    of that table whose runner-up bucket is the t-th cheapest, costed by ``best - score(bucket)``
    (Andoni et al. 2015, Sect. 5).

    proj (N, n_tables * per_table * n_dirs); returns (N, n_probes + 1, n_tables * per_table) uint32.
    Requires ``n_probes <= per_table * (2 * n_dirs - 1)``.
    """
    N = proj.shape[0]
    H = n_tables * per_table
    M = 2 * n_dirs
    out = np.empty((N, n_probes + 1, H), dtype=np.uint32)
    for i in prange(N):
        best_val = np.empty(H, dtype=np.float64)
        for v in range(H):
            best, best_val[v] = _crosspolytope_code(proj, i, v * n_dirs, n_dirs)
            out[i, :, v] = best
        costs, tab_pos, alts = _probe_scratch(n_probes)
        for tb in range(n_tables if n_probes > 0 else 0):
            n_kept = 0
            for v in range(tb * per_table, (tb + 1) * per_table):
                base = v * n_dirs
                for a in range(M):
                    if a == out[i, 0, v]:
                        continue
                    x = np.float64(proj[i, base + (a if a < n_dirs else a - n_dirs)])
                    score = x if a < n_dirs else -x
                    n_kept = _insert_cheapest(costs, tab_pos, alts, n_kept, best_val[v] - score, v, a)
            for t in range(n_kept):
                out[i, t + 1, tab_pos[t]] = np.uint32(alts[t])
    return out


# -------------------------------------------------------------------------------- angular-lsh (Reformer)


@njit(parallel=True, cache=True)
def crosspolytope_buckets(proj, n_rounds, n_hashes, n_dirs):
    """Per-round buckets from ``n_hashes`` concatenated cross-polytope hashes.

    proj (N, n_rounds * n_hashes * n_dirs); returns (n_rounds, N) int64 with bucket
    ``sum_h value_h * (2 n_dirs)**(n_hashes - 1 - h)`` (the first hash is the most significant digit, so
    sorting by bucket groups keys by their first hash, then their second, ...).
    """
    N = proj.shape[0]
    M = 2 * n_dirs
    out = np.empty((n_rounds, N), dtype=np.int64)
    for i in prange(N):
        for r in range(n_rounds):
            bucket = 0
            for h in range(n_hashes):
                bucket = bucket * M + _crosspolytope_code(proj, i, (r * n_hashes + h) * n_dirs, n_dirs)[0]
            out[r, i] = bucket
    return out


@njit(cache=True)
def _lower_bound(arr, lo, hi, value):
    """First p in [lo, hi) with arr[p] >= value (hi if none); arr ascending on [lo, hi)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if arr[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(parallel=True, cache=True)
def query_slots(q_buckets, sorted_buckets, sorted_ids, prefix):
    """Each query's slot in each round's sorted key order.

    q_buckets (R, L) int64; sorted_buckets / sorted_ids (R, S): keys sorted by bucket, ids ascending inside
    a bucket; prefix (L,) int64: the query sits after the keys of its bucket with id < prefix[i] (prefix 0
    gives the bucket start, whatever the order inside the bucket).
    Returns (slots (R, L) int64, bucket_lo (R, L) int64, bucket_hi (R, L) int64): the slot and the
    [lo, hi) range of the query's bucket in the sorted order.
    """
    R, L = q_buckets.shape
    S = sorted_buckets.shape[1]
    slots = np.empty((R, L), dtype=np.int64)
    lo_out = np.empty((R, L), dtype=np.int64)
    hi_out = np.empty((R, L), dtype=np.int64)
    for i in prange(L):
        for r in range(R):
            b = q_buckets[r, i]
            lo = _lower_bound(sorted_buckets[r], 0, S, b)
            hi = _lower_bound(sorted_buckets[r], lo, S, b + 1)
            slots[r, i] = _lower_bound(sorted_ids[r], lo, hi, prefix[i])
            lo_out[r, i] = lo
            hi_out[r, i] = hi
    return slots, lo_out, hi_out


@njit(cache=True)
def _window(slot, lo, hi, S, chunk, forward):
    """[a, b) of the sorted key order a query looks at in one round.

    chunk == 0: the query's whole bucket [lo, hi).  forward=False (Reformer): the chunk of size ``chunk``
    holding the slot and the chunk before it.  forward=True: the ``2 * chunk`` keys from the slot on
    (shifted back at the end of the order so that the window keeps ``min(2 * chunk, S)`` keys).
    """
    if chunk == 0:
        return lo, hi
    if forward:
        a = min(slot, max(S - 2 * chunk, 0))
        return a, min(a + 2 * chunk, S)
    c = slot // chunk
    if slot == S and S > 0:  # a slot past the last key belongs to the last chunk
        c = (S - 1) // chunk
    a = (c - 1) * chunk
    b = (c + 1) * chunk
    return max(a, 0), min(b, S)


@njit(cache=True)
def _gather_row(i, slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos, stamp, buf):
    """Distinct (causal-allowed) candidates of query i over all rounds, in first-seen order.

    ``stamp`` (S,) int64 is scratch shared by the rows of one block: ``stamp[j] == i + 1`` marks key j as
    already taken for row i, so duplicates across rounds cost O(1) each (no per-row sort).
    Returns the count written to ``buf``.
    """
    R = slots.shape[0]
    S = sorted_ids.shape[1]
    mark = i + 1
    n = 0
    for r in range(R):
        a, b = _window(slots[r, i], lo[r, i], hi[r, i], S, chunk, forward)
        for p in range(a, b):
            j = sorted_ids[r, p]
            if stamp[j] == mark:
                continue
            stamp[j] = mark
            if causal and kpos[j] > qpos[i]:
                continue
            buf[n] = j
            n += 1
    return n


@njit(cache=True)
def _row_capacity(i, slots, lo, hi, S, chunk, forward):
    total = 0
    for r in range(slots.shape[0]):
        a, b = _window(slots[r, i], lo[r, i], hi[r, i], S, chunk, forward)
        total += b - a
    return total


@njit(cache=True)
def _max_capacity(r0, r1, slots, lo, hi, S, chunk, forward):
    cap = 1
    for i in range(r0, r1):
        cap = max(cap, _row_capacity(i, slots, lo, hi, S, chunk, forward))
    return min(cap, S)


_ROW_BLOCK = 256  # rows sharing one stamp array (S int64) in the gathering kernels


@njit(cache=True)
def _block_scratch(blk, slots, lo, hi, S, chunk, forward):
    """Rows [r0, r1) of gathering block ``blk``, with their stamp array and candidate buffer."""
    r0 = blk * _ROW_BLOCK
    r1 = min(r0 + _ROW_BLOCK, slots.shape[1])
    buf = np.empty(_max_capacity(r0, r1, slots, lo, hi, S, chunk, forward), dtype=np.int64)
    return r0, r1, np.zeros(S, dtype=np.int64), buf


@njit(parallel=True, cache=True)
def window_counts(slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos):
    """Number of distinct (causal-allowed) candidates per query: (L,) int64."""
    L = slots.shape[1]
    counts = np.zeros(L, dtype=np.int64)
    for blk in prange((L + _ROW_BLOCK - 1) // _ROW_BLOCK):
        r0, r1, stamp, buf = _block_scratch(blk, slots, lo, hi, sorted_ids.shape[1], chunk, forward)
        for i in range(r0, r1):
            counts[i] = _gather_row(i, slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos, stamp, buf)
    return counts


@njit(parallel=True, cache=True)
def window_fill(slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos, indptr):
    """CSR indices (int32, sorted unique per row) of all candidates; indptr from :func:`window_counts`."""
    L = slots.shape[1]
    out = np.empty(indptr[L], dtype=np.int32)
    for blk in prange((L + _ROW_BLOCK - 1) // _ROW_BLOCK):
        r0, r1, stamp, buf = _block_scratch(blk, slots, lo, hi, sorted_ids.shape[1], chunk, forward)
        for i in range(r0, r1):
            m = _gather_row(i, slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos, stamp, buf)
            out[indptr[i]:indptr[i] + m] = np.sort(buf[:m])
    return out


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def window_topk(q, keys, slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos, k):
    """Exact top-k by inner product among each query's candidates (selection by the shared top-k core).

    q (L, E), keys (S, E) same float dtype.  Returns ids (L, k) int64, -1 padded, best first (ties by
    smaller id; NaN scores never selected).
    """
    L = slots.shape[1]
    out = np.empty((L, k), dtype=np.int64)
    for blk in prange((L + _ROW_BLOCK - 1) // _ROW_BLOCK):
        r0, r1, stamp, buf = _block_scratch(blk, slots, lo, hi, sorted_ids.shape[1], chunk, forward)
        hs = np.empty(k, dtype=q.dtype)
        for i in range(r0, r1):
            m = _gather_row(i, slots, lo, hi, sorted_ids, chunk, forward, causal, qpos, kpos, stamp, buf)
            # buf[:m] holds distinct ids in [0, S)
            n = rerank_ids(q, i, keys, buf[:m], False, k, hs, out[i])
            heap_finish(hs, out[i], n, ORDER_BEST)
            pad_row(hs, out[i], n)
    return out
