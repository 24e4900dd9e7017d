"""Routing step of the decode kernel (:mod:`sparseattn.kernels.decode`): per row, which clusters, pages or
slots to read, and the mass walk of ``top_p``.  The ``MODE_*`` constants name the routing of a step."""

from __future__ import annotations

import numpy as np
from numba import njit

from .estimate import second_order
from .options import FASTMATH
from .storage import clone_with, widen_bf16, widen_f16
from .topk import ORDER_BEST, heap_finish, heap_offer

__all__ = ["EVICTED", "MODE_CLUSTER", "MODE_LIST", "MODE_MASS", "MODE_NONE", "MODE_PAGES", "MODE_TOPK",
           "MASS_MARGIN", "cluster_log_mass", "mass_goal", "mass_next", "mass_open", "route_clusters",
           "route_pages_bf16", "route_pages_f32", "route_topk_bf16",
           "route_row_bf16", "route_row_f32", "route_topk_f32"]

MODE_NONE = 0
MODE_CLUSTER = 1
MODE_PAGES = 2
MODE_TOPK = 3
MODE_MASS = 4
MODE_LIST = 5

EVICTED = 2147483647  # position of an evicted slot: after every query, so never visible
BF16 = False  # compile-time constant: True in the bfloat16 variants below


@njit(cache=True, fastmath=FASTMATH, inline="always")
def route_clusters(qi, g, qp, mode, cent, cscale, n_cent, ccount, cminpos, cspread, scale, width, hs, hb, qc, la):
    """Score every routing vector of kv head g.  ``MODE_CLUSTER``: the ``width`` best clusters holding a
    key at or before ``qp`` go to the heap ``hs``/``hb`` (returns its size); ``MODE_MASS``: ``qc[c] = q .
    c`` and ``la[c]`` the log estimated mass (``-inf``: nothing the row may see), returns 0.

    The log mass is second order, as in the prefill walk (:mod:`sparseattn.kernels.estimate`):
    ``scale q.c + log n_c + g`` with g the spread term of ``x = scale^2 |q|^2 sigma_c^2 / 2`` (``sigma_c^2``
    the cluster's mean per-dimension variance, ``cspread[g, c, 0]``), continued as ``2 sqrt(x log n_c) -
    log n_c`` past ``x = log n_c`` and never above ``|scale| |q| r_c`` (``r_c``: the largest member
    distance to the mean, ``cspread[g, c, 1]``; so no cluster claims more than ``n_c`` times its largest
    possible weight).  The first-order ``n_c exp(scale q.c)`` is a lower bound of a cluster's mass
    (Jensen) that ranks spread-out clusters too low and ends the walk early."""
    E = qi.shape[0]
    n_sel = 0
    q2 = 0.0
    if mode != MODE_CLUSTER:
        for e in range(E):
            q2 += np.float64(qi[e]) * np.float64(qi[e])
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
                la[c] = np.float32(cluster_log_mass(s, scale, q2, ccount[g, c], cspread[g, c, 0], cspread[g, c, 1]))
    return n_sel


def _route_pages(qi, g, qp, pmin, pmax, pminpos, n_pages, n_probe, hs, hb):
    """Quest: the ``n_probe`` pages of largest bound ``sum_e max(q_e min_e, q_e max_e)`` to the heap ``hb``
    (pages of later or evicted keys only are skipped); returns its size.  The bounds are summed in float64
    and ranked in a float64 heap of their own (``hs`` is not written): in float32, pages of keys near 1e37
    all bounded to inf and the ranking lost the best page."""
    E = qi.shape[0]
    n_sel = 0
    h64 = np.empty(max(n_probe, 1), dtype=np.float64)
    for b in range(n_pages):
        if pminpos[g, b] > qp:
            continue  # a page of later or evicted keys only
        mn = pmin[g, b]
        mx = pmax[g, b]
        s = 0.0
        for e in range(E):
            qe = np.float64(qi[e])
            a1 = qe * np.float64(widen_bf16(mn[e]) if BF16 else widen_f16(mn[e]))
            a2 = qe * np.float64(widen_bf16(mx[e]) if BF16 else widen_f16(mx[e]))
            s += a1 if a1 > a2 else a2
        if n_sel < n_probe or s > h64[0]:
            n_sel = heap_offer(h64, hb, n_sel, n_probe, s, b)
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


