"""The log-sum-exp merge of partial attention results: one kernel for every caller.

A partial result over a key set is ``(o, s, m)``: the unnormalised output ``o = Σ_j exp(x_j - m) v_j``,
its row sum ``s = Σ_j exp(x_j - m)`` and the shift ``m``.  A normalised output with log-sum-exp ``l`` is
the partial ``(o, 1, l)``, so the same kernel merges

* the per-cluster partials of routed attention (:mod:`sparseattn.attention.routed`, shifts are score
  bounds, sums arbitrary), and
* normalised parts of :func:`sparseattn.attention.merge.merge_attention` / ``merge_pair`` (sums 1, shifts
  the parts' lse) -- and, later, the parts of a distributed attention.

Which partials belong to which output row is a slot map: row i merges partials ``slot[i*p : i*p + p]``.
The partials may live in several arrays of equal length (a tuple), so that parts held in separate
arrays (``merge_pair``'s two inputs) are read in place instead of being stacked into one copy first.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .options import FASTMATH, serial_and_parallel

__all__ = ["PARALLEL_MIN_WORK", "merge_partials", "merge_partials_serial"]

#: Elements read (partials x Ev) below which the serial variant is faster: the parallel launch costs more
#: than it saves there (merge_pair at L = 4,096, Ev = 64, float64: 3.7-4.1 ms parallel against 1.4-1.6 ms
#: serial, medians on a loaded 2-core machine).
PARALLEL_MIN_WORK = 1 << 20

_ROWS = 64  # rows per block of the parallel loop: one scratch accumulator per block


def _merge_partials(partials, sums, shifts, slot, p, lse_shift, out, lse):
    """Merge each output row's p partials exactly, with log-sum-exp weights.

    Parameters
    ----------
    partials : tuple of B arrays, each (n / B, Ev), float32 or float64 (any strides)
        Unnormalised partial outputs, in ``out``'s dtype; partial s is row ``s % (n / B)`` of array
        ``s // (n / B)`` (one array: partial s is its row s).
    sums : (n,) float, the partials' row sums; shifts : (n,) float, their shifts m.
        A partial with ``sums <= 0`` (or NaN), ``shifts = -inf``, or a weight ``exp(m - M)`` that
        underflows to 0 in ``out``'s dtype (M: the row's largest live shift) is not read: it may hold
        anything, NaN included.
    slot : (L * p,) int64
        Row i merges the partials ``slot[i*p + t]``, t < p.
    p : int
        Partials per row.
    lse_shift : (L,) float
        Added to each row's lse (e.g. the score offset ``q . mean`` removed by centring the keys).
    out : (L, Ev) float32 or float64, written
        ``Σ_t w_t o_t / Σ_t w_t s_t`` with ``w_t = exp(m_t - M)``; zeros for a row without a live partial.
    lse : (L,) float, written
        ``M + log(Σ_t w_t s_t) + lse_shift``; ``-inf`` for a row without a live partial.

    The weights and the total are float64; each partial enters the sum scaled by ``w_t / Σ w s`` (so the
    terms stay within the partials' normalised outputs: no overflow to inf from finite parts); the
    accumulation is in ``out``'s dtype (it vectorises).
    Rows are independent and each is summed in a fixed order: the serial and parallel variants
    (``merge_partials_serial`` / ``merge_partials``, compiled from this one function) give identical
    results whatever the thread count.
    """
    L = out.shape[0]
    Ev = out.shape[1]
    n_per = partials[0].shape[0]
    zero = out.dtype.type(0.0)
    n_blocks = (L + _ROWS - 1) // _ROWS
    for blk in prange(n_blocks):
        # one accumulator per block of rows (one per row cost ~0.4 ms of allocations at L = 4,096)
        acc = np.empty(Ev, dtype=out.dtype)  # local: the update loop vectorises
        wt = np.empty(p, dtype=np.float64)  # the row's partial weights
        for i in range(blk * _ROWS, min(L, blk * _ROWS + _ROWS)):
            M = -np.inf
            for t in range(p):
                s = slot[i * p + t]
                if sums[s] > 0 and shifts[s] > M:
                    M = shifts[s]
            o = out[i]
            if M == -np.inf:
                for e in range(Ev):
                    o[e] = 0.0
                lse[i] = -np.inf
                continue
            tot = 0.0
            for t in range(p):  # the weights once (wt: 0 for a partial not read), then their total
                s = slot[i * p + t]
                wt[t] = 0.0
                if sums[s] > 0 and shifts[s] > -np.inf:
                    w64 = np.exp(np.float64(shifts[s]) - M)
                    if out.dtype.type(w64) != zero:
                        wt[t] = w64
                        tot += w64 * np.float64(sums[s])
            # each partial weighted by w / tot before the sum: the terms are bounded by the partials'
            # normalised outputs, so finite parts never sum to inf (w o / tot would not be: o can be near max)
            for e in range(Ev):
                acc[e] = 0.0
            inv = 1.0 / tot
            for t in range(p):
                if wt[t] == 0.0:
                    continue
                s = slot[i * p + t]
                c = out.dtype.type(wt[t] * inv)
                ps = partials[s // n_per][s % n_per]
                for e in range(Ev):
                    acc[e] += c * ps[e]
            for e in range(Ev):
                o[e] = acc[e]
            lse[i] = M + np.log(tot) + lse_shift[i]


merge_partials_serial, merge_partials = serial_and_parallel(_merge_partials, fastmath=FASTMATH)
