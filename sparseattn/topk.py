"""Exact maximum-inner-product top-k by blocked brute force: the oracle every selector is judged by.

Scores are computed one query block at a time (``block x S``), so memory stays at one block of scores
whatever the sequence length.  Causal masking uses positions: key j is allowed for query i when
``key_positions[j] <= query_positions[i]`` (default ``arange``: SDPA's top-left alignment).
"""

from __future__ import annotations

import numpy as np

from .inputs import as_float_array, check_positive_int, positions
from .kernels.topk import ORDER_BEST, block_topk


def exact_topk(queries: np.ndarray, keys: np.ndarray, k: int, *, is_causal: bool = False,
               query_positions: object = None, key_positions: object = None, block: int = 512,
               check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The k keys with the largest inner product for each query.

    Parameters
    ----------
    queries : float array, shape (L, E)
    keys : float array, shape (S, E)
    k : int >= 1
        Keys per query; rows with fewer than k allowed keys are padded with id -1 / score -inf.
        Among keys tied with the k-th score the lower ids are kept.
    is_causal : bool
        Only keys with ``key_positions[j] <= query_positions[i]``.
    block : int
        Query rows scored at once (memory: ``block * S`` floats).

    Returns
    -------
    scores : (L, k) float array (dtype of the computation: float64 if any input is, else float32),
        sorted descending; ``-inf`` where padded.
    ids : (L, k) int64 array, ``-1`` where padded.
    """
    q = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
    kk = as_float_array(keys, "keys", min_ndim=2, check_finite=check_finite)
    if q.ndim != 2 or kk.ndim != 2:
        raise ValueError(f"queries and keys must be 2-D (n, E); got {q.shape} and {kk.shape}.")
    if q.shape[1] != kk.shape[1]:
        raise ValueError(f"queries and keys must have the same feature size E; got {q.shape[1]} and {kk.shape[1]}.")
    k = check_positive_int(k, "k")
    block = check_positive_int(block, "block")
    dtype = np.float64 if (q.dtype == np.float64 or kk.dtype == np.float64) else np.float32
    q = q.astype(dtype, copy=False)
    kk = kk.astype(dtype, copy=False)
    L, S = q.shape[0], kk.shape[0]
    qpos = positions(query_positions, L, "query_positions") if is_causal else None
    kpos = positions(key_positions, S, "key_positions") if is_causal else None
    scores_out = np.full((L, k), -np.inf, dtype=dtype)
    ids_out = np.full((L, k), -1, dtype=np.int64)
    if S == 0 or L == 0:
        return scores_out, ids_out
    qpos_a = qpos if qpos is not None else np.zeros(L, np.int64)
    kpos_a = kpos if kpos is not None else np.zeros(S, np.int64)
    key_ids = np.arange(S, dtype=np.int64)
    for start in range(0, L, block):
        stop = min(start + block, L)
        s = q[start:stop] @ kk.T
        # Shared top-k core: NaN never selected, ties at the k-th score keep the lower key id.
        block_topk(s, k, is_causal, qpos_a[start:stop], kpos_a, key_ids, scores_out[start:stop],
                   ids_out[start:stop], ORDER_BEST, False)
        del s  # release this block's scores before the next one is computed (one block at a time)
    return scores_out, ids_out
