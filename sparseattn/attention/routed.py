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
that sees at most ``index.prefix_budget()`` keys attends to all of them exactly instead.  Through a
:class:`~sparseattn.index.causal.CausalClusterIndex` each longer row routes through the index of its band
(the one whose codebook it sees whole).

Estimation (``estimate``) and the mass-driven budget (``top_p``): the clusters a query does not read
can be estimated from per-cluster statistics (count, mean key, key spread: kept in the index; mean
value and a pooled value-on-key regression: summed per call) and merged as one more partial; and the
routed clusters can be chosen by estimated mass instead of ``q.c`` (see :func:`routed_attention`; the
kernels are :mod:`sparseattn.kernels.estimate`).  With both off the code path is the plain one above.

The estimate: a cluster is summarised by its count n_c, mean key mu_c and mean per-dimension variance
sigma_c^2 (kept in the index, :meth:`~sparseattn.index.cluster.ClusterIndex.key_stats`) and its mean
value vbar_c (summed per call).  Its softmax numerator sum is estimated as ``n_c exp(s q.mu_c + g)``
with g the second-order term ``x = s^2 |q|^2 sigma_c^2 / 2`` (isotropic spread: the exp of the mean
score under-estimates the mean of the exp) capped where it stops being trustworthy
(:func:`~sparseattn.kernels.estimate.second_order`): ``2 sqrt(x log n_c) - log n_c`` once x passes
``log n_c``, never above ``|s| |q|`` times the cluster's largest member distance to its mean (what
its keys can hold), and never above 2 (``EST_CAP``: since ``n_c exp(s q.mu_c)`` is a lower bound of
the true sum, an estimated cluster claims at most e^2 times its true mass, so ``lse`` exceeds the
true one by at most 2).  Its weighted value sum is that times ``vbar_c + s f_c sigma_c^2 B q``, with
B the pooled within-cluster least-squares regression of values on keys (the exponential tilt of a
cluster moves its mean key by ``s Sigma_c q`` and, linearly, its mean value by ``B`` times that;
f_c = dg/dx, 0 where the cap of 2 binds), the regression part shrunk per row as far as needed to
keep the estimate inside the values' per-column range (so is every output row).  The estimated
clusters form one extra partial per query, merged with the routed ones by log-sum-exp.  Causal: an estimated cluster counts only its keys at or before the query, from prefix
statistics (sums over each cluster's keys in position order), so no row reads statistics of a future
key; the causal estimate is first order with the mean value (``n_c exp(s q.mu_c) vbar_c`` over the
visible keys), since the pooled regression B would mix in future keys.

Threads: the per-cluster products run on ``n_threads`` workers of :func:`sparseattn.threads.executor`
with BLAS pinned to one thread each (:func:`sparseattn.threads.worker_threads`); Numba kernels use
``n_threads`` too.  Results do not depend on the thread count.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..index.causal import CausalClusterIndex
from ..index.cluster import ClusterIndex, cluster_jobs, key_spans
from ..index.routing import RoutePlanner, check_budget, mass_routes, positions_in_clusters
from ..inputs import (
    as_float_array,
    check_bool,
    check_lse,
    check_scale,
    positions,
    result_dtype,
    unscale_output,
    value_scaling,
)
from ..kernels import cluster as ck
from ..kernels import estimate as ek
from ..kernels.merge import merge_partials
from ..threads import run_jobs, worker_threads

__all__ = ["CLAMP", "mass_routes", "prefix_attention", "queries_values", "routed_attention"]

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
CLAMP = {np.float32: -80.0, np.float64: -700.0}
# Elements of one score tile ``Q_c K_c^T`` (rows of a large cluster are processed in tiles).
_TILE = 1 << 18
# Fewest query rows per GEMM tile (large clusters would otherwise give skinny, slow products), and most
# (small clusters would otherwise get tiles of up to _TILE rows, and the P V scratch with them).
_MIN_ROWS = 64
_MAX_ROWS = 4096
# Rows per tile of the exact prefix rows (prefix_attention): measured on 2,048 causal rows over 2,048 keys,
# one thread, 6.8 ms at 128 rows (7.2 ms at 64), against 16.4 ms for the former four-rows-at-a-time loops.
_PREFIX_TILE = 128
# Rows planned at once by the estimate / top_p path (routing scores, log masses, estimate weights: a few
# (rows x C) temporaries that then fit in the L2 cache).
_PLAN_ROWS = 1024


def _buffers(n_buf: int, E: int, Ev: int, kptr: np.ndarray, n_threads: int, dtype: np.dtype
             ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Buffers allocated once and reused by every query block (fresh multi-MB arrays are page-faulted on
    first touch: up to 40 ms per block with two threads faulting at once): gathered queries (n_buf, E),
    partial outputs and sums (n_buf, Ev + 1), shifts (n_buf,); and each worker's tile scratch: scores
    (tile x largest cluster) and the tile's P V (tile x Ev)."""
    bufs = (np.empty((n_buf, E), dtype=dtype), np.empty((n_buf, Ev + 1), dtype=dtype),
            np.empty(n_buf, dtype=dtype))
    nk_max = int(np.diff(kptr).max())
    scratch = [(np.empty(max(_TILE, _MIN_ROWS * nk_max), dtype=dtype),
                np.empty(_MAX_ROWS * Ev, dtype=dtype)) for _ in range(max(1, n_threads))]
    return bufs, scratch


def routed_attention(index: ClusterIndex | CausalClusterIndex, queries: np.ndarray, values: np.ndarray, *,
                     scale: float | None = None, is_causal: bool = False, query_positions: object = None,
                     key_positions: object = None, exact_prefix: bool = True, n_threads: int | None = None,
                     check_finite: bool = True, stats: dict | None = None, estimate: int = 0,
                     top_p: float | None = None, min_keys: int = 0, max_keys: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Exact softmax attention of each query over every key of its routed clusters (plus, optionally,
    an estimate of the clusters it does not read).

    Parameters
    ----------
    index : ClusterIndex or CausalClusterIndex
        Built over the keys (S, E).  A :class:`~sparseattn.index.causal.CausalClusterIndex` (strictly
        causal) takes causal queries with ``exact_prefix`` only; each longer row routes through the
        index of its band.
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
        with a tighter shift (diagnostics), and ``stats["keys_read"]`` to an (L,) int64 array: the keys
        each query attended to exactly (causal: its visible keys in the routed clusters; an exact-prefix
        row: every key it sees).  With ``estimate`` on, ``stats["estimate_cpu_s"]``: CPU seconds (summed
        over the threads) of the estimate's own work: the per-call value statistics and, per row, the
        estimated clusters' weights and value sums (not the routing, shared with the plain path, nor
        the merge of the one extra partial); causal rows are not timed (0).
    estimate : int, default 0
        Estimation zone (see "Estimation" below).  0: off (unread clusters count as zero, the plain
        routed attention).  N > 0: the next N clusters after the routed ones (in routing order: ``q.c``,
        or estimated mass with ``top_p``) are estimated.  -1: every cluster not routed is estimated.
    top_p : float in (0, 1], optional
        Mass-driven budget instead of ``n_probe``: each query routes clusters in order of estimated mass
        until the routed estimated mass m_in reaches ``top_p`` of ``m_in + 1.1 m_out`` (m_out: the
        estimated mass left unrouted, counted 10 % larger as a margin for its estimation error), with at
        least ``min_keys`` keys when available and never more than ``max_keys`` (except a row's best
        cluster, read whatever its size).  ``top_p = 1``: every cluster with a visible key (within
        ``max_keys``).  Non-causal log masses are second order with
        each cluster's key covariance (its top 8 eigen-directions plus an isotropic rest:
        :meth:`~sparseattn.index.cluster.ClusterIndex.key_cov_factors`; the term capped as under
        "Estimation" below except for the cap of 2), so that a row keeps about
        ``top_p`` of the true softmax mass or more: measured on the MiniLM stores (16k and 65k keys, every
        head), top_p = 0.9 left >= 0.9 of the true mass in 97-100 % of the rows
        (``benchmarks/results/estimate.md``).  This is a measured calibration, not a bound.  Causal
        rows use first-order log masses of their visible keys.
    min_keys : int, default 0
        ``top_p`` only: floor of keys read per query (the walk continues past ``top_p`` until reached).
    max_keys : int, optional
        ``top_p`` only: cap of keys read per query (default ``4 * n_probe * S / n_clusters``, four times
        the fixed budget); a query stops at the first cluster that would exceed it, after its first.

    Returns
    -------
    output : (L, Ev) array, float64 if any of queries, keys, values is float64, else float32.
        Zeros for a query whose routed clusters hold no allowed key.
    lse : (L,) array, same dtype: log-sum-exp of the scaled scores over the routed keys
        (``-inf`` for no key).  ``exp(lse - lse_full)`` is the softmax mass the routing kept.

    Estimation: see the module docstring.

    Raises
    ------
    ValueError
        Wrong shapes, non-finite inputs, bad ``estimate`` / ``top_p`` / ``min_keys`` / ``max_keys``, or some score ``q . k * scale`` overflowing the computation dtype
        (pass float64 or a smaller scale).
    """
    if not index.is_built:
        raise RuntimeError(f"{type(index).__name__} is not built: call build(keys) first.")
    S, E = index.keys_.shape
    q_in, v_in = queries_values(queries, values, S, E, check_finite)
    is_causal = check_bool(is_causal, "is_causal")
    if isinstance(index, CausalClusterIndex) and not (is_causal and check_bool(exact_prefix, "exact_prefix")):
        raise ValueError("a CausalClusterIndex serves causal queries only, its short rows exactly: pass "
                         "is_causal=True and exact_prefix=True (or route through a ClusterIndex).")
    sc = check_scale(scale, E)
    dtype = result_dtype(q_in, index.keys_, v_in)
    q = np.ascontiguousarray(q_in, dtype=dtype)
    L = q.shape[0]
    Ev = v_in.shape[1]
    qpos = positions(query_positions, L, "query_positions")
    kpos = positions(key_positions, S, "key_positions")
    if isinstance(index, CausalClusterIndex) and not np.array_equal(kpos, index.key_positions_):
        raise ValueError("key_positions must be the ones the CausalClusterIndex was built with (its bands are "
                         "prefixes in that position order): pass those, or build it with these.")
    budget = check_budget(index.prefix_budget(), estimate, top_p, min_keys, max_keys)
    if budget is not None and index.get_params()["spread"]:
        raise ValueError(f"spread={index.get_params()['spread']} changes the fixed n_probe routing; estimate and "
                         f"top_p plan their own routing and would ignore it: build the index with spread=0, or "
                         f"pass estimate=0 and top_p=None.")
    if L == 0:
        if stats is not None:
            stats["refined_pairs"] = 0
            stats["keys_read"] = np.zeros(0, dtype=np.int64)
        return np.zeros((0, Ev), dtype=dtype), np.zeros(0, dtype=dtype)
    n = index.threads_ if n_threads is None else int(n_threads)
    return _checked_rows(v_in, (index, q, sc, is_causal, qpos, kpos, exact_prefix, n, budget, stats is not None),
                         stats, check_finite)


def _checked_rows(v_in: np.ndarray, args: tuple, stats: dict | None, check_finite: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_routed_rows` on validated inputs ``args``, with the overflow checks and ``stats``."""
    index, q, sc, budget = args[0], args[1], args[2], args[8]
    dtype = q.dtype
    S = index.keys_.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing scores: check_lse; values: below
        out, lse, keys_read, refined, est_cpu = _routed_rows(v_in, *args)
    # Finite inputs whose q.k overflows the dtype leave +inf (or inf - inf = NaN) in lse: an error, as in
    # sparse_attention, never a silent garbage row.  NaN from NaN inputs (check_finite=False) passes.
    check_lse(lse, dtype, sc, nan_is_overflow=check_finite)
    v_factors = None if np.isfinite(out).all() else value_scaling(v_in, S, dtype)
    if v_factors is not None:
        # Values near the dtype's limit: the weighted sums overflowed although the output is finite.
        # Computed again on power-of-two scaled value columns (rare: the check is one pass over the output).
        v_scaled = np.ascontiguousarray(v_in * v_factors.astype(dtype), dtype=dtype)
        out, lse, keys_read, refined, est_cpu = _routed_rows(v_scaled, *args)
        out = unscale_output(out, v_factors)
    if stats is not None:
        stats["refined_pairs"] = refined
        stats["keys_read"] = keys_read
        if budget is not None and budget[0] != 0:
            stats["estimate_cpu_s"] = est_cpu
    return out, lse


def _routed_rows(v_in, index, q, sc, is_causal, qpos, kpos, exact_prefix, n, budget, want_keys
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, float]:
    """The rows of :func:`routed_attention` (validated arguments, L >= 1): (out, lse, keys read, refined
    pairs, estimate CPU seconds)."""
    L, Ev = q.shape[0], v_in.shape[1]
    dtype = q.dtype
    out = np.zeros((L, Ev), dtype=dtype)
    lse = np.full(L, -np.inf, dtype=dtype)
    keys_read = np.zeros(L, dtype=np.int64)
    refined = [0]
    est_cpu = [0.0]  # CPU seconds of the estimate's own work (summed over threads)
    with worker_threads(n):
        prefix = np.zeros(0, dtype=np.int64)
        if is_causal and exact_prefix:
            order = np.argsort(kpos, kind="stable")  # keys in position order: one sort for both uses
            prefix = index.prefix_rows(qpos, kpos, kpos[order])
        if budget is None:
            def attend_rows(part, qs, qp, vp, kp):
                return _attend_routed(part, qs, vp, sc, is_causal, qp, kp, n, refined, want_keys)
        else:
            def attend_rows(part, qs, qp, vp, kp):
                return _attend_estimated(part, qs, vp, sc, is_causal, qp, kp, n, refined, *budget,
                                         est_cpu=est_cpu)
        # The exact-prefix rows are computed exactly below: the routed pass skips them.
        sub = np.delete(np.arange(L), prefix) if prefix.size else np.arange(L)
        if isinstance(index, CausalClusterIndex):  # each longer row through the index of its band
            parts = [(band.index, sub[r], band.take(v_in), band.take(kpos)) for band, r in index.band_rows(qpos[sub])]
        else:
            parts = [(index, sub, v_in, kpos)]
        for part, rows, vp, kp in parts:
            out[rows], lse[rows], keys_read[rows] = attend_rows(part, q[rows], qpos[rows], vp, kp)
        if prefix.size:
            keys_read[prefix] = np.searchsorted(kpos[order], qpos[prefix], side="right")
            _attend_prefix(index, q, v_in, sc, prefix, qpos, kpos, order, out, lse, n)
    return out, lse, keys_read, refined[0], est_cpu[0]


def _attend_routed(index, q, v_in, sc, is_causal, qpos, kpos, n_threads, refined, want_keys
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention of every row of q over its routed clusters (inside ``worker_threads``); returns
    (out, lse, keys read per row: zeros unless ``want_keys``)."""
    S, E = index.keys_.shape
    dtype = q.dtype
    L = q.shape[0]
    Ev = v_in.shape[1]
    out = np.zeros((L, Ev), dtype=dtype)
    lse = np.full(L, -np.inf, dtype=dtype)
    keys_read = np.zeros(L, dtype=np.int64)
    if L == 0:
        return out, lse, keys_read
    if is_causal:
        kpos_p, kmin, kmax = key_spans(index, kpos)
        route, route_scores = index.route_rows(q, n_threads, kmin, qpos)  # clusters of later keys rank last
    else:
        route, route_scores = index.route_rows(q, n_threads)
    if want_keys:
        kpos_cs = positions_in_clusters(index, kpos)[1] if is_causal else np.zeros(1, dtype=np.int64)
        ek.routed_visible(route, qpos, index.cluster_ptr_, kpos_cs, is_causal, keys_read)
    Kp = index.keys_as(dtype)
    Vp = np.empty((S, Ev), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(v_in, dtype=dtype), index.perm_, Vp)  # float16 in: upcast
    lse_shift = (q @ index.mean_.astype(dtype)) * sc  # scores against raw keys = centred + q.mean
    q_norm = np.sqrt(np.einsum("ij,ij->i", q, q, dtype=np.float64))  # for the score bounds
    kptr = index.cluster_ptr_
    if is_causal:
        # perm_ keeps the original order inside a cluster: sorted positions stay sorted there
        kpos_sorted = bool(np.all(kpos[1:] >= kpos[:-1]))
    else:
        kpos_p = kmin = kmax = None
        kpos_sorted = False
    p = index.n_probe_
    block = min(L, max(1, _BLOCK_BUDGET // (p * (E + Ev + 2))))  # Qs, po, pm
    bufs, scratch = _buffers(block * p, E, Ev, kptr, n_threads, dtype)
    for q0 in range(0, L, block):
        q1 = min(L, q0 + block)
        refined[0] += _attend_block(index, q, q_norm, q0, q1, route[q0:q1], route_scores[q0:q1], Kp, Vp, sc,
                                    qpos, kpos_p, kmin, kmax, kpos_sorted, lse_shift, out, lse, bufs, scratch,
                                    n_threads)
    return out, lse, keys_read


def _attend_prefix(index, q, values, scale, rows, qpos, kpos, order, out, lse, n_threads) -> None:
    """Exact causal attention for the rows that see few keys (``exact_prefix``), over raw keys.

    Each such row sees at most ``index.prefix_budget()`` keys, a prefix of the keys in position order
    (:func:`prefix_attention`); ``order`` is ``argsort(kpos)`` (stable).  Called inside ``worker_threads``."""
    dtype = q.dtype
    n_vis = np.searchsorted(kpos[order], qpos[rows], side="right").astype(np.int64)
    B = int(n_vis.max())
    Ks = np.empty((B, q.shape[1]), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(index.keys_, dtype=dtype), order[:B], Ks)
    Vs = np.empty((B, values.shape[1]), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(values, dtype=dtype), order[:B], Vs)
    o, lse_r = prefix_attention(q[rows] * dtype.type(scale), n_vis, Ks, Vs, n_threads)
    out[rows] = o
    lse[rows] = lse_r


def prefix_attention(Qs: np.ndarray, n_vis: np.ndarray, Ks: np.ndarray, Vs: np.ndarray, n_threads: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention of each row over a prefix of one block of keys: row r over ``Ks[:n_vis[r]]``.

    Qs (R, E) scaled queries in float32 or float64, n_vis (R,) int64 in [0, B], Ks (B, E) / Vs (B, Ev) the
    keys and values in position order, same dtype.  Returns (out (R, Ev), lse (R,)): zeros / ``-inf`` for
    ``n_vis = 0``.  Rows go ``_PREFIX_TILE`` at a time through two BLAS products
    (:func:`~sparseattn.kernels.cluster.attend_prefix_tiles_f32`), split over ``n_threads`` workers in
    contiguous shares of about equal work cut at multiples of the tile, so every tile holds the same rows
    whatever the thread count and the result does not depend on it.  Call inside ``worker_threads`` (BLAS
    pinned to one thread per worker)."""
    dtype = Qs.dtype
    R, Ev, B = Qs.shape[0], Vs.shape[1], Ks.shape[0]
    kernel = ck.attend_prefix_tiles_f32 if dtype == np.float32 else ck.attend_prefix_tiles_f64
    clamp = CLAMP[dtype.type]
    o = np.empty((R, Ev), dtype=dtype)
    lse = np.empty(R, dtype=dtype)
    T = _PREFIX_TILE
    n_shares = max(1, min(n_threads, -(-R // T)))
    cost = np.cumsum(n_vis)
    cuts = [0] + [int(np.searchsorted(cost, cost[-1] * t / n_shares)) // T * T for t in range(1, n_shares)] + [R]
    shares = [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]

    def work(t: int) -> None:
        a, b = shares[t]
        kernel(Qs[a:b], n_vis[a:b], Ks, Vs, clamp, T, np.empty(T * B, dtype=dtype), np.empty(T * Ev, dtype=dtype),
               np.empty(T, dtype=dtype), o[a:b], lse[a:b])

    run_jobs(work, range(len(shares)), n_threads)
    return o, lse

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
                  kpos_sorted, lse_shift, out, lse, bufs, scratch, n_threads, kptr=None, radius=None,
                  extra=None) -> int:
    """Attention of queries q0..q1 over their routed clusters; returns the number of refined pairs.

    Per cluster tile: ``s = (scale q) @ (k - mean)^T`` (one GEMM), then one pass
    (:func:`~sparseattn.kernels.cluster.shifted_exp_rows_f32`) that turns s into weights
    ``exp(max(s - m, clamp))`` with m the Cauchy-Schwarz bound of the pair (so exp cannot overflow),
    zeroes keys after the query (causal) and sums each row; then ``po = w @ V`` (one GEMM) and the row
    sum go to the pair's partial.  A pair whose bound was so loose that every weight is tiny (row sum <
    ``_TINY``: relevant weights could have underflowed) is recomputed with a tighter shift
    (:func:`_refine`).  Partials are then merged per query (:func:`~sparseattn.kernels.merge.merge_partials`).
    ``kptr`` / ``radius`` (default the index's) may list one more, empty, cluster that pads rows routed
    to fewer clusters (``top_p``); ``extra = (o, s, m)`` is one more partial per row (the estimate),
    merged with the routed ones; ``bufs`` then hold ``n_pairs + rows`` partials.
    """
    Ev = Vp.shape[1]
    p = route.shape[1]
    kptr = index.cluster_ptr_ if kptr is None else kptr
    radius = index.radius_ if radius is None else radius
    is_causal = kpos_p is not None
    qptr, src, slot = ck.group_pairs(route, kptr.shape[0] - 1)
    n_pairs = src.shape[0]
    Qs, po, pm = (b[:n_pairs] for b in bufs)
    ck.gather_pairs(q, q_norm, q0, src, p, route, route_scores, radius, scale, Qs, pm)
    clamp = CLAMP[q.dtype.type]
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
    if extra is not None:  # the estimate: partial n_pairs + i of row i, merged as its (p+1)-th
        R = q1 - q0
        po = bufs[1][:n_pairs + R]
        pm = bufs[2][:n_pairs + R]
        po[n_pairs:, :Ev] = extra[0]
        po[n_pairs:, Ev] = extra[1]
        pm[n_pairs:] = extra[2]
        slot2 = np.empty((R, p + 1), dtype=np.int64)
        slot2[:, :p] = slot.reshape(R, p)
        slot2[:, p] = np.arange(n_pairs, n_pairs + R)
        slot, p = slot2.reshape(-1), p + 1
    merge_partials((po[:, :Ev],), po[:, Ev], pm, slot, p, lse_shift[q0:q1], out[q0:q1], lse[q0:q1])
    return refined


def queries_values(queries: object, values: object, S: int, E: int, check_finite: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``queries`` (L, E) and ``values`` (S, Ev) float arrays for attention over S keys of E
    features (ValueError naming the argument and the expected shape otherwise)."""
    q_in = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
    v_in = as_float_array(values, "values", min_ndim=2, check_finite=check_finite)
    if q_in.ndim != 2 or q_in.shape[1] != E:
        raise ValueError(f"queries must have shape (L, E={E}); got {q_in.shape}.")
    if v_in.ndim != 2 or v_in.shape[0] != S:
        raise ValueError(f"values must have shape (S={S}, Ev), one row per key; got {v_in.shape}.")
    return q_in, v_in



def _value_stats(index: ClusterIndex, Vp: np.ndarray, Kp: np.ndarray, sig2: np.ndarray, dtype: np.dtype
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The value side of the estimate, from the values Vp (S, Ev) and centred keys Kp (S, E) in cluster
    order: (mean value per cluster (C, Ev) float64, B^T (E, Ev) in ``dtype``: the pooled within-cluster
    regression of values on keys, per-column value minimum and maximum (Ev,) each)."""
    S, E = Kp.shape
    Ev = Vp.shape[1]
    kptr = index.cluster_ptr_
    count = index.count_
    vsum = ek.cluster_sums(Vp, kptr)
    safe = np.maximum(count, 1).astype(np.float64)[:, None]
    vbar = vsum / safe
    # Pooled within-cluster regression of values on keys, B = X / sigma^2 with X the pooled
    # cross-covariance sum_j (v_j - vbar_c)(k_j - mu_c)^T / S and sigma^2 the pooled variance.
    xcov = (Vp.T @ Kp).astype(np.float64) - vsum.T @ (index.key_sum_ / safe)
    var_pool = float(np.sum(count * sig2)) / max(S, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        B = (xcov / (S * var_pool)).astype(dtype) if var_pool > 0 else np.zeros((Ev, E), dtype=dtype)
    if not np.isfinite(B).all():  # keys so small (subnormal float32) that B passes the dtype's range: no
        B = np.zeros((Ev, E), dtype=dtype)  # regression term (the estimate is then the clusters' mean values)
    v_lo, v_hi = np.empty(Ev, dtype=dtype), np.empty(Ev, dtype=dtype)
    ek.column_range(Vp, v_lo, v_hi)  # the regression term keeps the estimate in this range
    return vbar, np.ascontiguousarray(B.T), v_lo, v_hi


def _estimate_all(plan: RoutePlanner, A, qc, qmu, q2, route, W, sc, vbar32, B_T, v_lo, v_hi, o_e, s_e, m_e, ws2
                  ) -> None:
    """The estimate of every unread cluster for one row chunk: float32 weights W (R, C), then one BLAS
    product with the cluster mean values ``vbar32`` (C, Ev), plus the regression term ``s ws2 B q``
    kept inside the values' range [v_lo, v_hi]; written to o_e (R, Ev), s_e / m_e / ws2 (R,)."""
    if A is None:
        ek.estimate_weights_stats(qmu, q2, plan.logn32, plan.sig2_32, plan.ell32, plan.rmu32, sc, route, W, s_e,
                                  m_e, ws2)
    else:
        ek.estimate_weights(A, route, plan.sig2_32, plan.ell32, plan.rmu32, q2, W, s_e, m_e, ws2)
    reg = qc @ B_T  # the regression term, s ws2 B q
    reg *= (sc * ws2).astype(reg.dtype)[:, None]
    if o_e.dtype == np.float32:
        np.matmul(W, vbar32, out=o_e)
    else:
        o_e[:] = W @ vbar32
    ek.add_in_range(o_e, reg, s_e, v_lo, v_hi)


def _row_buffers(R: int, P: int, N: int, Ev: int, dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """A block's plan and estimate outputs: route (R, P) int32, route scores (R, P), estimated clusters
    (R, N) int32 (-1), the estimated partial (R, Ev), its sum, shift and spread weight (R,) float64."""
    return (np.empty((R, P), dtype=np.int32), np.zeros((R, P), dtype=dtype), np.full((R, N), -1, dtype=np.int32),
            np.empty((R, Ev), dtype=dtype), np.empty(R, dtype=np.float64), np.empty(R, dtype=np.float64),
            np.empty(R, dtype=np.float64))


def _attend_estimated(index, q, v_in, sc, is_causal, qpos, kpos, n_threads, refined, n_est, top_p, min_keys,
                      max_keys, est_cpu=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routed attention plus the estimate of unread clusters and / or the mass-driven budget (inside
    ``worker_threads``).  Returns (out, lse, keys read per row).

    Per block of rows: the plan of each row chunk (:class:`~sparseattn.index.routing.RoutePlanner`: routing scores, log masses, route,
    estimated clusters), the estimated partial (:func:`~sparseattn.kernels.estimate.estimate_weights`
    and one product with the cluster mean values, :func:`~sparseattn.kernels.estimate.estimate_rows` or
    ``estimate_rows_causal``) and the routed partials (:func:`_attend_block`), merged together.
    """
    S, E = index.keys_.shape
    dtype = q.dtype
    L = q.shape[0]
    Ev = v_in.shape[1]
    C = index.n_clusters_
    out = np.zeros((L, Ev), dtype=dtype)
    lse = np.full(L, -np.inf, dtype=dtype)
    keys_read = np.zeros(L, dtype=np.int64)
    if L == 0:
        return out, lse, keys_read
    plan = RoutePlanner(index, dtype, sc, is_causal, kpos, n_est, top_p, min_keys, max_keys)
    all_rest, N, P = plan.all_rest, plan.N, plan.P
    Kp = plan.Kp
    Vp = np.empty((S, Ev), dtype=dtype)
    ck.gather_rows(np.ascontiguousarray(v_in, dtype=dtype), index.perm_, Vp)
    lse_shift = (q @ index.mean_.astype(dtype)) * sc
    q_norm = np.sqrt(np.einsum("ij,ij->i", q, q, dtype=np.float64))
    kptr = index.cluster_ptr_
    kptr_x = np.append(kptr, kptr[-1])  # cluster C: empty, pads rows routed to fewer clusters
    radius_x = np.append(index.radius_, 0.0)
    sig2 = plan.sig2
    if is_causal:
        Gv = ek.cluster_prefix(Vp, kptr, plan.order)
        kpos_p, kmin, kmax = key_spans(index, kpos)
        kpos_sorted = bool(np.all(kpos[1:] >= kpos[:-1]))
        vbar = vbar32 = B_T = v_lo = v_hi = None
    else:
        t_stats = time.thread_time()
        kpos_p = kmin = kmax = None
        kpos_sorted = False
        vbar, B_T, v_lo, v_hi = _value_stats(index, Vp, Kp, sig2, dtype)
        # float32 inputs: one float32 product with the weights; float64 ones keep their range (values beyond
        # float32's largest became inf and the estimate NaN)
        vbar32 = vbar.astype(np.float32) if dtype == np.float32 else vbar
        B_T32 = B_T.astype(np.float32) if dtype == np.float32 else B_T
        if est_cpu is not None:
            est_cpu[0] += time.thread_time() - t_stats
    lock = threading.Lock()
    block = min(L, max(1, _BLOCK_BUDGET // ((P + 1) * (E + Ev + 2) + 3 * C)))
    bufs, scratch = _buffers(block * P + block, E, Ev, kptr, n_threads, dtype)
    for q0 in range(0, L, block):
        q1 = min(L, q0 + block)
        R = q1 - q0
        qb = q[q0:q1]
        qpb = qpos[q0:q1]
        route, rscore, est, o_e, s_e, m_e, ws2 = _row_buffers(R, P, N, Ev, dtype)
        kr, qnb = keys_read[q0:q1], q_norm[q0:q1]
        n_used = np.zeros(R, dtype=np.int64)  # most clusters a row of a chunk routed (at its first row)

        def work(a0: int, b0: int, qb=qb, qpb=qpb, qnb=qnb, route=route, rscore=rscore, est=est, o_e=o_e,
                 s_e=s_e, m_e=m_e, ws2=ws2, kr=kr, n_used=n_used) -> None:
            # sub-chunks of _PLAN_ROWS rows: the (rows x C) temporaries stay small and cache-resident
            # instead of fresh multi-MB arrays (page faults on first touch) per chunk
            wbuf = (np.empty((min(_PLAN_ROWS, b0 - a0), C), dtype=np.float32) if all_rest and not is_causal
                    else None)
            # values near the dtype's limit may overflow the estimate's products: routed_attention then
            # recomputes on scaled values (np.errstate is per thread: set here, in the worker)
            with np.errstate(over="ignore", invalid="ignore"):
                for a in range(a0, b0, _PLAN_ROWS):
                    b = min(b0, a + _PLAN_ROWS)
                    n_used[a0] = max(n_used[a0], sub(a, b, qb, qpb, qnb, route, rscore, est, o_e, s_e, m_e, ws2,
                                                     kr, wbuf))

        def sub(a, b, qb, qpb, qnb, route, rscore, est, o_e, s_e, m_e, ws2, kr, wbuf) -> int:
            qc = qb[a:b]
            _, A, used, qmu, q2 = plan.plan(qc, qpb[a:b], route[a:b], rscore[a:b], est[a:b], kr[a:b],
                                            qnb[a:b])
            t0 = time.thread_time()
            if is_causal:
                ek.estimate_rows_causal(qc, qpb[a:b], route[a:b], est[a:b], all_rest, kptr, plan.kpos_cs, plan.Gk,
                                        plan.Gk2, Gv, sc, plan.spread, o_e[a:b], s_e[a:b], m_e[a:b], ws2[a:b])
            elif all_rest:
                _estimate_all(plan, A, qc, qmu, q2, route[a:b], wbuf[:b - a], sc, vbar32,
                              B_T32 if qc.dtype == np.float32 else B_T, v_lo, v_hi, o_e[a:b], s_e[a:b],
                              m_e[a:b], ws2[a:b])
            else:
                ek.estimate_rows(A, route[a:b], est[a:b], all_rest, vbar, sig2, plan.ell, plan.rmu, q2, o_e[a:b],
                                 s_e[a:b], m_e[a:b], ws2[a:b])
                reg = (sc * ws2[a:b]).astype(o_e.dtype)[:, None] * (qc @ B_T)
                ek.add_in_range(o_e[a:b], reg, s_e[a:b], v_lo, v_hi)
            if est_cpu is not None and (N != 0 or all_rest):
                with lock:
                    est_cpu[0] += time.thread_time() - t0
            return used

        index.row_chunks(R, work, n_threads)
        if top_p is not None:  # drop the padding columns no row of the block uses
            P_blk = max(1, int(n_used.max()))
            route, rscore = np.ascontiguousarray(route[:, :P_blk]), np.ascontiguousarray(rscore[:, :P_blk])
        refined[0] += _attend_block(index, q, q_norm, q0, q1, route, rscore, Kp, Vp, sc, qpos, kpos_p, kmin,
                                    kmax, kpos_sorted, lse_shift, out, lse, bufs, scratch, n_threads,
                                    kptr=kptr_x, radius=radius_x, extra=(o_e, s_e, m_e))
    return out, lse, keys_read
