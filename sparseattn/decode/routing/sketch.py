"""Sketch routing: every clustered key keeps a 4-bit code of its residual from its cluster's routing
vector; a step estimates every routed key's score from the codes' top bit (the sign: clusters whose ball
bound cannot reach the best estimates found are skipped), re-ranks a shortlist of the best by the whole
4-bit code, and reads the ``candidates`` keys of largest re-ranked estimate exactly, with the sinks and the
not-yet-clustered tail (see :mod:`sparseattn.kernels.sketch` for the estimators).

Unlike ``cluster`` routing, which reads whole clusters ranked by their mean key and misses a key that
points at the query when the rest of its cluster does not, the sketch ranks keys one by one, so its
recall of the keys that carry a step's softmax mass does not fall as the cache grows.  The price is a
scan of ``8 ceil(E / 64) + 4`` bytes per routed key per step (the sign codes in whole 64-bit words and
their factors; 2.3 % of float32 K and V at E = 64) and ``24 ceil(E / 64) + 4`` more per shortlisted key,
besides the exact reads.  The codes hold ``32 ceil(E / 64) + 8`` bytes a key (7.8 % of float32 K and V at
E = 64; 9.5-9.7 % with the cluster layout, measured).

Options come with the selector: ``"sketch"``, ``"sketch:candidates=N"`` (keys read exactly per query
from the routed part; default ``max(1024, 1/128 of the routed keys)``) or ``"sketch:fraction=F"`` (F of
the routed keys, at least 1024), and ``shortlist=S`` (the share of the routed keys the sign scan passes
to the re-ranking, default 0.03, at least 4 x the candidates), e.g. ``"sketch:candidates=2048,shortlist=0.05"``.
While the candidates would be more than an eighth of the routed keys (a cache of up to about 8,000 keys
at the default) the step reads every key exactly instead: the scan and scattered reads would cost more
than reading the keys in order.  While the shortlist would be more than an eighth of the routed keys (up
to about 32,000 keys at the default) there is one stage: every routed key is estimated from its whole 4-bit
code, streamed in slot order, and the best ``candidates`` are read (re-ranking a quarter of the keys by
scattered reads cost more: 4 query / 1 kv heads at E = 256 and 16,384 keys, 2.7 ms two-stage against
1.9 ms, recall@64 0.997 against 1.000; at E = 64, 8 heads, 2.3-2.5 ms against 2.6 ms at 16,384 and 6.9
against 4.0 ms at 32,768).  The layout (segments, k-means clusters of about ``cluster_size`` keys) is
the ``cluster`` strategy's; ``estimate`` and ``top_p`` are not supported.
"""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

import numpy as np

from ...kernels import decode as kd
from ...kernels import sketch as ks
from ...threads import get_num_threads, single_threaded_blas
from ..plan import PLAN_BYTES, StepPlan, group_size, parallel_step
from ..store import EVICTED
from .base import register_routing
from .cluster import ClusterRouting

__all__ = ["SketchRouting", "parse_sketch"]

MIN_CANDIDATES = 1024
DEFAULT_FRACTION = 1 / 128  # keys read exactly (at least MIN_CANDIDATES)
DEFAULT_SHORTLIST = 0.03  # keys re-ranked by the 4-bit codes (at least SHORTLIST_RATIO x the candidates)
SHORTLIST_RATIO = 4
DENSE_RATIO = 8  # candidates above 1/8 of the routed keys: read every key instead (see reads_all)
# A shortlist above 1/ONE_STAGE_RATIO of the routed keys: every key is estimated from its whole 4-bit code
# in one streamed pass instead (re-ranking that many keys by scattered reads costs more; see one_stage)
ONE_STAGE_RATIO = 8


