"""Numba kernels of cluster-statistics estimation (``sparseattn.attention.routed``, ``estimate`` / ``top_p``).

A cluster c of keys is summarised by its count ``n_c``, the sum of its (centred) keys, the sum of their
squared norms and the sum of its values.  From these, for a query q and score scale s:

* the log of its softmax numerator sum (its *log mass*) is estimated as
  ``a_c = log n_c + s q.mu_c + spread * s^2 |q|^2 sigma_c^2 / 2`` (mu_c: mean key; sigma_c^2: mean
  per-dimension variance of the keys, ``(sum |k|^2 / n - |mu|^2) / E``).  ``spread = 1`` is the
  second-order (Gaussian, isotropic) correction: ``E[exp(s q.k)] = exp(s q.mu + s^2 q^T Sigma q / 2)``,
  since the exp of the mean under-estimates the mean of the exp;
* its weighted value sum as ``exp(a_c) vbar_c`` plus, in :mod:`sparseattn.attention.routed`, the linear
  term ``exp(a_c) s f_c sigma_c^2 B q`` (``B``: the pooled within-cluster regression of values on keys),
  from the per-row ``sum_c w_c f_c sigma_c^2`` these kernels return.

The second-order term is capped (:func:`second_order`): with ``x = s^2 q^T Sigma_c q / 2`` and ``l = log
n_c``, the correction is ``x`` while ``x <= l`` and ``2 sqrt(x l) - l`` beyond (the log-mean-exp of n
Gaussian samples: past ``x = l`` the sample holds no key far enough out in the tail to realise
``exp(x)``, and the sum is carried by its largest term, about ``sqrt(2 x) sqrt(2 l)`` above the mean),
and never more than ``|s| |q| rmu_c`` (``rmu_c``: the largest distance of a member key to the cluster's
mean), so an estimated cluster never claims more mass than ``n_c exp(max score)`` its keys can hold.
Uncapped, the term grows as ``|q|^2``: for a query ten times a key of clustered data, an estimated
cluster can claim ``exp(200)`` times its true mass and swamp the exact part.  ``f_c`` is the derivative
of the capped term over ``x`` (1 below the knee, ``sqrt(l / x)`` beyond, smaller where the bound binds):
the tilt ``s f_c Sigma_c q`` of the mean key that the same cap implies.

The mass-driven budget (``top_p``, non-causal) uses a finer second-order term, ``s^2 q^T Sigma_c q / 2``
with each cluster's covariance as a rank-r part plus an isotropic rest (``log_mass_rows_cov``): the
isotropic ``|q|^2 sigma_c^2`` mis-states the spread along the query's direction (on the 16k MiniLM store,
median true / estimated mass 0.87-1.01 over the clusters a row routed, 1.01-1.04 over the rest), so the
routed share of the estimated mass ran above the true one.

The kernels here turn those statistics into per-row log masses (``log_mass_rows``, ``log_mass_rows_cov``,
``log_mass_causal``),
pick the clusters a mass-driven budget routes (``mass_route``) and sum the estimated clusters of each
row into one partial ``(o, s, m)`` (``estimate_rows``, ``estimate_rows_causal``) for the log-sum-exp
merge (:mod:`sparseattn.kernels.merge`).  Causal variants read *prefix* statistics: the sums over the
first j keys (in position order) of each cluster, so a query only counts the keys at or before it.

Serial and ``nogil``: called from the worker threads (:func:`sparseattn.threads.run_jobs`) on row chunks.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .intrinsics import LOG2E, pow2_f32
from .options import FASTMATH

__all__ = ["cluster_prefix", "cluster_sums", "estimate_rows", "estimate_rows_causal", "estimate_weights",
           "estimate_weights_stats", "log_mass_causal", "log_mass_rows", "log_mass_rows_cov", "mass_route",
           "routed_visible", "rows_sorted_desc", "second_order", "EST_CAP", "add_in_range", "column_range"]

#: Most an *estimated* cluster's log mass may exceed its first-order term ``log n_c + s q.mu_c``, which is
#: a lower bound of the true log mass (Jensen: the mean of exp is at least the exp of the mean).  So each
#: estimated cluster claims at most e^2 = 7.4 times its true mass, and an output's lse exceeds the true
#: lse by at most 2 (float rounding aside).  On the shipped MiniLM store at the model's scale the
#: second-order term stays below 2 (the cap changes no error there); at 2x and 4x that scale, where it
#: does not, the capped estimate's error was 5-40 % lower than with the term uncapped.  Routing by mass
#: (``top_p``) uses the term without this cap (:func:`second_order` only).
EST_CAP = 2.0


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def second_order(x, ell, hb):
    """The capped second-order log-mass term of a cluster and its derivative: (g, f).

    x: ``s^2 q^T Sigma_c q / 2`` (>= 0; the uncapped term); ell: ``log n_c`` (>= 0); hb: ``|s| |q|
    rmu_c``, an upper bound of ``max_j s q.(k_j - mu_c)`` over the cluster's keys.  Returns float64.
    ``g = x`` for ``x <= ell``, ``2 sqrt(x ell) - ell`` beyond (continuous, with a continuous derivative),
    then ``min(g, hb)``; ``f = dg/dx`` (1, ``sqrt(ell / x)``) and at most ``hb / (2 x)`` (the tilt ``s f
    Sigma q`` of the mean key then stays within ``rmu_c`` of the mean).
    """
    x = np.float64(x)
    x2 = x + x
    if not x > ell:
        g = x
        f = 1.0
    else:
        f = np.sqrt(ell / x)
        g = x2 * f - ell
    if g > hb:
        g = hb
    if x2 * f > hb:
        f = hb / x2
    return g, f


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _estimate_term(x, ell, hb):
    """:func:`second_order` at most :data:`EST_CAP`: (g, f) of an estimated cluster, f = 0 where the
    cap binds (the capped term is flat there: no tilt)."""
    g, f = second_order(x, ell, hb)
    if g >= EST_CAP:
        g = EST_CAP
        f = 0.0
    return g, f


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _estimate_term_f32(x, ell, hb):
    """:func:`_estimate_term` in float32 without branches (selects only: the loop over clusters
    vectorises).  x, ell, hb float32; returns float32 (g, f)."""
    one = np.float32(1.0)
    zero = np.float32(0.0)
    cap = np.float32(EST_CAP)
    knee = x > ell
    r = np.sqrt(ell / x)  # NaN / inf for x = 0: not selected
    f = r if knee else one
    g = (x + x) * r - ell if knee else x
    g = hb if hb < g else g
    fb = hb / (x + x)  # NaN for hb = x = 0: the comparison below is False, f stays
    f = fb if fb < f else f
    f = zero if g >= cap else f
    g = cap if g >= cap else g
    return g, f


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def cluster_sums(x, kptr):
    """Per cluster the float64 sum of its rows: x (S, D) in cluster order, kptr (C + 1,) -> (C, D)."""
    C = kptr.shape[0] - 1
    D = x.shape[1]
    out = np.zeros((C, D), dtype=np.float64)
    for c in prange(C):
        for j in range(kptr[c], kptr[c + 1]):
            for d in range(D):
                out[c, d] += x[j, d]
    return out


@njit(parallel=True, cache=True)
def cluster_prefix(x, kptr, order):
    """Per-cluster prefix sums, float64 (S + C, D): row ``kptr[c] + c + j`` sums the first j rows of
    cluster c (j = 0 .. n_c), taking the rows ``x[order[i]]`` for slots i of ``kptr[c]:kptr[c+1]``.

    Each cluster's sums restart at zero, so they involve only that cluster's rows (a causal query
    reading the visible prefix of a cluster reads nothing of a later key, not even through rounding).
    x (S, D); kptr (C + 1,) int64; order (S,) int64 (``arange(S)`` when the slots are already in order).
    """
    C = kptr.shape[0] - 1
    D = x.shape[1]
    out = np.empty((x.shape[0] + C, D), dtype=np.float64)
    for c in prange(C):
        base = kptr[c] + c
        acc = np.zeros(D, dtype=np.float64)
        for d in range(D):
            out[base, d] = 0.0
        for j in range(kptr[c + 1] - kptr[c]):
            row = x[order[kptr[c] + j]]
            for d in range(D):
                acc[d] += row[d]
                out[base + j + 1, d] = acc[d]
    return out


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def log_mass_rows(qmu, q2, logn, sig2, rmu, scale, spread, out):
    """``out[r, c] = logn[c] + scale * qmu[r, c] + g`` (-inf where logn is -inf), g the capped
    :func:`second_order` term of ``x = spread * q2[r] * sig2[c]``, at most :data:`EST_CAP` (the log masses
    of estimated clusters).

    qmu (R, C) q.mu_c; q2 (R,) float64 ``scale^2 |q|^2 / 2``; logn (C,) log counts (-inf: empty);
    sig2 (C,) variances; rmu (C,) largest member distance to the mean; out (R, C) float32 or float64.
    """
    R, C = qmu.shape
    for r in range(R):
        qn = np.sqrt(2.0 * q2[r])
        for c in range(C):
            if logn[c] == -np.inf:
                out[r, c] = -np.inf
            else:
                g = _estimate_term(spread * q2[r] * np.float64(sig2[c]), logn[c], qn * rmu[c])[0]
                out[r, c] = logn[c] + scale * np.float64(qmu[r, c]) + g


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def log_mass_rows_cov(qmu, qw, q2, logn, rho, rmu, scale, out):
    """Log masses with a low-rank-plus-isotropic key covariance per cluster (the ``top_p`` rule).

    ``out[r, c] = logn[c] + scale qmu[r, c] + g`` (-inf where logn is -inf), g the capped
    :func:`second_order` term of ``x = scale^2 / 2 (sum_k qw[r, c K + k]^2 + rho[c] |q_r|^2)``: the
    second-order estimate ``log sum_j exp(s q.k_j) ~= log n_c + s q.mu_c + s^2 q^T Sigma_c q / 2`` with
    ``Sigma_c ~= sum_k w_ck w_ck^T + rho_c I``
    (:meth:`~sparseattn.index.cluster.ClusterIndex.key_cov_factors`).

    qmu (R, C) q.mu_c; qw (R, C K) the products ``q . w_ck``; q2 (R,) float64 ``scale^2 |q|^2 / 2``;
    logn (C,) log counts (-inf: empty); rho (C,) isotropic remainders; rmu (C,) largest member distance
    to the mean; out (R, C) float32 or float64.
    """
    R, C = qmu.shape
    K = qw.shape[1] // C if C else 0
    h = 0.5 * scale * scale
    for r in range(R):
        qn = np.sqrt(2.0 * q2[r])
        for c in range(C):
            if logn[c] == -np.inf:
                out[r, c] = -np.inf
                continue
            acc = 0.0
            for k in range(K):
                x = np.float64(qw[r, c * K + k])
                acc += x * x
            g = second_order(h * acc + q2[r] * rho[c], logn[c], qn * rmu[c])[0]
            out[r, c] = logn[c] + scale * np.float64(qmu[r, c]) + g


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _visible(kpos_cs, a, b, lim):
    """Keys of kpos_cs[a:b] (ascending) at or before ``lim``: a binary search."""
    lo = a
    hi = b
    while lo < hi:
        mid = (lo + hi) // 2
        if kpos_cs[mid] <= lim:
            lo = mid + 1
        else:
            hi = mid
    return lo - a


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _pair_stats(qr, c, nv, kptr, Gk, Gk2, scale, spread, q2):
    """(log mass a, variance sigma^2) of the first nv keys of cluster c from the prefix tables."""
    base = kptr[c] + c
    E = Gk.shape[1]
    inv = 1.0 / nv
    dot = 0.0
    mu2 = 0.0
    for e in range(E):
        mu = (Gk[base + nv, e] - Gk[base, e]) * inv
        dot += qr[e] * mu
        mu2 += mu * mu
    var = ((Gk2[base + nv] - Gk2[base]) * inv - mu2) / E
    var = var if var > 0.0 else 0.0
    ell = np.log(nv)
    g = _estimate_term(spread * q2 * var, ell, np.inf)[0] if spread > 0.0 else 0.0
    return ell + scale * dot + g, var


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def log_mass_causal(q, qpos, kptr, kpos_cs, Gk, Gk2, scale, spread, out, nvis):
    """Log mass of every cluster's visible keys (``kpos <= qpos[r]``) for each row.

    q (R, E) float queries; qpos (R,) int64; kptr (C + 1,); kpos_cs (S,) int64 key positions, ascending
    inside each cluster; Gk (S + C, E) / Gk2 (S + C,) float64 per-cluster prefix sums of the centred keys
    and their squared norms in that order (:func:`cluster_prefix`).  Writes out (R, C) float32 (-inf: no visible
    key) and nvis (R, C) int64 visible keys.
    """
    R = q.shape[0]
    C = kptr.shape[0] - 1
    for r in range(R):
        qr = q[r]
        q2 = 0.0
        for e in range(qr.shape[0]):
            q2 += qr[e] * qr[e]
        q2 *= 0.5 * scale * scale
        for c in range(C):
            nv = _visible(kpos_cs, kptr[c], kptr[c + 1], qpos[r])
            nvis[r, c] = nv
            if nv == 0:
                out[r, c] = -np.inf
            else:
                out[r, c] = _pair_stats(qr, c, nv, kptr, Gk, Gk2, scale, spread, q2)[0]


@njit(cache=True, nogil=True)
def rows_sorted_desc(A, out):
    """out[r] = the columns of A[r] by decreasing value (stable: lower column first on ties); int32.

    A (R, C) float (no NaN), out (R, C) int32.  The full order, for causal mass routing, where a
    cluster's visible size depends on the row and no bound on the candidates needed is known.
    """
    R = A.shape[0]
    for r in range(R):
        out[r] = np.argsort(-A[r], kind="mergesort").astype(np.int32)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def mass_route(A, cand, sizes, top_p, margin, min_keys, max_keys, n_est, dummy, route, n_route, keys, est):
    """Mass-driven routing of each row: clusters in order of estimated mass until the mass reaches top_p.

    A (R, C) float32 log masses (-inf: nothing visible); cand (R, K) int32 the K clusters of largest A,
    best first; sizes (R, C) int64 keys each cluster holds for the row (its visible keys when causal).
    Walking ``cand``: a cluster is routed unless routing it would pass ``max_keys``, which ends the walk
    (except the row's first cluster, routed whatever its size: a row never reads nothing because its best
    cluster is larger than the cap);
    the walk also ends at the first cluster with A = -inf, and once the routed estimated mass m_in
    reaches ``top_p`` of ``m_in + margin * m_out`` (m_out: the estimated mass not routed; ``margin >= 1``
    counts it larger, a safety factor against its estimation error) with at least ``min_keys`` keys read
    (``top_p >= 1``: never ends on mass).  Writes route (R, P) int32 (unused slots: ``dummy``, an empty cluster), n_route (R,) and keys
    (R,) int64 keys read, and est (R, n_est) int32: the next n_est candidates after the routed ones
    (-1 padded).
    """
    R, C = A.shape
    K = cand.shape[1]
    P = route.shape[1]
    for r in range(R):
        a = A[r]
        M = a[cand[r, 0]]
        tot = 0.0
        if M > -np.inf:
            for c in range(C):
                tot += np.exp(a[c] - M)
        cum = 0.0
        nk = 0
        t = 0
        nr = 0
        while t < K and nr < P:
            c = cand[r, t]
            if a[c] == -np.inf:
                break
            if top_p < 1.0 and cum >= top_p * (cum + margin * (tot - cum)) and nk >= min_keys:
                break
            if nr > 0 and nk + sizes[r, c] > max_keys:
                break
            route[r, nr] = c
            nr += 1
            nk += sizes[r, c]
            cum += np.exp(a[c] - M)
            t += 1
        n_route[r] = nr
        keys[r] = nk
        for u in range(nr, P):
            route[r, u] = dummy
        for u in range(n_est):
            tt = t + u
            est[r, u] = cand[r, tt] if tt < K and a[cand[r, tt]] > -np.inf else -1


@njit(cache=True, nogil=True, inline="always")
def _mark_routed(skip, route_r, C, flag):
    """skip[c] = flag for every routed cluster c of one row (ids >= C: padding)."""
    for t in range(route_r.shape[0]):
        if route_r[t] < C:
            skip[route_r[t]] = flag


@njit(cache=True, nogil=True, inline="always")
def _finish_row(r, tot, M, tw2, s, m, ws2, all_rest, skip, route_r, C):
    """Write row r's sum, shift and variance term (s, m, ws2) and, for ``all_rest``, clear the row's routed
    marks from ``skip`` (set by :func:`_mark_routed` at the row's start)."""
    s[r] = tot
    m[r] = M
    ws2[r] = tw2
    if all_rest:
        _mark_routed(skip, route_r, C, False)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def estimate_rows(A, route, est, all_rest, vbar, sig2, ell, rmu, q2, o, s, m, ws2):
    """One estimated partial per row from whole-cluster statistics (non-causal).

    A (R, C) float32 log masses; route (R, P) int32 routed clusters (ids >= C: padding); est (R, N) int32
    estimated clusters (-1: none), or ``all_rest``: every cluster not routed.  vbar (C, Ev) float64 mean
    values, sig2 (C,) variances, ell (C,) ``log n_c`` (0 for an empty cluster), rmu (C,) largest member
    distance to the mean, q2 (R,) ``scale^2 |q|^2 / 2``.  Writes o (R, Ev) ``sum_c w_c vbar_c``, s (R,)
    ``sum_c w_c``, m (R,) the shift (``w_c = exp(A[r, c] - m)``; ``m = -inf`` and s = 0 for a row with
    nothing estimated) and ws2 (R,) ``sum_c w_c f_c sig2_c`` (f_c: :func:`second_order` of the isotropic
    ``q2 sig2_c``; 0 where the term reaches :data:`EST_CAP`).
    """
    R, C = A.shape
    N = est.shape[1]
    Ev = vbar.shape[1]
    skip = np.zeros(C + 1, dtype=np.bool_)
    for r in range(R):
        a = A[r]
        qn = np.sqrt(2.0 * q2[r])
        if all_rest:
            _mark_routed(skip, route[r], C, True)
        M = -np.inf
        n_items = C if all_rest else N
        for t in range(n_items):
            c = t if all_rest else est[r, t]
            if c < 0 or (all_rest and skip[c]):
                continue
            if a[c] > M:
                M = a[c]
        orow = o[r]
        for e in range(Ev):
            orow[e] = 0.0
        tot = 0.0
        tw2 = 0.0
        if M > -np.inf:
            for t in range(n_items):
                c = t if all_rest else est[r, t]
                if c < 0 or (all_rest and skip[c]) or a[c] == -np.inf:
                    continue
                w = np.exp(a[c] - M)
                tot += w
                tw2 += w * sig2[c] * _estimate_term(q2[r] * sig2[c], ell[c], qn * rmu[c])[1]
                vb = vbar[c]
                for e in range(Ev):
                    orow[e] += w * vb[e]
        _finish_row(r, tot, M, tw2, s, m, ws2, all_rest, skip, route[r], C)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def estimate_rows_causal(q, qpos, route, est, all_rest, kptr, kpos_cs, Gk, Gk2, Gv, scale, spread, o, s, m,
                         ws2):
    """One estimated partial per row from the *visible* part of each estimated cluster (causal).

    Like :func:`estimate_rows`, but each estimated cluster only counts its keys with ``kpos <=
    qpos[r]``, read from prefix tables (see :func:`log_mass_causal`; Gv (S + C, Ev) float64 prefix sums
    of the values in the same order).  q (R, E) float.  A single pass with a running shift.
    """
    R, E = q.shape
    C = kptr.shape[0] - 1
    N = est.shape[1]
    Ev = Gv.shape[1]
    skip = np.zeros(C + 1, dtype=np.bool_)
    for r in range(R):
        qr = q[r]
        q2 = 0.0
        for e in range(E):
            q2 += qr[e] * qr[e]
        q2 *= 0.5 * scale * scale
        if all_rest:
            _mark_routed(skip, route[r], C, True)
        orow = o[r]
        for e in range(Ev):
            orow[e] = 0.0
        M = -np.inf
        tot = 0.0
        tw2 = 0.0
        n_items = C if all_rest else N
        for t in range(n_items):
            c = t if all_rest else est[r, t]
            if c < 0 or (all_rest and skip[c]):
                continue
            nv = _visible(kpos_cs, kptr[c], kptr[c + 1], qpos[r])
            if nv == 0:
                continue
            a, var = _pair_stats(qr, c, nv, kptr, Gk, Gk2, scale, spread, q2)
            if a > M:  # rescale what was summed so far to the new shift
                f = np.exp(M - a) if M > -np.inf else 0.0
                tot *= f
                tw2 *= f
                for e in range(Ev):
                    orow[e] *= f
                M = a
            w = np.exp(a - M)
            inv = w / nv
            base = kptr[c] + c
            tot += w
            tw2 += w * var
            for e in range(Ev):
                orow[e] += inv * (Gv[base + nv, e] - Gv[base, e])
        _finish_row(r, tot, M, tw2, s, m, ws2, all_rest, skip, route[r], C)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def column_range(x, lo, hi):
    """lo[d], hi[d] = the minimum and maximum of column d of x (S, D), S >= 1, one pass over the rows."""
    for d in range(x.shape[1]):
        lo[d] = x[0, d]
        hi[d] = x[0, d]
    for j in range(1, x.shape[0]):
        row = x[j]
        for d in range(x.shape[1]):
            v = row[d]
            lo[d] = v if v < lo[d] else lo[d]
            hi[d] = v if v > hi[d] else hi[d]


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def add_in_range(base, reg, s, lo, hi):
    """``base[r] += lam_r reg[r]`` with lam_r in [0, 1] the largest keeping ``base[r] / s[r]`` inside
    ``[lo, hi]`` in every column.

    base (R, D) an estimated partial's ``sum_c w_c vbar_c`` (``base / s``, a convex combination of cluster
    mean values, lies inside the values' per-column range [lo, hi]); reg (R, D) its regression term; s
    (R,) float64 ``sum_c w_c`` (> 0, or 0 with base = reg = 0); lo, hi (D,) in base's dtype.  The linear
    term grows with ``|q|``: unshrunk, it can carry the estimate, and the merged output, outside every value.
    """
    R, D = base.shape
    for r in range(R):
        sr = base.dtype.type(s[r])
        b = base[r]
        g = reg[r]
        n_out = 0
        for d in range(D):  # the common case: the whole term fits (a vectorised test, no division)
            y = b[d] + g[d]
            n_out += (y > hi[d] * sr) | (y < lo[d] * sr)
        if n_out == 0:
            for d in range(D):
                b[d] += g[d]
            continue
        lam = 1.0
        for d in range(D):
            room = (hi[d] * sr - b[d]) if g[d] > 0 else (lo[d] * sr - b[d])
            t = room / g[d]  # inf / NaN where g = 0: never below lam
            lam = t if t < lam else lam
        lam = lam if lam > 0.0 else 0.0
        lt = base.dtype.type(lam)
        for d in range(D):
            b[d] += lt * g[d]


@njit(cache=True, nogil=True)
def routed_visible(route, qpos, kptr, kpos_cs, causal, out):
    """Keys each row reads: ``out[r] = sum`` over its routed clusters (ids >= C: padding, skipped) of the
    cluster's keys, only those with ``kpos <= qpos[r]`` when ``causal`` (kpos_cs ascending inside each
    cluster).  route (R, P) int32, qpos (R,) int64, out (R,) int64."""
    R, P = route.shape
    C = kptr.shape[0] - 1
    for r in range(R):
        tot = 0
        for t in range(P):
            c = route[r, t]
            if c < C:
                if causal:
                    tot += _visible(kpos_cs, kptr[c], kptr[c + 1], qpos[r])
                else:
                    tot += kptr[c + 1] - kptr[c]
        out[r] = tot


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _weights_row(a, w, route_r, sig2, r, s, m, ws2):
    """Row ``r`` of :func:`estimate_weights`: ``a`` (C,) float32 log masses (set to -inf at the routed
    clusters ``route_r``, ids >= C: padding) -> ``w`` (C,) weights (``w`` may be ``a`` itself), s[r],
    m[r], ws2[r] (``sum_c w_c sig2[c]``: sig2 the row's tilt-scaled variances ``f_c sigma_c^2``)."""
    C = a.shape[0]
    lo = np.float32(-80.0 * 1.4426950408889634)
    ninf = np.float32(-np.inf)
    zero = np.float32(0.0)
    for t in range(route_r.shape[0]):
        c = route_r[t]
        if c < C:
            a[c] = ninf
    M = ninf
    for c in range(C):
        M = a[c] if a[c] > M else M
    if M == ninf:
        for c in range(C):
            w[c] = zero
        s[r] = 0.0
        m[r] = -np.inf
        ws2[r] = 0.0
        return
    tot = zero
    t2 = zero
    for c in range(C):
        x = (a[c] - M) * LOG2E
        x = x if x > lo else lo
        e = pow2_f32(x)
        e = e if a[c] > ninf else zero
        w[c] = e
        tot += e
        t2 += e * sig2[c]
    s[r] = tot
    m[r] = M
    ws2[r] = t2


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def estimate_weights(A, route, sig2, ell, rmu, q2, W, s, m, ws2):
    """Weights of the estimate of every cluster not routed (non-causal, ``estimate=-1``), for one GEMM.

    A (R, C) float32 log masses, overwritten with -inf at the routed clusters; route (R, P) int32 (ids
    >= C: padding); sig2 (C,) float32 variances; ell (C,) ``log n_c`` (0: empty), rmu (C,) largest
    member distance to the mean, q2 (R,) ``scale^2 |q|^2 / 2``.  Writes W (R, C) float32 ``exp(A[r, c] -
    m[r])`` (0 for routed and empty clusters, at least exp(-80) otherwise), s (R,) row sums, m (R,) the
    shift (``-inf`` and s = 0 when nothing is left) and ws2 (R,) ``sum_c W[r, c] f_c sig2[c]`` (f_c:
    :func:`second_order` of the isotropic ``q2 sig2_c``, 0 where the term reaches :data:`EST_CAP`); the
    caller's ``W @ vbar`` is
    the estimated partial's output.  Why not :func:`estimate_rows`: each pass here is a branch-free loop
    over contiguous columns that vectorises, with a float32 exp
    (:func:`~sparseattn.kernels.intrinsics.pow2_f32`, relative error 2.5e-7), and the value sum is a
    BLAS product (measured at 2,048 rows, C = 128, Ev = 32: 8.3 ms for the per-cluster loop with a
    scalar exp, under 1 ms here).
    """
    C = A.shape[1]
    tilt = np.empty(C, dtype=np.float32)
    cap = np.float32(EST_CAP)
    for r in range(A.shape[0]):
        h = np.float32(q2[r])
        qn = np.float32(np.sqrt(2.0 * q2[r]))
        n_cap = 0
        for c in range(C):
            x = h * sig2[c]
            tilt[c] = sig2[c]
            n_cap += (x > ell[c]) | (x >= cap) | (x + x > qn * rmu[c])
        if n_cap:
            for c in range(C):
                tilt[c] = sig2[c] * _estimate_term_f32(h * sig2[c], ell[c], qn * rmu[c])[1]
        _weights_row(A[r], W[r], route[r], tilt, r, s, m, ws2)


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def estimate_weights_stats(qmu, q2, logn, sig2, ell, rmu, scale, route, W, s, m, ws2):
    """:func:`estimate_weights` straight from the statistics (non-causal, fixed budget, ``estimate=-1``).

    The log masses ``logn[c] + scale qmu[r, c] + g`` (g: the capped :func:`second_order` term of
    ``q2[r] sig2[c]``, at most :data:`EST_CAP`, as :func:`log_mass_rows` with spread 1) are formed in
    ``W`` itself and turned into the weights in the same pass over the row (no (R, C) log-mass array is written and read back).  qmu
    (R, C) float32 q.mu_c; q2 (R,) float64 ``scale^2 |q|^2 / 2``; logn, sig2, ell, rmu (C,) float32
    (logn -inf: empty; ell ``log n_c``, 0 when empty; rmu largest member distance to the mean); route
    (R, P) int32 (ids >= C: padding).  Writes W (R, C) float32, s, m, ws2 (R,) float64 as
    :func:`estimate_weights`.
    """
    R, C = qmu.shape
    sc = np.float32(scale)
    cap = np.float32(EST_CAP)
    tilt = np.empty(C, dtype=np.float32)
    for r in range(R):
        w = W[r]
        qm = qmu[r]
        h = np.float32(q2[r])
        qn = np.float32(np.sqrt(2.0 * q2[r]))
        n_cap = 0
        for c in range(C):  # the term uncapped, counting the clusters where a cap binds (vectorises)
            x = h * sig2[c]
            w[c] = logn[c] + sc * qm[c] + x
            tilt[c] = sig2[c]
            n_cap += (x > ell[c]) | (x >= cap) | (x + x > qn * rmu[c])
        if n_cap:
            for c in range(C):
                g, f = _estimate_term_f32(h * sig2[c], ell[c], qn * rmu[c])
                w[c] = logn[c] + sc * qm[c] + g
                tilt[c] = sig2[c] * f
        _weights_row(w, w, route[r], tilt, r, s, m, ws2)
