"""Index-selector routing: one selector of :mod:`sparseattn.selectors` that declares ``supports_add``
(e.g. ``"faiss-hnsw:M=16"``) per kv head, built on the first keys it accepts and grown with ``add()``;
each query reads the sinks and the newest ``window`` keys exactly plus the selector's top-``k`` among the
other keys it may see.

Candidates are fetched with a margin, filtered by position and re-ranked exactly, and the search is
widened when the filter leaves fewer than ``k``.  Evicted keys stay in the backend index (FAISS graphs
cannot delete) but are filtered out; the index is rebuilt from the live keys once the evicted ones
outnumber them.  Until the backend accepts the keys held (e.g. an IVF index needs ``nlist`` keys) every
key is read exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels import decode as kd
from ...threads import single_threaded_blas
from ..plan import StepPlan
from ..store import INT32_MAX
from .base import Routing, routing_classes

__all__ = ["SELECT_BLOCK_BYTES", "IndexRouting", "index_selector_names", "parse_index_selector"]

#: bytes of candidates (keys gathered for exact re-ranking, ids, slots, positions, masks) per block of rows
SELECT_BLOCK_BYTES = 16 << 20


def index_selector_names() -> list[str]:
    """Names of the library selectors that can grow with ``add()`` (``supports_add``), besides the cache's own."""
    from ...selectors import selector_classes

    own = routing_classes()
    return sorted(n for n, c in selector_classes().items() if c.supports_add and n not in own)


# where the parameters of the cache's own selectors are set (named by the spec-option refusal)
_BUDGET = "budget=Budget(n_probe=..., estimate=..., top_p=...)"
_OWN_PARAMS = {
    "topk": "its k is attend(k=...) (SparseCache(k=...), the command line's --k).",
    "window": "set the window with KVCache(retention=Retention(sinks=..., window=...)).",
    "cluster": f"set its parameters with KVCache({_BUDGET}, layout=Layout(segment=..., cluster_size=...)).",
    "pages": "set its parameters with KVCache(budget=Budget(n_probe=...), layout=Layout(page_size=...)).",
    "dense": "it has no parameters.",
}


def parse_index_selector(selector: object) -> Any:
    """An unbuilt template of the index selector ``selector`` names (ValueError naming the accepted ones)."""
    own = tuple(routing_classes())
    accepted = index_selector_names()
    usage = (f"selector must be one of {own} or the spec string of an index selector that supports "
             f"add() ({', '.join(accepted)}; e.g. 'faiss-hnsw:M=16')")
    if not isinstance(selector, str) or not selector.strip():
        raise ValueError(f"{usage}; got {selector!r}.")
    from ...selectors import get_selector, selector_classes
    from ...selectors.registry import parse_spec

    head = selector.split(":", 1)[0].strip()
    if ":" in selector and head in own:  # the cache's own routing with spec options it does not take
        raise ValueError(f"selector {selector!r}: the cache's {head!r} selector takes no options in its spec "
                         f"string (only 'sketch' does, e.g. 'sketch:candidates=2048'); {_OWN_PARAMS.get(head, '')}")
    parts = parse_spec(selector)
    names = [n for n, _ in parts]
    if len(parts) != 1 or names[0] not in accepted:
        classes = selector_classes()
        bad = [n for n in names if n in classes and not classes[n].supports_add]
        why = (f" ({', '.join(repr(n) for n in bad)} cannot grow with add(): supports_add is False)" if bad
               else " (a union of selectors cannot grow with add())" if len(parts) > 1 else "")
        raise ValueError(f"{usage}; got {selector!r}{why}.")
    return get_selector(selector)


