"""Cluster routing (the default strategy): per kv head, one score per cluster routing vector, the
``n_probe`` best clusters read (or, with ``top_p``, clusters in order of estimated mass until ``top_p``
of it is read), the next ``estimate`` clusters estimated from their statistics; the sinks and the
not-yet-clustered tail are exact.  The layout it routes over is :mod:`.cluster_layout`."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...kernels import decode as kd
from ...kernels.cache_ops import mark_evicted_clusters
from ..plan import StepPlan
from .base import Routing, register_routing
from .cluster_layout import ClusterLayout

__all__ = ["ClusterRouting"]


@register_routing
class ClusterRouting(Routing):
    """Routing over the clusters of segments of keys (see the module docstring)."""

    name = "cluster"
    supports = frozenset({"n_probe", "estimate", "top_p"})
    default_probe = 32
    position_order = False

    def __init__(self, cfg: Any, store: Any) -> None:
        super().__init__(cfg, store)
        self.layout = ClusterLayout(store, segment=cfg.segment, open_step=cfg.open_step, window=cfg.window,
                                    sinks=cfg.sinks, cluster_size=cfg.cluster_size, seed=cfg.seed)
        self.cluster_seconds = 0.0

    # ---------------------------------------------------------------------------------- hooks
    def committed(self, a: int, b: int) -> None:
        t0 = time.perf_counter()
        if self.layout.cluster_new():
            self.cluster_seconds += time.perf_counter() - t0

    def evict(self, kill: np.ndarray) -> None:
        lay = self.layout
        mark_evicted_clusters(self.store.pos, kill, lay.cptr, lay.n_cent, lay.cmaxpos, kd.EVICTED)

    def compaction_sources(self, live: np.ndarray) -> list[np.ndarray]:
        return self.layout.compaction_sources(live)

    def tail_start(self) -> int:
        return self.layout.open_end

    def region_starts(self) -> list[int]:
        return [a for a, _ in self.layout.segments] + [self.layout.seg_end, self.layout.open_end]

    # ---------------------------------------------------------------------------------- a step
    def straddle_ids(self, qpos: np.ndarray) -> np.ndarray:
        return self.layout.straddle_ids(qpos)

    def scope(self, qpos: np.ndarray) -> tuple[int, int, np.ndarray]:
        """(first exact slot, stop slot, routed clusters per kv head) of a block of rows at ``qpos`` (one
        block of :meth:`token_blocks`).

        Rows after every clustered key route over all clusters and read the tail exactly.  Rows inside a
        clustered region (a multi-token attend over keys appended with it) read that region's visible keys
        exactly and route over the regions before it only (:meth:`ClusterLayout.straddle_ids`: strict
        causality, up to the float32 rounding of the region's summation order).  Later regions and the
        tail hold only later keys, so they are not scanned."""
        st, lay = self.store, self.layout
        i = int(lay.straddle_ids(qpos[:1])[0]) if qpos.shape[0] and qpos[0] < st.n - 1 else -1
        if i < 0:
            return lay.open_end, st.slots, lay.n_cent
        _, _, a, b, first = lay.spans()[i]
        return a, b, np.minimum(first, lay.n_cent)

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st, cfg, lay = self.store, self.cfg, self.layout
        ex_lo, stop, n_cent = self.scope(qpos)
        n_cmax = int(n_cent.max())  # (H_kv,), never empty
        n_probe = min(cfg.n_probe, n_cmax)
        mode, n_ranges = kd.MODE_CLUSTER, 2 + n_probe
        if cfg.top_p is not None:
            mode, n_ranges = kd.MODE_MASS, 2 + n_cmax
        budget = cfg.top_p_max_keys if cfg.top_p is not None else cfg.n_probe * cfg.cluster_size
        # the routing scan: one int8 vector of E bytes per cluster, counted in keys' bytes
        key_bytes = (cfg.head_dim + cfg.value_dim) * st.sdtype.itemsize
        route = n_cmax * cfg.head_dim // max(key_bytes, 1)
        work = (stop - ex_lo + st.s0 + budget + route) * q.shape[0] * q.shape[1]
        clusters = lay.kernel_arrays()
        if n_cent is not lay.n_cent:
            clusters = clusters[:3] + (np.ascontiguousarray(n_cent, np.int64),) + clusters[4:]
        return StepPlan(mode, st.s0, ex_lo, stop, work=work, n_probe=n_probe,
                        n_est=min(cfg.estimate, n_cmax), n_ranges=n_ranges, clusters=clusters,
                        top_p=cfg.top_p if cfg.top_p is not None else 1.0, tp_min=cfg.top_p_min_keys,
                        tp_max=cfg.top_p_max_keys)

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st, lay = self.store, self.layout
        parts = [np.arange(st.s0), np.arange(lay.open_end, st.slots)]
        nc = int(lay.n_cent[g])
        if nc and self.cfg.top_p is not None:
            parts += self.mass_walk(q, g, np.concatenate(parts).astype(np.int64))
        elif nc:
            sc = lay.routing(g, nc) @ q
            top = np.argsort(-sc, kind="stable")[:self.cfg.n_probe]
            parts += [np.arange(lay.cptr[g, c], lay.cptr[g, c + 1]) for c in top]
        return parts

    def mass_walk(self, q: np.ndarray, g: int, exact: np.ndarray) -> list[np.ndarray]:
        """``top_p`` routing of one query at the newest position (float64 replay of the kernel's walk,
        :func:`sparseattn.kernels.decode_route.route_clusters` and ``mass_open``): the slot ranges of the
        clusters read."""
        st, cfg, lay = self.store, self.cfg, self.layout
        nc = int(lay.n_cent[g])
        qp = st.n - 1
        exact = exact[st.pos[g, exact] <= qp]
        q64 = q.astype(np.float64)
        s_ex = st.keys(g, exact).astype(np.float64) @ q64 * cfg.scale
        cnt = lay.ccount[g, :nc]
        qc = lay.routing(g, nc).astype(np.float64) @ q64
        q2 = float(q64 @ q64)
        sp = lay.cspread[g, :nc]
        la = np.array([kd.cluster_log_mass(qc[c], cfg.scale, q2, cnt[c], sp[c, 0], sp[c, 1])
                       if cnt[c] > 0 and lay.cminpos[g, c] <= qp else -np.inf for c in range(nc)], np.float64)
        m = max(float(s_ex.max()) if s_ex.size else -np.inf, float(la.max()) if nc else -np.inf)
        cum = float(np.exp(s_ex - m).sum()) if s_ex.size else 0.0
        goal = kd.mass_goal(cfg.top_p, cum + float(np.exp(la - m).sum()))
        out, nk = [], 0
        for c in np.argsort(-la, kind="stable"):
            if la[c] == -np.inf or (cfg.top_p < 1.0 and cum >= goal and nk >= cfg.top_p_min_keys):
                break
            size = int(lay.cptr[g, c + 1] - lay.cptr[g, c])
            if nk + size > cfg.top_p_max_keys:
                break
            nk += size
            cum += float(np.exp(la[c] - m))
            out.append(np.arange(lay.cptr[g, c], lay.cptr[g, c + 1]))
        return out

    # ---------------------------------------------------------------------------------- report
    def index_nbytes(self) -> int:
        return self.layout.nbytes()

    def stats(self) -> dict[str, Any]:
        lay = self.layout
        return {"cluster_seconds": self.cluster_seconds, "segments_clustered": lay.segments_clustered,
                "segments": len(lay.segments), "open_segment_keys": lay.open_end - lay.seg_end,
                "clusters_per_head": float(lay.n_cent.mean())}

    def debug_arrays(self) -> dict[str, Any]:
        lay = self.layout
        n = int(lay.n_cent.max(initial=0))
        return {"n_clusters": lay.n_cent, "cluster_ptr": lay.cptr[:, :n + 1], "cluster_count": lay.ccount[:, :n],
                "cluster_value_mean": lay.cvmean[:, :n], "cluster_min_pos": lay.cminpos[:, :n],
                "cluster_max_pos": lay.cmaxpos[:, :n], "cluster_spread": lay.cspread[:, :n],
                "routing_codes": lay.cent[:, :n], "routing_scales": lay.cscale[:, :n],
                "routing_vectors": np.stack([lay.routing(g, n) for g in range(lay.n_cent.shape[0])]),
                "segment_starts": [a for a, _ in lay.segments], "open_segment": (lay.seg_end, lay.open_end)}
