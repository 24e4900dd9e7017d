"""ClusterSelector: block attention and top-k against independent numpy oracles of the routed key sets.

The oracle recomputes, with plain numpy, (1) each key's cluster from the fitted centroids, (2) each query's
routed clusters, (3) the routed mask, then float64 softmax attention / top-k restricted to that mask.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import sparse_attention, sparse_attention_result
from sparseattn.index.cluster import ClusterIndex, key_spans
from sparseattn.kernels import cluster as ck
from sparseattn.kernels.topk import rows_topk
from sparseattn.selectors.base import get_selector
from sparseattn.selectors.cluster import ClusterSelector
from sparseattn.threads import worker_threads
from sparseattn.topk import exact_topk

# Output tolerance per dtype (absolute, outputs are O(1)); observed max error: f32 ~3e-7, f64 ~1e-15.
TOL = {np.float32: 1e-5, np.float64: 1e-12}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def clustered(rng: np.random.Generator, n: int, L: int, d: int = 16, centres: int = 24,
              dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys around random centres (plus a shared offset), queries near centres, Gaussian values."""
    cent = rng.standard_normal((centres, d)) * 1.5
    k = cent[rng.integers(0, centres, n)] + 0.2 * rng.standard_normal((n, d)) + 0.5
    q = cent[rng.integers(0, centres, L)] * 1.5 + 0.2 * rng.standard_normal((L, d))
    v = rng.standard_normal((n, 6))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def oracle_assignment(sel: ClusterSelector, k: np.ndarray) -> np.ndarray:
    """Check ``sel.assignment_`` against a float64 recomputation; return it.

    Each key must sit in a cluster whose score (inner product, or minus the squared distance for "l2")
    is the best one up to float32 rounding (near-ties may legitimately go either way).
    Two levels (clusters larger than ``split`` x the mean are split): the key's coarse cluster
    ``parent_[assignment_]`` must be the best coarse centroid by that rule, and its part the nearest
    (Euclidean) among the parts of that coarse cluster.
    """
    kc = k.astype(np.float64) - sel.mean_.astype(np.float64)
    c = sel.coarse_centroids_.astype(np.float64)
    if sel.params["assign"] == "l2":
        scores = -((kc[:, None, :] - c[None]) ** 2).sum(-1)
    else:
        scores = kc @ c.T
    parent = sel.parent_[sel.assignment_]
    got = scores[np.arange(len(k)), parent]
    tol = 1e-5 * (1 + np.abs(scores).max(axis=1))
    np.testing.assert_array_less(scores.max(axis=1) - tol, got + 1e-300)
    agree = np.mean(parent == scores.argmax(axis=1))
    assert agree > 0.99, agree
    # within a split coarse cluster: the nearest of its parts
    fine = sel.kmeans_centroids_.astype(np.float64)  # centroids_ may be member means (route_by)
    d2 = ((kc[:, None, :] - fine[None]) ** 2).sum(-1)
    d2 = np.where(sel.parent_[None, :] == parent[:, None], d2, np.inf)
    got2 = d2[np.arange(len(k)), sel.assignment_]
    np.testing.assert_array_less(got2 - 1e-5 * (1 + d2.min(axis=1)), d2.min(axis=1) + 1e-300)
    assert np.mean(sel.assignment_ == d2.argmin(axis=1)) > 0.99
    return sel.assignment_


def oracle_mask(sel: ClusterSelector, q: np.ndarray, k: np.ndarray, qpos: np.ndarray | None = None) -> np.ndarray:
    """(L, S) bool: key j lies in one of query i's n_probe clusters of largest q.c (with ``qpos``, causal
    routing: among the clusters holding a key at or before the query, the others only fill a row that
    sees fewer than n_probe clusters; keys at positions ``arange(S)``).

    The routing is checked against a float64 recomputation (the chosen clusters' scores must all be at
    least the best unchosen score, up to float32 rounding), then the mask is built with numpy.
    """
    assignment = oracle_assignment(sel, k)
    scores = q.astype(np.float64) @ sel.centroids_.astype(np.float64).T
    seen = np.ones_like(scores, dtype=bool)
    if qpos is None:
        route = sel.route(q)
    else:
        kmin = np.full(sel.n_clusters_, np.iinfo(np.int64).max)
        np.minimum.at(kmin, assignment, np.arange(k.shape[0]))
        seen = kmin[None, :] <= qpos[:, None]
        with worker_threads(1):
            route = sel.index_.route_rows(sel.index_.validated_queries(q, True), 1, key_spans(
                sel.index_, np.arange(k.shape[0], dtype=np.int64))[1], qpos.astype(np.int64))[0]
    routed = np.zeros((q.shape[0], sel.n_clusters_), dtype=bool)
    np.put_along_axis(routed, route.astype(np.int64), True, axis=1)
    assert (routed.sum(axis=1) == sel.n_probe_).all()
    full = seen.sum(axis=1) >= sel.n_probe_
    assert (routed[full] <= seen[full]).all() and (seen[~full] <= routed[~full]).all()
    if sel.n_probe_ < sel.n_clusters_:
        worst_chosen = np.where(routed & seen, scores, np.inf).min(axis=1)
        best_other = np.where(routed | ~seen, -np.inf, scores).max(axis=1)
        tol = 1e-5 * (1 + np.abs(scores).max(axis=1))
        np.testing.assert_array_less(best_other - tol, worst_chosen)
    return routed[:, assignment]


def masked_attention(q, k, v, mask, scale):
    """Float64 softmax over the allowed keys; rows without one -> zeros and -inf."""
    s = q.astype(np.float64) @ k.astype(np.float64).T * scale
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    empty = ~np.isfinite(m[:, 0])
    m[empty] = 0.0
    w = np.exp(s - m)
    tot = w.sum(axis=1, keepdims=True)
    out = (w @ v.astype(np.float64)) / np.where(tot > 0, tot, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, (m + np.log(tot))[:, 0])
    return out, lse


def causal_mask(L, S, qpos=None, kpos=None):
    qpos = np.arange(L) if qpos is None else qpos
    kpos = np.arange(S) if kpos is None else kpos
    return kpos[None, :] <= qpos[:, None]


def causal_bands(S: int, T: int) -> list[tuple[int, int]]:
    """The bands (lo, hi] of visible-key counts a causal index of S keys with exact prefix T routes:
    (T, 4T], (4T, 16T], ..., the last one to S (absorbing a remainder shorter than its lo)."""
    out, lo = [], T
    while lo < S:
        hi = S if 4 * lo >= S or S - 4 * lo < lo else 4 * lo
        out.append((lo, hi))
        lo = hi
    return out


def causal_oracle_mask(sel: ClusterSelector, q: np.ndarray, k: np.ndarray, qpos=None, kpos=None) -> np.ndarray:
    """(L, S) bool: the keys strictly causal block attention reads, recomputed with numpy.

    A row seeing c <= T = ``prefix_budget()`` keys reads all of them.  A row seeing c in a band (lo, hi]
    (:func:`causal_bands`) routes through that band's index, over the first hi keys by position: its
    codebook must come from the band's first lo keys (the training keys), every band key's cluster must be
    its codeword of largest ``(k - mu) . c`` (mu: the training keys' mean; float64, up to rounding at near
    ties), each routing vector the mean of its codeword's training keys; the row reads the visible keys of
    its n_probe clusters of largest ``q . r`` among those holding a key at or before it (checked against
    float64 scores, up to float32 rounding).
    """
    L, S = q.shape[0], k.shape[0]
    qpos = np.arange(L) if qpos is None else np.asarray(qpos)
    kpos = np.arange(S) if kpos is None else np.asarray(kpos)
    index = sel.causal_index(kpos)
    T, C, p = index.prefix_budget(), index.n_clusters_, index.n_probe_
    assert T == min(S, max(int(np.ceil(p * S / C)), 16 * C))
    order = np.argsort(kpos, kind="stable")
    assert [(b.lo, b.hi) for b in index.bands_] == causal_bands(S, T)
    visible = kpos[None, :] <= qpos[:, None]
    n_vis = visible.sum(axis=1)
    mask = np.zeros((L, S), dtype=bool)
    for band in index.bands_:
        ids = order[:band.hi]
        np.testing.assert_array_equal(band.ids, ids)
        part = band.index
        assert (part.n_clusters_, part.n_probe_, part.prefix_budget()) == (C, p, band.lo)
        kb, kp = k[ids], kpos[ids]
        mu = kb[:band.lo].astype(np.float64).mean(axis=0)
        cent = part.kmeans_centroids_.astype(np.float64)
        sc = (kb.astype(np.float64) - mu) @ cent.T
        got = sc[np.arange(band.hi), part.assignment_]
        assert np.all(got >= sc.max(axis=1) - 1e-5 * (1 + np.abs(sc).max(axis=1)))
        assert np.mean(part.assignment_ == sc.argmax(axis=1)) > 0.99
        for c in range(C):
            members = np.flatnonzero(part.assignment_[:band.lo] == c)
            if members.size:
                np.testing.assert_allclose(part.centroids_[c], kb[members].astype(np.float64).mean(axis=0),
                                           rtol=1e-5, atol=1e-5)
        rows = np.flatnonzero((n_vis > band.lo) & (n_vis <= band.hi))
        if rows.size == 0:
            continue
        qr = q[rows]
        scores = qr.astype(np.float64) @ part.centroids_.astype(np.float64).T
        kmin = np.full(C, np.iinfo(np.int64).max)
        np.minimum.at(kmin, part.assignment_, kp)
        seen = kmin[None, :] <= qpos[rows][:, None]
        with worker_threads(1):
            route = part.route_rows(np.ascontiguousarray(qr, dtype=part.keys_.dtype), 1,
                                    key_spans(part, kp.astype(np.int64))[1], qpos[rows].astype(np.int64))[0]
        routed = np.zeros((rows.size, C), dtype=bool)
        np.put_along_axis(routed, route.astype(np.int64), True, axis=1)
        full = seen.sum(axis=1) >= p
        assert (routed[full] <= seen[full]).all() and (seen[~full] <= routed[~full]).all()
        if p < C:
            worst_chosen = np.where(routed & seen, scores, np.inf).min(axis=1)
            best_other = np.where(routed | ~seen, -np.inf, scores).max(axis=1)
            tol = 1e-5 * (1 + np.abs(scores).max(axis=1))
            np.testing.assert_array_less((best_other - tol)[full], worst_chosen[full])
        band_mask = np.zeros((rows.size, S), dtype=bool)
        band_mask[:, ids] = routed[:, part.assignment_]
        mask[rows] = band_mask & visible[rows]
    small = n_vis <= T
    mask[small] = visible[small]
    return mask


