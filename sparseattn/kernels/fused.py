"""Fused sparse attention kernel: scores -> stable softmax -> weighted sum of values, one pass per row.

Rows of all (batch, head) groups are flattened to ``G * L`` and split into chunks over ``prange``; each
chunk owns one scratch buffer for its rows' scores.  Per row: scores of the selected keys (plus an
optional bias), their maximum, ``exp(s - max)`` summed and accumulated against the value rows, then one
division.  Two passes over the row's keys instead of an online rescale per key: cheaper for the short
rows sparse attention has.  A row with no key, or only ``-inf`` scores, gets zeros and ``lse = -inf``.

The parallel and the serial variant are compiled from the same Python function; each row is computed by
one thread in a fixed order, so both give bit-identical results.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._options import FASTMATH
from .bias import bias_value


def _fused_rows(q, k, v, q_map, kv_map, indptr, indices, shared, scale, max_nnz, chunk,
                bias_kind, bias_params, bias_ints, qpos, kpos, bias_dense, bias_map, n_bias_heads,
                out, lse):
    G = q_map.shape[0]
    L = q.shape[1]
    E = q.shape[2]
    Ev = v.shape[2]
    n_rows = G * L
    n_chunks = (n_rows + chunk - 1) // chunk
    for c in prange(n_chunks):
        scratch = np.empty(max(max_nnz, 1), dtype=out.dtype)
        acc = np.zeros(max(Ev, 1), dtype=out.dtype)
        zero = np.zeros(1, dtype=out.dtype)
        r_end = min((c + 1) * chunk, n_rows)
        for r in range(c * chunk, r_end):
            g = r // L
            i = r - g * L
            pr = i if shared else r
            a = indptr[pr]
            b = indptr[pr + 1]
            qg = q_map[g]
            kg = kv_map[g]
            h = g % n_bias_heads
            m = -np.inf
            for p in range(a, b):
                j = indices[p]
                s = zero[0]
                for e in range(E):
                    s += q[qg, i, e] * k[kg, j, e]
                s = s * scale
                if bias_kind != 0:
                    s += bias_value(bias_kind, g, h, i, j, qpos, kpos, bias_params, bias_ints,
                                    bias_dense, bias_map)
                scratch[p - a] = s
                if s > m:
                    m = s
            if b == a or m == -np.inf:
                for e in range(Ev):
                    out[g, i, e] = 0.0
                lse[g, i] = -np.inf
                continue
            for e in range(Ev):
                acc[e] = 0.0
            total = zero[0]
            for p in range(a, b):
                w = np.exp(scratch[p - a] - m)
                total += w
                j = indices[p]
                for e in range(Ev):
                    acc[e] += w * v[kg, j, e]
            inv = 1.0 / total
            for e in range(Ev):
                out[g, i, e] = acc[e] * inv
            lse[g, i] = m + np.log(total)


fused_parallel = njit(parallel=True, cache=True, fastmath=FASTMATH)(_fused_rows)
fused_serial = njit(parallel=False, cache=True, fastmath=FASTMATH)(_fused_rows)
