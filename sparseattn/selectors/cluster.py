"""Cluster routing: k-means over the keys, each query attends to the keys of its best clusters.

Build: the keys are centred (subtracting the mean key changes no softmax), a k-means with ``n_clusters``
centroids is trained on a sample of them with FAISS (``faiss.Kmeans``: spherical, i.e. cosine
assignment and unit-norm centroids, by default; Lloyd with ``spherical=False``), then every key is assigned to a centroid by ``assign``:
default ``"ip"``, the centroid of largest inner product ``k.c`` (the same score that routes queries);
``"l2"``, the nearest centroid.  Measured at n = 16,384 (d = 64, C = 128, n_probe = 8): on clustered
keys "ip" kept 0.998 of the softmax mass (output error 0.019) against 0.90 (0.35) for "l2"; on Gaussian
keys neither works (0.42 / 0.09 of the mass).  Keys (and at attention time values) are permuted once
into cluster order, so each cluster is one contiguous block: a CSR over clusters.  Optionally
(``split > 0``) clusters larger than ``split`` times the mean size are split by a k-means of their
members (members go to the nearest part), because inner-product assignment piles keys onto the
centroids of largest norm: fewer keys per query, at some recall.

Each cluster is then represented by the mean of its keys (``route_by="mean"``, the default: unit-norm
spherical centroids ignore how large a cluster's keys are, which the inner product rewards) or by its
k-means centroid.

Query: each query is routed to the ``n_probe`` clusters of largest score ``q.c`` against those vectors
(the mean key is a per-query constant, so routing against centred vectors ranks the same).  The (query, cluster)
pairs are counting-sorted by cluster, each cluster's queries are gathered once into a contiguous block,
and the arithmetic is BLAS products per cluster block:

* ``mode="topk"``: ``query(q, k)`` is the exact top-k by inner product among the keys of the routed
  clusters (per-cluster ``Q_c K_c^T``, per-row top-k, then a per-query merge of the candidate lists);
* ``mode="block"``: :meth:`ClusterSelector.attend` computes softmax attention over *every* key of the
  routed clusters (per cluster ``exp(scale Q_c K_c^T - m) [V_c, 1]``, partial results merged per query
  by log-sum-exp as in :mod:`sparseattn.merge`); ``query(q, k)`` ignores ``k`` and returns the pattern
  of all routed keys (about L x n_probe x S / n_clusters ids: large).

Exactness of ``attend``: the shift ``m`` is not the row maximum but a Cauchy-Schwarz upper bound
``scale q.c + |scale| |q| r_c`` (``c``: the cluster's routing vector, ``r_c``: its members' largest
distance to it), applied in one fused pass with the exp, so ``exp`` never overflows.  Pairs whose
bound overshoots so far that their row sum drops below 1e-20 are recomputed with a tighter shift, and
weights below ``exp(-80)`` (float32; ``exp(-700)`` float64) are clamped up to it (subnormal floats made
the next GEMM 160x slower): a relative change below ``2e-15 * n_keys``.  The
result equals softmax attention restricted to the routed keys up to floating-point rounding
(tests: 1e-5 in float32, 1e-12 in float64).

Causal masking keeps the routing pure: keys after the query are masked inside each cluster; a query
whose routed clusters hold no allowed key gets zeros and ``lse = -inf`` (union with a window selector if
local keys must always be seen).

Threads: the per-cluster products run on ``n_threads`` Python worker threads with BLAS held to one
thread each (on a machine whose other core is busy, multi-threaded BLAS on these small products was
10x slower); Numba kernels use ``n_threads`` too.  The k-means runs single-threaded (FAISS's OpenMP
pool is set to 1 thread for it and restored afterwards: 0.023 s against 0.40 s on two threads with a
busy core, 16k keys).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

from .._validation import as_float_array, check_scale, overflow_message, result_dtype
from ..kernels import cluster as ck
from ..pattern import SparsePattern, _positions
from .base import Param, Selector, _fill_small_rows, non_negative, positive, register

_MODES = ("topk", "block")
_ASSIGN = ("ip", "l2")
_ROUTE_BY = ("mean", "centroid")
# Elements (not bytes) of the per-block buffers: queries are processed in blocks so the gathered query
# copies and the partial results stay near 2**24 elements (64 MiB in float32).
_BLOCK_BUDGET = 1 << 24
# Row sums below this after the bound shift trigger the exact fallback (see ClusterSelector._attend_block):
# relevant weights are then at least exp(-46 - ln(n_keys) - 20) > float32's smallest normal.
_TINY = {np.float32: 1e-20, np.float64: 1e-200}
# Shifted scores are clamped from below here before exp: exp would
# return subnormal floats, and a GEMM over subnormals ran 160x slower (40 ms instead of 0.26 ms for a
# 1024 x 256 x 65 product).  exp(-80) = 1.8e-35 is normal; since a row sum is >= _TINY = 1e-20, the
# clamp changes a row's weights by at most n_keys * exp(-80) / 1e-20 ~ 2e-15 * n_keys relative.
_CLAMP = {np.float32: -80.0, np.float64: -700.0}
# Elements of one score tile ``Q_c K_c^T`` (rows of a large cluster are processed in tiles).
_TILE = 1 << 18
# Fewest query rows per GEMM tile (large clusters would otherwise give skinny, slow products), and most
# (small clusters would otherwise get tiles of up to _TILE rows, and the P V scratch with them).
_MIN_ROWS = 64
_MAX_ROWS = 4096


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else "must be one of " + ", ".join(repr(c) for c in choices)
    return check




_executors: dict[int, ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()


def _executor(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``n`` worker threads, made once per size.

    Why not a pool per call: starting the threads cost ~1 ms per call, 4 ms of a 30 ms attend at
    n = 4,096 (several calls per build and attend).  The workers only run per-cluster jobs that never
    submit further jobs, so sharing a pool across selectors and calls cannot deadlock.
    """
    with _executors_lock:
        ex = _executors.get(n)
        if ex is None:
            ex = _executors[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"sparseattn-cluster{n}")
        return ex


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """BLAS pinned to one thread (we parallelise over clusters ourselves), Numba to n threads."""
    from ..threads import single_threaded_blas

    old = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        with single_threaded_blas():
            yield
    finally:
        numba.set_num_threads(old)


