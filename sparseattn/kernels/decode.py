"""Decode-step kernel of :class:`sparseattn.KVCache`: route + gather + online softmax in one call.

One row is one (query head, query token); rows are split over ``prange`` (a decode step of H heads is H
rows), or groups of rows with grouped-query attention (below).  Per row, over the cache of kv head
``h // rep``:

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
     :func:`sparseattn.kernels.estimate.mass_route`, except that there a row's first cluster is read
     whatever its size: prefill rows have no exact window to fall back on).  ``n_est`` clusters after the last one read are
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

Grouped-query attention: in ``MODE_NONE`` and the one-sweep ``MODE_LIST`` (nothing recorded) the caller
may pass a group size ``Qg > 1`` (a divisor of ``rep``): the work is then split by groups of ``Qg`` query
heads of one kv head at one token (``_group``), which read the exact ranges once for all of them (each
key row scored against the group's queries while it is in L1, one pass over the value rows), then each
row's listed slots; every row keeps its own online softmax, masks, overflow and empty-row rules.

Key masks, by the int32 position of each slot (``pos``): a key is visible to a row at position ``qp``
iff ``pos <= qp`` (causal).  An evicted key has position ``EVICTED`` (the int32 maximum), so the same
test hides it from every row, and a cluster holding one has ``cmaxpos = EVICTED`` until its statistics
are recomputed without it.  Routed keys must also satisfy ``pos < hi_pos`` so that a key of the exact
window is never counted twice.  Storage is float32, float16, or bfloat16 (uint16 bit patterns,
``BF16 = True``); scores, exp and sums are float32.  A row with no visible key gets zeros and
``lse = -inf``; a visible key's score of ``+inf``, ``-inf`` or NaN (finite inputs: the float32 dot product
overflowed) sets ``lse = +inf`` (the caller raises the overflow error).

Layout of the code: the routing of a row is in :mod:`sparseattn.kernels.decode_route` (``route_row``: one
function per mode, and the mass walk), the range order in ``_fixed_range``, the estimation zone in
``_estimate`` / ``_estimate_zone``; ``_row`` routes, reads every range with one online softmax (that loop
is written out in it: as a called function the step was 1-3 % slower) and writes the row.  A group of
rows (grouped-query attention) is ``_group``: the shared exact ranges, then each row's listed slots,
``CHUNK`` slots at a time through ``_read_chunk``, which applies the same rules as ``_row``'s loop.

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
    MASS_MARGIN,
    MODE_CLUSTER,
    MODE_LIST,
    MODE_MASS,
    MODE_NONE,
    MODE_PAGES,
    MODE_TOPK,
    cluster_log_mass,
    mass_goal,
    mass_next,
    mass_open,
    route_row_bf16,
    route_row_f32,
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

__all__ = ["CHUNK", "EVICTED", "MASS_MARGIN", "MODE_CLUSTER", "MODE_LIST", "MODE_MASS", "MODE_NONE", "MODE_PAGES",
           "MODE_TOPK", "cluster_log_mass", "mass_goal", "accumulate_parallel", "accumulate_parallel_bf16", "accumulate_serial", "accumulate_serial_bf16",
           "decode_parallel", "decode_parallel_bf16", "decode_serial", "decode_serial_bf16", "float32_bits",
           "narrow_f16", "page_bounds", "step_summary", "store_token_bf16", "store_token_f16", "store_token_f32", "widen_bf16",
           "widen_f16"]

CHUNK = 128  # keys scored before one softmax update (scratch: CHUNK floats a row, Qg x CHUNK a group)
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


# ------------------------------------------------------------------------------------------ reading
@njit(cache=True, inline="always")
def _record(rec, r, n_recorded, a, b, lim):
    """Record the range [a, b) (limit ``lim``) a row scores, when recording; returns the count."""
    if rec.shape[0] > 0 and b > a:
        rec[r, n_recorded, 0] = a
        rec[r, n_recorded, 1] = b
        rec[r, n_recorded, 2] = lim
        n_recorded += 1
    return n_recorded


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


@njit(cache=True)
def _estimate(mode, n_est, n_zone, n_probe, hs, hb, order, walk, la, qc, g, qp, scale, ccount, cmaxpos, cvmean, acc,
              m_run, l_run):
    """The estimation zone of a row: ``hb[n_probe:n_probe + n_zone]`` (``MODE_CLUSTER``) or the ``n_est``
    clusters after the last one the mass walk read (``MODE_MASS``); (maximum, sum, clusters used, overflow)."""
    if mode == MODE_CLUSTER and n_zone > 0:
        return _estimate_zone(hb[n_probe:], hs[n_probe:], n_zone, g, qp, scale, ccount, cmaxpos, cvmean, acc,
                              m_run, l_run)
    nc = la.shape[0]
    if mode == MODE_MASS and n_est > 0 and walk < nc:
        zone = order[walk:walk + min(n_est, nc - walk)].copy()
        for z in range(zone.shape[0]):
            zone[z] = -1 if la[zone[z]] == -np.inf else zone[z]
        return _estimate_zone(zone, qc[np.maximum(zone, 0)], zone.shape[0], g, qp, scale, ccount, cmaxpos, cvmean,
                              acc, m_run, l_run)
    return m_run, l_run, 0, False


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


@njit(cache=True)
def step_summary(out, lse, nread, nest):
    """One pass over a step's outputs (out (H, T, Ev) float32, lse (H, T) float32, nread / nest (R,)
    int64): (status, keys read, clusters estimated, largest finite ``|lse|``); status 1 when a row's scores
    overflowed (``lse = +inf``), 2 when an output is not finite (its weighted value sum overflowed
    float32), else 0."""
    status = 0
    big = np.float32(0.0)
    for h in range(lse.shape[0]):
        for t in range(lse.shape[1]):
            x = lse[h, t]
            if x == np.inf:
                return 1, 0, 0, np.float32(0.0)
            if x > -np.inf:
                big = max(big, abs(x))
            for e in range(out.shape[2]):
                if not (out[h, t, e] - out[h, t, e] == 0):
                    status = 2
    return status, nread.sum(), nest.sum(), big


# ---------------------------------------------------------------------------------------------- a row
def _row(r, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
         cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos, cmaxpos,
         cspread, top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest, ncap):
    """One row (query head h, token t): route (``ROUTE``), read the ranges (range 0 the sinks, 1 the window,
    then the routed ranges or the mass walk; in the ``LISTED`` variants range 2 is every slot of ``sel[r]``)
    with one online softmax in chunks of ``CHUNK`` (one row of the next range prefetched per row scored),
    estimate, write; see the module docstring.  The reading loop is written out here (~2 % faster)."""
    h = r // q.shape[1]
    t, g = r - h * q.shape[1], h // rep
    qi, qp, Kg, Vg, pg = q[h, t], qpos[t], K[g], V[g], pos[g]
    E, Ev = qi.shape[0], V.shape[2]
    kbytes, vbytes = Kg.shape[1] * Kg.itemsize, Vg.shape[1] * Vg.itemsize  # bytes of one key / value row
    acc, sc = np.zeros(max(Ev, 1), dtype=np.float32), np.empty(CHUNK, dtype=np.float32)
    idx = sel[r] if LISTED else np.empty(0, dtype=np.int64)  # LISTED: the row's listed slots
    hs, hb, qc, la, n_sel, n_zone, overflow = ROUTE(r, qi, g, qp, mode, n_probe, n_est, cent, cscale, n_cent, ccount,
                                                    cminpos, cspread, pmin, pmax, pminpos, page_size, n_sinks, ex_lo,
                                                    Kg, pg, n_slots, sel, scale)
    nc = la.shape[0]
    order = np.empty(0, dtype=np.int64)  # MODE_MASS walk state
    goal = cum = 0.0
    mshift, m_run, l_run = np.float32(-np.inf), np.float32(-np.inf), np.float32(0.0)
    nk = walk = rr = n_read = n_recorded = 0
    capped = 0  # MODE_MASS: the walk ended at top_p_max_keys, short of its goal
    listed = False  # LISTED: set once the listed slots are read
    while not overflow and not listed:
        listed = LISTED and rr == 2
        if listed:
            a, b, lim = 0, n_sel, hi_pos
        elif mode == MODE_MASS and rr >= 2:
            if rr == 2:  # the exact part is done: its true mass opens the walk
                order, mshift, cum, goal = mass_open(la, nc, m_run, l_run, top_p)
            c, walk, nk, cum = mass_next(order, la, walk, nc, cum, goal, mshift, nk, top_p, tp_min, tp_max, cptr, g)
            if c < 0:
                capped = 1 if c == -2 else 0
                break
            a, b, lim = cptr[g, c], cptr[g, c + 1], hi_pos
        else:
            a, b, lim, ok = _fixed_range(rr, mode, r, g, hb, n_sel, sel, cptr, n_sinks, ex_lo, n_slots, page_size,
                                         hi_pos)
            if not ok:
                break
        rr += 1
        pf_a, pf_b = _prefetch_range(rr, mode, g, hb, n_sel, cptr, n_sinks, ex_lo, page_size)
        n_recorded = _record(rec, r, n_recorded, a, b, lim)
        start = a
        while start < b:
            stop = min(start + CHUNK, b)
            n = stop - start
            for j in range(start, stop):  # scores of the whole chunk (a plain loop that vectorises)
                if LISTED and listed:
                    if j + LIST_AHEAD < b:
                        for off in range(0, kbytes, 64):
                            prefetch_l2(Kg, idx[j + LIST_AHEAD], off)
                        for off in range(0, vbytes, 64):
                            prefetch_l2(Vg, idx[j + LIST_AHEAD], off)
                elif pf_a + (j - a) < pf_b:
                    for off in range(0, kbytes, 64):
                        prefetch_l2(Kg, pf_a + (j - a), off)
                    for off in range(0, vbytes, 64):
                        prefetch_l2(Vg, pf_a + (j - a), off)
                kj = Kg[idx[j] if LISTED and listed else j]
                s = np.float32(0.0)
                for e in range(E):
                    s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
                sc[j - start] = s * scale
            cmax = np.float32(-np.inf)  # the position masks
            cnt = 0
            for u in range(n):
                p = pg[idx[start + u] if LISTED and listed else start + u]
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
                overflow = True
                break
            m_run, l_run = _raise_max(m_run, cmax, l_run, acc)
            exp_shifted_f32(sc, n, m_run, sc)  # masked keys: exp(-inf) = 0
            for u in range(n):
                w = sc[u]
                l_run += w
                vj = Vg[idx[first + u] if LISTED and listed else first + u]
                for e in range(Ev):
                    acc[e] += w * (widen_bf16(vj[e]) if BF16 else widen_f16(vj[e]))
    n_used = 0
    if not overflow:
        m_run, l_run, n_used, overflow = _estimate(mode, n_est, n_zone, n_probe, hs, hb, order, walk, la, qc, g, qp,
                                                   scale, ccount, cmaxpos, cvmean, acc, m_run, l_run)
    nest[r], nread[r], ncap[r] = n_used, n_read, capped
    if rec.shape[0] > 0:
        n_rec[r] = n_recorded
    _finish(out, lse, h, t, acc, m_run, l_run, overflow)


# ------------------------------------------------------------------------------ a group of rows
@njit(cache=True, fastmath=FASTMATH, inline="always")
def _read_chunk(Kg, Vg, pg, qs, u0, u1, idx, listed, start, stop, qp, lim, scale, sc, vis, acc, m_run, l_run, over):
    """Slots ``start .. stop - 1`` (at most ``CHUNK``; with ``listed`` the slots ``idx[start:stop]``) read for
    the query rows ``qs[u0:u1]`` of one kv head: each key row is scored against every one of those queries
    while it is in L1, then each row's online softmax (the rules of :func:`_row`: visible iff ``pos <= qp``
    and ``pos < lim``; a non-finite score of a visible key sets the row's ``over``) and one pass over the
    value rows for all of them.  Returns the visible keys."""
    E, Ev = qs.shape[1], Vg.shape[1]
    kbytes, vbytes = Kg.shape[1] * Kg.itemsize, Vg.shape[1] * Vg.itemsize
    n = stop - start
    cnt = 0
    for j in range(start, stop):
        if listed and j + LIST_AHEAD < stop:
            for off in range(0, kbytes, 64):
                prefetch_l2(Kg, idx[j + LIST_AHEAD], off)
            for off in range(0, vbytes, 64):
                prefetch_l2(Vg, idx[j + LIST_AHEAD], off)
        slot = idx[j] if listed else j
        p = pg[slot]
        ok = p <= qp and p < lim
        vis[j - start] = ok
        cnt += 1 if ok else 0
        kj = Kg[slot]
        for u in range(u0, u1):
            s = np.float32(0.0)
            for e in range(E):
                s += qs[u, e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
            sc[u, j - start] = s * scale
    if cnt == 0:
        return 0
    for u in range(u0, u1):
        row = sc[u]
        if over[u]:
            for i in range(n):
                row[i] = np.float32(0.0)
            continue
        cmax = np.float32(-np.inf)
        for i in range(n):
            if not vis[i]:
                row[i] = -np.inf
            else:
                x = row[i]
                if x > cmax:
                    cmax = x
                elif not (x > -np.inf):  # -inf or NaN from finite inputs: the score overflowed
                    cmax = np.inf
        if cmax == np.inf:
            over[u] = True
            for i in range(n):
                row[i] = np.float32(0.0)
            continue
        m_run[u], l_run[u] = _raise_max(m_run[u], cmax, l_run[u], acc[u])
        exp_shifted_f32(row, n, m_run[u], row)  # masked keys: exp(-inf) = 0
        tot = np.float32(0.0)
        for i in range(n):
            tot += row[i]
        l_run[u] += tot
    for j in range(start, stop):
        if not vis[j - start]:
            continue
        vj = Vg[idx[j] if listed else j]
        for u in range(u0, u1):
            w = sc[u, j - start]
            a = acc[u]
            for e in range(Ev):
                a[e] += w * (widen_bf16(vj[e]) if BF16 else widen_f16(vj[e]))
    return cnt


def _group(k, Qg, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, scale, sel, out, lse, nread, nest,
           ncap):
    """Group ``k`` of rows: query heads ``h0 .. h0 + Qg - 1`` of one kv head g at token t (``Qg`` divides
    ``rep``; groups are ordered (g, subgroup, t)), for ``MODE_NONE`` and the one-sweep ``MODE_LIST``.  The
    exact ranges (sinks, window) are read once for the group's rows, not once per row: grouped-query
    attention then reads a kv head's keys and values once per ``Qg`` query heads.  In ``MODE_LIST`` each
    row then reads its own listed slots.  Rows get what :func:`_row` gives them (up to float32 summation
    order): same masks, online softmax, overflow and empty-row rules."""
    T = q.shape[1]
    n_sub = rep // Qg
    t = k % T
    gs = k // T
    g = gs // n_sub
    h0 = g * rep + (gs % n_sub) * Qg
    qp, Kg, Vg, pg = qpos[t], K[g], V[g], pos[g]
    Ev = V.shape[2]
    qs = np.empty((Qg, q.shape[2]), np.float32)
    for u in range(Qg):
        qs[u] = q[h0 + u, t]
    acc = np.zeros((Qg, max(Ev, 1)), np.float32)
    sc = np.empty((Qg, CHUNK), np.float32)
    vis = np.empty(CHUNK, np.bool_)
    m_run = np.full(Qg, -np.inf, np.float32)
    l_run = np.zeros(Qg, np.float32)
    over = np.zeros(Qg, np.bool_)
    shared = 0
    for rr in range(2):  # the sinks, then the window: shared by the group's rows
        a = 0 if rr == 0 else ex_lo
        b = min(n_sinks, n_slots) if rr == 0 else n_slots
        for start in range(a, b, CHUNK):
            shared += _read_chunk(Kg, Vg, pg, qs, 0, Qg, sel[0], False, start, min(start + CHUNK, b), qp,
                                  2147483647, scale, sc, vis, acc, m_run, l_run, over)
    for u in range(Qg):
        r = (h0 + u) * T + t
        n_read = shared
        if mode == MODE_LIST:
            idx = sel[r]
            n_sel = 0
            while n_sel < idx.shape[0] and idx[n_sel] >= 0:
                n_sel += 1
            for start in range(0, n_sel, CHUNK):
                n_read += _read_chunk(Kg, Vg, pg, qs, u, u + 1, idx, True, start, min(start + CHUNK, n_sel), qp,
                                      hi_pos, scale, sc, vis, acc, m_run, l_run, over)
        nread[r], nest[r], ncap[r] = n_read, 0, 0
        _finish(out, lse, h0 + u, t, acc[u], m_run[u], l_run[u], over[u])


# one variant per storage and per slot source (ranges only, or a list in one sweep): compile-time
# constants, so the range variant's loop has no branch of the list's.  The row body is its own compiled
# function: a prange loop over a large body compiled ~10x slower.
ROUTE = route_row_f32
_row_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_row, "_std", {"BF16": False}))
_row_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_row, "_bf16", {"BF16": True, "ROUTE": route_row_bf16}))
_row_list_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_row, "_list", {"BF16": False, "LISTED": True}))
_row_list_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_row, "_list_bf16", {
    "BF16": True, "LISTED": True, "ROUTE": route_row_bf16}))
_group_f32 = njit(cache=True, fastmath=FASTMATH)(clone_with(_group, "_std", {"BF16": False}))
_group_bf16 = njit(cache=True, fastmath=FASTMATH)(clone_with(_group, "_bf16", {
    "BF16": True, "_read_chunk": njit(cache=True, fastmath=FASTMATH, inline="always")(
        clone_with(_read_chunk.py_func, "_bf16", {"BF16": True}))}))
ROW, ROW_LIST, GROUP = _row_f32, _row_list_f32, _group_f32


def _decode_rows(q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
                 cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos,
                 cmaxpos, cspread, top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest, ncap, Qg):
    one_sweep = mode == MODE_LIST and rec.shape[0] == 0  # every listed slot in one sweep
    if Qg > 1 and rec.shape[0] == 0 and (mode == MODE_LIST or mode == MODE_NONE):
        for k in prange(q.shape[0] // Qg * q.shape[1]):  # groups of Qg query heads sharing a kv head
            GROUP(k, Qg, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, scale, sel, out, lse, nread,
                  nest, ncap)
        return
    for r in prange(q.shape[0] * q.shape[1]):
        if one_sweep:
            ROW_LIST(r, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe, cent, cscale, cptr,
                     n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos, cmaxpos, cspread,
                     top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest, ncap)
            continue
        ROW(r, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
            cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos, cmaxpos,
            cspread, top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest, ncap)


decode_serial, decode_parallel = serial_and_parallel(_decode_rows)
decode_serial_bf16, decode_parallel_bf16 = serial_and_parallel(
    _decode_rows, constants={"ROW": _row_bf16, "ROW_LIST": _row_list_bf16, "GROUP": _group_bf16}, suffix="_bf16")
