"""Seeded uniform samples of the keys a pattern did not select (the tail estimate's draw).

Per query row i, the *visible* keys are the first ``visible[i]`` entries of ``order`` (a permutation of the
key ids sorted by position, so a causal row sees a prefix; non-causal rows see all S keys).  The row's
selected keys (CSR ``indptr``/``indices``) are removed from them, leaving the tail ``U_i`` of size
``u_i``.  :func:`sample_tail` draws ``m_i = min(m, u_i)`` distinct keys of ``U_i`` uniformly without
replacement and returns them as a canonical CSR plus ``log(u_i / m_i)``, the log inverse inclusion
probability every drawn key carries.

The random stream of a row depends only on ``(seed, stream, i)`` (a SplitMix64 counter), so the draw is the
same whatever the thread count or the order rows are processed in.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .pattern_ops import csr_alloc

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: the SplitMix64 stream increment


@njit(cache=True, nogil=True, inline="always")
def mix64(z):
    """SplitMix64's finaliser: a well-mixed uint64 of a uint64 (seeds and stream states are mixed by it)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def uniform_below(state, n):
    """(next state, a uniform integer in [0, n)) for n >= 1 (53-bit float scaling, bias < 2^-40)."""
    state = state + GOLDEN
    x = mix64(state)
    r = np.int64(np.float64(x >> np.uint64(11)) * (1.0 / 9007199254740992.0) * n)
    return state, min(r, n - 1)


@njit(cache=True, nogil=True, inline="always")
def floyd_sample(state, n, m, out):
    """Floyd's algorithm: ``m`` distinct integers of ``[0, n)`` (``m <= n``), every subset equally likely,
    in ``out[:m]`` (unsorted); returns the next stream state."""
    k = 0
    for j in range(n - m, n):
        state, t = uniform_below(state, j + 1)
        dup = False
        for c in range(k):
            if out[c] == t:
                dup = True
                break
        out[k] = j if dup else t
        k += 1
    return state


@njit(cache=True, nogil=True)
def _tail_rank(t, sel):
    """The t-th (0-based) rank in [0, ...) that is not in the sorted array ``sel``."""
    r = t
    for p in range(sel.shape[0]):
        if sel[p] <= r:
            r += 1
        else:
            break
    return r


@njit(cache=True, nogil=True)
def _row_selected_ranks(indptr, indices, i, rank, vis):
    """Sorted ranks (< vis) of row i's selected keys."""
    a, b = indptr[i], indptr[i + 1]
    sel = np.empty(b - a, dtype=np.int64)
    n = 0
    for p in range(a, b):
        r = rank[indices[p]]
        if r < vis:
            sel[n] = r
            n += 1
    out = np.sort(sel[:n])
    return out


@njit(parallel=True, cache=True)
def sample_tail(indptr, indices, visible, order, rank, m, seed, stream):
    """Uniform sample without replacement of each row's unselected visible keys.

    indptr (L+1,) int64, indices (nnz,) int32: the selected keys (canonical CSR, ids in [0, S)).
    visible (L,) int64: row i sees the keys ``order[:visible[i]]``; order (S,) int64 key ids by position;
    rank (S,) int64 its inverse (``rank[order[r]] == r``).  m: samples per row (>= 0).  seed, stream: the
    random stream (int64).

    Returns ``tail_indptr`` (L+1,) int64, ``tail_indices`` (int32, sorted per row) and ``log_w`` (L,)
    float64 = ``log(u_i / m_i)`` (0 when the row draws nothing).  When ``m >= u_i`` the whole tail is
    taken with weight 1 (log_w 0): the estimate is then exact.
    """
    L = visible.shape[0]
    counts = np.zeros(L, dtype=np.int64)
    log_w = np.zeros(L, dtype=np.float64)
    for i in prange(L):
        vis = visible[i]
        sel = _row_selected_ranks(indptr, indices, i, rank, vis)
        u = vis - sel.shape[0]
        mi = min(m, u)
        counts[i] = mi
        if mi > 0:
            log_w[i] = np.log(u / mi)
    tptr, tidx = csr_alloc(counts)
    base = mix64(np.uint64(seed) * GOLDEN + np.uint64(stream))
    for i in prange(L):
        mi = counts[i]
        if mi == 0:
            continue
        vis = visible[i]
        sel = _row_selected_ranks(indptr, indices, i, rank, vis)
        u = vis - sel.shape[0]
        state = mix64(base ^ (np.uint64(i) * GOLDEN))
        picks = np.empty(mi, dtype=np.int64)
        state = floyd_sample(state, u, mi, picks)
        a = tptr[i]
        for c in range(mi):
            tidx[a + c] = order[_tail_rank(picks[c], sel)]
        tidx[a:a + mi].sort()
    return tptr, tidx, log_w
