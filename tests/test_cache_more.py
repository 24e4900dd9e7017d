"""KVCache: the h2o memory cap, index selectors grown with add(), and the top_p budget of the cluster index.

Oracles: float64 dense attention (``helpers.dense64``) over the keys the cache must keep, a float64
re-implementation of the Heavy-Hitter policy (accumulate softmax weights, evict the least), and
hand-worked cases.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import dense64
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.cache import Budget, KVCache, Layout, Retention, group_options
from sparseattn.kernels.decode import EVICTED

H, HKV, E, EV = 4, 2, 16, 8
SEG = 64


def _kv(n: int, seed: int = 0, hkv: int = HKV) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hkv, n, E)).astype(np.float32),
            rng.standard_normal((hkv, n, EV)).astype(np.float32))


def _q(t: int, seed: int = 1, h: int = H) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((h, t, E)).astype(np.float32)


def oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, keep: list[np.ndarray] | None = None,
           scale: float | None = None) -> np.ndarray:
    """float64 attention of the T newest positions over positions [0, n), causal, restricted to ``keep[g]``
    (positions) per kv head."""
    Hq, T, e = q.shape
    rep = Hq // k.shape[0]
    sc = e ** -0.5 if scale is None else scale
    out = np.zeros((Hq, T, v.shape[2]))
    for h in range(Hq):
        g = h // rep
        allowed = np.zeros(n, bool)
        allowed[np.arange(n) if keep is None else keep[g]] = True
        mask = allowed[None, :] & (np.arange(n)[None, :] <= np.arange(n - T, n)[:, None])
        out[h] = dense64(q[h], k[g, :n], v[g, :n], sc, mask)[0]
    return out


# ---------------------------------------------------------------------------------------------- h2o
def test_h2o_keeps_the_heavy_hitters_hand_case() -> None:
    """Queries all point at e0; positions 2 and 5 have keys 3*e0, every other key is e1 (score 0).  With
    sinks=1, window=2, max_keys=5 the cache must end with {0} + {2, 5} + {10, 11}."""
    n = 12
    k = np.zeros((1, n, 4), np.float32)
    k[0, :, 1] = 1.0
    k[0, [2, 5]] = [3.0, 0.0, 0.0, 0.0]
    v = np.arange(n, dtype=np.float32).reshape(1, n, 1).repeat(2, axis=2)
    q = np.array([[[2.0, 0.0, 0.0, 0.0]]], np.float32)
    cache = KVCache(1, 4, value_dim=2, selector="dense",
                    retention=Retention(sinks=1, window=2, max_keys=5, policy="h2o"))
    for i in range(n):
        cache.append(k[:, i:i + 1], v[:, i:i + 1])
        cache.attend(q)
    np.testing.assert_array_equal(cache.positions(0), [0, 2, 5, 10, 11])
    assert len(cache) == 5 and cache.stats["evicted_keys"] == n - 5
    out = cache.attend(q)
    np.testing.assert_allclose(out[0, 0], oracle(q, k, v, n, [np.array([0, 2, 5, 10, 11])], 0.5)[0, 0],
                               rtol=1e-5)


def h2o_simulation(k, v, qs, sinks, window, cap, scale):
    """float64 H2O: after each one-token append, attend (dense over the kept keys), add each kept key's
    softmax weight (summed over the query heads of its kv head), then evict the least (ties: oldest)."""
    hkv, n, _ = k.shape
    rep = qs.shape[0] // hkv
    keep = [list() for _ in range(hkv)]
    acc = np.zeros((hkv, n))
    for i in range(n):
        for g in range(hkv):
            keep[g].append(i)
            while len(keep[g]) > cap:
                cand = [p for p in keep[g] if sinks <= p < i + 1 - window]
                victim = min(cand, key=lambda p: (acc[g, p], p))
                keep[g].remove(victim)
        for h in range(qs.shape[0]):
            g = h // rep
            kp = np.array(keep[g])
            s = k[g, kp].astype(np.float64) @ qs[h, i].astype(np.float64) * scale
            w = np.exp(s - s.max())
            acc[g, kp] += w / w.sum()
    return [np.array(sorted(x)) for x in keep], acc


@pytest.mark.parametrize("name", ["dense", "topk"])
def test_h2o_matches_float64_simulation(name: str) -> None:
    n, cap = 90, 30
    k, v = _kv(n, seed=5)
    qs = np.random.default_rng(6).standard_normal((H, n, E)).astype(np.float32) * 2
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=name,
                    retention=Retention(sinks=2, window=4, max_keys=cap, policy="h2o"),
                    layout=Layout(segment=16, page_size=16))
    for i in range(n):
        cache.append(k[:, i:i + 1], v[:, i:i + 1])
        cache.attend(qs[:, i:i + 1], k=10_000)
    keep, acc = h2o_simulation(k, v, qs, 2, 4, cap, E ** -0.5)
    for g in range(HKV):
        np.testing.assert_array_equal(cache.positions(g), keep[g])
        pos, w = cache.heavy_hitter_weights(g)
        np.testing.assert_allclose(w, acc[g, pos], rtol=1e-4, atol=1e-6)
    assert cache.stats["compactions"] >= 1  # 60 evictions, segment 16: storage was compacted
    assert cache.stats["slots"] < cap + 16 + 16 * HKV


def _decode_run(cache: KVCache, k, v, qs, n0: int) -> list[np.ndarray]:
    cache.append(k[:, :n0], v[:, :n0])
    outs = [cache.attend(qs[:, :1], k=16)]
    for i in range(n0, k.shape[1]):
        cache.append(k[:, i:i + 1], v[:, i:i + 1])
        outs.append(cache.attend(qs[:, i - n0 + 1:i - n0 + 2], k=16))
    return outs


@pytest.mark.parametrize("policy", ["h2o", "streaming"])
@pytest.mark.parametrize("kw", [
    dict(selector="cluster", n_probe=3, cluster_size=8, estimate=1000),
    dict(selector="cluster", cluster_size=8, top_p=0.9, estimate=1000),
    dict(selector="pages", n_probe=6),
    dict(selector="faiss-flat"),
], ids=["cluster-est", "cluster-top_p", "pages", "faiss-flat"])
def test_evicted_keys_are_never_read(policy: str, kw: dict) -> None:
    """A value changed by 1e6 at a key evicted at some step changes no output from that step on (the
    evictions do not depend on values, so both runs evict the same keys)."""
    n0, n = 200, 330
    k, v = _kv(n, seed=7)
    qs = np.random.default_rng(8).standard_normal((H, n - n0 + 1, E)).astype(np.float32)
    common = dict(num_kv_heads=HKV, value_dim=EV, sinks=4, window=16, max_keys=120, policy=policy,
                  segment=SEG, **kw)
    a = KVCache(H, E, **group_options(common))
    outs_a, evicted_at = [], {}
    a.append(k[:, :n0], v[:, :n0])
    outs_a.append(a.attend(qs[:, :1], k=16))
    for i in range(n0, n):
        a.append(k[:, i:i + 1], v[:, i:i + 1])
        gone = np.setdiff1d(np.arange(i + 1), a.positions(0))
        for p in gone:
            evicted_at.setdefault(int(p), i - n0 + 1)
        outs_a.append(a.attend(qs[:, i - n0 + 1:i - n0 + 2], k=16))
    # a key appended during decoding (read exactly while in the window) and evicted later
    victims = [p for p in evicted_at if p >= n0]
    assert victims
    p = victims[len(victims) // 2]
    v2 = v.copy()
    v2[0, p] += 1e6
    outs_b = _decode_run(KVCache(H, E, **group_options(common)), k, v2, qs, n0)
    s = evicted_at[p]
    rep = H // HKV
    for step in range(s, len(outs_a)):
        np.testing.assert_array_equal(outs_a[step], outs_b[step])
    assert a.stats["compactions"] >= 1
    appended = p - n0 + 1  # the step that appended p reads it (window): the change is visible there
    assert np.abs(outs_a[appended][:rep] - outs_b[appended][:rep]).max() > 1.0


def test_h2o_with_cluster_full_probe_equals_dense_over_survivors() -> None:
    n0, n = 300, 400
    k, v = _kv(n, seed=9)
    qs = np.random.default_rng(10).standard_normal((H, n, E)).astype(np.float32)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                retention=Retention(sinks=4, window=16, max_keys=150, policy="h2o"),
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=10_000))
    c.append(k[:, :n0], v[:, :n0])
    for i in range(n0, n):
        c.append(k[:, i:i + 1], v[:, i:i + 1])
        c.attend(qs[:, i:i + 1])
    q = _q(3, seed=11)
    keep = [c.positions(g) for g in range(HKV)]
    assert not np.array_equal(keep[0], keep[1])  # the kv heads keep different keys
    assert all(len(x) == 150 for x in keep)
    np.testing.assert_allclose(c.attend(q), oracle(q, k, v, n, keep), atol=2e-5)


def _check_cluster_stats(c: KVCache) -> None:
    """Every cluster's statistics describe its live members, unless it lost one since the last compaction
    (then it is marked: cmaxpos = EVICTED, never estimated)."""
    d = c.debug_view()
    for g in range(c.num_kv_heads):
        for ci in range(int(d["n_clusters"][g])):
            lo, hi = d["cluster_ptr"][g, ci], d["cluster_ptr"][g, ci + 1]
            p = d["positions"][g, lo:hi]
            live = p != EVICTED
            if d["cluster_max_pos"][g, ci] == EVICTED and d["cluster_count"][g, ci] != live.sum():
                continue  # marked: lost a member since the last compaction
            assert d["cluster_count"][g, ci] == live.sum()
            if live.any():
                assert d["cluster_min_pos"][g, ci] == p[live].min() and d["cluster_max_pos"][g, ci] == p[live].max()
                np.testing.assert_allclose(d["cluster_value_mean"][g, ci], d["values"][g, lo:hi][live].mean(axis=0),
                                           atol=1e-5)
                cent = d["routing_vectors"][g, ci]
                mean = d["keys"][g, lo:hi][live].astype(np.float64).mean(axis=0)
                # int8 codes: half a code step, 1/254 of the largest element (plus float32 rounding)
                np.testing.assert_allclose(cent, mean, atol=np.abs(mean).max() / 254 * 1.001 + 1e-6, rtol=0)
                # key spread: mean per-dimension variance and largest distance to the mean (float64 numpy)
                dev = d["keys"][g, lo:hi][live].astype(np.float64) - mean
                sq = (dev ** 2).sum(axis=1)
                np.testing.assert_allclose(d["cluster_spread"][g, ci], [sq.mean() / dev.shape[1], np.sqrt(sq.max())],
                                           rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("policy", ["h2o", "streaming"])
def test_compaction_recomputes_cluster_statistics(policy: str) -> None:
    n0, n = 200, 330
    k, v = _kv(n, seed=26)
    qs = np.random.default_rng(27).standard_normal((H, n, E)).astype(np.float32)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                retention=Retention(sinks=4, window=16, max_keys=120, policy=policy),
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3, estimate=1000))
    c.append(k[:, :n0], v[:, :n0])
    seen = 0
    for i in range(n0, n):
        before = c.stats["compactions"]
        c.append(k[:, i:i + 1], v[:, i:i + 1])
        c.attend(qs[:, i:i + 1])
        _check_cluster_stats(c)
        if c.stats["compactions"] > before:
            seen += 1
            d = c.debug_view()
            nc = d["n_clusters"]
            marked = sum(int(((d["cluster_max_pos"][g, :nc[g]] == EVICTED) & (d["cluster_count"][g, :nc[g]] > 0)).sum())
                         for g in range(HKV))
            assert marked == 0  # right after a compaction every non-empty cluster is estimable again
    assert seen >= 1


# ------------------------------------------------------------------------------- index selectors
INDEX_SPECS = ["faiss-flat", "faiss-hnsw:M=16", "faiss-ivf:nprobe=4"]


@pytest.mark.parametrize("spec", INDEX_SPECS)
def test_index_selector_full_k_equals_exact_and_grows_with_add(spec: str) -> None:
    n = 700
    k, v = _kv(n, seed=12)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=spec,
                    retention=Retention(sinks=4, window=16))
    cache.append(k[:, :500], v[:, :500])
    first = cache.debug_view()["indexes"][0]
    for a in range(500, n, 50):
        cache.append(k[:, a:a + 50], v[:, a:a + 50])
    assert cache.debug_view()["indexes"][0] is first and first.keys_.shape[0] == n - 4  # grown by add(), never rebuilt
    q = _q(5, seed=13)
    out, lse = cache.attend(q, k=10_000, return_lse=True)
    np.testing.assert_allclose(out, oracle(q, k, v, n), atol=1e-5)
    assert cache.stats["keys_read_max"] == n


@pytest.mark.parametrize("spec", INDEX_SPECS)
def test_index_selector_small_k_reads_sinks_window_and_k(spec: str) -> None:
    n = 600
    k, v = _kv(n, seed=14)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=spec,
                    retention=Retention(sinks=4, window=16))
    cache.append(k, v)
    q = _q(1, seed=15)
    out = cache.attend(q, k=20)
    assert cache.stats["keys_read_max"] <= 4 + 16 + 20
    rep = H // HKV
    for h in range(H):  # the step equals exact attention over the keys it reports reading
        sel = cache.selected_slots(q[h, 0], h, k=20)
        g = h // rep
        ref = oracle(q[h:h + 1], k[g:g + 1], v[g:g + 1], n, [cache.debug_view()["positions"][g, sel]])
        np.testing.assert_allclose(out[h], ref[0], atol=2e-5)
    if spec == "faiss-flat":  # exact search: the 20 best non-window keys
        for h in range(H):
            g = h // rep
            s = k[g, 4:n - 16] @ q[h, 0]
            best = 4 + np.argsort(-s)[:20]
            got = cache.debug_view()["positions"][g, cache.selected_slots(q[h, 0], h, k=20)]
            assert set(best) <= set(got)


def test_index_selector_waits_for_enough_keys() -> None:
    """An IVF index of 64 lists cannot be trained on fewer keys: until it can, every key is read exactly."""
    k, v = _kv(300, seed=28)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="faiss-ivf:nlist=64,nprobe=64",
                retention=Retention(window=8))
    c.append(k[:, :40], v[:, :40])
    q = _q(2, seed=29)
    assert c.debug_view()["indexes"][0] is None
    np.testing.assert_allclose(c.attend(q, k=5), oracle(q, k, v, 40), atol=1e-5)
    c.append(k[:, 40:], v[:, 40:])
    index = c.debug_view()["indexes"][0]
    assert index is not None and index.keys_.shape[0] == 300 - 4
    np.testing.assert_allclose(c.attend(q, k=10_000), oracle(q, k, v, 300), atol=1e-5)
    assert c.stats["keys_read_max"] == 300
    c.attend(q, k=5)
    assert c.stats["keys_read_max"] <= 4 + 8 + 5


@pytest.mark.parametrize("spec", ["faiss-flat", "faiss-hnsw:M=16"])
def test_index_selector_causal_multi_token(spec: str) -> None:
    n, T = 400, 6
    k, v = _kv(n, seed=16)
    k2, v2 = k.copy(), v.copy()
    k2[:, n - 2:] += 5.0
    v2[:, n - 2:] -= 3.0
    q = _q(T, seed=17)
    outs = []
    for kk, vv in ((k, v), (k2, v2)):
        cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=spec, retention=Retention(window=4))
        cache.append(kk[:, :n - T], vv[:, :n - T])
        cache.append(kk[:, n - T:], vv[:, n - T:])
        outs.append(cache.attend(q, k=8))
    np.testing.assert_array_equal(outs[0][:, :T - 2], outs[1][:, :T - 2])
    assert not np.allclose(outs[0][:, T - 1], outs[1][:, T - 1])
    full = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=spec, retention=Retention(window=4))
    full.append(k, v)
    np.testing.assert_allclose(full.attend(q, k=10_000), oracle(q, k, v, n), atol=1e-5)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_index_selector_under_cap_equals_dense_over_survivors(policy: str) -> None:
    n0, n = 300, 460
    k, v = _kv(n, seed=18)
    qs = np.random.default_rng(19).standard_normal((H, n, E)).astype(np.float32)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="faiss-hnsw:M=8",
                retention=Retention(sinks=4, window=16, max_keys=100, policy=policy),
                layout=Layout(segment=32))
    c.append(k[:, :n0], v[:, :n0])
    for i in range(n0, n):
        c.append(k[:, i:i + 1], v[:, i:i + 1])
        c.attend(qs[:, i:i + 1], k=30)
    assert c.stats["index_rebuilds"] >= 1  # the evicted ids outnumbered the live ones
    q = _q(2, seed=20)
    keep = [c.positions(g) for g in range(HKV)]
    np.testing.assert_allclose(c.attend(q, k=10_000), oracle(q, k, v, n, keep), atol=1e-5)


# ------------------------------------------------------------------------------------------ top_p
def test_top_p_one_without_cap_equals_exact() -> None:
    n = 5 * SEG + 70
    k, v = _kv(n, seed=21)
    q = _q(3, seed=22)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                layout=Layout(segment=SEG, cluster_size=8),
                budget=Budget(top_p=1.0, top_p_max_keys=10**9))
    c.append(k, v)
    np.testing.assert_allclose(c.attend(q), oracle(q, k, v, n), atol=2e-5)
    assert c.stats["keys_read_max"] == n


def _clustered(n: int, seed: int, hkv: int = 1, e: int = 32, n_centres: int = 64):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((hkv, n_centres, e)).astype(np.float32) * 1.5
    lab = rng.integers(0, n_centres, n)
    k = centres[:, lab] + 0.1 * rng.standard_normal((hkv, n, e)).astype(np.float32)
    v = rng.standard_normal((hkv, n, 8)).astype(np.float32)
    return k, v, centres


def test_top_p_reads_few_keys_on_a_peaky_query_and_follows_p() -> None:
    n = 8192
    k, v, centres = _clustered(n, seed=23)
    kw = dict(value_dim=8, segment=4096, cluster_size=64, window=16, open_step=512)  # exact tail < 528
    peaky = (3.0 * centres[:, 5:6]).astype(np.float32)  # (1, 1, 32): aligned with one centre
    flat = (0.05 * np.random.default_rng(24).standard_normal((1, 1, 32))).astype(np.float32)
    reads, errs = {}, {}
    for p in (0.5, 0.9, 0.99, 1.0):
        c = KVCache(1, 32, selector="cluster", **group_options(kw, top_p=p, top_p_max_keys=10**9))
        c.append(k, v)
        for name, q in (("peaky", peaky), ("flat", flat)):
            out = c.attend(q)
            reads[name, p] = c.stats["keys_read_per_query"]
            ref = oracle(q, k, v, n)
            errs[name, p] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert reads["peaky", 0.9] < 0.1 * n and reads["flat", 0.9] > 0.5 * n, reads
    for name in ("peaky", "flat"):
        assert reads[name, 0.5] <= reads[name, 0.9] <= reads[name, 0.99] <= reads[name, 1.0] == n
        assert errs[name, 1.0] < 1e-5
    assert errs["peaky", 0.9] < 0.05, errs


def test_top_p_floor_and_cap_in_routed_keys() -> None:
    n = 8192
    k, v, centres = _clustered(n, seed=25)
    q = (3.0 * centres[:, 7:8]).astype(np.float32)
    kw = dict(value_dim=8, segment=4096, cluster_size=64, window=16, top_p=0.5, selector="cluster")
    base = KVCache(1, 32, **group_options(kw))
    base.append(k, v)
    base.attend(q)
    exact_part = 4 + base.stats["tail_keys"]
    floor = KVCache(1, 32, **group_options(kw, top_p_min_keys=2000, top_p_max_keys=10**9))
    floor.append(k, v)
    floor.attend(q)
    assert floor.stats["keys_read_per_query"] >= exact_part + 2000
    cap = KVCache(1, 32, value_dim=8, selector="cluster", retention=Retention(window=16),
                  layout=Layout(segment=4096, cluster_size=64),
                  budget=Budget(top_p=1.0, top_p_max_keys=300))
    cap.append(k, v)
    cap.attend(q)
    assert exact_part < cap.stats["keys_read_per_query"] <= exact_part + 300
    sel = cap.selected_slots(q[0, 0], 0)
    assert sel.size == cap.stats["keys_read_max"]
    # top_p = 1 wants every cluster: the cap of 300 binds, and stats say so; without a cap nothing binds
    assert cap.stats["top_p_capped"] == 1 and cap.stats["top_p_capped_rows"] == 1
    assert base.stats["top_p_capped"] == 0 and floor.stats["top_p_capped"] == 0


def test_top_p_has_no_default_cap() -> None:
    # top_p = 1 with no top_p_max_keys reads every key (no default cap silently overrides top_p)
    n = 8192
    k, v, centres = _clustered(n, seed=27)
    q = (3.0 * centres[:, 3:4]).astype(np.float32)
    c = KVCache(1, 32, value_dim=8, selector="cluster", layout=Layout(segment=4096, cluster_size=64),
                budget=Budget(top_p=1.0))
    c.append(k, v)
    np.testing.assert_allclose(c.attend(q), oracle(q, k, v, n), atol=2e-5)
    assert c.stats["keys_read_max"] == n and c.stats["top_p_capped"] == 0


def _kept_mass(c: KVCache, k: np.ndarray, q: np.ndarray) -> float:
    """Softmax mass of the keys one attend of ``q`` (E,) read: exp(lse - lse over every key), float64."""
    _, lse = c.attend(q[None], return_lse=True)
    s = k[0].astype(np.float64) @ q.astype(np.float64) / np.sqrt(q.shape[0])
    full = s.max() + np.log(np.exp(s - s.max()).sum())
    return float(np.exp(float(lse[0]) - full))


def test_top_p_walk_is_calibrated_by_the_spread_term() -> None:
    # Clustered keys with spread (0.6 per dimension around centres of norm ~8.5) and queries near a
    # centre: the first-order estimate n_c exp(s q.mu_c) under-states each cluster's mass (Jensen), so a
    # first-order walk stops early (measured on these queries: mean kept mass 0.81 at top_p = 0.9).  With
    # the second-order spread term it keeps 0.90 (oracle: float64 softmax over every key against the lse
    # of the keys read), and the float64 replay of the walk (selected_slots) reads what the kernel reads.
    rng = np.random.default_rng(31)
    n, e = 8192, 32
    centres = rng.standard_normal((64, e)).astype(np.float32) * 1.5
    k = (centres[rng.integers(0, 64, n)] + 0.6 * rng.standard_normal((n, e))).astype(np.float32)[None]
    v = rng.standard_normal((1, n, 8)).astype(np.float32)
    qs = [(centres[rng.integers(0, 64)] + rng.standard_normal(e)).astype(np.float32) for _ in range(24)]
    c = KVCache(1, e, selector="cluster", **group_options(dict(value_dim=8, segment=4096, cluster_size=64,
                                                               window=16, open_step=512), top_p=0.9))
    c.append(k, v)
    kept = []
    for q in qs:
        kept.append(_kept_mass(c, k, q))
        assert c.selected_slots(q, 0).size == c.stats["keys_read_max"]
    assert float(np.mean(kept)) >= 0.87, kept


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="lru"), "policy must be one of"),
    (dict(selector="nope"), "selector must be one of"),
    (dict(selector="angular-lsh"), "angular-lsh.*supports_add"),
    (dict(selector="kdtree"), "faiss-hnsw"),
    (dict(selector="window+faiss-flat"), "selector"),
    (dict(selector="faiss-hnsw:Q=3"), "Q"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(top_p=1.5), "top_p must be"),
    (dict(top_p=True), "top_p must be"),
    (dict(top_p=0.9, selector="pages"), "top_p applies to selector='cluster'"),
    (dict(top_p=0.9, selector="faiss-flat"), "top_p applies"),
    (dict(top_p=0.9, top_p_min_keys=50, top_p_max_keys=10), "top_p_min_keys"),
    (dict(top_p_max_keys=-1), "top_p_max_keys"),
    (dict(top_p_max_keys=10), r"top_p_min_keys / top_p_max_keys bound the top_p walk and do nothing without it; "
                              r"got top_p=None with top_p_min_keys=0, top_p_max_keys=10"),
    (dict(top_p_min_keys=5), r"do nothing without it; got top_p=None with top_p_min_keys=5"),
])
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVCache(H, E, **group_options({"selector": "cluster", **kwargs}))


def test_heavy_hitter_weights_need_h2o() -> None:
    with pytest.raises(ValueError, match="policy='h2o'"):
        KVCache(H, E).heavy_hitter_weights(0)


# ------------------------------------------------------------------------------ reserve, one-token appends
def test_reserve_avoids_reallocation_and_changes_nothing() -> None:
    n0, n = 100, 260
    k, v = _kv(n, seed=40)
    qs = _q(1, seed=41)
    a = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3))
    b = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3))
    for c in (a, b):
        c.append(k[:, :n0], v[:, :n0])
    b.reserve(n - n0)
    kb = b.debug_view()["raw_keys"]
    for i in range(n0, n):
        for c in (a, b):
            c.append(k[:, i:i + 1], v[:, i:i + 1])
    assert np.shares_memory(b.debug_view()["raw_keys"], kb)  # no reallocation after reserve
    np.testing.assert_array_equal(a.attend(qs), b.attend(qs))
    np.testing.assert_allclose(b.attend(qs, selector="dense"), oracle(qs, k, v, n), atol=2e-5)
    with pytest.raises(ValueError, match="n_tokens"):
        b.reserve(-1)
    with pytest.raises(ValueError, match="n_tokens=.*int32"):
        b.reserve(2 ** 31)
    with pytest.raises((TypeError, ValueError), match="n_tokens"):
        b.reserve(2.5)
    capped = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, retention=Retention(max_keys=100, window=8),
                     layout=Layout(segment=SEG))
    capped.append(k[:, :10], v[:, :10])
    capped.reserve(10 ** 9)  # bounded by what the cap can ever hold
    assert capped.store.cap <= 100 + 2 * SEG + 8 + 4 + capped.page_size


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_one_token_append_same_as_general_path(dtype: object) -> None:
    """A (H_kv, 1, E) array already in the storage dtype takes the short path: same state as the general
    path (float64 input rounded to the storage dtype), same errors."""
    n = 150
    k, v = _kv(n, seed=42)
    a = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, dtype=dtype, selector="cluster",
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3))
    b = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, dtype=dtype, selector="cluster",
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3))
    sd = a.store.sdtype
    for i in range(n):
        ki, vi = k[:, i:i + 1], v[:, i:i + 1]
        if dtype == "bfloat16":  # values exactly representable in bfloat16, so both paths store the same
            ki, vi = a.store.decode(a.store.encode(ki, "keys")), a.store.decode(a.store.encode(vi, "values"))
        a.append(ki.astype(sd) if sd != np.uint16 else ki, vi.astype(sd) if sd != np.uint16 else vi)
        b.append(ki.astype(np.float64), vi.astype(np.float64))
    da, db = a.debug_view(), b.debug_view()
    for name in ("raw_keys", "raw_values", "positions", "cluster_ptr", "cluster_count"):
        np.testing.assert_array_equal(da[name], db[name])
    bad = np.full((HKV, 1, E), np.nan, dtype=np.float32 if sd == np.uint16 else sd)
    with pytest.raises(ValueError, match="keys contains NaN or Inf"):
        a.append(bad, np.zeros((HKV, 1, EV), bad.dtype))
    with pytest.raises(ValueError, match="values contains NaN or Inf"):
        a.append(np.zeros((HKV, 1, E), bad.dtype), np.full((HKV, 1, EV), np.inf, bad.dtype))
    assert len(a) == n  # a refused append changes nothing


def test_bfloat16_cache_refuses_raw_uint16() -> None:
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, dtype="bfloat16")
    with pytest.raises(TypeError, match="keys must have dtype float16, float32 or float64"):
        c.append(np.zeros((HKV, 1, E), np.uint16), np.zeros((HKV, 1, EV), np.uint16))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0, 0), (1, 0, E - 1), (0, 0, 7)])
def test_one_token_append_finds_one_bad_element_in_a_strided_view(bad: float, where: tuple) -> None:
    k, v = _kv(20, seed=43)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    kk = k.copy()
    kk[where[0], 5, where[2]] = bad
    with pytest.raises(ValueError, match="keys contains NaN or Inf"):
        c.append(kk[:, 5:6], v[:, 5:6])  # a strided (H_kv, 1, E) view: the one-token path
    vv = v.copy()
    vv[where[0], 5, min(where[2], EV - 1)] = bad
    with pytest.raises(ValueError, match="values contains NaN or Inf"):
        c.append(k[:, 5:6], vv[:, 5:6])
    assert len(c) == 0


def test_tail_and_estimation_zone_are_refused_together() -> None:
    k, v = _kv(300, seed=44)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=2, estimate=4))
    c.append(k, v)
    with pytest.raises(ValueError, match="tail= and estimate=4"):
        c.attend(_q(1), tail=16)
    assert c.attend(_q(1), tail=16, selector="window").shape == (H, 1, EV)  # no estimate there


@pytest.mark.parametrize("dtype,big,name", [(np.float32, 1e300, "float32"), (np.float16, 7e4, "float16"),
                                            ("bfloat16", 1e300, "bfloat16")])
@pytest.mark.parametrize("t", [1, 3])
def test_values_beyond_the_storage_range_are_refused_at_append(dtype: object, big: float, name: str, t: int) -> None:
    c = KVCache(2, 4, dtype=dtype)
    k = np.ones((2, t, 4))
    k[1, t - 1, 2] = big
    with pytest.raises(ValueError, match=f"keys has values beyond {name}'s range"):
        c.append(k, np.ones((2, t, 4)))
    with pytest.raises(ValueError, match=f"values has values beyond {name}'s range"):
        c.append(np.ones((2, t, 4)), -k)
    assert len(c) == 0
    edge = np.full((2, 1, 4), 65519.0 if name == "float16" else 1.0, np.float32)  # rounds to 65504: kept
    c.append(edge, edge)
    assert np.isfinite(c.debug_view()["keys"][:, :1]).all()


def test_concurrent_attends_on_one_cache_equal_serial() -> None:
    from concurrent.futures import ThreadPoolExecutor

    k, v = _kv(2000, seed=45)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                layout=Layout(segment=256, cluster_size=16), budget=Budget(n_probe=4))
    c.append(k, v)
    qs = [_q(1, seed=100 + i) for i in range(16)]
    serial = [c.attend(q) for q in qs]
    with ThreadPoolExecutor(4) as ex:
        par = list(ex.map(c.attend, qs * 3))
    for i, out in enumerate(par):
        np.testing.assert_array_equal(out, serial[i % 16])


@pytest.mark.parametrize("selector", ["cluster", "pages"])
def test_parallel_and_serial_steps_agree_bitwise(selector: str) -> None:
    """Rows are independent: the step on Numba's threads equals the one-thread step exactly, for every
    override, GQA and T_q = 3 (the default picks one of the two by the step's work)."""
    n = 700
    k, v = _kv(n, seed=41)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=selector, retention=Retention(window=16),
                layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=4))
    c.append(k, v)
    q = _q(3, seed=42)
    for sel in (None, "dense", "topk", "window"):
        res = []
        for par in (True, False):
            c.parallel = par
            res.append(c.attend(q, k=16, return_lse=True, selector=sel))
        np.testing.assert_array_equal(res[0][0], res[1][0])
        np.testing.assert_array_equal(res[0][1], res[1][1])


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(8, 80), segment=st.sampled_from([64, 128, 256]), open_step=st.sampled_from([8, 16, 32, 64]),
       window=st.integers(0, 12),
       chunks=st.lists(st.one_of(st.just(1), st.integers(1, 60)), min_size=1, max_size=150))
