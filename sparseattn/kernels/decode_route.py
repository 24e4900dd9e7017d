"""Routing step of the decode kernel (:mod:`sparseattn.kernels.decode`): per row, which clusters, pages or
slots to read, and the mass walk of ``top_p``.  The ``MODE_*`` constants name the routing of a step."""

from __future__ import annotations

import numpy as np
from numba import njit

from .options import FASTMATH
from .storage import clone_with, widen_bf16, widen_f16
from .topk import heap_offer

__all__ = ["EVICTED", "MODE_CLUSTER", "MODE_LIST", "MODE_MASS", "MODE_NONE", "MODE_PAGES", "MODE_TOPK",
           "mass_next", "mass_open", "route_clusters", "route_pages_bf16", "route_pages_f32", "route_topk_bf16",
           "route_topk_f32"]

MODE_NONE = 0
MODE_CLUSTER = 1
MODE_PAGES = 2
MODE_TOPK = 3
MODE_MASS = 4
MODE_LIST = 5

EVICTED = 2147483647  # position of an evicted slot: after every query, so never visible
BF16 = False  # compile-time constant: True in the bfloat16 variants below


@njit(cache=True, fastmath=FASTMATH, inline="always")
def route_clusters(qi, g, qp, mode, cent, cscale, n_cent, ccount, cminpos, scale, width, hs, hb, qc, la):
    """Score every routing vector of kv head g.  ``MODE_CLUSTER``: the ``width`` best clusters holding a
    key at or before ``qp`` go to the heap ``hs``/``hb`` (returns its size); ``MODE_MASS``: ``qc[c] = q .
    c`` and ``la[c]`` the log estimated mass (``-inf``: nothing the row may see), returns 0."""
    E = qi.shape[0]
    n_sel = 0
    for c in range(n_cent[g]):
        cv = cent[g, c]
        s = np.float32(0.0)
        for e in range(E):
            s += qi[e] * np.float32(cv[e])
        s *= cscale[g, c]
        if mode == MODE_CLUSTER:
            if cminpos[g, c] > qp:
                continue  # every key of the cluster is after the row (a prefill row): not a probe
            if n_sel < width or s > hs[0]:  # ids ascend: a tie with the root never enters
                n_sel = heap_offer(hs, hb, n_sel, width, s, c)
        else:
            qc[c] = s
            if ccount[g, c] <= 0 or cminpos[g, c] > qp:
                la[c] = -np.inf  # nothing the row may see
            else:
                la[c] = s * scale + np.float32(np.log(np.float32(ccount[g, c])))
    return n_sel


def _route_pages(qi, g, qp, pmin, pmax, pminpos, n_pages, n_probe, hs, hb):
    """Quest: the ``n_probe`` pages of largest bound ``sum_e max(q_e min_e, q_e max_e)`` to the heap
    (pages of later or evicted keys only are skipped); returns its size."""
    E = qi.shape[0]
    n_sel = 0
    for b in range(n_pages):
        if pminpos[g, b] > qp:
            continue  # a page of later or evicted keys only
        mn = pmin[g, b]
        mx = pmax[g, b]
        s = np.float32(0.0)
        for e in range(E):
            a1 = qi[e] * widen_bf16(mn[e]) if BF16 else qi[e] * widen_f16(mn[e])
            a2 = qi[e] * widen_bf16(mx[e]) if BF16 else qi[e] * widen_f16(mx[e])
            s += a1 if a1 > a2 else a2
        if n_sel < n_probe or s > hs[0]:
            n_sel = heap_offer(hs, hb, n_sel, n_probe, s, b)
    return n_sel


def _route_topk(qi, Kg, pg, qp, n_slots, n_probe, hs, hb):
    """Exact top-k: every visible slot scored, the ``n_probe`` best kept, then sorted by slot (a
    deterministic sum order); returns (count, overflow)."""
    E = qi.shape[0]
    n_sel = 0
    for j in range(n_slots):
        if pg[j] > qp:
            continue
        kj = Kg[j]
        s = np.float32(0.0)
        for e in range(E):
            s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
        if not (s > -np.inf and s < np.inf):  # the float32 dot product overflowed (finite inputs)
            return 0, True
        if n_sel < n_probe or s > hs[0]:
            n_sel = heap_offer(hs, hb, n_sel, n_probe, s, j)
    hb[:n_sel].sort()
    return n_sel, False


@njit(cache=True)
def mass_open(la, nc, m_run, l_run, top_p):
    """The mass walk, once the exact part is read: clusters by decreasing estimated mass, the shift, the
    exact part's mass and the goal (``top_p`` of the estimated total), all relative to the shift."""
    order = np.argsort(-la, kind="mergesort")
    mshift = m_run
    for c in range(nc):
        if la[c] > mshift:
            mshift = la[c]
    cum = 0.0
    tot = 0.0
    if mshift > -np.inf:
        if m_run > -np.inf:
            cum = np.float64(l_run) * np.exp(np.float64(m_run) - np.float64(mshift))
        tot = cum
        for c in range(nc):
            if la[c] > -np.inf:
                tot += np.exp(np.float64(la[c]) - np.float64(mshift))
    return order, mshift, cum, top_p * tot


@njit(cache=True, inline="always")
def mass_next(order, la, walk, nc, cum, goal, nk, top_p, tp_min, tp_max, cptr, g):
    """The next cluster of the mass walk, or -1 when the walk ends (no cluster left or none visible, the
    goal reached with ``tp_min`` keys, or ``tp_max`` keys passed by the next one)."""
    if walk >= nc:
        return -1
    c = order[walk]
    if la[c] == -np.inf:
        return -1
    if top_p < 1.0 and cum >= goal and nk >= tp_min:
        return -1
    if nk + cptr[g, c + 1] - cptr[g, c] > tp_max:
        return -1
    return c


route_pages_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_pages, "_std", {"BF16": False}))
route_pages_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_pages, "_bf16", {"BF16": True}))
route_topk_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_topk, "_std", {"BF16": False}))
route_topk_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_topk, "_bf16", {"BF16": True}))
