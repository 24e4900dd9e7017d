"""Routed attention: exact softmax attention of each query over every key of its routed clusters.

Given a built :class:`~sparseattn.index.cluster.ClusterIndex` (keys in cluster order, routing vectors,
radii), the (query, cluster) pairs are counting-sorted by cluster, each cluster's queries gathered once
into a contiguous block, and the arithmetic is BLAS products per cluster tile:
``exp(scale Q_c K_c^T - m) [V_c, 1]``.  The partial results are merged per query by log-sum-exp
(:func:`sparseattn.kernels.merge.merge_partials`, the kernel of :mod:`sparseattn.attention.merge`).

Exactness: the shift ``m`` is not the row maximum but a Cauchy-Schwarz upper bound
``scale q.c + |scale| |q| r_c`` (``c``: the cluster's routing vector, ``r_c``: its radius), applied in one
fused pass with the exp, so ``exp`` never overflows.  Pairs whose bound overshoots so far that their row
sum drops below 1e-20 are recomputed with a tighter shift, and weights below ``exp(-80)`` (float32;
``exp(-700)`` float64) are clamped up to it (subnormal floats make the next GEMM 160x slower): a relative
change below ``2e-15 * n_keys``.  The result equals softmax attention restricted to the routed keys up
to floating-point rounding (tests: 1e-5 in float32, 1e-12 in float64).

Causal masking keeps the routing pure: keys after the query are masked inside each cluster; a query whose
routed clusters hold no allowed key gets zeros and ``lse = -inf``.  With ``exact_prefix`` a causal query
that sees at most ``index.prefix_budget()`` keys attends to all of them exactly instead.

Threads: the per-cluster products run on ``n_threads`` workers of :func:`sparseattn.threads.executor`
with BLAS pinned to one thread each (:func:`sparseattn.threads.worker_threads`); Numba kernels use
``n_threads`` too.  Results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np

from ..index.cluster import ClusterIndex, cluster_jobs
from ..inputs import as_float_array, check_bool, check_lse, check_scale, positions, result_dtype
from ..kernels import cluster as ck
from ..kernels.merge import merge_partials
from ..threads import run_jobs, worker_threads

__all__ = ["routed_attention"]

# Elements (not bytes) of the per-block buffers: queries are processed in blocks so the gathered query
# copies and the partial results stay near 2**24 elements (64 MiB in float32).
_BLOCK_BUDGET = 1 << 24
# Row sums below this after the bound shift trigger the refinement (see _refine): relevant weights are
# then at least exp(-46 - ln(n_keys) - 20) > float32's smallest normal.
_TINY = {np.float32: 1e-20, np.float64: 1e-200}
# Shifted scores are clamped from below here before exp: exp would return subnormal floats, and a GEMM
# over subnormals ran 160x slower (40 ms instead of 0.26 ms for a 1024 x 256 x 65 product).
# exp(-80) = 1.8e-35 is normal; since a row sum is >= _TINY = 1e-20, the clamp changes a row's weights
# by at most n_keys * exp(-80) / 1e-20 ~ 2e-15 * n_keys relative.
_CLAMP = {np.float32: -80.0, np.float64: -700.0}
# Elements of one score tile ``Q_c K_c^T`` (rows of a large cluster are processed in tiles).
_TILE = 1 << 18
# Fewest query rows per GEMM tile (large clusters would otherwise give skinny, slow products), and most
# (small clusters would otherwise get tiles of up to _TILE rows, and the P V scratch with them).
_MIN_ROWS = 64
_MAX_ROWS = 4096


def routed_attention(index: ClusterIndex, queries: np.ndarray, values: np.ndarray, *,
                     scale: float | None = None, is_causal: bool = False, query_positions: object = None,
                     key_positions: object = None, exact_prefix: bool = True, n_threads: int | None = None,
                     check_finite: bool = True, stats: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact softmax attention of each query over every key of its routed clusters.

    Parameters
    ----------
    index : ClusterIndex
        Built over the keys (S, E).
    queries : float array, shape (L, E)
    values : float array, shape (S, Ev)
        One value row per key given to ``index.build``, in the original key order.
    scale : float, optional
        Score scale (default ``1/sqrt(E)``).  Routing ranks clusters by ``q . c`` whatever the scale.
    is_causal : bool
        Key j is visible to query i only when ``key_positions[j] <= query_positions[i]``.
    query_positions, key_positions : int arrays of shape (L,) and (S,), optional
        Default ``arange`` (top-left alignment, like SDPA).
    exact_prefix : bool, default True
        Causal only: a query that sees at most ``index.prefix_budget()`` keys attends to all of them
        exactly instead of through routing.
    n_threads : int, optional
        Worker threads (default: the index's).
    check_finite : bool, default True
        Reject NaN / Inf in queries and values.
    stats : dict, optional
        When given, ``stats["refined_pairs"]`` is set to the number of (query, cluster) pairs recomputed
        with a tighter shift (diagnostics).

    Returns
    -------
    output : (L, Ev) array, float64 if any of queries, keys, values is float64, else float32.
        Zeros for a query whose routed clusters hold no allowed key.
    lse : (L,) array, same dtype: log-sum-exp of the scaled scores over the routed keys
        (``-inf`` for no key).  ``exp(lse - lse_full)`` is the softmax mass the routing kept.

    Raises
    ------
    ValueError
        Wrong shapes, non-finite inputs, or some score ``q . k * scale`` overflowing the computation dtype
        (pass float64 or a smaller scale).
    """
    if not index.is_built:
        raise RuntimeError("ClusterIndex is not built: call build(keys) first.")
    S, E = index.keys_.shape
    q_in = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
    v_in = as_float_array(values, "values", min_ndim=2, check_finite=check_finite)
    if q_in.ndim != 2 or q_in.shape[1] != E:
        raise ValueError(f"queries must have shape (L, E={E}); got {q_in.shape}.")
    if v_in.ndim != 2 or v_in.shape[0] != S:
        raise ValueError(f"values must have shape (S={S}, Ev), one row per key; got {v_in.shape}.")
    is_causal = check_bool(is_causal, "is_causal")
    sc = check_scale(scale, E)
    dtype = result_dtype(q_in, index.keys_, v_in)
    q = np.ascontiguousarray(q_in, dtype=dtype)
    L = q.shape[0]
    Ev = v_in.shape[1]
    qpos = positions(query_positions, L, "query_positions")
    kpos = positions(key_positions, S, "key_positions")
    out = np.zeros((L, Ev), dtype=dtype)
    lse = np.full(L, -np.inf, dtype=dtype)
    refined = [0]
    if L == 0:
        if stats is not None:
            stats["refined_pairs"] = 0
        return out, lse
    n = index.threads_ if n_threads is None else int(n_threads)
    with worker_threads(n):
        prefix = np.zeros(0, dtype=np.int64)
        if is_causal and exact_prefix:
            order = np.argsort(kpos, kind="stable")  # keys in position order: one sort for both uses
            prefix = index.prefix_rows(qpos, kpos, kpos[order])
        if prefix.size:
            # The exact-prefix rows are computed exactly below: the routed pass skips them.
            sub = np.delete(np.arange(L), prefix)
            out_r, lse_r = _attend_routed(index, q[sub], v_in, sc, is_causal, qpos[sub], kpos, n, refined)
            out[sub] = out_r
            lse[sub] = lse_r
            _attend_prefix(index, q, v_in, sc, prefix, qpos, kpos, order, out, lse, n)
        else:
            out, lse = _attend_routed(index, q, v_in, sc, is_causal, qpos, kpos, n, refined)
    if stats is not None:
        stats["refined_pairs"] = refined[0]
    # Finite inputs whose q.k overflows the dtype leave +inf (or inf - inf = NaN) in lse: an error, as in
    # sparse_attention, never a silent garbage row.  NaN from NaN inputs (check_finite=False) passes.
    check_lse(lse, dtype, sc, nan_is_overflow=check_finite)
    return out, lse