# ------------------------------------------------------------------------------------------ block mode
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("assign", ["ip", "l2"])
@pytest.mark.parametrize("split", [0.0, 1.0])
def test_block_attend_equals_masked_dense(rng, dtype, assign, split):
    q, k, v = clustered(rng, 1500, 200, dtype=dtype)
    sel = ClusterSelector(n_clusters=20, n_probe=3, mode="block", assign=assign, split=split).build(k)
    assert (sel.n_clusters_ > 20) == (split > 0)  # split=1 breaks up every above-average cluster
    mask = oracle_mask(sel, q, k)
    # away from near-ties the routing is exactly numpy's top-3 by q.c
    scores = q.astype(np.float64) @ sel.centroids_.astype(np.float64).T
    expected = np.sort(np.argsort(-scores, axis=1)[:, :3], axis=1)
    assert np.mean(np.all(np.sort(sel.route(q), axis=1) == expected, axis=1)) > 0.98
    out, lse = sel.attend(q, v, scale=0.3)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.3)
    assert out.dtype == dtype and lse.dtype == dtype
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(lse, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])
    # query() in block mode returns exactly the routed key set, whatever k
    np.testing.assert_array_equal(sel.query(q, 1).to_mask(), mask)


def test_full_probe_is_exact_full_attention(rng):
    q, k, v = clustered(rng, 1200, 150)
    sel = ClusterSelector(n_clusters=12, n_probe=12, mode="block").build(k)
    out, lse = sel.attend(q, v)
    ref, ref_lse = masked_attention(q, k, v, np.ones((150, 1200), dtype=bool), 16 ** -0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    out, lse = sel.attend(q, v, is_causal=True)
    ref, ref_lse = masked_attention(q, k, v, causal_mask(150, 1200), 16 ** -0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


def test_block_causal_matches_oracle_and_does_not_leak(rng):
    S, L = 1000, 1000
    q, k, v = clustered(rng, S, L)
    # strictly causal: exact_prefix=False does not apply (the causal index's short rows are always exact)
    sel = ClusterSelector(n_clusters=16, n_probe=4, mode="block", exact_prefix=False).build(k)
    mask = causal_oracle_mask(sel, q, k)
    assert not (mask & ~causal_mask(L, S)).any()
    assert mask.sum(axis=1).mean() < 0.6 * causal_mask(L, S).sum(axis=1).mean()  # routed, not dense
    out, lse = sel.attend(q, v, is_causal=True)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.25)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    np.testing.assert_array_equal(sel.last_keys_read_, mask.sum(axis=1))
    # no leak: poisoning the values of every key after position 499 leaves rows 0..499 unchanged
    v2 = v.copy()
    v2[500:] = 1e6
    out2, lse2 = sel.attend(q, v2, is_causal=True)
    np.testing.assert_array_equal(out2[:500], out[:500])
    np.testing.assert_array_equal(lse2[:500], lse[:500])
    pattern = sel.query(q, 8, is_causal=True)
    np.testing.assert_array_equal(pattern.to_mask(), mask)


def test_exact_prefix_rows_see_every_visible_key_and_lift_early_recall(rng):
    # Rows that see at most the causal index's T = max(n_probe*S/C, 16 C) = 256 keys attend to all of them
    # (dense oracle), the others to their routed keys; query() returns exactly that key set; nothing leaks.
    S = L = 1000
    q, k, v = clustered(rng, S, L)
    sel = ClusterSelector(n_clusters=16, n_probe=4, mode="block").build(k)
    assert sel.params["exact_prefix"] is True
    mask = causal_oracle_mask(sel, q, k)
    out, lse = sel.attend(q, v, is_causal=True)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.25)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    np.testing.assert_array_equal(sel.query(q, 8, is_causal=True).to_mask(), mask)
    np.testing.assert_array_equal(mask[:256], causal_mask(256, S))  # the prefix rows: exact
    assert mask[256:].sum(axis=1).mean() < 0.6 * causal_mask(L, S)[256:].sum(axis=1).mean()  # the others: routed
    v2 = v.copy()
    v2[500:] = 1e6
    out2, _ = sel.attend(q, v2, is_causal=True)
    np.testing.assert_array_equal(out2[:500], out[:500])
    # early rows: recall@8 of the exact causal top-8 is 1 on the prefix rows
    s = np.where(causal_mask(L, S), q @ k.T, -np.inf)
    top = np.argsort(-s, axis=1, kind="stable")[:, :8]
    hit = np.take_along_axis(mask, top, axis=1) | ~np.take_along_axis(causal_mask(L, S), top, axis=1)
    assert hit[:250].all()


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 700), L=st.integers(1, 300), C=st.integers(1, 12), p=st.integers(1, 12),
       sorted_keys=st.booleans(), prefix=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_property_block_causal_equals_masked_oracle(S, L, C, p, sorted_keys, prefix, seed):
    # Causal block attention against the float64 oracle for any positions: sorted key positions (with
    # repeats) take the prefix path (only keys up to a tile's latest query are multiplied), shuffled
    # ones the full-block path; queries at random positions, some before every key.
    rng = np.random.default_rng(seed)
    C = min(C, S)
    p = min(p, C)
    q, k, v = clustered(rng, S, L)
    kpos = np.sort(rng.integers(0, S, S)) if sorted_keys else rng.permutation(S)
    qpos = rng.integers(-2, S + 2, L)
    sel = ClusterSelector(n_clusters=C, n_probe=p, mode="block", exact_prefix=prefix).build(k)
    out, lse = sel.attend(q, v, is_causal=True, query_positions=qpos, key_positions=kpos)
    mask = causal_oracle_mask(sel, q, k, qpos, kpos)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.25)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shuffled", [False, True])
def test_block_causal_routes_each_row_through_its_band(rng, shuffled):
    # Three bands: T = max(8000 / 24, 16 * 24) = 384, (384, 1536], (1536, 6144], (6144, 8000]; keys stored in
    # position order (bands are views of the keys) or shuffled (bands gather them).  Rows at random
    # positions, some before every key; attend(), query() in block and top-k mode, all against the oracle.
    S, L = 8000, 600
    q, k, v = clustered(rng, S, L)
    kpos = rng.permutation(S) if shuffled else np.arange(S)
    qpos = np.concatenate([[-1, 0, 383, 384, 1536, 1537, 6144, 6145, S - 1], rng.integers(0, S, L - 9)])
    sel = ClusterSelector(n_clusters=24, n_probe=1, mode="block").build(k)
    index = sel.causal_index(kpos)
    assert [(b.lo, b.hi) for b in index.bands_] == [(384, 1536), (1536, 6144), (6144, 8000)]
    assert all(b.leading for b in index.bands_) == (not shuffled)
    mask = causal_oracle_mask(sel, q, k, qpos, kpos)
    visible = kpos[None, :] <= qpos[:, None]
    n_vis = visible.sum(axis=1)
    assert {int(np.searchsorted([384, 1536, 6144], c)) for c in n_vis[n_vis > 384]} == {1, 2, 3}  # every band
    out, lse = sel.attend(q, v, is_causal=True, query_positions=qpos, key_positions=kpos)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.25)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    np.testing.assert_array_equal(sel.last_keys_read_, mask.sum(axis=1))
    np.testing.assert_array_equal(sel.query(q, 8, is_causal=True, query_positions=qpos, key_positions=kpos
                                            ).to_mask(), mask)
    # top-k mode: the exact top-16 of the same candidates (a row with at most 16 visible keys: all of them)
    topk = ClusterSelector(n_clusters=24, n_probe=1).build(k).query(q, 16, is_causal=True, query_positions=qpos,
                                                                    key_positions=kpos)
    cand = mask | (visible & (n_vis <= 16)[:, None])
    s = np.where(cand, q.astype(np.float64) @ k.astype(np.float64).T, -np.inf)
    np.testing.assert_array_equal(topk.nnz_per_row, np.minimum(cand.sum(axis=1), 16))
    for i in range(L):
        got = np.sort(s[i, topk.row(i)])[::-1]
        np.testing.assert_allclose(got, np.sort(s[i])[::-1][:got.size], rtol=1e-5, atol=1e-4)
    # strictly causal: the values and keys after each row's position change nothing beyond float32 rounding
    # (the later keys move the radii, so the exp's shift, which cancels in the softmax)
    k2, v2 = k.copy(), v.copy()
    late = kpos > np.median(qpos)
    k2[late] *= 50.0
    v2[late] = 1e6
    rows = qpos < np.median(qpos)
    sel2 = ClusterSelector(n_clusters=24, n_probe=1, mode="block").build(k2)
    out2, _ = sel2.attend(q, v2, is_causal=True, query_positions=qpos, key_positions=kpos)
    np.testing.assert_allclose(out2[rows], out[rows], atol=1e-5)


@pytest.mark.parametrize("budget", ["top_p", "estimate"])
def test_band_rows_with_top_p_and_estimate_stay_causal(rng, budget):
    # The mass-driven routes and the estimation zone run per band too: top_p attends exactly over the
    # pattern query() returns; with the estimate, later keys and values change nothing (to rounding).
    S, L = 8000, 400
    q, k, v = clustered(rng, S, L)
    kpos = rng.permutation(S)
    qpos = rng.integers(0, S, L)
    prm = {"top_p": 0.9} if budget == "top_p" else {"estimate": -1}
    sel = ClusterSelector(n_clusters=24, n_probe=1, mode="block", **prm).build(k)
    out, lse = sel.attend(q, v, is_causal=True, query_positions=qpos, key_positions=kpos)
    assert len(sel.causal_index(kpos).bands_) == 3 and np.isfinite(out).all()
    if budget == "top_p":
        mask = sel.query(q, 8, is_causal=True, query_positions=qpos, key_positions=kpos).to_mask()
        assert not (mask & ~(kpos[None, :] <= qpos[:, None])).any()
        np.testing.assert_array_equal(sel.last_keys_read_, mask.sum(axis=1))
        ref, _ = masked_attention(q, k, v, mask, 0.25)
        np.testing.assert_allclose(out, ref, atol=2e-5)
    k2, v2 = k.copy(), v.copy()
    late = kpos > np.median(qpos)
    k2[late] *= 50.0
    v2[late] = 1e6
    rows = qpos < np.median(qpos)
    out2, _ = ClusterSelector(n_clusters=24, n_probe=1, mode="block", **prm).build(k2).attend(
        q, v2, is_causal=True, query_positions=qpos, key_positions=kpos)
    np.testing.assert_allclose(out2[rows], out[rows], atol=1e-5)


