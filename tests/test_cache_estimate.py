"""The KV cache's estimation zone (``KVCache(..., estimate=N, selector="cluster")``) against float64 dense attention.

Oracles: numpy float64 softmax attention over every cached key; for clusters made of identical keys and
values the pseudo-key ``n_c * exp(q·μ_c)`` with value ``v̄_c`` is exact, so the estimate must then match
dense attention to float32 accuracy.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparseattn.cache import Budget, KVCache, Layout, Retention, group_options


def dense64(q, k, v, scale):
    s = np.einsum("hte,hse->hts", q.astype(np.float64), k.astype(np.float64)) * scale
    m = s.max(axis=-1, keepdims=True)
    w = np.exp(s - m)
    return np.einsum("hts,hse->hte", w, v.astype(np.float64)) / w.sum(axis=-1, keepdims=True)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def duplicated_clusters(hk=2, n_points=32, copies=64, E=16, Ev=8, seed=0):
    """Keys and values that are ``copies`` exact repeats of ``n_points`` points (float16-exact)."""
    rng = np.random.default_rng(seed)
    pts = (rng.standard_normal((hk, n_points, E)) * 2).astype(np.float16).astype(np.float32)
    vals = rng.standard_normal((hk, n_points, Ev)).astype(np.float32)
    idx = rng.permutation(np.repeat(np.arange(n_points), copies))
    return pts[:, idx], vals[:, idx]


def test_identical_members_make_the_estimate_exact():
    keys, vals = duplicated_clusters()
    S = keys.shape[1]
    kw = dict(num_heads=2, head_dim=16, value_dim=8, segment=1024, cluster_size=64, sinks=0, window=0,
              open_step=1024)
    exact_cache = KVCache(selector="cluster", **group_options(kw, n_probe=2))
    est_cache = KVCache(selector="cluster", **group_options(kw, n_probe=2, estimate=1000))
    for c in (exact_cache, est_cache):
        c.append(keys, vals)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 16)).astype(np.float32) * 0.5
    ref = dense64(q, keys, vals, 0.25)
    # both routed clusters are exact; every other cluster made of one repeated key is estimated exactly
    # (when k-means keeps each point's copies together; the clustering is checked below)
    dbg = est_cache.debug_view()
    labels_pure = all(
        len({tuple(r) for r in dbg["keys"][g, dbg["cluster_ptr"][g, c]:dbg["cluster_ptr"][g, c + 1]].tolist()}) == 1
        for g in range(2) for c in range(int(dbg["n_clusters"][g])))
    out_est = est_cache.attend(q)
    out_plain = exact_cache.attend(q)
    assert est_cache.stats["clusters_estimated_per_query"] > 0
    if labels_pure:
        np.testing.assert_allclose(out_est, ref, atol=2e-5)
    assert rel_err(out_est, ref) < 0.2 * rel_err(out_plain, ref)
    assert S == len(est_cache)


def test_every_cluster_routed_equals_dense_with_or_without_estimate():
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 2, 3000, 16)).astype(np.float32)
    q = rng.standard_normal((2, 1, 16)).astype(np.float32)
    c = KVCache(2, 16, selector="cluster", layout=Layout(segment=1024, cluster_size=64),
                budget=Budget(n_probe=10_000, estimate=5))
    c.append(k, v)
    np.testing.assert_allclose(c.attend(q), dense64(q, k, v, 0.25), atol=2e-5)
    assert c.stats["clusters_estimated_per_query"] == 0


def test_estimate_lowers_error_on_clustered_keys():
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((2, 64, 32)).astype(np.float32)
    lab = rng.integers(0, 64, 8192)
    k = centres[:, lab] + 0.05 * rng.standard_normal((2, 8192, 32)).astype(np.float32)
    v = 1.0 + centres[:, lab, :16] + 0.1 * rng.standard_normal((2, 8192, 16)).astype(np.float32)
    q = (centres[:, rng.integers(0, 64, 4)] + 0.3 * rng.standard_normal((2, 4, 32))).astype(np.float32)
    errs = {}
    for n_est in (0, 8, 64):
        c = KVCache(2, 32, value_dim=16, selector="cluster", layout=Layout(segment=4096, cluster_size=64),
                    budget=Budget(n_probe=4, estimate=n_est))
        c.append(k, v)
        errs[n_est] = rel_err(c.attend(q), dense_rows(q, k, v))
    assert errs[64] < 0.5 * errs[0], errs
    assert errs[8] < errs[0], errs


def dense_rows(q, k, v):
    """Dense attention of the T newest queries, causal among themselves (positions S-T .. S-1)."""
    H, T, E = q.shape
    S = k.shape[1]
    s = np.einsum("hte,hse->hts", q.astype(np.float64), k.astype(np.float64)) * E ** -0.5
    qpos = np.arange(S - T, S)
    s = np.where(np.arange(S)[None, None, :] <= qpos[None, :, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    w = np.exp(s - m)
    return np.einsum("hts,hse->hte", w, v.astype(np.float64)) / w.sum(axis=-1, keepdims=True)


def test_estimated_clusters_never_carry_later_values():
    """Row t's output does not change when the values of positions after it change (keys equal, so the
    clusters are equal): no estimated cluster may hold a key the row cannot see."""
    rng = np.random.default_rng(4)
    S, T = 6000, 3000
    k = rng.standard_normal((1, S, 16)).astype(np.float32)
    v1 = rng.standard_normal((1, S, 8)).astype(np.float32)
    v2 = v1.copy()
    cut = S - T + 10  # row 10 of the queries sits at position cut
    v2[:, cut + 1:] *= 50.0
    q = rng.standard_normal((1, T, 16)).astype(np.float32)
    outs = []
    for v in (v1, v2):
        c = KVCache(1, 16, value_dim=8, selector="cluster", retention=Retention(window=16),
                    layout=Layout(segment=1024, cluster_size=32),
                    budget=Budget(n_probe=4, estimate=64))
        c.append(k, v)
        outs.append(c.attend(q))
    np.testing.assert_array_equal(outs[0][:, :11], outs[1][:, :11])


def test_estimate_bad_values_are_named():
    with pytest.raises(ValueError, match="estimate"):
        KVCache(2, 16, selector="cluster", budget=Budget(estimate=-1))
    with pytest.raises(ValueError, match="estimate"):
        KVCache(2, 16, selector="pages", budget=Budget(estimate=4))