def parse_sketch(selector: object) -> dict[str, float] | None:
    """Options of a ``"sketch[:name=value,...]"`` selector spec; None when ``selector`` is not one.
    ValueError naming the option for an unknown name or a bad value."""
    if not isinstance(selector, str) or not (selector == "sketch" or selector.startswith("sketch:")):
        return None
    out: dict[str, float] = {}
    body = selector[len("sketch:"):] if ":" in selector else ""
    for part in filter(None, body.split(",")):
        name, eq, val = part.partition("=")
        name = name.strip()
        if not eq or name not in ("candidates", "fraction", "shortlist"):
            raise ValueError(f"selector {selector!r}: unknown option {part!r}; 'sketch' takes candidates=<int >= 1> "
                             f"or fraction=<float in (0, 1]>, and shortlist=<float in (0, 1]>, e.g. "
                             f"'sketch:candidates=4096,shortlist=0.05'.")
        try:
            if name == "candidates" and not val.strip().isdigit():  # int() would take "5_0" as 50
                raise ValueError(val)
            x = int(val) if name == "candidates" else float(val)
        except ValueError:
            what = "an integer >= 1" if name == "candidates" else "a number"
            raise ValueError(f"selector {selector!r}: {name} must be {what}; got {val!r}.") from None
        if name == "candidates" and not 1 <= x <= 2**31 - 2:
            raise ValueError(f"selector {selector!r}: candidates must be an int in [1, {2**31 - 2}]; got {val!r}.")
        if name in ("fraction", "shortlist") and not 0 < x <= 1:
            raise ValueError(f"selector {selector!r}: {name} must be in (0, 1]; got {val!r}.")
        out[name] = x
    if "candidates" in out and "fraction" in out:
        raise ValueError(f"selector {selector!r}: pass candidates or fraction, not both.")
    return out


