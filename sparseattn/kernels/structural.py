"""Numba kernels for the structural selectors (window by position, seeded random keys).

Plain functions over arrays (no closures), so ``cache=True`` works.  Each returns a fresh canonical CSR
pair: ``indptr`` int64 (L + 1,) and ``indices`` int32 with every row sorted ascending and unique.

Key positions may be arbitrary integers: the kernels receive them sorted (``sorted_pos``) together with
the permutation ``order`` (``sorted_pos = key_positions[order]``, a stable argsort), so a window or a
causal prefix is a contiguous range of ``order``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import options  # noqa: F401  (sets up the cache directory before compiling)
from .pattern_ops import csr_alloc, emit, two_pass_csr

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


# ------------------------------------------------------------------------------------------ window
@njit(cache=True, inline="always")
def _window_row(i, args, out, w, write):
    """Row i of :func:`window_by_position` (a row emitter of :func:`~.pattern_ops.two_pass_csr`)."""
    query_positions, sorted_pos, order, lo_off, hi_off, dilation = args
    qp = query_positions[i]
    a = np.searchsorted(sorted_pos, qp - lo_off, side="left")
    b = np.searchsorted(sorted_pos, qp + hi_off, side="right")
    w0 = w
    for p in range(a, b):
        if (sorted_pos[p] - qp) % dilation == 0:
            w = emit(out, w, write, order[p])
    if write and w > w0 + 1:
        out[w0:w].sort()
    return w


_window_rows = two_pass_csr(_window_row, "window_by_position")[1]


def window_by_position(query_positions, sorted_pos, order, lo_off, hi_off, dilation):
    """Row i selects every key j with ``qp - lo_off <= pos[j] <= qp + hi_off`` and
    ``(pos[j] - qp) % dilation == 0``, where ``qp = query_positions[i]``.

    ``sorted_pos`` (S,) int64 ascending, ``order`` (S,) int64 key ids in that order.  Cost per row:
    two binary searches plus the keys inside the position range.
    """
    args = (query_positions, sorted_pos, order, lo_off, hi_off, dilation)
    return _window_rows(query_positions.shape[0], args)


# ------------------------------------------------------------------------------------------ random
@njit(cache=True, inline="always")
def _splitmix64(state):
    """One SplitMix64 step: returns (new_state, 64 random bits)."""
    state = state + _GOLDEN
    z = state
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return state, z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def _uniform_below(state, m):
    """Exactly uniform integer in [0, m) (m >= 1) by rejection of the biased low range."""
    mm = np.uint64(m)
    threshold = (np.uint64(0) - mm) % mm  # 2**64 mod m: values below it would bias the modulo
    while True:
        state, r = _splitmix64(state)
        if r >= threshold:
            return state, np.int64(r % mm)


@njit(cache=True)
def row_seed(seed, position):
    """Per-query RNG state from (seed, query position): independent of rows, threads and batch shape."""
    _, h = _splitmix64(np.uint64(seed))
    _, h = _splitmix64(h ^ np.uint64(position))
    return h


@njit(cache=True, parallel=True)
def random_rows(allowed, order, n_sample, seed, query_positions):
    """Row i: ``min(n_sample, allowed[i])`` distinct keys drawn uniformly from ``order[:allowed[i]]``.

    Floyd's algorithm (each n-subset equally likely) with a small open-addressing hash set, so a row
    costs O(n_sample) whatever the number of allowed keys.  The generator is SplitMix64 seeded from
    ``(seed, query_positions[i])``, so results do not depend on thread scheduling.
    """
    n_rows = allowed.shape[0]
    indptr, indices = csr_alloc(np.minimum(allowed, n_sample))
    size = 4
    bits = 2
    while size < 2 * n_sample:
        size *= 2
        bits += 1
    mask = size - 1
    shift = np.uint64(64 - bits)  # multiplicative (Fibonacci) hashing into `bits` bits
    for i in prange(n_rows):
        c = allowed[i]
        w0 = indptr[i]
        n = indptr[i + 1] - w0
        if n == 0:
            continue
        if n == c:  # every allowed key
            for p in range(c):
                indices[w0 + p] = order[p]
        else:
            table = np.full(size, -1, dtype=np.int64)
            state = row_seed(seed, query_positions[i])
            for j in range(c - n, c):
                state, t = _uniform_below(state, j + 1)
                # insert t, or j when t is already present (Floyd)
                h = np.int64((np.uint64(t) * _GOLDEN) >> shift) & mask
                found = False
                while table[h] != -1:
                    if table[h] == t:
                        found = True
                        break
                    h = (h + 1) & mask
                if found:
                    h = np.int64((np.uint64(j) * _GOLDEN) >> shift) & mask
                    while table[h] != -1:
                        h = (h + 1) & mask
                    table[h] = j
                else:
                    table[h] = t
            w = w0
            for h in range(size):
                if table[h] != -1:
                    indices[w] = order[table[h]]
                    w += 1
        indices[w0:w0 + n] = np.sort(indices[w0:w0 + n])
    return indptr, indices
