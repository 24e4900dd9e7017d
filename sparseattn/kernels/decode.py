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

With ``rec`` of nonzero length the kernel records, per row, the slot ranges it scored (``rec[r, i] =
(first, stop, hi)``, ``n_rec[r]`` of them); ``accumulate_serial`` / ``accumulate_parallel`` replay them
to add each read key's softmax weight ``exp(scale * q . k - lse)`` to a per-slot total (the
heavy-hitter statistics of the ``"h2o"`` memory cap).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ._intrinsics import exp_shifted_f32, prefetch_l2
from ._options import FASTMATH, serial_and_parallel
from .topk import ORDER_BEST, heap_finish, heap_offer

MODE_NONE = 0
MODE_CLUSTER = 1
MODE_PAGES = 2
MODE_TOPK = 3
MODE_MASS = 4
MODE_LIST = 5

EVICTED = 2147483647  # position of an evicted slot: after every query, so never visible
CHUNK = 128  # keys scored before one softmax update (scratch per row: CHUNK floats)
BF16 = False  # compile-time constant: True in the bfloat16 variants below


@intrinsic
def widen_f16(typingctx, x):
    """float32 from a float32 (unchanged) or from float16 bits held in a uint16 (an LLVM ``fpext``)."""
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def codegen(context, builder, signature, args):
            return args[0]
        return types.float32(x), codegen
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        def codegen(context, builder, signature, args):
            half = builder.bitcast(args[0], ir.HalfType())
            return builder.fpext(half, ir.FloatType())
        return types.float32(x), codegen
    return None


