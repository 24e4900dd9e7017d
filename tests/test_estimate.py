"""Estimation of unread clusters (``estimate``) and the mass-driven budget (``top_p``) of routed attention.

Oracle: dense softmax attention in float64 numpy (optionally masked), and brute-force key counts.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from helpers import dense64
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import get_selector
from sparseattn.attention.routed import mass_routes, routed_attention
from sparseattn.index import ClusterIndex
from sparseattn.kernels import cluster as ck
from sparseattn.kernels import estimate as ek
from sparseattn.threads import worker_threads


def _clustered(seed: int = 3, S: int = 1500, L: int = 200, E: int = 12, Ev: int = 6, n_cent: int = 24,
               spread: float = 0.6, dtype=np.float32):
    rng = np.random.default_rng(seed)
    cent = rng.standard_normal((n_cent, E)) * 1.2
    k = cent[rng.integers(0, n_cent, S)] + spread * rng.standard_normal((S, E))
    q = cent[rng.integers(0, n_cent, L)] + spread * rng.standard_normal((L, E))
    v = 0.3 * k @ rng.standard_normal((E, Ev)) + rng.standard_normal((S, Ev))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)




def _err(o, ref):
    return float(np.mean(np.linalg.norm(o.astype(np.float64) - ref, axis=1) / np.linalg.norm(ref, axis=1)))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-5), (np.float64, 1e-11)])
def test_every_cluster_routed_is_exact(is_causal, dtype, tol):
    """n_probe = C leaves nothing to estimate; top_p = 1 (no cap) routes every cluster: dense attention."""
    q, k, v = _clustered(dtype=dtype, L=150, S=900)
    qpos = np.arange(150) * 6
    mask = np.arange(900)[None, :] <= qpos[:, None] if is_causal else None
    ref, ref_lse = dense64(q, k, v, 0.4, mask)
    full = ClusterIndex(n_clusters=12, n_probe=12).build(k)
    out, lse = routed_attention(full, q, v, scale=0.4, is_causal=is_causal, query_positions=qpos, estimate=-1)
    np.testing.assert_allclose(out, ref, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)
    index = ClusterIndex(n_clusters=12, n_probe=2).build(k)
    st_: dict = {}
    out, lse = routed_attention(index, q, v, scale=0.4, is_causal=is_causal, query_positions=qpos, top_p=1.0,
                                max_keys=900, estimate=-1, stats=st_)
    np.testing.assert_allclose(out, ref, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)
    visible = (qpos + 1).clip(max=900) if is_causal else np.full(150, 900)
    np.testing.assert_array_equal(st_["keys_read"], visible)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), L=st.integers(1, 40), E=st.integers(1, 9), C=st.integers(1, 9),
       scale=st.floats(0.01, 3.0), mag=st.floats(0.1, 5.0))
def test_estimate_with_all_clusters_routed_matches_dense_any_shape(seed, L, E, C, scale, mag):
    rng = np.random.default_rng(seed)
    S = 60
    k = mag * rng.standard_normal((S, E))
    q = mag * rng.standard_normal((L, E))
    v = rng.standard_normal((S, 3))
    index = ClusterIndex(n_clusters=C, n_probe=C).build(k)
    out, lse = routed_attention(index, q, v, scale=scale, estimate=-1)
    ref, ref_lse = dense64(q, k, v, scale)
    np.testing.assert_allclose(out, ref, atol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("is_causal", [False, True])
def test_estimation_lowers_error_at_equal_routed_clusters_clustered(is_causal):
    q, k, v = _clustered(S=3000, L=300, spread=0.8)
    qpos = np.arange(300) * 10
    mask = np.arange(3000)[None, :] <= qpos[:, None] if is_causal else None
    ref, _ = dense64(q, k, v, 0.35, mask)
    index = ClusterIndex(n_clusters=40, n_probe=4).build(k)
    errs = {}
    for est in (0, 6, -1):
        s: dict = {}
        out, _ = routed_attention(index, q, v, scale=0.35, is_causal=is_causal, query_positions=qpos,
                                  estimate=est, stats=s)
        errs[est] = (_err(out, ref), s["keys_read"])
    np.testing.assert_array_equal(errs[0][1], errs[-1][1])  # estimation reads no extra key exactly
    assert errs[6][0] < errs[0][0]
    assert errs[-1][0] < 0.5 * errs[0][0], errs


def test_estimation_lowers_error_on_real_keys():
    sa_data = pytest.importorskip("sparseattn.data")
    try:
        t = sa_data.load("store", head=0, dtype=np.float32)
    except (FileNotFoundError, ValueError) as exc:  # pragma: no cover - data directory missing
        pytest.skip(f"shipped store fixture unavailable: {exc}")
    q, k, v = t.q[:256], t.k[:4096], t.v[:4096]
    ref, _ = dense64(q, k, v, t.scale)
    index = ClusterIndex(n_probe=6).build(k)
    off, _ = routed_attention(index, q, v, scale=t.scale)
    on, _ = routed_attention(index, q, v, scale=t.scale, estimate=-1)
    assert _err(on, ref) < 0.5 * _err(off, ref)


@pytest.mark.parametrize("kw", [{"estimate": -1}, {"estimate": 3}, {"top_p": 0.6, "estimate": -1}])
def test_causal_rows_never_read_future_keys_statistics(kw):
    """Future keys and values x50 (index clustering kept, statistics recomputed): past rows unchanged."""
    q, k, v = _clustered(S=1200, L=160, dtype=np.float64)
    qpos = np.arange(160) * 7 + 3
    t = 600
    index = ClusterIndex(n_clusters=16, n_probe=3).build(k)
    base, base_lse = routed_attention(index, q, v, scale=0.5, is_causal=True, query_positions=qpos,
                                      exact_prefix=False, **kw)
    other = copy.deepcopy(index)
    future = index.perm_ > t  # default key positions: id = position
    kp = other.keys_perm_.copy()
    kp[future] *= 50.0
    other.keys_perm_ = kp
    other._keys_cast = {kp.dtype: kp}
    other._init_stats(kp)
    # the score bounds must hold for the new keys (only the shifts change: rounding-level differences)
    other.radius_ = ck.cluster_radius(kp, other.cluster_ptr_, other.centroids_)
    v2 = v.copy()
    v2[t + 1:] *= 50.0
    out, lse = routed_attention(other, q, v2, scale=0.5, is_causal=True, query_positions=qpos, exact_prefix=False,
                                **kw)
    past = qpos <= t
    assert past.sum() > 50 and not np.allclose(out[~past], base[~past])
    np.testing.assert_allclose(out[past], base[past], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse[past], base_lse[past], rtol=1e-10, atol=1e-10)


def test_keys_read_matches_routed_clusters():
    q, k, v = _clustered()
    index = ClusterIndex(n_clusters=20, n_probe=3).build(k)
    ids, _ = index.route(q)
    sizes = np.diff(index.cluster_ptr_)
    for est in (0, -1):
        s: dict = {}
        routed_attention(index, q, v, estimate=est, stats=s)
        np.testing.assert_array_equal(s["keys_read"], sizes[ids].sum(axis=1))
    qpos = np.arange(q.shape[0]) * 8
    s = {}
    routed_attention(index, q, v, is_causal=True, query_positions=qpos, exact_prefix=False, stats=s)
    # causal routing: a cluster whose first key (position = key id) is after the row ranks last
    first = np.array([np.flatnonzero(index.assignment_ == c).min(initial=k.shape[0]) for c in range(20)])
    first[first == k.shape[0]] = 0  # an empty cluster: visible to every row (it holds nothing to read)
    with worker_threads(1):
        ids = index.route_rows(index.validated_queries(q, True), 1, first, qpos.astype(np.int64))[0]
    assert all((first[ids[i]] <= qpos[i]).all() or (first <= qpos[i]).sum() < 3 for i in range(q.shape[0]))
    brute = [sum(int(np.sum(np.flatnonzero(index.assignment_ == c) <= qpos[i])) for c in ids[i])
             for i in range(q.shape[0])]
    np.testing.assert_array_equal(s["keys_read"], brute)


@pytest.mark.parametrize("is_causal", [False, True])
def test_top_p_keys_read_bounds(is_causal):
    q, k, v = _clustered(S=2000, L=200)
    qpos = np.arange(200) * 10
    index = ClusterIndex(n_clusters=30, n_probe=4).build(k)
    sizes = np.diff(index.cluster_ptr_)
    for lo, hi in ((0, 150), (300, 2000), (200, 400)):
        s: dict = {}
        routed_attention(index, q, v, is_causal=is_causal, query_positions=qpos, exact_prefix=False, top_p=0.3,
                         min_keys=lo, max_keys=hi, estimate=-1, stats=s)
        kr = s["keys_read"]
        over = kr > hi  # allowed only for a row whose best cluster alone exceeds the cap: it reads just that one
        assert np.isin(kr[over], sizes[sizes > hi]).all(), (hi, kr[over])
        visible = np.minimum(qpos + 1, 2000) if is_causal else np.full(200, 2000)
        # the floor holds unless the row sees fewer keys or the cap stopped it (within one cluster of it)
        short = kr < np.minimum(lo, visible)
        assert np.all(kr[short] > hi - sizes.max())
        if hi == 2000:
            assert not short.any()


def test_top_p_reads_more_keys_for_flat_rows():
    q, k, v = _clustered(S=2000, L=200, spread=0.5)
    index = ClusterIndex(n_clusters=30, n_probe=4).build(k)
    peaky, flat = {}, {}
    routed_attention(index, q * 4.0, v, top_p=0.9, max_keys=2000, stats=peaky)
    routed_attention(index, q * 0.05, v, top_p=0.9, max_keys=2000, stats=flat)
    assert peaky["keys_read"].mean() < 0.5 * flat["keys_read"].mean()
    # more top_p, more keys (the walk over the same mass order only goes further)
    a, b = {}, {}
    routed_attention(index, q, v, top_p=0.5, max_keys=2000, stats=a)
    routed_attention(index, q, v, top_p=0.95, max_keys=2000, stats=b)
    assert np.all(a["keys_read"] <= b["keys_read"]) and a["keys_read"].mean() < b["keys_read"].mean()


def test_stats_update_incrementally():
    _, k, _ = _clustered(dtype=np.float64)
    index = ClusterIndex(n_clusters=10, n_probe=2).build(k)
    logn, mu, var = index.key_stats()
    kc = k - index.mean_
    for c in range(10):  # brute force per cluster
        members = kc[index.assignment_ == c]
        np.testing.assert_allclose(mu[c], members.mean(axis=0), atol=1e-12)
        np.testing.assert_allclose(var[c], members.var(axis=0).mean(), rtol=1e-9, atol=1e-12)
        assert logn[c] == np.log(len(members))
    grown = copy.deepcopy(index)
    grown.count_[:] = 0
    grown.key_sum_[:] = 0
    grown.key_sqsum_[:] = 0
    half = k.shape[0] // 2
    grown.update_stats(k[:half], index.assignment_[:half])
    grown.update_stats(k[half:], index.assignment_[half:])
    np.testing.assert_array_equal(grown.count_, index.count_)
    np.testing.assert_allclose(grown.key_sum_, index.key_sum_, rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(grown.key_sqsum_, index.key_sqsum_, rtol=1e-10)
    with pytest.raises(ValueError, match=r"assignment values must lie in \[0, 10\)"):
        index.update_stats(k[:2], np.array([0, 10]))
    with pytest.raises(ValueError, match="keys must have shape"):
        index.update_stats(k[:2, :3], np.array([0, 1]))


def test_argument_errors():
    q, k, v = _clustered(L=5)
    index = ClusterIndex(n_clusters=8, n_probe=2).build(k)
    with pytest.raises(ValueError, match="estimate must be an int >= -1"):
        routed_attention(index, q, v, estimate=-2)
    with pytest.raises(ValueError, match=r"top_p must be a float in \(0, 1\]"):
        routed_attention(index, q, v, top_p=0.0)
    with pytest.raises(ValueError, match=r"top_p must be a float in \(0, 1\]"):
        routed_attention(index, q, v, top_p=1.5)
    with pytest.raises(ValueError, match="min_keys=50 must be <= max_keys=10"):
        routed_attention(index, q, v, top_p=0.5, min_keys=50, max_keys=10)
    with pytest.raises(ValueError, match="max_keys must be an int >= 0"):
        routed_attention(index, q, v, top_p=0.5, max_keys=-1)


def test_selector_parameters():
    q, k, v = _clustered(S=2000, L=100)
    ref, _ = dense64(q, k, v, 0.3)
    off = get_selector("cluster:mode=block,n_clusters=30,n_probe=3").build(k)
    on = get_selector("cluster:mode=block,n_clusters=30,n_probe=3,estimate=-1").build(k)
    e_off = _err(off.attend(q, v, scale=0.3)[0], ref)
    e_on = _err(on.attend(q, v, scale=0.3)[0], ref)
    assert e_on < 0.5 * e_off
    np.testing.assert_array_equal(on.last_keys_read_, off.last_keys_read_)
    on.set_params(top_p=0.8, max_keys=500)
    on.attend(q, v, scale=0.3)
    assert on.last_keys_read_.shape == (100,) and on.last_keys_read_.max() <= 500
    with pytest.raises(ValueError, match="estimate"):
        get_selector("cluster:mode=block,estimate=-3")
    with pytest.raises(ValueError, match="top_p"):
        get_selector("cluster:mode=block,top_p=2")


@pytest.mark.parametrize("is_causal", [False, True])
def test_block_query_with_top_p_is_the_attended_key_set(is_causal):
    """Block-mode query() returns the mass-routed keys; attend() (estimate off) is exact attention over them."""
    q, k, v = _clustered(S=1500, L=120, dtype=np.float64)
    qpos = np.arange(120) * 12
    sel = get_selector("cluster:mode=block,n_clusters=25,n_probe=3,top_p=0.7,max_keys=600,exact_prefix=false")
    sel.build(k)
    pat = sel.query(q, 1, is_causal=is_causal, query_positions=qpos)
    out, _ = sel.attend(q, v, is_causal=is_causal, query_positions=qpos)
    np.testing.assert_array_equal(pat.nnz_per_row, sel.last_keys_read_)
    mask = np.zeros((120, 1500), dtype=bool)
    for i in range(120):
        mask[i, pat.row(i)] = True
    if is_causal:
        assert not np.any(mask & (np.arange(1500) > qpos[:, None]))  # no future key in the pattern
    live = mask.any(axis=1)
    ref, _ = dense64(q[live], k, v, 1 / np.sqrt(12), mask[live])
    np.testing.assert_allclose(out[live], ref, atol=1e-10)
    # one mass rule: the pattern's routes are the clusters routed_attention reads
    route, keys = mass_routes(sel.index_, q, top_p=0.7, max_keys=600, is_causal=is_causal, query_positions=qpos)
    st_: dict = {}
    routed_attention(sel.index_, q, v, top_p=0.7, max_keys=600, is_causal=is_causal, query_positions=qpos,
                     exact_prefix=False, stats=st_)
    np.testing.assert_array_equal(keys, st_["keys_read"])
    sizes = np.diff(sel.index_.cluster_ptr_)
    for i in range(120):
        r = route[i][route[i] >= 0]
        assert len(set(r.tolist())) == r.size
        if not is_causal:
            assert sizes[r].sum() == keys[i]


def _anisotropic(seed: int = 5, S: int = 3000, L: int = 300, E: int = 16, n_cent: int = 30):
    """Gaussian clusters with a random orientation and a decaying spectrum each (float64)."""
    rng = np.random.default_rng(seed)
    cent = rng.standard_normal((n_cent, E)) * 1.5
    lab = rng.integers(0, n_cent, S)
    k = np.empty((S, E))
    for c in range(n_cent):
        rot = np.linalg.qr(rng.standard_normal((E, E)))[0]
        sd = 1.2 * 0.6 ** np.arange(E)  # one wide direction, then fast decay
        m = lab == c
        k[m] = cent[c] + (rng.standard_normal((m.sum(), E)) * sd) @ rot.T
    q = cent[rng.integers(0, n_cent, L)] + 0.5 * rng.standard_normal((L, E))
    v = rng.standard_normal((S, 4))
    return q, k, v


def test_key_cov_factors_reconstruct_the_covariance():
    """rank = E: the factors give each cluster's covariance exactly; rank r: its top r eigenpairs plus the
    mean of the other eigenvalues on the identity (same trace)."""
    _, k, _ = _anisotropic(S=800)
    index = ClusterIndex(n_clusters=6, n_probe=2).build(k)
    E = k.shape[1]
    kc = k - index.mean_
    for rank in (E, 3):
        W, rho = index.key_cov_factors(rank)
        assert W.shape == (6 * rank, E) and rho.shape == (6,)
        for c in range(6):
            cov = np.cov(kc[index.assignment_ == c].T, bias=True)
            approx = W[c * rank:(c + 1) * rank].T @ W[c * rank:(c + 1) * rank] + rho[c] * np.eye(E)
            lam, vec = np.linalg.eigh(cov)
            if rank == E:
                np.testing.assert_allclose(approx, cov, atol=1e-10)
            else:
                top = vec[:, -rank:]
                np.testing.assert_allclose(top.T @ approx @ top, np.diag(lam[-rank:]), atol=1e-10)
                np.testing.assert_allclose(np.trace(approx), np.trace(cov), rtol=1e-10)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        index.key_cov_factors(0)


def test_mass_route_stop_rule_hand_worked():
    """Masses 4, 3, 2, 1 (total 10): a row stops once routed >= top_p * (routed + margin * unrouted).
    top_p = 0.7: after 4 + 3, 7 >= 0.7 * (7 + 3) with margin 1 (2 clusters) but 7 < 0.7 * (7 + 1.1 * 3)
    = 7.21 with margin 1.1 (3 clusters)."""
    A = np.log(np.array([[4.0, 3.0, 2.0, 1.0]], dtype=np.float32))
    cand = np.array([[0, 1, 2, 3]], dtype=np.int32)
    sizes = np.full((1, 4), 10, dtype=np.int64)
    for margin, n_expected in ((1.0, 2), (1.1, 3)):
        route = np.empty((1, 4), dtype=np.int32)
        n_route = np.empty(1, dtype=np.int64)
        keys = np.empty(1, dtype=np.int64)
        est = np.empty((1, 1), dtype=np.int32)
        ek.mass_route(A, cand, sizes, 0.7, margin, 0, 1000, 1, 4, route, n_route, keys, est)
        assert n_route[0] == n_expected and keys[0] == 10 * n_expected
        np.testing.assert_array_equal(route[0, :n_expected], np.arange(n_expected))
        assert est[0, 0] == n_expected  # the next candidate is the estimated one


@pytest.mark.parametrize("top_p", [0.8, 0.9])
def test_top_p_rows_keep_the_mass_they_claim(top_p):
    """Calibration: with top_p = p, >= 95 % of rows keep >= p of the true (float64 dense) softmax mass
    on their routed keys, while reading fewer keys than all of them."""
    # Rows pooled over four k-means seeds: one seed's clusters move the fraction by a few rows (0.94-1.0).
    q, k, v = _anisotropic()
    S = k.shape[0]
    for scale in (0.25, 0.5):
        _, lse_dense = dense64(q, k, v, scale)
        kept = []
        for seed in range(4):
            index = ClusterIndex(n_clusters=30, n_probe=3, seed=seed).build(k)
            s: dict = {}
            _, lse = routed_attention(index, q, v, scale=scale, top_p=top_p, max_keys=S, stats=s)
            kept.append(np.exp(lse - lse_dense) >= top_p - 1e-12)
            assert s["keys_read"].mean() < 0.9 * S
            route, keys = mass_routes(index, q, top_p=top_p, max_keys=S, scale=scale)
            np.testing.assert_array_equal(keys, s["keys_read"])
        assert np.mean(kept) >= 0.95, (scale, [np.mean(x) for x in kept])


def _capped_term(x, ell, hb):
    """The documented capped second-order term of an estimated cluster and its tilt factor, float64."""
    if x <= ell:
        g, f = x, 1.0
    else:
        f = np.sqrt(ell / x)
        g = 2 * np.sqrt(x * ell) - ell
    g = min(g, hb)
    if x > 0:
        f = min(f, hb / (2 * x))
    if g >= 2.0:
        g, f = 2.0, 0.0
    return g, f


@pytest.mark.parametrize("qmult", [1.0, 4.0])
def test_estimate_all_rest_matches_its_formula(qmult):
    """estimate=-1 at a fixed n_probe against the documented estimate, brute force in float64: exact sums
    over the routed keys plus, per unrouted cluster, ``n_c exp(s q.mu_c + g)`` times ``vbar_c + s f
    sigma_c^2 B q`` (B: pooled within-cluster regression of values on keys; g, f: the capped second-order
    term of ``x = s^2 |q|^2 sigma_c^2 / 2`` and its derivative: x up to log n_c, then 2 sqrt(x log n_c) -
    log n_c, at most |s| |q| max_j |k_j - mu_c| and at most 2, f = 0 there), the regression part shrunk
    (lam in [0, 1]) to keep the estimate inside the values' per-column range.
    The kernels use float32 weights: tolerance 1e-4 relative."""
    q, k, v = _clustered(S=900, L=60, dtype=np.float64)
    q = q * qmult
    s = 0.45
    index = ClusterIndex(n_clusters=10, n_probe=3).build(k)
    out, _ = routed_attention(index, q, v, scale=s, estimate=-1)
    kc = k - index.mean_
    lab = index.assignment_
    C, S = 10, k.shape[0]
    n = np.array([np.sum(lab == c) for c in range(C)])
    mu = np.array([kc[lab == c].mean(0) for c in range(C)])
    rmu = np.array([np.linalg.norm(kc[lab == c] - mu[c], axis=1).max() for c in range(C)])
    vbar = np.array([v[lab == c].mean(0) for c in range(C)])
    sig2 = np.array([kc[lab == c].var(0).mean() for c in range(C)])
    X = sum((v[lab == c] - vbar[c]).T @ (kc[lab == c] - mu[c]) for c in range(C))
    B = X / (S * np.sum(n * sig2) / S)
    ids, _ = index.route(q)
    n_capped = 0
    for i in range(q.shape[0]):
        routed = np.isin(lab, ids[i])
        w = np.exp(s * kc[routed] @ q[i])
        num, den = w @ v[routed], w.sum()
        e_num, e_reg, e_den = 0.0, 0.0, 0.0
        for c in set(range(C)) - set(ids[i].tolist()):
            x = 0.5 * s * s * (q[i] @ q[i]) * sig2[c]
            g, f = _capped_term(x, np.log(n[c]), s * np.linalg.norm(q[i]) * rmu[c])
            n_capped += g < x
            wc = n[c] * np.exp(s * q[i] @ mu[c] + g)
            e_num = e_num + wc * vbar[c]
            e_reg = e_reg + wc * s * f * sig2[c] * B @ q[i]
            e_den += wc
        lo, hi = v.min(0), v.max(0)
        lam = 1.0
        for col in range(v.shape[1]):
            r = e_reg[col] if np.ndim(e_reg) else 0.0
            if r > 0:
                lam = min(lam, (hi[col] * e_den - e_num[col]) / r)
            elif r < 0:
                lam = min(lam, (lo[col] * e_den - e_num[col]) / r)
        num = num + e_num + max(lam, 0.0) * e_reg
        den += e_den
        np.testing.assert_allclose(out[i], num / den, rtol=1e-4, atol=1e-6 * np.abs(num / den).max())
    assert n_capped > 0  # the caps are exercised


@pytest.mark.parametrize("is_causal", [False, True])
def test_estimate_beyond_the_unread_clusters_is_every_unread_cluster(is_causal):
    """estimate=N with fewer than N clusters left after the routed ones estimates all of them: equal to
    estimate=-1 (causal: through the selector's segments, whose small segments hold few clusters)."""
    from sparseattn.selectors.cluster import ClusterSelector

    rng = np.random.default_rng(5)
    k = (rng.standard_normal((1200, 8)) + np.repeat(rng.standard_normal((12, 8)) * 2, 100, axis=0)).astype(np.float32)
    q = rng.standard_normal((300, 8)).astype(np.float32)
    v = rng.standard_normal((1200, 4)).astype(np.float32)
    outs = []
    for est in (50, -1):
        sel = ClusterSelector(mode="block", n_clusters=6, n_probe=2, estimate=est)
        outs.append(sel.build(k).attend(q, v, is_causal=is_causal, query_positions=np.arange(300) * 4))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-6)


