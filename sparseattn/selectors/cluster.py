"""Cluster routing: k-means over the keys, each query attends to the keys of its best clusters.

:class:`ClusterSelector` is the selector face of two parts that also work on their own:

* :class:`sparseattn.index.cluster.ClusterIndex`: the keys are centred (subtracting the mean key changes
  no softmax), a k-means with ``n_clusters`` centroids is trained on a sample of them (Lloyd rounds:
  spherical, i.e. cosine assignment and unit-norm centroids, by default; Euclidean with
  ``spherical=False``), then every key is assigned to a centroid by ``assign``: default ``"ip"``, the
  centroid of largest inner product ``k.c`` (the same score that routes queries); ``"l2"``, the nearest
  centroid.  Measured at n = 16,384 (d = 64, C = 128, n_probe = 8): on clustered keys "ip" kept 0.998 of
  the softmax mass (output error 0.019) against 0.90 (0.35) for "l2"; on Gaussian keys neither works
  (0.42 / 0.09 of the mass).  Keys (and at attention time values) are permuted once into cluster order,
  so each cluster is one contiguous block: a CSR over clusters.  Optionally (``split > 0``) clusters
  larger than ``split`` times the mean size are split by a k-means of their members (members go to the
  nearest part), because inner-product assignment piles keys onto the centroids of largest norm: fewer
  keys per query, at some recall.  Each cluster is then represented by the mean of its keys
  (``route_by="mean"``, the default: unit-norm spherical centroids ignore how large a cluster's keys
  are, which the inner product rewards) or by its k-means centroid.  Each query is routed to the
  ``n_probe`` clusters of largest score ``q.c`` against those vectors.
* :func:`sparseattn.attention.routed.routed_attention`: exact softmax attention over every key of the
  routed clusters, per cluster ``exp(scale Q_c K_c^T - m) [V_c, 1]`` as BLAS products, partial results
  merged per query by log-sum-exp (:mod:`sparseattn.kernels.merge`, the kernel of
  :mod:`sparseattn.attention.merge`).

Modes:

* ``mode="topk"``: ``query(q, k)`` is the exact top-k by inner product among the keys of the routed
  clusters (per-cluster ``Q_c K_c^T``, per-row top-k, then a per-query merge of the candidate lists);
* ``mode="block"``: the selector ``attends`` (:meth:`ClusterSelector.attend`); ``query(q, k)`` ignores
  ``k`` and returns the pattern of all routed keys (about L x n_probe x S / n_clusters ids: large).

Exactness of ``attend``: the shift ``m`` is not the row maximum but a Cauchy-Schwarz upper bound
``scale q.c + |scale| |q| r_c`` (``c``: the cluster's routing vector, ``r_c``: its members' largest
distance to it), applied in one fused pass with the exp, so ``exp`` never overflows.  Pairs whose
bound overshoots so far that their row sum drops below 1e-20 are recomputed with a tighter shift, and
weights below ``exp(-80)`` (float32; ``exp(-700)`` float64) are clamped up to it (subnormal floats made
the next GEMM 160x slower): a relative change below ``2e-15 * n_keys``.  The result equals softmax
attention restricted to the routed keys up to floating-point rounding (tests: 1e-5 in float32, 1e-12 in
float64).

Causal (strictly): a causal query never uses the index over all keys, whose k-means, centring and routing
vectors see later keys.  It goes through one :class:`~sparseattn.index.causal.CausalClusterIndex` instead
(built on first causal use and kept).  A query that sees at most
``T = max(ceil(n_probe S / n_clusters), 16 n_clusters)`` keys reads all of them exactly (block attention:
attends to all; top-k mode: the exact top-k among them, whatever ``exact_prefix``).  A longer one that
sees c keys routes through the index of its band (``(T, 4T]``, ``(4T, 16T]``, ..., the last to S): built
over the first ``hi`` keys by position with a codebook trained on the band's first ``lo``, all of which
the query sees; every key joins a codeword's cluster by itself, clusters are routed by their training
keys' mean, and the query reads the visible keys of its ``n_probe`` clusters of largest ``q . r`` among
those holding a key at or before it.  A row's output depends only on keys and values at or before its
position (``tests/test_causality.py``; for block attention up to float rounding: the exp's shift uses
each cluster's radius over all its members).  Measured at S = 65,536 (clustered synthetic keys, d = 64,
``benchmarks/results/block-profile.md``): recall@64 at least the global index's (masked to the visible
keys, not strictly causal) at about its speed; on real MiniLM keys ``benchmarks/results/causal-cluster.md``.
A band's codebook assumes its earliest quarter represents the rest of it.  The band indexes store raw keys,
route by their training keys' mean and are never split: ``center``, ``route_by`` and ``split`` do not apply
to them, and ``coarse`` (a two-level build over all keys) is refused for strictly causal queries.

Threads: the per-cluster products run on ``n_threads`` worker threads with BLAS held to one thread each
(on a machine whose other core is busy, multi-threaded BLAS on these small products is 10x slower);
Numba kernels use ``n_threads`` too (both through :mod:`sparseattn.threads`), and so do the k-means
rounds (:func:`sparseattn.index.kmeans.lloyd`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ..index.causal import CausalBand, CausalClusterIndex
from ..index.cluster import ASSIGN, ROUTE_BY, ClusterIndex, key_spans
from ..index.routing import check_budget, mass_routes
from ..inputs import positions
from ..kernels import cluster as ck
from ..pattern import SparsePattern
from ..threads import worker_threads
from .base import Selector, fill_small_rows
from .params import Param, faiss_seed, non_negative, positive
from .registry import attention_for, register

_MODES = ("topk", "block")
# Parameters that configure the ClusterIndex (the others, mode, exact_prefix, strict_causal, ..., are
# query-time choices).
_INDEX_PARAMS = ("n_clusters", "n_probe", "train_sample", "n_iter", "seed", "center", "spherical", "assign",
                 "route_by", "split", "spread", "coarse", "n_threads")


def _coarse_not_causal(coarse: int) -> str:
    return (f"coarse={coarse} (the two-level build) is one index over all keys; strictly causal queries use "
            f"prefix indexes trained on the keys they may see: pass strict_causal=False or coarse=None")


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else "must be one of " + ", ".join(repr(c) for c in choices)
    return check


def _at_least_minus_one(v: Any) -> str | None:
    return None if v is None or v >= -1 else "must be >= -1 (-1: every unread cluster, 0: off)"


def _unit_open(v: Any) -> str | None:
    return None if v is None or 0 < v <= 1 else "must lie in (0, 1] (or None: fixed n_probe)"


# Attributes of the built ClusterIndex that ClusterSelector exposes as read-only properties, with their docs.
_INDEX_ATTRIBUTES = {
    "n_clusters_": "Clusters in force after splitting.",
    "n_probe_": "Clusters each query is routed to.",
    "centroids_": "(C, E) routing vectors in centred coordinates.",
    "kmeans_centroids_": "(C, E) centroids that assigned the keys.",
    "coarse_centroids_": "(C0, E) centroids of the first k-means.",
    "parent_": "(C,) int64 coarse cluster of each final cluster.",
    "mean_": "(E,) mean key (zeros when center=False or when a few keys dominate it: index.cluster.key_mean).",
    "assignment_": "(S,) int32 cluster of each key.",
    "perm_": "(S,) int64 key ids in cluster order.",
    "cluster_ptr_": "(C + 1,) int64 cluster -> range of perm_.",
    "radius_": "(C,) float64 largest member distance to the routing vector.",
    "keys_perm_": "(S, E) centred keys in cluster order.",
}


def _forward_index_attributes(cls: type[ClusterSelector]) -> type[ClusterSelector]:
    """Class decorator adding a property ``name`` returning ``self.index_.<name>`` per _INDEX_ATTRIBUTES."""
    def forward(name: str, doc: str) -> property:
        return property(lambda self: getattr(self.index_, name), doc=doc)

    for name, doc in _INDEX_ATTRIBUTES.items():
        setattr(cls, name, forward(name, doc))
    return cls


@register
@_forward_index_attributes
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
        2,360), and 5 iterations took half the k-means time of 10 (~2.8 ms against 5.7 ms of a 22 ms build +
        attend at S = 4,096, with FAISS's k-means then).
    seed : int, default 0
        Seed of the training sample and of the k-means initialisation.
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
        Causal block attention with ``strict_causal=False`` only: a query that can see at most
        ``ceil(n_probe * S / n_clusters)`` keys (the routed keys of an average query) attends to all of
        them exactly instead of through its routed clusters.  Costs at most as much as routing those rows.
        (Strictly causal rows that see at most the causal index's training keys are always exact.)
    strict_causal : bool, default True
        Causal queries only.  True: the causal index described under "Causal" below (a row depends only
        on keys and values at or before it).  False: routing over the one index of all keys, masked to
        each query's visible keys: k-means, centring and routing vectors see later keys, so which past
        keys a row reads depends on them: not for training or evaluating causal models.
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
    coarse : int, optional
        Two-level build (``mode=block`` with many small clusters): a k-means of ``coarse`` clusters, each
        split by a k-means of its members into parts of about ``S / n_clusters`` keys (each key to its
        nearest part), instead of one k-means of ``n_clusters``: at S = 65,536, 1,024 clusters build in
        71-95 ms against 500-530 ms, with about the same keys per query for a given recall
        (:class:`~sparseattn.index.cluster.ClusterIndex`, ``docs/cluster-routing.md``).  Default None.
        Not with ``split``; refused for strictly causal queries (their prefix indexes train on the keys
        each query may see): use ``strict_causal=False``.
    spread : float, default 0 (off)
        Rank clusters by ``q . c + spread |q| sigma_c`` (``sigma_c``: root mean per-dimension variance of
        the cluster's keys) instead of ``q . c``: a cluster whose keys spread widely can hold a key far
        along q although its mean scores low.  Keys per query for recall@64 0.9
        (``benchmarks/results/block-routing-study.md``, ``spread=1.5``): at C = round(sqrt(S)) up to 13 %
        fewer on real MiniLM keys (65k store: head 5 7,664 -> 6,646; up to 1 % more on the most peaked
        heads) and 13 % fewer on clustered keys; at 4x as many clusters 3-22 % fewer (head 5 3,735 ->
        2,896).  Clusters that spread widely are often the
        larger ones, so at a fixed ``n_probe`` a query may read more keys (clustered 65k, 8 probes:
        1,970 -> 2,150, recall@64 0.964 -> 0.983).  Fixed ``n_probe`` routing only: refused with
        ``estimate`` or ``top_p``, which plan their own routing.
    estimate : int, default 0 (off)
        Block attention only: the clusters a query does not read are estimated from per-cluster
        statistics (count, mean key, key spread, mean value, pooled value-on-key regression) instead of
        counting as zero, and merged with the routed ones by log-sum-exp.  N > 0: the next N clusters
        after the routed ones; -1: every unread cluster.  Causal queries only count the keys at or before
        them (prefix statistics).  Measured on the shipped 16k store (C = 128, n_probe = 8, 1,000-1,440
        keys per query, heads 0-3): output relative error 0.11-0.53 off, 0.018-0.080 with ``estimate=-1``
        (``benchmarks/results/estimate.md``).
    top_p : float in (0, 1], optional
        Block attention only: instead of ``n_probe`` clusters, route clusters in order of estimated mass
        until ``top_p`` of the query's estimated mass, with ``min_keys`` / ``max_keys`` (default 0 and
        ``4 * n_probe * S / C``) as floor and cap of keys read (a query reads its best cluster even when
        that cluster alone passes the cap); peaky queries read few keys, flat ones more.
        Block-mode ``query`` then returns those routed keys (masses at the default scale 1/sqrt(E)).

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
    last_keys_read_ : (L,) int64
        Keys each query of the last ``attend`` read exactly (see ``stats["keys_read"]`` of
        :func:`~sparseattn.attention.routed.routed_attention`).
    index_ : ClusterIndex
        The index over all keys, built on first use (a selector used only causally never builds it);
        every attribute above except ``last_refined_pairs_`` and ``last_keys_read_`` is read from it
        (``kmeans_centroids_``, ``coarse_centroids_``, ``parent_``, ``keys_perm_`` too).
    causal_index(key_positions) : CausalClusterIndex
        The strictly causal index of causal queries (see "Causal" above).

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
    requires = None  # the k-means is the library's own (no FAISS)
    # Keys beyond float32's range stay refused as when FAISS trained the index in float32: the selector's
    # float64 paths at such magnitudes (top-k mode, estimates, causal bands) are not tested there.
    index_dtype = np.float32
    guarantee = ("k-means clusters of the (centred) keys, each query routed to its n_probe clusters of "
                 "largest q.c (plus spread * |q| * sigma_c when spread > 0). mode=topk: exact top-k by "
                 "inner product among the routed clusters' keys. "
                 "mode=block: attend() is exact softmax attention restricted to all keys of the routed "
                 "clusters (query() returns that key set). n_probe = n_clusters is exact full attention. "
                 "Causal: strictly causal (a query seeing at most T = max(n_probe*S/C, 16C) keys reads all of "
                 "them exactly, a longer one routes through the prefix index of its band (T, 4T], (4T, 16T], "
                 "..., whose codebook it sees whole); "
                 "strict_causal=False: one global index, masked, not strict, a query seeing at most n_probe*S/C "
                 "keys attends to all of them with exact_prefix); "
                 "no key -> zeros and lse = -inf. estimate != 0 adds an estimate of "
                 "unread clusters from per-cluster statistics (not exact); top_p routes by estimated mass.")
    params_spec = {
        "n_clusters": Param(int, None, "k-means clusters C (default round(sqrt(S)))", positive),
        "n_probe": Param(int, None, "clusters per query (default min(8, C))", positive),
        "mode": Param(str, "topk", "'topk' (exact top-k in routed clusters) or 'block' (attend())",
                      _one_of(_MODES), when="query"),
        "train_sample": Param(int, None, "keys sampled to train k-means (default min(S, 64*C))", positive),
        "n_iter": Param(int, 5, "k-means iterations", positive),
        "seed": Param(int, 0, "seed of the sample and the k-means initialisation", faiss_seed),
        "center": Param(bool, True, "subtract the mean key before clustering"),
        "spherical": Param(bool, True, "spherical (cosine) k-means"),
        "assign": Param(str, "ip", "key -> cluster rule: 'ip' (max k.c) or 'l2' (nearest centroid)",
                        _one_of(ASSIGN)),
        "route_by": Param(str, "mean", "route to clusters by the 'mean' of their keys or the k-means "
                          "'centroid'", _one_of(ROUTE_BY)),
        "n_threads": Param(int, None, "worker threads (default: numba.get_num_threads())", positive,
                           when="query"),
        "exact_prefix": Param(bool, True, "causal, mode=block, strict_causal=False: a query that can see at "
                              "most n_probe*S/C keys attends to all of them exactly", when="query"),
        "strict_causal": Param(bool, True, "causal: strictly causal (prefix indexes whose codebooks each "
                               "query sees whole); False: one index over all keys masked to the visible ones "
                               "(the keys a row reads depend on later keys)", when="query"),
        "split": Param(float, 0.0, "split clusters larger than split * S / n_clusters (0 = never; "
                       "a speed/recall trade)", non_negative),
        "coarse": Param(int, None, "two-level build: k-means of coarse clusters, each split by a k-means of its "
                        "members into parts of about S / n_clusters keys (None = one k-means of n_clusters)",
                        positive),
        "spread": Param(float, 0.0, "route by q.c + spread * |q| * sigma_c (sigma_c: the cluster's key spread; "
                        "0 = q.c alone); n_probe routing only, not with estimate or top_p", non_negative),
        "estimate": Param(int, 0, "mode=block: estimate unread clusters from their statistics (0 = off, N = "
                          "the next N clusters after the routed ones, -1 = every unread cluster)", _at_least_minus_one,
                          when="query"),
        "top_p": Param(float, None, "mode=block: route clusters by estimated mass until top_p of it "
                       "(None = fixed n_probe)", _unit_open, when="query"),
        "min_keys": Param(int, 0, "top_p: floor of keys read per query", non_negative, when="query"),
        "max_keys": Param(int, None, "top_p: cap of keys read per query (default 4 * n_probe * S / C; "
                          "a query always reads its best cluster)", non_negative, when="query"),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._make_index()  # the index checks the cross-parameter rules (n_probe <= n_clusters, ...)
        p = self._params
        if p["spread"] and (p["estimate"] != 0 or p["top_p"] is not None):
            raise ValueError(f"cluster: spread={p['spread']} changes the fixed n_probe routing; estimate and top_p "
                             f"plan their own routing and would ignore it: pass spread=0, or estimate=0 and "
                             f"top_p=None.")

    def _make_index(self) -> ClusterIndex:
        return ClusterIndex(**{p: self._params[p] for p in _INDEX_PARAMS})

    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False, bias: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(n_keys=n_keys, dim=dim, is_causal=is_causal, bias=bias)
        c = self._params["n_clusters"]
        if n_keys is not None:
            if n_keys < 1:
                reasons.append("cluster routing needs at least one key")
            elif c is not None and c > n_keys:
                reasons.append(f"n_clusters={c} > n_keys={n_keys}; use n_clusters <= n_keys "
                               f"(default round(sqrt(S)))")
        if self.attends and bias:
            reasons.append("bias is not supported by cluster:mode=block (block mode attends by itself); "
                           "use mode=topk or drop bias")
        if is_causal and self._params["strict_causal"] and self._params["coarse"] is not None:
            reasons.append(_coarse_not_causal(self._params["coarse"]))
        return reasons

    # ---------------------------------------------------------------------------------- capabilities
    @property
    def attends(self) -> bool:  # type: ignore[override]
        """True in block mode: :meth:`attend` computes the attention itself (no pattern is materialised)."""
        return self._params["mode"] == "block"

    @property
    def fills_small_rows(self) -> bool:  # type: ignore[override]
        # Block mode's pattern is exactly the routed key set attend() uses: never padded.
        return self._params["mode"] != "block"

    @property
    def n_threads(self) -> int:
        """Worker threads in use: the ``n_threads`` parameter, or Numba's current thread count."""
        t = self._params["n_threads"]
        return int(t) if t is not None else int(numba.get_num_threads())

    # ----------------------------------------------------------------------------------------- work
    def _build(self, keys: np.ndarray) -> None:
        self._make_index().sizes(keys.shape[0])  # size errors now; the k-means when first needed
        self._index: ClusterIndex | None = None
        self._causal: CausalClusterIndex | None = None
        self.last_refined_pairs_ = 0
        self.last_keys_read_ = np.zeros(0, dtype=np.int64)

    @property
    def index_(self) -> ClusterIndex:
        """The ClusterIndex over all keys, built on first use (non-causal queries, the attributes above):
        strictly causal queries use :meth:`causal_index` instead and never need it."""
        self._require_built("index_")
        index = self._index
        if index is None:
            index = self._index = self._make_index().build(self.keys_)
        return index

    def causal_index(self, key_positions: object = None) -> CausalClusterIndex:
        """The strictly causal index of causal queries
        (:class:`~sparseattn.index.causal.CausalClusterIndex`: queries that see at most its
        ``prefix_budget()`` keys attend to all of them exactly, longer ones route through the prefix index of
        their band, whose codebook they see whole).  Built on first use and kept while the key positions
        stay the same.

        key_positions : int array (S,), optional; default ``arange(S)``.
        """
        self._require_built("causal_index")
        if self._params["coarse"] is not None:
            raise ValueError(f"cluster: {_coarse_not_causal(self._params['coarse'])}.")
        kpos = positions(key_positions, self.keys_.shape[0], "key_positions")
        index = self._causal
        if index is None or not index.same_layout(self.keys_, kpos):
            index = self._causal = CausalClusterIndex(**{p: self._params[p] for p in _INDEX_PARAMS}).build(
                self.keys_, kpos)
        return index

    def route(self, queries: np.ndarray, *, check_finite: bool = True) -> np.ndarray:
        """The clusters each query is routed to.

        Parameters
        ----------
        queries : float array, shape (L, E); computed in the keys' dtype.

        Returns
        -------
        (L, n_probe_) int32 cluster ids, best centroid score ``q . c`` first.
        """
        self._require_built("route")
        q = self.index_.validated_queries(queries, check_finite)
        n = self.n_threads
        with worker_threads(n):
            return self.index_.route_rows(q, n)[0]

    def _query(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray, kpos: np.ndarray
               ) -> SparsePattern:
        n = self.n_threads
        prm = self._params
        S = self.keys_.shape[0]
        if is_causal and prm["strict_causal"]:
            # strictly causal: the causal index, whose small rows are always exact
            index = self.causal_index(kpos)
            q = np.ascontiguousarray(q, dtype=self.keys_.dtype)
            if prm["mode"] != "block":
                return _causal_topk(index, q, min(k, S), qpos, kpos, n)
            # the cap of the mass-driven routes is the causal index's, as in attend()
            budget = check_budget(index.prefix_budget(), 0, prm["top_p"], prm["min_keys"], prm["max_keys"])
            max_keys = None if budget is None else budget[3]
            with worker_threads(n):
                pattern = _band_patterns(index, qpos, lambda band, rows: self._block_pattern(
                    band.index, q[rows], True, qpos[rows], band.take(kpos), n, max_keys))
            return fill_small_rows(pattern, index.prefix_budget(), True, qpos, kpos)
        index = self.index_
        with worker_threads(n):
            if prm["mode"] != "block":
                route = index.route_rows(q, n, key_spans(index, kpos)[1], qpos)[0] if is_causal else \
                    index.route_rows(q, n)[0]
                return index.search_routed(q, route, min(k, S), is_causal, qpos, kpos, n)
            pattern = self._block_pattern(index, q, is_causal, qpos, kpos, n)
        if is_causal and prm["exact_prefix"]:
            # the rows attend() computes exactly over every visible key
            pattern = fill_small_rows(pattern, index.prefix_budget(), True, qpos, kpos)
        return pattern

    def _block_pattern(self, index: ClusterIndex, q: np.ndarray, is_causal: bool, qpos: np.ndarray,
                       kpos: np.ndarray, n: int, max_keys: int | None = None) -> SparsePattern:
        """Every key block-mode attention reads through ``index`` (routed clusters, or the mass-driven
        routes with ``top_p``, capped at ``max_keys``, default the parameter's), before the exact prefix;
        inside ``worker_threads``."""
        prm = self._params
        if prm["top_p"] is not None:
            # the mass-driven routes attend() reads (at the default scale 1/sqrt(E))
            cap = prm["max_keys"] if max_keys is None else max_keys
            mr = mass_routes(index, q, top_p=prm["top_p"], min_keys=prm["min_keys"], max_keys=cap,
                             is_causal=is_causal, query_positions=qpos, key_positions=kpos, n_threads=n,
                             check_finite=False)[0]
            C = index.n_clusters_
            route = np.where(mr < 0, C, mr).astype(np.int32)
            kptr = np.append(index.cluster_ptr_, index.cluster_ptr_[-1])  # cluster C: empty padding
            indptr, indices = ck.routed_pattern(route, kptr, index.perm_, bool(is_causal), qpos, kpos)
            return SparsePattern(indptr, indices, index.keys_.shape[0], validate=False)
        # causal: clusters of later keys rank last, as in routed_attention
        route = index.route_rows(q, n, key_spans(index, kpos)[1], qpos)[0] if is_causal else \
            index.route_rows(q, n)[0]
        return index.routed_keys(route, is_causal, qpos, kpos)

    def attend(self, queries: np.ndarray, values: np.ndarray, *, scale: float | None = None,
               is_causal: bool = False, query_positions: object = None, key_positions: object = None,
               check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Exact softmax attention of each query over every key of its routed clusters.

        Works in either mode (``mode`` only changes what :meth:`query` returns and ``attends``).  Computed
        by :func:`sparseattn.attention.cluster.cluster_attention`:
        :func:`sparseattn.attention.routed.routed_attention` over ``index_`` (strictly causal queries:
        :meth:`causal_index`) with this selector's
        ``exact_prefix`` and ``n_threads``: the parameters, results (``output`` (L, Ev), ``lse`` (L,)) and
        errors are those documented there; ``last_refined_pairs_`` records its ``refined_pairs`` and
        ``last_keys_read_`` its per-query ``keys_read``.  ``estimate``, ``top_p``, ``min_keys`` and
        ``max_keys`` add the estimate of unread clusters and the mass-driven budget (documented there).
        """
        self._require_built("attend")
        stats: dict[str, Any] = {}
        out = attention_for(ClusterSelector.name)(self, queries, values, scale=scale, is_causal=is_causal,
                                                  query_positions=query_positions, key_positions=key_positions,
                                                  check_finite=check_finite, stats=stats)
        self.last_refined_pairs_ = stats.get("refined_pairs", 0)
        self.last_keys_read_ = stats["keys_read"]
        return out


def _band_patterns(index: CausalClusterIndex, qpos: np.ndarray,
                   pattern_of: Callable[[CausalBand, np.ndarray], SparsePattern]) -> SparsePattern:
    """(L, S) pattern of the rows routed through the bands of a causal index: ``pattern_of(band, rows)``
    gives the rows' pattern over the band's keys, mapped here to key ids; other rows (exact prefix, no
    key) are empty."""
    L, S = qpos.shape[0], index.keys_.shape[0]
    counts = np.zeros(L, dtype=np.int64)
    pieces = []
    for band, rows in index.band_rows(qpos):
        pat = pattern_of(band, rows)
        counts[rows] = pat.nnz_per_row
        pieces.append((rows, pat, band))
    indptr = np.zeros(L + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    for rows, pat, band in pieces:
        per_row = pat.nnz_per_row
        offset = np.arange(pat.nnz, dtype=np.int64) - np.repeat(pat.indptr[:-1], per_row)
        indices[np.repeat(indptr[rows], per_row) + offset] = band.ids[pat.indices]
    if not all(band.leading for _, _, band in pieces):  # band order is position order: sort by key id
        indices = indices[np.lexsort((indices, np.repeat(np.arange(L), counts)))]
    return SparsePattern(indptr, indices, S, validate=False)


def _causal_topk(index: CausalClusterIndex, q: np.ndarray, k: int, qpos: np.ndarray, kpos: np.ndarray,
                 n_threads: int) -> SparsePattern:
    """Strictly causal top-k through the causal index: a row that sees more than ``index.prefix_budget()``
    keys takes the exact top-k among the visible keys of its routed clusters in its band's index; a
    shorter one the exact top-k among all of its visible keys."""
    from ..kernels.topk import rerank_topk

    S = index.keys_.shape[0]

    def routed(band: CausalBand, rows: np.ndarray) -> SparsePattern:
        part, kp, qs, qp = band.index, band.take(kpos), q[rows], qpos[rows]
        route = part.route_rows(qs, n_threads, key_spans(part, kp)[1], qp)[0]
        return part.search_routed(qs, route, min(k, band.hi), True, qp, kp, n_threads)

    with worker_threads(n_threads):
        padded = _band_patterns(index, qpos, routed).to_padded(k)
        order = index.order_
        visible = np.searchsorted(kpos[order], qpos, side="right")
        small = np.flatnonzero(visible <= index.prefix_budget())
        for a in range(0, small.size, 512):  # (rows x T) candidate blocks stay small
            rows = small[a:a + 512]
            width = int(visible[rows].max(initial=0))
            if width == 0:
                padded[rows] = -1
                continue
            within = np.arange(width)
            cand = np.where(within[None, :] < visible[rows][:, None], order[within][None, :], -1)
            padded[rows] = rerank_topk(q[rows], index.keys_, cand, k, True)[1]
    return SparsePattern.from_padded(padded, S)
