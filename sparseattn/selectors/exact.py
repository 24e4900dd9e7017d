"""The exact top-k selector: brute-force maximum inner product, blocked over queries (never L x S at once).

It is the oracle the approximate selectors are judged by, exposed as a selector so that "exact top-k
attention" can be benchmarked and combined (``"topk+sinks"``) like any other pattern.
"""

from __future__ import annotations

import numpy as np

from ..kernels.topk import ORDER_ID, block_topk
from ..pattern import SparsePattern
from .base import Selector
from .params import Param, positive
from .registry import register

__all__ = ["TopKSelector", "topk_pattern"]


def topk_pattern(q: np.ndarray, keys: np.ndarray, k: int, *, is_causal: bool = False,
                 query_positions: np.ndarray | None = None, key_positions: np.ndarray | None = None,
                 block: int = 512) -> SparsePattern:
    """Exact top-k pattern, tie-aware, from validated arrays.

    Parameters
    ----------
    q : (L, E) float32/float64 C-contiguous, same dtype as ``keys``
    keys : (S, E)
    k : int >= 1
    is_causal : bool
        Only keys with ``key_positions[j] <= query_positions[i]`` (int64 arrays, required when causal).
    block : int
        Query rows scored at once (memory ``block * S`` scores).

    Returns
    -------
    SparsePattern (L, S): row i holds the ``min(k, allowed_i)`` keys of largest ``q_i . k_j``; among keys
    tied with the k-th score the lower ids win.
    """
    L, S = q.shape[0], keys.shape[0]
    kk = min(k, S)
    if S == 0 or L == 0:
        return SparsePattern(np.zeros(L + 1, np.int64), np.zeros(0, np.int32), S, validate=False)
    if is_causal and (query_positions is None or key_positions is None):
        raise ValueError("topk_pattern: is_causal=True needs query_positions and key_positions "
                         "(e.g. np.arange(L), np.arange(S)).")
    qpos = np.ascontiguousarray(np.zeros(L) if query_positions is None else query_positions, dtype=np.int64)
    kpos = np.ascontiguousarray(np.zeros(S) if key_positions is None else key_positions, dtype=np.int64)
    ids = np.empty((L, kk), dtype=np.int32)
    scores = np.empty((L, kk), dtype=q.dtype)
    counts = np.empty(L, dtype=np.int64)
    key_ids = np.arange(S, dtype=np.int64)
    kT = keys.T
    for start in range(0, L, block):
        stop = min(start + block, L)
        s = q[start:stop] @ kT
        counts[start:stop] = block_topk(s, kk, is_causal, qpos[start:stop], kpos, key_ids, scores[start:stop],
                                        ids[start:stop], ORDER_ID, False)
        del s  # one block of scores alive at a time
    indptr = np.zeros(L + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = ids[np.arange(kk)[None, :] < counts[:, None]]  # row-major: each row's ids stay ascending
    return SparsePattern(indptr, indices, S, validate=False)


@register
class TopKSelector(Selector):
    """Exact maximum-inner-product top-k by blocked brute force.

    The same computation as :func:`sparseattn.topk.exact_topk` (one ``block x S`` GEMM at a time, causal
    masking by positions) but selecting with the shared Numba top-k core (:mod:`sparseattn.kernels.topk`),
    emitting the pattern directly, and breaking ties deterministically: among keys whose score equals the
    k-th largest, the lower ids are kept; NaN scores are never selected.  Cost O(L*S*E) flops, memory O(block * S).  Scores are computed in
    the keys' dtype (float32 unless the keys are float64), so "largest" is up to that rounding.
    """

    name = "topk"
    guarantee = ("exact: exactly the k largest q.k among the allowed keys (ties at the k-th score broken "
                 "by lower id); causal rows search exactly their allowed keys")
    params_spec = {
        "block": Param(int, 512, "query rows scored per GEMM (memory: block * S scores)", positive,
                       when="query"),
    }

    def _build(self, keys: np.ndarray) -> None:
        pass

    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        return topk_pattern(q, self.keys_, k, is_causal=is_causal, query_positions=qpos,
                            key_positions=kpos, block=self._params["block"])
