"""Strategies without an index: every key (``dense``), sinks + recent window (``window``), exact top-k
(``topk``, the accuracy reference: it scores every key)."""

from __future__ import annotations

import numpy as np

from ...kernels import decode as kd
from ..plan import StepPlan
from .base import Routing, register_routing

__all__ = ["DenseRouting", "TopKRouting", "WindowRouting"]


@register_routing
class WindowRouting(Routing):
    """The sinks and the newest ``window`` slots."""

    name = "window"
    any_cache = True

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st = self.store
        work = (self.cfg.window + st.s0) * q.shape[0] * q.shape[1]
        return StepPlan(kd.MODE_NONE, st.s0, max(st.s0, st.slots - self.cfg.window), st.slots, work=work)

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st = self.store
        return [np.arange(st.s0), np.arange(max(st.s0, st.slots - self.cfg.window), st.slots)]


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
class DenseRouting(Routing):
    """Every visible key, exactly: the exact decode step."""

    name = "dense"
    any_cache = True

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st = self.store
        return StepPlan(kd.MODE_NONE, st.s0, st.s0, st.slots, work=st.slots * q.shape[0] * q.shape[1])

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        return [np.arange(self.store.slots)]
