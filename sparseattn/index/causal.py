"""CausalClusterIndex: one cluster index over every key whose clusters are fixed by the earliest keys only,
so that causal routing through it is strictly causal.

Build: the keys' first ``T`` by position (``prefix_budget_``, default ``max(ceil(p S / C), 16 C)``, at most S)
train the k-means codebook (``n_clusters`` centroids, spherical by default, on those keys centred by
their own mean); then every key is assigned to a codeword by the same rule as
:class:`~sparseattn.index.cluster.ClusterIndex` (``assign``), and stored once in cluster order.  Each
cluster is routed by the mean of the *training* keys of its codeword (raw coordinates; the codeword's
centroid scaled to the training keys' median norm for a codeword without training keys), and the keys
are stored raw (``mean_ = 0``).

Why strictly causal: a query that sees more than ``T`` keys sees every training key, so the codebook,
the routing vectors and each key's cluster (a function of the key and the codebook alone) depend only on
keys it sees; routed attention reads, of its routed clusters, only the keys at or before it, and ranks
a cluster without such a key last.  A query that sees at most ``T`` keys must attend to all of them
exactly: :func:`~sparseattn.attention.routed.routed_attention` does so with ``exact_prefix=True`` (its
``prefix_budget()`` is ``T``), and that is the only way to use this index for causal attention.  The
one input from later keys is numerical: each cluster's ``radius_`` (its members' largest distance to the
routing vector) sets the shift of the exp in routed attention, which cancels in the softmax (outputs
agree to rounding whatever the later keys are; the tests poison them).

Why this and not one index per aligned position segment (the former design, see the CHANGELOG): segments
cluster few keys each into few, broad clusters, need one k-means per segment and level, and split each
query's probes among its segments.  Measured side by side at S = 65,536 (d = 64, C = 256, 8 probes): on
clustered synthetic keys recall@64 0.93 at 1,032 keys per query in 0.44 s against 0.82 at 2,158 in
1.10 s; on the MiniLM store (2,048 queries) 0.84 / 0.63 against 0.76 / 0.58 on its two heads, with 34-41 %
fewer keys in a fifth to a quarter of the time.  It assumes the earliest keys are representative of the
rest (the codebook never changes); a stream whose keys drift far from its beginning routes worse.
"""

from __future__ import annotations

import math

import numpy as np

from ..inputs import positions
from ..threads import worker_threads
from .cluster import ClusterIndex, checked_keys
from .kmeans import assign_keys

__all__ = ["CausalClusterIndex"]


class CausalClusterIndex(ClusterIndex):
    """A :class:`~sparseattn.index.cluster.ClusterIndex` whose codebook is trained on the earliest keys
    only (see the module docstring); same parameters (``center``, ``route_by`` and ``split`` do not apply:
    keys are stored raw, clusters are routed by their training keys' mean, never split).

    Attributes (after :meth:`build`), besides ClusterIndex's: ``prefix_budget_`` (int, the training keys T:
    queries seeing at most T keys are exact), ``key_positions_`` ((S,) int64), ``train_ids_`` ((T,) int64
    the training keys' ids, the first T by position).

    Examples
    --------
    >>> import numpy as np
    >>> keys = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32)
    >>> index = CausalClusterIndex(n_clusters=16, n_probe=4).build(keys)
    >>> index.prefix_budget(), index.n_clusters_
    (1024, 16)
    """

    def build(self, keys: np.ndarray, key_positions: object = None) -> CausalClusterIndex:
        """Train the codebook on the first ``prefix_budget_`` keys by position, assign every key, store them
        in cluster order; returns ``self``.

        Parameters
        ----------
        keys : (S, E) float32 or float64 array, S >= 1 (kept as ``keys_``)
        key_positions : int array (S,), optional
            Default ``arange(S)``; ties keep the keys' order.
        """
        keys = checked_keys(keys)
        S, E = keys.shape
        kpos = positions(key_positions, S, "key_positions")
        C, p, n_train = self.sizes(S)
        T = int(min(S, max(math.ceil(p * S / C), 16 * C)))
        train_ids = np.argsort(kpos, kind="stable")[:T].astype(np.int64)
        train = keys[train_ids]
        mu = train.mean(axis=0, dtype=np.float64)
        centred = np.ascontiguousarray(train - mu.astype(keys.dtype))
        cent = self._kmeans(centred, C, min(n_train, T)).astype(keys.dtype)
        n = self.threads_
        with worker_threads(n):
            assignment = assign_keys(np.ascontiguousarray(keys - mu.astype(keys.dtype)), cent, self.assign, n)
        route_vec = _training_means(centred, assignment[train_ids], cent) + mu
        self.n_clusters_, self.n_probe_ = C, p
        self.prefix_budget_ = T
        self.key_positions_ = kpos
        self.train_ids_ = train_ids
        self.mean_ = np.zeros(E, dtype=keys.dtype)
        self.coarse_centroids_ = self.kmeans_centroids_ = cent
        self.parent_ = np.arange(C, dtype=np.int64)
        with worker_threads(n):
            self._store(keys, keys, assignment, route_vec.astype(keys.dtype), False)
        return self

    def labels(self, keys: np.ndarray, key_positions: object = None) -> np.ndarray:
        """Cluster of each key, as :meth:`build` with these arguments would assign it ((S,) int64 in
        ``[0, C)``), without changing this index (ClusterIndex's ``labels`` would train on every key)."""
        return CausalClusterIndex(**self.get_params()).build(keys, key_positions).assignment_.astype(np.int64)

    def prefix_budget(self) -> int:
        """Visible keys up to which a causal query is served exactly: the training keys T (a query that
        sees no more than T keys may not see every key the codebook was trained on)."""
        self._check_built()
        return self.prefix_budget_

    def same_layout(self, keys: np.ndarray, key_positions: np.ndarray) -> bool:
        """Whether this index was built over exactly these keys (same object) and key positions."""
        return self.keys_ is not None and keys is self.keys_ and np.array_equal(key_positions, self.key_positions_)


def _training_means(centred: np.ndarray, labels: np.ndarray, cent: np.ndarray) -> np.ndarray:
    """(C, E) float64: the mean of each codeword's training keys (``centred`` (T, E) with ``labels`` (T,)),
    or, for a codeword without training keys, its centroid scaled to the training keys' median norm."""
    C, E = cent.shape
    count = np.bincount(labels, minlength=C).astype(np.float64)
    sums = np.zeros((C, E), dtype=np.float64)
    np.add.at(sums, labels, centred.astype(np.float64))
    out = sums / np.maximum(count, 1.0)[:, None]
    empty = count == 0
    if empty.any():
        scale = float(np.median(np.linalg.norm(centred.astype(np.float64), axis=1)))
        c = cent[empty].astype(np.float64)
        out[empty] = c * (scale / np.maximum(np.linalg.norm(c, axis=1), 1e-300))[:, None]
    return out