class IndexRouting(Routing):
    """A grown index selector per kv head (see the module docstring)."""

    name = "index"
    supports = frozenset({"k"})

    def __init__(self, cfg: Any, store: Any) -> None:
        super().__init__(cfg, store)
        hk = cfg.num_kv_heads
        self.template = parse_index_selector(cfg.selector)
        store.add_slot_array("ids", np.int64)  # id of each slot in its head's index (-1: none)
        self.index: list[Any] = [None] * hk  # one per kv head (None: not built yet)
        self.index_slot: list[np.ndarray] = [np.zeros(0, np.int64)] * hk  # id -> slot (-1: evicted)
        self.index_dead = 0  # ids of evicted keys still in each head's index
        self.rebuilds = 0

    @property
    def built(self) -> bool:
        """The backend holds the keys (else every key is read exactly)."""
        return self.index[0] is not None

    # ---------------------------------------------------------------------------------- hooks
    def committed(self, a: int, b: int) -> None:
        """Grow each kv head's index with the keys of slots [a, b) (sinks excluded)."""
        st = self.store
        a = max(a, st.s0)
        if a >= b:
            return
        if not self.built:
            st.ids[:, a:b] = -1
            self.build()  # once the backend accepts the live keys held
            return
        for g in range(st.num_kv_heads):
            sel = self.index[g]
            start = sel.keys_.shape[0]
            sel.add(st.keys(g, slice(a, b)), check_finite=False)
            st.ids[g, a:b] = np.arange(start, start + (b - a), dtype=np.int64)
            slot_map = self.index_slot[g]
            if slot_map.size < start + (b - a):
                grown = np.full(max(2 * slot_map.size, start + (b - a), 64), -1, np.int64)
                grown[:slot_map.size] = slot_map
                self.index_slot[g] = slot_map = grown
            slot_map[start:start + (b - a)] = np.arange(a, b)

    def build(self) -> None:
        """(Re)build every kv head's index from its live non-sink keys; when the backend cannot train on
        that many, drop the index instead (every key is then read exactly until more keys come)."""
        st = self.store
        s0 = st.s0
        n_keys = st.n_live - s0  # live non-sink keys per kv head (sinks are never evicted)
        self.index_dead = 0
        if self.template.not_supported_reasons(n_keys=n_keys, dim=st.head_dim):
            self.index = [None] * st.num_kv_heads
            st.ids[:, :st.slots] = -1
            return
        for g in range(st.num_kv_heads):
            slots = s0 + np.flatnonzero(st.pos[g, s0:st.slots] != kd.EVICTED)
            sel = self.template.clone()
            with single_threaded_blas():
                sel.build(st.keys(g, slots), check_finite=False)
            self.index[g] = sel
            st.ids[g, :st.slots] = -1
            st.ids[g, slots] = np.arange(slots.size)
            slot_map = np.full(max(64, 2 * slots.size), -1, np.int64)
            slot_map[:slots.size] = slots
            self.index_slot[g] = slot_map

    def evict(self, kill: np.ndarray) -> None:
        super().evict(kill)
        if not self.built:
            return
        for g in range(self.store.num_kv_heads):
            ids = self.store.ids[g, kill[g]]
            self.index_slot[g][ids[ids >= 0]] = -1
        self.index_dead += kill.shape[1]

    def compacted(self) -> None:
        """Slots moved: id -> slot maps from the per-slot ids; rebuild once evicted ids outnumber live ones."""
        st = self.store
        if not self.built:
            return
        if self.index_dead > max(st.n_live, self.cfg.segment):
            self.build()
            self.rebuilds += 1
            return
        for g in range(st.num_kv_heads):
            ids = st.ids[g, :st.slots]
            ok = (ids >= 0) & (st.pos[g, :st.slots] != kd.EVICTED)
            self.index_slot[g][:] = -1
            self.index_slot[g][ids[ok]] = np.flatnonzero(ok)

    # ---------------------------------------------------------------------------------- a step
    def _exact(self) -> tuple[int, int]:
        """(first slot of the exact window, its first position)."""
        st = self.store
        ex_lo = max(st.s0, st.slots - self.cfg.window)
        return ex_lo, (int(st.pos[0, ex_lo]) if ex_lo < st.slots else INT32_MAX)

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st = self.store
        R = q.shape[0] * q.shape[1]
        if not self.built:
            return StepPlan(kd.MODE_NONE, st.s0, st.s0, st.slots, work=st.slots * R)
        k = min(k, max(st.slots, 1))
        ex_lo, hi = self._exact()
        rows = self.select(q, qpos, k, hi)
        return StepPlan(kd.MODE_LIST, st.s0, ex_lo, st.slots, work=(self.cfg.window + st.s0 + 4 * k) * R,
                        hi=hi, n_ranges=2 + rows.shape[1], rows_sel=rows)

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st, cfg = self.store, self.cfg
        if not self.built:
            return [np.arange(st.slots)]
        ex_lo, hi = self._exact()
        qq = np.zeros((cfg.num_heads, 1, cfg.head_dim), np.float32)
        qq[g * cfg.rep] = q
        row = self.select(qq, np.array([st.n - 1]), k, hi)[g * cfg.rep]
        return [np.arange(st.s0), np.arange(ex_lo, st.slots), row[row >= 0]]

    def select(self, q: np.ndarray, qpos: np.ndarray, k: int, hi: int) -> np.ndarray:
        """(H * T, k) int64 slots each row reads from its index (-1 padded, ascending): per row the ``k``
        best keys by ``q . k`` among those the index returns that the row may see and that are not in
        the exact part (sinks, positions >= ``hi``).  The search is widened until a row has ``k`` such
        keys or the index has no more to give.  Rows go through in blocks of about ``SELECT_BLOCK_BYTES``
        of candidates, so a long prefill needs memory linear in its length."""
        st = self.store
        H, T, E = q.shape
        rep = H // st.num_kv_heads
        out = np.full((H * T, k), -1, np.int64)
        for g in range(st.num_kv_heads):
            sel = self.index[g]
            S = sel.keys_.shape[0]
            if S == 0:
                continue
            qs = q[g * rep:(g + 1) * rep].reshape(rep * T, E)
            tpos = np.tile(qpos, rep)
            rows = (np.arange(g * rep, (g + 1) * rep)[:, None] * T + np.arange(T)[None, :]).reshape(-1)
            kq = min(S, k + self.cfg.window + T + 16 + 2 * self.index_dead * k // max(S, 1))
            block = max(1, SELECT_BLOCK_BYTES // (kq * (4 * E + 64)))
            for r0 in range(0, rep * T, block):
                r1 = min(r0 + block, rep * T)
                chosen = self._select_rows(g, qs[r0:r1], tpos[r0:r1], k, hi, kq)
                out[rows[r0:r1], :chosen.shape[1]] = chosen
        return out

    def _select_rows(self, g: int, qs: np.ndarray, tpos: np.ndarray, k: int, hi: int, kq: int) -> np.ndarray:
        """:meth:`select` for the rows ``qs`` (r, E) at positions ``tpos`` (r,) of kv head ``g``, starting
        with ``kq`` candidates per row: (r, min(k, candidates)) int64 slots, -1 padded, ascending."""
        st, sel = self.store, self.index[g]
        S = sel.keys_.shape[0]
        while True:
            ids = sel.query(qs, kq, check_finite=False).to_padded(kq)
            slots = np.where(ids >= 0, self.index_slot[g][np.maximum(ids, 0)], -1)
            p = np.where(slots >= 0, st.pos[g, np.maximum(slots, 0)].astype(np.int64), kd.EVICTED)
            ok = (slots >= 0) & (p >= self.cfg.sinks) & (p < hi) & (p <= tpos[:, None])
            short = ok.sum(axis=1) < k
            if kq >= S or not short.any() or (ids[short] >= 0).all(axis=1).sum() == 0:
                break
            kq = min(S, 2 * kq)
        kd_ = st.keys(g, np.maximum(slots, 0))  # (rows, kq, E)
        sc = np.where(ok, np.einsum("rke,re->rk", kd_, qs), -np.inf)
        kk = min(k, sc.shape[1])
        top = np.argpartition(-sc, kk - 1, axis=1)[:, :kk] if kk < sc.shape[1] else \
            np.broadcast_to(np.arange(sc.shape[1]), sc.shape)
        chosen = np.take_along_axis(slots, top, axis=1)
        chosen = np.where(np.take_along_axis(ok, top, axis=1), chosen, -1)
        chosen = np.sort(np.where(chosen < 0, np.iinfo(np.int64).max, chosen), axis=1)
        chosen[chosen == np.iinfo(np.int64).max] = -1
        return chosen

    # ---------------------------------------------------------------------------------- report
    def index_nbytes(self) -> int:
        return self.store.slots * self.cfg.num_kv_heads * 8 + sum(int(s.size) for s in self.index_slot) * 8

    def stats(self) -> dict[str, Any]:
        return {"index_rebuilds": self.rebuilds}

    def debug_arrays(self) -> dict[str, Any]:
        return {"indexes": tuple(self.index), "index_ids": self.store.ids[:, :self.store.slots]}
