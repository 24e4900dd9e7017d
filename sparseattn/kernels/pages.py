"""Quest page bounds: an upper bound of ``q . k`` over each page of keys from its element-wise min and max."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["page_bounds"]


@njit(cache=True)
def page_bounds(q, pmin, pmax):
    """Quest bounds of queries over pages: ``out[i, b] = sum_e max(q[i, e] * min[b, e], q[i, e] * max[b, e])``.

    q : (L, E); pmin, pmax : (P, E), element-wise min and max of each page's keys (same float dtype).
    Returns (L, P) of that dtype; ``out[i, b] >= q_i . k`` for every key k of page b (up to rounding).
    """
    L = q.shape[0]
    P = pmin.shape[0]
    out = np.empty((L, P), dtype=q.dtype)
    for i in range(L):
        for b in range(P):
            s = q.dtype.type(0.0)
            for e in range(q.shape[1]):
                a1 = q[i, e] * pmin[b, e]
                a2 = q[i, e] * pmax[b, e]
                s += a1 if a1 > a2 else a2
            out[i, b] = s
    return out
