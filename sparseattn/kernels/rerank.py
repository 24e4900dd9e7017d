"""Exact re-ranking of candidate keys: the step that turns any approximate candidate set into a top-k.

Candidates come padded with -1 (and possibly duplicated, e.g. from several LSH rounds or index blocks).
Per query row: drop sentinels and duplicates, score ``q . k_j`` exactly, keep the k best.  Working on the
candidate ids directly avoids materialising an (L, C, E) gather in numpy.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._options import FASTMATH


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def rerank_topk(q, keys, cand, k):
    """Top-k of each row's candidates by exact inner product.

    q (L, E), keys (S, E) same float dtype; cand (L, C) int64 with -1 for none; returns
    (scores (L, k) in q's dtype, sorted descending, -inf padded; ids (L, k) int64, -1 padded).
    """
    L = cand.shape[0]
    C = cand.shape[1]
    E = q.shape[1]
    out_ids = np.full((L, k), -1, dtype=np.int64)
    out_scores = np.full((L, k), -np.inf, dtype=q.dtype)
    for i in prange(L):
        row = np.sort(cand[i])
        uniq = np.empty(C, dtype=np.int64)
        n = 0
        for p in range(C):
            j = row[p]
            if j >= 0 and (n == 0 or uniq[n - 1] != j):
                uniq[n] = j
                n += 1
        if n == 0:
            continue
        sc = np.zeros(n, dtype=q.dtype)
        for p in range(n):
            j = uniq[p]
            s = sc[p]  # zero-initialised: keeps the accumulator in q's dtype
            for e in range(E):
                s += q[i, e] * keys[j, e]
            sc[p] = s
        order = np.argsort(-sc, kind="mergesort")
        m = min(k, n)
        for t in range(m):
            out_ids[i, t] = uniq[order[t]]
            out_scores[i, t] = sc[order[t]]
    return out_scores, out_ids
