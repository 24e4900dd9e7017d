"""Strategies without an index: every key (``dense``), sinks + recent window (``window``), exact top-k
(``topk``, the accuracy reference: it scores every key)."""

from __future__ import annotations

import numpy as np

from ...kernels import decode as kd
from ..plan import PLAN_BYTES, StepPlan
from .base import Routing, register_routing

__all__ = ["DenseRouting", "TopKRouting", "WindowRouting"]


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
    """The sinks and the newest ``window`` slots: of the cache for a decode step, of each query's own
    position for the rows of a multi-token attend (row t reads the ``window`` slots up to its own key)."""

    name = "window"

    def recent_start(self) -> int:
        return max(self.store.s0, self.store.slots - self.cfg.window)

    def work_slots(self) -> int:
        return self.cfg.window + self.store.s0

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st, T = self.store, q.shape[1]
        # the slot of each row's own key: the newest keys hold the newest positions, one slot each
        own = st.slots - (st.n - qpos.astype(np.int64))
        lo = np.maximum(st.s0, own - self.cfg.window + 1)
        if T == 1 or lo[-1] == st.s0:  # one row, or every row's window reaches back to the sinks: one range
            return super().plan(q, qpos, k)
        width = max(int((own - lo).max()) + 1, 1)  # rows inside the sinks list nothing (-1) beyond them
        cols = np.arange(width)
        sel_t = np.where(cols[None, :] <= (own - lo)[:, None], lo[:, None] + cols[None, :], -1)  # (T, width)
        rows = np.ascontiguousarray(np.broadcast_to(sel_t[None], (q.shape[0], T, width)).reshape(-1, width))
        return StepPlan(kd.MODE_LIST, st.s0, st.slots, st.slots, work=(self.cfg.window + st.s0) * q.shape[0] * T,
                        n_ranges=2 + width, rows_sel=rows)

    def max_tokens(self, num_heads: int) -> int | None:
        # a multi-token plan lists each row's window slots (int64): at most PLAN_BYTES of them per block
        return max(1, PLAN_BYTES // (8 * num_heads * max(self.cfg.window, 1)))


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
