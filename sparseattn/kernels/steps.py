"""The unfused steps of sparse attention, one kernel each, for tests and ``sparseattn.tutorial``.

Over one (L, E) query block and one (S, E) key block with a CSR pattern (``indptr`` (L + 1,) int64,
``indices`` (nnz,) int32 key ids): ``sparse_scores`` (q.k * scale per selected pair), ``csr_softmax``
(stable softmax per row, plus lse), ``csr_matmul`` (probabilities times V).  Composed they equal the
fused kernel up to rounding.  Arrays must be C-contiguous float32 or float64.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .options import FASTMATH


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def sparse_scores(q, k, indptr, indices, scale):
    """Scores (nnz,) in the dtype of q: ``scale * q[i] . k[j]`` for each selected (i, j).

    q (L, E) and k (S, E) float arrays; indptr (L + 1,), indices (nnz,) the CSR pattern; scale a float.
    """
    L = indptr.shape[0] - 1
    E = q.shape[1]
    out = np.empty(indices.shape[0], dtype=q.dtype)
    zero = np.zeros(1, dtype=q.dtype)
    for i in prange(L):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            s = zero[0]
            for e in range(E):
                s += q[i, e] * k[j, e]
            out[p] = s * scale
    return out


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def csr_softmax(indptr, scores):
    """Row-wise stable softmax of CSR scores (nnz,); returns (probs (nnz,), lse (L,)) in their dtype.

    Rows with no pair, or only ``-inf`` scores, get probabilities 0 and ``lse = -inf``.
    """
    L = indptr.shape[0] - 1
    probs = np.zeros_like(scores)
    lse = np.empty(L, dtype=scores.dtype)
    for i in prange(L):
        a = indptr[i]
        b = indptr[i + 1]
        m = -np.inf
        for p in range(a, b):
            if scores[p] > m:
                m = scores[p]
        if b == a or m == -np.inf:
            lse[i] = -np.inf
            continue
        total = 0.0
        for p in range(a, b):
            w = np.exp(scores[p] - m)
            probs[p] = w
            total += w
        for p in range(a, b):
            probs[p] = probs[p] / total
        lse[i] = m + np.log(total)
    return probs, lse


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def csr_matmul(indptr, indices, probs, v):
    """Dense (L, Ev) in v's dtype = sparse (L, S) probabilities (CSR, ``probs`` (nnz,)) @ v (S, Ev)."""
    L = indptr.shape[0] - 1
    Ev = v.shape[1]
    out = np.zeros((L, Ev), dtype=v.dtype)
    for i in prange(L):
        for p in range(indptr[i], indptr[i + 1]):
            w = probs[p]
            j = indices[p]
            for e in range(Ev):
                out[i, e] += w * v[j, e]
    return out