def _attend_routed(index, q, v_in, sc, is_causal, qpos, kpos, n_threads, refined) -> tuple[np.ndarray, np.ndarray]:
    """Attention of every row of q over its routed clusters (inside ``worker_threads``)."""
    S, E = index.keys_.shape
    dtype = q.dtype
    L = q.shape[0]
    Ev = v_in.shape[1]
    out = np.zeros((L, Ev), dtype=dtype)
    lse = np.full(L, -np.inf, dtype=dtype)
    if L == 0:
        return out, lse
    route, route_scores = index._route_rows(q, n_threads)
    Kp = index.keys_as(dtype)
    Vp = np.empty((S, Ev), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(v_in, dtype=dtype), index.perm_, Vp)  # float16 in: upcast
    lse_shift = (q @ index.mean_.astype(dtype)) * sc  # scores against raw keys = centred + q.mean
    q_norm = np.sqrt(np.einsum("ij,ij->i", q, q, dtype=np.float64))  # for the score bounds
    kptr = index.cluster_ptr_
    if is_causal:
        kpos_p = kpos[index.perm_]
        nonempty = np.diff(kptr) > 0
        kmin = np.zeros(index.n_clusters_, dtype=np.int64)
        kmax = np.zeros(index.n_clusters_, dtype=np.int64)
        kmin[nonempty] = np.minimum.reduceat(kpos_p, kptr[:-1][nonempty])
        kmax[nonempty] = np.maximum.reduceat(kpos_p, kptr[:-1][nonempty])
        # perm_ keeps the original order inside a cluster: sorted positions stay sorted there
        kpos_sorted = bool(np.all(kpos[1:] >= kpos[:-1]))
    else:
        kpos_p = kmin = kmax = None
        kpos_sorted = False
    p = index.n_probe_
    block = min(L, max(1, _BLOCK_BUDGET // (p * (E + Ev + 2))))  # Qs, po, pm
    # Buffers allocated once and reused by every block: fresh multi-MB arrays are page-faulted on first
    # touch, which cost up to 40 ms per block with two threads faulting at once.
    n_buf = block * p
    bufs = (np.empty((n_buf, E), dtype=dtype), np.empty((n_buf, Ev + 1), dtype=dtype),
            np.empty(n_buf, dtype=dtype))
    # Each worker's tile scratch: scores (tile x nk) and the tile's P V (tile x Ev).
    nk_max = int(np.diff(kptr).max())
    scratch = [(np.empty(max(_TILE, _MIN_ROWS * nk_max), dtype=dtype),
                np.empty(_MAX_ROWS * Ev, dtype=dtype)) for _ in range(max(1, n_threads))]
    for q0 in range(0, L, block):
        q1 = min(L, q0 + block)
        refined[0] += _attend_block(index, q, q_norm, q0, q1, route[q0:q1], route_scores[q0:q1], Kp, Vp, sc,
                                    qpos, kpos_p, kmin, kmax, kpos_sorted, lse_shift, out, lse, bufs, scratch,
                                    n_threads)
    return out, lse


def _attend_prefix(index, q, values, scale, rows, qpos, kpos, order, out, lse, n_threads) -> None:
    """Exact causal attention for the rows that see few keys (``exact_prefix``), over raw keys.

    Each such row sees at most ``index.prefix_budget()`` keys, a prefix of the keys in position order
    (:func:`~sparseattn.kernels.cluster.attend_prefix_rows_f32`); rows split over the worker threads by
    their number of keys; ``order`` is ``argsort(kpos)`` (stable).  Called inside ``worker_threads``."""
    dtype = q.dtype
    n_vis = np.searchsorted(kpos[order], qpos[rows], side="right").astype(np.int64)
    B = int(n_vis.max())
    Ks = np.empty((B, q.shape[1]), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(index.keys_, dtype=dtype), order[:B], Ks)
    Vs = np.empty((B, values.shape[1]), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(values, dtype=dtype), order[:B], Vs)
    Qs = q[rows] * dtype.type(scale)
    o = np.empty((rows.size, Vs.shape[1]), dtype=dtype)
    lse_r = np.empty(rows.size, dtype=dtype)
    kernel = ck.attend_prefix_rows_f32 if dtype == np.float32 else ck.attend_prefix_rows_f64
    clamp = _CLAMP[dtype.type]
    # Contiguous row shares of about equal work (sum of prefix lengths).
    T = max(1, min(n_threads, rows.size // 16))
    cost = np.cumsum(n_vis)
    cuts = [0] + [int(np.searchsorted(cost, cost[-1] * t / T)) for t in range(1, T)] + [rows.size]
    shares = [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]

    def work(t: int) -> None:
        a, b = shares[t]
        kernel(Qs[a:b], n_vis[a:b], Ks, Vs, clamp, np.empty(B, dtype=dtype), o[a:b], lse_r[a:b])

    run_jobs(work, range(len(shares)), n_threads)
    out[rows] = o
    lse[rows] = lse_r


def _shares(qptr: np.ndarray, kptr: np.ndarray, n_threads: int) -> list[np.ndarray]:
    """The clusters with work, split over the worker threads by cost (queries x keys): largest first,
    each to the least loaded worker (LPT scheduling; within 4/3 of the best split)."""
    cost = np.diff(qptr) * np.diff(kptr)
    T = max(1, n_threads)
    lists: list[list[int]] = [[] for _ in range(T)]
    load = [0] * T
    for c in cluster_jobs(qptr, kptr):
        t = min(range(T), key=load.__getitem__)
        lists[t].append(c)
        load[t] += int(cost[c])
    return [np.asarray(x, dtype=np.int64) for x in lists if x]


def _refine(Qs, pm, po, Kp, Vp, kptr, qptr, clamp, causal_args) -> int:
    """Fix the pairs whose shift m was too loose; return how many were recomputed.

    After the clamp every allowed key has a weight >= exp(-80) > 0, so a zero row sum means "no allowed
    key" (the pair becomes empty).  A row sum below ``_TINY`` means relevant weights may have underflowed:
    the pair is recomputed with ``m' = m + log(l)``, which is still >= the true log-sum-exp (the clamp only
    raises weights), hence a valid bound, and lies within ``log(n_keys)`` of the true maximum unless that
    was below the clamp, in which case it drops by ``>= 80 - log(n_keys)`` and the loop repeats.  Any pair
    left after 64 rounds (not expected) is recomputed with its exact maximum by a scalar kernel.  Pairs are
    sorted by cluster: cluster c owns pairs ``qptr[c]:qptr[c+1]``.
    """
    Ev = Vp.shape[1]
    tiny = _TINY[Qs.dtype.type]
    exp_rows = ck.shifted_exp_rows_f32 if Qs.dtype == np.float32 else ck.shifted_exp_rows_f64
    no_pos = np.zeros(1, dtype=np.int64)
    refined = 0
    for _ in range(64):
        bad = ck.scan_pairs(pm, po, tiny)
        if bad.size == 0:
            return refined
        refined += int(bad.size)
        clusters = np.searchsorted(qptr, bad, side="right") - 1
        new_m = pm[bad].astype(np.float64) + np.log(po[bad, Ev].astype(np.float64))
        cuts = np.flatnonzero(np.diff(clusters)) + 1
        for run, m_run, cl in zip(np.split(bad, cuts), np.split(new_m, cuts), np.split(clusters, cuts),
                                  strict=True):
            c = int(cl[0])
            ka, kb = int(kptr[c]), int(kptr[c + 1])
            Kc, Vc = Kp[ka:kb], Vp[ka:kb]
            step = max(_MIN_ROWS, _TILE // (kb - ka))
            for a in range(0, run.size, step):
                idx = run[a:a + step]
                m_new = m_run[a:a + step].astype(Qs.dtype)
                with np.errstate(over="ignore"):  # an overflowing score is reported by routed_attention
                    sc = Qs[idx] @ Kc.T
                sums_new = np.empty(idx.size, dtype=Qs.dtype)
                if causal_args is not None:
                    exp_rows(sc, m_new, clamp, True, causal_args[0][idx], causal_args[1][ka:kb], sums_new)
                else:
                    exp_rows(sc, m_new, clamp, False, no_pos, no_pos, sums_new)
                po[idx, :Ev] = sc @ Vc
                po[idx, Ev] = sums_new
                pm[idx] = m_new
    live = pm > -np.inf
    bad = np.nonzero(live & ~(po[:, Ev] >= tiny))[0]  # pragma: no cover - not expected
    if bad.size:  # pragma: no cover
        qpos_s, kpos_p = causal_args if causal_args is not None else (np.zeros(1, np.int64),) * 2
        pair_cluster = np.repeat(np.arange(qptr.size - 1, dtype=np.int64), np.diff(qptr))
        ck.exact_pairs(bad, Qs, Kp, Vp, kptr, pair_cluster, causal_args is not None, qpos_s, kpos_p, po, pm)
    return refined


def _attend_block(index, q, q_norm, q0, q1, route, route_scores, Kp, Vp, scale, qpos, kpos_p, kmin, kmax,
                  kpos_sorted, lse_shift, out, lse, bufs, scratch, n_threads) -> int:
    """Attention of queries q0..q1 over their routed clusters; returns the number of refined pairs.

    Per cluster tile: ``s = (scale q) @ (k - mean)^T`` (one GEMM), then one pass
    (:func:`~sparseattn.kernels.cluster.shifted_exp_rows_f32`) that turns s into weights
    ``exp(max(s - m, clamp))`` with m the Cauchy-Schwarz bound of the pair (so exp cannot overflow),
    zeroes keys after the query (causal) and sums each row; then ``po = w @ V`` (one GEMM) and the row
    sum go to the pair's partial.  A pair whose bound was so loose that every weight is tiny (row sum <
    ``_TINY``: relevant weights could have underflowed) is recomputed with a tighter shift
    (:func:`_refine`).  Partials are then merged per query (:func:`~sparseattn.kernels.merge.merge_partials`).
    """
    Ev = Vp.shape[1]
    p = index.n_probe_
    kptr = index.cluster_ptr_
    is_causal = kpos_p is not None
    qptr, src, slot = ck.group_pairs(route, index.n_clusters_)
    n_pairs = src.shape[0]
    Qs, po, pm = (b[:n_pairs] for b in bufs)
    ck.gather_pairs(q, q_norm, q0, src, p, route, route_scores, index.radius_, scale, Qs, pm)
    clamp = _CLAMP[q.dtype.type]
    kernel = ck.attend_clusters_f32 if q.dtype == np.float32 else ck.attend_clusters_f64
    qpos_s = qpos[src // p + q0] if is_causal else np.zeros(1, dtype=np.int64)
    kpos_arg = kpos_p if is_causal else np.zeros(1, dtype=np.int64)  # not read unless causal
    kmin_arg = kmin if is_causal else np.zeros(1, dtype=np.int64)
    kmax_arg = kmax if is_causal else np.zeros(1, dtype=np.int64)
    shares = _shares(qptr, kptr, n_threads)
    tiny = _TINY[q.dtype.type]
    n_low = [0] * len(shares)

    def work(t: int) -> None:
        buf, obuf = scratch[t]
        n_low[t] = kernel(shares[t], qptr, kptr, Qs, Kp, Vp, pm, po, clamp, tiny, _TILE, _MIN_ROWS, _MAX_ROWS,
                          is_causal, kpos_sorted, qpos_s, kpos_arg, kmin_arg, kmax_arg, buf, obuf)

    run_jobs(work, range(len(shares)), n_threads)
    # Pairs routed to clusters without keys were never computed: mark them empty.
    for c in np.flatnonzero((np.diff(kptr) == 0) & (np.diff(qptr) > 0)):
        pm[qptr[c]:qptr[c + 1]] = -np.inf
        po[qptr[c]:qptr[c + 1], Ev] = 0.0
    causal_args = (qpos_s, kpos_p) if is_causal else None
    refined = 0
    if sum(n_low):  # some row sum fell below _TINY: find and recompute those pairs
        refined = _refine(Qs, pm, po, Kp, Vp, kptr, qptr, clamp, causal_args)
    merge_partials((po[:, :Ev],), po[:, Ev], pm, slot, p, lse_shift[q0:q1], out[q0:q1], lse[q0:q1])
    return refined
