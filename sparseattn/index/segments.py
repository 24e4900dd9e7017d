"""Strictly causal cluster routing: the keys, in position order, cut into aligned dyadic segments, each
segment clustered on its own keys only.

A causal query at position ``t`` sees the prefix of ``c`` keys with position <= ``t`` (in position order).
That prefix is covered by (:func:`dyadic_cover`):

* an *exact tail* ``[B * floor(c / B), c)`` of fewer than ``B`` keys, read exactly, and
* aligned dyadic segments ``[t * 2^l * B, (t + 1) * 2^l * B)``, one per set bit of ``floor(c / B)``
  (the binary decomposition of the rest of the prefix), each a whole segment the query may see.

Each segment has its own :class:`~sparseattn.index.cluster.ClusterIndex`, trained, centred, clustered and
summarised on the segment's keys alone (built when first needed, then kept).  So *which* past keys a row
reads never depends on a later key's value: the causality the plain index cannot give, since its k-means,
centring and routing vectors see every key.  The same segments serve the top-k search
(:meth:`SegmentedClusterIndex.search`) and routed attention
(:func:`sparseattn.attention.segmented.segmented_attention`).

Sizes: the index parameters (``n_clusters`` C and ``n_probe`` p for the S keys; defaults as for
:class:`ClusterIndex`) fix the *fraction* of keys a query reads, ``p / C``, and the cluster size
``S / C``.  A segment of ``s`` keys gets ``max(1, round(C s / S))`` clusters and routes each query to
``min(C_s, max(1, ceil(p s / S)))`` of them, so a query at prefix c reads about ``p c / C`` routed keys plus
its exact tail, like the plain index's causal rows (which read their routed clusters' visible keys).
These sizes depend on the number of keys S and the parameters only, never on key values.  A segment's
``n_probe`` equal to its ``n_clusters`` (e.g. ``n_probe = n_clusters``) reads the whole segment exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..pattern import SparsePattern
from .cluster import ClusterIndex

__all__ = ["SegmentedClusterIndex", "dyadic_cover", "scatter_rows"]

# Segments of at most this many keys are clustered on one thread: on 2 cores the pool's hand-offs made
# the 63 segment builds of 16,384 keys take 0.72 s (mostly waits), most of them small.
_SERIAL_BUILD = 4096
_NONE = np.zeros(0, dtype=np.int64)  # positions argument of non-causal calls (unused)


def dyadic_cover(exact_from: np.ndarray, block: int) -> list[tuple[int, list[tuple[int, np.ndarray]]]]:
    """The aligned dyadic blocks covering each row's ``[0, exact_from[i])``.

    Parameters
    ----------
    exact_from : (L,) int64 array
        Multiples of ``block`` (smaller values are rounded down to one): where each row's exact part starts.
    block : int >= 1
        The smallest block size B.

    Returns
    -------
    ``[(level, [(t, rows), ...]), ...]`` by increasing level: block ``t`` of level ``l`` covers
    ``[t * B * 2^l, (t + 1) * B * 2^l)`` and belongs to ``rows`` (int64, ascending).  A row has at most
    one block per level (bit ``l`` of ``exact_from[i] // B``); its blocks are disjoint and cover
    ``[0, exact_from[i])`` exactly.
    """
    n_full = np.asarray(exact_from, dtype=np.int64) // block
    out: list[tuple[int, list[tuple[int, np.ndarray]]]] = []
    if n_full.size == 0:
        return out
    for level in range(int(n_full.max()).bit_length()):
        has = ((n_full >> level) & 1) == 1
        if not has.any():
            continue
        t_idx = (n_full >> (level + 1)) << 1  # block index at this level after clearing the lower bits
        out.append((level, [(int(t), np.flatnonzero(has & (t_idx == t))) for t in np.unique(t_idx[has])]))
    return out


def scatter_rows(found: list[tuple[np.ndarray, np.ndarray]], n_rows: int) -> np.ndarray:
    """(n_rows, width) int64 candidate ids, -1 padded, from ``(rows, ids)`` pieces (``ids`` (len(rows), w_i));
    width is the widest piece.  Gathers the per-block candidates of causal searches."""
    width = max((ids.shape[1] for _, ids in found), default=0)
    out = np.full((n_rows, width), -1, dtype=np.int64)
    for rows, ids in found:
        out[rows, :ids.shape[1]] = ids
    return out


class SegmentedClusterIndex:
    """A cluster index over keys in position order, segmented so causal routing is strictly causal.

    Parameters
    ----------
    block : int, optional
        Smallest segment B (and bound of the exact tail).  Default: the largest power of two at most
        ``max(16, ceil(p S / C))``, the routed keys of an average query.  Why that large: every level of
        segments costs about one k-means over all keys, and the exact tail is cheap per key (measured on
        the shipped 16k store, head 0: B = 512 read 871 keys per query in 0.129 s, B = 1024 1,052 keys in
        0.085 s, at output error 0.110 / 0.107).
    **params
        :class:`ClusterIndex` parameters for the S keys (``n_clusters``, ``n_probe``, ...; see the module
        docstring for how each segment scales them).

    Attributes (after :meth:`build`)
    ----------------------------------
    keys_ : (S, E) array, the keys as given; order_ : (S,) int64, key ids in position order (stable);
    kpos_sorted_ : (S,) int64 positions in that order; block_ : int; n_clusters_, n_probe_ : int, the sizes
    for S keys; prefix_budget_ : int, ``ceil(n_probe_ * S / n_clusters_)``.
    """

    def __init__(self, *, block: int | None = None, **params: Any) -> None:
        if block is not None and (isinstance(block, bool) or not isinstance(block, (int, np.integer))
                                  or block < 1):
            raise ValueError(f"block must be an int >= 1 (or None: automatic); got {block!r}.")
        self.block = block
        self.params = dict(params)
        self._template = ClusterIndex(**self.params)  # checks the parameters now
        self.keys_: np.ndarray | None = None

    @property
    def threads_(self) -> int:
        """Worker threads in use: the ``n_threads`` parameter, or Numba's current thread count when None."""
        return self._template.threads_

    def build(self, keys: np.ndarray, key_positions: np.ndarray) -> SegmentedClusterIndex:
        """Store the keys (S, E) float32/float64 and their (S,) int64 positions; segments are built lazily."""
        keys = np.ascontiguousarray(keys)
        kpos = np.asarray(key_positions, dtype=np.int64)
        S = keys.shape[0]
        self.keys_ = keys
        self.order_ = np.argsort(kpos, kind="stable").astype(np.int64)
        self.kpos_sorted_ = kpos[self.order_]
        C, p, _ = self._template.sizes(max(S, 1))
        self.n_clusters_, self.n_probe_ = C, p
        self.prefix_budget_ = int(math.ceil(p * S / C))
        if self.block is not None:
            self.block_ = int(self.block)
        else:
            self.block_ = 1 << int(math.floor(math.log2(max(16, self.prefix_budget_))))
        self._segments: dict[tuple[int, int], ClusterIndex] = {}
        return self

    def same_layout(self, keys: np.ndarray, key_positions: np.ndarray) -> bool:
        """Whether this index was built over exactly these keys (same object) and key positions."""
        return (self.keys_ is not None and keys is self.keys_
                and np.array_equal(np.asarray(key_positions, dtype=np.int64)[self.order_], self.kpos_sorted_)
                and np.all(np.diff(np.asarray(key_positions, dtype=np.int64)[self.order_]) >= 0))

    # --------------------------------------------------------------------------------------- layout
    def segment_params(self, size: int) -> dict[str, Any]:
        """ClusterIndex parameters of a segment of ``size`` keys (scaled from the S-key sizes)."""
        S = self.keys_.shape[0]
        C_s = max(1, min(size, round(self.n_clusters_ * size / S)))
        p_s = min(C_s, max(1, math.ceil(self.n_probe_ * size / S)))
        prm = dict(self.params, n_clusters=C_s, n_probe=p_s)
        if size <= _SERIAL_BUILD:
            prm["n_threads"] = 1  # a thread pool costs more than it saves here (results do not depend on it)
        t = self.params.get("train_sample")
        if t is not None:
            prm["train_sample"] = min(size, max(C_s, math.ceil(t * size / S)))
        return prm

    def segment(self, level: int, t: int) -> tuple[ClusterIndex, np.ndarray]:
        """(index over segment ``t`` of ``level``, its key ids (s,) int64 in position order)."""
        size = self.block_ << level
        ids = self.order_[t * size:(t + 1) * size]
        index = self._segments.get((level, t))
        if index is None:
            index = ClusterIndex(**self.segment_params(size)).build(self.keys_[ids])
            self._segments[(level, t)] = index
        return index, ids

    def prepare(self, segs: list[tuple[int, list[tuple[int, np.ndarray]]]], n_threads: int) -> None:
        """Build the not yet built segments of a :meth:`cover` result.  Segments of at most
        ``_SERIAL_BUILD`` keys (built single-threaded) are built ``n_threads`` at a time (mostly FAISS
        k-means and NumPy, which release the GIL); larger ones, which use the thread pool themselves, one
        after the other.  Results do not depend on the order."""
        from ..threads import run_jobs

        todo = [(level, t) for level, blocks in segs for t, _ in blocks if (level, t) not in self._segments]
        small = [lt for lt in todo if self.block_ << lt[0] <= _SERIAL_BUILD]
        run_jobs(lambda j: self.segment(*small[j]), range(len(small)), n_threads)
        for lt in todo:
            if lt not in self._segments:
                self.segment(*lt)

    def cover(self, qpos: np.ndarray, exact_prefix: bool) -> tuple[np.ndarray, np.ndarray,
                                                                     list[tuple[int, int, np.ndarray]]]:
        """Each query's visible prefix split into an exact part and routed segments.

        Returns ``(visible (L,), exact_from (L,), segments)``: the query sees the keys ``order_[:visible]``;
        ``order_[exact_from:visible]`` are read exactly; ``segments`` as :func:`dyadic_cover` covers
        ``[0, exact_from)``.  With ``exact_prefix`` a query seeing at most ``prefix_budget_`` keys reads all
        of them exactly.
        """
        visible = np.searchsorted(self.kpos_sorted_, np.asarray(qpos, dtype=np.int64), side="right"
                                  ).astype(np.int64)
        B = self.block_
        exact_from = (visible // B) * B
        if exact_prefix:
            exact_from[visible <= self.prefix_budget_] = 0
        return visible, exact_from, dyadic_cover(exact_from, B)

    # --------------------------------------------------------------------------------------- search
    def search(self, q: np.ndarray, k: int, qpos: np.ndarray, n_threads: int) -> SparsePattern:
        """Causal top-k: per query the exact top-k by inner product among its exact tail and the keys of
        its routed clusters in each of its segments (ids of ``keys_``).

        q (L, E) in the keys' dtype, k >= 1, qpos (L,) int64.  Rows that see no key are empty.
        """
        from ..kernels.topk import rerank_topk
        from ..threads import worker_threads

        L = q.shape[0]
        S = self.keys_.shape[0]
        visible, exact_from, segs = self.cover(qpos, exact_prefix=False)
        pieces: list[np.ndarray] = []
        # Exact tail, by rows sharing a start: all its ids are candidates (fewer than B of them).
        found: list[tuple[np.ndarray, np.ndarray]] = []
        for lo in np.unique(exact_from):
            rows = np.flatnonzero(exact_from == lo)
            width = int(visible[rows].max()) - int(lo)
            if width <= 0:
                continue
            within = np.arange(width, dtype=np.int64)
            ids = np.where(within[None, :] < (visible[rows] - lo)[:, None],
                           self.order_[int(lo) + np.minimum(within, S - 1 - int(lo))][None, :], -1)
            _, top = rerank_topk(q[rows], self.keys_, ids, min(k, width), True)
            found.append((rows, top))
        pieces.append(scatter_rows(found, L))
        with worker_threads(n_threads):
            self.prepare(segs, n_threads)
            for level, blocks in segs:
                found = []
                for t, rows in blocks:
                    index, ids = self.segment(level, t)
                    qs = np.ascontiguousarray(q[rows], dtype=index.keys_.dtype)
                    route = index.route_rows(qs, n_threads)[0]
                    kk = min(k, ids.size)
                    local = index.search_routed(qs, route, kk, False, _NONE, _NONE, n_threads).to_padded(kk)
                    found.append((rows, np.where(local >= 0, ids[np.maximum(local, 0)], -1)))
                pieces.append(scatter_rows(found, L))
        cand = np.concatenate(pieces, axis=1)
        _, top = rerank_topk(q, self.keys_, cand, k, True)
        return SparsePattern.from_padded(top, S)

    def routed_keys(self, q: np.ndarray, qpos: np.ndarray, exact_prefix: bool, n_threads: int,
                    routes: dict[tuple[int, int], np.ndarray] | None = None) -> SparsePattern:
        """Every key a query of :func:`~sparseattn.attention.segmented.segmented_attention` reads exactly:
        its exact part and all keys of its routed clusters in each segment, as an (L, S) pattern.

        ``routes`` (optional): ``(level, t) -> (rows, p) int32`` routes to use instead of the segments'
        fixed ``n_probe`` (``-1`` = none), e.g. the mass-driven routes of ``top_p``.
        """
        from ..kernels import cluster as ck
        from ..threads import worker_threads

        L = q.shape[0]
        S = self.keys_.shape[0]
        visible, exact_from, segs = self.cover(qpos, exact_prefix)
        counts = visible - exact_from
        indptr = np.zeros(L + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        within = np.arange(indptr[-1], dtype=np.int64) - np.repeat(indptr[:-1], counts)
        idx = self.order_[np.repeat(exact_from, counts) + within]
        parts = [_csr_sorted(indptr, idx, S)]
        with worker_threads(n_threads):
            self.prepare(segs, n_threads)
            for level, t, rows in ((lv, t, r) for lv, blocks in segs for t, r in blocks):
                index, ids = self.segment(level, t)
                if routes is not None:
                    route = routes[(level, t)]
                    C = index.n_clusters_
                    route = np.where(route < 0, C, route).astype(np.int32)
                    kptr = np.append(index.cluster_ptr_, index.cluster_ptr_[-1])  # cluster C: empty
                    ptr, loc = ck.routed_pattern(route, kptr, index.perm_, False, _NONE, _NONE)
                else:
                    qs = np.ascontiguousarray(q[rows], dtype=index.keys_.dtype)
                    route = index.route_rows(qs, n_threads)[0]
                    pat = index.routed_keys(route, False, _NONE, _NONE)
                    ptr, loc = pat.indptr, pat.indices
                n_row = np.diff(ptr)
                full = np.zeros(L, dtype=np.int64)
                full[rows] = n_row
                fptr = np.zeros(L + 1, dtype=np.int64)
                np.cumsum(full, out=fptr[1:])
                parts.append(_csr_sorted(fptr, ids[np.asarray(loc, dtype=np.int64)], S))
        return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def _csr_sorted(indptr: np.ndarray, ids: np.ndarray, n_keys: int) -> SparsePattern:
    """A SparsePattern from CSR rows of distinct, unsorted ids (sorted here)."""
    from ..kernels.pattern_ops import canonicalize_rows

    ptr, idx = canonicalize_rows(np.ascontiguousarray(indptr, dtype=np.int64), ids.astype(np.int32))
    return SparsePattern(ptr, idx, n_keys, validate=False)