def test_causal_estimate_routes_like_the_plain_path():
    # Both paths rank the clusters whose every key is after the row last, so with top_p unset they read
    # the same keys (the estimate only adds the unread clusters' estimate).  Keys sorted by cluster make
    # many clusters lie wholly after the early rows.
    q, k, v = _clustered()
    index = ClusterIndex(n_clusters=20, n_probe=3).build(k)
    kpos = np.empty(k.shape[0], dtype=np.int64)
    kpos[index.perm_] = np.arange(k.shape[0])  # cluster c's keys: one position range, in cluster order
    qpos = np.linspace(0, k.shape[0] - 1, q.shape[0]).astype(np.int64)
    reads = []
    for est in (0, 4, -1):
        s: dict = {}
        routed_attention(index, q, v, is_causal=True, query_positions=qpos, key_positions=kpos, exact_prefix=False,
                         estimate=est, stats=s)
        reads.append(s["keys_read"])
    np.testing.assert_array_equal(reads[1], reads[0])
    np.testing.assert_array_equal(reads[2], reads[0])
    # Never a wasted probe while a cluster with a visible key is left: each row reads at least the 3 smallest
    # visible counts among the clusters it can see (all of them when it sees fewer than 3).
    lab = index.assignment_
    for i, qp in enumerate(qpos):
        counts = np.bincount(lab[kpos <= qp], minlength=index.n_clusters_)
        assert reads[0][i] >= np.sort(counts[counts > 0])[:3].sum(), i