@register
class ClusterSelector(Selector):
    """K-means cluster routing with exact attention (or exact top-k) inside the routed clusters.

    Parameters
    ----------
    n_clusters : int, optional
        Number of k-means clusters C (default ``round(sqrt(S))`` clipped to [1, S]; 256 at S = 65,536).
    n_probe : int, optional
        Clusters each query is routed to (default ``min(8, C)``); must not exceed ``n_clusters``.
    mode : {"topk", "block"}, default "topk"
        ``"topk"``: ``query`` returns the exact top-k among the routed keys.  ``"block"``: use
        :meth:`attend` (exact attention over all routed keys); ``query`` returns all routed keys.
    train_sample : int, optional
        Keys sampled for k-means training (default ``min(S, 64 * C)``); must be >= n_clusters.
    n_iter : int, default 5
        K-means iterations.  Spherical k-means settles fast: at S = 65,536 (C = 256, n_probe = 9) 4 and
        20 iterations gave the same recall@64 for the same keys per query on real keys (0.90 at 2,339 vs
        2,360), and 5 instead of 10 halves the k-means time (5.7 -> ~2.8 ms of a 22 ms build + attend at
        S = 4,096).
    seed : int, default 0
        Seed of the training sample and of FAISS's k-means initialisation.
    center : bool, default True
        Subtract the mean key before clustering (exact for softmax; better conditioned clusters).
    spherical : bool, default True
        Spherical k-means (unit-norm centroids, cosine assignment during training).  Measured at
        S = 65,536 (C = 256; keys per query needed for recall@64 >= 0.9, with ``route_by="mean"``):
        real MiniLM store keys 2,356 (Lloyd k-means: 3,272), clustered synthetic 1,005 (3,211).
    assign : {"ip", "l2"}, default "ip"
        Key -> cluster rule after training: largest inner product or nearest centroid.
    route_by : {"mean", "centroid"}, default "mean"
        The vector each cluster is routed (and bounded) by: the mean of the keys assigned to it, or the
        k-means centroid.  Why the mean: spherical centroids have unit norm, so ``q.c`` ignores how large
        a cluster's keys are, which is what the inner product rewards.  Measured at S = 65,536, C = 256
        (keys per query for recall@64 >= 0.9): real keys 2,356 by mean vs 3,076 by centroid, clustered
        synthetic 1,005 vs 2,123, Gaussian 32,511 vs 33,024.  (With ``spherical=False`` the centroid
        routes better on clustered keys: 1,521 vs 3,211.)
    n_threads : int, optional
        Worker threads (default: Numba's current thread count).
    exact_prefix : bool, default True
        Causal block attention (``attend`` and block-mode ``query``) only: a query that can see at most ``ceil(n_probe * S / n_clusters)`` keys (the routed
        keys of an average query) attends to all of them exactly, instead of through routing.  Why:
        routing ignores positions, so the first queries, which see few keys, found them scattered over
        clusters they were not routed to (measured at S = 4,096 on clustered keys: recall@64 0.80
        causal against 0.93 without causality).  Costs at most as much as routing those rows.
    split : float, default 0 (off)
        When > 0, every cluster holding more than ``split * S / n_clusters`` keys after assignment is
        split by a k-means of its members into ``ceil(size / (S / n_clusters))`` parts, each member
        going to its nearest part; ``n_clusters_`` then exceeds ``n_clusters``.  Why: inner-product
        assignment sends many keys to centroids of large norm (at S = 65,536 on clustered keys the
        largest cluster held 9x the mean), and a query's cost is the size of its routed clusters.  A
        speed / recall trade, hence off by default; measured with ``split=2`` at S = 65,536, k = 64 with
        Lloyd k-means routed by centroid (``spherical=False, route_by="centroid"``, where the imbalance
        is worst): clustered keys 4,250 -> 1,549 keys per query, 1.4x faster end to end, recall@64
        0.971 -> 0.958; norm-matched Gaussian keys recall@64 0.37 -> 0.07; real MiniLM store keys no
        gain.  The spherical default is far more balanced (largest cluster 2.6x the mean on real keys).
        ``n_probe = n_clusters`` still routes to every cluster (exact attention).

    Attributes
    ----------
    n_clusters_, n_probe_ : int
        The sizes in force after splitting (set by ``build``, like every attribute below).
    centroids_ : (C, E) array in the keys' dtype
        The routing vectors in centred coordinates (subtract ``mean_`` from a key before comparing):
        member means (``route_by="mean"``; the k-means centroid for a cluster without keys) or the
        k-means centroids.  ``kmeans_centroids_`` holds the centroids that assigned the keys.
    mean_ : (E,) array
        The mean key (zeros when ``center=False``).
    assignment_ : (S,) int32
        Cluster of each key.
    coarse_centroids_ : (C0, E) array
        The first k-means' centroids (before splitting); ``parent_`` (n_clusters_,) int64 maps each
        final cluster to the coarse cluster it came from (itself when not split).
    perm_ : (S,) int64
        Key ids in cluster order: cluster c is ``perm_[cluster_ptr_[c]:cluster_ptr_[c+1]]``.
    cluster_ptr_ : (C + 1,) int64
    radius_ : (C,) float64
        Largest distance of a member key to its centroid (for the softmax shift bound).
    last_refined_pairs_ : int
        (query, cluster) pairs the last ``attend`` recomputed with a tighter shift (diagnostics).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((512, 16)).astype(np.float32)
    >>> sel = ClusterSelector(n_clusters=8, n_probe=8, mode="block").build(keys)
    >>> v = rng.standard_normal((512, 4)).astype(np.float32)
    >>> out, lse = sel.attend(keys[:3], v)   # n_probe == n_clusters: exact full attention
    >>> out.shape, lse.shape
    ((3, 4), (3,))
    """

    name = "cluster"
    metric = "inner_product"
    guarantee = ("k-means clusters of the (centred) keys, each query routed to its n_probe clusters of "
                 "largest q.c. mode=topk: exact top-k by inner product among the routed clusters' keys. "
                 "mode=block: attend() is exact softmax attention restricted to all keys of the routed "
                 "clusters (query() returns that key set). n_probe = n_clusters is exact full attention. "
                 "Causal: masked inside clusters; a query seeing at most n_probe*S/C keys attends to all "
                 "of them (exact_prefix); no key -> zeros and lse = -inf.")
    params_spec = {
        "n_clusters": Param(int, None, "k-means clusters C (default round(sqrt(S)))", positive),
        "n_probe": Param(int, None, "clusters per query (default min(8, C))", positive),
        "mode": Param(str, "topk", "'topk' (exact top-k in routed clusters) or 'block' (attend())",
                      _one_of(_MODES)),
        "train_sample": Param(int, None, "keys sampled to train k-means (default min(S, 64*C))", positive),
        "n_iter": Param(int, 5, "k-means iterations", positive),
        "seed": Param(int, 0, "seed of the sample and the k-means initialisation", non_negative),
        "center": Param(bool, True, "subtract the mean key before clustering"),
        "spherical": Param(bool, True, "spherical (cosine) k-means"),
        "assign": Param(str, "ip", "key -> cluster rule: 'ip' (max k.c) or 'l2' (nearest centroid)",
                        _one_of(_ASSIGN)),
        "route_by": Param(str, "mean", "route to clusters by the 'mean' of their keys or the k-means "
                          "'centroid'", _one_of(_ROUTE_BY)),
        "n_threads": Param(int, None, "worker threads (default: numba.get_num_threads())", positive),
        "exact_prefix": Param(bool, True, "causal, mode=block: a query that can see at most n_probe*S/C keys "
                              "attends to all of them exactly"),
        "split": Param(float, 0.0, "split clusters larger than split * S / n_clusters (0 = never; "
                       "a speed/recall trade)", non_negative),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        c, p = self._params["n_clusters"], self._params["n_probe"]
        if c is not None and p is not None and p > c:
            raise ValueError(f"cluster: n_probe must be <= n_clusters; got n_probe={p} > n_clusters={c}. "
                             f"Routing a query to every cluster is n_probe = n_clusters (exact attention).")
        t = self._params["train_sample"]
        if c is not None and t is not None and t < c:
            raise ValueError(f"cluster: train_sample must be >= n_clusters; got train_sample={t} < "
                             f"n_clusters={c}. k-means needs at least one training key per centroid.")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import faiss  # noqa: F401
        except ImportError as exc:  # pragma: no cover - faiss is a dependency
            return f"faiss is not importable ({exc}); install faiss-cpu."
        return None

    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(n_keys=n_keys, dim=dim, is_causal=is_causal)
        c = self._params["n_clusters"]
        if n_keys is not None:
            if n_keys < 1:
                reasons.append("cluster routing needs at least one key")
            elif c is not None and c > n_keys:
                reasons.append(f"n_clusters={c} > n_keys={n_keys}; use n_clusters <= n_keys "
                               f"(default round(sqrt(S)))")
        return reasons

    # ------------------------------------------------------------------------------------- helpers
    @property
    def n_threads(self) -> int:
        t = self._params["n_threads"]
        return int(t) if t is not None else int(numba.get_num_threads())

    def _sizes(self, S: int) -> tuple[int, int, int]:
        C = self._params["n_clusters"]
        if C is None:
            C = int(min(max(round(float(np.sqrt(S))), 1), S))
        p = self._params["n_probe"]
        if p is None:
            p = min(8, C)
        elif p > C:
            raise ValueError(f"cluster: n_probe={p} exceeds the {C} clusters chosen for S={S} keys; pass "
                             f"n_probe <= {C} or set n_clusters explicitly.")
        t = self._params["train_sample"]
        if t is None:
            t = min(S, 64 * C)
        elif t < C:
            raise ValueError(f"cluster: train_sample={t} < n_clusters={C}; k-means needs at least one "
                             f"training key per centroid.")
        return C, p, min(t, S)

    def _kmeans(self, centred: np.ndarray, C: int, n_train: int, seed_offset: int = 0) -> np.ndarray:
        import faiss

        S, E = centred.shape
        seed = self._params["seed"] + seed_offset
        rng = np.random.default_rng(seed)
        sample = centred if n_train >= S else centred[np.sort(rng.choice(S, n_train, replace=False))]
        sample = np.ascontiguousarray(sample, dtype=np.float32)
        if C == 1:
            cent = sample.mean(axis=0, keepdims=True)
            if self._params["spherical"]:
                cent /= max(float(np.linalg.norm(cent)), 1e-30)
            return cent
        old = faiss.omp_get_max_threads()
        # One OpenMP thread, whatever n_threads: with the other core busy, FAISS's k-means took 0.40 s
        # on 2 threads against 0.023 s on 1 (16k x 64 sample, 128 centroids): its many short parallel
        # regions spin at barriers.  Single-threaded it is a small part of the build anyway.  Set it
        # before limiting BLAS: FAISS's OpenBLAS is OpenMP-threaded and follows the OpenMP setting.
        faiss.omp_set_num_threads(1)
        try:
            with _threads(1):
                km = faiss.Kmeans(E, C, niter=self._params["n_iter"], seed=seed,
                                  spherical=self._params["spherical"], verbose=False,
                                  max_points_per_centroid=1 << 30, min_points_per_centroid=1)
                km.train(sample)
        finally:
            faiss.omp_set_num_threads(old)
        return np.asarray(km.centroids, dtype=np.float32).reshape(C, E)

    def _build(self, keys: np.ndarray) -> None:
        S, E = keys.shape
        C, p, n_train = self._sizes(S)
        self.n_clusters_, self.n_probe_ = C, p
        if self._params["center"]:
            self.mean_ = keys.mean(axis=0, dtype=np.float64).astype(keys.dtype)
        else:
            self.mean_ = np.zeros(E, dtype=keys.dtype)
        centred = keys - self.mean_ if self._params["center"] else keys
        self.centroids_ = self._kmeans(centred, C, n_train).astype(keys.dtype)
        with _threads(self.n_threads):
            assignment = self._assign(centred)
            self.coarse_centroids_ = self.centroids_
            self.parent_ = np.arange(C, dtype=np.int64)
            split = self._params["split"]
            if split > 0:
                assignment = self._split_large(centred, assignment, split * S / C, S / C)
                # n_probe = n_clusters keeps its meaning (every cluster: exact attention).
                self.n_probe_ = self.centroids_.shape[0] if p == C else p
                self.n_clusters_ = C = self.centroids_.shape[0]
            self.assignment_ = assignment
            self.perm_ = np.argsort(assignment, kind="stable").astype(np.int64)
            self.cluster_ptr_ = np.zeros(C + 1, dtype=np.int64)
            np.cumsum(np.bincount(assignment, minlength=C), out=self.cluster_ptr_[1:])
            # Centred keys in cluster order: each cluster one contiguous block.
            kp = np.empty((S, E), dtype=keys.dtype)
            ck.gather_rows(centred, self.perm_, kp)
            self.kmeans_centroids_ = self.centroids_
            if self._params["route_by"] == "mean":
                self.centroids_ = self._member_means(kp, self.centroids_)
            self.radius_ = ck.cluster_radius(kp, self.cluster_ptr_, self.centroids_)
        self.keys_perm_ = kp
        self._keys_cast: dict[np.dtype, np.ndarray] = {keys.dtype: kp}

    def _member_means(self, kp: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        """(C, E) mean of each cluster's keys (kp: centred keys in cluster order); ``fallback`` rows for
        clusters without keys (they hold nothing to attend, so their routing vector only costs a probe)."""
        return ck.cluster_means(kp, self.cluster_ptr_, np.ascontiguousarray(fallback, dtype=kp.dtype))

    def _assign(self, centred: np.ndarray) -> np.ndarray:
        """Cluster of each (centred) key: argmax of k.c ("ip") or nearest centroid ("l2"); (S,) int32."""
        S = centred.shape[0]
        bias = None
        if self._params["assign"] == "l2":
            bias = (-0.5 * (self.centroids_.astype(np.float64) ** 2).sum(axis=1)).astype(centred.dtype)
        assignment = np.empty(S, dtype=np.int32)
        cent = self.centroids_.astype(centred.dtype, copy=False)

        def work(a: int, b: int) -> None:
            sc = centred[a:b] @ cent.T
            if bias is not None:
                sc += bias
            assignment[a:b] = ck.row_argmax_serial(sc)

        self._row_chunks(S, work)
        return assignment

    def _row_chunks(self, n_rows: int, work: Callable[[int, int], None]) -> None:
        """``work(a, b)`` over row chunks of about 2**24 score elements, on the worker threads.

        Why not one big product: BLAS is pinned to one thread (see ``_threads``), so the (rows x C)
        scoring GEMM and its serial argmax / top-p kernel run chunk-parallel on our own workers
        (0.27 s -> about half at S = 262,144, C ~ 900); chunks also bound the score buffer.
        """
        C = self.centroids_.shape[0]
        block = max(1, _BLOCK_BUDGET // (4 * C))
        n_chunks = -(-n_rows // block)
        per = max(1, -(-n_rows // max(n_chunks, 2 * self.n_threads)))
        per = min(per, block)
        chunks = [(a, min(n_rows, a + per)) for a in range(0, n_rows, per)]
        self._run(list(range(len(chunks))), lambda t: work(*chunks[t]))

    def _split_large(self, centred: np.ndarray, assignment: np.ndarray, cap: float, target: float
                     ) -> np.ndarray:
        """Split every cluster of more than ``cap`` keys into ``ceil(size / target)`` parts.

        Why: inner-product assignment favours centroids of large norm (the hull of the centroid set),
        so a few clusters collect many keys (at S = 65,536 on clustered keys the largest held 9x the
        mean), and a query's attention cost is the size of its routed clusters.  A member k-means
        (Euclidean) splits such a cluster into compact parts; members go to their nearest part (a
        global inner-product re-assignment would pull them back into one part).  Returns the new
        assignment; ``centroids_`` gains the parts' centroids (replacing the split cluster's).
        """
        sizes = np.bincount(assignment, minlength=self.centroids_.shape[0])
        big = np.flatnonzero(sizes > cap)
        if big.size == 0:
            return assignment
        keep = np.setdiff1d(np.arange(sizes.size), big)
        new_id = np.full(sizes.size, -1, dtype=np.int64)
        new_id[keep] = np.arange(keep.size)
        out = new_id[assignment].astype(np.int32)
        cents, parents = [self.centroids_[keep]], [keep]
        nxt = keep.size
        # One stable sort gives every cluster's member rows (ascending), instead of an O(S) scan per
        # split cluster (hundreds of them at S = 262,144).
        order = np.argsort(assignment, kind="stable")
        starts = np.concatenate(([0], np.cumsum(sizes)))
        for c in big:
            rows = order[starts[c]:starts[c + 1]]
            members = centred[rows]
            parts = int(min(np.ceil(sizes[c] / target), rows.size))
            sub = self._kmeans(members, parts, min(rows.size, 64 * parts), seed_offset=1 + int(c))
            sub = sub.astype(centred.dtype)
            half_sq = 0.5 * (sub.astype(np.float64) ** 2).sum(axis=1)
            out[rows] = nxt + ck.row_argmax(members @ sub.T - half_sq.astype(centred.dtype))  # nearest part
            cents.append(sub)
            parents.append(np.full(parts, c, dtype=np.int64))
            nxt += parts
        self.centroids_ = np.ascontiguousarray(np.concatenate(cents))
        self.parent_ = np.concatenate(parents)
        return out

    def _prefix_budget(self) -> int:
        """Visible keys up to which a causal query attends to all of them (``exact_prefix``)."""
        S = self.keys_.shape[0]
        return int(np.ceil(self.n_probe_ * S / self.n_clusters_))

    def _prefix_rows(self, qpos: np.ndarray, kpos: np.ndarray, kpos_ascending: np.ndarray | None = None
                     ) -> np.ndarray:
        """Rows that see between 1 and ``_prefix_budget()`` keys (int64, ascending); empty when off.
        ``kpos_ascending``: ``np.sort(kpos)`` when the caller already has it."""
        if not self._params["exact_prefix"]:
            return np.zeros(0, dtype=np.int64)
        visible = np.searchsorted(np.sort(kpos) if kpos_ascending is None else kpos_ascending, qpos, side="right")
        return np.flatnonzero((visible > 0) & (visible <= self._prefix_budget()))

    def _check_built(self) -> None:
        if self.keys_ is None:
            raise RuntimeError(f"selector {self.name!r} is not built: call build(keys) first.")

    def _route_rows(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(route (L, p) int32 cluster ids, best first; their scores q.c (L, p))."""
        L = q.shape[0]
        p = self.n_probe_
        route = np.empty((L, p), dtype=np.int32)
        scores = np.empty((L, p), dtype=q.dtype)
        cent = self.centroids_.astype(q.dtype, copy=False)

        def work(a: int, b: int) -> None:
            route[a:b], scores[a:b] = ck.row_top_p_serial(q[a:b] @ cent.T, p)

        self._row_chunks(L, work)
        return route, scores

    def route(self, queries: np.ndarray, *, check_finite: bool = True) -> np.ndarray:
        """The clusters each query is routed to.

        Parameters
        ----------
        queries : float array, shape (L, E)

        Returns
        -------
        (L, n_probe) int32 cluster ids, best centroid score ``q . c`` first.
        """
        self._check_built()
        q = self._queries(queries, check_finite)
        with _threads(self.n_threads):
            return self._route_rows(q)[0]

    def _queries(self, queries: np.ndarray, check_finite: bool) -> np.ndarray:
        q = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
        if q.ndim != 2:
            raise ValueError(f"queries must be 2-D (L, E); got shape {q.shape}.")
        if q.shape[1] != self.keys_.shape[1]:
            raise ValueError(f"queries have E={q.shape[1]} features but the keys have {self.keys_.shape[1]}.")
        return np.ascontiguousarray(q, dtype=self.keys_.dtype)

    def _keys_as(self, dtype: np.dtype) -> np.ndarray:
        if dtype not in self._keys_cast:
            self._keys_cast[dtype] = self.keys_perm_.astype(dtype)
        return self._keys_cast[dtype]

    def _run(self, jobs: list[int], work: Callable[[int], None]) -> None:
        """Run ``work(cluster)`` for each cluster, largest first, on the worker threads."""
        n = self.n_threads
        if n <= 1 or len(jobs) <= 1:
            for c in jobs:
                work(c)
            return
        for _ in _executor(n).map(work, jobs):
            pass

    def _shares(self, qptr: np.ndarray) -> list[np.ndarray]:
        """The clusters with work, split over the worker threads by cost (queries x keys): largest first,
        each to the least loaded worker (LPT scheduling; within 4/3 of the best split)."""
        nq = np.diff(qptr)
        cost = nq * np.diff(self.cluster_ptr_)
        T = max(1, self.n_threads)
        lists: list[list[int]] = [[] for _ in range(T)]
        load = [0] * T
        for c in self._jobs(qptr):
            t = min(range(T), key=load.__getitem__)
            lists[t].append(c)
            load[t] += int(cost[c])
        return [np.asarray(x, dtype=np.int64) for x in lists if x]

    def _jobs(self, qptr: np.ndarray) -> list[int]:
        nq = np.diff(qptr)
        nk = np.diff(self.cluster_ptr_)
        cost = nq * nk
        order = np.argsort(-cost, kind="stable")
        return [int(c) for c in order if cost[c] > 0]

    # --------------------------------------------------------------------------------------- query
    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        S = self.keys_.shape[0]
        with _threads(self.n_threads):
            route = self._route_rows(q)[0]
            if self._params["mode"] == "block":
                kp = np.ascontiguousarray(kpos, dtype=np.int64)
                indptr, indices = ck.routed_pattern(route, self.cluster_ptr_, self.perm_, bool(is_causal),
                                                    np.ascontiguousarray(qpos, dtype=np.int64), kp)
                pattern = SparsePattern(indptr, indices, S, validate=False)
                if is_causal and self._params["exact_prefix"]:
                    # the rows attend() computes exactly over every visible key (_prefix_rows)
                    pattern = _fill_small_rows(pattern, self._prefix_budget(), True, qpos, kpos)
                return pattern
            return self._topk(q, route, min(k, S), is_causal, qpos, kpos)

    def _topk(self, q, route, k, is_causal, qpos, kpos) -> SparsePattern:
        L, E = q.shape
        p = self.n_probe_
        Kp = self._keys_as(q.dtype)  # centred keys: same ranking as the raw keys per query
        kptr = self.cluster_ptr_
        kpos_p = kpos[self.perm_] if is_causal else None
        block = max(1, _BLOCK_BUDGET // (p * (E + 2 * k)))
        ptrs, idxs = [np.zeros(1, dtype=np.int64)], []
        offset = 0
        for q0 in range(0, L, block):
            q1 = min(L, q0 + block)
            qptr, src, slot = ck.group_pairs(route[q0:q1], self.n_clusters_)
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
                ids = self.perm_[ka:kb]
                tile = max(_MIN_ROWS, _TILE // (kb - ka))
                for a in range(int(qptr[c]), int(qptr[c + 1]), tile):
                    b = min(int(qptr[c + 1]), a + tile)
                    sc = Qs[a:b] @ Kc.T
                    if is_causal:
                        ck.causal_mask_block(sc, qpos_s[a:b], kpos_p[ka:kb])
                    ck.rows_topk(sc, k, ids, cand_s[a:b], cand_i[a:b])

            self._run(self._jobs(qptr), work)
            indptr, indices = ck.merge_topk(cand_s, cand_i, slot, p, k)
            ptrs.append(indptr[1:] + offset)
            idxs.append(indices)
            offset += int(indptr[-1])
        indices = np.concatenate(idxs) if idxs else np.zeros(0, dtype=np.int32)
        return SparsePattern(np.concatenate(ptrs), indices, self.keys_.shape[0], validate=False)

    # -------------------------------------------------------------------------------------- attend
    @property
    def fills_small_rows(self) -> bool:  # type: ignore[override]
        # Block mode's pattern is exactly the routed key set attend() uses: never padded.
        return self._params["mode"] != "block"

    def attend(self, queries: np.ndarray, values: np.ndarray, *, scale: float | None = None,
               is_causal: bool = False, query_positions: object = None, key_positions: object = None,
               check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Exact softmax attention of each query over every key of its routed clusters.

        Works in either mode (``mode`` only changes what :meth:`query` returns).

        Parameters
        ----------
        queries : float array, shape (L, E)
        values : float array, shape (S, Ev)
            One value row per key given to ``build``, in the original key order.
        scale : float, optional
            Score scale (default ``1/sqrt(E)``).  Routing ranks clusters by ``q . c`` whatever the scale.
        is_causal : bool
            Key j is visible to query i only when ``key_positions[j] <= query_positions[i]``.
        query_positions, key_positions : int arrays of shape (L,) and (S,), optional
            Default ``arange`` (top-left alignment, like SDPA).

        Returns
        -------
        output : (L, Ev) array, float64 if any of queries, keys, values is float64, else float32.
            Zeros for a query whose routed clusters hold no allowed key.
        lse : (L,) array, same dtype: log-sum-exp of the scaled scores over the routed keys
            (``-inf`` for no key).  ``exp(lse - lse_full)`` is the softmax mass the routing kept.

        Raises
        ------
        ValueError
            If some score ``q . k * scale`` overflows the computation dtype (pass float64 or a smaller scale).
        """
        self._check_built()
        S, E = self.keys_.shape
        q_in = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
        v_in = as_float_array(values, "values", min_ndim=2, check_finite=check_finite)
        if q_in.ndim != 2 or q_in.shape[1] != E:
            raise ValueError(f"queries must have shape (L, E={E}); got {q_in.shape}.")
        if v_in.ndim != 2 or v_in.shape[0] != S:
            raise ValueError(f"values must have shape (S={S}, Ev), one row per key; got {v_in.shape}.")
        if not isinstance(is_causal, (bool, np.bool_)):
            raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")
        is_causal = bool(is_causal)
        sc = check_scale(scale, E)
        dtype = result_dtype(q_in, self.keys_, v_in)
        q = np.ascontiguousarray(q_in, dtype=dtype)
        L = q.shape[0]
        Ev = v_in.shape[1]
        qpos = _positions(query_positions, L, "query_positions")
        kpos = _positions(key_positions, S, "key_positions")
        out = np.zeros((L, Ev), dtype=dtype)
        lse = np.full(L, -np.inf, dtype=dtype)
        if L == 0:
            return out, lse
        with _threads(self.n_threads):
            prefix = np.zeros(0, dtype=np.int64)
            if is_causal and self._params["exact_prefix"]:
                order = np.argsort(kpos, kind="stable")  # keys in position order: one sort for both uses
                prefix = self._prefix_rows(qpos, kpos, kpos[order])
            if prefix.size:
                # The exact-prefix rows are computed exactly below: the routed pass skips them.
                sub = np.delete(np.arange(L), prefix)
                out_r, lse_r = self._attend_routed(q[sub], v_in, sc, is_causal, qpos[sub], kpos)
                out[sub] = out_r
                lse[sub] = lse_r
                self._attend_prefix(q, v_in, sc, prefix, qpos, kpos, order, out, lse)
            else:
                out, lse = self._attend_routed(q, v_in, sc, is_causal, qpos, kpos)
        # Finite inputs whose q.k overflows the dtype leave +inf (or inf - inf = NaN) in lse: an error, as in
        # sparse_attention, never a silent garbage row.  NaN from NaN inputs (check_finite=False) passes.
        if np.isposinf(lse).any() or (check_finite and np.isnan(lse).any()):
            raise ValueError(overflow_message(dtype, sc))
        return out, lse

    def _attend_routed(self, q, v_in, sc, is_causal, qpos, kpos) -> tuple[np.ndarray, np.ndarray]:
        """Attention of every row of q over its routed clusters (the body of :meth:`attend`)."""
        S, E = self.keys_.shape
        dtype = q.dtype
        L = q.shape[0]
        Ev = v_in.shape[1]
        out = np.zeros((L, Ev), dtype=dtype)
        lse = np.full(L, -np.inf, dtype=dtype)
        if L == 0:
            return out, lse
        route, route_scores = self._route_rows(q)
        Kp = self._keys_as(dtype)
        Vp = np.empty((S, Ev), dtype=dtype)
        ck.gather_rows(np.ascontiguousarray(v_in, dtype=dtype), self.perm_, Vp)  # float16 in: upcast
        lse_shift = (q @ self.mean_.astype(dtype)) * sc  # scores against raw keys = centred + q.mean
        q_norm = np.sqrt(np.einsum("ij,ij->i", q, q, dtype=np.float64))  # for the score bounds
        if is_causal:
            kpos_p = kpos[self.perm_]
            kptr = self.cluster_ptr_
            nonempty = np.diff(kptr) > 0
            kmin = np.zeros(self.n_clusters_, dtype=np.int64)
            kmax = np.zeros(self.n_clusters_, dtype=np.int64)
            kmin[nonempty] = np.minimum.reduceat(kpos_p, kptr[:-1][nonempty])
            kmax[nonempty] = np.maximum.reduceat(kpos_p, kptr[:-1][nonempty])
            # perm_ keeps the original order inside a cluster: sorted positions stay sorted there
            kpos_sorted = bool(np.all(kpos[1:] >= kpos[:-1]))
        else:
            kpos_p = kmin = kmax = None
            kpos_sorted = False
        block = min(L, max(1, _BLOCK_BUDGET // (self.n_probe_ * (E + Ev + 2))))  # Qs, po, pm
        # Buffers allocated once and reused by every block: fresh multi-MB arrays are page-faulted
        # on first touch, which cost up to 40 ms per block with two threads faulting at once.
        n_buf = block * self.n_probe_
        bufs = (np.empty((n_buf, E), dtype=dtype), np.empty((n_buf, Ev + 1), dtype=dtype),
                np.empty(n_buf, dtype=dtype))
        # Each worker's tile scratch: scores (tile x nk) and the tile's P V (tile x Ev).
        nk_max = int(np.diff(self.cluster_ptr_).max())
        scratch = [(np.empty(max(_TILE, _MIN_ROWS * nk_max), dtype=dtype),
                    np.empty(_MAX_ROWS * Ev, dtype=dtype)) for _ in range(max(1, self.n_threads))]
        for q0 in range(0, L, block):
            q1 = min(L, q0 + block)
            self._attend_block(q, q_norm, q0, q1, route[q0:q1], route_scores[q0:q1], Kp, Vp, sc,
                               qpos, kpos_p, kmin, kmax, kpos_sorted, lse_shift, out, lse, bufs, scratch)
        return out, lse

    def _attend_prefix(self, q, values, scale, rows, qpos, kpos, order, out, lse) -> None:
        """Exact causal attention for the rows that see few keys (``exact_prefix``), over raw keys.

        Each such row sees at most ``_prefix_budget()`` keys, a prefix of the keys in position order
        (:func:`~sparseattn.kernels.cluster.attend_prefix_rows_f32`); rows split over the worker threads by
        their number of keys; ``order`` is ``argsort(kpos)`` (stable).  Called inside ``_threads``."""
        dtype = q.dtype
        n_vis = np.searchsorted(kpos[order], qpos[rows], side="right").astype(np.int64)
        B = int(n_vis.max())
        Ks = np.empty((B, q.shape[1]), dtype=dtype)
        ck.gather_rows(np.ascontiguousarray(self.keys_, dtype=dtype), order[:B], Ks)
        Vs = np.empty((B, values.shape[1]), dtype=dtype)
        ck.gather_rows(np.ascontiguousarray(values, dtype=dtype), order[:B], Vs)
        Qs = q[rows] * dtype.type(scale)
        o = np.empty((rows.size, Vs.shape[1]), dtype=dtype)
        lse_r = np.empty(rows.size, dtype=dtype)
        kernel = ck.attend_prefix_rows_f32 if dtype == np.float32 else ck.attend_prefix_rows_f64
        clamp = _CLAMP[dtype.type]
        # Contiguous row shares of about equal work (sum of prefix lengths).
        T = max(1, min(self.n_threads, rows.size // 16))
        cost = np.cumsum(n_vis)
        cuts = [0] + [int(np.searchsorted(cost, cost[-1] * t / T)) for t in range(1, T)] + [rows.size]
        shares = [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]

        def work(t: int) -> None:
            a, b = shares[t]
            kernel(Qs[a:b], n_vis[a:b], Ks, Vs, clamp, np.empty(B, dtype=dtype), o[a:b], lse_r[a:b])

        self._run(list(range(len(shares))), work)
        out[rows] = o
        lse[rows] = lse_r

    def _refine(self, Qs, pm, po, Kp, Vp, qptr, clamp, causal_args) -> int:
        """Fix the pairs whose shift m was too loose; return how many were recomputed.

        After the clamp every allowed key has a weight >= exp(-80) > 0, so a zero row sum means "no
        allowed key" (the pair becomes empty).  A row sum below ``_TINY`` means relevant weights may have
        underflowed: the pair is recomputed with ``m' = m + log(l)``, which is still >= the true
        log-sum-exp (the clamp only raises weights), hence a valid bound, and lies within
        ``log(n_keys)`` of the true maximum unless that was below the clamp, in which case it drops by
        ``>= 80 - log(n_keys)`` and the loop repeats.  Any pair left after 64 rounds (not expected) is
        recomputed with its exact maximum by a scalar kernel.  Pairs are sorted by cluster: cluster c
        owns pairs ``qptr[c]:qptr[c+1]``.
        """
        Ev = Vp.shape[1]
        kptr = self.cluster_ptr_
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
                    with np.errstate(over="ignore"):  # an overflowing score is reported by attend's error
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
            ck.exact_pairs(bad, Qs, Kp, Vp, kptr, pair_cluster, causal_args is not None, qpos_s, kpos_p,
                           po, pm)
        return refined

    def _attend_block(self, q, q_norm, q0, q1, route, route_scores, Kp, Vp, scale, qpos, kpos_p, kmin,
                      kmax, kpos_sorted, lse_shift, out, lse, bufs, scratch) -> None:
        """Attention of queries q0..q1 over their routed clusters.

        Per cluster tile: ``s = (scale q) @ (k - mean)^T`` (one GEMM), then one pass
        (:func:`~sparseattn.kernels.cluster.shifted_exp_rows_f32`) that turns s into weights
        ``exp(max(s - m, clamp))`` with m the Cauchy-Schwarz bound of the pair (so exp cannot overflow),
        zeroes keys after the query (causal) and sums each row; then ``po = w @ V`` (one GEMM) and the
        row sum go to the pair's partial.  A pair whose bound was so loose that every weight is tiny
        (row sum < ``_TINY``: relevant weights could have underflowed) is recomputed with a tighter
        shift (:meth:`_refine`).  Partials are then merged per query.
        """
        Ev = Vp.shape[1]
        p = self.n_probe_
        kptr = self.cluster_ptr_
        is_causal = kpos_p is not None
        qptr, src, slot = ck.group_pairs(route, self.n_clusters_)
        n_pairs = src.shape[0]
        Qs, po, pm = (b[:n_pairs] for b in bufs)
        ck.gather_pairs(q, q_norm, q0, src, p, route, route_scores, self.radius_, scale, Qs, pm)
        clamp = _CLAMP[q.dtype.type]
        kernel = ck.attend_clusters_f32 if q.dtype == np.float32 else ck.attend_clusters_f64
        qpos_s = qpos[src // p + q0] if is_causal else np.zeros(1, dtype=np.int64)
        kpos_arg = kpos_p if is_causal else np.zeros(1, dtype=np.int64)  # not read unless causal
        kmin_arg = kmin if is_causal else np.zeros(1, dtype=np.int64)
        kmax_arg = kmax if is_causal else np.zeros(1, dtype=np.int64)
        shares = self._shares(qptr)
        tiny = _TINY[q.dtype.type]
        n_low = [0] * len(shares)

        def work(t: int) -> None:
            buf, obuf = scratch[t]
            n_low[t] = kernel(shares[t], qptr, kptr, Qs, Kp, Vp, pm, po, clamp, tiny, _TILE, _MIN_ROWS,
                              _MAX_ROWS, is_causal, kpos_sorted, qpos_s, kpos_arg, kmin_arg, kmax_arg, buf,
                              obuf)

        self._run(list(range(len(shares))), work)
        # Pairs routed to clusters without keys were never computed: mark them empty.
        for c in np.flatnonzero((np.diff(kptr) == 0) & (np.diff(qptr) > 0)):
            pm[qptr[c]:qptr[c + 1]] = -np.inf
            po[qptr[c]:qptr[c + 1], Ev] = 0.0
        causal_args = (qpos_s, kpos_p) if is_causal else None
        self.last_refined_pairs_ = 0
        if sum(n_low):  # some row sum fell below _TINY: find and recompute those pairs
            self.last_refined_pairs_ = self._refine(Qs, pm, po, Kp, Vp, qptr, clamp, causal_args)
        ck.merge_partials(po, pm, slot, p, lse_shift[q0:q1], out[q0:q1], lse[q0:q1])