def test_causal_index_refuses_non_causal_or_routed_short_rows(rng):
    from sparseattn.attention.routed import routed_attention
    from sparseattn.index import CausalClusterIndex

    q, k, v = clustered(rng, 2000, 50)
    index = CausalClusterIndex(n_clusters=8, n_probe=1).build(k)
    with pytest.raises(ValueError, match="is_causal=True and exact_prefix=True"):
        routed_attention(index, q, v)
    with pytest.raises(ValueError, match="is_causal=True and exact_prefix=True"):
        routed_attention(index, q, v, is_causal=True, exact_prefix=False)
    with pytest.raises(RuntimeError, match="CausalClusterIndex is not built"):
        routed_attention(CausalClusterIndex(), q, v, is_causal=True)
    with pytest.raises(ValueError, match="keys must be finite"):
        CausalClusterIndex().build(np.full((100, 4), np.nan, np.float32))
    # the bands are prefixes in the build's position order: other key positions would pick rows' bands from
    # one order and their keys from another (silent zeros, or later keys read)
    for kpos in (np.arange(2000) - 1000, np.arange(2000)[::-1]):
        with pytest.raises(ValueError, match="key_positions must be the ones"):
            routed_attention(index, q, v, is_causal=True, query_positions=np.full(50, 100), key_positions=kpos)
    shuffled = CausalClusterIndex(n_clusters=8, n_probe=1).build(k, rng.permutation(2000))
    with pytest.raises(ValueError, match="key_positions must be the ones"):
        routed_attention(shuffled, q, v, is_causal=True)  # default arange is not the build's positions


def test_prefix_index_refuses_non_finite_keys_past_its_training_keys(rng):
    from sparseattn.index import PrefixClusterIndex

    _, k, _ = clustered(rng, 2000, 1)
    k[1500, 3] = np.nan
    with pytest.raises(ValueError, match="keys must be finite"):
        PrefixClusterIndex(n_clusters=8, n_probe=1).build(k, 1000)


def test_prefix_index_labels_and_repr(rng):
    from sparseattn.index import PrefixClusterIndex

    _, k, _ = clustered(rng, 2000, 1)
    index = PrefixClusterIndex(n_clusters=8, n_probe=1)
    built = PrefixClusterIndex(n_clusters=8, n_probe=1).build(k, 500)
    np.testing.assert_array_equal(index.labels(k, 500), built.assignment_)
    assert index.keys_ is None  # labels() leaves it unbuilt
    assert repr(index).startswith("PrefixClusterIndex(n_clusters=8, n_probe=1")


def test_block_causal_with_cache_positions(rng):
    S, L = 800, 100
    q, k, v = clustered(rng, S, L)
    kpos = rng.permutation(S)  # keys need not be stored in position order
    qpos = np.arange(S - L, S)  # L new tokens after a cache (bottom-right alignment)
    sel = ClusterSelector(n_clusters=10, n_probe=3, mode="block").build(k)
    out, lse = sel.attend(q, v, is_causal=True, query_positions=qpos, key_positions=kpos, scale=0.5)
    mask = causal_oracle_mask(sel, q, k, qpos, kpos)
    ref, _ = masked_attention(q, k, v, mask, 0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    none_visible = np.full(L, -1)
    out, lse = sel.attend(q, v, is_causal=True, query_positions=none_visible)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)


def test_many_blocks_and_tiles(rng, monkeypatch):
    # Tiny buffers: queries in many blocks, large clusters in many row tiles, buffers reused.
    import sparseattn.attention.routed as routed_mod
    import sparseattn.index.cluster as index_mod
    import sparseattn.index.kmeans as kmeans_mod

    monkeypatch.setattr(kmeans_mod, "BLOCK_BUDGET", 3000)
    for mod in (routed_mod, index_mod):
        monkeypatch.setattr(mod, "_BLOCK_BUDGET", 3000)
        monkeypatch.setattr(mod, "_TILE", 512)
        monkeypatch.setattr(mod, "_MIN_ROWS", 2)
    q, k, v = clustered(rng, 700, 260)
    sel = ClusterSelector(n_clusters=5, n_probe=2, mode="block").build(k)
    for is_causal in (False, True):
        out, lse = sel.attend(q, v, is_causal=is_causal)
        mask = causal_oracle_mask(sel, q, k) if is_causal else oracle_mask(sel, q, k)
        ref, _ = masked_attention(q, k, v, mask, 0.25)
        np.testing.assert_allclose(out, ref, atol=1e-5)
    sel_t = ClusterSelector(n_clusters=5, n_probe=2).build(k)
    pattern = sel_t.query(q, 7)
    full = ClusterSelector(n_clusters=5, n_probe=2).build(k)
    monkeypatch.undo()
    assert pattern == full.query(q, 7)


def test_threads_give_identical_results(rng):
    q, k, v = clustered(rng, 2000, 300)
    a = ClusterSelector(n_clusters=20, n_probe=5, mode="block", n_threads=1).build(k)
    b = ClusterSelector(n_clusters=20, n_probe=5, mode="block", n_threads=2).build(k)
    np.testing.assert_array_equal(a.assignment_, b.assignment_)
    oa, la = a.attend(q, v, is_causal=True)
    ob, lb = b.attend(q, v, is_causal=True)
    np.testing.assert_array_equal(oa, ob)
    np.testing.assert_array_equal(la, lb)


def test_block_variants_stay_exact_on_their_routing(rng):
    q, k, v = clustered(rng, 900, 80)
    for params in ({"center": False}, {"spherical": True}, {"n_clusters": 1, "n_probe": 1},
                   {"train_sample": 100, "n_iter": 3, "seed": 5}):
        sel = ClusterSelector(mode="block", **{"n_clusters": 9, "n_probe": 2, **params}).build(k)
        out, _ = sel.attend(q, v, scale=0.2)
        ref, _ = masked_attention(q, k, v, oracle_mask(sel, q, k), 0.2)
        np.testing.assert_allclose(out, ref, atol=1e-5, err_msg=str(params))


@pytest.mark.parametrize(("dtype", "scale", "atol"), [(np.float32, 6.0, 1e-4), (np.float64, 80.0, 1e-10)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_loose_shift_bound_is_refined_exactly(rng, dtype, scale, atol, is_causal):
    # Large scores: the Cauchy-Schwarz shift overshoots the true row maximum by far more than exp's
    # range, so the first pass underflows and the pairs go through the refinement loop.
    S, L = 600, 120
    k = (rng.standard_normal((S, 16)) * 2).astype(dtype)
    q = (rng.standard_normal((L, 16)) * 2).astype(dtype)
    v = rng.standard_normal((S, 3)).astype(dtype)
    # exact_prefix off, causal rows after the causal index's exact rows (T = 200): every row goes through
    # the routed (refined) path being tested
    sel = ClusterSelector(n_clusters=6, n_probe=2, mode="block", exact_prefix=False).build(k)
    qpos = np.arange(S - L, S)
    out, lse = sel.attend(q, v, scale=scale, is_causal=is_causal, query_positions=qpos)
    assert sel.last_refined_pairs_ > 0
    mask = causal_oracle_mask(sel, q, k, qpos) if is_causal else oracle_mask(sel, q, k)
    ref, ref_lse = masked_attention(q, k, v, mask, scale)
    np.testing.assert_allclose(out, ref, atol=atol)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=atol)


def test_exact_pairs_kernel_matches_oracle(rng):
    # The last-resort scalar kernel: pair t = (query row Qs[t], cluster c) recomputed with its true max.
    E, Ev = 5, 3
    kp = rng.standard_normal((30, E))
    vp = rng.standard_normal((30, Ev))
    kptr = np.array([0, 10, 10, 30], dtype=np.int64)
    Qs = rng.standard_normal((4, E))
    pair_cluster = np.array([0, 1, 2, 2], dtype=np.int64)
    qpos_s = np.array([100, 100, 100, 12], dtype=np.int64)
    kpos_p = np.arange(30, dtype=np.int64)
    po = np.full((4, Ev + 1), np.nan)
    pm = np.zeros(4)
    ck.exact_pairs(np.arange(4, dtype=np.int64), Qs, kp, vp, kptr, pair_cluster, True, qpos_s, kpos_p, po, pm)
    assert pm[1] == -np.inf and po[1, Ev] == 0.0  # empty cluster
    for t, (a, b) in ((0, (0, 10)), (2, (10, 30)), (3, (10, 13))):  # row 3 sees positions <= 12 only
        s = kp[a:b] @ Qs[t]
        w = np.exp(s - s.max())
        assert pm[t] == pytest.approx(s.max(), abs=1e-12)
        np.testing.assert_allclose(po[t, :Ev], w @ vp[a:b], atol=1e-12)
        assert po[t, Ev] == pytest.approx(w.sum(), abs=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shifted_exp_rows_matches_float64_oracle(rng, dtype):
    # One pass: exp(max(s - m, clamp)), causal zeros, row sums; checked against numpy in float64.
    s = (rng.standard_normal((7, 300)) * 30).astype(dtype)
    s[0, :] = -1e30  # everything below the clamp: every weight exp(clamp), a normal float
    m = (s.astype(np.float64).max(axis=1) + rng.uniform(0, 5, 7)).astype(dtype)
    m[0] = 0.0
    qpos = rng.integers(0, 300, 7).astype(np.int64)
    kpos = rng.permutation(300).astype(np.int64)
    clamp = -80.0 if dtype == np.float32 else -700.0
    fn = ck.shifted_exp_rows_f32 if dtype == np.float32 else ck.shifted_exp_rows_f64
    for masked in (False, True):
        w = s.copy()
        sums = np.empty(7, dtype=dtype)
        fn(w, m, clamp, masked, qpos, kpos, sums)
        want = np.exp(np.maximum(s.astype(np.float64) - m[:, None].astype(np.float64), clamp))
        if masked:
            want[kpos[None, :] > qpos[:, None]] = 0.0
        # float32: s - m and (s - m) log2(e) are rounded to float32: a relative error of the weight up
        # to about (|s| + |m| + 2 |s - m|) * 2**-24 (plus the polynomial's 2.5e-7)
        if dtype == np.float32:
            d = np.abs(s.astype(np.float64) - m[:, None])
            arg = np.minimum(np.abs(s) + np.abs(m)[:, None] + 2 * d, 1e4)  # row 0: clamp, exact shift
            rtol = arg * 2.0**-24 + 3e-7
        else:
            rtol = np.full(s.shape, 1e-13)
        assert np.all(np.abs(w - want) <= rtol * want)
        np.testing.assert_allclose(sums, want.sum(axis=1), rtol=rtol.max())
        assert np.all(w[~(want == 0)] >= np.finfo(dtype).tiny)  # never subnormal


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**32 - 1), ties=st.sampled_from([0, 1, 2]),
       big=st.booleans(), f64=st.booleans())
