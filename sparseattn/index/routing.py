"""Routing without values: which clusters of a :class:`~sparseattn.index.cluster.ClusterIndex` each query
reads under the mass-driven budget (``top_p``), and the planning shared with routed attention.

* :func:`mass_routes`: the clusters routed by estimated mass;
* :class:`RoutePlanner`: the per-row-chunk plan (routing scores, log masses, route, estimated clusters)
  that :func:`sparseattn.attention.routed.routed_attention` consumes when ``estimate`` or ``top_p`` is set;
* :func:`check_budget`: validation of the ``estimate`` / ``top_p`` / ``min_keys`` / ``max_keys`` arguments.

Everything here reads keys and per-cluster key statistics only; attention over values is
:mod:`sparseattn.attention.routed`.
"""

from __future__ import annotations

import numpy as np

from ..inputs import check_bool, check_scale, positions
from ..kernels import cluster as ck
from ..kernels import estimate as ek
from ..threads import worker_threads
from .cluster import ClusterIndex, key_spans

__all__ = ["COV_RANK", "REST_MARGIN", "RoutePlanner", "check_budget", "mass_routes", "positions_in_clusters"]

# top_p: rank of the low-rank part of each cluster's key covariance in the log masses (the rest of the
# spectrum is counted isotropically; ClusterIndex.key_cov_factors), and the factor the estimated mass left
# unrouted is counted with when deciding to stop (measured on the MiniLM stores, benchmarks/
# results/estimate.md: with rank 8 and 1.1, top_p = 0.9 leaves >= 0.9 of the true mass in 97-100 % of the
# rows of every head; isotropic spread and 1.0 left it in 10-88 %).
COV_RANK = 8
REST_MARGIN = 1.1


def check_budget(prefix_budget: int, estimate: object, top_p: object, min_keys: object, max_keys: object
                 ) -> tuple[int, float | None, int, int] | None:
    """Validate the estimation / budget arguments of routed attention over an index whose
    ``prefix_budget()`` is ``prefix_budget`` (the default ``max_keys`` is 4 times it); None when both are
    off (the plain routed path), else (estimate, top_p, min_keys, max_keys) with the defaults resolved."""
    if isinstance(estimate, bool) or not isinstance(estimate, (int, np.integer)) or estimate < -1:
        raise ValueError(f"estimate must be an int >= -1 (0: off, N: the next N clusters, -1: every "
                         f"unread cluster); got {estimate!r}.")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating, np.integer)) \
                or not 0 < float(top_p) <= 1:
            raise ValueError(f"top_p must be a float in (0, 1] (or None: fixed n_probe); got {top_p!r}.")
    for name, val in (("min_keys", min_keys), ("max_keys", max_keys)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0):
            raise ValueError(f"{name} must be an int >= 0; got {val!r}.")
    if min_keys is None:
        min_keys = 0
    if max_keys is None:
        max_keys = 4 * int(prefix_budget)
    if int(min_keys) > int(max_keys):
        raise ValueError(f"min_keys={min_keys} must be <= max_keys={max_keys} (the floor and the cap of "
                         f"keys read per query).")
    if int(estimate) == 0 and top_p is None:
        return None
    return int(estimate), (None if top_p is None else float(top_p)), int(min_keys), int(max_keys)


