"""1-bit residual sketches of keys and the candidate scan of the decode cache's ``sketch`` routing.

A key ``k`` of a cluster with routing vector ``mu`` has the residual ``r = k - mu``.  With a fixed random
rotation ``P`` (E, E) orthogonal, the key's code is the signs of ``P r``, packed 8 per byte (bit ``i`` of
byte ``j`` is ``(P r)[8 j + i] >= 0``), plus one factor ``f = |P r|^2 / |P r|_1``.  For a query ``q``::

    q . k = q . mu + (P q) . (P r)  ~  q . mu + f * (P q) . s        (s = the signs as +-1)

exact when ``P r`` is parallel to its sign vector, an unbiased-direction estimate otherwise (RaBitQ's
estimator without its error bound).  The scan evaluates ``(P q) . s`` from one table per code byte of the
256 partial sums of its 8 rotated query components: 8 lookups a key at E = 64, E / 8 bytes read.

:func:`scan_rows` estimates every routed key of a row's kv head, cluster by cluster in order of the ball
bound ``q . mu + |q| rad`` (``rad``: the cluster's largest residual norm, so no member scores above it),
skips every cluster whose bound falls below the ``R``-th best estimate of the clusters scanned before it
(their keys cannot beat keys already found), and returns per row the ``R`` slots of largest estimate.
The caller reads those slots exactly (the decode kernel's ``MODE_LIST``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .intrinsics import prefetch_l2
from .options import FASTMATH, serial_and_parallel

__all__ = ["code_bytes", "encode_residuals", "scan_parallel", "scan_serial"]

AHEAD = 2  # clusters prefetched ahead of the one scanned


def code_bytes(E: int) -> int:
    """Bytes of one key's code: ceil(E / 8)."""
    return (E + 7) // 8