def test_streaming_cap_on_clusters_keeps_exactly_sinks_and_newest(cap: int, segment: int, open_step: int,
                                                                 window: int, chunks: list[int]) -> None:
    """Streaming cap on the cluster index, the cap well below a segment (few compactions): after every append the cache holds
    exactly the sinks and the newest ``max_keys - sinks`` positions (clustering the open segment reorders
    slots the eviction scan had passed), and the dense step equals float64 attention over them."""
    sinks = 4
    cap = max(cap, sinks + window)  # the smallest cap the cache accepts
    n = sum(chunks)
    k, v = _kv(n, seed=n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV,
                    retention=Retention(sinks=sinks, window=window, max_keys=cap),
                    layout=Layout(segment=segment, open_step=open_step, cluster_size=4))
    done = 0
    for t in chunks:
        cache.append(k[:, done:done + t], v[:, done:done + t])
        done += t
        keep = np.r_[np.arange(min(sinks, done)), np.arange(max(sinks, done - (cap - sinks)), done)]
        assert len(cache) == keep.size
        for g in range(HKV):
            np.testing.assert_array_equal(cache.positions(g), keep)
    q = _q(1)
    out, lse = cache.attend(q, return_lse=True, selector="dense")
    rep = H // HKV
    for h in range(H):
        ref, ref_lse = dense64(q[h], k[h // rep, keep], v[h // rep, keep], cache.scale)
        np.testing.assert_allclose(out[h], ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[h], ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("segment, open_step, cap, window, n", [
    (64, 32, 20, 0, 100), (256, None, 60, 0, 300), (4096, None, 1000, 64, 4200)])
def test_streaming_cap_decode_loop_evicts_every_old_key(segment: int, open_step: int | None, cap: int,
                                                        window: int, n: int) -> None:
    """One token per append (a decode loop) under a streaming cap below the open segment's step: each
    append evicts the oldest non-sink key, including after a clustering pass reordered the slots the
    eviction scan starts from."""
    k, v = _kv(n, seed=3, hkv=1)
    cache = KVCache(1, E, value_dim=EV, retention=Retention(max_keys=cap, window=window),
                    layout=Layout(segment=segment, open_step=open_step, cluster_size=4))
    for i in range(n):
        cache.append(k[:, i:i + 1], v[:, i:i + 1])
        assert len(cache) == cache.positions(0).size == min(i + 1, cap)
    keep = np.r_[0:4, n - (cap - 4):n]
    np.testing.assert_array_equal(cache.positions(0), keep)
    q = _q(1, h=1)
    out, lse = cache.attend(q, return_lse=True, selector="dense")
    ref, ref_lse = dense64(q[0], k[0, keep], v[0, keep], cache.scale)
    np.testing.assert_allclose(out[0], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse[0], ref_lse, rtol=1e-5, atol=1e-5)


def test_queries_beyond_float32_are_refused() -> None:
    k, v = _kv(50)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    cache.append(k, v)
    q = _q(1).astype(np.float64) * 1e39  # finite in float64, inf in float32
    with pytest.raises(ValueError, match="float32's range"):
        cache.attend(q)


@pytest.mark.parametrize("selector, cache_selector", [
    ("dense", "cluster"), (None, "cluster"), ("topk", "cluster"), ("window", "cluster"), (None, "pages")])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_scores_overflowing_float32_raise_not_zeros(selector: str | None, cache_selector: str, sign: float) -> None:
    """Keys of 3e38: q . k is -inf (sign -1: every element the same sign) or NaN (+inf - inf, alternating
    signs) in float32.  Neither may be dropped as a masked key (zeros, lse = -inf): the overflow error."""
    keys = np.full((1, 10, E), 3e38, np.float32)
    if sign > 0:
        keys[:, :, 1::2] = -3e38
    cache = KVCache(1, E, value_dim=EV, selector=cache_selector)
    cache.append(keys, np.ones((1, 10, EV), np.float32))
    with pytest.raises(ValueError, match="overflow float32"):
        cache.attend(sign * np.ones((1, 1, E), np.float32), k=4, selector=selector)


def test_append_and_attend_from_threads_take_turns() -> None:
    """One thread appends token by token while three attend: no crash, every output finite, and the cache
    afterwards equals one filled from a single thread."""
    import threading

    n0, n = 600, 1400
    k, v = _kv(n, seed=5)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, layout=Layout(segment=SEG, cluster_size=8))
    cache.append(k[:, :n0], v[:, :n0])
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(n0, n):
                cache.append(k[:, i:i + 1], v[:, i:i + 1])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def reader(seed: int) -> None:
        q = _q(1, seed=seed)
        try:
            while not done.is_set():
                out = cache.attend(q)
                assert np.isfinite(out).all()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ref = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, layout=Layout(segment=SEG, cluster_size=8))
    ref.append(k[:, :n0], v[:, :n0])
    for i in range(n0, n):
        ref.append(k[:, i:i + 1], v[:, i:i + 1])
    q = _q(1, seed=9)
    np.testing.assert_array_equal(cache.attend(q), ref.attend(q))


def test_cache_pickles_with_its_own_lock() -> None:
    import pickle

    k, v = _kv(300)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, layout=Layout(segment=SEG, cluster_size=8))
    cache.append(k, v)
    copy = pickle.loads(pickle.dumps(cache))
    assert copy._lock is not cache._lock
    q = _q(2)
    np.testing.assert_array_equal(copy.attend(q), cache.attend(q))
    copy.append(k[:, :1], v[:, :1])
    assert len(copy) == len(cache) + 1