@register_routing
class SketchRouting(ClusterRouting):
    """Routing by 4-bit residual sketches over the ``cluster`` layout (see the module docstring)."""

    name = "sketch"
    supports = frozenset()
    default_probe = 0
    rotation_seed: ClassVar[int] = 12

    def __init__(self, cfg: Any, store: Any) -> None:
        super().__init__(cfg, store)
        self.options = parse_sketch(cfg.selector) or {}
        E = cfg.head_dim
        q, rr = np.linalg.qr(np.random.default_rng(self.rotation_seed).standard_normal((E, E)))
        self.rot = np.ascontiguousarray(q * np.sign(np.diag(rr)))  # (E, E) float64 orthogonal
        store.add_slot_array("sketch_codes", np.uint8, (ks.code_bytes(E),))
        store.add_slot_array("sketch_fac", np.float32)
        store.add_slot_array("sketch_fine", np.uint8, (3 * ks.code_bytes(E),))  # code planes 0-2 (3: the signs)
        store.add_slot_array("sketch_fscale", np.float32)
        self.rad = np.zeros((cfg.num_kv_heads, 0), np.float64)  # per cluster: largest live residual norm
        self.scanned = 0
        self.steps = 0
        self._est = np.empty((0, 0), np.float64)  # scan scratch per worker (reused: fresh pages cost more)
        self._ids = np.empty((0, 0), np.int64)
        self._tmp = np.empty((0, 0), np.float64)
        self._scratch_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_scratch_lock", None)  # a lock does not pickle; the scratch is rebuilt on demand
        state["_est"], state["_ids"] = np.empty((0, 0), np.float64), np.empty((0, 0), np.int64)
        state["_tmp"] = np.empty((0, 0), np.float64)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scratch_lock = threading.Lock()

    # ---------------------------------------------------------------------------------- hooks
    def committed(self, a: int, b: int) -> None:
        first = self.layout.closed_cent.copy()  # clusters from here on may be (re)built below
        before = self.layout.segments_clustered, self.layout.open_end
        super().committed(a, b)
        if (self.layout.segments_clustered, self.layout.open_end) != before:
            self.encode(first)

    def compacted(self) -> None:
        super().compacted()
        self.encode(np.zeros(self.store.num_kv_heads, np.int64))

    def encode(self, first: np.ndarray) -> None:
        """Codes, factors and cluster radii of clusters ``[first[g], n_cent[g])`` of every kv head."""
        st, lay = self.store, self.layout
        if self.rad.shape[1] < lay.cent.shape[1]:
            rad = np.zeros((st.num_kv_heads, lay.cent.shape[1]), np.float64)
            rad[:, :self.rad.shape[1]] = self.rad
            self.rad = rad
        for g in range(st.num_kv_heads):
            c0, c1 = int(first[g]), int(lay.n_cent[g])
            if c1 <= c0:
                continue
            a, b = int(lay.cptr[g, c0]), int(lay.cptr[g, c1])
            sizes = np.diff(lay.cptr[g, c0:c1 + 1])
            mu = lay.routing(g, c1)[c0:].astype(np.float64)
            res = st.keys(g, slice(a, b)).astype(np.float64) - np.repeat(mu, sizes, axis=0)
            # one BLAS thread: a multi-threaded product leaves BLAS's threads spinning for ~0.1 s, which
            # halved the speed of the next parallel decode steps (measured: 1.8 against 1.0 ms)
            with single_threaded_blas():
                codes, fac, norm, fine, fscale = ks.encode_residuals(res, self.rot)
            st.sketch_codes[g, a:b] = codes
            st.sketch_fac[g, a:b] = fac
            st.sketch_fine[g, a:b] = fine
            st.sketch_fscale[g, a:b] = fscale
            live = st.pos[g, a:b] != EVICTED
            norm = np.where(live, norm, 0.0)
            self.rad[g, c0:c1] = np.maximum.reduceat(norm, np.cumsum(sizes) - sizes) if norm.size else 0.0
            self.rad[g, c0:c1][sizes == 0] = 0.0

    # ---------------------------------------------------------------------------------- a step
    def candidates(self) -> int:
        """Keys read exactly per query from the routed part."""
        routed = max(self.layout.open_end - self.store.s0, 0)
        if "candidates" in self.options:
            return int(self.options["candidates"])
        frac = self.options.get("fraction", DEFAULT_FRACTION)
        return max(MIN_CANDIDATES, math.ceil(frac * routed))

    def shortlist(self) -> int:
        """Keys per query the sign scan passes to the re-ranking (>= the candidates)."""
        routed = max(self.layout.open_end - self.store.s0, 0)
        frac = self.options.get("shortlist", DEFAULT_SHORTLIST)
        # never more than the routed keys (the scan's buffers scale with it; a step that would shortlist
        # more than an eighth of them reads every key instead, see reads_all)
        return min(max(SHORTLIST_RATIO * self.candidates(), math.ceil(frac * routed)), max(routed, 1))

    def _scan(self, q: np.ndarray, qpos: np.ndarray, R: int, n_cent: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        st, lay, cfg = self.store, self.layout, self.cfg
        rows = np.empty((q.shape[0] * q.shape[1], R), np.int64)
        scanned = np.empty(q.shape[0] * q.shape[1], np.int64)
        # a code word (64 dimensions) is ~1/16 of an E = 64 key's reads and arithmetic: 4 query / 1 kv heads,
        # E = 256, 32,768 keys scanned in 0.71 ms parallel against 1.29 ms serial (two stages)
        W = st.sketch_codes.shape[2] // 8
        par = parallel_step((lay.open_end - st.s0) * q.shape[0] * q.shape[1] * W / 16, cfg.parallel)
        fn = ks.scan_parallel if par else ks.scan_serial
        H, T = q.shape[0], q.shape[1]
        threads = get_num_threads() if par else 1
        Qg = group_size(cfg.rep, (H // cfg.rep) * T, threads)
        P = min(threads, H * T // Qg)
        one = self.one_stage()
        R1 = R if one else self.shortlist()
        need = Qg * (4 * R1 + cfg.segment)  # the scan's buffers (each cut back to R1 when a cluster may not fit)
        with self._scratch_lock:
            if self._est.shape[0] < P or self._est.shape[1] < need:
                shape = (max(P, self._est.shape[0]), max(need, self._est.shape[1]))
                self._est, self._ids = np.empty(shape, np.float64), np.empty(shape, np.int64)
                self._tmp = np.empty((shape[0], cfg.segment), np.float64)  # a cluster's estimates
            fn(q, qpos, cfg.rep, Qg, self.rot, lay.cent, lay.cscale, lay.cptr,
               lay.n_cent if n_cent is None else n_cent, self.rad, st.sketch_codes.view(np.uint64), st.sketch_fac,
               st.sketch_fine.view(np.uint64), st.sketch_fscale, st.pos, R1, rows, scanned,
               self._est[:P, :need], self._ids[:P, :need], self._tmp[:P], one)
        return rows, scanned

    def one_stage(self) -> bool:
        """True when the shortlist would hold more than 1/``ONE_STAGE_RATIO`` of the routed keys (small
        caches: the ``MIN_CANDIDATES`` floor times ``SHORTLIST_RATIO``): then every routed key is estimated
        from its whole 4-bit code, read in slot order, and the best ``candidates`` are read exactly."""
        routed = self.layout.open_end - self.store.s0
        return ONE_STAGE_RATIO * self.shortlist() > routed

    def reads_all(self) -> bool:
        """True when the step reads every key exactly: nothing is clustered yet, or the candidates would be
        more than 1/``DENSE_RATIO`` of the routed keys (a scan plus scattered reads would then cost more
        than reading the keys in order)."""
        routed = self.layout.open_end - self.store.s0
        return int(self.layout.n_cent.max(initial=0)) == 0 or DENSE_RATIO * self.candidates() >= routed

    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        st = self.store
        R_rows = q.shape[0] * q.shape[1]
        if self.reads_all():
            return StepPlan(kd.MODE_NONE, st.s0, st.s0, st.slots, work=st.slots * R_rows)
        R = self.candidates()
        ex_lo, stop, n_cent = self.scope(qpos)
        rows, scanned = self._scan(q, qpos, R, n_cent)
        self.scanned += int(scanned.sum())
        self.steps += R_rows
        work = (st.s0 + stop - ex_lo + R) * R_rows
        return StepPlan(kd.MODE_LIST, st.s0, ex_lo, stop, work=work, n_ranges=2 + R, rows_sel=rows)

    def max_tokens(self, num_heads: int) -> int | None:
        # a plan lists R candidate slots per row (int64): at most PLAN_BYTES of them per block of tokens
        return max(1, PLAN_BYTES // (8 * num_heads * self.candidates()))  # = sketch_plan_rows // num_heads

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        st, lay, cfg = self.store, self.layout, self.cfg
        if self.reads_all():
            return [np.arange(st.slots)]
        qq = np.zeros((cfg.num_heads, 1, cfg.head_dim), np.float32)
        qq[g * cfg.rep] = q
        rows, _ = self._scan(qq, np.array([st.n - 1], np.int64), self.candidates())
        row = rows[g * cfg.rep]
        return [np.arange(st.s0), np.arange(lay.open_end, st.slots), row[row >= 0]]

    # ---------------------------------------------------------------------------------- report
    def index_nbytes(self) -> int:
        st = self.store
        per_slot = st.sketch_codes.shape[2] + st.sketch_fine.shape[2] + 8  # codes, planes, two float32 scales
        return super().index_nbytes() + st.num_kv_heads * st.slots * per_slot + int(self.rad.size) * 8

    def debug_arrays(self) -> dict[str, Any]:
        return {**super().debug_arrays(), "sketch_rotation": self.rot, "sketch_radius": self.rad,
                "sketch_plan_rows": max(1, PLAN_BYTES // (8 * self.candidates())),
                "sketch_reads_all": self.reads_all(), "sketch_one_stage": self.one_stage()}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "sketch_candidates": self.candidates(), "sketch_shortlist": self.shortlist(),
                "sketch_one_stage": self.one_stage(),
                "sketch_keys_scanned_per_query": self.scanned / max(self.steps, 1)}
