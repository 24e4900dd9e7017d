"""The step planner of the decode cache: a routing strategy's choice as the ranges and estimates the
decode kernel reads, and the one kernel call that runs it.

A :class:`StepPlan` says, for every row of a step (query head x query token), which slot ranges are
exact (the sinks ``[0, s0)`` and ``[ex_lo, n_slots)``), how the routed part is chosen (``mode``, one of
the ``MODE_*`` constants of :mod:`sparseattn.kernels.decode`, with the arrays that mode reads), and how
many routed groups are estimated instead of read (``n_est``).  Strategies fill in only what their mode
reads; the rest keeps empty arrays of the right dtypes (one compiled kernel per storage dtype).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernels import decode as kd
from ..threads import get_num_threads
from .store import SlotStore

__all__ = ["PARALLEL_MIN_KEYS", "StepPlan", "parallel_step", "StepResult", "concat_results", "group_size", "run_plan",
           "run_strategy"]

# Work per call (keys scored, plus routing vectors weighted by their bytes against a key's key + value, in
# keys of E = Ev = 64: a key of E = Ev = 256 counts 4, see parallel_step) below which the kernel runs on one
# thread.  Measured on 2 cores, 8 heads, E = 64, median of 40 steps:
# 8,192 keys per step (1,024 per head, all exact) 0.22 ms serial against 0.26 ms parallel with warm
# caches; about 17,000 (16,384 cached keys, cluster selector) 1.30 against 0.80 ms; about 25,000 of a
# 131,072-key step 2.30 against 1.46 ms with cold caches.  The cost of going parallel: on a busy shared
# machine a descheduled worker costs up to a scheduler time slice (~10-20 ms per step at load average 9
# on 2 cores); ``KVCache(parallel=False)`` opts out.  Scaled by the key width: 4 query / 1 kv heads, E = 256,
# 32,768 keys, the default sketch (1,536 keys read a row) read 0.55 ms parallel against 1.22 ms serial.
PARALLEL_MIN_KEYS = 12288


PLAN_BYTES = 32 << 20  # slot lists (MODE_LIST) of one plan: longer multi-token calls run in token blocks

def parallel_step(work: float, parallel: bool | None) -> bool:
    """The user's ``parallel`` if set, else whether ``work`` (keys of E = Ev = 64 scored, or their
    equivalent: callers scale by ``(E + Ev) / 128``) reaches :data:`PARALLEL_MIN_KEYS`."""
    return parallel if parallel is not None else work >= PARALLEL_MIN_KEYS


def group_size(rep: int, groups: int, threads: int) -> int:
    """Query heads of a kv head read together (the sketch scan's codes, the decode kernel's exact keys and
    values): the largest divisor of ``rep`` that still leaves at least ``threads`` groups of rows
    (``groups``: kv heads x query tokens), so sharing a kv head's reads never idles a worker; 1 without
    GQA."""
    for d in range(rep, 0, -1):
        if rep % d == 0 and (groups * (rep // d) >= threads or d == 1):
            return d
    return 1


# kernel inputs of a step that lists no rows / records nothing (the kernel never writes them)
_NO_ROWS = np.full((1, 1), -1, np.int64)
_NO_REC = np.zeros((0, 1, 3), np.int64)
_NO_REC_N = np.zeros(0, np.int64)


@functools.lru_cache(maxsize=64)
def empty_clusters(hk: int, E: int, Ev: int) -> tuple[np.ndarray, ...]:
    """Cluster arrays of a cache without clusters: (cent, cscale, cptr, n_cent, ccount, cvmean, cminpos,
    cmaxpos, cspread), the dtypes and ranks the kernel expects (made once per shape: the kernel never
    writes them)."""
    return (np.zeros((hk, 0, E), np.int8), np.zeros((hk, 0), np.float32), np.zeros((hk, 1), np.int64),
            np.zeros(hk, np.int64), np.zeros((hk, 0), np.int64), np.zeros((hk, 0, Ev), np.float32),
            np.zeros((hk, 0), np.int32), np.zeros((hk, 0), np.int32), np.zeros((hk, 0, 2), np.float32))


@functools.lru_cache(maxsize=64)
def empty_pages(hk: int, E: int, sdtype: np.dtype) -> tuple[np.ndarray, ...]:
    """Page arrays of a cache without pages: (pmin, pmax, pminpos) (made once per shape)."""
    return np.zeros((hk, 0, E), sdtype), np.zeros((hk, 0, E), sdtype), np.zeros((hk, 0), np.int32)


@dataclass
class StepPlan:
    """What one decode step reads, per row (see :mod:`sparseattn.kernels.decode`).

    Attributes
    ----------
    mode : int
        ``MODE_NONE`` (exact ranges only), ``MODE_CLUSTER``, ``MODE_MASS``, ``MODE_PAGES``, ``MODE_TOPK``
        or ``MODE_LIST``.
    s0, ex_lo, n_slots : int
        Exact slot ranges ``[0, s0)`` and ``[ex_lo, n_slots)``.
    hi : int
        Routed keys must have a position below ``hi`` (the exact window's first position).
    n_probe, n_est : int
        Routed groups read (clusters, pages, or k of top-k) and clusters estimated.
    n_ranges : int
        Slot ranges a row may score (sizes the recording of ranges).
    work : int
        Keys the step scores in total (sets serial against parallel).
    rows_sel : (R, W) int64
        ``MODE_LIST``: the slots each row reads, -1 padded.
    clusters : tuple of arrays
        (cent, cscale, cptr, n_cent, ccount, cvmean, cminpos, cmaxpos, cspread), see :func:`empty_clusters`.
    pages : tuple of arrays
        (pmin, pmax, pminpos) in the storage dtype, see :func:`empty_pages`.
    page_size : int; top_p : float; tp_min, tp_max : int
        Mode parameters.
    """

    mode: int
    s0: int
    ex_lo: int
    n_slots: int
    work: int
    hi: int = 2**31 - 1
    n_probe: int = 0
    n_est: int = 0
    n_ranges: int = 2
    rows_sel: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    clusters: tuple[np.ndarray, ...] | None = None
    pages: tuple[np.ndarray, ...] | None = None
    page_size: int = 16
    top_p: float = 1.0
    tp_min: int = 0
    tp_max: int = 0


@dataclass
class StepResult:
    """Outputs of one kernel call: out (H, T, Ev) float32, lse (H, T) float32, keys read and clusters
    estimated per row (R = H * T, int64), and the slot ranges each row scored (``rec[r, :n_rec[r]]`` of
    (first, stop, lim); slot j of a range was read iff ``pos[g, j] <= qpos[t]`` and ``pos[g, j] < lim``)
    when recorded; ``ncap`` (R,) int8: 1 where a ``top_p`` walk stopped at ``top_p_max_keys`` short of
    its goal."""

    out: np.ndarray
    lse: np.ndarray
    nread: np.ndarray
    nest: np.ndarray
    rec: np.ndarray
    n_rec: np.ndarray
    seconds: float
    ncap: np.ndarray


def run_plan(store: SlotStore, plan: StepPlan, q: np.ndarray, qpos: np.ndarray, *, scale: float,
             parallel: bool | None, record: bool = False, weights: np.ndarray | None = None) -> StepResult:
    """Run ``plan`` for the queries ``q`` (H, T, E) float32 at positions ``qpos`` (T,) int64.

    ``parallel`` None picks parallel from ``plan.work``; with ``weights`` (H_kv, cap) float64 (the h2o
    policy) each read key's softmax weight is added to its slot's total after the step.
    """
    H, T = q.shape[0], q.shape[1]
    R = H * T
    hk, E, Ev = store.num_kv_heads, store.head_dim, store.value_dim
    out = np.empty((H, T, Ev), np.float32)
    lse = np.empty((H, T), np.float32)
    nread = np.empty(R, np.int64)
    nest = np.empty(R, np.int64)  # written for every row
    ncap = np.empty(R, np.int8)
    par = parallel_step(plan.work * (E + Ev) / 128, parallel)
    bf16 = store.storage == "bfloat16"
    if bf16:
        fn = kd.decode_parallel_bf16 if par else kd.decode_serial_bf16
    else:
        fn = kd.decode_parallel if par else kd.decode_serial
    if weights is not None or record:
        rec = np.zeros((R, max(plan.n_ranges, 1), 3), np.int64)
        n_rec = np.zeros(R, np.int64)
    else:  # nothing recorded: the kernel reads neither
        rec, n_rec = _NO_REC, _NO_REC_N
    clusters = plan.clusters if plan.clusters is not None else empty_clusters(hk, E, Ev)
    pages = plan.pages if plan.pages is not None else empty_pages(hk, E, store.sdtype)
    cent, cscale, cptr, n_cent, ccount, cvmean, cminpos, cmaxpos, cspread = clusters
    t1 = time.perf_counter()
    K, V, pmin, pmax = store.kernel_arrays(store.K, store.V, pages[0], pages[1])
    # query heads of a kv head read its exact keys together (MODE_NONE / MODE_LIST without recording)
    Qg = group_size(H // hk, hk * T, get_num_threads() if par else 1)
    fn(q, qpos, H // hk, K, V, store.pos, plan.s0, plan.ex_lo, plan.n_slots, plan.hi, plan.mode,
       plan.n_probe, cent, cscale, cptr, n_cent, ccount, pmin, pmax, pages[2],
       plan.page_size, np.float32(scale), plan.n_est, cvmean, cminpos, cmaxpos, cspread,
       float(plan.top_p), plan.tp_min, plan.tp_max, plan.rows_sel, rec, n_rec, out, lse, nread, nest, ncap, Qg)
    if weights is not None and plan.n_slots:
        if bf16:
            acc = kd.accumulate_parallel_bf16 if par else kd.accumulate_serial_bf16
        else:
            acc = kd.accumulate_parallel if par else kd.accumulate_serial
        acc(q, qpos, H // hk, K, store.pos, rec, n_rec, lse, np.float32(scale), weights)
    return StepResult(out, lse, nread, nest, rec, n_rec, time.perf_counter() - t1, ncap)


def run_strategy(store: SlotStore, strategy: Any, q: np.ndarray, qpos: np.ndarray, k: int, *, scale: float,
                 parallel: bool | None, record: bool = False, weights: np.ndarray | None = None) -> StepResult:
    """Plan and run the queries ``q`` (H, T, E) float32 at ``qpos`` (T,) with a routing ``strategy``, in the
    token blocks of ``strategy.token_blocks`` (a long prefill's plan stays bounded; rows that need another
    plan, such as rows inside the clustered part, get their own)."""
    blocks = strategy.token_blocks(qpos, q.shape[0])
    if len(blocks) == 1:  # one block (every decode step)
        return run_plan(store, strategy.plan(q, qpos, k), q, qpos, scale=scale, parallel=parallel, record=record,
                        weights=weights)
    parts = []
    for a, b in blocks:  # a C-contiguous copy per block: a strided view compiles (and runs) a slower kernel
        qb = np.ascontiguousarray(q[:, a:b])
        parts.append(run_plan(store, strategy.plan(qb, qpos[a:b], k), qb, qpos[a:b], scale=scale, parallel=parallel,
                              record=record, weights=weights))
    return parts[0] if len(parts) == 1 else concat_results(parts)


def concat_results(parts: list[StepResult]) -> StepResult:
    """One :class:`StepResult` of consecutive token blocks of the same heads (rows are h * T + t)."""
    H = parts[0].out.shape[0]
    T = sum(p.out.shape[1] for p in parts)

    def rows(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name).reshape(H, -1) for p in parts], axis=1).reshape(H * T)

    width = max(p.rec.shape[1] for p in parts)
    recs = []
    for p in parts:
        r = np.zeros((H, p.out.shape[1], width, 3), np.int64)
        if p.rec.shape[0]:
            r[:, :, :p.rec.shape[1]] = p.rec.reshape(H, p.out.shape[1], p.rec.shape[1], 3)
        recs.append(r)
    rec = np.concatenate(recs, axis=1).reshape(H * T, width, 3) if parts[0].rec.shape[0] else parts[0].rec
    n_rec = rows("n_rec") if parts[0].n_rec.shape[0] else parts[0].n_rec
    return StepResult(np.concatenate([p.out for p in parts], axis=1), np.concatenate([p.lse for p in parts], axis=1),
                      rows("nread"), rows("nest"), rec, n_rec, sum(p.seconds for p in parts), rows("ncap"))


def describe(plan: StepPlan) -> dict[str, Any]:
    """The plan's scalars (for debugging and tests)."""
    return {k: getattr(plan, k) for k in ("mode", "s0", "ex_lo", "n_slots", "hi", "n_probe", "n_est",
                                          "n_ranges", "work")}
