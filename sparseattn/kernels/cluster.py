"""Numba kernels of the cluster index and routed attention (``sparseattn.index.cluster``,
``sparseattn.attention.routed``).

The dense arithmetic (per-cluster ``Q_c K_c^T`` and ``P_c V_c``) is BLAS on contiguous blocks; these kernels
drive it and do the irregular parts around it without Python loops or numpy fancy indexing:

* ``col_argmax`` / ``row_top_p``: key -> cluster assignment and query -> top-p cluster routing;
* ``kmeanspp_seeds`` / ``assign_chunk`` / ``member_sums``: k-means++ starting rows; each row's centroid,
  one chunk of rows per worker (k-means rounds and key assignment); per-cluster sums of a round;
* ``group_pairs``: counting sort of the (query, probe) pairs by cluster (a CSR cluster -> queries);
* ``gather_rows``: row gathers (keys and values into cluster order, queries for top-k);
* ``gather_pairs``: the contiguous copy of each cluster's queries for attention (scaled), and an upper
  bound m of each row's scores;
* ``shifted_exp_rows_f32`` / ``_f64``: one pass over a score tile: ``exp(max(s - m, clamp))``, causal
  mask, row sums;
* ``cluster_radius``: per cluster the largest key-to-centroid distance (for that bound);
* ``cluster_means``: per cluster the mean of its keys (the default routing vectors);
* ``attend_clusters_f32`` / ``_f64``: one worker's share of the per-cluster tiles: ``Q_c K_c^T`` and
  ``P_c V_c`` through BLAS (Numba's ``np.dot``) around that exp pass;
* ``causal_mask_block``: ``-inf`` where a key lies after its query, inside one cluster block;
* ``scan_pairs``: after a pass, marks pairs without allowed keys empty and lists those to refine;
* ``exact_pairs``: a scalar last-resort recomputation of pairs with their true row maximum;
* ``routed_pattern``: the CSR of all keys of each query's routed clusters.

Each query's partials across its clusters are merged by :func:`sparseattn.kernels.merge.merge_partials`.
The per-cluster top-k of ``mode=topk`` is the shared core's (:mod:`sparseattn.kernels.topk`).
The serial ``nogil`` kernels (``causal_mask_block``, ``attend_clusters_f32``, ...) are the ones called from the
worker threads (:func:`sparseattn.threads.run_jobs`): Numba's parallel pool must not be entered from
several Python threads at once.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .intrinsics import LOG2E, pow2_f32
from .options import FASTMATH, serial_and_parallel
from .pattern_ops import emit, two_pass_csr

_LOG2E_F64 = 1.0 / math.log(2.0)
_CHUNK = 8  # columns per chunk in the first passes below (a compile-time constant, so it vectorises)
_ROWS = 64  # rows per scratch allocation: the row loops allocate their scratch once per 64 rows


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _chunk_max(row, C, cmax):
    """cmax[b] = max(row[8b : 8b + 8]) for each chunk of ``_CHUNK`` columns (the last may be shorter)."""
    W = _CHUNK
    n_full = C // W
    for b in range(n_full):
        m = row[b * W]
        for c in range(1, W):
            v = row[b * W + c]
            m = v if v > m else m  # this form vectorises (the builtin max() did not)
        cmax[b] = m
    if n_full * W < C:
        m = row[n_full * W]
        for c in range(n_full * W + 1, C):
            v = row[c]
            m = v if v > m else m
        cmax[n_full] = m


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def col_argmax(s, half, labels, best):
    """Row of the largest ``s[c, j] - half[c]`` in each column j (the first one on ties).

    s (C, n) float32 or float64 scores, one row per centroid (``centroids @ x^T``: the layout in which the
    comparison runs 16 columns a vector, 5x faster than an argmax along each key's row), C >= 1;
    half (C,) in s's dtype (``|c|^2 / 2`` for the nearest centroid, zeros for the largest inner
    product).  Writes labels (n,) int32 and best (n,) in s's dtype (that largest value).  A NaN never
    wins a comparison: a column of NaNs gets row 0 (inputs are checked finite before this).
    Serial and ``nogil``: called from the worker threads."""
    C, n = s.shape
    h = half[0]
    for j in range(n):
        best[j] = s[0, j] - h
        labels[j] = 0
    for c in range(1, C):
        h = half[c]
        for j in range(n):
            v = s[c, j] - h
            if v > best[j]:
                best[j] = v
                labels[j] = c


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _nearer(x, j, d2):
    """``d2[i] = min(d2[i], |x[i] - x[j]|^2)`` for every row of x (m, E) float32; d2 (m,) float64."""
    m, E = x.shape
    for i in range(m):
        s = 0.0
        for e in range(E):
            t = np.float64(x[i, e]) - np.float64(x[j, e])
            s += t * t
        if s < d2[i]:
            d2[i] = s


@njit(cache=True, nogil=True)
def kmeanspp_seeds(x, u, out):
    """k-means++ seeding (Arthur and Vassilvitskii, 2007): ``len(out)`` distinct rows of x (m, E) float32,
    each drawn with probability proportional to its squared distance to the nearest row drawn before.

    u (C,) float64 uniform draws in [0, 1), one per seed (the first picks uniformly); writes out (C,)
    int64 row ids, C <= m.  Rows at distance 0 from every seed so far are drawn only when every row is
    (then the first row not yet drawn).  The running total and the walk that picks add ``d2`` in the same
    order without fastmath, so the walk always reaches the drawn mass."""
    m = x.shape[0]
    C = out.shape[0]
    d2 = np.full(m, np.inf)
    taken = np.zeros(m, dtype=np.bool_)
    pick = min(m - 1, int(u[0] * m))
    for c in range(C):
        if c > 0:
            tot = 0.0
            for i in range(m):
                tot += d2[i]
            pick = -1
            if tot > 0.0:
                r = u[c] * tot
                acc = 0.0
                for i in range(m):
                    acc += d2[i]
                    if acc > r:
                        pick = i
                        break
            if pick < 0:
                for i in range(m):
                    if not taken[i]:
                        pick = i
                        break
        out[c] = pick
        taken[pick] = True
        _nearer(x, pick, d2)
        d2[pick] = 0.0


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def member_sums(x, labels, C, out, count):
    """Per cluster the float64 sum of its member rows, each cluster's members added in row order.

    x (n, E) float32 rows, labels (n,) int32 in [0, C); writes out (C, E) float64 and count (C,) int64.
    A counting sort lists each cluster's members (ascending rows), then each cluster is summed alone: the
    sums do not depend on how the labels were computed (chunks, threads).  Serial and ``nogil``: the
    k-means runs on worker threads too (one per head in the decode cache)."""
    n, E = x.shape
    count[:] = 0
    for i in range(n):
        count[labels[i]] += 1
    ptr = np.empty(C + 1, dtype=np.int64)
    ptr[0] = 0
    for c in range(C):
        ptr[c + 1] = ptr[c] + count[c]
    fill = ptr[:C].copy()
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        c = labels[i]
        order[fill[c]] = i
        fill[c] += 1
    for c in range(C):
        for e in range(E):
            out[c, e] = 0.0
        for j in range(ptr[c], ptr[c + 1]):
            r = order[j]
            for e in range(E):
                out[c, e] += x[r, e]


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def assign_chunk(x, cent, half, buf, labels, best):
    """Centroid of each row of one chunk: the largest ``x . c - half[c]`` (first on ties).

    x (n, E) rows and cent (C, E) centroids, float32 or float64 (the same dtype); half (C,) in that
    dtype (``|c|^2 / 2`` for the nearest centroid, zeros for the largest inner product); buf (>= C * n,)
    scratch in that dtype.  Scores ``cent @ x^T`` through BLAS (Numba's ``np.dot``), then
    :func:`col_argmax`.  Writes labels (n,) int32 and best (n,) (the largest ``score - half``).
    Serial and ``nogil``: called from the worker threads, one chunk of rows each."""
    n = x.shape[0]
    C = cent.shape[0]
    sc = buf[:C * n].reshape((C, n))
    np.dot(cent, x.T, sc)
    col_argmax(sc, half, labels, best)


@njit(cache=True, nogil=True, inline="always")
def _insert_top(v, c, n_have, p, top_v, top_c):
    """Insert (v, c) into the descending list ``top_v[:n_have]`` of capacity p; return its new length.

    An entry equal to one already listed goes after it (callers insert in column order: ties keep the
    lower column first).  NaN is never inserted into a full list.
    """
    if n_have == p:
        if not (v > top_v[p - 1]):
            return n_have
        pos = p - 1
    else:
        pos = n_have
        n_have += 1
    while pos > 0 and v > top_v[pos - 1]:
        top_v[pos] = top_v[pos - 1]
        top_c[pos] = top_c[pos - 1]
        pos -= 1
    top_v[pos] = v
    top_c[pos] = c
    return n_have


_BISECT = 16  # halvings of the threshold interval in _threshold
_RANK_MAX = 128  # candidates up to which _row_top_p ranks by counting (m^2 compares), else by insertion


@njit(cache=True, nogil=True, inline="always")
def _threshold(cmax, n_ch, p):
    """A lower bound t of the p-th largest of ``cmax[:n_ch]`` (no NaN) with at least p entries >= t,
    close to it: -inf when fewer than p entries are finite or above -inf; else the bisection of
    [least entry above -inf, largest] on ``count(cmax >= t) >= p`` (at most ``_BISECT`` halvings, ending
    early when exactly p entries reach the midpoint; each midpoint rounded to the scores' dtype and counted
    in it, a vectorised loop, where a sorted insertion or a quickselect of the entries cost ~3 us a row at
    144 entries, most of it mispredicted branches).  Any such t gives the same final columns; a closer one
    only gives fewer candidates."""
    n_fin = 0
    lo = np.inf
    hi = -np.inf
    for b in range(n_ch):
        x = np.float64(cmax[b])
        fin = x > -np.inf
        n_fin += fin
        lo = x if fin and x < lo else lo
        hi = x if x > hi else hi
    if n_fin < p:
        return -np.inf
    for _ in range(_BISECT):
        mid = cmax.dtype.type(lo + (hi - lo) * 0.5)  # compared in the scores' dtype: 8 lanes in float32
        if not (mid > lo and mid < hi):  # the interval is one float wide (or inf): lo stands
            break
        cnt = np.float32(0.0)  # a float count vectorises best (exact: n_ch < 2**24)
        for b in range(n_ch):
            cnt += np.float32(1.0) if cmax[b] >= mid else np.float32(0.0)
        if cnt >= p:
            lo = np.float64(mid)
            if cnt == p:  # exactly p entries reach it: no closer threshold exists
                break
        else:
            hi = np.float64(mid)
    return lo


@njit(cache=True, nogil=True, inline="always")
def _candidates(row, C, p, cmax, chunks, cand):
    """Steps (1)-(2) of :func:`_row_top_p` for a row without NaN: the columns >= a threshold t that at
    least p columns reach, in column order, into ``cand``; returns how many (>= p)."""
    W = _CHUNK
    n_ch = (C + W - 1) // W
    _chunk_max(row, C, cmax)
    t = _threshold(cmax, n_ch, p)
    n_b = 0
    for b in range(n_ch):
        chunks[n_b] = b
        n_b += cmax[b] >= t
    m_c = 0
    for u in range(n_b):
        b = chunks[u]
        for c in range(b * W, min(C, b * W + W)):
            cand[m_c] = c
            m_c += row[c] >= t
    return m_c


@njit(cache=True, nogil=True, inline="always")
def _rank_top(row, cand, m_c, p, work, seen, vals, ids):
    """The p best of the candidate columns ``cand[:m_c]`` (column order; no NaN) into vals / ids, best
    first, lower column first on ties: candidate u goes to position g + j, with g the candidates of larger
    score (a branch-free count that vectorises) and j the equal ones before it in column order
    (``seen[g]``, counted as they are placed); positions below p are written.  ``work`` (>= m_c + 8,) in
    the row's dtype and ``seen`` (>= m_c,) int64 are scratch."""
    for u in range(m_c):
        work[u] = row[cand[u]]
        seen[u] = 0
    m8 = (m_c + 7) // 8 * 8  # padded with -inf (above no score): whole 8-lane groups, no scalar tail
    for u in range(m_c, m8):
        work[u] = -np.inf
    for u in range(m_c):
        x = work[u]
        gf = np.float32(0.0)  # a float count vectorises best (exact: m_c <= _RANK_MAX)
        for w in range(m8):
            gf += np.float32(1.0) if work[w] > x else np.float32(0.0)
        g = np.int64(gf)
        r = g + seen[g]
        seen[g] += 1
        if r < p:
            vals[r] = x
            ids[r] = cand[u]


def _row_top_p(scores, p, kmin, qpos):
    """The p largest columns of each row, best first (lower column first on ties).

    scores (L, C) float, 1 <= p <= C; returns ids (L, p) int32 and their scores (L, p).  With ``kmin``
    (C,) / ``qpos`` (L,) int64 (causal routing; empty arrays: off) a column with ``kmin[c] > qpos[i]`` (a
    cluster whose every key is after the row) ranks below every other one: chosen only to fill a row
    that sees fewer than p clusters; the scores returned are the columns' own (bounds stay valid).
    Per row: (1) the maximum of each chunk of 8 columns (a fixed-width loop that vectorises), and a
    threshold t that at least p chunk maxima reach (:func:`_threshold`: a bisection just below the p-th
    largest), so at least p columns reach it too; (2) the columns >= t of the chunks whose maximum is >= t
    are collected (typically ~p to 2p) by branch-free compaction (write always, advance when kept: the
    kept/dropped pattern is random, and branch mispredictions were most of the time); (3) up to
    ``_RANK_MAX`` candidates are ranked by counting (:func:`_rank_top`), more are inserted into a sorted
    list of p.  Scratch is allocated once per block of 64 rows.  Measured serial, 16,384 rows of a
    random-projection score matrix, against the same selection by sorted insertions of every chunk
    maximum and candidate (mostly mispredicted branches): C = 256, p = 8: 7.4 against 11.0 ms; p = 12:
    9.8 against 14.4; p = 24: 23.6 against 30.1; C = 512, p = 8: 9.0 against 14.8; C = 1,152, p = 32:
    26 against 61.  A row with NaN scores (garbage in) takes the insertion path over every column, which
    still gives p in-range columns.
    """
    L, C = scores.shape
    n_ch = (C + _CHUNK - 1) // _CHUNK
    out = np.empty((L, p), dtype=np.int32)
    out_s = np.empty((L, p), dtype=scores.dtype)
    n_blocks = (L + _ROWS - 1) // _ROWS
    for blk in prange(n_blocks):
        cmax = np.empty(n_ch, dtype=scores.dtype)
        work = np.empty(min(C, _RANK_MAX) + 8, dtype=scores.dtype)
        seen = np.empty(min(C, _RANK_MAX), dtype=np.int64)
        chunks = np.empty(n_ch, dtype=np.int32)
        cand = np.empty(C, dtype=np.int32)
        masked = np.empty(C if kmin.shape[0] > 0 else 0, dtype=scores.dtype)
        for i in range(blk * _ROWS, min(L, blk * _ROWS + _ROWS)):
            row = scores[i]
            if kmin.shape[0] > 0:  # clusters after the row rank last
                qp = qpos[i]
                for c in range(C):
                    masked[c] = row[c] if kmin[c] <= qp else -np.inf
                row = masked
            z = row[0] - row[0]
            for c in range(1, C):
                z += row[c] - row[c]  # 0 unless a score is NaN or infinite (vectorises)
            nan = False
            if z != 0:
                for c in range(C):
                    nan |= row[c] != row[c]
            vals = out_s[i]
            ids = out[i]
            m_c = 0 if nan else _candidates(row, C, p, cmax, chunks, cand)
            if p <= m_c <= _RANK_MAX:
                _rank_top(row, cand, m_c, p, work, seen, vals, ids)
            elif m_c >= p:  # many candidates (C < 8p, rows that see few clusters): sorted insertion
                n_have = 0
                for u in range(m_c):
                    n_have = _insert_top(row[cand[u]], cand[u], n_have, p, vals, ids)
            else:  # NaN scores (garbage in): every column into the sorted list, then padding
                n_have = 0
                for c in range(C):
                    n_have = _insert_top(row[c], c, n_have, p, vals, ids)
                while n_have < p:
                    vals[n_have] = row[0]
                    ids[n_have] = 0
                    n_have += 1
            if kmin.shape[0] > 0:
                for u in range(p):
                    vals[u] = scores[i, ids[u]]
    return out, out_s


@njit(cache=True, nogil=True)  # no fastmath: a fused multiply-add would round differently from numpy
def spread_rank(s, qn, width, out):
    """``out[i, c] = s[i, c] + qn[i] * width[c]`` in float64 (one pass, no temporaries): the ranking of
    spread routing.  s (n, C) float32 / float64 scores ``q . c``, qn (n,) float64 query norms, width (C,)
    float64 ``spread * sigma_c``, out (>= n, C) float64: the same bits as numpy's
    ``s + qn[:, None] * width``, without its two temporaries.  Serial and ``nogil``: called on a worker's
    row chunk."""
    n, C = s.shape
    for i in range(n):
        a = qn[i]
        for c in range(C):
            out[i, c] = np.float64(s[i, c]) + a * width[c]


NO_POS = np.zeros(0, dtype=np.int64)  # the kmin / qpos of row_top_p when routing is not causal


def empty_last(kptr: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kmin, qpos)`` for :func:`row_top_p` in routing that is not causal: clusters holding no key
    (``kptr`` (C + 1,) int64 offsets; k-means leaves some empty on duplicate keys) rank last, as causal
    routing ranks the clusters after a row; else a query whose best probes are all empty reads no key.
    ``(NO_POS, NO_POS)`` (no masking, no cost) when no cluster is empty."""
    empty = kptr[1:] == kptr[:-1]
    if not empty.any():
        return NO_POS, NO_POS
    return np.where(empty, np.iinfo(np.int64).max, 0), np.zeros(n_rows, dtype=np.int64)

# Serial ``nogil`` variants run inside the worker threads (one row chunk each, right after
# that chunk's BLAS product); the parallel ones serve single calls from Python.
row_top_p_serial, row_top_p = serial_and_parallel(_row_top_p, fastmath=FASTMATH, nogil=True)


@njit(cache=True)
def group_pairs(route, n_clusters):
    """Counting sort of the (query i, probe t) pairs by routed cluster ``route[i, t]``.

    Returns
    -------
    ptr : (n_clusters + 1,) int64   pairs of cluster c are ``[ptr[c], ptr[c+1])`` in sorted order
    src : (L*p,) int64              ``i*p + t`` of each sorted pair (queries ascending within a cluster)
    slot : (L*p,) int64             sorted position of pair (i, t), stored at ``i*p + t``
    """
    L, p = route.shape
    counts = np.zeros(n_clusters + 1, dtype=np.int64)
    for i in range(L):
        for t in range(p):
            counts[route[i, t] + 1] += 1
    for c in range(n_clusters):
        counts[c + 1] += counts[c]
    ptr = counts.copy()
    fill = counts[:n_clusters].copy()
    src = np.empty(L * p, dtype=np.int64)
    slot = np.empty(L * p, dtype=np.int64)
    for i in range(L):
        for t in range(p):
            c = route[i, t]
            pos = fill[c]
            fill[c] = pos + 1
            src[pos] = i * p + t
            slot[i * p + t] = pos
    return ptr, src, slot


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def gather_rows(x, rows, out):
    """``out[t, :E] = x[rows[t]]`` (x (n, E), rows (m,) int64, out (m, >= E))."""
    m = rows.shape[0]
    E = x.shape[1]
    for t in prange(m):
        r = rows[t]
        for e in range(E):
            out[t, e] = x[r, e]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def cluster_radius(kp, kptr, cent):
    """Per cluster, the largest distance of a member key to its centroid: (C,) float64.

    kp (S, >= E) keys in cluster order (only the first E columns are read), kptr (C+1,), cent (C, E).
    """
    C, E = cent.shape
    out = np.zeros(C, dtype=np.float64)
    for c in prange(C):
        best = 0.0
        for j in range(kptr[c], kptr[c + 1]):
            d2 = 0.0
            for e in range(E):
                diff = np.float64(kp[j, e]) - np.float64(cent[c, e])
                d2 += diff * diff
            if d2 > best:
                best = d2
        out[c] = np.sqrt(best)
    return out


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def gather_pairs(q, q_norm, q0, src, p, route, route_scores, radius, scale, out, m_out):
    """The scaled query row and the score bound of every sorted (query, cluster) pair.

    For sorted pair t with ``src[t] = i*p + r`` (query ``q0 + i``, probe r, cluster ``c = route[i, r]``):
    ``out[t] = scale * q[q0 + i]`` and ``m_out[t] = m = scale * (q . cent_c) + |scale| * |q| * radius[c]``,
    an upper bound of every scaled score of the query in cluster c (Cauchy-Schwarz), so the weights
    ``exp(s - m)`` never overflow.  ``route_scores[i, r]`` is ``q . cent_c``; ``q_norm`` (L,) float64 the
    query norms (computed once per query, not once per pair).
    """
    m = src.shape[0]
    E = q.shape[1]
    abs_scale = abs(scale)
    sc = q.dtype.type(scale)
    for t in prange(m):
        il = src[t] // p
        r = src[t] - il * p
        i = q0 + il
        qi = q[i]
        ot = out[t]
        for e in range(E):
            ot[e] = qi[e] * sc
        c = route[il, r]
        m_out[t] = scale * np.float64(route_scores[il, r]) + abs_scale * q_norm[i] * radius[c]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def split_members(kp, kptr, parts, pptr, n_iter, labels, cent):
    """Split every cluster into parts by a Lloyd (Euclidean) k-means of its members, all clusters at once.

    kp (S, E) keys in cluster order, kptr (C + 1,) int64; parts (C,) int64 >= 1 wanted parts of cluster c
    (at most its size, or 1 when empty), pptr (C + 1,) int64 their offsets (``cumsum`` of parts).
    Writes labels (S,) int64: the part of each ordered row, as a global part id in
    ``[pptr[c], pptr[c + 1])``, and cent (P, E) float64 the part means (the initial centroid for a part
    that ends without members).  Initial centroids: members evenly spaced in the cluster's order; then
    ``n_iter`` rounds of nearest-centroid assignment (largest ``x . c - |c|^2 / 2``, the lower part on
    ties) and member means; the labels are the final centroids' assignment.  Deterministic: clusters are
    independent, each computed in a fixed order, whatever the thread count."""
    C = parts.shape[0]
    E = kp.shape[1]
    for c in prange(C):
        a = kptr[c]
        m = kptr[c + 1] - a
        f = parts[c]
        p0 = pptr[c]
        if m == 0:
            for e in range(E):
                cent[p0, e] = 0.0
            continue
        if f == 1:
            for j in range(m):
                labels[a + j] = p0
            for e in range(E):
                acc = 0.0
                for j in range(m):
                    acc += kp[a + j, e]
                cent[p0, e] = acc / m
            continue
        for u in range(f):
            src = a + (2 * u + 1) * m // (2 * f)
            for e in range(E):
                cent[p0 + u, e] = kp[src, e]
        half = np.empty(f)
        sums = np.empty((f, E))
        cnt = np.empty(f, dtype=np.int64)
        for it in range(n_iter + 1):
            for u in range(f):
                h = 0.0
                for e in range(E):
                    h += cent[p0 + u, e] * cent[p0 + u, e]
                half[u] = 0.5 * h
            for j in range(m):
                best = -np.inf
                arg = 0
                for u in range(f):
                    d = -half[u]
                    for e in range(E):
                        d += kp[a + j, e] * cent[p0 + u, e]
                    if d > best:
                        best = d
                        arg = u
                labels[a + j] = p0 + arg
            if it == n_iter:
                break
            sums[:] = 0.0
            cnt[:] = 0
            for j in range(m):
                u = labels[a + j] - p0
                cnt[u] += 1
                for e in range(E):
                    sums[u, e] += kp[a + j, e]
            for u in range(f):
                if cnt[u] > 0:
                    for e in range(E):
                        cent[p0 + u, e] = sums[u, e] / cnt[u]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def cluster_means(kp, kptr, fallback):
    """(C, E) mean of each cluster's rows of kp (S, E) (float64 sums), ``fallback[c]`` for an empty one."""
    C, E = fallback.shape
    out = np.empty((C, E), dtype=kp.dtype)
    for c in prange(C):
        n = kptr[c + 1] - kptr[c]
        if n == 0:
            for e in range(E):
                out[c, e] = fallback[c, e]
            continue
        acc = np.zeros(E, dtype=np.float64)
        for j in range(kptr[c], kptr[c + 1]):
            row = kp[j]
            for e in range(E):
                acc[e] += row[e]
        for e in range(E):
            out[c, e] = acc[e] / n
    return out


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _exp_row_f32(row, n, mr, clamp, masked, lim, kpos):
    """One pass over a float32 row: clamp, vectorised exp (see ``intrinsics.exp_shifted_f32``), mask, sum."""
    shift = np.float32(mr)
    cl = np.float32(clamp * _LOG2E_F64)
    tot = np.float32(0.0)
    for j in range(n):
        x = (row[j] - shift) * LOG2E
        x = x if x > cl else cl
        # s <= m by construction (m bounds the scores); the cap only keeps the exponent bits valid if
        # rounding ever broke that by > 88: a huge finite weight instead of a wrapped, negative one
        x = x if x < np.float32(127.0) else np.float32(127.0)
        e = pow2_f32(x)  # cl >= -125: a normal float
        if masked and kpos[j] > lim:
            e = np.float32(0.0)
        row[j] = e
        tot += e
    return tot


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _exp_row_f64(row, n, mr, clamp, masked, lim, kpos):
    tot = 0.0
    for j in range(n):
        x = row[j] - mr
        e = np.exp(x if x > clamp else clamp)
        if masked and kpos[j] > lim:
            e = 0.0
        row[j] = e
        tot += e
    return tot


_exp_row = _exp_row_f32  # the row pass; each compiled variant below binds its own (``constants=``)


def _shifted_exp_rows(s, m, clamp, masked, qpos, kpos, rowsum):
    """In place ``s[r, j] = exp(max(s[r, j] - m[r], clamp))``, and 0 where ``masked`` and
    ``kpos[j] > qpos[r]``; ``rowsum[r] = sum_j s[r, j]`` after the update.

    s (R, n) float32 (``shifted_exp_rows_f32``) or float64 (``_f64``) scores of one cluster tile,
    m (R,) float shifts (upper bounds of the row's scores), clamp a float in [-80, 0] for float32
    (its weight exp(clamp) must stay a normal float), qpos (R,) / kpos (n,) int64 (read only when
    ``masked``), rowsum (R,) in s's dtype (may be a strided column view).
    Why one kernel: a clamp pass, a mask pass, numpy's exp and a row sum (an extra GEMM column of ones)
    each streamed the tile through memory again; here each row is read and written once, with a
    float32 exp that vectorises (numpy's exp inside Numba is a scalar libm call).  Measured on a
    1024 x 256 tile: 81 us against 208 us for numpy maximum + exp + sum.  The clamp keeps every allowed
    weight >= exp(clamp) > 0, a normal float (subnormals make the next GEMM slow; see ``CLAMP`` in
    :mod:`sparseattn.attention.routed`), so a zero row sum still means "no allowed key".  Relative error of a float32 weight:
    the rounding of ``s - m`` and ``(s - m) log2(e)``, about ``(|s| + |m| + 2 |s - m|) * 6e-8``: the
    order of the rounding already in a float32 score s.
    Serial and ``nogil``: called from the worker threads.
    """
    R, n = s.shape
    for r in range(R):
        lim = qpos[r] if masked else 0
        rowsum[r] = _exp_row(s[r], n, m[r], clamp, masked, lim, kpos)


shifted_exp_rows_f32 = serial_and_parallel(_shifted_exp_rows, constants={"_exp_row": _exp_row_f32},
                                           suffix="_f32", fastmath=FASTMATH, nogil=True)[0]
shifted_exp_rows_f64 = serial_and_parallel(_shifted_exp_rows, constants={"_exp_row": _exp_row_f64},
                                           suffix="_f64", fastmath=FASTMATH, nogil=True)[0]


def _attend_clusters(jobs, qptr, kptr, Qs, Kp, Vp, pm, po, clamp, tiny, tile_elems, min_rows, max_rows,
                     is_causal, kpos_sorted, qpos_s, kpos_p, kmin, kmax, buf, obuf):
    """Partial attention of every (query, cluster) pair of the listed clusters, one worker's share.

    jobs (n,) int64 cluster ids; qptr (C+1,) sorted pairs per cluster; kptr (C+1,) keys per cluster;
    Qs (n_pairs, E) scaled queries; Kp (S, E) centred keys and Vp (S, Ev) values in cluster order;
    pm (n_pairs,) score bounds m.  Per tile of up to ``max(min_rows, min(max_rows, tile_elems // nk))``
    pairs: ``s = Qs_tile @ K_c^T`` (BLAS, through Numba's ``np.dot``), one pass of ``_exp_row`` per row
    (``exp(max(s - m, clamp))``, causal zeros, row sum), ``Qs_tile``'s partial ``s @ V_c`` (BLAS).
    Writes po (n_pairs, Ev + 1): partial outputs and the row sum in the last column; causal tiles
    whose keys all lie after their queries, and pairs whose row sum is 0 (no allowed key; every allowed
    weight is >= exp(clamp) > 0), are marked empty (``pm = -inf``, sum 0).  Returns the number of pairs
    whose row sum is below ``tiny`` (or NaN): only then must the caller look for pairs to refine, which
    saves a pass over every pair's partial (12 ms at 590k pairs).
    buf (>= max tile * nk) and obuf (>= max tile rows * Ev) are the worker's scratch.
    Causal with ``kpos_sorted`` (key positions non-decreasing inside each cluster, as with the default
    positions): a tile only multiplies the prefix of the cluster's keys up to its latest query, and causal
    tiles are cut 8 per cluster (at least ``min_rows``) so the prefixes follow the triangle: about half
    the products of the full cluster blocks.
    Why in Numba: the same loop in Python cost 12-18 % of attend at S = 65,536 and ~30 % at S = 4,096
    (per-tile interpreter and GIL hand-offs between the two workers).  Serial and ``nogil``: each worker
    thread runs one call.
    """
    Ev = Vp.shape[1]
    n_low = 0
    for c in jobs:
        ka = kptr[c]
        kb = kptr[c + 1]
        nk = kb - ka
        if nk == 0:
            continue
        kpos_c = kpos_p[ka:kb]
        tile = max(min_rows, min(max_rows, tile_elems // nk))
        if is_causal and kpos_sorted:
            tile = max(min_rows, min(tile, (qptr[c + 1] - qptr[c] + 7) // 8))
        for a in range(qptr[c], qptr[c + 1], tile):
            b = min(qptr[c + 1], a + tile)
            masked = False
            n_use = nk
            if is_causal:
                qmin = qpos_s[a]
                qmax = qpos_s[a]
                for r in range(a + 1, b):
                    qmin = min(qmin, qpos_s[r])
                    qmax = max(qmax, qpos_s[r])
                if kmin[c] > qmax:  # every key of the cluster lies after every query of the tile
                    for r in range(a, b):
                        pm[r] = -np.inf
                        po[r, Ev] = 0.0
                    continue
                masked = kmax[c] > qmin
                if kpos_sorted:  # keys after the tile's latest query: a suffix, skipped
                    n_use = np.searchsorted(kpos_c, qmax, side="right")
            sc = buf[:(b - a) * n_use].reshape((b - a, n_use))
            np.dot(Qs[a:b], Kp[ka:ka + n_use].T, sc)  # a row slice keeps the 'C'/'F' layout BLAS needs
            for r in range(b - a):
                lim = qpos_s[a + r] if masked else 0
                sm = _exp_row(sc[r], n_use, pm[a + r], clamp, masked, lim, kpos_c)
                po[a + r, Ev] = sm
                if sm == 0:
                    pm[a + r] = -np.inf
                elif not (sm >= tiny):
                    n_low += 1
            o = obuf[:(b - a) * Ev].reshape((b - a, Ev))
            np.dot(sc, Vp[ka:ka + n_use], o)
            po[a:b, :Ev] = o
    return n_low


attend_clusters_f32 = serial_and_parallel(_attend_clusters, constants={"_exp_row": _exp_row_f32},
                                          suffix="_f32", fastmath=FASTMATH, nogil=True)[0]
attend_clusters_f64 = serial_and_parallel(_attend_clusters, constants={"_exp_row": _exp_row_f64},
                                          suffix="_f64", fastmath=FASTMATH, nogil=True)[0]


_PV_KEYS = 256  # keys per value product of the prefix tiles


def _attend_prefix_tiles(Qs, n_vis, Ks, Vs, clamp, T, sbuf, obuf, tots, out, lse):
    """Exact attention of row r over the first ``n_vis[r]`` keys of ``Ks`` (the causal prefix rows), ``T``
    rows at a time through BLAS.

    Qs (R, E) scaled queries; n_vis (R,) int64, each in [0, B]; Ks (B, E) / Vs (B, Ev) the keys and values in
    position order (a causal query sees a prefix of them, read as one contiguous block: no gathers); writes
    out (R, Ev) and lse (R,) (zeros / -inf for ``n_vis = 0``).  A row's result depends on its inputs and on
    which rows share its tile (the products' blocking follows the tile's shape), never on how many threads
    run the tiles: callers cut the rows at multiples of T (:func:`sparseattn.attention.routed.prefix_attention`).
    Why not the fused sparse kernel over an explicit pattern: building that pattern (canonicalise + union)
    and the call around it cost 4.7 ms of a 20 ms causal attend at S = 4,096; why BLAS and not plain loops
    over four rows at a time (the former kernel): 2,048 rows over 2,048 keys, one thread, 16.4 -> 6.8 ms
    (the loops' dot products were bound by horizontal sums and stores; these are two GEMMs per tile).

    Per tile of T rows with largest prefix ``nmax``: ``S = Q_tile Ks[:nmax]^T`` (one GEMM), per row its
    exact maximum over its own prefix and one ``_exp_row`` pass (keys after the row get weight 0), then
    ``S Vs[:nmax]`` (one GEMM) divided by the row sums.  Scratch: sbuf (>= T * B), obuf (>= T * Ev),
    tots (>= T), in Qs's dtype.  Serial and ``nogil``: each worker thread runs one call on its own rows.
    """
    R = Qs.shape[0]
    Ev = Vs.shape[1]
    for r0 in range(0, R, T):
        r1 = min(R, r0 + T)
        nmax = 0
        for r in range(r0, r1):
            nmax = max(nmax, n_vis[r])
        if nmax == 0:
            for r in range(r0, r1):
                lse[r] = -np.inf
                for e in range(Ev):
                    out[r, e] = 0.0
            continue
        rows = r1 - r0
        sc = sbuf[:rows * nmax].reshape((rows, nmax))
        np.dot(Qs[r0:r1], Ks[:nmax].T, sc)
        for u in range(rows):
            r = r0 + u
            n = n_vis[r]
            row = sc[u]
            m = -np.inf
            for j in range(n):
                if row[j] > m:
                    m = row[j]
            tots[u] = 0.0
            if n == 0 or m == -np.inf:
                lse[r] = -np.inf
                for j in range(nmax):
                    row[j] = 0.0
                continue
            tots[u] = _exp_row(row, n, m, clamp, False, 0, n_vis)
            for j in range(n, nmax):
                row[j] = 0.0  # keys after the row: weight 0 in the product below
            lse[r] = m + np.log(tots[u])
        o = obuf[:rows * Ev].reshape((rows, Ev))
        for u in range(rows):
            for e in range(Ev):
                out[r0 + u, e] = 0.0
        for k0 in range(0, nmax, _PV_KEYS):  # the value product in key blocks, summed in this order
            k1 = min(nmax, k0 + _PV_KEYS)
            np.dot(np.ascontiguousarray(sc[:, k0:k1]), Vs[k0:k1], o)
            for u in range(rows):
                for e in range(Ev):
                    out[r0 + u, e] += o[u, e]
        for u in range(rows):
            r = r0 + u
            inv = 1.0 / tots[u] if tots[u] > 0 else 0.0
            for e in range(Ev):
                out[r, e] *= inv


attend_prefix_tiles_f32 = serial_and_parallel(_attend_prefix_tiles, constants={"_exp_row": _exp_row_f32},
                                              suffix="_f32", fastmath=FASTMATH, nogil=True)[0]
attend_prefix_tiles_f64 = serial_and_parallel(_attend_prefix_tiles, constants={"_exp_row": _exp_row_f64},
                                              suffix="_f64", fastmath=FASTMATH, nogil=True)[0]


@njit(cache=True)
def scan_pairs(pm, po, tiny):
    """Classify the computed pairs after a pass: returns the ids (int64, ascending) of pairs to refine.

    pm (n,) shifts, po (n, Ev + 1) partials with the row sum in the last column.  A live pair
    (``pm > -inf``) with sum 0 has no allowed key: marked empty in place (``pm = -inf``).  A live pair
    with ``0 < sum < tiny`` may have lost relevant weights to the clamp: returned.  One serial pass
    instead of five numpy passes with temporaries (~1 ms against 12 ms at 590k pairs).
    """
    n = pm.shape[0]
    ev = po.shape[1] - 1
    cnt = 0
    for t in range(n):
        if pm[t] > -np.inf:
            sm = po[t, ev]
            if sm == 0:
                pm[t] = -np.inf
            elif sm > 0 and not (sm >= tiny):
                cnt += 1
    bad = np.empty(cnt, dtype=np.int64)
    w = 0
    for t in range(n):
        if pm[t] > -np.inf:
            sm = po[t, ev]
            if sm > 0 and not (sm >= tiny):
                bad[w] = t
                w += 1
    return bad


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def causal_mask_block(S, qpos, kpos):
    """In place: ``S[r, c] = -inf`` where ``kpos[c] > qpos[r]``. Serial (called from worker threads)."""
    R, Cn = S.shape
    for r in range(R):
        lim = qpos[r]
        for c in range(Cn):
            if kpos[c] > lim:
                S[r, c] = -np.inf


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def exact_pairs(bad, Qs, kp, vp, kptr, pair_cluster, is_causal, qpos_s, kpos_p, po, pm):
    """Recompute the listed pairs with their true row maximum (last-resort fallback of the bound shift).

    bad (n,) int64 sorted-pair ids; Qs (n_pairs, E) scaled queries; kp (S, E), vp (S, Ev) keys / values
    in cluster order;
    pair_cluster (n_pairs,) cluster of each pair.  Writes po[t] (unnormalised output, row sum in
    the last column) and pm[t] (row max; ``-inf`` with a zero sum when no key is allowed).
    """
    E = Qs.shape[1]
    Ev = vp.shape[1]
    for b in prange(bad.shape[0]):
        t = bad[b]
        c = pair_cluster[t]
        ka = kptr[c]
        kb = kptr[c + 1]
        sc = np.empty(max(kb - ka, 1), dtype=np.float64)
        m = -np.inf
        for j in range(ka, kb):
            s = 0.0
            for e in range(E):
                s += np.float64(Qs[t, e]) * np.float64(kp[j, e])
            if is_causal and kpos_p[j] > qpos_s[t]:
                s = -np.inf
            sc[j - ka] = s
            if s > m:
                m = s
        for e in range(Ev + 1):
            po[t, e] = 0.0
        if m == -np.inf:
            pm[t] = -np.inf
            continue
        tot = 0.0
        for j in range(ka, kb):
            w = np.exp(sc[j - ka] - m)
            tot += w
            for e in range(Ev):
                po[t, e] += w * vp[j, e]
        po[t, Ev] = tot
        pm[t] = m


@njit(cache=True, inline="always")
def _routed_row(i, args, out, w, write):
    """Row i of :func:`routed_pattern` (a row emitter of :func:`~.pattern_ops.two_pass_csr`)."""
    route, kptr, perm, is_causal, qpos, kpos = args
    w0 = w
    for t in range(route.shape[1]):
        cl = route[i, t]
        if not (write or is_causal):  # counting every key of the cluster
            w += kptr[cl + 1] - kptr[cl]
            continue
        for q in range(kptr[cl], kptr[cl + 1]):
            j = perm[q]
            if not is_causal or kpos[j] <= qpos[i]:
                w = emit(out, w, write, j)
    if write:
        out[w0:w].sort()
    return w


_routed_rows = two_pass_csr(_routed_row, "routed_pattern")[1]


def routed_pattern(route, kptr, perm, is_causal, qpos, kpos):
    """CSR of every key in each query's routed clusters (causal: only ``kpos[j] <= qpos[i]``).

    route (L, p) int32 cluster ids (distinct per row); kptr (C+1,) int64 cluster -> range of ``perm``;
    perm (S,) int64 original key id at each cluster-ordered position; qpos (L,), kpos (S,) int64
    (original key order).  Returns indptr (L+1,) int64 and indices int32, sorted per row.
    """
    return _routed_rows(route.shape[0], (route, kptr, perm, is_causal, qpos, kpos))
