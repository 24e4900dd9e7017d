"""Strictly causal cluster routing: the keys, in position order, cut into segments of ``B`` keys, each
clustered on its own keys only, and the clusters of every segment pooled into one index.

A causal query that sees the first ``c`` keys (in position order) reads

* its *exact part* ``[B * floor(c / B), c)``, the fewer than B keys of the segment it is in, every one, and
* the ``n_probe`` clusters of largest ``q . c`` among the clusters of the ``floor(c / B)`` whole segments
  before it: pooled routing, the best clusters over every segment it can see at once (as the decode
  cache routes), not a share of the probes per segment.

Each segment's k-means sees its own keys only and its routing vectors are its clusters' member means, so
*which* past keys a row reads never depends on a later key: the causality the plain index cannot give,
since its k-means, centring and routing vectors see every key.  The pooled index
(:meth:`SegmentedClusterIndex.pooled`) holds the keys of the whole segments in position order, each key
at its *segment position* (the last position index of its segment, ``B * (j // B + 1) - 1`` for the j-th
key): a causal call at query position ``B * floor(c / B) - 1`` sees exactly the whole segments before
the row, and routing ranks the clusters it cannot see last
(:func:`~sparseattn.kernels.cluster.row_top_p`).  The same pooled index serves the top-k search
(:meth:`SegmentedClusterIndex.search`), the key sets (:meth:`SegmentedClusterIndex.routed_keys`) and
routed attention (:func:`sparseattn.attention.segmented.segmented_attention`).

Sizes: with ``n_clusters`` C and ``n_probe`` p for the S keys (defaults as for
:class:`~sparseattn.index.cluster.ClusterIndex`), each segment of B keys gets ``max(1, round(C B / S))``
clusters (about ``S / C`` keys each) and a row routes to p pooled clusters, so it reads about
``p S / C`` routed keys plus its exact part, like the plain index's causal rows.  These sizes depend on
the number of keys S and the parameters only, never on key values.

:func:`dyadic_cover` and :func:`scatter_rows` serve the causal search of the index selectors (aligned
dyadic blocks, each indexed on its own keys).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..pattern import SparsePattern
from .cluster import ClusterIndex, key_spans

__all__ = ["SegmentedClusterIndex", "dyadic_cover", "scatter_rows"]



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
        Segment size B (and bound of the exact part).  Default: the largest power of two at most
        ``max(16, ceil(p S / C) / 2)``, half the routed keys of an average query, so the exact part (B / 2
        keys per row on average) stays below the routed one.
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
        """Store the keys (S, E) float32/float64 and their (S,) int64 positions; the pooled index is built
        when first needed (:meth:`pooled`)."""
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
            self.block_ = 1 << int(math.floor(math.log2(max(16, self.prefix_budget_ // 2))))
        self._pooled: tuple[ClusterIndex | None, np.ndarray, np.ndarray] | None = None
        return self

    def same_layout(self, keys: np.ndarray, key_positions: np.ndarray) -> bool:
        """Whether this index was built over exactly these keys (same object) and key positions."""
        return (self.keys_ is not None and keys is self.keys_
                and np.array_equal(np.asarray(key_positions, dtype=np.int64)[self.order_], self.kpos_sorted_)
                and np.all(np.diff(np.asarray(key_positions, dtype=np.int64)[self.order_]) >= 0))

    # --------------------------------------------------------------------------------------- layout
    def segment_params(self, size: int) -> dict[str, Any]:
        """ClusterIndex parameters of a segment of ``size`` keys: ``max(1, round(C size / S))`` clusters,
        one thread (segments are clustered in parallel, one per worker)."""
        S = self.keys_.shape[0]
        C_s = max(1, min(size, round(self.n_clusters_ * size / S)))
        prm = dict(self.params, n_clusters=C_s, n_probe=1, n_threads=1)
        t = self.params.get("train_sample")
        if t is not None:
            prm["train_sample"] = min(size, max(C_s, math.ceil(t * size / S)))
        return prm

    def pooled(self, n_threads: int) -> tuple[ClusterIndex | None, np.ndarray, np.ndarray]:
        """(pooled index over the keys of the whole segments, their key ids (n,) int64 in position order,
        their segment positions (n,) int64); the index is None when no segment is whole (S < B).

        Each segment is clustered on its own keys (``ClusterIndex(**segment_params(B))``, k-means and
        assignment, plus its cluster splits with ``split``), ``n_threads`` segments at a time; the pooled
        index takes those clusters as given (:meth:`ClusterIndex.build` with ``labels``), uncentred, with
        the S-key ``n_probe``.  Built once, then kept."""
        if self._pooled is None:
            from ..threads import run_jobs

            B = self.block_
            n = (self.keys_.shape[0] // B) * B
            ids = self.order_[:n]
            seg_pos = (np.arange(n, dtype=np.int64) // B + 1) * B - 1
            if n == 0:
                self._pooled = (None, ids, seg_pos)
                return self._pooled
            prm = self.segment_params(B)
            labels: list[np.ndarray] = [np.empty(0, np.int64)] * (n // B)

            def work(t: int) -> None:
                seg = ClusterIndex(**prm)
                part = self.keys_[ids[t * B:(t + 1) * B]]
                labels[t] = seg.labels(part) if seg.split == 0 else seg.build(part).assignment_
                labels[t] = np.unique(labels[t], return_inverse=True)[1].astype(np.int64)  # no empty cluster

            run_jobs(work, range(n // B), n_threads)
            offsets = np.cumsum([0] + [int(lab.max()) + 1 for lab in labels])
            glob = np.concatenate([lab + off for lab, off in zip(labels, offsets[:-1], strict=True)])
            C = int(offsets[-1])
            pool_prm = dict(self.params, n_clusters=C, n_probe=min(self.n_probe_, C), center=False, split=0.0)
            pool_prm.pop("train_sample", None)
            index = ClusterIndex(**pool_prm).build(np.ascontiguousarray(self.keys_[ids]), labels=glob)
            self._pooled = (index, ids, seg_pos)
        return self._pooled

    def cover(self, qpos: np.ndarray, exact_prefix: bool) -> tuple[np.ndarray, np.ndarray]:
        """Each query's visible prefix split into an exact part and its whole segments.

        Returns ``(visible (L,), exact_from (L,))``: the query sees the keys ``order_[:visible]``;
        ``order_[exact_from:visible]`` are read exactly; the pooled clusters of segments before
        ``exact_from`` (a multiple of B) are routed, at query position ``exact_from - 1`` of the pooled
        index.  With ``exact_prefix`` a query seeing at most ``prefix_budget_`` keys reads all of them
        exactly (``exact_from = 0``).
        """
        visible = np.searchsorted(self.kpos_sorted_, np.asarray(qpos, dtype=np.int64), side="right"
                                  ).astype(np.int64)
        exact_from = (visible // self.block_) * self.block_
        if exact_prefix:
            exact_from[visible <= self.prefix_budget_] = 0
        return visible, exact_from

    # --------------------------------------------------------------------------------------- search
    def search(self, q: np.ndarray, k: int, qpos: np.ndarray, n_threads: int) -> SparsePattern:
        """Causal top-k: per query the exact top-k by inner product among its exact part and the keys of its
        routed pooled clusters (ids of ``keys_``).

        q (L, E) in the keys' dtype, k >= 1, qpos (L,) int64.  Rows that see no key are empty.
        """
        from ..kernels.topk import rerank_topk
        from ..threads import worker_threads

        L = q.shape[0]
        S = self.keys_.shape[0]
        visible, exact_from = self.cover(qpos, exact_prefix=False)
        found: list[tuple[np.ndarray, np.ndarray]] = []
        # Exact part, by rows sharing a start: all its ids are candidates (fewer than B of them).
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
        pieces = [scatter_rows(found, L)]
        rows = np.flatnonzero(exact_from > 0)
        if rows.size:
            index, ids, seg_pos = self.pooled(n_threads)
            with worker_threads(n_threads):
                qs = np.ascontiguousarray(q[rows], dtype=index.keys_.dtype)
                qp = exact_from[rows] - 1
                route = index.route_rows(qs, n_threads, key_spans(index, seg_pos)[1], qp)[0]
                kk = min(k, ids.size)
                local = index.search_routed(qs, route, kk, True, qp, seg_pos, n_threads).to_padded(kk)
            pieces.append(scatter_rows([(rows, np.where(local >= 0, ids[np.maximum(local, 0)], -1))], L))
        cand = np.concatenate(pieces, axis=1)
        _, top = rerank_topk(q, self.keys_, cand, k, True)
        return SparsePattern.from_padded(top, S)

    def routed_keys(self, q: np.ndarray, qpos: np.ndarray, exact_prefix: bool, n_threads: int,
                    routes: tuple[np.ndarray, np.ndarray] | None = None) -> SparsePattern:
        """Every key a query of :func:`~sparseattn.attention.segmented.segmented_attention` reads exactly:
        its exact part and all visible keys of its routed pooled clusters, as an (L, S) pattern.

        ``routes`` (optional): ``(rows, route)`` with ``route`` (len(rows), p) int32 pooled clusters to use
        instead of the fixed ``n_probe`` (``-1`` = none), e.g. the mass-driven routes of ``top_p``
        (:func:`~sparseattn.index.routing.segment_routes`).
        """
        from ..kernels import cluster as ck
        from ..threads import worker_threads

        L = q.shape[0]
        S = self.keys_.shape[0]
        visible, exact_from = self.cover(qpos, exact_prefix)
        counts = visible - exact_from
        indptr = np.zeros(L + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        within = np.arange(indptr[-1], dtype=np.int64) - np.repeat(indptr[:-1], counts)
        parts = [_csr_sorted(indptr, self.order_[np.repeat(exact_from, counts) + within], S)]
        rows = np.flatnonzero(exact_from > 0)
        if rows.size:
            index, ids, seg_pos = self.pooled(n_threads)
            qp = exact_from[rows] - 1
            C = index.n_clusters_
            if routes is not None:
                rows, route = routes
                qp = exact_from[rows] - 1
                route = np.where(route < 0, C, route).astype(np.int32)
            else:
                with worker_threads(n_threads):
                    qs = np.ascontiguousarray(q[rows], dtype=index.keys_.dtype)
                    route = index.route_rows(qs, n_threads, key_spans(index, seg_pos)[1], qp)[0]
            kptr = np.append(index.cluster_ptr_, index.cluster_ptr_[-1])  # cluster C: empty padding
            ptr, loc = ck.routed_pattern(route, kptr, index.perm_, True, qp, seg_pos)
            full = np.zeros(L, dtype=np.int64)
            full[rows] = np.diff(ptr)
            fptr = np.zeros(L + 1, dtype=np.int64)
            np.cumsum(full, out=fptr[1:])
            parts.append(_csr_sorted(fptr, ids[np.asarray(loc, dtype=np.int64)], S))
        return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def _csr_sorted(indptr: np.ndarray, ids: np.ndarray, n_keys: int) -> SparsePattern:
    """A SparsePattern from CSR rows of distinct, unsorted ids (sorted here)."""
    from ..kernels.pattern_ops import canonicalize_rows

    ptr, idx = canonicalize_rows(np.ascontiguousarray(indptr, dtype=np.int64), ids.astype(np.int32))
    return SparsePattern(ptr, idx, n_keys, validate=False)
