"""Bookkeeping kernels of :class:`sparseattn.KVCache` under a memory cap: find and mark the keys a step evicts.

Each runs once per append over plain arrays (the cache's slot arrays), so that evicting one key per decode
step costs a scan in compiled code instead of a dozen numpy calls per kv head.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True)
def slots_of_positions(pos, start, stop, lo, hi, out):
    """Per kv head g, the slots ``j`` in ``[start, stop)`` with ``lo <= pos[g, j] < hi``, ascending, in
    ``out[g, :count]``; returns the smallest count over the heads.

    pos (H_kv, cap) int32; out (H_kv, hi - lo) int64.  The scan of a head stops once it has found
    ``hi - lo`` slots (positions are distinct within a head).
    """
    want = hi - lo
    least = want
    for g in range(pos.shape[0]):
        got = 0
        pg = pos[g]
        for j in range(start, stop):
            p = pg[j]
            if p >= lo and p < hi:
                out[g, got] = j
                got += 1
                if got == want:
                    break
        least = min(least, got)
    return least


@njit(cache=True, nogil=True)
def mark_evicted_clusters(pos, kill, cptr, n_cent, cmaxpos, evicted):
    """Set ``pos[g, kill[g, i]] = evicted`` for every kv head g, and ``cmaxpos[g, c] = evicted`` for each
    cluster c whose slot range ``[cptr[g, c], cptr[g, c + 1])`` holds one of them (binary search)."""
    for g in range(kill.shape[0]):
        nc = n_cent[g]
        end = cptr[g, nc] if nc > 0 else 0
        for i in range(kill.shape[1]):
            j = kill[g, i]
            pos[g, j] = evicted
            if j < end:
                lo = 0
                hi = nc
                while hi - lo > 1:  # the last c with cptr[g, c] <= j
                    mid = (lo + hi) // 2
                    if cptr[g, mid] <= j:
                        lo = mid
                    else:
                        hi = mid
                cmaxpos[g, lo] = evicted


@njit(cache=True, nogil=True, parallel=True)
def least_weight_slot(pos, weight, n, first_pos, newest, evicted, out):
    """Per kv head g, the slot j < n of least ``weight[g, j]`` among positions ``first_pos <= p < newest``
    (not evicted), ties to the smallest position, in ``out[g]`` (-1 when there is none); kv heads in
    parallel."""
    for g in prange(pos.shape[0]):
        best = -1
        bw = np.inf
        bp = evicted
        pg = pos[g]
        wg = weight[g]
        for j in range(n):
            p = pg[j]
            if p >= first_pos and p < newest and p != evicted:
                w = wg[j]
                if w < bw or (w == bw and p < bp):
                    best = j
                    bw = w
                    bp = p
        out[g] = best
