"""Read-only reports of a decode cache: bytes held, counters, h2o weights and a debug view of its parts
(the reporting half of :class:`sparseattn.KVCache`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np

from ..inputs import check_positive_int
from .checks import check_kv_head, check_queries, check_query_tokens
from .store import EVICTED

__all__ = ["CacheReport"]


def _readonly(x: np.ndarray) -> np.ndarray:
    v = x.view()
    v.flags.writeable = False
    return v


class CacheReport:
    """Reporting methods of :class:`sparseattn.KVCache` (a mixin over its store, routing strategy and
    counters)."""

    _cfg: Any
    _store: Any
    _routing: Any
    _stats: dict[str, Any]
    _last_read: Any
    _lock: Any
    _run: Any
    _strategy: Any

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values (slots in use)."""
        return self._store.kv_nbytes

    @property
    def index_nbytes(self) -> int:
        """Bytes of everything beyond the keys and values: positions, routing vectors and cluster
        statistics, page bounds, h2o weights, index-selector slot maps (not the FAISS index itself)."""
        st = self._store
        total = st.slots * self.num_kv_heads * 4 + self._routing.index_nbytes()  # int32 position per slot
        if self.policy == "h2o" and self.max_keys is not None:
            total += st.slots * self.num_kv_heads * 8
        return total

    @property
    def nbytes(self) -> int:
        """Bytes held for the slots in use: keys, values and index (``kv_nbytes + index_nbytes``)."""
        return self.kv_nbytes + self.index_nbytes

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and timings.

        Cumulative since the cache was made: ``appends``, ``attends``, ``queries`` (query rows attended:
        heads x tokens), ``keys_read`` and ``clusters_estimated`` (summed over those rows), seconds in
        append / clustering / attend / the kernel, ``evicted_keys``, ``compactions``, ``index_rebuilds``,
        ``top_p_capped`` (rows whose ``top_p`` walk stopped at ``top_p_max_keys`` short of its goal: the cap
        bound).  Of the last attend: ``keys_read_per_query`` (mean), ``keys_read_max``, ``keys_read_min``,
        ``clusters_estimated_per_query``, ``top_p_capped_rows``.  Now: segments, clusters, tail keys, slots,
        bytes.
        ``keys_read / queries`` is the mean over every attend."""
        st = self._store
        out = {"cluster_seconds": 0.0, "segments_clustered": 0, "keys_read_per_query": 0.0, "keys_read_max": 0,
               "keys_read_min": 0, "clusters_estimated_per_query": 0.0, "top_p_capped_rows": 0,
               "index_rebuilds": 0, "segments": 0, "open_segment_keys": 0, "clusters_per_head": 0.0}
        out.update(self._stats)
        out.update(self._routing.stats())
        if self._last_read is not None:
            nread, nest, ncap = self._last_read
            out.update(keys_read_per_query=float(nread.mean()), keys_read_max=int(nread.max()),
                       keys_read_min=int(nread.min()), clusters_estimated_per_query=float(nest.mean()),
                       top_p_capped_rows=int(ncap.sum()))
        out.update(tail_keys=st.slots - self._routing.tail_start(), len=len(self), kv_nbytes=self.kv_nbytes,
                   index_nbytes=self.index_nbytes, slots=st.slots,
                   append_us_per_token=(1e6 * self._stats["append_seconds"] / st.n) if st.n else 0.0)
        return out

    def heavy_hitter_weights(self, kv_head: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``policy="h2o"``: (positions int64, accumulated attention weights float64) of the attendable keys
        of kv head ``kv_head``, sorted by position."""
        if self.policy != "h2o":
            raise ValueError(f"heavy_hitter_weights needs policy='h2o'; this cache has policy={self.policy!r}.")
        kv_head = check_kv_head(self._cfg, kv_head)
        st = self._store
        p = st.pos[kv_head, :st.slots].astype(np.int64)
        w = st.weight[kv_head, :st.slots] if st.weight.shape[1] else np.zeros(st.slots)
        live = p != EVICTED
        order = np.argsort(p[live], kind="stable")
        return p[live][order], w[live][order]

    def debug_view(self) -> MappingProxyType:
        """Read-only views of the cache's internals, for tests and measurements (the layout may change
        between releases; nothing here is needed to use the cache).

        Keys: ``slots`` (int, slots in use), ``positions`` (H_kv, slots) int32 (``EVICTED`` for an
        evicted slot), ``keys`` (H_kv, slots, E) and ``values`` (H_kv, slots, Ev) float32, ``raw_keys`` /
        ``raw_values`` (the storage arrays, whole capacity, storage dtype), ``weights`` (h2o: (H_kv,
        slots) float64) and the routing strategy's arrays (``cluster``: ``n_clusters``, ``cluster_ptr``,
        ``cluster_count``, ``cluster_value_mean``, ``cluster_min_pos``, ``cluster_max_pos``,
        ``routing_codes`` (int8) and ``routing_scales`` (float32), ``routing_vectors`` (their product), ``segment_starts``, ``open_segment``; ``pages``: ``page_min``, ``page_max``,
        ``page_min_pos``; ``sketch``: the cluster keys and ``sketch_rotation``, ``sketch_radius``, ``sketch_plan_rows``,
        ``sketch_reads_all`` (this step would read every key); index selectors: ``indexes``, ``index_ids``).
        """
        st = self._store
        n = st.slots
        view: dict[str, Any] = {"slots": n, "positions": _readonly(st.pos[:, :n]),
                                "keys": _readonly(st.decode(st.K[:, :n])), "values": _readonly(st.decode(st.V[:, :n])),
                                "raw_keys": _readonly(st.K), "raw_values": _readonly(st.V)}
        if self.policy == "h2o":
            view["weights"] = _readonly(st.weight[:, :n])
        view.update({k: _readonly(v) if isinstance(v, np.ndarray) else v
                     for k, v in self._routing.debug_arrays().items()})
        return MappingProxyType(view)

    def debug_step(self, queries: np.ndarray, qpos: np.ndarray, k: int = 64, selector: str | None = None,
                   *, record: bool = True) -> tuple[np.ndarray, ...]:
        """One kernel call without the checks and bookkeeping of :meth:`attend` (for tests and measurements).

        ``queries`` (H, T, E) float32 C-contiguous at positions ``qpos`` (T,) int64; returns (out (H, T, Ev),
        lse (H, T), keys read (R,), clusters estimated (R,), rec (R, n, 3), n_rec (R,)) with ``R = H * T``
        and ``rec[r, :n_rec[r]]`` the slot ranges (first, stop, lim) row r scored (slot j of a range was
        read iff its position is ``<= qpos[t]`` and ``< lim``).  Under ``policy="h2o"`` the weights are
        accumulated as by :meth:`attend`.
        """
        with self._lock:
            res = self._run(queries, qpos, k, self._strategy(selector), record=record)
        return res.out, res.lse, res.nread, res.nest, res.rec, res.n_rec

    def audit(self, queries: object, k: int = 64) -> dict[str, np.ndarray]:
        """Recall report of one decode step: which keys the cache's selector reads for ``queries`` at the
        newest position, against an exact scan of every live key (float64).  Opt-in: it scores every key.

        Parameters
        ----------
        queries : (H, E) or (H, 1, E) float array
            One query token per head (the step being audited; the cache is not changed).
        k : int, default 64
            Size of the exact top-k whose recall is reported.

        Returns
        -------
        dict of (H,) arrays: ``keys_read`` (int64, keys the step reads), ``recall`` (float64, share of the
        exact top-``k`` keys among them; a read key whose score ties with the k-th best counts as one),
        ``mass`` (float64, share of the exact softmax mass they hold).
        """
        q32, _ = check_queries(self._cfg, queries)  # the checks of attend: dtype, shape, NaN/Inf, range
        H, E = self._cfg.num_heads, self._cfg.head_dim
        if q32.shape[1] != 1:
            raise ValueError(f"queries must have shape ({H}, {E}) or ({H}, 1, {E}) (one token per head); "
                             f"got {q32.shape[1]} tokens.")
        check_query_tokens(1, self._store.n)
        q = q32.reshape(H, E).astype(np.float64)
        k = check_positive_int(k, "k")
        out = {"keys_read": np.zeros(H, np.int64), "recall": np.zeros(H), "mass": np.zeros(H)}
        with self._lock:
            st = self._store
            rep = H // self._cfg.num_kv_heads
            for h in range(H):
                sel = self.selected_slots(q[h], h)
                top = self.selected_slots(q[h], h, k=k, selector="topk")
                g = h // rep
                live = np.flatnonzero(st.pos[g, :st.slots] != EVICTED)
                s = st.keys(g, live).astype(np.float64) @ q[h] * self._cfg.scale
                w = np.exp(s - s.max()) if s.size else s
                w = w / w.sum() if s.size else w
                out["keys_read"][h] = sel.size
                is_read = np.isin(live, sel)
                # recall counts a read key tying with the k-th best score as one of the top k (copies of
                # one key are interchangeable)
                if top.size:
                    kth = np.partition(s, s.size - top.size)[s.size - top.size]
                    read = s[is_read]
                    above = int(np.count_nonzero(s > kth))  # keys strictly better than the k-th: all count
                    hits = int(np.count_nonzero(read > kth)) + min(int(np.count_nonzero(read == kth)),
                                                                   top.size - above)
                    out["recall"][h] = hits / top.size
                else:
                    out["recall"][h] = 1.0
                out["mass"][h] = float(w[is_read].sum()) if s.size else 1.0
        return out
