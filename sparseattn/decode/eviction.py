"""Memory-cap policies of the decode cache: which keys go when more than ``max_keys`` are held.

``streaming`` (StreamingLLM) evicts the oldest keys outside the sinks; ``h2o`` (Heavy-Hitter Oracle,
Zhang et al. 2023) evicts those of least accumulated attention weight outside the sinks and the newest
``window`` positions (every step adds to each key it read the softmax weight it got; ties evict the
oldest first).  Both share one mechanism: an evicted key's slot gets the position ``EVICTED`` (the
routing strategy hears of it and updates its index), and once ``segment`` keys have been evicted since
the last compaction the store frees their slots (:func:`compact`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..kernels.cache_ops import least_weight_slot, slots_of_positions
from .routing.base import Routing
from .store import EVICTED, SlotStore

__all__ = ["EvictionPolicy", "H2OPolicy", "StreamingPolicy", "compact", "make_policy"]


class EvictionPolicy:
    """Chooses the slots to evict; subclasses implement :meth:`victims`."""

    name: ClassVar[str] = ""

    def __init__(self, store: SlotStore, routing: Routing, *, sinks: int, window: int) -> None:
        self.store, self.routing, self.sinks, self.window = store, routing, sinks, window

    @property
    def weights(self) -> np.ndarray | None:
        """Per-slot accumulated attention weight (H_kv, cap) float64, or None when not tracked."""
        return None

    def committed(self, a: int, b: int) -> None:
        """Slots [a, b) were appended."""

    def victims(self, e: int) -> np.ndarray:
        """(H_kv, e) int64: the slots to evict per kv head."""
        raise NotImplementedError


class StreamingPolicy(EvictionPolicy):
    """The oldest non-sink keys go first."""

    name = "streaming"

    def __init__(self, store: SlotStore, routing: Routing, *, sinks: int, window: int) -> None:
        super().__init__(store, routing, sinks=sinks, window=window)
        self.lo_done = 0  # positions below this (sinks apart) are evicted

    def victims(self, e: int) -> np.ndarray:
        """(H_kv, e) slots of the positions ``[lo_done, lo_done + e)``."""
        st = self.store
        hk = st.num_kv_heads
        lo0 = max(self.lo_done, self.sinks)
        lo1 = lo0 + e
        self.lo_done = lo1
        s0 = st.s0
        if self.routing.position_order:  # position order, the evicted ones first: the next e slots
            first = s0 + (st.slots - st.n_live)
            return np.broadcast_to(np.arange(first, first + e, dtype=np.int64), (hk, e)).copy()
        # regions holding keys out of position order: scan every slot (compiled; a head's scan stops at
        # its e-th victim)
        out = np.empty((hk, e), np.int64)
        got = slots_of_positions(st.pos, max(s0, st.evict_from), st.slots, lo0, lo1, out)
        if got < e and st.evict_from > s0:  # not expected: the whole scan, before giving fewer
            got = slots_of_positions(st.pos, s0, st.slots, lo0, lo1, out)
        if got < e:
            raise RuntimeError(f"sparseattn internal error: {got} of the {e} positions to evict were found; "
                               f"please report it with the cache's parameters.")
        if got:  # later victims are newer: they sit in this region or after it
            first = int(out[:, :got].min())
            st.evict_from = max(a for a in self.routing.region_starts() + [s0] if a <= first)
        return out[:, :got]


class H2OPolicy(EvictionPolicy):
    """The keys of least accumulated attention weight go first (outside sinks and window)."""

    name = "h2o"

    def __init__(self, store: SlotStore, routing: Routing, *, sinks: int, window: int) -> None:
        super().__init__(store, routing, sinks=sinks, window=window)
        store.add_slot_array("weight", np.float64)

    @property
    def weights(self) -> np.ndarray:
        return self.store.weight

    def committed(self, a: int, b: int) -> None:
        self.store.weight[:, a:b] = 0.0

    def victims(self, e: int) -> np.ndarray:
        """(H_kv, e) slots of the e keys of least accumulated weight per kv head (ties: oldest first)."""
        st = self.store
        hk, n = st.num_kv_heads, st.slots
        out = np.empty((hk, e), np.int64)
        newest = st.n - self.window
        if e == 1:  # a decode step: one compiled scan per kv head
            least_weight_slot(st.pos, st.weight, n, self.sinks, newest, EVICTED, out[:, 0])
            if (out[:, 0] >= 0).all():
                return out
        for g in range(hk):
            p = st.pos[g, :n]
            w = np.where((p >= self.sinks) & (p < newest) & (p != EVICTED), st.weight[g, :n], np.inf)
            idx = np.argpartition(w, e - 1)[:e]
            thr = w[idx].max()
            less = np.flatnonzero(w < thr)
            tied = np.flatnonzero(w == thr)
            need = e - less.size
            if need < tied.size:
                tied = tied[np.argpartition(p[tied], need - 1)[:need]]
            out[g] = np.concatenate([less, tied])
        return out


def make_policy(name: str, store: SlotStore, routing: Routing, *, sinks: int, window: int) -> EvictionPolicy:
    """The policy ``name`` ("streaming" or "h2o")."""
    cls = {"streaming": StreamingPolicy, "h2o": H2OPolicy}[name]
    return cls(store, routing, sinks=sinks, window=window)


def enforce_cap(store: SlotStore, routing: Routing, policy: EvictionPolicy, max_keys: int | None,
                segment: int, counters: dict[str, Any]) -> None:
    """Evict down to ``max_keys`` (``policy`` picks the keys), then compact once ``segment`` keys have
    been evicted since the last compaction; ``counters`` gets ``evicted_keys`` and ``compactions``."""
    if max_keys is None or store.n_live <= max_keys:
        return
    e = store.n_live - max_keys
    kill = np.ascontiguousarray(policy.victims(e), dtype=np.int64)
    routing.evict(kill)
    store.n_live -= e
    counters["evicted_keys"] = store.n - store.n_live
    if store.slots - store.n_live - store.pad >= segment:
        compact(store, routing)
        counters["compactions"] += 1


def compact(store: SlotStore, routing: Routing) -> None:
    """Free the evicted slots: the routing strategy lays out the survivors, the store moves them."""
    live = store.pos[:, :store.slots] != EVICTED
    store.compact(routing.compaction_sources(live))
    routing.compacted()