def positions_in_clusters(index: ClusterIndex, kpos: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(order, kpos_cs): cluster-ordered slots re-sorted by key position inside each cluster (None when
    already so: perm_ is ascending inside a cluster, so sorted positions need nothing) and the positions
    in that order."""
    kpos_p = kpos[index.perm_]
    cid = np.repeat(np.arange(index.n_clusters_), np.diff(index.cluster_ptr_))
    same = cid[1:] == cid[:-1]
    if np.all(kpos_p[1:][same] >= kpos_p[:-1][same]):
        return None, kpos_p
    order = np.lexsort((kpos_p, cid))
    return order, kpos_p[order]


class RoutePlanner:
    """Key-side state of the estimate / budget path and the per-row-chunk planning: routing scores, log
    masses, the route (top ``n_probe`` by ``q . c``, or :func:`~sparseattn.kernels.estimate.mass_route`)
    and the estimated clusters.  Used by :func:`mass_routes` and by the estimate / budget path of
    :func:`~sparseattn.attention.routed.routed_attention`."""

    def __init__(self, index: ClusterIndex, dtype: np.dtype, sc: float, is_causal: bool, kpos: np.ndarray,
                 n_est: int, top_p: float | None, min_keys: int, max_keys: int) -> None:
        S, E = index.keys_.shape
        C = self.C = index.n_clusters_
        self.index, self.sc, self.is_causal = index, sc, is_causal
        self.top_p, self.min_keys, self.max_keys = top_p, min_keys, max_keys
        self.all_rest = n_est < 0
        self.N = 0 if self.all_rest else min(n_est, C)
        self.Kp = index.keys_as(dtype)
        self.kptr = index.cluster_ptr_
        self.logn, self.mu, self.sig2 = index.key_stats()
        self.sig2_32 = self.sig2.astype(np.float32)
        # caps of the second-order term (kernels.estimate.second_order): log n_c (0 when empty) and the
        # largest distance of a member key to the cluster mean (radius around the routing vector plus the
        # vector's distance to the mean)
        self.ell = np.where(np.isfinite(self.logn), self.logn, 0.0)
        self.rmu = index.radius_ + np.linalg.norm(self.mu - index.centroids_.astype(np.float64), axis=1)
        self.rmu[index.count_ == 0] = 0.0
        self.ell32, self.rmu32 = self.ell.astype(np.float32), self.rmu.astype(np.float32)
        self.count = index.count_
        self.cent = index.centroids_.astype(dtype, copy=False)
        self.mu_d = None if index.route_by == "mean" else self.mu.astype(dtype)  # "mean": centroids_ = means
        self.spread = 0.0 if is_causal else 1.0
        self.no_pos = np.zeros(1, dtype=np.int64)
        if is_causal:
            order, self.kpos_cs = positions_in_clusters(index, kpos)
            self.order = np.arange(S, dtype=np.int64) if order is None else order.astype(np.int64)
            self.Gk = ek.cluster_prefix(self.Kp, self.kptr, self.order)
            sq = np.einsum("ij,ij->i", self.Kp, self.Kp, dtype=np.float64)[:, None]
            self.Gk2 = ek.cluster_prefix(sq, self.kptr, self.order)[:, 0].copy()
            self.kmin = key_spans(index, kpos)[1]
        self.p = index.n_probe_
        # Non-causal top_p: log masses with the low-rank-plus-isotropic covariance of each cluster
        # (log_mass_rows_cov), its factors multiplied in the same GEMM as the routing vectors (and the
        # means when routing by centroid): one (rows x C (2 + r)) product per row chunk.
        self.cov = top_p is not None and not is_causal
        self.fused = top_p is None and not is_causal and self.all_rest  # estimate_weights_stats
        if self.cov:
            W, self.rho = index.key_cov_factors(COV_RANK)
            parts = [index.centroids_] + ([] if self.mu_d is None else [self.mu]) + [W]
            self.G = np.ascontiguousarray(np.concatenate(parts).astype(dtype))
        if self.fused:
            self.logn32 = self.logn.astype(np.float32)
        if top_p is None:
            self.P = self.p
            self.n_cand = min(C, self.p + self.N)
        elif is_causal:
            # a cluster's visible size depends on the row: every cluster is a candidate (full sort per row)
            self.P = self.n_cand = C
        else:
            # enough candidates to reach max_keys even through the smallest clusters
            sizes_sorted = np.sort(self.count)
            self.P = int(min(C, np.searchsorted(np.cumsum(sizes_sorted), max_keys, side="right") + 1))
            self.n_cand = min(C, self.P + self.N)

    def plan(self, qc: np.ndarray, qpc: np.ndarray, route: np.ndarray, rscore: np.ndarray, est: np.ndarray,
             kr: np.ndarray, q_norm: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray | None, int, np.ndarray | None, np.ndarray | None]:
        """Plan rows qc (R, E) at positions qpc: fills route (R, P) int32 (padding: C), rscore (R, P) their
        ``q . c``, est (R, N) and kr (R,) keys read (q_norm: the rows' norms (R,) float64 when known);
        returns (routing scores (R, C), log masses (R, C)
        float32 (not computed: causal without top_p; None: ``fused``), most clusters a row routed,
        for ``fused`` q.mu_c (R, C) (the input of :func:`~sparseattn.kernels.estimate.estimate_weights_stats`)
        else None, and ``scale^2 |q|^2 / 2`` (R,) float64 (None when causal))."""
        C, sc, is_causal, top_p = self.C, self.sc, self.is_causal, self.top_p
        R = qc.shape[0]
        qmu = q2 = A = None
        if self.cov:
            X = qc @ self.G.T
            sc_c = np.ascontiguousarray(X[:, :C])
            off = C if self.mu_d is None else 2 * C
            qmu = sc_c if self.mu_d is None else X[:, C:off]
        else:
            sc_c = qc @ self.cent.T
        if not is_causal:
            if qmu is None:
                qmu = sc_c if self.mu_d is None else qc @ self.mu_d.T
            qq = np.einsum("ij,ij->i", qc, qc, dtype=np.float64) if q_norm is None else q_norm * q_norm
            q2 = 0.5 * sc * sc * qq
        if not self.fused:
            A = np.empty((R, C), dtype=np.float32)  # log masses: an estimate, float32 is ample
        nvis = None
        if is_causal and top_p is not None:
            nvis = np.empty((R, C), dtype=np.int64)
            ek.log_mass_causal(qc, qpc, self.kptr, self.kpos_cs, self.Gk, self.Gk2, sc, self.spread, A, nvis)
        elif self.cov:
            ek.log_mass_rows_cov(qmu, X[:, off:], q2, self.logn, self.rho, self.rmu, sc, A)
        elif not is_causal and not self.fused:
            ek.log_mass_rows(qmu, q2, self.logn, self.sig2, self.rmu, sc, self.spread, A)
        if top_p is None:
            # causal: a cluster whose every key is after the row ranks last, as in the plain path; not
            # causal: one holding no key
            ids, scs = ck.row_top_p_serial(sc_c, self.n_cand, *((self.kmin, np.ascontiguousarray(qpc, np.int64))
                                                                if is_causal else ck.empty_last(self.kptr, R)))
            p = self.p
            route[:] = ids[:, :p]
            rscore[:] = scs[:, :p]
            est[:, :ids.shape[1] - p] = ids[:, p:]  # fewer than N clusters left after the routed: -1 padded
            ek.routed_visible(route, qpc, self.kptr, self.kpos_cs if is_causal else self.no_pos, is_causal, kr)
            if self.fused:
                return sc_c, None, p, qmu, q2
            return sc_c, A, p, None, q2
        if is_causal:
            cand = np.empty((R, C), dtype=np.int32)
            ek.rows_sorted_desc(A, cand)
        else:
            cand = ck.row_top_p_serial(A, self.n_cand, ck.NO_POS, ck.NO_POS)[0]
        sizes = nvis if is_causal else np.broadcast_to(self.count, (R, C))
        n_route = np.empty(R, dtype=np.int64)
        ek.mass_route(A, cand, sizes, top_p, REST_MARGIN, self.min_keys, self.max_keys, self.N, C, route, n_route,
                      kr, est)
        if self.cov:  # routed by the second-order masses; estimated with the term capped (ek.EST_CAP)
            first = self.logn + sc * qmu.astype(np.float64)
            np.minimum(A, first + ek.EST_CAP, out=A, casting="same_kind")
        live = route < C
        rscore[:] = np.where(live, np.take_along_axis(sc_c, np.where(live, route, 0), 1), 0)
        return sc_c, A, int(n_route.max()) if R else 0, None, q2


def mass_routes(index: ClusterIndex, queries: np.ndarray, *, top_p: float, min_keys: int = 0,
                max_keys: int | None = None, scale: float | None = None, is_causal: bool = False,
                query_positions: object = None, key_positions: object = None, n_threads: int | None = None,
                check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The clusters the mass-driven budget (``top_p`` of
    :func:`~sparseattn.attention.routed.routed_attention`) routes each query to.

    Parameters are those of :func:`~sparseattn.attention.routed.routed_attention`.  Returns ``route`` (L, P) int32, clusters in order
    of estimated mass, ``-1`` padded (P: the most any query routed, at least 1), and ``keys_read`` (L,)
    int64.  (``exact_prefix`` rows are not special-cased here: these are the routed clusters.)
    """
    q = index.validated_queries(queries, check_finite)
    budget = check_budget(index.prefix_budget(), 0, top_p, min_keys, max_keys)
    if budget is None:
        raise ValueError("top_p must be given (a float in (0, 1]) to compute mass routes.")
    sc = check_scale(scale, q.shape[1])
    L = q.shape[0]
    qpos = positions(query_positions, L, "query_positions")
    kpos = positions(key_positions, index.keys_.shape[0], "key_positions")
    n = index.threads_ if n_threads is None else int(n_threads)
    is_causal = check_bool(is_causal, "is_causal")
    with worker_threads(n):
        plan = RoutePlanner(index, q.dtype, sc, is_causal, kpos, 0, *budget[1:])
        route = np.empty((L, plan.P), dtype=np.int32)
        keys = np.zeros(L, dtype=np.int64)
        used = np.zeros(L, dtype=np.int64)

        def work(a: int, b: int) -> None:
            used[a] = plan.plan(q[a:b], qpos[a:b], route[a:b], np.zeros((b - a, plan.P), dtype=q.dtype),
                                np.zeros((b - a, 0), dtype=np.int32), keys[a:b])[2]

        index.row_chunks(L, work, n)
    route = route[:, :max(1, int(used.max()) if L else 1)]
    return np.where(route < plan.C, route, -1).astype(np.int32), keys