def encode_residuals(residuals: np.ndarray, rotation: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes of residuals (n, E) float (any finite magnitude; computed in float64).

    Returns
    -------
    codes : (n, ceil(E / 8)) uint8
        Signs of the rotated residuals, little-endian bit order within a byte.
    fac : (n,) float32
        ``|P r|^2 / |P r|_1`` (0 for a zero residual), the scale of the sign estimate.
    norm : (n,) float64
        ``|r|``, the residual norms (the caller's cluster radii).
    """
    r = np.asarray(residuals, np.float64)
    n, E = r.shape
    rr = r @ np.asarray(rotation, np.float64).T
    nb = code_bytes(E)
    bits = np.zeros((n, nb * 8), bool)
    bits[:, :E] = rr >= 0
    codes = np.packbits(bits, axis=1, bitorder="little")
    # |P r|^2 / |P r|_1 with both sums taken after dividing by the largest magnitude (no overflow at 1e300)
    big = np.abs(rr).max(axis=1) if E else np.zeros(n)
    safe = np.where(big > 0, big, 1.0)
    u = rr / safe[:, None]
    l1 = np.abs(u).sum(axis=1)
    fac = np.where(big > 0, (u * u).sum(axis=1) / np.where(l1 > 0, l1, 1.0) * big, 0.0)
    norm = np.sqrt((u * u).sum(axis=1)) * big
    with np.errstate(over="ignore"):
        return codes, np.minimum(fac, np.finfo(np.float32).max).astype(np.float32), norm


@njit(cache=True)
def _tables(qr, nb):
    """(nb, 256) float32: entry [j, v] = sum over the 8 bits i of byte value v of +-qr[8 j + i]."""
    lut = np.empty((nb, 256), np.float32)
    E = qr.shape[0]
    for j in range(nb):
        base = np.float32(0.0)
        for i in range(8):
            if 8 * j + i < E:
                base -= qr[8 * j + i]
        lut[j, 0] = base
        for v in range(1, 256):
            low = v & (-v)
            i = 0
            while (1 << i) != low:
                i += 1
            x = qr[8 * j + i] if 8 * j + i < E else np.float32(0.0)
            lut[j, v] = lut[j, v ^ low] + 2 * x
    return lut


@njit(cache=True, fastmath=FASTMATH)
def _scan_row(qi, qr, qnorm, qp, g, cent, cscale, cptr, nc, rad, codes, fac, pos, R, out, est, ids):
    """One row: writes the ``R`` slots of largest estimate (ascending, -1 padded) to ``out``; returns the
    keys whose codes were scanned.  ``est`` / ``ids``: a buffer of B >= 2 R + the largest cluster entries
    (reused across rows) holding the keys whose estimate beats ``theta``, the R-th best estimate kept so
    far; before a cluster that might not fit it is cut back to its best R and ``theta`` rises, so most
    keys are written to a small, cache-resident buffer and passed over."""
    E = qi.shape[0]
    nb = codes.shape[2]
    B = est.shape[0]
    lut = _tables(qr, nb)
    base = np.empty(nc, np.float64)
    ub = np.empty(nc, np.float64)
    for c in range(nc):
        s = 0.0
        for e in range(E):
            s += np.float64(cent[g, c, e]) * np.float64(qi[e])
        base[c] = s * np.float64(cscale[g, c])
        ub[c] = base[c] + qnorm * rad[g, c]
    order = np.argsort(-ub)
    cg = codes[g]
    fg = fac[g]
    pg = pos[g]
    big = 0
    for c in range(nc):
        big = max(big, cptr[g, c + 1] - cptr[g, c])
    tmp = np.empty(big, np.float64)
    early = cptr[g, nc] - cptr[g, 0] > 8 * R  # worth a threshold early (to skip clusters) only on long caches
    m = 0  # keys kept in the buffer
    scanned = 0
    theta = -np.inf  # the R-th best estimate kept (a lower bound of the final R-th best)
    for oi in range(nc):
        c = order[oi]
        if ub[c] < theta:
            break  # bounds are sorted: no later cluster holds a key above theta
        b0 = base[c]
        a = cptr[g, c]
        b = cptr[g, c + 1]
        scanned += b - a
        if m + (b - a) > B or (early and m >= 2 * R and theta == -np.inf):
            m, theta = _shrink(est, ids, m, R)
        if oi + AHEAD < nc:  # clusters come in bound order, not slot order: fetch one AHEAD clusters on
            c2 = order[oi + AHEAD]
            a2 = cptr[g, c2]
            n2 = cptr[g, c2 + 1] - a2
            for off in range(0, n2 * nb, 64):
                prefetch_l2(cg, a2, off)
            for off in range(0, n2 * 4, 64):
                prefetch_l2(fac, g, 4 * a2 + off)
                prefetch_l2(pos, g, 4 * a2 + off)
        # estimates first (independent iterations that pipeline), then the filter: folding the filter into
        # the same loop chains each key's lookups into the next key's write position (~2.5x slower)
        if nb == 8:  # E = 64: a fixed trip count the compiler unrolls (~1.6x)
            for j in range(a, b):
                t = np.float32(0.0)
                for k in range(8):
                    t += lut[k, cg[j, k]]
                tmp[j - a] = b0 + np.float64(fg[j]) * np.float64(t)
        else:
            for j in range(a, b):
                t = np.float32(0.0)
                for k in range(nb):
                    t += lut[k, cg[j, k]]
                tmp[j - a] = b0 + np.float64(fg[j]) * np.float64(t)
        for j in range(a, b):
            x = tmp[j - a]
            if x > theta and pg[j] <= qp:  # not a future key, nor evicted (its position is the largest int32)
                est[m] = x
                ids[m] = j
                m += 1
    if m > R:
        m, theta = _shrink(est, ids, m, R)
    _ascending(ids, m, cptr[g, 0], cptr[g, nc], out)
    for i in range(m, R):
        out[i] = -1
    return scanned


_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_POS = np.array([((((1 << i) * 0x03F79D71B4CB0A89) & (2**64 - 1)) >> 58) for i in range(64)], np.int64)
_BIT_OF = np.empty(64, np.int64)
_BIT_OF[_DEBRUIJN_POS] = np.arange(64)


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
            low = x & (~x + np.uint64(1))  # the lowest set bit
            out[w] = lo + 64 * k + _BIT_OF[np.int64((low * _DEBRUIJN) >> np.uint64(58))]
            w += 1
            x ^= low





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


def _scan(q, qpos, rep, rot, cent, cscale, cptr, n_cent, rad, codes, fac, pos, R, out, scanned, est, ids):
    """Rows r = h * T + t of queries ``q`` (H, T, E) float32 at ``qpos`` (T,): ``out[r]`` (R slots) and
    ``scanned[r]`` (keys estimated).  ``est`` (P, B) float64 and ``ids`` (P, B) int64: scratch of P workers
    (rows p, p + P, ...; every row costs the same), B >= 2 R + the largest cluster."""
    H, T = q.shape[0], q.shape[1]
    P = est.shape[0]
    for p in prange(P):
        for r in range(p, H * T, P):
            h = r // T
            t = r - h * T
            g = h // rep
            qi = q[h, t]
            qr = (rot @ qi.astype(np.float64)).astype(np.float32)
            qn = np.sqrt(np.sum(qi.astype(np.float64) ** 2))
            scanned[r] = _scan_row(qi, qr, qn, qpos[t], g, cent, cscale, cptr, n_cent[g], rad, codes, fac, pos,
                                   R, out[r], est[p], ids[p])


scan_serial, scan_parallel = serial_and_parallel(_scan)
