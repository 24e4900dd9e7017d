"""Strictly causal routed attention over a :class:`~sparseattn.index.segments.SegmentedClusterIndex`.

Each query's visible prefix is its exact part (the exact tail, or the whole prefix for a short one with
``exact_prefix``) plus whole dyadic segments (:meth:`SegmentedClusterIndex.cover`).  The exact part is
one exact softmax over those keys (:func:`sparseattn.attention.routed.prefix_attention`); each
segment is a plain, non-causal :func:`~sparseattn.attention.routed.routed_attention` over the segment's
own index (the query sees all of the segment), with the same ``estimate`` / ``top_p`` options applied per
segment; the parts are merged by log-sum-exp (:func:`sparseattn.attention.merge.merge_pair`).  Every
visible key is in exactly one part, and no part reads or was built from a key after the query: the output
of a row depends only on the keys and values at or before its position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..index.routing import check_budget, segment_routes
from ..index.segments import SegmentedClusterIndex
from ..inputs import check_lse, check_scale, positions, result_dtype, unscale_output, value_scaling
from ..kernels import cluster as ck
from ..threads import worker_threads
from .merge import merge_pair
from .routed import prefix_attention, queries_values, routed_attention

__all__ = ["segment_routes", "segmented_attention"]


def segmented_attention(index: SegmentedClusterIndex, queries: np.ndarray, values: np.ndarray, *,
                        scale: float | None = None, query_positions: object = None, exact_prefix: bool = True,
                        n_threads: int | None = None, check_finite: bool = True, stats: dict | None = None,
                        estimate: int = 0, top_p: float | None = None, min_keys: int = 0,
                        max_keys: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of each query over its exact part and its routed clusters in each of its segments.

    Parameters
    ----------
    index : SegmentedClusterIndex
        Built over the keys (S, E) and their positions.
    queries : float array, shape (L, E)
    values : float array, shape (S, Ev)
        One value row per key, in the keys' order.
    scale : float, optional
        Score scale (default ``1/sqrt(E)``).
    query_positions : int array (L,), optional
        Default ``arange(L)`` (top-left alignment).  Key j is visible to query i iff its position is
        ``<=`` the query's.
    exact_prefix : bool, default True
        A query seeing at most ``index.prefix_budget_`` keys attends to all of them exactly.
    n_threads : int, optional
        Worker threads (default: the index parameters' ``n_threads``, else Numba's thread count).
    check_finite : bool, default True
        Reject NaN / Inf in queries and values.
    stats : dict, optional
        Receives ``keys_read`` (L,) int64 (keys each query attended to exactly) and ``refined_pairs``.
    estimate, top_p, min_keys, max_keys
        As for :func:`~sparseattn.attention.routed.routed_attention`, applied within each segment (the
        estimate covers the segment's unread clusters; ``top_p`` is reached in every segment, so also
        overall; ``min_keys`` / ``max_keys`` bound the keys read per segment).

    Returns
    -------
    output : (L, Ev) array, float64 if any input is float64, else float32; zeros for a query seeing no key.
    lse : (L,) array, same dtype; ``-inf`` for a query seeing no key.
    """
    if index.keys_ is None:
        raise RuntimeError("SegmentedClusterIndex is not built: call build(keys, key_positions) first.")
    keys = index.keys_
    S, E = keys.shape
    q_in, v_in = queries_values(queries, values, S, E, check_finite)
    sc = check_scale(scale, E)
    dtype = result_dtype(q_in, keys, v_in)
    q = np.ascontiguousarray(q_in, dtype=dtype)
    v = np.ascontiguousarray(v_in, dtype=dtype)
    L, Ev = q.shape[0], v.shape[1]
    qpos = positions(query_positions, L, "query_positions")
    n = index.threads_ if n_threads is None else int(n_threads)
    visible, exact_from, segs = index.cover(qpos, exact_prefix)
    check_budget(index.prefix_budget_, estimate, top_p, min_keys, max_keys)  # once, even with no segment

    def run(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        out = np.zeros((L, Ev), dtype=dtype)
        lse = np.full(L, -np.inf, dtype=dtype)
        keys_read = np.zeros(L, dtype=np.int64)
        refined = 0
        with worker_threads(n):
            index.prepare(segs, n)
            _attend_exact(q, keys, v, sc, index.order_, visible, exact_from, out, lse, n)
            keys_read += visible - exact_from
            for level, blocks in segs:
                for t, rows in blocks:
                    seg, ids = index.segment(level, t)
                    st: dict[str, Any] = {}
                    o, lo = routed_attention(seg, q[rows], v[ids], scale=sc, n_threads=n, check_finite=False,
                                             stats=st, estimate=estimate, top_p=top_p, min_keys=min_keys,
                                             max_keys=max_keys)
                    acc_o, acc_l = merge_pair(out[rows], lse[rows], o, lo)
                    out[rows] = acc_o
                    lse[rows] = acc_l
                    keys_read[rows] += st["keys_read"]
                    refined += int(st.get("refined_pairs", 0))
        return out, lse, keys_read, refined

    with np.errstate(over="ignore", invalid="ignore"):  # overflowing scores: check_lse; values: below
        out, lse, keys_read, refined = run(v)
    check_lse(lse, dtype, sc, nan_is_overflow=check_finite)
    v_factors = None if np.isfinite(out).all() else value_scaling(v, S, dtype)
    if v_factors is not None:
        # Values near the dtype's limit: the weighted sums (or the merges) overflowed although the output
        # is finite.  Computed again on power-of-two scaled value columns.
        out, lse, keys_read, refined = run(v * v_factors.astype(dtype))
        out = unscale_output(out, v_factors)
    if stats is not None:
        stats["keys_read"] = keys_read
        stats["refined_pairs"] = refined
    return out, lse


def _attend_exact(q: np.ndarray, keys: np.ndarray, v: np.ndarray, scale: float, order: np.ndarray,
                  visible: np.ndarray, exact_from: np.ndarray, out: np.ndarray, lse: np.ndarray,
                  n_threads: int) -> None:
    """Exact attention of every row over the keys ``order[exact_from[i]:visible[i]]`` (its exact part),
    written into ``out`` / ``lse`` (rows with an empty exact part are left alone).  Rows sharing a start
    share one gathered key block; inside ``worker_threads``."""
    dtype = q.dtype
    live = visible > exact_from
    keys = np.ascontiguousarray(keys, dtype=dtype)
    for lo in np.unique(exact_from[live]):
        rows = np.flatnonzero(live & (exact_from == lo))
        n_vis = (visible[rows] - lo).astype(np.int64)
        B = int(n_vis.max())
        ids = order[int(lo):int(lo) + B]
        Ks = np.empty((B, keys.shape[1]), dtype=dtype)
        ck.gather_rows(keys, ids, Ks)
        Vs = np.empty((B, v.shape[1]), dtype=dtype)
        ck.gather_rows(v, ids, Vs)
        o, lr = prefix_attention(q[rows] * dtype.type(scale), n_vis, Ks, Vs, n_threads)
        out[rows] = o
        lse[rows] = lr