def _route_row(r, qi, g, qp, mode, n_probe, n_est, cent, cscale, n_cent, ccount, cminpos, cspread, pmin, pmax,
               pminpos, page_size, n_sinks, ex_lo, Kg, pg, n_slots, sel, scale):
    """The routing step of one row: (hs, hb, qc, la, n_sel, n_zone, overflow).  ``hb[:n_sel]`` are the
    clusters, pages or slots to read in slot order, ``hb[n_probe:n_probe + n_zone]`` (scores ``hs``) the
    clusters to estimate, best first (``MODE_CLUSTER``); ``qc``/``la`` the per-cluster scores and log
    estimated masses of ``MODE_MASS``; ``overflow`` when an exact top-k score overflowed."""
    width = max(n_probe + (n_est if mode == MODE_CLUSTER else 0), 1)
    hs = np.empty(width, dtype=np.float32)
    hb = np.empty(width, dtype=np.int64)
    routed = mode == MODE_CLUSTER or mode == MODE_MASS
    nc = n_cent[g] if routed else 0
    qc = np.empty(nc if mode == MODE_MASS else 0, dtype=np.float32)  # MODE_MASS: q . c per cluster
    la = np.empty(nc if mode == MODE_MASS else 0, dtype=np.float32)  # MODE_MASS: log estimated masses
    n_sel = 0
    overflow = False
    if routed:
        n_sel = route_clusters(qi, g, qp, mode, cent, cscale, n_cent, ccount, cminpos, cspread, scale, width, hs, hb,
                               qc, la)
    elif mode == MODE_PAGES:
        n_sel = ROUTE_PAGES(qi, g, qp, pmin, pmax, pminpos, (ex_lo - n_sinks + page_size - 1) // page_size,
                            n_probe, hs, hb)
    elif mode == MODE_TOPK:
        n_sel, overflow = ROUTE_TOPK(qi, Kg, pg, qp, n_slots, n_probe, hs, hb)
    elif mode == MODE_LIST:
        while n_sel < sel.shape[1] and sel[r, n_sel] >= 0:
            n_sel += 1
    n_zone = 0
    if mode == MODE_CLUSTER and n_est > 0 and n_sel > n_probe:
        heap_finish(hs, hb, n_sel, ORDER_BEST)
        n_zone = n_sel - n_probe
        n_sel = n_probe
    if mode == MODE_CLUSTER or mode == MODE_PAGES:
        hb[:n_sel].sort()  # read in slot order (clusters and pages are laid out by id): a forward sweep
    return hs, hb, qc, la, n_sel, n_zone, overflow


#: The mass walk counts the estimated mass it leaves unread this much larger (a margin for the estimate's
#: error, as the prefill walk does: :func:`sparseattn.index.routing.mass_routes`).
MASS_MARGIN = 1.1


@njit(cache=True)
def mass_open(la, nc, m_run, l_run, top_p):
    """The mass walk, once the exact part is read: clusters by decreasing estimated mass, the shift, the
    exact part's mass and the goal, all relative to the shift.  The walk stops once the mass read m_in
    reaches ``top_p`` of ``m_in + MASS_MARGIN * m_out`` (m_out the estimated mass left), i.e. ``m_in >=
    goal = top_p * MASS_MARGIN * total / (1 + (MASS_MARGIN - 1) * top_p)``."""
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
    return order, mshift, cum, mass_goal(top_p, tot)


@njit(cache=True)
def mass_goal(top_p, total):
    """The mass the walk must read of an estimated ``total``: m_in >= ``top_p (m_in + MASS_MARGIN m_out)``
    with ``m_out = total - m_in``, i.e. ``top_p MASS_MARGIN total / (1 + (MASS_MARGIN - 1) top_p)``."""
    return top_p * MASS_MARGIN * total / (1.0 + (MASS_MARGIN - 1.0) * top_p)


@njit(cache=True, inline="always")
def cluster_log_mass(s, scale, q2, count, sig2, rmax):
    """A cluster's estimated log mass for the walk: ``scale s + log n + g`` with ``s = q . c``, ``q2 =
    |q|^2``, n ``count``, g the capped second-order spread term of ``x = scale^2 q2 sig2 / 2``
    (:func:`sparseattn.kernels.estimate.second_order`, at most ``|scale| |q| rmax``); float64."""
    ell = np.log(np.float64(count))
    x = 0.5 * np.float64(scale) * np.float64(scale) * q2 * np.float64(sig2)
    return np.float64(s) * np.float64(scale) + ell + second_order(x, ell, abs(np.float64(scale)) * np.sqrt(q2)
                                                                  * np.float64(rmax))[0]


@njit(cache=True, inline="always")
def mass_next(order, la, walk, nc, cum, goal, mshift, nk, top_p, tp_min, tp_max, cptr, g):
    """The next cluster of the mass walk, with the walk's state after reading it: (cluster, clusters walked,
    keys routed, estimated mass read); cluster -1 when the walk ends (no cluster left or none visible, or
    the goal reached with ``tp_min`` keys), -2 when it ends short of that because the next cluster would
    take the routed keys past ``tp_max`` (the cap binds: counted in ``stats``)."""
    if walk >= nc:
        return -1, walk, nk, cum
    c = order[walk]
    if la[c] == -np.inf:
        return -1, walk, nk, cum
    if top_p < 1.0 and cum >= goal and nk >= tp_min:
        return -1, walk, nk, cum
    size = cptr[g, c + 1] - cptr[g, c]
    if nk + size > tp_max:
        return -2, walk, nk, cum
    return c, walk + 1, nk + size, cum + np.exp(np.float64(la[c]) - np.float64(mshift))


route_pages_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_pages, "_std", {"BF16": False}))
route_pages_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_pages, "_bf16", {"BF16": True}))
route_topk_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_topk, "_std", {"BF16": False}))
route_topk_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_topk, "_bf16", {"BF16": True}))
ROUTE_PAGES, ROUTE_TOPK = route_pages_f32, route_topk_f32
route_row_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_row, "_std", {"BF16": False}))
route_row_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_route_row, "_bf16", {
    "BF16": True, "ROUTE_PAGES": route_pages_bf16, "ROUTE_TOPK": route_topk_bf16}))
