"""CausalClusterIndex: the strictly causal cluster index, a few nested prefix indexes whose codebooks are
each trained on keys every query they serve can see.

A causal query that sees ``c`` keys sees the first ``c`` keys by position.  The index is built for
bands of ``c`` (``bands_``):

* ``c <= T`` (``prefix_budget_``, ``T = max(ceil(p S / C), 16 C)`` at most S): no index, the query
  attends to all of its keys exactly (:func:`~sparseattn.attention.routed.routed_attention`'s exact
  prefix);
* ``lo < c <= hi`` for bands ``(T, 4T], (4T, 16T], ...`` (the last band runs to S, and absorbs a
  remainder shorter than its own ``lo``): one :class:`PrefixClusterIndex` over the first ``hi`` keys by
  position whose codebook is trained on the first ``lo`` of them (the same C and p in every band).

Why strictly causal: a query in a band sees every training key of its band's index, so that index's
codebook, its routing vectors (each cluster's mean training key) and each key's cluster (a function of
the key and the codebook alone) depend only on keys it sees; routed attention reads, of its routed
clusters, only the keys at or before it, and ranks a cluster without such a key last.  The one input
from later keys is numerical: each cluster's ``radius_`` (its members' largest distance to the routing
vector) sets the shift of the exp in routed attention, which cancels in the softmax (outputs agree to
rounding whatever the later keys are; the tests poison them).

Why bands and not one codebook of the first T keys for every query: a codebook of 16 C keys clusters
the rest of a long stream worse than one trained on a sample of all of it.  Measured at S = 65,536
(clustered synthetic keys, d = 64, C = 256, p = 8, ``benchmarks/bench_block_profile.py``): recall@64
0.934 with one codebook of the first 4,096 keys, 0.966 with the bands, 0.965 with the global index (not
strictly causal), reading 1,032 / 1,155 / 1,014 keys per query; the queries seeing more than 16,384 keys,
three quarters of them, go through a codebook of at least 16,384 keys.  The bands cost about 1.33 S
stored keys (each band stores its keys once in cluster order; as many again when the keys are not given in
position order, since each band then gathers its own) and a k-means per band, each paid when a query
first reaches the band.  A band's codebook still assumes its
earliest quarter represents the rest of it, and, like any k-means, it can land in a poor local optimum
(at S = 262,144 the last band's recall@64 ranged 0.949-0.996 over eight seeds, the global index's
0.980-1.000).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ..inputs import check_positive_int, positions
from ..threads import worker_threads
from .cluster import ClusterIndex, check_built, checked_keys, rows_seeing_at_most
from .kmeans import assign_keys

__all__ = ["CausalBand", "CausalClusterIndex", "PrefixClusterIndex"]


class PrefixClusterIndex(ClusterIndex):
    """A :class:`~sparseattn.index.cluster.ClusterIndex` over keys given in position order whose codebook
    is trained on the first ``n_train_keys`` of them only (one band of :class:`CausalClusterIndex`); same
    parameters (``center``, ``route_by`` and ``split`` do not apply: keys are stored raw, clusters are
    routed by their training keys' mean, never split).

    Attributes (after :meth:`build`), besides ClusterIndex's: ``prefix_budget_`` (int, the training keys:
    a causal query must see all of them to be routed through this index).
    """

    def build(self, keys: np.ndarray, n_train_keys: int | None = None) -> PrefixClusterIndex:
        """Train the codebook on ``keys[:n_train_keys]`` (centred by their mean), assign every key, store
        them in cluster order; returns ``self``.

        Parameters
        ----------
        keys : (S, E) float32 or float64 array, S >= 1, in position order (kept as ``keys_``)
        n_train_keys : int in [n_clusters, S], optional
            Default S.
        """
        keys = checked_keys(keys, finite=True)
        S, E = keys.shape
        C, p, n_train = self.sizes(S)
        T = S if n_train_keys is None else check_positive_int(n_train_keys, "n_train_keys", minimum=C, maximum=S)
        train = keys[:T]
        mu = train.mean(axis=0, dtype=np.float64)
        centred = np.ascontiguousarray(train - mu.astype(keys.dtype))
        cent = self._kmeans(centred, C, min(n_train, T)).astype(keys.dtype)
        n = self.threads_
        with worker_threads(n):
            assignment = assign_keys(np.ascontiguousarray(keys - mu.astype(keys.dtype)), cent, self.assign, n)
        route_vec = _training_means(centred, assignment[:T], cent) + mu
        self.n_clusters_, self.n_probe_ = C, p
        self.prefix_budget_ = T
        self.mean_ = np.zeros(E, dtype=keys.dtype)
        self.coarse_centroids_ = self.kmeans_centroids_ = cent
        self.parent_ = np.arange(C, dtype=np.int64)
        with worker_threads(n):
            self._store(keys, keys, assignment, route_vec.astype(keys.dtype), False)
        return self

    def prefix_budget(self) -> int:
        """The training keys: a causal query that sees no more of them may not see every one."""
        self._check_built()
        return self.prefix_budget_

    def labels(self, keys: np.ndarray, n_train_keys: int | None = None) -> np.ndarray:
        """Cluster of each key, as :meth:`build` with these arguments would assign it ((S,) int64 in
        ``[0, C)``); builds a new index, this one is unchanged."""
        return PrefixClusterIndex(**self.get_params()).build(keys, n_train_keys).assignment_.astype(np.int64)


class CausalBand:
    """One band of a :class:`CausalClusterIndex`: queries that see more than ``lo`` and at most ``hi``
    keys route through ``index``, a :class:`PrefixClusterIndex` over the keys ``ids`` ((hi,) int64: the
    first ``hi`` keys by position, in position order) with a codebook of the first ``lo``, built on first
    use (a batch of queries that never reaches this band never pays for it; thread-safe); ``leading``:
    whether ``ids`` is ``arange(hi)`` (keys given in position order)."""

    def __init__(self, lo: int, hi: int, ids: np.ndarray, keys: np.ndarray, params: dict[str, Any]) -> None:
        self.lo, self.hi, self.ids = lo, hi, ids
        self.leading = _is_leading(ids)
        self._keys, self._params = keys, params
        self._index: PrefixClusterIndex | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CausalBand(lo={self.lo}, hi={self.hi}, built={self._index is not None})"

    @property
    def index(self) -> PrefixClusterIndex:
        """The band's index (built now if it was not yet)."""
        if self._index is None:
            with self._lock:
                if self._index is None:
                    self._index = PrefixClusterIndex(**self._params).build(self.take(self._keys), self.lo)
        return self._index

    @property
    def is_built(self) -> bool:
        return self._index is not None

    def take(self, x: np.ndarray) -> np.ndarray:
        """The rows of ``x`` (S, ...) of this band's keys, in its order (a view when ``leading``)."""
        return x[:self.hi] if self.leading else x[self.ids]