@pytest.mark.parametrize("kw, exc, text", [
    (dict(n_probe=2**40), ValueError, "n_probe must be <="),
    (dict(n_probe=2**70), ValueError, "n_probe must be <="),
    (dict(estimate=2**40), ValueError, "estimate must be <="),
    (dict(cluster_size=10**30), ValueError, "cluster_size must be <="),
    (dict(segment=2**40), ValueError, "segment must be <="),
    (dict(top_p=0.9, top_p_max_keys=2**70), ValueError, "top_p_max_keys must be <="),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(seed="x"), TypeError, "seed must be an integer"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
    (dict(parallel="no"), TypeError, "parallel must be a bool"),
])
def test_constructor_refuses_out_of_range_values_naming_them(kw: dict, exc: type, text: str) -> None:
    with pytest.raises(exc, match=text):
        KVCache(H, E, num_kv_heads=HKV, selector="cluster", **group_options(kw))


def test_budgets_beyond_the_cache_read_everything_without_allocating_them() -> None:
    """n_probe / estimate / k far beyond the clusters or keys held: the step reads what there is (equal to
    the dense step) instead of sizing per-row heaps by the request."""
    k, v = _kv(300)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                    layout=Layout(segment=SEG, cluster_size=8),
                    budget=Budget(n_probe=2**30, estimate=2**30))
    cache.append(k, v)
    q = _q(2)
    dense = cache.attend(q, selector="dense")
    np.testing.assert_allclose(cache.attend(q), dense, atol=2e-6)
    np.testing.assert_allclose(cache.attend(q, k=2**40, selector="topk"), dense, atol=2e-6)
    np.testing.assert_allclose(cache.attend(q, k=2**63, selector="topk"), dense, atol=2e-6)