def test_property_rows_topk_is_exact_with_ties(n, seed, ties, big, f64):
    """The shared top-k core as mode=topk calls it: one score row, exact with ties and huge values."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal(n)
    if ties == 1:
        vals = np.round(vals * 2)
    elif ties == 2:
        vals[:] = 1.5
    if big:
        vals *= 1e300 if f64 else 1e37
    vals = vals.astype(np.float64 if f64 else np.float32)
    k = int(rng.integers(1, n + 1))
    out_s = np.empty((1, k), dtype=vals.dtype)
    out_i = np.empty((1, k), dtype=np.int32)
    rows_topk(vals[None, :].copy(), k, np.arange(n, dtype=np.int64), out_s, out_i)
    out_s, out_i = out_s[0], out_i[0].astype(np.int64)
    assert np.all(out_i >= 0) and len(set(out_i.tolist())) == k
    np.testing.assert_array_equal(np.sort(vals[out_i]), np.sort(vals)[n - k:])
    np.testing.assert_array_equal(out_s, vals[out_i])


# ------------------------------------------------------------------------------------------- top-k mode
@pytest.mark.parametrize("is_causal", [False, True])
def test_topk_equals_exact_topk_of_routed_keys(rng, is_causal):
    S, L, kk = 1500, 300, 20
    q, k, _ = clustered(rng, S, L)
    sel = ClusterSelector(n_clusters=20, n_probe=3).build(k)
    pattern = sel.query(q, kk, is_causal=is_causal)
    if is_causal:  # the candidates: the visible keys of the causal index's routed clusters (short rows: all)
        mask = causal_oracle_mask(sel, q, k)
        # Documented rule (Selector.query): a row with at most kk allowed keys holds all of them.
        few = causal_mask(L, S).sum(axis=1) <= kk
        mask[few] = causal_mask(L, S)[few]
    else:
        mask = oracle_mask(sel, q, k)
    s = q.astype(np.float64) @ k.astype(np.float64).T
    s_masked = np.where(mask, s, -np.inf)
    per_row = pattern.nnz_per_row
    np.testing.assert_array_equal(per_row, np.minimum(mask.sum(axis=1), kk))
    sel_mask = pattern.to_mask()
    assert not (sel_mask & ~mask).any(), "selected a key outside the routed (causal) set"
    # tie-aware: the selected scores equal the oracle's top scores (float32 scoring: 1e-4 slack)
    for i in range(L):
        got = np.sort(s[i, sel_mask[i]])[::-1]
        want = np.sort(s_masked[i])[::-1][:per_row[i]]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_topk_recall_vs_global_exact_topk_on_clustered_data(rng):
    S, L, kk = 4000, 400, 16
    q, k, _ = clustered(rng, S, L, centres=32)
    sel = ClusterSelector(n_clusters=32, n_probe=4).build(k)
    pattern = sel.query(q, kk)
    _, ids = exact_topk(q, k, kk)
    got = pattern.to_padded(kk)
    recall = np.mean([len(np.intersect1d(got[i], ids[i])) / kk for i in range(L)])
    assert recall > 0.9, recall  # observed 1.0


def test_topk_k_larger_than_routed_set_returns_all_routed(rng):
    q, k, _ = clustered(rng, 300, 40)
    sel = ClusterSelector(n_clusters=10, n_probe=2).build(k)
    mask = oracle_mask(sel, q, k)
    np.testing.assert_array_equal(sel.query(q, 250).to_mask(), mask)  # k below S: the routed set
    assert sel.query(q, 10_000).to_mask().all()  # k >= S: every key (Selector.query's documented rule)


def test_float16_values_are_upcast(rng):
    q, k, v = clustered(rng, 400, 30)
    sel = ClusterSelector(n_clusters=6, n_probe=2, mode="block").build(k)
    out16, lse16 = sel.attend(q, v.astype(np.float16))
    out32, lse32 = sel.attend(q, v.astype(np.float16).astype(np.float32))
    assert out16.dtype == np.float32
    np.testing.assert_array_equal(out16, out32)
    np.testing.assert_array_equal(lse16, lse32)


def test_exp_pass_never_wraps_above_the_bound():
    # s - m > 88 cannot happen through the selector (m bounds s); if rounding ever broke that, the
    # weight must stay positive and finite-or-huge, never a wrapped negative number.
    s = np.array([[200.0, 0.0]], dtype=np.float32)
    sums = np.empty(1, dtype=np.float32)
    z = np.zeros(1, dtype=np.int64)
    ck.shifted_exp_rows_f32(s, np.zeros(1, dtype=np.float32), -80.0, False, z, z, sums)
    assert s[0, 0] > 1e37 and s[0, 1] == pytest.approx(1.0, rel=1e-6)


def test_float64_keys_and_registry(rng):
    q, k, v = clustered(rng, 600, 50, dtype=np.float64)
    sel = get_selector("cluster:n_clusters=6,n_probe=2,mode=block")
    assert isinstance(sel, ClusterSelector) and sel.params["mode"] == "block"
    sel.build(k)
    out, lse = sel.attend(q, v.astype(np.float32))
    assert out.dtype == np.float64
    ref, ref_lse = masked_attention(q, k, v.astype(np.float32), oracle_mask(sel, q, k), 0.25)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


@pytest.mark.parametrize("split", [0.0, 1.0])
def test_route_by_mean_routes_by_each_clusters_member_mean(rng, split):
    q, k, v = clustered(rng, 700, 40)
    sel = ClusterSelector(n_clusters=12, n_probe=3, mode="block", split=split).build(k)
    assert sel.params["route_by"] == "mean" and sel.params["spherical"] is True  # the defaults
    kc = k.astype(np.float64) - sel.mean_.astype(np.float64)
    for c in range(sel.n_clusters_):
        members = kc[sel.assignment_ == c]
        want = members.mean(axis=0) if len(members) else sel.kmeans_centroids_[c]
        np.testing.assert_allclose(sel.centroids_[c], want, atol=1e-5)
    # routing ranks clusters by q . mean (float64 oracle; near-ties aside)
    scores = q.astype(np.float64) @ sel.centroids_.astype(np.float64).T
    route = sel.route(q)
    got = np.take_along_axis(scores, route.astype(np.int64), axis=1)
    kth = -np.sort(-scores, axis=1)[:, 2]
    assert np.all(got >= kth[:, None] - 1e-4 * (1 + np.abs(kth[:, None])))
    # attend stays exact over the routed keys (the shift bound uses the same vectors)
    out, lse = sel.attend(q, v)
    ref, ref_lse = masked_attention(q, k, v, oracle_mask(sel, q, k), 1 / np.sqrt(k.shape[1]))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    by_centroid = ClusterSelector(n_clusters=12, n_probe=3, route_by="centroid", split=split).build(k)
    np.testing.assert_array_equal(by_centroid.centroids_, by_centroid.kmeans_centroids_)


def test_defaults_scale_with_n(rng):
    _, k, _ = clustered(rng, 900, 1)
    sel = ClusterSelector().build(k)
    assert sel.n_clusters_ == 30 and sel.n_probe_ == 8 and sel.params["split"] == 0
    small = ClusterSelector().build(k[:20])
    assert small.n_clusters_ == 4 and small.n_probe_ == 4
    assert ClusterSelector.unavailable_reason() is None


@pytest.mark.parametrize("split", [1.0, 2.0])
def test_split_breaks_up_exactly_the_oversized_clusters(split):
    # keys of a low-rank mixture: inner-product assignment piles them onto large-norm centroids
    rng = np.random.default_rng(3)
    basis = rng.standard_normal((3, 16))
    k = (rng.standard_normal((3000, 3)) @ basis + 0.05 * rng.standard_normal((3000, 16))).astype(np.float32)
    # Lloyd k-means (spherical=False): its large-norm centroids are what inner-product assignment favours
    coarse = ClusterSelector(n_clusters=30, split=0, spherical=False).build(k)
    sizes = np.bincount(coarse.assignment_, minlength=30)
    target = 3000 / 30
    assert sizes.max() > split * target  # the premise: some cluster is oversized
    sel = ClusterSelector(n_clusters=30, split=split, spherical=False).build(k)
    np.testing.assert_array_equal(sel.coarse_centroids_, coarse.kmeans_centroids_)  # same seed, same k-means
    parts = np.bincount(sel.parent_, minlength=30)
    expected = np.where(sizes > split * target, np.ceil(sizes / target), 1).astype(int)
    np.testing.assert_array_equal(parts, expected)
    assert sel.n_clusters_ == expected.sum() == len(sel.centroids_)
    # every key keeps its coarse cluster and sits in its nearest part (checked by the oracle)
    np.testing.assert_array_equal(sel.parent_[sel.assignment_], coarse.assignment_)
    oracle_assignment(sel, k)
    assert np.bincount(sel.assignment_).max() < sizes.max()


# --------------------------------------------------------------------------------------------- errors
def test_error_messages(rng):
    _, k, v = clustered(rng, 100, 1)
    with pytest.raises(ValueError, match=r"n_probe must be <= n_clusters; got n_probe=9 > n_clusters=4"):
        ClusterSelector(n_clusters=4, n_probe=9)
    with pytest.raises(ValueError, match=r"n_clusters=200 > n_keys=100"):
        ClusterSelector(n_clusters=200).build(k)
    with pytest.raises(ValueError, match=r"parameter mode must be one of 'topk', 'block'; got 'dense'"):
        ClusterSelector(mode="dense")
    with pytest.raises(ValueError, match=r"parameter assign must be one of 'ip', 'l2'"):
        ClusterSelector(assign="cos")
    with pytest.raises(ValueError, match=r"parameter route_by must be one of 'mean', 'centroid'"):
        ClusterSelector(route_by="max")
    with pytest.raises(ValueError, match=r"train_sample must be >= n_clusters"):
        ClusterSelector(n_clusters=10, train_sample=5)
    with pytest.raises(ValueError, match=r"n_probe=16 exceeds the 10 clusters chosen for S=100"):
        ClusterSelector(n_probe=16).build(k)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['nprobe'\]"):
        ClusterSelector(nprobe=3)
    sel = ClusterSelector(n_clusters=4, n_probe=2)
    with pytest.raises(RuntimeError, match="not built"):
        sel.attend(k, v)
    with pytest.raises(RuntimeError, match="not built"):
        sel.route(k)
    sel.build(k)
    with pytest.raises(ValueError, match=r"values must have shape \(S=100, Ev\)"):
        sel.attend(k, v[:50])
    with pytest.raises(ValueError, match=r"queries must have shape \(L, E=16\)"):
        sel.attend(k[:, :8], v)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        sel.attend(k, v, is_causal=1)
    with pytest.raises(ValueError, match="values contains NaN"):
        sel.attend(k, np.full_like(v, np.nan))


@settings(max_examples=15, deadline=None)
@given(S=st.integers(1, 120), L=st.integers(1, 30), C=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       causal=st.booleans())
def test_property_block_attend_is_exact_on_routed_keys(S, L, C, seed, causal):
    rng = np.random.default_rng(seed)
    C = min(C, S)
    p = int(rng.integers(1, C + 1))
    q = rng.standard_normal((L, 5)).astype(np.float32)
    k = rng.standard_normal((S, 5)).astype(np.float32)
    v = rng.standard_normal((S, 3)).astype(np.float32)
    sel = ClusterSelector(n_clusters=C, n_probe=p, mode="block").build(k)
    out, lse = sel.attend(q, v, is_causal=causal)
    mask = causal_oracle_mask(sel, q, k) if causal else oracle_mask(sel, q, k)
    ref, ref_lse = masked_attention(q, k, v, mask, 5 ** -0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    assert not np.isnan(out).any()


# ------------------------------------------------------------------------------- routing kernels
@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 150), C=st.integers(1, 70), p=st.integers(1, 70), ties=st.booleans(),
       f64=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_property_col_argmax_and_top_p_match_numpy(n, C, p, ties, f64, seed):
    # Oracles: np.argmax (first maximum) and a stable sort by (-score, column): ties to the lower column.
    p = min(p, C)
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((n, C))
    half = rng.standard_normal(C)
    if ties:
        s, half = np.round(s), np.round(half)  # many equal scores
    dt = np.float64 if f64 else np.float32
    s, half = s.astype(dt), half.astype(dt)
    for h in (np.zeros(C, dt), half):
        labels, best = np.full(n, -1, np.int32), np.empty(n, dt)
        ck.col_argmax(np.ascontiguousarray(s.T), h, labels, best)
        np.testing.assert_array_equal(labels, np.argmax(s - h, axis=1))
        np.testing.assert_array_equal(best, np.max(s - h, axis=1))
    want = np.argsort(-s, axis=1, kind="stable")[:, :p]
    for fn in (ck.row_top_p, ck.row_top_p_serial):
        ids, vals = fn(s, p, ck.NO_POS, ck.NO_POS)
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(vals, np.take_along_axis(s, want, axis=1))


@pytest.mark.parametrize("C, p", [(64, 8), (60, 8), (57, 8), (8, 1), (16, 2), (9, 2)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_p_when_chunks_equal_probes(C, p, ties, rng):
    # ceil(C / 8) == p: the threshold is the least chunk maximum (every chunk holds one of the p best
    # chunk maxima), a path the property test above reaches only by chance.
    s = rng.standard_normal((300, C))
    if ties:
        s = np.round(s * 2)
    s[7] = 1.0  # a row of equal scores: the first p columns
    s = s.astype(np.float32)
    want = np.argsort(-s, axis=1, kind="stable")[:, :p]
    for fn in (ck.row_top_p, ck.row_top_p_serial):
        ids, vals = fn(s, p, ck.NO_POS, ck.NO_POS)
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(vals, np.take_along_axis(s, want, axis=1))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-12)])
@pytest.mark.parametrize("T", [1, 3, 4, 64])
def test_prefix_kernel_matches_float64_oracle(rng, dtype, tol, T):
    # Row r attends to the first n_vis[r] keys exactly, T rows per pair of BLAS products (tiles with
    # rows of different prefixes: later keys must get weight 0); n_vis = 0 gives zeros and lse = -inf.
    B, E, Ev = 40, 8, 5
    Ks, Vs = rng.standard_normal((B, E)).astype(dtype), rng.standard_normal((B, Ev)).astype(dtype)
    Qs = (3 * rng.standard_normal((7, E))).astype(dtype)  # large scores: the shift must be the row max
    n_vis = np.array([1, 40, 0, 17, 2, 40, 33], dtype=np.int64)
    out = np.full((7, Ev), np.nan, dtype=dtype)
    lse = np.full(7, np.nan, dtype=dtype)
    kernel = ck.attend_prefix_tiles_f32 if dtype == np.float32 else ck.attend_prefix_tiles_f64
    kernel(Qs, n_vis, Ks, Vs, -80.0 if dtype == np.float32 else -700.0, T, np.full(T * B, np.nan, dtype=dtype),
           np.full(T * Ev, np.nan, dtype=dtype), np.full(T, np.nan, dtype=dtype), out, lse)
    for r, n in enumerate(n_vis):
        if n == 0:
            assert lse[r] == -np.inf and np.all(out[r] == 0)
            continue
        s = Ks[:n].astype(np.float64) @ Qs[r].astype(np.float64)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(out[r], w @ Vs[:n] / w.sum(), atol=tol, rtol=tol)
        assert lse[r] == pytest.approx(s.max() + np.log(w.sum()), abs=tol * 10)


def test_prefix_rows_of_a_zero_width_block():
    # every row sees no key (B = 0): zeros and -inf, no product over an empty block
    kernel = ck.attend_prefix_tiles_f32
    out = np.full((3, 2), np.nan, np.float32)
    lse = np.full(3, np.nan, np.float32)
    kernel(np.ones((3, 4), np.float32), np.zeros(3, np.int64), np.zeros((0, 4), np.float32),
           np.zeros((0, 2), np.float32), -80.0, 2, np.empty(0, np.float32), np.empty(4, np.float32),
           np.empty(2, np.float32), out, lse)
    assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("is_causal", [False, True])
def test_overflowing_scores_raise_instead_of_garbage(rng, is_causal):
    # finite float32 inputs whose q.k overflows: routed rows (NaN or +inf lse) and exact-prefix rows alike
    k = rng.standard_normal((300, 8)).astype(np.float32)
    v = rng.standard_normal((300, 4)).astype(np.float32)
    q = k[:50].copy()
    for r in (3, 40):  # row 3 is an exact-prefix row when causal, row 40 is routed
        q[r] *= np.float32(3e38) / np.abs(q[r]).max()
    sel = ClusterSelector(n_clusters=4, n_probe=2, mode="block").build(k)
    with pytest.raises(ValueError, match="attention scores overflow float32"):
        sel.attend(q, v, is_causal=is_causal)
    import sparseattn as sa
    with pytest.raises(ValueError, match="attention scores overflow float32"):
        sa.sparse_attention(q, k, v, "cluster:mode=block,n_clusters=4,n_probe=2", is_causal=is_causal)
    # the same rows in float64 are fine
    o, lse = sel.attend(q.astype(np.float64), v, is_causal=is_causal)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))


def test_scan_pairs_marks_empty_and_lists_tiny_sums():
    pm = np.array([0.0, 1.0, -np.inf, 2.0, 3.0, 4.0], dtype=np.float32)
    po = np.zeros((6, 3), dtype=np.float32)
    po[:, 2] = [1.0, 0.0, 0.0, 1e-25, np.nan, 1e-19]
    bad = ck.scan_pairs(pm, po, 1e-20)
    np.testing.assert_array_equal(bad, [3])  # 0 < sum < tiny; NaN is neither empty nor refined
    np.testing.assert_array_equal(pm, [0.0, -np.inf, -np.inf, 2.0, 3.0, 4.0])  # sum 0 -> empty


# ------------------------------------------------------------------------------- the adapter's contract
def test_attends_follows_mode_and_block_mode_refuses_bias():
    topk = ClusterSelector(n_clusters=4)
    block = ClusterSelector(n_clusters=4, mode="block")
    assert topk.attends is False and block.attends is True
    assert topk.not_supported_reasons(n_keys=100, dim=8, is_causal=True, bias=True) == []
    assert block.not_supported_reasons(n_keys=100, dim=8, is_causal=True, bias=False) == []
    assert block.not_supported_reasons(n_keys=100, bias=True) == [
        "bias is not supported by cluster:mode=block (block mode attends by itself); use mode=topk or drop bias"]
    assert topk.set_params(mode="block").attends is True  # mode is a query-time parameter


def test_selector_is_a_thin_adapter_over_index_and_routed_attention(rng):
    from sparseattn.attention.routed import routed_attention
    from sparseattn.index.cluster import ClusterIndex

    q, k, v = clustered(rng, 800, 90)
    sel = ClusterSelector(n_clusters=9, n_probe=3, mode="block", split=1.0).build(k)
    index = ClusterIndex(n_clusters=9, n_probe=3, split=1.0).build(k)
    assert isinstance(sel.index_, ClusterIndex)
    for name in ("n_clusters_", "n_probe_", "centroids_", "perm_", "cluster_ptr_", "assignment_", "radius_",
                 "mean_", "parent_", "kmeans_centroids_", "coarse_centroids_"):
        np.testing.assert_array_equal(getattr(sel, name), getattr(index, name), err_msg=name)
    np.testing.assert_array_equal(sel.route(q), index.route(q)[0])
    for is_causal in (False, True):
        a = sel.attend(q, v, is_causal=is_causal, scale=0.4)
        b = routed_attention(index, q, v, is_causal=is_causal, scale=0.4)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    topk = ClusterSelector(n_clusters=9, n_probe=3, split=1.0).build(k)
    assert topk.query(q, 12) == index.search(q, 12)


@pytest.mark.parametrize("mode", ["block", "topk"])
def test_strict_causal_off_routes_over_the_global_index(rng, mode):
    # strict_causal=False: one index over all keys, routing masked to the visible keys; with exact_prefix
    # (block mode) a row seeing at most n_probe*S/C = 250 keys attends to all of them.
    S = L = 1000
    q, k, v = clustered(rng, S, L)
    sel = ClusterSelector(n_clusters=16, n_probe=4, mode=mode, strict_causal=False).build(k)
    visible = causal_mask(L, S)
    mask = oracle_mask(sel, q, k, np.arange(L)) & visible
    if mode == "block":
        few = visible.sum(axis=1) <= 250
        mask[few] = visible[few]
        out, lse = sel.attend(q, v, is_causal=True)
        ref, ref_lse = masked_attention(q, k, v, mask, 0.25)
        np.testing.assert_allclose(out, ref, atol=1e-5)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
        np.testing.assert_array_equal(sel.query(q, 8, is_causal=True).to_mask(), mask)
    else:
        few = visible.sum(axis=1) <= 8  # Selector.query's rule: at most k allowed keys -> all of them
        mask[few] = visible[few]
        got = sel.query(q, 8, is_causal=True).to_mask()
        assert not (got & ~mask).any()
        s = np.where(mask, q.astype(np.float64) @ k.astype(np.float64).T, -np.inf)
        for i in range(0, L, 50):
            want = np.sort(s[i])[::-1][:min(8, int(mask[i].sum()))]
            np.testing.assert_allclose(np.sort(s[i, got[i]])[::-1][:want.size], want, rtol=1e-5, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 90), C=st.integers(1, 70), p_frac=st.floats(0.0, 1.0), f64=st.booleans(),
       seed=st.integers(0, 2**16))
def test_causal_top_p_ranks_later_clusters_last(n, C, p_frac, f64, seed):
    # Oracle: a stable argsort with the clusters whose first key is after the row scored -inf; the
    # scores returned are the clusters' own (the score bounds of attention need them finite).
    rng = np.random.default_rng(seed)
    p = max(1, min(C, int(round(p_frac * C))))
    s = rng.standard_normal((n, C)).astype(np.float64 if f64 else np.float32)
    kmin = rng.integers(0, 50, C).astype(np.int64)
    qpos = rng.integers(-5, 55, n).astype(np.int64)
    masked = np.where(kmin[None, :] > qpos[:, None], -np.inf, s)
    want = np.argsort(-masked, axis=1, kind="stable")[:, :p]
    for fn in (ck.row_top_p, ck.row_top_p_serial):
        ids, vals = fn(s, p, kmin, qpos)
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(vals, np.take_along_axis(s, want, axis=1))


@settings(max_examples=25, deadline=None)
@given(R=st.integers(1, 400), B=st.integers(1, 60), f64=st.booleans(), seed=st.integers(0, 2**16))
def test_prefix_attention_does_not_depend_on_the_thread_count(R, B, f64, seed):
    # Rows go in tiles and shares start at multiples of the tile: 1, 2 and 3 workers give the same bits,
    # and each row matches a float64 softmax over its prefix.
    from sparseattn.attention.routed import prefix_attention

    rng = np.random.default_rng(seed)
    dt = np.float64 if f64 else np.float32
    Qs = (2 * rng.standard_normal((R, 6))).astype(dt)
    Ks, Vs = rng.standard_normal((B, 6)).astype(dt), rng.standard_normal((B, 3)).astype(dt)
    n_vis = np.sort(rng.integers(0, B + 1, R)).astype(np.int64)
    runs = []
    for n in (1, 2, 3):
        with worker_threads(n):
            runs.append(prefix_attention(Qs, n_vis, Ks, Vs, n))
    for o, lse in runs[1:]:
        np.testing.assert_array_equal(o, runs[0][0])
        np.testing.assert_array_equal(lse, runs[0][1])
    for r in range(R):
        n = n_vis[r]
        if n == 0:
            assert runs[0][1][r] == -np.inf and not runs[0][0][r].any()
            continue
        s = Ks[:n].astype(np.float64) @ Qs[r].astype(np.float64)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(runs[0][0][r], w @ Vs[:n] / w.sum(), atol=1e-5 if dt == np.float32 else 1e-12)


def test_prefix_attention_from_another_python_thread_gives_the_same_bits():
    # the tiles' BLAS products called from a Python thread of the caller's own (entering worker_threads
    # there) give the bits of the main thread's call
    import threading

    from sparseattn.attention.routed import prefix_attention

    rng = np.random.default_rng(7)
    Qs = rng.standard_normal((700, 16)).astype(np.float32)
    Ks, Vs = rng.standard_normal((900, 16)).astype(np.float32), rng.standard_normal((900, 8)).astype(np.float32)
    n_vis = np.sort(rng.integers(0, 901, 700)).astype(np.int64)
    with worker_threads(2):
        want = prefix_attention(Qs, n_vis, Ks, Vs, 2)
    got = {}

    def run() -> None:
        with worker_threads(2):
            got["x"] = prefix_attention(Qs, n_vis, Ks, Vs, 2)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    np.testing.assert_array_equal(got["x"][0], want[0])
    np.testing.assert_array_equal(got["x"][1], want[1])


@pytest.mark.parametrize("magnitude", [1e-30, 1e-120, 1e10])
@pytest.mark.parametrize("strict", [True, False])
def test_causal_block_at_extreme_key_magnitudes(rng, magnitude, strict):
    # float64 keys far from 1: the k-means (FAISS trains in float32) must still cluster them (at 1e-30 their
    # squared norms underflowed, the centroids became NaN, the keys all went to one cluster and causal
    # routing picked empty clusters: rows that see keys got lse = -inf); every row that sees a key reads
    # one, and the output is float64 attention over the keys query() reports
    S = L = 1200
    base, qs, v = clustered(rng, S, L, dtype=np.float64)
    k = base * magnitude
    q = qs / magnitude * 0.25
    sel = ClusterSelector(n_clusters=8, n_probe=2, mode="block", strict_causal=strict).build(k)
    out, lse = sel.attend(q, v, is_causal=True, scale=1.0)
    assert np.isfinite(lse).all() and np.isfinite(out).all()
    mask = sel.query(q, 8, is_causal=True).to_mask()
    assert (mask.sum(axis=1) > 0).all()
    ref, ref_lse = masked_attention(q, k, v, mask, 1.0)
    np.testing.assert_allclose(out, ref, atol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-10)
    if strict:
        np.testing.assert_array_equal(mask, causal_oracle_mask(sel, q, k))


def test_causal_bands_are_built_when_first_reached(rng, monkeypatch):
    # Queries after a cache reach the last band only: the other bands are never built; queries that see at
    # most T keys build none.  From many threads at once, a band is built once.
    import threading

    from sparseattn.index import PrefixClusterIndex

    S = 8000
    q, k, v = clustered(rng, S, 64)
    sel = ClusterSelector(n_clusters=24, n_probe=1, mode="block").build(k)
    sel.attend(q, v, is_causal=True, query_positions=np.arange(S - 64, S))
    index = sel.causal_index()
    assert [b.is_built for b in index.bands_] == [False, False, True]
    sel.attend(q, v, is_causal=True, query_positions=np.arange(64) + 100)  # all exact (T = 384)
    assert [b.is_built for b in index.bands_] == [False, False, True]
    built = []
    original = PrefixClusterIndex.build

    def counting(self, keys, n_train_keys=None):
        built.append(n_train_keys)
        return original(self, keys, n_train_keys)

    monkeypatch.setattr(PrefixClusterIndex, "build", counting)
    outs = [None] * 8
    barrier = threading.Barrier(8)

    def work(t):
        barrier.wait()
        outs[t] = sel.attend(q, v, is_causal=True, query_positions=np.full(64, 1000))[0]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert built == [384] and [b.is_built for b in index.bands_] == [True, False, True]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


# ------------------------------------------------------------------------------------------ spread routing
def _spread_oracle(sel: ClusterSelector, q: np.ndarray, k: np.ndarray, a: float) -> tuple[np.ndarray, np.ndarray]:
    """Float64 from the keys alone: each cluster's member mean (centred) and root mean per-dimension
    variance, the ranking score q.mu + a |q| sigma, and q.mu."""
    assignment = oracle_assignment(sel, k)
    kc = k.astype(np.float64) - k.astype(np.float64).mean(axis=0)
    C, E = sel.n_clusters_, k.shape[1]
    mu, sigma = np.zeros((C, E)), np.zeros(C)
    for c in range(C):
        members = kc[assignment == c]
        if len(members):
            mu[c] = members.mean(axis=0)
            sigma[c] = np.sqrt(members.var(axis=0).mean())
    qd = q.astype(np.float64)
    base = qd @ mu.T
    return base + a * np.linalg.norm(qd, axis=1)[:, None] * sigma[None, :], base


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spread_routing_ranks_by_the_spread_bound_and_attends_exactly(rng, dtype):
    q, k, v = clustered(rng, 1500, 200, dtype=dtype)
    k[:300] += (3.0 * rng.standard_normal((300, k.shape[1]))).astype(dtype)  # some clusters spread widely
    a = 1.5
    sel = ClusterSelector(n_clusters=20, n_probe=3, mode="block", spread=a).build(k)
    rank, base = _spread_oracle(sel, q, k, a)
    ids, scores = sel.index_.route(q)
    chosen = np.zeros_like(rank, dtype=bool)
    np.put_along_axis(chosen, ids.astype(np.int64), True, axis=1)
    # the chosen clusters rank at least as high as every other one (float32 rounding aside) ...
    worst_chosen = np.where(chosen, rank, np.inf).min(axis=1)
    best_other = np.where(chosen, -np.inf, rank).max(axis=1)
    np.testing.assert_array_less(best_other - 1e-4 * (1 + np.abs(rank).max(axis=1)), worst_chosen)
    # ... the order differs from q.c alone on some rows, and the scores returned are q.c (the bounds use them)
    plain = np.sort(np.argsort(-base, axis=1)[:, :3], axis=1)
    assert (np.sort(ids, axis=1) != plain).any(axis=1).mean() > 0.05
    np.testing.assert_allclose(scores, np.take_along_axis(base, ids.astype(np.int64), axis=1),
                               rtol=1e-4 if dtype == np.float32 else 1e-10, atol=1e-4 if dtype == np.float32 else 1e-10)
    # attention stays exact softmax over the keys of the clusters it routed to
    assignment = oracle_assignment(sel, k)
    mask = chosen[:, assignment]
    out, lse = sel.attend(q, v, scale=0.3)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.3)
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(lse, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_array_equal(sel.query(q, 1).to_mask(), mask)
    # spread = 0 is the plain routing, bit for bit
    sel0 = ClusterSelector(n_clusters=20, n_probe=3, mode="block", spread=0.0).build(k)
    np.testing.assert_array_equal(sel0.route(q), ClusterSelector(n_clusters=20, n_probe=3, mode="block").build(k).route(q))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spread_routing_is_scale_invariant_at_extreme_query_magnitudes(rng, dtype):
    # q.c + a |q| sigma_c scales with |q|: the same clusters at 1e-30 .. 1e30 (float32) / 1e-200 .. 1e200
    q, k, _ = clustered(rng, 800, 60, dtype=dtype)
    sel = ClusterSelector(n_clusters=12, n_probe=3, mode="block", spread=1.5).build(k)
    ids = np.sort(sel.route(q), axis=1)
    for f in ((1e-30, 1e30) if dtype == np.float32 else (1e-200, 1e200)):
        np.testing.assert_array_equal(np.sort(sel.route(q * dtype(f)), axis=1), ids)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "wide"])
def test_spread_refuses_bad_values_naming_it(bad):
    from sparseattn.index import ClusterIndex

    with pytest.raises((ValueError, TypeError), match="spread"):
        ClusterSelector(spread=bad)
    if not isinstance(bad, str):
        with pytest.raises(ValueError, match="spread"):
            ClusterIndex(spread=bad)


def test_spread_is_refused_with_the_estimate_and_top_p(rng):
    from sparseattn.attention.routed import routed_attention
    from sparseattn.index import ClusterIndex

    q, k, v = clustered(rng, 600, 20)
    for extra in ({"estimate": -1}, {"top_p": 0.9}):
        with pytest.raises(ValueError, match="spread=1.0 changes the fixed n_probe routing"):
            ClusterSelector(n_clusters=10, n_probe=2, mode="block", spread=1.0, **extra)
        sel = ClusterSelector(n_clusters=10, n_probe=2, mode="block", spread=1.0)
        with pytest.raises(ValueError, match="spread=1.0 changes the fixed n_probe routing"):
            sel.set_params(**extra)
        assert sel.get_params()["spread"] == 1.0 and sel.get_params()["estimate"] == 0  # left unchanged
        index = ClusterIndex(n_clusters=10, n_probe=2, spread=1.0).build(k)  # the index used directly
        with pytest.raises(ValueError, match="spread=1.0 changes the fixed n_probe routing"):
            routed_attention(index, q, v, **extra)


@settings(max_examples=15, deadline=None)
@given(S=st.integers(1, 400), L=st.integers(1, 30), C=st.integers(1, 12), seed=st.integers(0, 2**32 - 1),
       causal=st.booleans(), a=st.sampled_from([0.5, 2.0, 40.0]))
def test_property_spread_block_attend_is_exact_on_the_keys_it_reports(S, L, C, seed, causal, a):
    rng = np.random.default_rng(seed)
    C = min(C, S)
    p = int(rng.integers(1, C + 1))
    q = rng.standard_normal((L, 5)).astype(np.float32)
    k = (rng.standard_normal((S, 5)) * rng.uniform(0.1, 3.0, (S, 1))).astype(np.float32)
    v = rng.standard_normal((S, 3)).astype(np.float32)
    sel = ClusterSelector(n_clusters=C, n_probe=p, mode="block", spread=a).build(k)
    out, lse = sel.attend(q, v, is_causal=causal)
    mask = sel.query(q, 1, is_causal=causal).to_mask()
    if causal:
        assert not np.triu(mask, 1).any()  # query i (position i) never reads a key j > i
    ref, ref_lse = masked_attention(q, k, v, mask, 5 ** -0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))


# ------------------------------------------------------------------ two-level build and wide routing
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), C=st.integers(1, 1500), p_frac=st.floats(0.0, 1.0), kind=st.sampled_from(
    ["normal", "ties", "masked", "huge", "flat"]), f64=st.booleans(), causal=st.booleans(),
    seed=st.integers(0, 2**16))
def test_property_top_p_of_many_clusters_matches_a_stable_sort(n, C, p_frac, kind, f64, causal, seed):
    # Oracle: a stable argsort by (-score, column), with clusters after the row at -inf when causal.
    # Many columns and probes reach every path of the selection: the threshold bisection, ranking by
    # counting (<= 128 candidates) and sorted insertion (more: rows that see few clusters, equal scores).
    rng = np.random.default_rng(seed)
    p = max(1, min(C, int(round(p_frac * min(C, 96)))))
    s = rng.standard_normal((n, C))
    if kind == "ties":
        s = np.round(s * 2)
    elif kind == "masked":
        s = np.where(rng.random((n, C)) < 0.5, -np.inf, s)
    elif kind == "huge":
        s = s * 1e30
    elif kind == "flat":
        s[:] = 2.0
    s = s.astype(np.float64 if f64 else np.float32)
    kmin = rng.integers(0, 50, C).astype(np.int64) if causal else ck.NO_POS
    qpos = rng.integers(-5, 55, n).astype(np.int64) if causal else ck.NO_POS
    masked = np.where(kmin[None, :] > qpos[:, None], -np.inf, s) if causal else s
    want = np.argsort(-masked, axis=1, kind="stable")[:, :p]
    for fn in (ck.row_top_p, ck.row_top_p_serial):
        ids, vals = fn(s, p, kmin, qpos)
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(vals, np.take_along_axis(s, want, axis=1))


def test_top_p_rows_with_nan_still_get_in_range_distinct_columns(rng):
    s = rng.standard_normal((20, 700)).astype(np.float32)
    s[::2, ::5] = np.nan
    s[3] = np.nan
    ids, _ = ck.row_top_p_serial(s, 24, ck.NO_POS, ck.NO_POS)
    assert ids.min() >= 0 and ids.max() < 700
    clean = np.argsort(-s[1::2], axis=1, kind="stable")[:, :24]  # rows without NaN: exact
    np.testing.assert_array_equal(ids[1::2], clean)


def test_spread_rank_is_the_float64_sum(rng):
    s = rng.standard_normal((30, 50)).astype(np.float32)
    qn, width = rng.random(30) * 1e30, rng.random(50) * 1e-20
    out = np.full((30, 50), np.nan)
    ck.spread_rank(s, qn, width, out)
    np.testing.assert_array_equal(out, s.astype(np.float64) + qn[:, None] * width[None, :])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_coarse_build_is_two_levels_and_block_attention_is_exact_over_its_clusters(rng, dtype):
    # coarse=8, n_clusters=32: a k-means of 8 clusters, each split by a Lloyd k-means of its members into
    # ceil(size / (S / 32)) parts; every key keeps its coarse cluster and sits in its nearest part
    # (oracle_assignment, float64); block attention is exact over the key set query() reports.
    q, k, v = clustered(rng, 2000, 300, dtype=dtype)
    coarse = ClusterSelector(n_clusters=8).build(k)
    sel = ClusterSelector(n_clusters=32, coarse=8, n_probe=6, mode="block").build(k)
    np.testing.assert_array_equal(sel.coarse_centroids_, coarse.kmeans_centroids_)  # same seed and sample
    np.testing.assert_array_equal(sel.parent_[sel.assignment_], coarse.assignment_)
    sizes = np.bincount(coarse.assignment_, minlength=8)
    parts = np.bincount(sel.parent_, minlength=8)
    assert (parts <= np.ceil(sizes / (2000 / 32))).all() and sel.n_clusters_ == parts.sum() >= 32
    assert np.bincount(sel.assignment_, minlength=sel.n_clusters_).min() > 0  # parts left empty are dropped
    oracle_assignment(sel, k)
    assert sel.n_probe_ == 6
    mask = sel.query(q, 1).to_mask()
    out, lse = sel.attend(q, v, scale=0.3)
    ref, ref_lse = masked_attention(q, k, v, mask, 0.3)
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(lse, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])
    assert mask.sum(axis=1).max() < 2000  # routed: not every key
    # every cluster probed: exact attention; causal over the global index: masked to the visible keys
    full = ClusterSelector(n_clusters=32, coarse=8, n_probe=32, mode="block").build(k)
    assert full.n_probe_ == full.n_clusters_
    out, _ = full.attend(q, v, scale=0.3)
    np.testing.assert_allclose(out, masked_attention(q, k, v, np.ones((300, 2000), bool), 0.3)[0], atol=TOL[dtype])
    loose = ClusterSelector(n_clusters=32, coarse=8, n_probe=32, mode="block", strict_causal=False).build(k)
    out, _ = loose.attend(q, v, scale=0.3, is_causal=True)
    np.testing.assert_allclose(out, masked_attention(q, k, v, causal_mask(300, 2000), 0.3)[0], atol=TOL[dtype])


def test_coarse_split_members_oracle_and_determinism(rng):
    # The member k-means itself against a numpy Lloyd: same start (members evenly spaced), same rounds.
    from sparseattn.index.kmeans import split_every

    x = rng.standard_normal((500, 6))
    assignment = rng.integers(0, 4, 500).astype(np.int32)
    assignment[assignment == 3] = 2  # cluster 3 empty
    out, cent, parent = split_every(x, assignment, 4, 40.0, 3)
    again = split_every(x, assignment, 4, 40.0, 3)
    np.testing.assert_array_equal(out, again[0])
    np.testing.assert_array_equal(cent, again[1])
    want_parts = []
    for c in range(4):
        rows = np.flatnonzero(assignment == c)
        if rows.size == 0:
            continue
        f = int(min(np.ceil(rows.size / 40.0), rows.size))
        xs = x[rows]
        cc = xs[[(2 * u + 1) * rows.size // (2 * f) for u in range(f)]].copy()
        for it in range(4):
            lab = np.argmax(xs @ cc.T - 0.5 * (cc ** 2).sum(1), axis=1)
            if it == 3:
                break
            for u in range(f):
                if (lab == u).any():
                    cc[u] = xs[lab == u].mean(axis=0)
        used = np.unique(lab)
        want_parts += [(c, cc[u]) for u in used]
        got_ids = out[rows]
        base = np.flatnonzero(parent == c)
        np.testing.assert_array_equal(got_ids, base[np.searchsorted(used, lab)])
    np.testing.assert_array_equal(parent, [c for c, _ in want_parts])
    np.testing.assert_allclose(cent, np.array([v for _, v in want_parts]), atol=1e-12)


def test_coarse_refusals_name_the_fix(rng):
    q, k, v = clustered(rng, 400, 10)
    for bad in (0, -1, True, 1.5, "eight"):
        with pytest.raises((ValueError, TypeError), match="coarse"):
            ClusterSelector(coarse=bad)
    for bad in (0, -1, True, 1.5, np.int64(0)):
        with pytest.raises(ValueError, match=r"coarse must be an int >= 1"):
            ClusterIndex(coarse=bad)
    with pytest.raises(ValueError, match=r"coarse must be <= n_clusters .*got coarse=9 > n_clusters=8"):
        ClusterSelector(n_clusters=8, coarse=9)
    with pytest.raises(ValueError, match=r"coarse=4 already splits every cluster; pass split=0"):
        ClusterSelector(n_clusters=8, coarse=4, split=2.0)
    with pytest.raises(ValueError, match=r"train_sample must be >= coarse"):
        ClusterSelector(n_clusters=8, coarse=6, train_sample=5)
    with pytest.raises(ValueError, match=r"coarse=30 exceeds the n_clusters=20 in force for S=400 keys"):
        ClusterIndex(coarse=30).build(k)
    with pytest.raises(ValueError, match=r"coarse=30 exceeds the n_clusters=20 in force for S=400 keys"):
        ClusterSelector(coarse=30, mode="block").build(k).attend(q, v)
    sel = ClusterSelector(n_clusters=16, coarse=4, mode="block").build(k)
    with pytest.raises(ValueError, match=r"strict_causal=False or coarse=None"):
        sel.attend(q, v, is_causal=True)


@pytest.mark.parametrize("big", [1e6, 1e10, 1e14])
@pytest.mark.parametrize("C", [1, 32])
def test_one_huge_key_every_cluster_read_is_exact_attention(big: float, C: int) -> None:
    # one key far longer than the rest dominates the mean key: centring the float32 keys on it would erase
    # the other keys' low-order bits (q.(k - mean) + q.mean cancels), so the index does not centre then, and
    # reading every cluster stays exact attention (against float64)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1000, 16)).astype(np.float32)
    k[17] = big
    q = rng.standard_normal((30, 16)).astype(np.float32)
    v = rng.standard_normal((1000, 5)).astype(np.float32)
    s = q.astype(np.float64) @ k.astype(np.float64).T / 4.0
    w = np.exp(s - s.max(axis=1, keepdims=True))
    ref = (w / w.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    out = sparse_attention(q, k, v, f"cluster:mode=block,n_clusters={C},n_probe={C}")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6


def test_key_mean_skips_a_dominated_mean_only() -> None:
    from sparseattn.index.cluster import CENTRE_LIMIT, key_mean

    rng = np.random.default_rng(1)
    k = rng.standard_normal((5000, 8)).astype(np.float32)
    np.testing.assert_array_equal(key_mean(k), k.mean(axis=0, dtype=np.float64).astype(np.float32))
    off = k + np.float32(1000.0)  # a large common offset: every key is long, the mean is typical
    np.testing.assert_allclose(key_mean(off), off.mean(axis=0, dtype=np.float64), rtol=1e-6)
    out = k.copy()
    out[3] = 5000.0 * CENTRE_LIMIT * 3.0  # one key drags the mean beyond the limit
    assert not key_mean(out).any()
    assert not key_mean(np.zeros((4, 3), np.float64)).any()
    idx = ClusterIndex(n_clusters=4).build(out)
    assert not idx.mean_.any()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("max_keys", [0, 1, 10])
def test_top_p_cap_below_the_best_cluster_still_reads_it(max_keys: int, is_causal: bool) -> None:
    # a cap smaller than every cluster: each row still reads its best cluster (before, it read nothing and
    # returned zeros): every row reads keys, has a finite log-sum-exp and an output inside the values' range
    rng = np.random.default_rng(3)
    S, E = 300, 8
    q = rng.standard_normal((S if is_causal else 10, E)).astype(np.float32)
    k = rng.standard_normal((S, E)).astype(np.float32)
    v = (rng.standard_normal((S, 3)) + 5).astype(np.float32)  # every value above 2: zero rows are wrong
    spec = f"cluster:mode=block,top_p=0.9,max_keys={max_keys}"
    r = sparse_attention_result(q, k, v, spec, is_causal=is_causal)
    assert (r.keys_read > 0).all()
    assert np.isfinite(r.lse).all() and (r.output > 2).all()


@pytest.mark.parametrize("spec", ["cluster:mode=block,estimate=-1", "cluster:mode=block,estimate=2"])
def test_estimate_keeps_float64_values_beyond_float32_range(spec: str) -> None:
    # float64 values of 1e300: the estimate's cluster mean values stay float64 (a float32 copy was inf and
    # the output NaN); the output is finite and inside each value column's range
    rng = np.random.default_rng(1)
    k, q = rng.standard_normal((200, 8)), rng.standard_normal((20, 8))
    v = rng.standard_normal((200, 4)) * 1e300
    out = sparse_attention(q, k, v, spec)
    assert np.isfinite(out).all()
    assert (out >= v.min(axis=0) * (1 + 1e-12)).all() and (out <= v.max(axis=0) * (1 + 1e-12)).all()


def test_estimate_with_subnormal_float32_keys_is_uniform_attention() -> None:
    # queries and keys of 1e-40 (subnormal float32): every score is ~0, so attention is the mean value; the
    # regression term's coefficient passed float32's range (inf, then NaN rows with a finite lse) and is
    # now dropped when it cannot be represented
    rng = np.random.default_rng(1)
    k = (rng.standard_normal((200, 8)) * 1e-40).astype(np.float32)
    q = (rng.standard_normal((20, 8)) * 1e-40).astype(np.float32)
    v = rng.standard_normal((200, 4)).astype(np.float32)
    out = sparse_attention(q, k, v, "cluster:mode=block,estimate=-1")
    np.testing.assert_allclose(out, np.broadcast_to(v.astype(np.float64).mean(axis=0), out.shape), atol=1e-5)


@pytest.mark.parametrize("seed", [2**31, 2**40, -1])
def test_seed_outside_its_range_is_refused_by_name(seed: int) -> None:
    with pytest.raises(TypeError, match="seed"):
        ClusterIndex(seed=1.5)
    # seeds are 31-bit: a larger one is refused by name, not an error from deep inside the build
    with pytest.raises(ValueError, match="seed"):
        ClusterIndex(seed=seed)
    with pytest.raises(ValueError, match="seed"):
        get_selector(f"cluster:mode=block,seed={seed}")


def test_largest_seed_with_split_offsets_builds() -> None:
    # split clusters train with seed + offset: the sum wraps inside the seed range instead of overflowing
    k = np.random.default_rng(0).standard_normal((2000, 8)).astype(np.float32)
    idx = ClusterIndex(seed=2**31 - 1, split=0.5, n_clusters=8).build(k)
    assert idx.n_clusters_ >= 8


def test_spec_strings_refuse_a_repeated_parameter_and_name_nan() -> None:
    with pytest.raises(ValueError, match="given twice"):
        get_selector("cluster:mode=block,n_probe=2,n_probe=3")
    with pytest.raises(ValueError, match="must be finite"):
        get_selector("cluster:mode=block,spread=nan")
    with pytest.raises(ValueError, match="name=value"):
        get_selector("cluster:topk")


@pytest.mark.parametrize("spec", ["cluster", "cluster:mode=block", "cluster:n_probe=3,n_clusters=12",
                                  "cluster:mode=block,estimate=1", "cluster:mode=block,estimate=-1"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_clusters_left_empty_by_duplicate_keys_are_never_the_only_probes(rng, spec, is_causal):
    """100 identical keys: k-means leaves every cluster but one empty.  Routing by the empty clusters'
    centroids had sent about half the queries to empty clusters only: zeros and lse -inf, silently.
    Oracle: every key ties, so any k keys' attention is the mean of their values, and all keys' (block
    mode reads the one full cluster) the mean of every visible value."""
    K = np.tile(np.array([0.3, -1.2, 0.7, 2.0]), (100, 1))[None]
    V = np.arange(200.0).reshape(1, 100, 2)
    q = rng.standard_normal((1, 50 if not is_causal else 100, 4))  # causal: L = S, row i sees i + 1 keys
    res = sparse_attention_result(q, K, V, spec, k=8, is_causal=is_causal)
    out, lse = res.output, res.lse
    assert np.isfinite(lse).all() and res.keys_read.min() >= 1  # keys read exactly, not only estimated
    s = (q @ K[0, 0]) / 2.0  # each row's one scaled score (scale 1 / sqrt(4))
    if "block" in spec:
        n_vis = np.arange(1, q.shape[1] + 1) if is_causal else np.full(q.shape[1], 100)
        expected = np.stack([V[0, :n].mean(axis=0) for n in n_vis])
        np.testing.assert_allclose(out[0], expected, rtol=1e-12)
        np.testing.assert_allclose(lse[0], s[0] + np.log(n_vis), rtol=1e-12)
    else:  # top-8 of tied keys: 8 of them (fewer for early causal rows)
        n_read = np.minimum(8, np.arange(1, q.shape[1] + 1)) if is_causal else np.full(q.shape[1], 8)
        np.testing.assert_allclose(lse[0], s[0] + np.log(n_read), rtol=1e-12)
