"""Quest page routing: per page of ``page_size`` slots (from slot ``sinks``) the element-wise min and max
of its keys, updated on append; a step reads the ``n_probe`` pages of largest upper bound
``sum_e max(q_e min_e, q_e max_e)`` of ``q . k`` besides the sinks and the recent window."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels import decode as kd
from ..plan import StepPlan
from ..store import INT32_MAX, bf16_bits, bf16_to_f32
from .base import Routing, register_routing

__all__ = ["PagesRouting"]


@register_routing
class PagesRouting(Routing):
    """Quest: pages ranked by their bound of ``q . k``."""

    name = "pages"
    supports = frozenset({"n_probe"})
    default_probe = 128

    def __init__(self, cfg: Any, store: Any) -> None:
        super().__init__(cfg, store)
        hk, E = cfg.num_kv_heads, cfg.head_dim
        self.pmin = np.zeros((hk, 0, E), store.sdtype)
        self.pmax = np.zeros((hk, 0, E), store.sdtype)
        self.pminpos = np.zeros((hk, 0), np.int32)  # per page: smallest live position (EVICTED: none)
        self._spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # see _page_spans()

    def n_pages(self) -> int:
        """Pages holding slots in use."""
        span = max(self.store.slots - self.cfg.sinks, 0)
        return (span + self.cfg.page_size - 1) // self.cfg.page_size

    def grown(self, cap: int) -> None:
        n_pages = -(-cap // self.cfg.page_size) + 1
        for name in ("pmin", "pmax", "pminpos"):
            old = getattr(self, name)
            arr = np.zeros((old.shape[0], n_pages) + old.shape[2:], old.dtype)
            arr[:, :old.shape[1]] = old
            setattr(self, name, arr)

    def committed(self, a: int, b: int) -> None:
        self.update(a, b)

    def update(self, a: int, b: int) -> None:
        """Recompute the min/max and smallest position of the pages holding slots [a, b)."""
        self._spans = None
        st = self.store
        s0 = self.cfg.sinks  # pages start at slot `sinks`
        a = max(a, s0)
        if a >= b:
            return
        P, hk, bf16 = self.cfg.page_size, st.num_kv_heads, st.storage == "bfloat16"
        p0 = (a - s0) // P
        p1 = (b - s0 + P - 1) // P
        start = s0 + p0 * P
        full = (b - start) // P
        if full:
            blk = st.K[:, start:start + full * P].reshape(hk, full, P, st.head_dim)
            if bf16:
                f = bf16_to_f32(blk)
                self.pmin[:, p0:p0 + full] = bf16_bits(f.min(axis=2))
                self.pmax[:, p0:p0 + full] = bf16_bits(f.max(axis=2))
            else:
                self.pmin[:, p0:p0 + full] = blk.min(axis=2)
                self.pmax[:, p0:p0 + full] = blk.max(axis=2)
            self.pminpos[:, p0:p0 + full] = st.pos[:, start:start + full * P].reshape(hk, full, P).min(axis=2)
        if p0 + full < p1:  # the last, partial page
            blk = st.K[:, start + full * P:b]
            f = st.decode(blk) if bf16 else blk
            lo, hi = f.min(axis=1), f.max(axis=1)
            if bf16:
                lo, hi = bf16_bits(lo), bf16_bits(hi)
            self.pmin[:, p0 + full] = lo
            self.pmax[:, p0 + full] = hi
            self.pminpos[:, p0 + full] = st.pos[:, start + full * P:b].min(axis=1)

    def evict(self, kill: np.ndarray) -> None:
        super().evict(kill)
        self._spans = None
        st, s0, P = self.store, self.store.s0, self.cfg.page_size
        for g in range(st.num_kv_heads):
            kg = kill[g]
            for b in np.unique((kg[kg >= s0] - s0) // P):
                first = s0 + int(b) * P
                self.pminpos[g, b] = st.pos[g, first:min(first + P, st.slots)].min()

    def compacted(self) -> None:
        self.update(self.store.s0, self.store.slots)

    def _page_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids of the pages holding a live key, their smallest and largest live position over the kv heads),
        int64, in position order (pages never reorder slots); cached until an append, eviction or compaction."""
        if self._spans is not None:
            return self._spans
        st, P, s0 = self.store, self.cfg.page_size, self.store.s0
        n = self.n_pages()
        pos = st.pos[:, s0:min(s0 + n * P, st.slots)]
        if pos.shape[1] < n * P:
            pos = np.concatenate([pos, np.full((pos.shape[0], n * P - pos.shape[1]), kd.EVICTED, pos.dtype)], axis=1)
        pos = pos.reshape(pos.shape[0], n, P).astype(np.int64)
        live = pos != kd.EVICTED
        hi = np.where(live, pos, -1).max(axis=(0, 2), initial=-1)
        ids = np.flatnonzero(hi >= 0)
        lo = np.where(live, pos, INT32_MAX).min(axis=(0, 2), initial=INT32_MAX)
        self._spans = (ids, lo[ids], hi[ids])
        return self._spans

    def _straddled(self, qpos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per position of ``qpos`` (T,) int64, the first and the last page holding keys both at or before it
        and after it (their bounds were taken over keys the row may not see), or -1 and -1.  Usually one page;
        after an h2o compaction the kv heads' pages cover different positions and a few may overlap."""
        ids, lo, hi = self._page_spans()
        first = np.full(qpos.shape[0], -1, np.int64)
        last = np.full(qpos.shape[0], -1, np.int64)
        if ids.size:
            i0 = np.searchsorted(hi, qpos, side="right")  # the first page with a key after qp
            i1 = np.searchsorted(lo, qpos, side="right") - 1  # the last page with a key at or before qp
            ok = i0 <= i1
            first[ok], last[ok] = ids[i0[ok]], ids[i1[ok]]
        return first, last

    def straddle_ids(self, qpos: np.ndarray) -> np.ndarray:
        first, last = self._straddled(qpos)
        return np.where(first >= 0, first * (self.n_pages() + 1) + last, -1)

    def _exact_lo(self) -> int:
        st = self.store
        return max(st.s0, st.slots - self.cfg.window)

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st, cfg = self.store, self.cfg
        # the exact window of the block's first row (its own key and the window slots before it; the newest
        # keys hold the newest positions, one slot each): later rows read it too, from further back
        first_own = st.slots - (st.n - int(qpos[0])) if qpos.shape[0] else st.slots - 1
        ex_lo, stop = max(st.s0, first_own - cfg.window + 1), st.slots
        n_pages = self.n_pages()
        hi = int(st.pos[0, ex_lo]) if ex_lo < st.slots else INT32_MAX
        first, last = self._straddled(qpos[:1]) if qpos.shape[0] and qpos[0] < st.n - 1 else ((-1,), (-1,))
        if first[0] >= 0:  # rows inside pages with later keys: those are read exactly, the pages before ranked
            ex_lo = min(ex_lo, st.s0 + int(first[0]) * cfg.page_size)
            stop = min(st.s0 + (int(last[0]) + 1) * cfg.page_size, st.slots)
            n_pages, hi = min(n_pages, int(first[0])), INT32_MAX
        n_probe = min(cfg.n_probe, n_pages)
        work = (stop - ex_lo + st.s0 + cfg.n_probe * cfg.page_size + n_pages // 8) * q.shape[0] * q.shape[1]
        return StepPlan(kd.MODE_PAGES, st.s0, ex_lo, stop, work=work, hi=hi, n_probe=n_probe,
                        n_ranges=2 + n_probe, pages=(self.pmin, self.pmax, self.pminpos), page_size=cfg.page_size)

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st, P, s0 = self.store, self.cfg.page_size, self.store.s0
        ex_lo = self._exact_lo()
        parts = [np.arange(s0), np.arange(ex_lo, st.slots)]
        n_pages = -(-(ex_lo - s0) // P)
        if n_pages:
            mn = st.decode(self.pmin[g, :n_pages]).astype(np.float64)
            mx = st.decode(self.pmax[g, :n_pages]).astype(np.float64)
            q64 = q.astype(np.float64)
            bound = np.maximum(q64 * mn, q64 * mx).sum(axis=1)  # float64, as the kernel (keys near 1e37)
            bound[self.pminpos[g, :n_pages] == kd.EVICTED] = -np.inf
            for b in np.argsort(-bound, kind="stable")[:self.cfg.n_probe]:
                if bound[b] > -np.inf:
                    parts.append(np.arange(s0 + b * P, min(s0 + (b + 1) * P, ex_lo)))
        return parts

    def index_nbytes(self) -> int:
        return self.n_pages() * self.cfg.num_kv_heads * (2 * self.cfg.head_dim * self.store.sdtype.itemsize + 4)

    def debug_arrays(self) -> dict[str, Any]:
        n = self.n_pages()
        return {"page_min": self.pmin[:, :n], "page_max": self.pmax[:, :n], "page_min_pos": self.pminpos[:, :n]}