def _is_leading(ids: np.ndarray) -> bool:
    """Whether ``ids`` is ``arange(len(ids))``."""
    return bool(ids.size == 0 or (ids[0] == 0 and np.all(np.diff(ids) == 1)))


class CausalClusterIndex:
    """The strictly causal cluster index (see the module docstring): exact attention for queries that see
    at most ``prefix_budget()`` keys, one :class:`PrefixClusterIndex` per band of longer ones.

    Parameters: those of :class:`~sparseattn.index.cluster.ClusterIndex` (``n_clusters`` / ``n_probe``
    resolved once for all S keys and used in every band; ``center``, ``route_by`` and ``split`` do not
    apply).

    Attributes (after :meth:`build`): ``keys_`` ((S, E), as given), ``key_positions_`` ((S,) int64),
    ``order_`` ((S,) int64, key ids in position order, stable), ``prefix_budget_`` (int T),
    ``n_clusters_`` / ``n_probe_`` (C, p of every band), ``bands_`` (list of :class:`CausalBand`, by
    increasing ``lo``; empty when S <= T).  :meth:`build` fixes the bands; each band's index is built
    when a query first reaches it (queries placed after a cache, as in decode, build the last one only).

    Examples
    --------
    >>> import numpy as np
    >>> keys = np.random.default_rng(0).standard_normal((8192, 16)).astype(np.float32)
    >>> index = CausalClusterIndex(n_clusters=16, n_probe=4).build(keys)
    >>> index.prefix_budget(), [(b.lo, b.hi) for b in index.bands_]
    (2048, [(2048, 8192)])
    """

    def __init__(self, **params: Any) -> None:
        self._params = ClusterIndex(**params).get_params()  # checked there
        self.keys_: np.ndarray | None = None
        self.bands_: list[CausalBand] = []

    def get_params(self) -> dict[str, Any]:
        """name -> value of every constructor parameter (those of ClusterIndex)."""
        return dict(self._params)

    def __repr__(self) -> str:
        return "CausalClusterIndex(" + ", ".join(f"{k}={v!r}" for k, v in self._params.items()) + ")"

    @property
    def threads_(self) -> int:
        """Worker threads in use (as ClusterIndex's)."""
        return ClusterIndex(**self._params).threads_

    is_built = ClusterIndex.is_built

    def _check_built(self) -> None:
        check_built(self)

    def build(self, keys: np.ndarray, key_positions: object = None) -> CausalClusterIndex:
        """Build every band's index; returns ``self``.

        Parameters
        ----------
        keys : (S, E) float32 or float64 array, S >= 1 (kept as ``keys_``)
        key_positions : int array (S,), optional
            Default ``arange(S)``; ties keep the keys' order.
        """
        keys = checked_keys(keys, finite=True)
        S = keys.shape[0]
        kpos = positions(key_positions, S, "key_positions")
        C, p, _ = ClusterIndex(**self._params).sizes(S)
        T = int(min(S, max(math.ceil(p * S / C), 16 * C)))
        order = np.argsort(kpos, kind="stable").astype(np.int64)
        params = dict(self._params, n_clusters=C, n_probe=p)
        bands = []
        lo = T
        while lo < S:
            hi = 4 * lo
            if hi >= S or S - hi < lo:
                hi = S
            bands.append(CausalBand(lo, hi, order[:hi], keys, params))
            lo = hi
        self.keys_ = keys
        self.key_positions_ = kpos
        self.order_ = order
        self.prefix_budget_ = T
        self.n_clusters_, self.n_probe_ = C, p
        self.bands_ = bands
        return self

    def prefix_budget(self) -> int:
        """Visible keys up to which a causal query is served exactly (T)."""
        self._check_built()
        return self.prefix_budget_

    def prefix_rows(self, qpos: np.ndarray, kpos: np.ndarray, kpos_ascending: np.ndarray | None = None
                    ) -> np.ndarray:
        """Rows that see between 1 and :meth:`prefix_budget` keys: (n,) int64, ascending (as
        ClusterIndex's)."""
        return rows_seeing_at_most(self.prefix_budget(), qpos, kpos, kpos_ascending)

    def band_rows(self, qpos: np.ndarray) -> list[tuple[CausalBand, np.ndarray]]:
        """(band, rows) for every band with rows: the rows (ascending int64) whose query position ``qpos``
        (L,) int64 sees more than ``band.lo`` and at most ``band.hi`` of the keys."""
        self._check_built()
        visible = np.searchsorted(self.key_positions_[self.order_], qpos, side="right")
        out = []
        for band in self.bands_:
            rows = np.flatnonzero((visible > band.lo) & (visible <= band.hi))
            if rows.size:
                out.append((band, rows))
        return out

    def labels(self, keys: np.ndarray, key_positions: object = None) -> np.ndarray:
        """Cluster of each key in the index that serves the queries seeing every key (the last band), as
        :meth:`build` with these arguments would assign it: (S,) int64 in ``[0, C)``; -1 for all keys when
        S <= T (no band: every query is exact).  Builds a new index; this one is unchanged."""
        index = CausalClusterIndex(**self._params).build(keys, key_positions)
        out = np.full(index.keys_.shape[0], -1, dtype=np.int64)
        if index.bands_:
            last = index.bands_[-1]
            out[last.ids] = last.index.assignment_
        return out

    def same_layout(self, keys: np.ndarray, key_positions: np.ndarray) -> bool:
        """Whether this index was built over exactly these keys (same object) and key positions."""
        return self.keys_ is not None and keys is self.keys_ and np.array_equal(key_positions, self.key_positions_)


def _training_means(centred: np.ndarray, labels: np.ndarray, cent: np.ndarray) -> np.ndarray:
    """(C, E) float64: the mean of each codeword's training keys (``centred`` (T, E) with ``labels`` (T,)),
    or, for a codeword without training keys, its centroid scaled to the training keys' median norm."""
    C, E = cent.shape
    count = np.bincount(labels, minlength=C).astype(np.float64)
    sums = np.empty((C, E), dtype=np.float64)
    for e in range(E):  # a bincount per dimension: np.add.at over rows took 2 ms at 8,192 x 32
        sums[:, e] = np.bincount(labels, weights=centred[:, e].astype(np.float64), minlength=C)
    out = sums / np.maximum(count, 1.0)[:, None]
    empty = count == 0
    if empty.any():
        scale = float(np.median(np.linalg.norm(centred.astype(np.float64), axis=1)))
        c = cent[empty].astype(np.float64)
        out[empty] = c * (scale / np.maximum(np.linalg.norm(c, axis=1), 1e-300))[:, None]
    return out
