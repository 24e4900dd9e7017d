"""Residual sketches of keys and the two-stage candidate scan of the decode cache's ``sketch`` routing.

A key ``k`` of a cluster with routing vector ``mu`` has the residual ``r = k - mu``.  With a fixed random
rotation ``P`` (E, E) orthogonal, each component of ``P r`` gets a 4-bit code ``c`` in 0..15 (16 bins of
width ``D = max |P r| / 7.5``), stored as four bit planes of 64-bit words (bit ``i`` of word ``w`` of plane
``b`` is bit ``b`` of ``c[64 w + i]``; bits past E are 0).  The top plane is the sign of ``P r``.

Stage 1 (every routed key): the sign code and one factor ``f = |P r|^2 / |P r|_1`` estimate a score::

    q . k = q . mu + (P q) . (P r)  ~  q . mu + f * (P q) . s        (s = the signs as +-1)

exact when ``P r`` is parallel to its sign vector, an unbiased-direction estimate otherwise (RaBitQ's
estimator without its error bound).  The rotated query is quantized to 4 bits a component, ``P q ~ lo + d
u`` with ``u`` in 0..15 (RaBitQ's query quantization: on 131,072 Gaussian keys the top-3 % candidates held
the same share of the true top-64 as with the float query, 0.961 against 0.959), so that

    (P q) . s  ~  2 d S + 2 lo c - d sum(u) - E lo,    S = sum_p 2^p popcount(U_p & code),  c = popcount(code)

with ``U_p`` the bit planes of ``u``: five popcounts and a few integer operations a key at E = 64, which
vectorise (``vpopcntq``); 8 bytes of code per 64 dimensions and 4 of factor read.  The scan streams the
clusters in slot order against a threshold taken from a sample of the keys (about 1.5 x the shortlist
beats it; a row with fewer is scanned again from -inf), skipping every cluster whose ball bound ``q . mu
+ |q| rad`` (``rad``: its largest residual norm) is below the threshold, and keeps the ``R`` best keys;
consecutive clusters it does not skip are estimated and filtered as one block, each key with its
cluster's ``q . mu``.

Stage 2 (the shortlist): the whole 4-bit codes re-rank the ``R`` keys (20 popcounts a key at E = 64,
``fine_scale * sum_i qhat_i (c_i - 7.5)``), and the best ``R2`` are returned for the exact reads (the
decode kernel's ``MODE_LIST``).  :func:`scan_serial` / :func:`scan_parallel` run both for every row,
the query heads of a kv head (GQA) in groups that read each cluster's codes once.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .intrinsics import append_above16, popcount64, prefetch_l2, trailing_zeros64
from .options import FASTMATH, serial_and_parallel

__all__ = ["code_bytes", "encode_residuals", "query_planes", "rotate_query", "scan_parallel", "scan_serial"]

LEVELS = 15  # the rotated query's components are quantized to 0..LEVELS (4 bits)
AHEAD = 16  # shortlisted keys prefetched ahead of the one re-ranked


def code_bytes(E: int) -> int:
    """Bytes of one key's code: 8 per 64 dimensions (whole 64-bit words)."""
    return 8 * ((E + 63) // 64)


def encode_residuals(residuals: np.ndarray, rotation: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Codes of residuals (n, E) float (any finite magnitude; computed in float64).

    Returns
    -------
    codes : (n, code_bytes(E)) uint8
        Signs of the rotated residuals, bit ``i`` of byte ``j`` for dimension ``8 j + i`` (read as
        little-endian uint64 words by the scan); bits past E are 0.
    fac : (n,) float32
        ``|P r|^2 / |P r|_1`` (0 for a zero residual), the scale of the sign estimate.
    norm : (n,) float64
        ``|r|``, the residual norms (the caller's cluster radii).
    fine : (n, 3 code_bytes(E)) uint8
        Bit planes 0, 1, 2 (one whole-word code each, in that order) of the 4-bit code ``c`` in 0..15 of
        every rotated component, ``x = D (c - 7.5)`` with ``D = max |P r| / 7.5`` (bins of width D:
        ``c = floor(x / D + 8)`` clipped).  Plane 3, the top bit, is ``codes`` (``c >= 8`` iff ``x >= 0``).
    fine_scale : (n,) float32
        ``D |P r|^2 / <D (c - 7.5), P r>``: the re-ranking estimate ``(P q) . (P r) ~ fine_scale *
        sum_i (P q)_i (c_i - 7.5)`` (exact along the quantized direction); 0 for a zero residual.
    """
    r = np.asarray(residuals, np.float64)
    n, E = r.shape
    rr = r @ np.asarray(rotation, np.float64).T
    nb = code_bytes(E)
    bits = np.zeros((n, nb * 8), bool)  # bit i of byte j = dimension 8 j + i: little-endian words
    bits[:, :E] = rr >= 0
    codes = np.packbits(bits, axis=1, bitorder="little")
    # |P r|^2 / |P r|_1 with both sums taken after dividing by the largest magnitude (no overflow at 1e300)
    big = np.abs(rr).max(axis=1) if E else np.zeros(n)
    safe = np.where(big > 0, big, 1.0)
    u = rr / safe[:, None]
    l1 = np.abs(u).sum(axis=1)
    fac = np.where(big > 0, (u * u).sum(axis=1) / np.where(l1 > 0, l1, 1.0) * big, 0.0)
    norm = np.sqrt((u * u).sum(axis=1)) * big
    # 4-bit codes of u = P r / max |P r| (in [-1, 1]): bins of width 1 / 7.5, c >= 8 exactly where u >= 0
    c = np.clip(np.floor(u * 7.5 + 8.0), 0, 15).astype(np.uint8)
    fine = np.zeros((n, 3 * nb), np.uint8)
    for p in range(3):
        bits[:, :E] = (c >> p) & 1
        fine[:, p * nb:(p + 1) * nb] = np.packbits(bits, axis=1, bitorder="little")
    x = (c.astype(np.float64) - 7.5) / 7.5  # the quantized u
    dot = (x * u).sum(axis=1)
    fine_scale = np.where(big > 0, (u * u).sum(axis=1) / np.where(dot > 0, dot, 1.0) / 7.5 * big, 0.0)
    f32max = np.finfo(np.float32).max
    with np.errstate(over="ignore"):
        return (codes, np.minimum(fac, f32max).astype(np.float32), norm, fine,
                np.minimum(fine_scale, f32max).astype(np.float32))


@njit(cache=True)
def query_planes(qr):
    """4-bit quantization of a rotated query ``qr`` (E,) float64.

    Returns ``planes`` (4, W) uint64 (bit ``i`` of word ``w`` of plane ``p``: bit ``p`` of ``u[64 w + i]``)
    and ``(c1, c2, c0)`` float64 such that the estimate ``sum_i (lo + d u_i) s_i`` of a code with
    ``S = sum_p 2^p popcount(planes[p] & code)`` and ``c = popcount(code)`` is ``c1 S + c2 c + c0``.
    """
    E = qr.shape[0]
    W = (E + 63) // 64
    lo, hi = np.inf, -np.inf
    for i in range(E):
        lo = min(lo, qr[i])
        hi = max(hi, qr[i])
    if not hi > lo:  # E = 0 or a constant query: every u is 0
        lo = qr[0] if E else 0.0
        hi = lo
    d = (hi - lo) / LEVELS if hi > lo else 1.0
    planes = np.zeros((4, W), np.uint64)
    usum = 0
    for i in range(E):
        u = min(max(int(np.rint((qr[i] - lo) / d)), 0), LEVELS)
        usum += u
        for p in range(4):
            if (u >> p) & 1:
                planes[p, i >> 6] |= np.uint64(1) << np.uint64(i & 63)
    return planes, 2.0 * d, 2.0 * lo, -d * usum - E * lo


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _wpop(U0, U1, U2, U3, x):
    """``sum_b 2^b popcount(U_b & x)``: the 4-bit query (bit planes ``U0..U3``) dotted with one 64-bit word
    of a key's bit plane ``x``."""
    return (popcount64(U0 & x) + (popcount64(U1 & x) << 1) + (popcount64(U2 & x) << 2)
            + (popcount64(U3 & x) << 3))


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _estimate_w(planes, q, c1, c2, c0, bk, cwf, fg, pg, qp, a, n, tmp, WC):
    """``tmp[i]`` = row ``q``'s (``planes[q]``) estimated score of slot ``a + i`` (i < n) from its code (the
    ``WC`` words ``cwf[WC (a + i):WC (a + i + 1)]`` of the flat uint64 codes), factor ``fg[a + i]`` and its
    cluster's base ``bk[i]`` (``q . mu``): ``bk[i] + f (c1 S + c2 c + c0)``; -inf where the slot's position ``pg[a + i]`` is after ``qp`` (a future
    key, or an evicted one: its position is the largest int32).  ``WC`` is a literal at the calls of
    :func:`_estimate` for 1, 2 and 4 words: the stride is then a constant, the loop over the words unrolls
    and the loop over the keys vectorises (E = 256: 2.0 against 11 ns a key with the stride read from a
    2-D array at run time, which LLVM vectorised only under a stride-1 check that failed).  (Unsigned
    indices: the loads need no wraparound; no slices, whose reference counts cost more than a small
    cluster's arithmetic.)"""
    u0 = np.uint64(a)
    uw = np.uint64(WC)
    for i in range(np.uint64(n)):
        j = u0 + i
        S = 0
        c = 0
        for w in range(WC):
            x = cwf[j * uw + np.uint64(w)]
            S += _wpop(planes[q, 0, w], planes[q, 1, w], planes[q, 2, w], planes[q, 3, w], x)
            c += popcount64(x)
        e = bk[i] + np.float64(fg[j]) * (c1 * S + c2 * c + c0)
        tmp[i] = e if pg[j] <= qp else -np.inf


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _estimate(planes, q, c1, c2, c0, bk, cwf, W, fg, pg, qp, a, n, tmp):
    """:func:`_estimate_w` with ``W`` words a code, a compile-time constant for W = 1, 2, 4 (E <= 64, 128,
    256)."""
    if W == 1:
        _estimate_w(planes, q, c1, c2, c0, bk, cwf, fg, pg, qp, a, n, tmp, 1)
    elif W == 2:
        _estimate_w(planes, q, c1, c2, c0, bk, cwf, fg, pg, qp, a, n, tmp, 2)
    elif W == 4:
        _estimate_w(planes, q, c1, c2, c0, bk, cwf, fg, pg, qp, a, n, tmp, 4)
    else:
        _estimate_w(planes, q, c1, c2, c0, bk, cwf, fg, pg, qp, a, n, tmp, W)


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _estimate_fine_w(planes, q, c1, c2, c0, bk, cwf, finef, sg, pg, qp, a, n, tmp, WC):
    """``tmp[i]`` = row ``q``'s 4-bit estimate of slot ``a + i``: ``bk[i] + fine_scale (sum_i qhat_i (c_i -
    7.5))`` from the whole 4-bit code (planes 0-2: the ``3 WC`` words of the slot in the flat ``finef``,
    plane 3 the sign code in ``cwf``) and the slot's ``sg`` scale; -inf after ``qp``.  The estimate
    :func:`_refine` gives a shortlisted key, here for every slot in order (streamed, no gathers): the
    scan's single stage on small caches.  ``WC`` as in :func:`_estimate_w`."""
    k_c, k_uc, k_0 = 0.5 * c2, 0.5 * c1, 7.5 * c0
    u0 = np.uint64(a)
    uw = np.uint64(WC)
    uf = np.uint64(3 * WC)
    for i in range(np.uint64(n)):
        j = u0 + i
        sum_uc = 0
        sum_c = 0
        for w in range(WC):
            U0, U1, U2, U3 = planes[q, 0, w], planes[q, 1, w], planes[q, 2, w], planes[q, 3, w]
            for b in range(4):
                x = finef[j * uf + np.uint64(b * WC + w)] if b < 3 else cwf[j * uw + np.uint64(w)]
                t = _wpop(U0, U1, U2, U3, x)
                sum_uc += t << b
                sum_c += popcount64(x) << b
        e = bk[i] + np.float64(sg[j]) * (k_c * sum_c + k_uc * sum_uc + k_0)
        tmp[i] = e if pg[j] <= qp else -np.inf


@njit(cache=True, fastmath=FASTMATH, inline="always")
def _estimate_fine(planes, q, c1, c2, c0, bk, cwf, finef, W, sg, pg, qp, a, n, tmp):
    """:func:`_estimate_fine_w` with ``W`` words a code plane, a compile-time constant for W = 1, 2, 4."""
    if W == 1:
        _estimate_fine_w(planes, q, c1, c2, c0, bk, cwf, finef, sg, pg, qp, a, n, tmp, 1)
    elif W == 2:
        _estimate_fine_w(planes, q, c1, c2, c0, bk, cwf, finef, sg, pg, qp, a, n, tmp, 2)
    elif W == 4:
        _estimate_fine_w(planes, q, c1, c2, c0, bk, cwf, finef, sg, pg, qp, a, n, tmp, 4)
    else:
        _estimate_fine_w(planes, q, c1, c2, c0, bk, cwf, finef, sg, pg, qp, a, n, tmp, W)


@njit(cache=True, fastmath=FASTMATH)
def _refine(planes, c1, c2, c0, cg, fine, fac, fscale, g, ids, est, m):
    """Re-rank the shortlist ``ids[:m]`` (stage-1 estimates in ``est[:m]``) by the 4-bit codes, in place:
    ``est[i]`` becomes ``base + fine_scale (sum_i qhat_i (c_i - 7.5))`` with ``sum qhat c`` from the bit
    planes (``c`` planes 0-2 in ``fine``, plane 3 = the sign code in ``cg``; 20 popcounts a key at E = 64).
    The cluster's ``base = q . mu`` is the stage-1 estimate minus its sign term (recomputed from the code),
    so the shortlist carries no cluster ids.  The shortlist is scattered over the slots: a first loop
    copies each key's words and scales into contiguous scratch, prefetching ``AHEAD`` keys early so the
    misses overlap; a second loop does the arithmetic (it vectorises)."""
    W = cg.shape[1]
    fg = fac[g]
    sg = fscale[g]
    X = np.empty((4 * W, m), np.uint64)  # plane-major: word w of plane b at row b * W + w
    F = np.empty(m, np.float64)
    G = np.empty(m, np.float64)
    for i in range(m):
        if i + AHEAD < m:
            j2 = ids[i + AHEAD]
            prefetch_l2(cg, j2, 0)
            prefetch_l2(fine, j2, 0)
            prefetch_l2(fac, g, 4 * j2)
            prefetch_l2(fscale, g, 4 * j2)
        j = ids[i]
        for w in range(3 * W):
            X[w, i] = fine[j, w]
        for w in range(W):
            X[3 * W + w, i] = cg[j, w]
        F[i] = fg[j]
        G[i] = sg[j]
    # sum qhat_i (c_i - 7.5) = lo sum c + d sum u c - 7.5 sum qhat, with c1 = 2 d, c2 = 2 lo, c0 = -sum qhat
    k_c, k_uc, k_0 = 0.5 * c2, 0.5 * c1, 7.5 * c0
    for w in range(W):
        U0, U1, U2, U3 = planes[0, w], planes[1, w], planes[2, w], planes[3, w]
        for i in range(m):
            sum_uc = 0
            sum_c = 0
            S = 0
            pc3 = 0
            for b in range(4):
                x = X[b * W + w, i]
                t = _wpop(U0, U1, U2, U3, x)
                sum_uc += t << b
                sum_c += popcount64(x) << b
                if b == 3:
                    S = t
                    pc3 = popcount64(x)
            sign_term = F[i] * (c1 * S + c2 * pc3 + (c0 if w == 0 else 0.0))
            fine_term = G[i] * (k_c * sum_c + k_uc * sum_uc + (k_0 if w == 0 else 0.0))
            est[i] += fine_term - sign_term


@njit(cache=True, fastmath=FASTMATH)
def _sample_cut(planes, q, c1, c2, c0, base, cptr, g, nc, cgf, W, fg, pg, qp, R, fine_all, finegf, sg):
    """A provisional threshold: the estimate that about ``1.5 R`` of the routed keys exceed, from the
    estimates of every k-th cluster (about 4,096 keys, spread over the slots).  -inf when the sample is
    too small to tell."""
    total = cptr[g, nc] - cptr[g, 0]
    stride = max(1, total // 4096)
    n = 0
    for c in range(0, nc, stride):
        n += cptr[g, c + 1] - cptr[g, c]
    if n < 256:
        return -np.inf
    sample = np.empty(n, np.float64)
    bk = np.empty(n, np.float64)  # each sampled key's cluster base
    w = 0
    for c in range(0, nc, stride):
        a, b = cptr[g, c], cptr[g, c + 1]
        bk[w:w + b - a] = base[q, c]
        if fine_all:
            _estimate_fine(planes, q, c1, c2, c0, bk[w:], cgf, finegf, W, sg, pg, qp, a, b - a, sample[w:])
        else:
            _estimate(planes, q, c1, c2, c0, bk[w:], cgf, W, fg, pg, qp, a, b - a, sample[w:])
        w += b - a
    above = int(1.5 * R * n / total) + 16  # keys of the sample expected above the cut, with a margin
    if above >= n:
        return -np.inf
    return _shrink(sample, np.empty(n, np.int64), n, above)[1]  # the above-th largest (a histogram select)


@njit(cache=True, fastmath=FASTMATH)
def _bounds(qs, qnorm, g, cent, cscale, rad, nc):
    """Per row and cluster of kv head g: ``base = q . mu`` (Q, nc) and the ball bound ``base + |q| rad``
    (Q, nc), float64, from queries ``qs`` (Q, E) float32 and their norms ``qnorm`` (Q,)."""
    Q, E = qs.shape[0], qs.shape[1]
    base = np.empty((Q, nc), np.float64)
    ub = np.empty((Q, nc), np.float64)
    for c in range(nc):
        for q in range(Q):
            s = 0.0
            for e in range(E):
                s += np.float64(cent[g, c, e]) * np.float64(qs[q, e])
            base[q, c] = s * np.float64(cscale[g, c])
            ub[q, c] = base[q, c] + qnorm[q] * rad[g, c]
    return base, ub


@njit(cache=True, fastmath=FASTMATH)
def _finish_row(planes_q, cq_q, cg, fineg, fac, fscale, g, eq, iq, mq, R, R2, lo, hi, out, fine_all):
    """Row q's buffer ``eq`` / ``iq`` (``mq`` kept) to its answer: the best R (the shortlist), re-ranked by
    the 4-bit codes unless ``fine_all`` (stage 2), the best R2 of those written ascending to ``out`` (R2,),
    -1 padded."""
    if mq > R:
        mq = _shrink(eq, iq, mq, R)[0]
    if mq > R2 and not fine_all:
        _refine(planes_q, cq_q[0], cq_q[1], cq_q[2], cg, fineg, fac, fscale, g, iq, eq, mq)
    if mq > R2:
        mq = _shrink(eq, iq, mq, R2)[0]
    _ascending(iq, mq, lo, hi, out)
    for i in range(mq, R2):
        out[i] = -1


@njit(cache=True, fastmath=FASTMATH)
def _scan_group(qs, qrs, qnorm, qp, g, cent, cscale, cptr, nc, rad, cw, fac, fine, fscale, pos, R, R2, outs, est,
                ids, tmp, fine_all):
    """Rows ``qs`` (Q, E) float32 (rotated: ``qrs`` (Q, E) float64, norms ``qnorm`` (Q,)) of one kv head g at
    position ``qp``: the query heads of a GQA group, scanned together so each cluster's codes come from
    memory once for all of them (estimated row by row from L1).

    Per row: shortlists the ``R`` slots of largest sign estimate, writes the ``R2 <= R`` of them with the
    largest 4-bit estimate (ascending, -1 padded) to ``outs[q]`` (R2,); returns the keys whose codes were
    scanned per row (Q,).  ``est`` / ``ids`` (Q B,): row q's buffer is ``[q B, q B + B)``, B > R, holding
    the keys whose estimate beats the row's ``theta``; when it is full it is cut back to its best R and
    ``theta`` rises to the R-th best.  ``theta`` starts at a cut from a sample that about 1.5 R keys beat
    (on long caches): most keys are compared and passed over, and clusters whose bound ``q . mu + |q| rad``
    is below it are skipped; a row with fewer than R keys above it is scanned again from -inf (exact
    either way).  Consecutive clusters not skipped by the same rows are estimated and filtered as one block
    (a run).  ``tmp``: scratch for the estimates of up to ``min(len(tmp), B - R)`` keys at a time.
    With ``fine_all`` every key's estimate is the 4-bit one (:func:`_estimate_fine`) and there is no second
    stage (R = R2)."""
    Q = qs.shape[0]
    B = est.shape[0] // Q
    C = min(tmp.shape[0], B - R)  # keys estimated at a time (a cluster may be larger)
    bk = np.empty(C, np.float64)  # the cluster base of each key estimated
    W = cw.shape[2]
    planes = np.empty((Q, 4, W), np.uint64)
    cq = np.empty((Q, 3), np.float64)
    for q in range(Q):
        planes[q], cq[q, 0], cq[q, 1], cq[q, 2] = query_planes(qrs[q])
    base, ub = _bounds(qs, qnorm, g, cent, cscale, rad, nc)
    cg, fg, pg, fineg, sg = cw[g], fac[g], pos[g], fine[g], fscale[g]
    cgf, finegf = cg.reshape(-1), fineg.reshape(-1)  # flat: the estimators index them with constant strides
    long = cptr[g, nc] - cptr[g, 0] > 8 * R  # worth a threshold up front (to skip keys) only on long caches
    theta0 = np.full(Q, -np.inf)
    if long:
        for q in range(Q):
            theta0[q] = _sample_cut(planes, q, cq[q, 0], cq[q, 1], cq[q, 2], base, cptr, g, nc, cgf, W, fg, pg, qp,
                                    R, fine_all, finegf, sg)
    m = np.zeros(Q, np.int64)  # keys kept in each row's buffer
    scanned = np.zeros(Q, np.int64)
    theta = np.empty(Q, np.float64)  # a lower bound of the row's final R-th best (once checked)
    todo = np.ones(Q, np.bool_)  # rows (still) to scan
    live = np.zeros(Q, np.bool_)  # rows reading the current cluster
    for attempt in range(2):
        for q in range(Q):
            if todo[q]:
                m[q] = 0
                scanned[q] = 0
                theta[q] = theta0[q] if attempt == 0 else -np.inf
        c = 0
        while c < nc:
            any_live = False
            for q in range(Q):
                live[q] = todo[q] and ub[q, c] >= theta[q]  # else no key of the cluster beats keys found
                any_live |= live[q]
            if not any_live:
                c += 1
                continue
            # a run [c, c2) of whole clusters live for the same rows, at most C keys (or one larger cluster,
            # in chunks of C), estimated and filtered as one block, each key with its cluster's base: the
            # per-cluster loop ends cost 14 % of a scan of 64-key clusters (131,072 keys x 8 heads, E = 64)
            c2 = c + 1
            if cptr[g, c + 1] - cptr[g, c] <= C:
                while c2 < nc and cptr[g, c2 + 1] - cptr[g, c] <= C:
                    same = True
                    for q in range(Q):
                        same &= live[q] == (todo[q] and ub[q, c2] >= theta[q])
                    if not same:
                        break
                    c2 += 1
            for a in range(cptr[g, c], cptr[g, c2], C):
                b = min(a + C, cptr[g, c2])
                for q in range(Q):
                    if not live[q]:
                        continue
                    if m[q] + (b - a) > B:  # the buffer is full: cut back to the best R, raise theta
                        m[q], theta[q] = _shrink(est[q * B:(q + 1) * B], ids[q * B:(q + 1) * B], m[q], R)
                        if c2 == c + 1 and ub[q, c] < theta[q]:
                            live[q] = False
                            continue
                    scanned[q] += b - a
                    bq = base[q]
                    for cc in range(c, c2):  # a slice fill per cluster (an indexed loop over the keys was slower)
                        bk[max(cptr[g, cc], a) - a:min(cptr[g, cc + 1], b) - a] = bq[cc]
                    # estimates first (independent iterations that vectorise; hidden keys at -inf), then
                    # the filter, 16 at a time without a branch per key (about 1 key in 20 passes)
                    if fine_all:
                        _estimate_fine(planes, q, cq[q, 0], cq[q, 1], cq[q, 2], bk, cgf, finegf, W, sg, pg, qp,
                                       a, b - a, tmp)
                    else:
                        _estimate(planes, q, cq[q, 0], cq[q, 1], cq[q, 2], bk, cgf, W, fg, pg, qp, a, b - a, tmp)
                    th = theta[q]
                    w = q * B + m[q]
                    i = 0
                    while i + 16 <= b - a:
                        w = append_above16(tmp, i, th, est, ids, w, a)
                        i += 16
                    for r in range(i, b - a):  # the last few
                        if tmp[r] > th:
                            est[w] = tmp[r]
                            ids[w] = a + r
                            w += 1
                    m[q] = w - q * B
            c = c2
        for q in range(Q):
            if todo[q]:
                todo[q] = m[q] < R and theta0[q] > -np.inf
        if not todo.any():
            break
    for q in range(Q):
        _finish_row(planes[q], cq[q], cg, fineg, fac, fscale, g, est[q * B:(q + 1) * B], ids[q * B:(q + 1) * B], m[q],
                    R, R2, cptr[g, 0], cptr[g, nc], outs[q], fine_all)
    return scanned


@njit(cache=True)
def _ascending(ids, m, lo, hi, out):
    """``out[:m]`` = ``ids[:m]`` (distinct, in [lo, hi)) in ascending order, through a bitmap of [lo, hi): the
    decode kernel then reads the slots as a forward sweep (Numba's sort costs ~35 ns an id)."""
    words = np.zeros((hi - lo + 63) // 64, np.uint64)
    for i in range(m):
        d = ids[i] - lo
        words[d >> 6] |= np.uint64(1) << np.uint64(d & 63)
    w = 0
    for k in range(words.shape[0]):
        x = words[k]
        while x != 0:
            out[w] = lo + 64 * k + trailing_zeros64(x)
            w += 1
            x &= x - np.uint64(1)  # clear the lowest set bit





@njit(cache=True)
def _shrink(est, ids, m, R):
    """Move the R largest of ``est[:m]`` (m > R; ties in any order) with their ids to the front; returns
    (R, the smallest of them).  A histogram of the estimates finds the bin holding the R-th largest and
    only that bin's members are sorted (numpy's partition costs ~10 ns an element)."""
    lo, hi = np.inf, -np.inf
    for i in range(m):
        lo = min(lo, est[i])
        hi = max(hi, est[i])
    if not (np.isfinite(lo) and np.isfinite(hi) and hi > lo and (hi - lo) < np.inf):
        thr = np.partition(est[:m], m - R)[m - R]  # infinite or equal estimates: the plain way
        w = 0
        for i in range(m):
            if est[i] > thr:
                est[w] = est[i]
                ids[w] = ids[i]
                w += 1
        for i in range(m):
            if w >= R:
                break
            if est[i] == thr:
                est[w] = est[i]
                ids[w] = ids[i]
                w += 1
        return w, thr
    nbins = min(4096, max(64, m // 4))
    inv = nbins / (hi - lo)
    counts = np.zeros(nbins, np.int64)
    for i in range(m):
        counts[min(int((est[i] - lo) * inv), nbins - 1)] += 1
    b = nbins - 1
    above = 0
    while above + counts[b] < R:
        above += counts[b]
        b -= 1
    need = R - above
    cand = np.empty(counts[b], np.float64)
    cid = np.empty(counts[b], np.int64)
    nc = 0
    w = 0
    for i in range(m):  # in place: w <= i
        k = min(int((est[i] - lo) * inv), nbins - 1)
        if k > b:
            est[w] = est[i]
            ids[w] = ids[i]
            w += 1
        elif k == b:
            cand[nc] = est[i]
            cid[nc] = ids[i]
            nc += 1
    sel = np.argsort(-cand)[:need]
    for i in range(need):
        est[w] = cand[sel[i]]
        ids[w] = cid[sel[i]]
        w += 1
    return w, cand[sel[need - 1]]


@njit(cache=True, fastmath=FASTMATH)
def rotate_query(rot, x, out):
    """``out`` (E,) float64 = ``rot`` (E, E) float64 @ ``x`` (E,) float32, in plain loops: Numba's ``@``
    calls BLAS (a matrix-vector product) from inside a parallel worker; this keeps BLAS and its thread pool
    out of the step."""
    E = x.shape[0]
    for i in range(E):
        s = 0.0
        for e in range(E):
            s += rot[i, e] * np.float64(x[e])
        out[i] = s


def _scan(q, qpos, rep, Qg, rot, cent, cscale, cptr, n_cent, rad, cw, fac, fine, fscale, pos, R, out, scanned, est,
          ids, tmp, fine_all):
    """Rows r = h * T + t of queries ``q`` (H, T, E) float32 at ``qpos`` (T,): ``out[r]`` (R2 slots, the
    best of a shortlist of ``R`` >= R2) and ``scanned[r]`` (keys estimated).  The ``rep`` query heads of a
    kv head go in groups of ``Qg`` (a divisor of ``rep``) scanned together.  ``cw``: the sign codes as
    (G, slots, W) uint64 words, ``fine`` the lower code planes (G, slots, 3 W), ``fscale`` (G, slots).
    ``est`` (P, Qg B) float64, ``ids`` (P, Qg B) int64 and ``tmp`` (P, C) float64: scratch of P workers
    (groups p, p + P, ...; every group costs the same), B > R (4 R + a segment: few cut-backs), C >= 1.
    ``fine_all``: one stage, every key estimated from its whole 4-bit code (``R`` = R2; for caches so small
    that the shortlist would be a large share of them and re-ranking it by scattered reads costs more)."""
    H, T, E = q.shape[0], q.shape[1], q.shape[2]
    n_sub = rep // Qg
    n_groups = (H // rep) * n_sub * T
    P = est.shape[0]
    R2 = out.shape[1]
    for p in prange(P):
        for k in range(p, n_groups, P):
            t = k % T
            gs = k // T
            g = gs // n_sub
            h0 = g * rep + (gs % n_sub) * Qg
            qs = np.empty((Qg, E), np.float32)
            qrs = np.empty((Qg, E), np.float64)
            qn = np.empty(Qg, np.float64)
            for j in range(Qg):
                qs[j] = q[h0 + j, t]
                rotate_query(rot, qs[j], qrs[j])
                qn[j] = np.sqrt(np.sum(qs[j].astype(np.float64) ** 2))
            outs = np.empty((Qg, R2), np.int64)
            sc = _scan_group(qs, qrs, qn, qpos[t], g, cent, cscale, cptr, n_cent[g], rad, cw, fac, fine, fscale,
                             pos, R, R2, outs, est[p], ids[p], tmp[p], fine_all)
            for j in range(Qg):
                out[(h0 + j) * T + t] = outs[j]
                scanned[(h0 + j) * T + t] = sc[j]


scan_serial, scan_parallel = serial_and_parallel(_scan)
