"""Decode-step kernel of :class:`sparseattn.KVCache`: route + gather + online softmax in one call.

One row is one (query head, query token); rows are split over ``prange`` (a decode step of H heads is H
rows).  Per row, over the cache of kv head ``h // rep``:

1. the exact part: slots ``[0, n_sinks)`` (the attention sinks) and ``[ex_lo, n_slots)`` (the recent
   window, plus for the cluster index the tail not yet clustered), every key scored;
2. routing (``mode``):

   * ``MODE_CLUSTER``: one score ``q . c`` per routing vector of the head (member means of the clusters
     of every segment, stored as int8 codes of the vector over its largest magnitude / 127, times the
     float32 ``cscale[g, c]``), the ``n_probe`` largest among the clusters holding a key at or before the
     row's position (``cminpos <= qp``) kept by a min-heap, then each
     chosen cluster's contiguous slot range ``[cptr[c], cptr[c + 1])`` scored; with ``n_est > 0`` the
     next ``n_est`` clusters are estimated: one pseudo-key each, score ``scale * q . c + log(ccount)``
     and value ``cvmean[g, c]``, skipped when the cluster holds a key the row may not see
     (``cmaxpos > qp``: a later key, or an evicted one, see below);
   * ``MODE_MASS`` (the cluster index with a mass-driven budget): every cluster gets the log of its
     estimated mass ``A_c = scale * q . c + log(ccount)`` (``-inf`` when empty or when its first key is
     after the row); after the exact part, clusters are read in order of decreasing ``A_c`` until the
     estimated mass read (the exact part's true mass plus ``exp(A_c)`` of each cluster read) reaches
     ``top_p`` of the estimated total (exact part + every cluster) with at least ``tp_min`` routed keys;
     a cluster that would take the routed keys past ``tp_max`` ends the walk (the semantics of
     :func:`sparseattn.kernels.estimate.mass_route`).  ``n_est`` clusters after the last one read are
     estimated as above;
   * ``MODE_PAGES`` (Quest): per page of ``page_size`` slots starting at slot ``n_sinks``, the upper
     bound ``sum_e max(q_e * min_e, q_e * max_e)`` of ``q . k`` over the page, the ``n_probe`` largest
     pages scored (a page whose smallest position ``pminpos`` is after the row is skipped);
   * ``MODE_TOPK``: every slot scored, the ``n_probe`` largest kept (exact top-k), then attended;
   * ``MODE_LIST``: the slots listed in ``sel[r]`` (``-1`` padded; chosen by the caller, e.g. an index
     selector grown with ``add()``) are attended after the exact part;
   * ``MODE_NONE``: no routed part (sinks + window, or everything when ``ex_lo = n_sinks``);

3. one online softmax over all scored keys, processed in chunks of ``CHUNK``: chunk maximum, rescale of
   the running sum when the maximum grows, a vectorised float32 exp, the weighted value sum.

Key masks, by the int32 position of each slot (``pos``): a key is visible to a row at position ``qp``
iff ``pos <= qp`` (causal).  An evicted key has position ``EVICTED`` (the int32 maximum), so the same
test hides it from every row, and a cluster holding one has ``cmaxpos = EVICTED`` until its statistics
are recomputed without it.  Routed keys must also satisfy ``pos < hi_pos`` so that a key of the exact
window is never counted twice.  Storage is float32, float16, or bfloat16 (uint16 bit patterns,
``BF16 = True``); scores, exp and sums are float32.  A row with no visible key gets zeros and
``lse = -inf``; a visible key's score of ``+inf``, ``-inf`` or NaN (finite inputs: the float32 dot product
overflowed) sets ``lse = +inf`` (the caller raises the overflow error).

Layout of the code: the routing of each mode is in :mod:`sparseattn.kernels.decode_route` (one function
per mode, and the mass walk), the range order in ``_fixed_range``, the online softmax over one slot range
in ``_score_range``, the estimation zone in ``_estimate_zone``; ``_row`` strings them together.

With ``rec`` of nonzero length the kernel records, per row, the slot ranges it scored (``rec[r, i] =
(first, stop, hi)``, ``n_rec[r]`` of them); ``accumulate_serial`` / ``accumulate_parallel`` (:mod:`sparseattn.kernels.decode_weights`) replay them
to add each read key's softmax weight ``exp(scale * q . k - lse)`` to a per-slot total (the
heavy-hitter statistics of the ``"h2o"`` memory cap).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .decode_route import (
    EVICTED,
    MODE_CLUSTER,
    MODE_LIST,
    MODE_MASS,
    MODE_NONE,
    MODE_PAGES,
    MODE_TOPK,
    mass_next,
    mass_open,
    route_clusters,
    route_pages_bf16,
    route_pages_f32,
    route_topk_bf16,
    route_topk_f32,
)
from .decode_weights import (
    accumulate_parallel,
    accumulate_parallel_bf16,
    accumulate_serial,
    accumulate_serial_bf16,
)
from .intrinsics import exp_shifted_f32, prefetch_l2
from .options import FASTMATH, serial_and_parallel
from .pages import page_bounds
from .storage import (
    clone_with,
    float32_bits,
    narrow_f16,
    store_token_bf16,
    store_token_f16,
    store_token_f32,
    widen_bf16,
    widen_f16,
)
from .topk import ORDER_BEST, heap_finish

__all__ = ["CHUNK", "EVICTED", "MODE_CLUSTER", "MODE_LIST", "MODE_MASS", "MODE_NONE", "MODE_PAGES", "MODE_TOPK",
           "accumulate_parallel", "accumulate_parallel_bf16", "accumulate_serial", "accumulate_serial_bf16",
           "decode_parallel", "decode_parallel_bf16", "decode_serial", "decode_serial_bf16", "float32_bits",
           "narrow_f16", "page_bounds", "store_token_bf16", "store_token_f16", "store_token_f32", "widen_bf16",
           "widen_f16"]

CHUNK = 128  # keys scored before one softmax update (scratch per row: CHUNK floats)
LIST_AHEAD = 8  # MODE_LIST: the listed slot this many ahead is prefetched while one is scored
LISTED = False  # compile-time constant: True in the list variants of the scoring loop
BF16 = False  # compile-time constant: True in the bfloat16 variants below


@njit(cache=True, inline="always")
def _raise_max(m_run, m_new, l_run, acc):
    """Online softmax: when ``m_new`` exceeds the running maximum, rescale the running sum and the
    accumulator to it; returns (maximum, sum)."""
    if m_new > m_run:
        if m_run > -np.inf:
            alpha = np.float32(np.exp(m_run - m_new))
            l_run *= alpha
            for e in range(acc.shape[0]):
                acc[e] *= alpha
        m_run = m_new
    return m_run, l_run


@njit(cache=True, inline="always")
def _fixed_range(rr, mode, r, g, hb, n_sel, sel, cptr, n_sinks, ex_lo, n_slots, page_size, hi_pos):
    """Range ``rr`` of a row in every mode but the mass walk's routed part: (first, stop, lim, exists).
    Ranges 0 and 1 are the exact sinks and window (no ``lim``); then the chosen clusters, pages or listed
    slots; ``MODE_TOPK`` reads only its chosen slots."""
    if mode == MODE_TOPK:
        if rr >= n_sel:
            return 0, 0, hi_pos, False
        return hb[rr], hb[rr] + 1, hi_pos, True
    if rr == 0:
        return 0, min(n_sinks, n_slots), 2147483647, True
    if rr == 1:
        return ex_lo, n_slots, 2147483647, True
    i = rr - 2
    if mode == MODE_NONE or i >= n_sel:
        return 0, 0, hi_pos, False
    if mode == MODE_CLUSTER:
        return cptr[g, hb[i]], cptr[g, hb[i] + 1], hi_pos, True
    if mode == MODE_PAGES:
        a = n_sinks + hb[i] * page_size
        return a, min(a + page_size, ex_lo), hi_pos, True
    return sel[r, i], sel[r, i] + 1, hi_pos, True  # MODE_LIST


@njit(cache=True, inline="always")
def _prefetch_range(rr, mode, g, hb, n_sel, cptr, n_sinks, ex_lo, page_size):
    """The routed range read after range ``rr`` (clusters and pages), prefetched while ``rr`` is scored."""
    if (mode == MODE_CLUSTER or mode == MODE_PAGES) and 2 <= rr and rr - 2 < n_sel:
        nxt = hb[rr - 2]
        if mode == MODE_CLUSTER:
            return cptr[g, nxt], cptr[g, nxt + 1]
        a = n_sinks + nxt * page_size
        return a, min(a + page_size, ex_lo)
    return 0, 0


# ------------------------------------------------------------------------------------------ scoring
def _score_range(Kg, Vg, pg, qi, a, b, lim, qp, scale, pf_a, pf_b, sc, acc, m_run, l_run, idx):
    """Online softmax over slots [a, b) visible to the row (``pos <= qp`` and ``pos < lim``), in chunks of
    ``CHUNK``; one row of the next range [pf_a, pf_b) is prefetched per row scored.  In the ``LISTED``
    variants the slots are ``idx[a:b]`` instead (int64; each row prefetched ``LIST_AHEAD`` ahead).
    Returns (maximum, sum, keys read, overflow)."""
    E = qi.shape[0]
    Ev = acc.shape[0] if Vg.shape[1] > 0 else 0
    kbytes = Kg.shape[1] * Kg.itemsize  # bytes of one key row / value row
    vbytes = Vg.shape[1] * Vg.itemsize
    n_read = 0
    start = a
    while start < b:
        stop = min(start + CHUNK, b)
        n = stop - start
        # scores of the whole chunk (a plain loop that vectorises), then the position masks
        for j in range(start, stop):
            if LISTED:
                if j + LIST_AHEAD < b:
                    nxt = idx[j + LIST_AHEAD]
                    for off in range(0, kbytes, 64):
                        prefetch_l2(Kg, nxt, off)
                    for off in range(0, vbytes, 64):
                        prefetch_l2(Vg, nxt, off)
            elif pf_a + (j - a) < pf_b:
                for off in range(0, kbytes, 64):
                    prefetch_l2(Kg, pf_a + (j - a), off)
                for off in range(0, vbytes, 64):
                    prefetch_l2(Vg, pf_a + (j - a), off)
            kj = Kg[idx[j] if LISTED else j]
            s = np.float32(0.0)
            for e in range(E):
                s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
            sc[j - start] = s * scale
        cmax = np.float32(-np.inf)
        cnt = 0
        for u in range(n):
            p = pg[idx[start + u] if LISTED else start + u]
            if p > qp or p >= lim:
                sc[u] = -np.inf
            else:
                cnt += 1
                x = sc[u]
                if x > cmax:
                    cmax = x
                elif not (x > -np.inf):  # -inf or NaN from finite inputs: the score overflowed
                    cmax = np.inf
        first = start
        start = stop
        if cnt == 0:
            continue
        n_read += cnt
        if cmax == np.inf:
            return m_run, l_run, n_read, True
        m_run, l_run = _raise_max(m_run, cmax, l_run, acc)
        exp_shifted_f32(sc, n, m_run, sc)  # masked keys: exp(-inf) = 0
        for u in range(n):
            w = sc[u]
            l_run += w
            vj = Vg[idx[first + u] if LISTED else first + u]
            for e in range(Ev):
                acc[e] += w * (widen_bf16(vj[e]) if BF16 else widen_f16(vj[e]))
    return m_run, l_run, n_read, False


@njit(cache=True, fastmath=FASTMATH)
def _estimate_zone(zone, scores, n_zone, g, qp, scale, ccount, cmaxpos, cvmean, acc, m_run, l_run):
    """The estimation zone: clusters ``zone[:n_zone]`` (``scores``: their q . c), each one pseudo-key of
    score ``scale * q . c + log(count)`` and value its mean, skipped when it holds a key the row may not
    see (later or evicted).  Returns (maximum, sum, clusters used, overflow)."""
    n_used = 0
    for z in range(n_zone):
        c = zone[z]
        if c < 0:
            break
        cnt_c = ccount[g, c]
        if cnt_c <= 0 or cmaxpos[g, c] > qp:
            continue  # a key the row may not see (later or evicted): never estimated
        s = scores[z] * scale + np.float32(np.log(np.float32(cnt_c)))
        if s == np.inf:
            return m_run, l_run, n_used, True
        m_run, l_run = _raise_max(m_run, s, l_run, acc)
        w = np.float32(np.exp(s - m_run))
        l_run += w
        vm = cvmean[g, c]
        for e in range(acc.shape[0]):
            acc[e] += w * vm[e]
        n_used += 1
    return m_run, l_run, n_used, False


@njit(cache=True, inline="always")
def _finish(out, lse, h, t, acc, m_run, l_run, overflow):
    """Write a row: NaN and ``lse = +inf`` on overflow, zeros and ``-inf`` with no key, else acc / sum."""
    Ev = out.shape[2]
    if overflow:
        for e in range(Ev):
            out[h, t, e] = np.nan
        lse[h, t] = np.inf
    elif l_run == 0.0:
        for e in range(Ev):
            out[h, t, e] = 0.0
        lse[h, t] = -np.inf
    else:
        inv = np.float32(1.0) / l_run
        for e in range(Ev):
            out[h, t, e] = acc[e] * inv
        lse[h, t] = m_run + np.log(l_run)


# one variant per storage and per slot source (a range or a list): compile-time constants, so the range
# variant's loop has no branch of the list's
_score_range_f32 = njit(cache=True, fastmath=FASTMATH, inline="always")(clone_with(_score_range, "_std", {"BF16": False}))
_score_range_bf16 = njit(cache=True, fastmath=FASTMATH, inline="always")(clone_with(_score_range, "_bf16", {"BF16": True}))
_score_list_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_score_range, "_list", {"BF16": False,
                                                                                          "LISTED": True}))
_score_list_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_score_range, "_list_bf16", {"BF16": True,
                                                                                                "LISTED": True}))
ROUTE_PAGES, ROUTE_TOPK, SCORE_RANGE, SCORE_LIST = route_pages_f32, route_topk_f32, _score_range_f32, _score_list_f32


# ---------------------------------------------------------------------------------------------- a row
def _row(r, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
         cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos, cmaxpos,
         top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest):
    """One row (query head h, token t) of the decode kernel: route, read the ranges, estimate, write;
    see the module docstring."""
    T = q.shape[1]
    h = r // T
    t = r - h * T
    g = h // rep
    qi = q[h, t]
    qp = qpos[t]
    Kg = K[g]
    Vg = V[g]
    pg = pos[g]
    width = max(n_probe + (n_est if mode == MODE_CLUSTER else 0), 1)
    sc = np.empty(CHUNK, dtype=np.float32)
    acc = np.zeros(max(V.shape[2], 1), dtype=np.float32)
    hs = np.empty(width, dtype=np.float32)
    hb = np.empty(width, dtype=np.int64)
    record = rec.shape[0] > 0
    overflow = False
    n_sel = 0
    nc = n_cent[g] if (mode == MODE_CLUSTER or mode == MODE_MASS) else 0
    qc = np.empty(nc if mode == MODE_MASS else 0, dtype=np.float32)  # MODE_MASS: q . c per cluster
    la = np.empty(nc if mode == MODE_MASS else 0, dtype=np.float32)  # MODE_MASS: log estimated masses
    if mode == MODE_CLUSTER or mode == MODE_MASS:
        n_sel = route_clusters(qi, g, qp, mode, cent, cscale, n_cent, ccount, cminpos, scale, width, hs, hb, qc, la)
    elif mode == MODE_PAGES:
        n_sel = ROUTE_PAGES(qi, g, qp, pmin, pmax, pminpos, (ex_lo - n_sinks + page_size - 1) // page_size,
                            n_probe, hs, hb)
    elif mode == MODE_TOPK:
        n_sel, overflow = ROUTE_TOPK(qi, Kg, pg, qp, n_slots, n_probe, hs, hb)
    elif mode == MODE_LIST:
        while n_sel < sel.shape[1] and sel[r, n_sel] >= 0:
            n_sel += 1
    n_zone = 0  # estimation zone: hb[n_probe:n_sel] after ordering best first
    if mode == MODE_CLUSTER and n_est > 0 and n_sel > n_probe:
        heap_finish(hs, hb, n_sel, ORDER_BEST)
        n_zone = n_sel - n_probe
        n_sel = n_probe
    if mode == MODE_CLUSTER or mode == MODE_PAGES:
        hb[:n_sel].sort()  # read in slot order (clusters and pages are laid out by id): a forward sweep
    order = np.empty(0, dtype=np.int64)  # MODE_MASS walk state
    goal = cum = 0.0
    mshift = np.float32(0.0)
    m_run = np.float32(-np.inf)
    l_run = np.float32(0.0)
    nk = walk = rr = n_read = n_recorded = 0
    no_list = np.empty(0, dtype=np.int64)
    while not overflow:
        if mode == MODE_LIST and rr == 2 and not record:  # every listed slot in one sweep
            m_run, l_run, n, overflow = SCORE_LIST(Kg, Vg, pg, qi, 0, n_sel, hi_pos, qp, scale, 0, 0, sc, acc,
                                                   m_run, l_run, sel[r])
            n_read += n
            break
        if mode == MODE_MASS and rr >= 2:
            if rr == 2:  # the exact part is done: its true mass opens the walk
                order, mshift, cum, goal = mass_open(la, nc, m_run, l_run, top_p)
            c = mass_next(order, la, walk, nc, cum, goal, nk, top_p, tp_min, tp_max, cptr, g)
            if c < 0:
                break
            walk += 1
            nk += cptr[g, c + 1] - cptr[g, c]
            cum += np.exp(np.float64(la[c]) - np.float64(mshift))
            a, b, lim = cptr[g, c], cptr[g, c + 1], hi_pos
        else:
            a, b, lim, ok = _fixed_range(rr, mode, r, g, hb, n_sel, sel, cptr, n_sinks, ex_lo, n_slots, page_size,
                                         hi_pos)
            if not ok:
                break
        rr += 1
        pf_a, pf_b = _prefetch_range(rr, mode, g, hb, n_sel, cptr, n_sinks, ex_lo, page_size)
        if record and b > a:
            rec[r, n_recorded, 0] = a
            rec[r, n_recorded, 1] = b
            rec[r, n_recorded, 2] = lim
            n_recorded += 1
        m_run, l_run, n, overflow = SCORE_RANGE(Kg, Vg, pg, qi, a, b, lim, qp, scale, pf_a, pf_b, sc, acc,
                                                m_run, l_run, no_list)
        n_read += n
    n_used = 0
    if not overflow and mode == MODE_CLUSTER and n_zone > 0:
        m_run, l_run, n_used, overflow = _estimate_zone(hb[n_probe:], hs[n_probe:], n_zone, g, qp, scale, ccount,
                                                        cmaxpos, cvmean, acc, m_run, l_run)
    elif not overflow and mode == MODE_MASS and n_est > 0 and walk < nc:
        zone = order[walk:walk + min(n_est, nc - walk)].copy()
        for z in range(zone.shape[0]):
            zone[z] = -1 if la[zone[z]] == -np.inf else zone[z]
        m_run, l_run, n_used, overflow = _estimate_zone(zone, qc[np.maximum(zone, 0)], zone.shape[0], g, qp, scale,
                                                        ccount, cmaxpos, cvmean, acc, m_run, l_run)
    nest[r] = n_used
    nread[r] = n_read
    if record:
        n_rec[r] = n_recorded
    _finish(out, lse, h, t, acc, m_run, l_run, overflow)


# The row body is its own compiled function: a prange loop over a large body compiled ~10x slower.
_row_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_row, "_std", {"BF16": False}))
_row_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_row, "_bf16", {
    "BF16": True, "ROUTE_PAGES": route_pages_bf16, "ROUTE_TOPK": route_topk_bf16, "SCORE_RANGE": _score_range_bf16,
    "SCORE_LIST": _score_list_bf16}))
ROW = _row_f32


def _decode_rows(q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
                 cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos,
                 cmaxpos, top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest):
    for r in prange(q.shape[0] * q.shape[1]):
        ROW(r, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
            cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos, cmaxpos,
            top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest)


decode_serial, decode_parallel = serial_and_parallel(_decode_rows)
decode_serial_bf16, decode_parallel_bf16 = serial_and_parallel(
    _decode_rows, constants={"ROW": _row_bf16}, suffix="_bf16")
