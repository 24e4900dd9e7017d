"""ClusterIndex: spherical k-means over the centred keys, cluster order, routing and routed exact top-k.

Build: the keys are centred (subtracting the mean key changes no softmax), a k-means with ``n_clusters``
centroids is trained on a sample of them (k-means++ starts and Lloyd rounds,
:func:`sparseattn.index.kmeans.lloyd`: spherical, i.e. cosine assignment and unit-norm centroids, by
default; Euclidean with ``spherical=False``), then every key is assigned to a centroid: ``assign="ip"``
(default) picks the centroid of largest inner product ``k.c`` (the score that routes queries), ``"l2"``
the nearest one.  Measured at S = 16,384 (E = 64, C = 128, n_probe = 8): on
clustered keys "ip" kept 0.998 of the softmax mass (output error 0.019) against 0.90 (0.35) for "l2"; on
Gaussian keys neither works (0.42 / 0.09 of the mass).  Optionally (``split > 0``) clusters larger than
``split`` times the mean size are split by a k-means of their members.  The keys are then stored once in
cluster order, so each cluster is one contiguous block (a CSR over clusters: ``perm_``, ``cluster_ptr_``).

Each cluster is represented by the mean of its keys (``route_by="mean"``, the default: unit-norm
spherical centroids ignore how large a cluster's keys are, which the inner product rewards) or by its
k-means centroid; ``radius_`` is the members' largest distance to that vector.

Query side: :meth:`ClusterIndex.route` ranks the clusters by ``q.c`` (the mean key adds a per-query
constant, so centred vectors rank the same) and keeps the ``n_probe`` best; :meth:`ClusterIndex.search`
is the exact top-k by inner product among the keys of those clusters.  The index knows nothing about
values: attention over the routed clusters is :func:`sparseattn.attention.routed.routed_attention`.

Seam for a growing index (KV-cache decode, not implemented): routed attention reads the index only
through ``route_rows``, ``keys_as``, ``prefix_budget`` / ``prefix_rows``, ``keys_``, ``mean_``, ``perm_``,
``cluster_ptr_``, ``radius_``, ``n_clusters_``, ``n_probe_``, ``threads_`` and ``is_built`` (and, for
``estimate`` / ``top_p``, ``key_stats``, ``count_``, ``key_sum_``, ``route_by``, ``centroids_``).  The
estimation statistics are additive sums, updated in O(new keys) by :meth:`ClusterIndex.update_stats`. The strictly causal form is
:class:`~sparseattn.index.causal.CausalClusterIndex` (nested prefix indexes, each with a codebook of keys its
queries see).

Estimation statistics: ``count_``, ``key_sum_`` and ``key_sqsum_`` give each cluster's mean key and
mean per-dimension variance (:meth:`ClusterIndex.key_stats`), from which routed attention estimates the
softmax mass of clusters it does not read (``estimate`` / ``top_p`` of
:func:`~sparseattn.attention.routed.routed_attention`).  They are sums, so keys added later update them
in O(new keys) with :meth:`ClusterIndex.update_stats` (the key store itself has no add path).  Value
statistics are not kept here (the index knows no values): routed attention sums the values per cluster
at each call.

Threads: the scoring products run on ``n_threads`` workers of :func:`sparseattn.threads.executor`, BLAS
pinned to one thread each (:func:`sparseattn.threads.worker_threads`); so do the k-means rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ..inputs import as_float_array, positions
from ..kernels import cluster as ck
from ..kernels import estimate as ek
from ..kernels import topk as topk_core
from ..pattern import SparsePattern
from ..threads import run_jobs, worker_threads
from .kmeans import BLOCK_BUDGET as _BLOCK_BUDGET
from .kmeans import SEED_MAX, assign_keys, cov_factors, row_chunks, split_every, split_large, train_kmeans

__all__ = ["ClusterIndex", "check_built", "checked_keys", "key_mean", "rows_seeing_at_most"]

ASSIGN = ("ip", "l2")
ROUTE_BY = ("mean", "centroid")
# Elements of one score tile ``Q_c K_c^T`` (rows of a large cluster are processed in tiles), and the
# fewest query rows per tile (large clusters would otherwise give skinny, slow products).
_TILE = 1 << 18
_MIN_ROWS = 64


def cluster_jobs(qptr: np.ndarray, kptr: np.ndarray) -> list[int]:
    """Clusters with work (queries x keys > 0), largest cost first.

    qptr (C + 1,) int64: sorted (query, cluster) pairs per cluster; kptr (C + 1,) int64: keys per cluster.
    """
    cost = np.diff(qptr) * np.diff(kptr)
    order = np.argsort(-cost, kind="stable")
    return [int(c) for c in order if cost[c] > 0]


def check_params(n_clusters: int | None, n_probe: int | None, train_sample: int | None, assign: str,
                 route_by: str, spread: float = 0.0, coarse: int | None = None, split: float = 0.0,
                 seed: int = 0) -> None:
    """Raise ValueError naming the parameter when :class:`ClusterIndex`'s options contradict each other."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"cluster: seed must be an int in [0, {SEED_MAX}]; got {seed!r} ({type(seed).__name__}).")
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(f"cluster: seed must be an int in [0, {SEED_MAX}] (a 31-bit k-means "
                         f"seed); got {seed!r}.")
    if coarse is not None:
        if isinstance(coarse, bool) or not isinstance(coarse, (int, np.integer)) or coarse < 1:
            raise ValueError(f"cluster: coarse must be an int >= 1 (the first k-means' clusters) or None (one "
                             f"k-means); got {coarse!r}.")
        if n_clusters is not None and coarse > n_clusters:
            raise ValueError(f"cluster: coarse must be <= n_clusters (each coarse cluster is split into parts "
                             f"of about S / n_clusters keys); got coarse={coarse} > n_clusters={n_clusters}.")
        if split:
            raise ValueError(f"cluster: coarse={coarse} already splits every cluster; pass split=0 with it (or "
                             f"coarse=None).")
        if train_sample is not None and train_sample < coarse:
            raise ValueError(f"cluster: train_sample must be >= coarse; got train_sample={train_sample} < "
                             f"coarse={coarse}. k-means needs at least one training key per centroid.")
    if isinstance(spread, bool) or not isinstance(spread, (int, float, np.integer, np.floating)) \
            or not np.isfinite(spread) or spread < 0:
        raise ValueError(f"cluster: spread must be a finite number >= 0 (0 = route by q . c alone); got "
                         f"{spread!r}.")
    if n_clusters is not None and n_probe is not None and n_probe > n_clusters:
        raise ValueError(f"cluster: n_probe must be <= n_clusters; got n_probe={n_probe} > "
                         f"n_clusters={n_clusters}. Routing a query to every cluster is n_probe = "
                         f"n_clusters (exact attention).")
    if n_clusters is not None and train_sample is not None and train_sample < n_clusters:
        raise ValueError(f"cluster: train_sample must be >= n_clusters; got train_sample={train_sample} "
                         f"< n_clusters={n_clusters}. k-means needs at least one training key per "
                         f"centroid.")
    if assign not in ASSIGN:
        raise ValueError(f"cluster: assign must be one of {ASSIGN}; got {assign!r}.")
    if route_by not in ROUTE_BY:
        raise ValueError(f"cluster: route_by must be one of {ROUTE_BY}; got {route_by!r}.")


