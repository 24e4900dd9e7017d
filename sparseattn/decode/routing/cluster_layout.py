"""The clustered layout of the decode cache's ``cluster`` strategy: segments of keys clustered once, their
routing vectors (int8 codes) and per-cluster statistics.

Per kv head the slots after the sinks are ``[closed segment 0 | ... | open segment | tail]``.  When the
tail holds ``segment + window`` keys beyond the closed segments, the oldest ``segment`` of them are
clustered on their own (spherical k-means on the segment's centred keys, about ``cluster_size`` keys per
cluster), reordered in place into cluster order, and their routing vectors (member means) join the
head's routed set for good.  In between, the open segment is re-clustered each time the tail gains
``open_step`` keys.  Each cluster keeps its live member count, mean value, smallest / largest
position and key spread (mean per-dimension variance and largest member distance to the mean); the
estimation zone and the mass walk read them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...threads import executor, get_num_threads, single_threaded_blas
from ..store import EVICTED, SlotStore

__all__ = ["ClusterLayout", "cluster_segment", "routing_codes"]


def routing_codes(means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Routing vectors (m, E) float -> (int8 codes (m, E), scales (m,) float32) with ``vector ~= codes *
    scale``: each vector is divided by its largest magnitude over 127 and rounded, so any finite float32
    key mean (1e-40 .. 3e38) keeps 1/254 of its largest element's magnitude as absolute precision
    (half a code step) instead of under- or overflowing; one byte per element halves the routing scan's
    reads against float16."""
    m = np.asarray(means, dtype=np.float64)
    big = np.abs(m).max(axis=1) if m.size else np.zeros(m.shape[0])
    sc = np.where(big > 0, big / 127.0, 1.0)
    codes = np.clip(np.rint(m / sc[:, None]), -127, 127).astype(np.int8)
    sc32 = sc.astype(np.float32)
    tiny = sc32 == 0  # a largest element below ~1.8e-43: the scale underflows float32; keep the direction
    if tiny.any():
        sc32[tiny] = np.float32(1e-45)
    return codes, sc32


def cluster_segment(keys: np.ndarray, n_clusters: int, *, seed: int = 0, niter: int = 5) -> np.ndarray:
    """Cluster labels of one segment's keys: spherical k-means on the centred keys
    (:class:`sparseattn.index.cluster.ClusterIndex`, single-threaded; callers parallelise over heads).

    Parameters
    ----------
    keys : (n, E) float32
    n_clusters : int >= 1

    Returns
    -------
    labels : (n,) int64 in ``[0, n_clusters)``: each key's centroid of largest inner product with the
    centred key (the same as the largest cosine).
    """
    from ...index.cluster import ClusterIndex

    n = keys.shape[0]
    c = max(1, min(n_clusters, n))
    if c == 1:
        return np.zeros(n, dtype=np.int64)
    index = ClusterIndex(n_clusters=c, n_probe=1, n_iter=niter, seed=seed, spherical=True, assign="ip",
                         n_threads=1)
    return index.labels(np.ascontiguousarray(keys, dtype=np.float32))


def key_spread(x: np.ndarray, starts: np.ndarray, counts: np.ndarray, means: np.ndarray) -> np.ndarray:
    """Per cluster (members ``x[starts[c]:starts[c] + counts[c]]`` of the (n, E) keys, mean ``means[c]``):
    (m, 2) float32 ``[mean per-dimension variance, largest member distance to the mean]`` (float64 sums;
    a variance beyond float32's range, from keys near 1e19 and up, is stored as float32's largest value)."""
    d = x.astype(np.float64) - np.repeat(np.asarray(means, np.float64), counts, axis=0)
    sq = np.einsum("ij,ij->i", d, d)
    out = np.empty((counts.shape[0], 2), np.float32)
    if counts.shape[0]:
        big = float(np.finfo(np.float32).max)
        out[:, 0] = np.minimum(np.add.reduceat(sq, starts) / (counts * max(x.shape[1], 1)), big)
        out[:, 1] = np.minimum(np.sqrt(np.maximum.reduceat(sq, starts)), big)
    return out


_CLUSTER_ARRAYS = ("cent", "cscale", "cptr", "cvmean", "ccount", "cminpos", "cmaxpos", "cspread")