def test_attend_and_selected_slots_refuse_bad_arguments_naming_them() -> None:
    k, v = _kv(100)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, layout=Layout(segment=SEG, cluster_size=8))
    cache.append(k, v)
    q = _q(1)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cache.attend(q, return_lse="no")
    with pytest.raises(ValueError, match="selector must be None"):
        cache.selected_slots(q[0, 0], 0, selector="bogus")
    with pytest.raises(ValueError, match="head must be >= 0"):
        cache.selected_slots(q[0, 0], -1)
    with pytest.raises(ValueError, match=f"head must be <= {H - 1}"):
        cache.selected_slots(q[0, 0], H)
    with pytest.raises(ValueError, match="k must be >= 1"):
        cache.selected_slots(q[0, 0], 0, k=-5, selector="topk")
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.selected_slots(np.full(E, np.nan, np.float32), 0)
    with pytest.raises(ValueError, match=f"head_dim={E}"):
        cache.selected_slots(np.ones(E // 2, np.float32), 0)


@pytest.mark.parametrize("spec, cap", [("faiss-ivfpq", 200), ("faiss-ivf:nlist=150", 100)])
def test_index_selector_that_cannot_train_under_the_cap_reads_everything(spec: str, cap: int) -> None:
    """PQ / IVF need more training keys than a small cap keeps: appends never fail, the cap holds, and the
    step reads every live key exactly (equal to the dense step) instead of a stale index."""
    pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    cache = KVCache(1, E, value_dim=EV, selector=spec, retention=Retention(max_keys=cap, sinks=2, window=8),
                    layout=Layout(segment=64))
    for i in range(1000):
        cache.append(rng.standard_normal((1, 1, E)), rng.standard_normal((1, 1, EV)))
        assert len(cache) == min(i + 1, cap)
    q = _q(1, h=1)
    out = cache.attend(q, k=10_000)
    assert cache.stats["keys_read_per_query"] == cap
    np.testing.assert_allclose(out, cache.attend(q, selector="dense"), atol=1e-6)


def test_prefill_rows_route_only_to_clusters_they_can_see() -> None:
    """512 prefill queries over 1,024 keys whose later half matches them best: a row's probes go to clusters
    holding a key at or before its position, so no row is left with its window alone or nothing."""
    d = np.ones(8, np.float32) / np.sqrt(8)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 1024, 8)).astype(np.float32)
    k[0, 512:] += 4 * d
    v = rng.standard_normal((1, 1024, 8)).astype(np.float32)
    cache = KVCache(1, 8, selector="cluster", retention=Retention(sinks=0, window=1),
                    layout=Layout(segment=64, cluster_size=8), budget=Budget(n_probe=4))
    cache.append(k, v)
    out, lse = cache.attend(np.tile(3 * d, (1, 512, 1)), return_lse=True)
    assert np.isfinite(lse).all()
    assert cache.stats["keys_read_min"] >= 1 + 4  # the window key and one visible key per probed cluster


def test_tail_samples_beyond_the_keys_cost_no_more_than_the_keys() -> None:
    """tail=2**40 on a 10-key cache: exact (every unread key enumerated), and no scratch of 2**40 per row."""
    from sparseattn.attention.tail import Tail

    k, v = _kv(10)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="window",
                    retention=Retention(window=2, sinks=1))
    cache.append(k, v)
    q = _q(2)
    dense = cache.attend(q, selector="dense")
    for samples in (10, 2**40, 2**62):
        np.testing.assert_allclose(cache.attend(q, tail=Tail(samples, seed=3)), dense, atol=2e-6)