@intrinsic
def widen_bf16(typingctx, x):
    """float32 from a float32 (unchanged) or from bfloat16 bits held in a uint16 (shift + bitcast)."""
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def codegen(context, builder, signature, args):
            return args[0]
        return types.float32(x), codegen
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        def codegen(context, builder, signature, args):
            wide = builder.zext(args[0], ir.IntType(32))
            bits = builder.shl(wide, ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(bits, ir.FloatType())
        return types.float32(x), codegen
    return None


@intrinsic
def narrow_f16(typingctx, x):
    """float16 bits (uint16) of a float32: an LLVM ``fptrunc`` (round to nearest even; beyond +-65504
    after rounding: +-inf)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def float32_bits(typingctx, x):
    """The bits of a float32 as a uint32 (an LLVM bitcast)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@njit(cache=True, nogil=True)
def store_token_f32(src, dst):
    """Copy one token ``src`` (H_kv, 1, E) float32 (any strides) into ``dst`` (H_kv, E) float32; returns 0,
    or 1 at the first NaN/Inf (``dst`` then partly written)."""
    for i in range(src.shape[0]):
        for e in range(src.shape[2]):
            x = src[i, 0, e]
            if not (x - x == 0):
                return 1
            dst[i, e] = x
    return 0


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


def _row(r, q, qpos, rep, K, V, pos, n_sinks, ex_lo, n_slots, hi_pos, mode, n_probe,
         cent, cscale, cptr, n_cent, ccount, pmin, pmax, pminpos, page_size, scale, n_est, cvmean, cminpos, cmaxpos,
         top_p, tp_min, tp_max, sel, rec, n_rec, out, lse, nread, nest):
    """One row (query head h, token t) of the decode kernel; see the module docstring."""
    T = q.shape[1]
    E = q.shape[2]
    Ev = V.shape[2]
    width = max(n_probe + (n_est if mode == MODE_CLUSTER else 0), 1)
    h = r // T
    t = r - h * T
    g = h // rep
    qi = q[h, t]
    qp = qpos[t]
    Kg = K[g]
    Vg = V[g]
    pg = pos[g]
    sc = np.empty(CHUNK, dtype=np.float32)
    kbytes = Kg.shape[1] * Kg.itemsize  # bytes of one key row / value row
    vbytes = Vg.shape[1] * Vg.itemsize
    acc = np.zeros(max(Ev, 1), dtype=np.float32)
    hs = np.empty(width, dtype=np.float32)
    hb = np.empty(width, dtype=np.int64)
    record = rec.shape[0] > 0
    n_recorded = 0
    m_run = np.float32(-np.inf)
    l_run = np.float32(0.0)
    overflow = False
    n_read = 0
    n_sel = 0
    nc = n_cent[g] if (mode == MODE_CLUSTER or mode == MODE_MASS) else 0
    qc = np.empty(nc if mode == MODE_MASS else 0, dtype=np.float32)  # MODE_MASS: q . c per cluster
    la = np.empty(nc if mode == MODE_MASS else 0, dtype=np.float32)  # MODE_MASS: log estimated masses
    if mode == MODE_CLUSTER or mode == MODE_MASS:
        for c in range(nc):
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
    elif mode == MODE_PAGES:
        n_pages = (ex_lo - n_sinks + page_size - 1) // page_size
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
    elif mode == MODE_TOPK:
        for j in range(n_slots):
            if pg[j] > qp:
                continue
            kj = Kg[j]
            s = np.float32(0.0)
            for e in range(E):
                s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
            if not (s > -np.inf and s < np.inf):  # the float32 dot product overflowed (finite inputs)
                overflow = True
                n_sel = 0
                break
            if n_sel < n_probe or s > hs[0]:
                n_sel = heap_offer(hs, hb, n_sel, n_probe, s, j)
        # attend the chosen slots in ascending slot order (a deterministic sum order)
        hb[:n_sel].sort()
    elif mode == MODE_LIST:
        sr = sel[r]
        n_sel = 0
        while n_sel < sr.shape[0] and sr[n_sel] >= 0:
            n_sel += 1
    n_zone = 0  # estimation zone: hb[n_probe:n_sel] after ordering best first
    zone0 = n_probe
    if mode == MODE_CLUSTER and n_est > 0 and n_sel > n_probe:
        heap_finish(hs, hb, n_sel, ORDER_BEST)
        n_zone = n_sel - n_probe
        n_sel = n_probe
    if mode == MODE_CLUSTER or mode == MODE_PAGES:
        hb[:n_sel].sort()  # read in slot order (clusters and pages are laid out by id): a forward sweep
    # MODE_MASS walk state
    order = np.empty(0, dtype=np.int64)
    tot = 0.0
    goal = 0.0
    cum = 0.0
    mshift = np.float32(0.0)
    nk = 0
    walk = 0
    rr = 0
    while True:
        lim = hi_pos
        if mode == MODE_TOPK:
            if rr >= n_sel:
                break
            a = hb[rr]
            b = a + 1
        elif rr == 0:
            a = 0
            b = min(n_sinks, n_slots)
            lim = 2147483647
        elif rr == 1:
            a = ex_lo
            b = n_slots
            lim = 2147483647
        elif mode == MODE_CLUSTER:
            if rr - 2 >= n_sel:
                break
            c = hb[rr - 2]
            a = cptr[g, c]
            b = cptr[g, c + 1]
        elif mode == MODE_PAGES:
            if rr - 2 >= n_sel:
                break
            a = n_sinks + hb[rr - 2] * page_size
            b = min(a + page_size, ex_lo)
        elif mode == MODE_LIST:
            if rr - 2 >= n_sel:
                break
            a = sel[r, rr - 2]
            b = a + 1
        elif mode == MODE_MASS:
            if rr == 2:  # the exact part is done: its true mass opens the walk
                order = np.argsort(-la, kind="mergesort")
                mshift = m_run
                for c in range(nc):
                    if la[c] > mshift:
                        mshift = la[c]
                if mshift > -np.inf:
                    if m_run > -np.inf:
                        cum = np.float64(l_run) * np.exp(np.float64(m_run) - np.float64(mshift))
                    tot = cum
                    for c in range(nc):
                        if la[c] > -np.inf:
                            tot += np.exp(np.float64(la[c]) - np.float64(mshift))
                goal = top_p * tot
            if walk >= nc:
                break
            c = order[walk]
            if la[c] == -np.inf:
                break
            if top_p < 1.0 and cum >= goal and nk >= tp_min:
                break
            size = cptr[g, c + 1] - cptr[g, c]
            if nk + size > tp_max:
                break
            walk += 1
            nk += size
            cum += np.exp(np.float64(la[c]) - np.float64(mshift))
            a = cptr[g, c]
            b = cptr[g, c + 1]
        else:  # MODE_NONE: the two exact ranges only
            break
        rr += 1
        pf_a = 0  # the next routed range [pf_a, pf_b), prefetched row by row while this one is scored
        pf_b = 0
        if (mode == MODE_CLUSTER or mode == MODE_PAGES) and 2 <= rr and rr - 2 < n_sel:
            nxt = hb[rr - 2]
            if mode == MODE_CLUSTER:
                pf_a = cptr[g, nxt]
                pf_b = cptr[g, nxt + 1]
            else:
                pf_a = n_sinks + nxt * page_size
                pf_b = min(pf_a + page_size, ex_lo)
        if record and b > a:
            rec[r, n_recorded, 0] = a
            rec[r, n_recorded, 1] = b
            rec[r, n_recorded, 2] = lim
            n_recorded += 1
        start = a
        while start < b:
            stop = min(start + CHUNK, b)
            n = stop - start
            # scores of the whole chunk (a plain loop that vectorises), then the position masks
            for j in range(start, stop):
                if pf_a + (j - a) < pf_b:  # one row of the next range per row scored (keys and values)
                    for off in range(0, kbytes, 64):
                        prefetch_l2(Kg, pf_a + (j - a), off)
                    for off in range(0, vbytes, 64):
                        prefetch_l2(Vg, pf_a + (j - a), off)
                kj = Kg[j]
                s = np.float32(0.0)
                for e in range(E):
                    s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
                sc[j - start] = s * scale
            cmax = np.float32(-np.inf)
            cnt = 0
            for u in range(n):
                p = pg[start + u]
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
                vj = Vg[first + u]
                for e in range(Ev):
                    acc[e] += w * (widen_bf16(vj[e]) if BF16 else widen_f16(vj[e]))
        if overflow:
            break
    if mode == MODE_MASS and n_est > 0:
        n_zone = min(n_est, nc - walk)
        zone0 = walk
    n_used = 0
    for z in range(n_zone):  # estimated clusters: one pseudo-key each (score + log count, mean value)
        if overflow:
            break
        if mode == MODE_MASS:
            c = order[zone0 + z]
            if la[c] == -np.inf:
                break
            s_c = qc[c]
        else:
            c = hb[zone0 + z]
            s_c = hs[zone0 + z]
        cnt_c = ccount[g, c]
        if cnt_c <= 0 or cmaxpos[g, c] > qp:
            continue  # a key the row may not see (later or evicted): never estimated
        s = s_c * scale + np.float32(np.log(np.float32(cnt_c)))
        if s == np.inf:
            overflow = True
            break
        m_run, l_run = _raise_max(m_run, s, l_run, acc)
        w = np.float32(np.exp(s - m_run))
        l_run += w
        vm = cvmean[g, c]
        for e in range(Ev):
            acc[e] += w * vm[e]
        n_used += 1
    nest[r] = n_used
    nread[r] = n_read
    if record:
        n_rec[r] = n_recorded
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


def _clone(fn, suffix, constants):
    """A copy of ``fn`` with some module globals replaced (compile-time constants) and its own name, so
    that each copy gets its own on-disk cache entry."""
    import types as pytypes

    f = pytypes.FunctionType(fn.__code__, {**fn.__globals__, **constants}, fn.__name__ + suffix,
                             fn.__defaults__, fn.__closure__)
    f.__qualname__ = fn.__qualname__ + suffix
    f.__module__ = fn.__module__
    f.__doc__ = fn.__doc__
    return f


def _store_token_16(src, dst):
    """Round one token ``src`` (H_kv, 1, E) float32 to 16-bit bits in ``dst`` (H_kv, E) uint16: float16
    (an LLVM ``fptrunc``), or with ``BF16 = True`` bfloat16 (nearest even); returns 0, 1 at the first
    NaN/Inf, or 2 when a value rounds beyond the format's range (``dst`` then partly written)."""
    for i in range(src.shape[0]):
        for e in range(src.shape[2]):
            x = src[i, 0, e]
            if not (x - x == 0):
                return 1
            if BF16:
                u = float32_bits(x)
                r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
                if (r & np.uint32(0x7F80)) == np.uint32(0x7F80):
                    return 2
                dst[i, e] = np.uint16(r)
            else:
                h = narrow_f16(x)
                if (h & np.uint16(0x7FFF)) == np.uint16(0x7C00):
                    return 2
                dst[i, e] = h
    return 0


store_token_f16 = njit(cache=True, nogil=True)(_clone(_store_token_16, "_f16", {"BF16": False}))
store_token_bf16 = njit(cache=True, nogil=True)(_clone(_store_token_16, "_bf16", {"BF16": True}))


# The row body is its own compiled function: a prange loop over a large body compiled ~10x slower.
_row_f32 = njit(cache=True, fastmath=FASTMATH)(_clone(_row, "_std", {"BF16": False}))
_row_bf16 = njit(cache=True, fastmath=FASTMATH)(_clone(_row, "_bf16", {"BF16": True}))
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


def _accumulate_rows(q, qpos, rep, K, pos, rec, n_rec, lse, scale, weights):
    """Add each key's softmax weight to ``weights[g, slot]`` (float64), replaying the ranges the decode
    kernel recorded: for row r = (h, t), every slot j of ``rec[r, :n_rec[r]]`` visible to the row (same
    masks as the kernel) gets ``exp(scale * q[h, t] . K[g, j] - lse[h, t])`` (float32 scores and exp, in
    chunks of ``CHUNK`` as in the kernel).  Parallel over kv heads (each head's totals are written by one
    thread); rows with a non-finite lse add nothing."""
    T = q.shape[1]
    E = q.shape[2]
    H = q.shape[0]
    for g in prange(weights.shape[0]):
        Kg = K[g]
        pg = pos[g]
        wg = weights[g]
        sc = np.empty(CHUNK, dtype=np.float32)
        for h in range(g * rep, min((g + 1) * rep, H)):
            for t in range(T):
                r = h * T + t
                m = lse[h, t]
                if not (m > -np.inf and m < np.inf):
                    continue
                qi = q[h, t]
                qp = qpos[t]
                for i in range(n_rec[r]):
                    b = rec[r, i, 1]
                    lim = rec[r, i, 2]
                    start = rec[r, i, 0]
                    while start < b:
                        stop = min(start + CHUNK, b)
                        n = stop - start
                        for j in range(start, stop):
                            kj = Kg[j]
                            s = np.float32(0.0)
                            for e in range(E):
                                s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
                            p = pg[j]
                            sc[j - start] = -np.inf if (p > qp or p >= lim) else s * scale
                        exp_shifted_f32(sc, n, m, sc)
                        for u in range(n):
                            wg[start + u] += sc[u]
                        start = stop


accumulate_serial, accumulate_parallel = serial_and_parallel(_accumulate_rows, fastmath=FASTMATH)
accumulate_serial_bf16, accumulate_parallel_bf16 = serial_and_parallel(
    _accumulate_rows, constants={"BF16": True}, suffix="_bf16", fastmath=FASTMATH)


@njit(cache=True)
def page_bounds(q, pmin, pmax):
    """Quest bounds of queries over pages: ``out[i, b] = sum_e max(q[i, e] * min[b, e], q[i, e] * max[b, e])``.

    q : (L, E); pmin, pmax : (P, E), element-wise min and max of each page's keys (same float dtype).
    Returns (L, P) of that dtype; ``out[i, b] >= q_i . k`` for every key k of page b (up to rounding).
    """
    L = q.shape[0]
    P = pmin.shape[0]
    out = np.empty((L, P), dtype=q.dtype)
    for i in range(L):
        for b in range(P):
            s = q.dtype.type(0.0)
            for e in range(q.shape[1]):
                a1 = q[i, e] * pmin[b, e]
                a2 = q[i, e] * pmax[b, e]
                s += a1 if a1 > a2 else a2
            out[i, b] = s
    return out