class ClusterLayout:
    """Segments, routing vectors and cluster statistics over a :class:`SlotStore` (see the module docstring).

    Arrays per kv head g and cluster c < ``n_cent[g]``: ``cent`` (int8 codes) x ``cscale`` is the routing
    vector, slots ``[cptr[g, c], cptr[g, c + 1])`` its members, ``ccount`` the live ones, ``cvmean`` their
    mean value, ``cminpos`` / ``cmaxpos`` their smallest / largest position (``EVICTED`` when a member was
    evicted and the statistics are stale), ``cspread`` (float32 pairs) their mean per-dimension variance
    and largest distance to the mean (:func:`key_spread`)."""

    def __init__(self, store: SlotStore, *, segment: int, open_step: int, window: int, sinks: int,
                 cluster_size: int, seed: int) -> None:
        self.store = store
        self.segment, self.open_step, self.window, self.sinks = segment, open_step, window, sinks
        self.cluster_size, self.seed = cluster_size, seed
        hk, E, Ev = store.num_kv_heads, store.head_dim, store.value_dim
        self.seg_end = 0  # end of the closed segments
        self.open_end = 0  # first tail slot; [seg_end, open_end) is the open segment
        self.closed_cent = np.zeros(hk, np.int64)  # routing vectors of the closed segments, per kv head
        self.segments: list[tuple[int, np.ndarray]] = []  # (first slot, first centroid per kv head)
        self.cent = np.zeros((hk, 0, E), np.int8)
        self.cscale = np.zeros((hk, 0), np.float32)
        self.cptr = np.zeros((hk, 1), np.int64)
        self.n_cent = np.zeros(hk, np.int64)
        self.ccount = np.zeros((hk, 0), np.int64)
        self.cvmean = np.zeros((hk, 0, Ev), np.float32)
        self.cminpos = np.zeros((hk, 0), np.int32)
        self.cmaxpos = np.zeros((hk, 0), np.int32)
        self.cspread = np.zeros((hk, 0, 2), np.float32)
        self.segments_clustered = 0
        self._spans: list[tuple[int, int, int, int, np.ndarray]] | None = None  # see spans()

    def kernel_arrays(self) -> tuple[np.ndarray, ...]:
        """(cent, cscale, cptr, n_cent, ccount, cvmean, cminpos, cmaxpos, cspread) as the kernel reads them."""
        return (self.cent, self.cscale, self.cptr, self.n_cent, self.ccount, self.cvmean, self.cminpos,
                self.cmaxpos, self.cspread)

    def routing(self, g: int, nc: int) -> np.ndarray:
        """Routing vectors ``[0, nc)`` of kv head g, (nc, E) float32."""
        return self.cent[g, :nc].astype(np.float32) * self.cscale[g, :nc, None]

    def cluster_new(self) -> bool:
        """Close every segment the tail can fill, then grow the open segment by whole ``open_step``s;
        True when anything was clustered.  The result depends only on the keys appended, not on how
        appends were split."""
        st = self.store
        if self.seg_end < self.sinks:
            self.seg_end = self.open_end = min(self.sinks, st.slots)
        if st.slots < self.sinks:
            return False
        changed = False
        while st.slots - self.seg_end >= self.segment + self.window:
            self.cluster_range(self.seg_end, self.seg_end + self.segment, closed=True)
            self.seg_end += self.segment
            self.open_end = self.seg_end
            self.segments_clustered += 1
            changed = True
        step = self.open_step
        grow = ((st.slots - self.open_end - self.window) // step) * step
        grow = min(grow, ((self.segment - 1 - (self.open_end - self.seg_end)) // step) * step)
        if grow > 0:
            self.cluster_range(self.seg_end, self.open_end + grow, closed=False)
            self.open_end += grow
            changed = True
        return changed

    def _cluster_head(self, g: int, a: int, b: int) -> tuple[Any, ...]:
        """k-means of kv head g's live keys in slots [a, b), the slots reordered into cluster order; the
        statistics of its clusters (or ``(0,)`` when no key is live)."""
        st = self.store
        pos = st.pos[g, a:b]
        # position order, evicted slots last (stable): the clusters depend on the keys only
        by_pos = np.argsort(pos, kind="stable") if b - a > 1 and np.any(np.diff(pos) < 0) else None
        nl = int(np.count_nonzero(pos != EVICTED))
        live = a + (by_pos[:nl] if by_pos is not None else np.arange(nl))
        if nl == 0:
            if by_pos is not None:
                st.permute(g, a, b, by_pos)
            return (0,)
        x = st.keys(g, live)
        n_c = max(1, nl // self.cluster_size)
        labels = cluster_segment(x, n_c, seed=self.seed)
        order = np.argsort(labels, kind="stable")
        rest = np.arange(nl, b - a)
        final = np.concatenate([order, rest]) if by_pos is None else by_pos[np.concatenate([order, rest])]
        st.permute(g, a, b, final)  # one reordering: position order, then cluster order
        counts = np.bincount(labels, minlength=n_c)
        kept = counts > 0
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[kept]
        sums = np.add.reduceat(x[order], starts, axis=0, dtype=np.float64)
        means = (sums / counts[kept, None]).astype(np.float32)
        vsum = np.add.reduceat(st.values(g, slice(a, a + nl)), starts, axis=0, dtype=np.float64)
        seg_pos = st.pos[g, a:a + nl]
        return (nl, counts[kept], means, (vsum / counts[kept, None]).astype(np.float32),
                np.minimum.reduceat(seg_pos, starts), np.maximum.reduceat(seg_pos, starts),
                key_spread(x[order], starts, counts[kept], sums / counts[kept, None]))

    def cluster_range(self, a: int, b: int, *, closed: bool) -> None:
        """Cluster slots [a, b) of every kv head, reorder them by cluster, add their routing vectors
        (replacing those of the open segment, which [a, b) always contains).  A head's evicted slots
        go to the end of its last cluster's range.  Heads run on worker threads (the k-means' serial
        Numba kernels, BLAS and numpy's copies and reductions release the GIL)."""
        hk = self.store.num_kv_heads
        self._spans = None
        firsts = self.closed_cent.copy()
        self.n_cent[:] = self.closed_cent  # the open segment's routing vectors are recomputed
        self.store.evict_from = min(self.store.evict_from, a)  # slots [a, b) are reordered below
        n_threads = min(get_num_threads(), hk)
        with single_threaded_blas():  # parallel over heads, not inside BLAS (oversubscription: ~10x slower)
            if n_threads > 1:  # one head per worker, each k-means single-threaded
                results = list(executor(n_threads).map(lambda g: self._cluster_head(g, a, b), range(hk)))
            else:
                results = [self._cluster_head(g, a, b) for g in range(hk)]
        for g in range(hk):
            res = results[g]
            nc = int(self.n_cent[g])
            if res[0] == 0:  # every key of this head evicted: one empty cluster holds the slots
                self.grow(nc + 1)
                self.set_cluster(g, nc, a, b, (np.zeros(self.cent.shape[2], np.int8), 1.0),
                                 np.zeros(self.cvmean.shape[2], np.float32), 0, EVICTED, EVICTED, (0.0, 0.0))
                self.n_cent[g] = nc + 1
                continue
            _, counts, means, vmean, pmin, pmax, spread = res
            m = means.shape[0]
            self.grow(nc + m)
            self.cvmean[g, nc:nc + m] = vmean
            self.cspread[g, nc:nc + m] = spread
            self.ccount[g, nc:nc + m] = counts
            self.cminpos[g, nc:nc + m] = pmin
            self.cmaxpos[g, nc:nc + m] = pmax
            self.cent[g, nc:nc + m], self.cscale[g, nc:nc + m] = routing_codes(means)
            self.cptr[g, nc + 1:nc + 1 + m] = a + np.cumsum(counts)
            self.cptr[g, nc] = a
            self.cptr[g, nc + m] = b  # evicted slots, if any, close the last cluster's range
            self.n_cent[g] = nc + m
        if closed:
            self.segments.append((a, firsts))
            self.closed_cent = self.n_cent.copy()

    def set_cluster(self, g: int, c: int, lo: int, hi: int, code: tuple[np.ndarray, float], vmean: np.ndarray,
                    count: int, pmin: int, pmax: int, spread: tuple[float, float] | np.ndarray) -> None:
        """Write cluster c of kv head g: slots [lo, hi), routing (codes, scale), statistics."""
        self.cptr[g, c], self.cptr[g, c + 1] = lo, hi
        self.cent[g, c], self.cscale[g, c] = code
        self.cvmean[g, c] = vmean
        self.ccount[g, c] = count
        self.cminpos[g, c], self.cmaxpos[g, c] = pmin, pmax
        self.cspread[g, c] = spread

    def grow(self, need: int) -> None:
        """Room for ``need`` clusters per kv head."""
        if need <= self.cent.shape[1]:
            return
        cap = max(need, 2 * self.cent.shape[1], 64)
        for name in _CLUSTER_ARRAYS:
            old = getattr(self, name)
            arr = np.zeros((old.shape[0], cap + (name == "cptr")) + old.shape[2:], old.dtype)
            arr[:, :old.shape[1]] = old
            setattr(self, name, arr)

    def region_bounds(self) -> list[int]:
        """Slot bounds of the regions: each closed segment, the open segment, the tail (to ``slots``)."""
        return [a for a, _ in self.segments] + [self.seg_end, self.open_end, self.store.slots]

    def spans(self) -> list[tuple[int, int, int, int, np.ndarray]]:
        """Per clustered region (closed segments, then the open segment) holding a live key: (smallest and
        largest live position over the kv heads, first slot, stop slot, its first cluster per kv head),
        in position order.  Cached until the layout changes (evictions only narrow the true ranges)."""
        if self._spans is None:
            bounds = self.region_bounds()[:-1]  # closed segments and the open segment, not the tail
            firsts = [f for _, f in self.segments] + [self.closed_cent]
            spans = []
            for ri in range(len(bounds) - 1):
                a, b = bounds[ri], bounds[ri + 1]
                pos = self.store.pos[:, a:b]
                live = pos[pos != EVICTED]
                if live.size:
                    spans.append((int(live.min()), int(live.max()), a, b, firsts[ri].copy()))
            self._spans = spans
        return self._spans

    def straddle_ids(self, qpos: np.ndarray) -> np.ndarray:
        """For each position of ``qpos`` (T,) int64, the index in :meth:`spans` of the clustered region holding
        keys both at or before it and after it, or -1; (T,) int64.

        A row must not route through such a region: its clusters (members, means, codes) were made with
        keys the row may not see, so which of its visible keys are read would depend on later keys.  Only
        rows of a multi-token attend inside the clustered part meet one (a decode step's row is the newest
        position).  Regions are in position order, so at most one straddles a position."""
        spans = self.spans()
        out = np.full(qpos.shape[0], -1, np.int64)
        if spans:
            lo = np.array([s[0] for s in spans], np.int64)
            hi = np.array([s[1] for s in spans], np.int64)
            i = np.searchsorted(lo, qpos, side="right") - 1  # the last region starting at or before qp
            ok = (i >= 0) & (qpos < hi[np.maximum(i, 0)])
            out[ok] = i[ok]
        return out

    def nbytes(self) -> int:
        """Bytes of the routing vectors and cluster statistics."""
        return int(self.n_cent.sum()) * (self.store.head_dim + 4 + 8 + 8 + 8 + 8 + 4 * self.store.value_dim)

    # ------------------------------------------------------------------------------------ compaction
    def compaction_sources(self, live: np.ndarray) -> list[np.ndarray]:
        """Per kv head the source slots of the compacted layout after the sinks (see
        :meth:`SlotStore.compact`): every region keeps its live keys in order (clusters that lost members
        get their statistics recomputed from the survivors, emptied clusters and segments are dropped); a
        region keeps as many slots as its fullest kv head needs.  Updates the layout to the new slots."""
        st = self.store
        hk = st.num_kv_heads
        self._spans = None
        w0 = w = st.s0
        bounds = self.region_bounds()
        n_regions = len(bounds) - 1  # closed segments, open segment, tail
        cent_lists: list[list[tuple[Any, ...]]] = [[] for _ in range(hk)]
        srcs: list[list[np.ndarray]] = [[] for _ in range(hk)]
        seg_list: list[tuple[int, np.ndarray]] = []
        seg_end = open_end = w
        closed_cent = np.zeros(hk, np.int64)
        for ri in range(n_regions):
            a, b = bounds[ri], bounds[ri + 1]
            if ri == n_regions - 1:  # the tail: position order
                R, tail_src = st.plain_sources(live, a, b)
                for g in range(hk):
                    srcs[g].append(tail_src[g])
            else:
                R = int(live[:, a:b].sum(axis=1).max()) if b > a else 0
                if ri < n_regions - 2 and R > 0:  # a closed segment
                    seg_list.append((w, np.array([len(c) for c in cent_lists], np.int64)))
                for g in range(hk):
                    srcs[g].append(self._compact_clusters(g, a, b, ri, w, R, live[g], cent_lists[g]))
            w += R
            if ri < n_regions - 2:  # a closed segment ends
                seg_end = open_end = w
                closed_cent = np.array([len(c) for c in cent_lists], np.int64)
            elif ri == n_regions - 2:  # the open segment ends: the tail starts here
                open_end = w
        self.segments = seg_list
        self.seg_end, self.open_end = seg_end, open_end
        self.closed_cent = closed_cent
        self.n_cent = np.array([len(c) for c in cent_lists], np.int64)
        for g in range(hk):
            for c, (lo, hi, cen, vm, cnt, pmn, pmx, spr) in enumerate(cent_lists[g]):
                self.set_cluster(g, c, lo, hi, cen, vm, cnt, pmn, pmx, spr)
        return [np.concatenate(s).astype(np.int64) if s else np.zeros(w - w0, np.int64) for s in srcs]

    def _compact_clusters(self, g: int, a: int, b: int, ri: int, w: int, R: int, live: np.ndarray,
                          out: list[tuple[Any, ...]]) -> np.ndarray:
        """Compaction of the clustered region [a, b) (segment or open segment ``ri``) of kv head g into R
        slots from ``w``: returns the source slots (live keys cluster by cluster, then padding) and appends
        (first, stop, routing code, mean value, count, min pos, max pos, key spread) of each surviving
        cluster."""
        st = self.store
        bounds = [f[g] for _, f in self.segments] + [self.closed_cent[g], self.n_cent[g]]
        c_lo, c_hi = int(bounds[ri]), int(bounds[ri + 1])
        parts = []
        at = w
        for c in range(c_lo, c_hi):
            lo, hi = int(self.cptr[g, c]), int(self.cptr[g, c + 1])
            keep = lo + np.flatnonzero(live[lo:hi])
            if keep.size == 0:
                continue
            parts.append(keep)
            if keep.size == hi - lo or self.ccount[g, c] == keep.size and self.cmaxpos[g, c] != EVICTED:
                stats = ((self.cent[g, c].copy(), self.cscale[g, c]), self.cvmean[g, c].copy(), int(keep.size),
                         int(self.cminpos[g, c]), int(self.cmaxpos[g, c]), self.cspread[g, c].copy())
            else:  # lost members: statistics of the survivors
                kk = st.keys(g, keep).astype(np.float64)
                vv = st.values(g, keep).astype(np.float64)
                pp = st.pos[g, keep]
                mu = kk.mean(axis=0)[None]
                codes, sc = routing_codes(mu)
                spread = key_spread(kk, np.zeros(1, np.int64), np.array([keep.size]), mu)[0]
                stats = ((codes[0], sc[0]), vv.mean(axis=0).astype(np.float32), int(keep.size), int(pp.min()),
                         int(pp.max()), spread)
            out.append((at, at + keep.size) + stats)
            at += keep.size
        src = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        pad = R - src.size
        if pad > 0:
            dead = a + np.flatnonzero(~live[a:b])[:pad]
            src = np.concatenate([src, dead])
            if out and out[-1][0] >= w:  # the padding closes the region's last cluster
                lo, _, *rest = out[-1]
                out[-1] = (lo, w + R, *rest)
            else:  # no live key of this head here: one empty cluster holds the padding
                out.append((w, w + R, (np.zeros(st.head_dim, np.uint16), 1.0),
                            np.zeros(st.value_dim, np.float32), 0, EVICTED, EVICTED, (0.0, 0.0)))
        return src