def checked_update(keys: np.ndarray, assignment: np.ndarray, E: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys (m, E) float64, assignment (m,) int in [0, C)) checked for :meth:`ClusterIndex.update_stats`."""
    k = np.asarray(keys, dtype=np.float64)
    a = np.asarray(assignment)
    if k.ndim != 2 or k.shape[1] != E:
        raise ValueError(f"keys must have shape (m, E={E}); got {k.shape}.")
    if a.shape != (k.shape[0],) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"assignment must be an int array of shape ({k.shape[0]},), one cluster per key; "
                         f"got {a.dtype} {a.shape}.")
    if a.size and (a.min() < 0 or a.max() >= C):
        raise ValueError(f"assignment values must lie in [0, {C}) (n_clusters_); got range "
                         f"[{a.min()}, {a.max()}].")
    return k, a


# Centring is skipped when the mean key's norm exceeds this many times the median key norm (see key_mean).
CENTRE_LIMIT = 16.0


def key_mean(keys: np.ndarray) -> np.ndarray:
    """The mean of ``keys`` (S, E) float32 or float64 (summed in float64), in their dtype: the vector the
    index subtracts before clustering and scoring; zeros when a few keys dominate it (its norm above
    ``CENTRE_LIMIT`` times the median key norm, taken over up to 4,096 evenly spaced keys; also when more
    than half the keys are near zero and the rest share an offset, which costs clustering quality, not
    exactness).  Why: the kernels score ``q . (k - mean)`` in the keys' dtype and add ``q . mean`` back; a
    mean far longer than the typical key (one key of 1e10 among unit keys) would leave the centred keys
    with none of the typical keys' low-order bits (measured: relative error 0.096 against float64 dense
    attention with every cluster read, 4.5e-8 uncentred).  A mean up to 16 times the median norm costs at most 4 of float32's 24
    bits; ordinary keys, even with a large common offset, stay far below it (the mean of the keys is no
    longer than their average norm)."""
    S, E = keys.shape
    mean = keys.mean(axis=0, dtype=np.float64)
    if S == 0 or not mean.any():
        return mean.astype(keys.dtype)
    sample = keys[::max(1, S // 4096)].astype(np.float64)
    big = float(np.abs(sample).max())
    med = float(np.median(np.sqrt(np.einsum("ij,ij->i", sample / big, sample / big)))) * big if big > 0 else 0.0
    top = float(np.abs(mean).max())
    norm = float(np.sqrt(np.sum((mean / top) ** 2))) * top
    if not norm <= CENTRE_LIMIT * med:
        return np.zeros(E, dtype=keys.dtype)
    return mean.astype(keys.dtype)


class ClusterIndex:
    """K-means cluster index over keys: build, assignment, cluster order, routing, routed exact top-k.

    sklearn style: ``__init__`` only stores (and checks) the parameters, :meth:`build` does the work and
    sets the attributes ending in ``_``.

    Parameters
    ----------
    n_clusters : int, optional
        Number of k-means clusters C (default ``round(sqrt(S))`` clipped to [1, S]).
    n_probe : int, optional
        Clusters each query is routed to (default ``min(8, C)``); at most ``n_clusters``.
    train_sample : int, optional
        Keys sampled for k-means training (default ``min(S, 64 * C)``); at least ``n_clusters``.
    n_iter : int, default 5
        K-means iterations.
    seed : int, default 0
        Seed of the training sample and of the k-means initialisation.
    center : bool, default True
        Subtract the mean key before clustering and scoring (unless a few keys dominate the mean: see
        :func:`key_mean`).
    spherical : bool, default True
        Spherical k-means (unit-norm centroids, cosine assignment during training).
    assign : {"ip", "l2"}, default "ip"
        Key -> cluster rule after training: largest inner product or nearest centroid.
    route_by : {"mean", "centroid"}, default "mean"
        The vector each cluster is routed (and bounded) by: the mean of its keys or the k-means centroid.
    split : float, default 0 (off)
        When > 0, every cluster holding more than ``split * S / n_clusters`` keys is split by a k-means
        of its members into ``ceil(size / (S / n_clusters))`` parts (members go to their nearest part);
        ``n_clusters_`` then exceeds ``n_clusters``.
    spread : float, default 0 (off)
        Routing (the ``n_probe`` clusters of each query) ranks clusters by ``q . c + spread |q| sigma_c``
        instead of ``q . c``, with ``sigma_c`` the root mean per-dimension variance of the cluster's keys
        (``key_stats``): a cluster whose keys spread widely can hold a key far along q although its mean
        scores low.  The scores :meth:`route` returns stay ``q . c``.  Measured
        (``benchmarks/results/block-routing-study.md``, ``spread=1.5``): keys per query for recall@64 0.9
        3-22 % fewer on real MiniLM keys (most on the flattest heads) and 17 % fewer on clustered keys at
        4 sqrt(S) clusters; at sqrt(S) clusters up to 13 % fewer (up to 1 % more on the most peaked
        heads).  (Routed attention refuses it with ``estimate`` / ``top_p``, which rank clusters by
        estimated mass.)
    coarse : int, optional
        Two-level build: a k-means of ``coarse`` clusters (trained on ``min(S, 64 * coarse)`` keys unless
        ``train_sample``), every key assigned to one, then every cluster split by a Lloyd k-means of its
        members (``n_iter`` rounds, started from members evenly spaced in key order) into
        ``ceil(size / (S / n_clusters))`` parts, each key going to its nearest part; parts left empty are
        dropped, so ``n_clusters_`` is about ``n_clusters`` (at least, unless parts emptied).  Finer
        clusters than one k-means of ``coarse`` at a small extra cost: at S = 65,536 (real MiniLM keys,
        E = 32) ``n_clusters=1024, coarse=256`` builds in 71-95 ms against 500-530 ms for one k-means of
        1,024, and needs as few keys per query for recall@64 0.9 on two of three workloads (1,595 against
        1,699; 236 against 288) and 20 % more on the third (``docs/cluster-routing.md``).  Default None
        (one k-means of ``n_clusters``).  Not with ``split``; strictly causal indexes do not use it.
    n_threads : int, optional
        Worker threads (default: Numba's current thread count).

    Attributes
    ----------
    keys_ : (S, E) float32 or float64
        The keys given to :meth:`build` (original order, not centred; not copied).
    n_clusters_, n_probe_ : int
        The sizes in force after splitting.
    mean_ : (E,) array in the keys' dtype
        The mean key (zeros when ``center=False``, or when a few keys dominate it: see :func:`key_mean`).
    centroids_ : (C, E) array in the keys' dtype
        The routing vectors in centred coordinates: member means (``route_by="mean"``; the k-means
        centroid for a cluster without keys) or the k-means centroids.
    kmeans_centroids_ : (C, E)
        The centroids that assigned the keys.
    coarse_centroids_ : (C0, E)
        The first k-means' centroids (before splitting; ``coarse`` of them with ``coarse``).
    parent_ : (C,) int64
        Coarse cluster each final cluster came from (itself when not split).
    assignment_ : (S,) int32
        Cluster of each key.
    perm_ : (S,) int64
        Key ids in cluster order: cluster c is ``perm_[cluster_ptr_[c]:cluster_ptr_[c+1]]`` (ascending
        inside a cluster).
    cluster_ptr_ : (C + 1,) int64
    keys_perm_ : (S, E)
        Centred keys in cluster order.
    radius_ : (C,) float64
        Largest distance of a member key to its routing vector (for score bounds).
    count_ : (C,) int64
        Keys per cluster (the statistics below are additive sums: see :meth:`update_stats`).
    key_sum_ : (C, E) float64
        Sum of each cluster's centred keys.
    key_sqsum_ : (C,) float64
        Sum of each cluster's squared centred key norms.

    Estimation statistics (``count_``, ``key_sum_``, ``key_sqsum_``): see the module docstring.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((512, 16)).astype(np.float32)
    >>> index = ClusterIndex(n_clusters=8, n_probe=2).build(keys)
    >>> ids, scores = index.route(keys[:3])
    >>> ids.shape, ids.dtype, index.search(keys[:3], 5).nnz_per_row.tolist()
    ((3, 2), dtype('int32'), [5, 5, 5])
    """

    def __init__(self, *, n_clusters: int | None = None, n_probe: int | None = None,
                 train_sample: int | None = None, n_iter: int = 5, seed: int = 0, center: bool = True,
                 spherical: bool = True, assign: str = "ip", route_by: str = "mean", split: float = 0.0,
                 spread: float = 0.0, coarse: int | None = None, n_threads: int | None = None) -> None:
        check_params(n_clusters, n_probe, train_sample, assign, route_by, spread, coarse, split, seed)
        self.n_clusters = n_clusters
        self.n_probe = n_probe
        self.train_sample = train_sample
        self.n_iter = n_iter
        self.seed = seed
        self.center = center
        self.spherical = spherical
        self.assign = assign
        self.route_by = route_by
        self.split = split
        self.spread = spread
        self.coarse = coarse
        self.n_threads = n_threads
        self.keys_: np.ndarray | None = None

    def get_params(self) -> dict[str, Any]:
        """name -> value of every constructor parameter (``ClusterIndex(**index.get_params())`` is equal)."""
        return {name: getattr(self, name) for name in (
            "n_clusters", "n_probe", "train_sample", "n_iter", "seed", "center", "spherical", "assign",
            "route_by", "split", "spread", "coarse", "n_threads")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    @property
    def threads_(self) -> int:
        """Worker threads in use: ``n_threads``, or Numba's current thread count when None."""
        return int(self.n_threads) if self.n_threads is not None else int(numba.get_num_threads())

    is_built = property(lambda self: self.keys_ is not None, doc="Whether :meth:`build` has run.")

    def _check_built(self) -> None:
        check_built(self)

    # ------------------------------------------------------------------------------------------ build
    def sizes(self, n_keys: int) -> tuple[int, int, int]:
        """(clusters C, probes p, training keys) for ``n_keys`` keys, defaults resolved and checked."""
        S = n_keys
        C = self.n_clusters
        if C is None:
            C = int(min(max(round(float(np.sqrt(S))), 1), S))
        elif C > S:
            raise ValueError(f"cluster: n_clusters={C} exceeds the S={S} keys; pass n_clusters <= {S} (default "
                             f"round(sqrt(S))).")
        p = self.n_probe
        if p is None:
            p = min(8, C)
        elif p > C:
            raise ValueError(f"cluster: n_probe={p} exceeds the {C} clusters chosen for S={S} keys; pass "
                             f"n_probe <= {C} or set n_clusters explicitly.")
        t = self.train_sample
        if t is None:
            t = min(S, 64 * C)
        elif t < C:
            raise ValueError(f"cluster: train_sample={t} < n_clusters={C}; k-means needs at least one "
                             f"training key per centroid.")
        return C, p, min(t, S)

    def build(self, keys: np.ndarray) -> ClusterIndex:
        """Cluster the keys and store them in cluster order; returns ``self``.

        Parameters
        ----------
        keys : (S, E) float32 or float64 array, S >= 1 (C-contiguous; not copied, kept as ``keys_``)
        """
        keys = checked_keys(keys, finite=True)
        S, E = keys.shape
        C, p, n_train = self.sizes(S)
        self.n_clusters_, self.n_probe_ = C, p
        self.mean_ = key_mean(keys) if self.center else np.zeros(E, dtype=keys.dtype)
        centred = keys - self.mean_ if self.mean_.any() else keys
        n = self.threads_
        if self.coarse is not None:  # two levels: k-means of `coarse` clusters, each split into parts
            C0 = int(self.coarse)
            if C0 > C:
                raise ValueError(f"cluster: coarse={C0} exceeds the n_clusters={C} in force for S={S} keys; pass "
                                 f"coarse <= {C} or a larger n_clusters.")
            n_train0 = min(S, 64 * C0 if self.train_sample is None else self.train_sample)
            self.coarse_centroids_ = self._kmeans(centred, C0, n_train0).astype(keys.dtype)
            with worker_threads(n):
                assignment, self.centroids_, self.parent_ = split_every(
                    centred, assign_keys(centred, self.coarse_centroids_, self.assign, n), C0, S / C, self.n_iter)
                P = self.centroids_.shape[0]  # >= C unless Lloyd left parts empty (duplicate keys)
                self.n_clusters_, self.n_probe_ = P, (P if p == C else min(p, P))
                self.kmeans_centroids_ = self.centroids_
                self._store(keys, centred, assignment, self.centroids_, self.route_by == "mean")
            return self
        self.centroids_ = self._kmeans(centred, C, n_train).astype(keys.dtype)
        with worker_threads(n):
            assignment = assign_keys(centred, self.centroids_, self.assign, n)
            self.coarse_centroids_ = self.centroids_
            self.parent_ = np.arange(C, dtype=np.int64)
            if self.split > 0:
                assignment, self.centroids_, self.parent_ = split_large(
                    centred, assignment, self.centroids_, self.split * S / C, S / C, self._kmeans)
                # n_probe = n_clusters keeps its meaning (every cluster: exact attention).
                self.n_probe_ = self.centroids_.shape[0] if p == C else p
                self.n_clusters_ = C = self.centroids_.shape[0]
            self.kmeans_centroids_ = self.centroids_
            self._store(keys, centred, assignment, self.centroids_, self.route_by == "mean")
        return self

    def _store(self, keys: np.ndarray, stored: np.ndarray, assignment: np.ndarray, vectors: np.ndarray,
               by_mean: bool) -> None:
        """Keep ``keys`` (S, E) as given and ``stored`` (S, E) (the keys as scored: centred, or raw) in the
        cluster order of ``assignment`` (S,) int32, with routing vectors (member means when ``by_mean``,
        else ``vectors`` (C, E)), radii and estimation statistics.  Call inside ``worker_threads``."""
        self.assignment_ = assignment
        self.perm_, self.cluster_ptr_, kp, self.centroids_, self.radius_ = cluster_order(
            stored, assignment, vectors, by_mean)
        self._init_stats(kp)
        self.keys_perm_ = kp
        self._keys_cast: dict[np.dtype, np.ndarray] = {kp.dtype: kp}
        self.keys_ = keys

    def labels(self, keys: np.ndarray) -> np.ndarray:
        """Cluster of each key from the k-means alone, without building the index (no reordered keys,
        routing vectors or statistics): the ``assignment_`` that ``build(keys)`` would give.

        Parameters
        ----------
        keys : (S, E) float32 or float64 array, S >= 1

        Returns
        -------
        (S,) int64 in ``[0, C)``
        """
        if self.split > 0:
            raise ValueError("labels() is the k-means assignment only; with split > 0 use build(keys).assignment_.")
        keys = checked_keys(keys, finite=True)
        S = keys.shape[0]
        C, _, n_train = self.sizes(S)
        centred = np.ascontiguousarray(keys - key_mean(keys) if self.center else keys)
        self.centroids_ = self._kmeans(centred, C, n_train).astype(keys.dtype)
        with worker_threads(self.threads_):
            return assign_keys(centred, self.centroids_, self.assign, self.threads_).astype(np.int64)

    def _kmeans(self, centred: np.ndarray, C: int, n_train: int, seed_offset: int = 0) -> np.ndarray:
        """(C, E) centroids of a k-means over ``n_train`` sampled rows of ``centred`` (:func:`train_kmeans`)."""
        # the offsets of split clusters' k-means wrap around within 31-bit seeds
        return train_kmeans(centred, C, n_train, seed=(self.seed + seed_offset) % (SEED_MAX + 1),
                            n_iter=self.n_iter, spherical=self.spherical, n_threads=self.threads_)

    def row_chunks(self, n_rows: int, work: Callable[[int, int], None], n_threads: int) -> None:
        """``work(a, b)`` over row chunks of about 2**24 (rows x clusters) score elements, on the workers
        (:func:`sparseattn.index.kmeans.row_chunks`)."""
        row_chunks(n_rows, self.centroids_.shape[0], work, n_threads)

    # ------------------------------------------------------------------------------------ statistics
    def _init_stats(self, kp: np.ndarray) -> None:
        """count_, key_sum_, key_sqsum_ from the centred keys in cluster order kp (S, E)."""
        kptr = self.cluster_ptr_
        self.count_ = np.diff(kptr).astype(np.int64)
        self.key_sum_ = ek.cluster_sums(kp, kptr)
        sq = np.einsum("ij,ij->i", kp, kp, dtype=np.float64)[:, None]
        self.key_sqsum_ = ek.cluster_sums(sq, kptr)[:, 0]
        self._key_stats: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def update_stats(self, keys: np.ndarray, assignment: np.ndarray) -> None:
        """Add keys to the estimation statistics (``count_``, ``key_sum_``, ``key_sqsum_``), O(len(keys)).

        keys (m, E) float, raw (not centred: ``mean_`` is subtracted here); assignment (m,) int cluster
        of each key in [0, n_clusters_).  Only the statistics change (the key store, routing vectors and
        radii do not): this is the update a growing index would make for keys appended to a cluster.
        """
        self._check_built()
        C = self.n_clusters_
        k, a = checked_update(keys, assignment, self.keys_.shape[1], C)
        kc = k - self.mean_.astype(np.float64)
        self.count_ += np.bincount(a, minlength=C).astype(np.int64)
        np.add.at(self.key_sum_, a, kc)
        self.key_sqsum_ += np.bincount(a, weights=np.einsum("ij,ij->i", kc, kc), minlength=C)
        self._key_stats = None

    def key_stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(log count (C,), mean key (C, E), mean per-dimension variance (C,)), float64, centred coordinates.

        Empty clusters: log count ``-inf``, mean and variance 0.  Computed once and cached until
        :meth:`update_stats` (read-only arrays).
        """
        self._check_built()
        if getattr(self, "_key_stats", None) is not None:
            return self._key_stats  # type: ignore[return-value]
        n = self.count_.astype(np.float64)
        safe = np.maximum(n, 1.0)
        mu = self.key_sum_ / safe[:, None]
        var = np.maximum(self.key_sqsum_ / safe - np.einsum("ij,ij->i", mu, mu), 0.0) / self.key_sum_.shape[1]
        logn = np.where(n > 0, np.log(safe), -np.inf)
        for a in (logn, mu, var):
            a.flags.writeable = False
        self._key_stats = (logn, mu, var)
        return self._key_stats

    def key_cov_factors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(W (C * r, E) float64, rho (C,) float64): low-rank-plus-isotropic factors of each cluster's key
        covariance, r = min(rank, E), for the mass-driven budget (:func:`sparseattn.index.kmeans.cov_factors`
        over ``keys_perm_``).  Computed once per rank and cached (read-only; ``update_stats`` does not change
        it: it reads the stored keys, not the additive sums)."""
        self._check_built()
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank must be an int >= 1; got {rank!r}.")
        cache = self.__dict__.setdefault("_cov_factors", {})
        r = int(min(rank, self.keys_perm_.shape[1]))
        if r not in cache:
            W, rho = cov_factors(self.keys_perm_, self.cluster_ptr_, r)
            for arr in (W, rho):
                arr.flags.writeable = False
            cache[r] = (W, rho)
        return cache[r]

    # ---------------------------------------------------------------------------------------- helpers
    def keys_as(self, dtype: np.dtype) -> np.ndarray:
        """The centred keys in cluster order, (S, E) in ``dtype`` (cast once, then cached)."""
        dtype = np.dtype(dtype)
        kp = self._keys_cast.get(dtype)
        if kp is None:
            kp = self._keys_cast[dtype] = self.keys_perm_.astype(dtype)
        return kp

    def prefix_budget(self) -> int:
        """Visible keys up to which a causal query is served exactly instead of routed:
        ``ceil(n_probe_ * S / n_clusters_)``, the routed keys of an average query."""
        self._check_built()
        return int(np.ceil(self.n_probe_ * self.keys_.shape[0] / self.n_clusters_))

    def prefix_rows(self, qpos: np.ndarray, kpos: np.ndarray, kpos_ascending: np.ndarray | None = None
                    ) -> np.ndarray:
        """Rows that see between 1 and :meth:`prefix_budget` keys: (n,) int64, ascending.

        qpos (L,) / kpos (S,) int64 positions; ``kpos_ascending``: ``np.sort(kpos)`` when already known.
        """
        return rows_seeing_at_most(self.prefix_budget(), qpos, kpos, kpos_ascending)

    def validated_queries(self, queries: np.ndarray, check_finite: bool, dtype: np.dtype | None = None
                          ) -> np.ndarray:
        """``queries`` checked against the built keys ((L, E), finite when ``check_finite``) as a
        C-contiguous array of ``dtype`` (default the keys' dtype): the input of :meth:`route_rows`."""
        self._check_built()
        q = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
        if q.ndim != 2:
            raise ValueError(f"queries must be 2-D (L, E); got shape {q.shape}.")
        if q.shape[1] != self.keys_.shape[1]:
            raise ValueError(f"queries have E={q.shape[1]} features but the keys have {self.keys_.shape[1]}.")
        return np.ascontiguousarray(q, dtype=self.keys_.dtype if dtype is None else dtype)

    # ---------------------------------------------------------------------------------------- routing
    def route_rows(self, q: np.ndarray, n_threads: int, kmin: np.ndarray = ck.NO_POS, qpos: np.ndarray = ck.NO_POS
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(ids (L, p) int32 best first, scores q.c (L, p) in q's dtype); q (L, E) float32/float64
        C-contiguous, validated.  Causal routing with each cluster's first key position ``kmin`` (C,) and
        ``qpos`` (L,) int64 (:func:`key_spans`): clusters of later keys only rank last.  Clusters holding no
        key rank last either way.  Call inside :func:`~sparseattn.threads.worker_threads`."""
        L, p = q.shape[0], self.n_probe_
        if not kmin.size:
            kmin, qpos = ck.empty_last(self.cluster_ptr_, L)
        route, scores = np.empty((L, p), dtype=np.int32), np.empty((L, p), dtype=q.dtype)
        cent = self.centroids_.astype(q.dtype, copy=False)
        width = self.spread_widths()

        def work(a: int, b: int) -> None:
            s = q[a:b] @ cent.T
            qp = qpos[a:b] if kmin.size else qpos
            if width is None:
                route[a:b], scores[a:b] = ck.row_top_p_serial(s, p, kmin, qp)
                return
            big = np.abs(q[a:b]).max(axis=1).astype(np.float64)  # |q| without overflow at any magnitude
            safe = np.where(big > 0, big, 1.0)
            qn = big * np.sqrt(np.einsum("ij,ij->i", q[a:b] / safe[:, None], q[a:b] / safe[:, None],
                                         dtype=np.float64))
            rank = np.empty(s.shape, dtype=np.float64)
            ck.spread_rank(s, qn, width, rank)
            route[a:b] = ck.row_top_p_serial(rank, p, kmin, qp)[0]
            scores[a:b] = np.take_along_axis(s, route[a:b], axis=1)  # q . c: the bounds use it

        self.row_chunks(L, work, n_threads)
        return route, scores

    def spread_widths(self) -> np.ndarray | None:
        """``spread * sigma_c`` (C,) float64 (the routing's spread term per unit ``|q|``), or None when
        ``spread`` is 0."""
        if not self.spread:
            return None
        return float(self.spread) * np.sqrt(self.key_stats()[2])  # float64: the ranking is float64

    def route(self, queries: np.ndarray, *, check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The ``n_probe_`` clusters of largest ``q.c`` (plus ``spread |q| sigma_c``) for each query.

        Parameters
        ----------
        queries : float array, shape (L, E); computed in the keys' dtype.

        Returns
        -------
        ids : (L, n_probe_) int32, best first (lower cluster id first on ties)
        scores : (L, n_probe_) in the keys' dtype, ``q . centroids_[ids]`` (centred coordinates)
        """
        q = self.validated_queries(queries, check_finite)
        n = self.threads_
        with worker_threads(n):
            return self.route_rows(q, n)

    # ------------------------------------------------------------------------------------ key sets
    def routed_keys(self, route: np.ndarray, is_causal: bool, qpos: np.ndarray, kpos: np.ndarray
                    ) -> SparsePattern:
        """Every key of each query's routed clusters as an (L, S) pattern (causal: ``kpos <= qpos``).

        route (L, p) int32 from :meth:`route`; qpos (L,), kpos (S,) int64.
        """
        indptr, indices = ck.routed_pattern(route, self.cluster_ptr_, self.perm_, bool(is_causal),
                                            np.ascontiguousarray(qpos, dtype=np.int64),
                                            np.ascontiguousarray(kpos, dtype=np.int64))
        return SparsePattern(indptr, indices, self.keys_.shape[0], validate=False)

    def search(self, queries: np.ndarray, k: int, *, is_causal: bool = False, query_positions: object = None,
               key_positions: object = None, check_finite: bool = True) -> SparsePattern:
        """Exact top-k by inner product among the keys of each query's routed clusters.

        Like FAISS's ``search`` over the routed clusters, but the result is CSR (ids ascending per row),
        since a row may hold fewer than k keys (small routed set, causal masking).

        Parameters
        ----------
        queries : float array, shape (L, E); computed in the keys' dtype.
        k : int >= 1
        is_causal : bool
            Only keys with ``key_positions[j] <= query_positions[i]`` are candidates.
        query_positions, key_positions : int arrays (L,) and (S,), optional (default ``arange``)

        Returns
        -------
        SparsePattern of shape (L, S), ``min(k, candidates)`` keys per row.
        """
        q = self.validated_queries(queries, check_finite)
        S = self.keys_.shape[0]
        qpos = positions(query_positions, q.shape[0], "query_positions")
        kpos = positions(key_positions, S, "key_positions")
        n = self.threads_
        with worker_threads(n):  # causal: clusters of later keys rank last
            route = self.route_rows(q, n, *((key_spans(self, kpos)[1], qpos) if is_causal else ()))[0]
            return self.search_routed(q, route, min(int(k), S), bool(is_causal), qpos, kpos, n)

    def search_routed(self, q: np.ndarray, route: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
                      kpos: np.ndarray, n_threads: int) -> SparsePattern:
        """The body of :meth:`search` on validated inputs (:meth:`validated_queries`) and their ``route``
        (:meth:`route_rows`), inside ``worker_threads``."""
        Kp = self.keys_as(q.dtype)  # centred keys: same ranking as the raw keys per query
        indptr, indices = routed_topk(q, route, Kp, self.perm_, self.cluster_ptr_, k, is_causal, qpos, kpos,
                                      n_threads)
        return SparsePattern(indptr, indices, self.keys_.shape[0], validate=False)


def check_built(index: Any) -> None:
    """RuntimeError naming the index's class unless its ``keys_`` are set (built)."""
    if index.keys_ is None:
        raise RuntimeError(f"{type(index).__name__} is not built: call build(keys) first.")


def rows_seeing_at_most(budget: int, qpos: np.ndarray, kpos: np.ndarray, kpos_ascending: np.ndarray | None = None
                        ) -> np.ndarray:
    """Rows whose query position ``qpos`` (L,) int64 sees between 1 and ``budget`` of the keys at
    positions ``kpos`` (S,) int64 (``kpos_ascending``: ``np.sort(kpos)`` when already known): (n,) int64,
    ascending."""
    visible = np.searchsorted(np.sort(kpos) if kpos_ascending is None else kpos_ascending, qpos, side="right")
    return np.flatnonzero((visible > 0) & (visible <= budget))


def checked_keys(keys: object, *, finite: bool = False) -> np.ndarray:
    """``keys`` as a C-contiguous (S, E) float32 or float64 array with S >= 1 and E >= 1 (ValueError
    otherwise: there is nothing to cluster); with ``finite``, every key finite too (a NaN key past the
    k-means' training sample would otherwise be assigned, and drop out of attention, silently)."""
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.dtype not in (np.float32, np.float64) or keys.shape[0] < 1 or keys.shape[1] < 1:
        raise ValueError(f"keys must be a 2-D float32 or float64 array (S >= 1, E >= 1); got {keys.dtype} "
                         f"{keys.shape}.")
    if finite and not np.isfinite(keys).all():
        raise ValueError("keys must be finite: the k-means and the exact prefix rows would take NaN / Inf "
                         "in; clean or mask those keys first.")
    return np.ascontiguousarray(keys)


def cluster_order(centred: np.ndarray, assignment: np.ndarray, centroids: np.ndarray, by_mean: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The keys stored in cluster order: (perm (S,) int64 key id of each ordered row, ascending inside a
    cluster; cluster_ptr (C + 1,) int64; kp (S, E) the centred keys (S, E) in that order; the routing
    vectors (C, E): member means when ``by_mean`` (the k-means centroid for a cluster without keys: it
    holds nothing to attend, so its routing vector only costs a probe), else ``centroids``; radius (C,)
    float64, the members' largest distance to their routing vector)."""
    S, E = centred.shape
    C = centroids.shape[0]
    perm = np.argsort(assignment, kind="stable").astype(np.int64)
    kptr = np.zeros(C + 1, dtype=np.int64)
    np.cumsum(np.bincount(assignment, minlength=C), out=kptr[1:])
    kp = np.empty((S, E), dtype=centred.dtype)
    ck.gather_rows(centred, perm, kp)
    if by_mean:
        centroids = ck.cluster_means(kp, kptr, np.ascontiguousarray(centroids, dtype=kp.dtype))
    return perm, kptr, kp, centroids, ck.cluster_radius(kp, kptr, centroids)


def key_spans(index: ClusterIndex, kpos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions of the keys in cluster order (S,), each cluster's first and last key position (C,)),
    int64, from the keys' positions ``kpos`` (S,).  An empty cluster's first position is the largest int64
    (causal routing ranks it with the clusters that hold no visible key: last) and its last 0."""
    kptr = index.cluster_ptr_
    C = kptr.shape[0] - 1
    kpos_p = kpos[index.perm_]
    nonempty = np.diff(kptr) > 0
    kmin = np.full(C, np.iinfo(np.int64).max, dtype=np.int64)
    kmax = np.zeros(C, dtype=np.int64)
    kmin[nonempty] = np.minimum.reduceat(kpos_p, kptr[:-1][nonempty])
    kmax[nonempty] = np.maximum.reduceat(kpos_p, kptr[:-1][nonempty])
    return kpos_p, kmin, kmax


def routed_topk(q: np.ndarray, route: np.ndarray, Kp: np.ndarray, perm: np.ndarray, kptr: np.ndarray, k: int,
                is_causal: bool, qpos: np.ndarray, kpos: np.ndarray, n_threads: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product among the keys of each query's routed clusters, as CSR.

    q (L, E) float32/float64 queries; route (L, p) int32 cluster ids per query (-1 none); Kp (S, E) keys
    in cluster order in q's dtype; perm (S,) int64 key id of each ordered row; kptr (C + 1,) int64
    cluster offsets; qpos (L,) / kpos (S,) int64 positions (read when ``is_causal``).  Returns
    (indptr (L + 1,) int64, indices int32 key ids ascending per row), at most k per row.  Call inside
    ``worker_threads``.
    """
    L, E = q.shape
    p = route.shape[1]
    C = kptr.shape[0] - 1
    kpos_p = kpos[perm] if is_causal else None
    block = max(1, _BLOCK_BUDGET // (p * (E + 2 * k)))
    ptrs, idxs = [np.zeros(1, dtype=np.int64)], []
    offset = 0
    for q0 in range(0, L, block):
        q1 = min(L, q0 + block)
        qptr, src, slot = ck.group_pairs(route[q0:q1], C)
        rows = src // p + q0
        n_pairs = rows.shape[0]
        Qs = np.empty((n_pairs, E), dtype=q.dtype)
        ck.gather_rows(q, rows, Qs)
        cand_s = np.empty((n_pairs, k), dtype=q.dtype)
        cand_i = np.full((n_pairs, k), -1, dtype=np.int32)  # pairs of empty clusters stay -1
        qpos_s = qpos[rows] if is_causal else None

        def work(c: int, Qs=Qs, cand_s=cand_s, cand_i=cand_i, qptr=qptr, qpos_s=qpos_s) -> None:
            ka, kb = int(kptr[c]), int(kptr[c + 1])
            Kc = Kp[ka:kb]
            ids = perm[ka:kb]
            tile = max(_MIN_ROWS, _TILE // (kb - ka))
            for a in range(int(qptr[c]), int(qptr[c + 1]), tile):
                b = min(int(qptr[c + 1]), a + tile)
                sc = Qs[a:b] @ Kc.T
                if is_causal:
                    ck.causal_mask_block(sc, qpos_s[a:b], kpos_p[ka:kb])
                topk_core.rows_topk(sc, k, ids, cand_s[a:b], cand_i[a:b])

        run_jobs(work, cluster_jobs(qptr, kptr), n_threads)
        indptr, indices = topk_core.merge_topk(cand_s, cand_i, slot, p, k)
        ptrs.append(indptr[1:] + offset)
        idxs.append(indices)
        offset += int(indptr[-1])
    indices = np.concatenate(idxs) if idxs else np.zeros(0, dtype=np.int32)
    return np.concatenate(ptrs), indices
