"""Strategies without an index: every key (``dense``), sinks + recent window (``window``), exact top-k
(``topk``, the accuracy reference: it scores every key)."""

from __future__ import annotations

import numpy as np

from ...kernels import decode as kd
from ..plan import PLAN_BYTES, StepPlan
from ..store import EVICTED
from .base import Routing, register_routing

__all__ = ["DenseRouting", "TopKRouting", "WindowRouting"]

INT64_MAX = np.iinfo(np.int64).max


class _RangeRouting(Routing):
    """The sinks and every slot from :meth:`recent_start` on, attended exactly (no key is scored)."""

    any_cache = True

    def recent_start(self) -> int:
        """First slot after the sinks that the step reads."""
        raise NotImplementedError

    def work_slots(self) -> int:
        """Slots the step's cost is counted over (times query rows and dimensions)."""
        raise NotImplementedError

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st = self.store
        return StepPlan(kd.MODE_NONE, st.s0, self.recent_start(), st.slots,
                        work=self.work_slots() * q.shape[0] * q.shape[1])

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st = self.store
        return [np.arange(st.s0), np.arange(self.recent_start(), st.slots)]


@register_routing
class WindowRouting(_RangeRouting):
    """The sinks and the newest ``window`` slots: of the cache for a decode step; for the rows of a
    multi-token attend, the ``window`` newest live keys at or before each row's own position."""

    name = "window"

    def recent_start(self) -> int:
        return max(self.store.s0, self.store.slots - self.cfg.window)

    def work_slots(self) -> int:
        return self.cfg.window + self.store.s0

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st, T, W = self.store, q.shape[1], self.cfg.window
        if T == 1:
            return super().plan(q, qpos, k)
        # each row: the W newest live keys at or before its position (after the sinks), found by position
        # (a cluster or sketch cache keeps its older slots in cluster order, not position order)
        H, hk = q.shape[0], st.num_kv_heads
        rep = H // hk
        parts, width, covers = [], 1, True
        for g in range(hk):
            pos = st.pos[g, st.s0:st.slots].astype(np.int64)
            live = np.flatnonzero(pos != EVICTED)
            order = live[np.argsort(pos[live], kind="stable")] + st.s0  # live slots in position order
            hi = np.searchsorted(pos[order - st.s0], qpos, side="right")  # (T,) keys at or before each row
            lo = np.maximum(hi - W, 0)
            covers &= bool((lo == 0).all())
            parts.append((order, lo, hi))
            width = max(width, int((hi - lo).max(initial=0)))
        if covers:  # every row's window holds all its earlier keys: one range, masked causally
            return StepPlan(kd.MODE_NONE, st.s0, st.s0, st.slots, work=(W + st.s0) * H * T)
        rows = np.full((H, T, width), -1, np.int64)
        cols = np.arange(width)
        for g, (order, lo, hi) in enumerate(parts):
            idx = lo[:, None] + cols[None, :]
            ok = idx < hi[:, None]
            sel = np.where(ok, order[np.minimum(idx, max(order.size - 1, 0))] if order.size else -1, INT64_MAX)
            sel = np.sort(sel, axis=1)  # ascending slots (a forward sweep), the padding last
            rows[g * rep:(g + 1) * rep] = np.where(sel == INT64_MAX, -1, sel)[None]
        return StepPlan(kd.MODE_LIST, st.s0, st.slots, st.slots, work=(W + st.s0) * H * T, n_ranges=2 + width,
                        rows_sel=rows.reshape(H * T, width))

    def max_tokens(self, num_heads: int) -> int | None:
        # a multi-token plan lists each row's window slots (int64): at most PLAN_BYTES of them per block
        return max(1, PLAN_BYTES // (8 * num_heads * max(min(self.cfg.window, self.store.slots), 1)))


@register_routing
class TopKRouting(Routing):
    """The ``k`` visible keys of largest ``q . k`` (every key scored), attended exactly."""

    name = "topk"
    any_cache = True
    supports = frozenset({"k"})

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st = self.store
        k = min(k, max(st.slots, 1))
        return StepPlan(kd.MODE_TOPK, st.s0, st.s0, st.slots, work=st.slots * q.shape[0] * q.shape[1],
                        n_probe=k, n_ranges=k)

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st = self.store
        visible = st.pos[g, :st.slots] != kd.EVICTED
        sc = np.where(visible, st.keys(g) @ q, -np.inf)
        return [np.argsort(-sc, kind="stable")[:k]]


@register_routing
class DenseRouting(_RangeRouting):
    """Every visible key, exactly: the exact decode step."""

    name = "dense"

    def recent_start(self) -> int:
        return self.store.s0

    def work_slots(self) -> int:
        return self.store.slots
