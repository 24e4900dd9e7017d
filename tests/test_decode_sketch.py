"""KVCache(selector="sketch"): the 1-bit residual estimator against hand-worked numbers, candidate selection
against brute force (planted keys at every depth, across segment boundaries, after evictions), the step
against float64 attention over the slots it reads, and its options refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.cache import Budget, KVCache, group_options
from sparseattn.kernels import sketch as ks

E = 16
KW = {"segment": 256, "cluster_size": 16, "window": 8, "sinks": 2}


def _attend64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """float64 softmax(q k^T scale) v of one query over the given keys."""
    s = k.astype(np.float64) @ q.astype(np.float64) * scale
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v.astype(np.float64)


def _cache(n: int, *, hk: int = 2, h: int = 2, seed: int = 0, selector: str = "sketch", **kw):
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((hk, n, E)).astype(np.float32)
    V = rng.standard_normal((hk, n, E)).astype(np.float32)
    c = KVCache(h, E, num_kv_heads=hk, selector=selector, **group_options({**KW, **kw}))
    for a in range(0, n, 300):  # uneven appends cross segment boundaries
        c.append(K[:, a:a + 300], V[:, a:a + 300])
    return c, K, V



def _oracle_routed(c: KVCache, q: np.ndarray, g: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """numpy recomputation of one query's two estimates over kv head g's routed slots [a0, b0): the sign
    estimate (stage 1) and the 4-bit one (stage 2), both with the 4-bit query; -inf for evicted slots.
    Returns (est1, est2, live, a0, b0)."""
    view, st_ = c.debug_view(), c.store
    nc = int(view["n_clusters"][g])
    cptr = view["cluster_ptr"]
    a0, b0 = int(cptr[g, 0]), int(cptr[g, nc])
    qr = view["sketch_rotation"] @ q.astype(np.float64)
    d = (qr.max() - qr.min()) / 15 if qr.max() > qr.min() else 1.0
    qh = qr.min() + d * np.rint((qr - qr.min()) / d)  # the scan's 4-bit query
    Ec = c.head_dim
    unpack = lambda a: np.unpackbits(a, axis=1, bitorder="little")[:, :Ec].astype(np.float64)  # noqa: E731
    nb = st_.sketch_codes.shape[2]
    sign = unpack(st_.sketch_codes[g, a0:b0])
    cq = 8 * sign + sum((1 << p) * unpack(st_.sketch_fine[g, a0:b0, p * nb:(p + 1) * nb]) for p in range(3))
    mu = np.repeat(view["routing_vectors"][g, :nc].astype(np.float64), np.diff(cptr[g, :nc + 1]), axis=0)
    base = mu @ q.astype(np.float64)
    est1 = base + st_.sketch_fac[g, a0:b0] * ((2 * sign - 1) @ qh)
    est2 = base + st_.sketch_fscale[g, a0:b0] * ((cq - 7.5) @ qh)
    live = st_.pos[g, a0:b0] <= st_.n - 1  # evicted slots hold the largest int32
    return np.where(live, est1, -np.inf), np.where(live, est2, -np.inf), live, a0, b0


def _check_two_stage(c: KVCache, q: np.ndarray, h: int = 0, sel: np.ndarray | None = None) -> None:
    """The routed slots query head h reads (``sel``, default ``selected_slots``) are the ``candidates`` best
    by the 4-bit estimate among the ``shortlist`` best by the sign estimate (live slots of its kv head
    only), up to float rounding at the two cuts; on a cache small enough for the one-stage scan
    (``sketch_one_stage``), the ``candidates`` best of all live routed slots by the 4-bit estimate."""
    est1, est2, live, a0, b0 = _oracle_routed(c, q, h * c.num_kv_heads // c.num_heads)
    R1, R2 = c.stats["sketch_shortlist"], c.stats["sketch_candidates"]
    sel = np.asarray(c.selected_slots(q, h)) if sel is None else sel
    routed = sel[(sel >= a0) & (sel < b0)] - a0
    n_live = int(live.sum())
    assert routed.size == min(R2, n_live) and live[routed].all()
    tol1 = 1e-9 * (np.abs(est1[live]).max() + 1e-300)
    tol2 = 1e-9 * (np.abs(est2[live]).max() + 1e-300)
    if c.stats["sketch_one_stage"]:
        kth2 = np.sort(est2)[::-1][min(R2, n_live) - 1]
        assert (est2[routed] >= kth2 - tol2).all()
        assert np.isin(np.flatnonzero(est2 > kth2 + tol2), routed).all()
        return
    kth1 = np.sort(est1)[::-1][min(R1, n_live) - 1]
    assert (est1[routed] >= kth1 - tol1).all()  # every key read made the shortlist
    short = np.flatnonzero(est1 >= kth1 - tol1)
    sure = np.flatnonzero(est1 > kth1 + tol1)  # surely on the shortlist
    kth2 = np.sort(est2[short])[::-1][min(R2, short.size) - 1]
    assert (est2[routed] >= kth2 - tol2).all()
    assert np.isin(sure[est2[sure] > kth2 + tol2], routed).all()  # the best of the sure ones are all read

def test_estimator_hand_worked() -> None:
    # a residual along its own sign vector (after the rotation) is estimated exactly: with P = I,
    # r = (2, -2, 2, -2) has signs (+, -, +, -), |r|^2 / |r|_1 = 16 / 8 = 2, and q . r = 2 * (q . s)
    r = np.array([[2.0, -2.0, 2.0, -2.0]])
    codes, fac, norm, fine, fscale = ks.encode_residuals(r, np.eye(4))  # one 64-bit word a key, bits past E 0
    assert codes.tolist() == [[0b0101, 0, 0, 0, 0, 0, 0, 0]] and fac.tolist() == [2.0] and norm.tolist() == [4.0]
    # 4-bit codes: u = r / max|r| = (1, -1, 1, -1), c = floor(7.5 u + 8) = (15, 0, 15, 0): planes 0-2 all
    # 0b0101; the quantized u is u itself, so fine_scale = |u|^2 / <u, u> * max|r| / 7.5 = 2 / 7.5 and the
    # re-ranking estimate fine_scale * sum q_i (c_i - 7.5) = 2 q . s = q . r exactly
    assert fine.tolist() == [[0b0101] + [0] * 7 + [0b0101] + [0] * 7 + [0b0101] + [0] * 7]
    assert fscale[0] == pytest.approx(2 / 7.5)
    # a residual off its sign vector: r = (3, 1), signs (+, +), factor 10 / 4 = 2.5, q = (1, 0):
    # estimate 2.5 * 1 = 2.5 against the true 3
    codes, fac, _, fine, fscale = ks.encode_residuals(np.array([[3.0, 1.0]]), np.eye(2))
    assert codes.tolist() == [[0b11] + [0] * 7] and fac[0] == pytest.approx(2.5)
    # u = (1, 1/3): c = (15, floor(10.5)) = (15, 10); x = (c - 7.5) / 7.5 = (1, 1/3): exact again, so
    # fine_scale = 3 / 7.5 and 0.4 * (q . (7.5, 2.5)) = q . r for q = (1, 0): 3
    assert [fine[0, 0], fine[0, 8], fine[0, 16]] == [0b01, 0b11, 0b01] and fscale[0] == pytest.approx(0.4)
    assert ks.encode_residuals(np.ones((1, 65)), np.eye(65))[0].shape == (1, 16)  # 65 dims: two words
    # magnitudes at float64's ends do not overflow the norms; factors saturate at float32's range
    codes, fac, norm, _, fscale = ks.encode_residuals(np.array([[1e300, -1e300], [1e-300, 0.0], [1e-30, 0.0]]),
                                                      np.eye(2))
    assert np.isfinite(norm).all() and norm[0] == pytest.approx(np.sqrt(2) * 1e300)
    assert fac[0] == np.finfo(np.float32).max and fac[2] == pytest.approx(1e-30)
    assert fscale[0] == np.finfo(np.float32).max and fscale[2] == pytest.approx(1e-30 / 7.5)



def test_query_quantization_hand_worked() -> None:
    # qr = (-1.5, 1.5, 0, 3): lo = -1.5, d = 4.5 / 15 = 0.3, u = (0, 10, 5, 15), every component on the grid.
    # A code with bits (1, 0, 1, 1), signs (+, -, +, +): qr . s = -1.5 - 1.5 + 0 + 3 = 0, and the popcount
    # form: S = 10 * 0 + 5 + 15 = 20, c = 3, c1 S + c2 c + c0 = 0.6 * 20 - 3 * 3 + (-0.3 * 30 + 4 * 1.5) = 0
    planes, c1, c2, c0 = ks.query_planes(np.array([-1.5, 1.5, 0.0, 3.0]))
    assert planes[:, 0].tolist() == [0b1100, 0b1010, 0b1100, 0b1010]  # bit p of u_i at bit i of plane p
    assert (c1, c2, c0) == pytest.approx((0.6, -3.0, -3.0))
    S = sum((1 << p) * bin(int(planes[p, 0]) & 0b1101).count("1") for p in range(4))
    assert S == 20 and c1 * S + c2 * 3 + c0 == pytest.approx(0.0, abs=1e-12)
    # every code of 4 bits: the popcount form equals the quantized query's dot product with the signs
    qhat = -1.5 + 0.3 * np.array([0, 10, 5, 15])
    for code in range(16):
        bits = np.array([(code >> i) & 1 for i in range(4)])
        S = sum((1 << p) * bin(int(planes[p, 0]) & code).count("1") for p in range(4))
        assert c1 * S + c2 * bits.sum() + c0 == pytest.approx(qhat @ (2.0 * bits - 1), abs=1e-12)
    # a constant query (or a zero one) quantizes without dividing by zero
    planes, c1, c2, c0 = ks.query_planes(np.full(5, 2.0))
    assert not planes.any() and (c2, c0) == (4.0, -10.0)  # 2 (2 c - 5): the exact sum of +-2

def test_every_candidate_equals_dense_float64() -> None:
    # candidates >= every routed key: the step reads every key, so it is exact attention (GQA, causal)
    c, K, V = _cache(2000, hk=2, h=4, selector="sketch:candidates=5000")
    q = np.random.default_rng(3).standard_normal((4, 5, E)).astype(np.float32)
    out = c.attend(q)
    for h in range(4):
        for t in range(5):
            n_vis = 2000 - 5 + t + 1
            ref = _attend64(q[h, t], K[h // 2, :n_vis], V[h // 2, :n_vis], c.scale)
            np.testing.assert_allclose(out[h, t], ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9])
def test_planted_keys_found_at_every_depth(depth: float) -> None:
    n = 3000
    c, K, V = _cache(n, hk=1, h=1, seed=int(depth * 10))
    q = np.random.default_rng(7).standard_normal(E).astype(np.float32)
    q *= 6 / np.linalg.norm(q)
    # rebuild with a key pointing at the query at the given depth (the rest is background)
    K2 = K.copy()
    j = int(depth * (n - 100)) + 3
    K2[0, j] = q * 1.2
    c2 = KVCache(1, E, selector="sketch:candidates=256", **group_options(KW))  # 256 of ~2,900 routed keys: the scan decides
    c2.append(K2, V)
    sel = c2.selected_slots(q, 0)
    top = c2.selected_slots(q, 0, k=16, selector="topk")
    slot_of = {int(p): s for s, p in enumerate(c2.store.pos[0, :c2.store.slots])}
    assert slot_of[j] in set(sel.tolist())
    assert np.isin(top, sel).mean() >= 0.9
    # the step equals float64 attention over the slots it reads
    out = c2.attend(q[None, None])[0, 0]
    ks_, vs_ = c2.store.keys(0, sel), c2.store.values(0, sel)
    np.testing.assert_allclose(out, _attend64(q, ks_, vs_, c2.scale), rtol=1e-5, atol=1e-5)


def _check_heads(c: KVCache, q: np.ndarray, out: np.ndarray) -> None:
    """Every query head's read slots pass the two-stage oracle, and its output ``out[i]`` equals float64
    attention over them."""
    h, hk = c.num_heads, c.num_kv_heads
    for i in range(h):
        sel = np.asarray(c.selected_slots(q[i], i))
        _check_two_stage(c, q[i], i, sel)
        g = i // (h // hk)
        ref = _attend64(q[i], c.store.keys(g, sel), c.store.values(g, sel), c.scale)
        np.testing.assert_allclose(out[i], ref, rtol=2e-5, atol=2e-5)


def test_selection_is_the_top_estimates_brute_force() -> None:
    # the candidates are the best routed keys by the two estimates (recomputed here in numpy from the
    # codes), plus the sinks and the tail
    for cand, one in ((40, False), (60, False), (200, True)):  # a shortlist of 800 of ~2,900 keys: one stage
        c, K, V = _cache(3000, hk=1, h=1, selector=f"sketch:candidates={cand}")
        assert c.stats["sketch_one_stage"] is one
        for seed in range(3):
            _check_two_stage(c, np.random.default_rng(seed).standard_normal(E).astype(np.float32))
    c, K, V = _cache(3000, hk=1, h=1, selector="sketch:candidates=40,shortlist=0.9")
    _check_two_stage(c, np.random.default_rng(5).standard_normal(E).astype(np.float32))



@settings(max_examples=30, deadline=None)
@given(n=st.integers(700, 6000), cand=st.integers(1, 400), cap=st.one_of(st.none(), st.integers(300, 4000)),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_candidates_are_the_top_estimates_hypothesis(n: int, cand: int, cap: int | None, seed: int,
                                                     scale: float) -> None:
    # the routed keys read are the live routed keys of largest estimate, recomputed in numpy from the codes
    # (the scan's sampled threshold and its cluster skipping change nothing), with evictions and compaction
    kw = {"max_keys": cap} if cap is not None else {}
    c, K, V = _cache(n, hk=1, h=1, seed=seed, selector=f"sketch:candidates={cand}", **kw)
    if int(c.debug_view()["n_clusters"][0]) == 0 or c.debug_view()["sketch_reads_all"]:
        return
    _check_two_stage(c, (np.random.default_rng(seed + 1).standard_normal(E) * scale).astype(np.float32))



@pytest.mark.parametrize("hk, h", [(1, 4), (2, 6), (2, 2)])
def test_gqa_heads_scanned_together_read_their_own_best_keys(hk: int, h: int) -> None:
    # the query heads of a kv head are scanned as one group: each still reads its own best keys (the
    # two-stage oracle per head), the same set as when it is scanned alone (selected_slots), and the
    # step equals float64 attention over that set
    c, K, V = _cache(3000, hk=hk, h=h, selector="sketch:candidates=40")
    q = np.random.default_rng(11).standard_normal((h, E)).astype(np.float32)
    out = c.attend(q)
    _check_heads(c, q, out)


@pytest.mark.parametrize("hk, h, seed", [(1, 1, 0), (1, 4, 1), (2, 6, 2), (1, 3, 3)])
def test_skipped_clusters_between_runs_change_no_selection(hk: int, h: int, seed: int) -> None:
    # well-separated key clusters: the ball bound skips most clusters, so the scan's runs of consecutive
    # live clusters start and end at skipped ones, and the query heads of a group (each aimed at a
    # different centre) skip different clusters; every head still reads the best keys by the two
    # estimates (the numpy oracle), and the step equals float64 attention over what it reads
    rng = np.random.default_rng(seed)
    n = 6000
    cent = rng.standard_normal((12, E)) * 6.0
    lab = rng.integers(0, 12, (hk, n))
    K = (cent[lab] + 0.3 * rng.standard_normal((hk, n, E))).astype(np.float32)
    V = rng.standard_normal((hk, n, E)).astype(np.float32)
    c = KVCache(h, E, num_kv_heads=hk, selector="sketch:candidates=30,shortlist=0.02", **group_options(KW))
    for a in range(0, n, 700):
        c.append(K[:, a:a + 700], V[:, a:a + 700])
    q = (cent[rng.integers(0, 12, h)] / 6.0 + 0.1 * rng.standard_normal((h, E))).astype(np.float32)
    out = c.attend(q)
    routed = int(c.debug_view()["cluster_ptr"][0, int(c.debug_view()["n_clusters"][0])]
                 - c.debug_view()["cluster_ptr"][0, 0])
    assert c.stats["sketch_keys_scanned_per_query"] < 0.8 * routed  # clusters were skipped
    _check_heads(c, q, out)


def test_evictions_and_compaction_keep_codes_in_step() -> None:
    c, K, V = _cache(4000, hk=1, h=1, selector="sketch:candidates=100000", max_keys=1500)
    assert c.stats["compactions"] > 0
    q = np.random.default_rng(9).standard_normal(E).astype(np.float32)
    out = c.attend(q[None, None])[0, 0]
    live = c.positions(0)
    ref = _attend64(q, K[0, live], V[0, live], c.scale)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    # after compaction every code is the code of the key now in its slot
    view, st_ = c.debug_view(), c.store
    nc = int(view["n_clusters"][0])
    cptr = view["cluster_ptr"]
    a, b = int(cptr[0, 0]), int(cptr[0, nc])
    mu = np.repeat(view["routing_vectors"][0, :nc].astype(np.float64), np.diff(cptr[0, :nc + 1]), axis=0)
    codes, _, _, fine, _ = ks.encode_residuals(st_.keys(0, slice(a, b)).astype(np.float64) - mu,
                                               view["sketch_rotation"])
    np.testing.assert_array_equal(codes, st_.sketch_codes[0, a:b])
    np.testing.assert_array_equal(fine, st_.sketch_fine[0, a:b])


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_reduced_precision_storage(dtype: object) -> None:
    c, K, V = _cache(1200, hk=1, h=1, selector="sketch:candidates=100000", dtype=dtype)
    q = np.random.default_rng(2).standard_normal(E).astype(np.float32)
    out = c.attend(q[None, None])[0, 0]
    ks_, vs_ = c.store.keys(0), c.store.values(0)
    ref = _attend64(q, ks_[:c.store.slots], vs_[:c.store.slots], c.scale)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 700), t=st.integers(1, 4), mag=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e15]),
       seed=st.integers(0, 2**16))
def test_full_candidates_match_dense_any_shape(n: int, t: int, mag: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    K = (rng.standard_normal((1, n, E)) * mag).astype(np.float32)
    V = rng.standard_normal((1, n, E)).astype(np.float32)
    c = KVCache(1, E, selector="sketch:candidates=100000", scale=1.0 / mag**2 if mag > 1 else None,
                **group_options(KW))
    c.append(K, V)
    t = min(t, n)
    q = (rng.standard_normal((1, t, E)) * mag).astype(np.float32)
    out = c.attend(q)
    for i in range(t):
        nv = n - t + i + 1
        ref = _attend64(q[0, i], K[0, :nv], V[0, :nv], c.scale)
        np.testing.assert_allclose(out[0, i], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec, word", [("sketch:candidates=0", "candidates"), ("sketch:fraction=2", "fraction"),
                                        ("sketch:candidates=1.5", "candidates must be an integer"),
                                        ("sketch:candidates=-1", "candidates must be an integer >= 1; got '-1'"),
                                        ("sketch:candidates=99999999999", "candidates must be an int in"),
                                        ("sketch:fraction=nan", "fraction must be in"),
                                        ("sketch:fraction=abc", "fraction"), ("sketch:probes=3", "unknown option"),
                                        ("sketch:candidates=5,fraction=0.1", "not both"),
                                        ("sketch:shortlist=0", "shortlist must be in"),
                                        ("sketch:shortlist=1.5", "shortlist must be in"),
                                        ("sketch:shortlist=inf", "shortlist must be in"),
                                        ("sketch:shortlist=", "shortlist")])
def test_bad_options_are_named(spec: str, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        KVCache(1, E, selector=spec)


def test_estimate_and_top_p_refused() -> None:
    with pytest.raises(ValueError, match="estimate"):
        KVCache(1, E, selector="sketch", budget=Budget(estimate=4))
    with pytest.raises(ValueError, match="top_p"):
        KVCache(1, E, selector="sketch", budget=Budget(top_p=0.9))


def test_small_cache_reads_every_key() -> None:
    # the default budget (1,024 candidates) is more than an eighth of 2,000 keys: every key is read exactly
    c, K, V = _cache(2000, hk=1, h=1)
    q = np.random.default_rng(6).standard_normal(E).astype(np.float32)
    out = c.attend(q[None, None])[0, 0]
    assert c.stats["keys_read_per_query"] == 2000 and c.stats["sketch_keys_scanned_per_query"] == 0
    assert c.selected_slots(q, 0).size == 2000
    np.testing.assert_allclose(out, _attend64(q, K[0], V[0], c.scale), rtol=2e-5, atol=2e-5)


def test_stats_and_index_size() -> None:
    c, _, _ = _cache(2000, hk=1, h=1, selector="sketch:candidates=100")
    c.attend(np.ones((1, 1, E), np.float32))
    s = c.stats
    assert s["sketch_candidates"] == 100
    assert 0 < s["sketch_keys_scanned_per_query"] <= 2000
    # 4 code planes (8 bytes per 64 dimensions each) + 2 scales (4 bytes each) per slot and a radius (8 bytes)
    # per cluster, beside the layout of the cluster selector (the same clusters): at E = 64 that is 40 of a
    # key's 512 bytes of K and V
    plain, _, _ = _cache(2000, hk=1, h=1, selector="cluster")  # the same clusters
    clusters = int(c.debug_view()["sketch_radius"].size)  # the radius array's allocated size
    extra = 2000 * (32 + 8) + 8 * clusters  # E = 16: a word for each of the 4 bit planes
    assert s["index_nbytes"] == plain.stats["index_nbytes"] + extra


def test_long_multi_token_attend_runs_in_blocks() -> None:
    # 100,000 candidates per row: a plan holds at most 41 tokens of one head, so 120 query tokens run in
    # three blocks; the result is still exact causal attention, and the h2o weights and tail recording
    # (which read the recorded ranges of every block) work across blocks
    n, T = 600, 120
    rng = np.random.default_rng(4)
    K = rng.standard_normal((1, n, E)).astype(np.float32)
    V = rng.standard_normal((1, n, E)).astype(np.float32)
    c = KVCache(1, E, selector="sketch:candidates=100000", **group_options(KW, policy="h2o"))
    assert c.debug_view()["sketch_plan_rows"] == 41  # the block size this test is about (1 head)
    c.append(K, V)
    q = rng.standard_normal((1, T, E)).astype(np.float32)
    out, lse = c.attend(q, return_lse=True)
    for t in (0, 40, 41, 82, 119):
        nv = n - T + t + 1
        ref = _attend64(q[0, t], K[0, :nv], V[0, :nv], c.scale)
        np.testing.assert_allclose(out[0, t], ref, rtol=2e-5, atol=2e-5)
    assert out.shape == (1, T, E) and lse.shape == (1, T) and np.isfinite(lse).all()
    assert c.stats["keys_read_per_query"] == pytest.approx(np.mean(n - T + 1 + np.arange(T)))
    out2 = c.attend(q, tail=8)
    assert out2.shape == (1, T, E) and np.isfinite(out2).all()


def test_audit_against_brute_force() -> None:
    c, K, V = _cache(2500, hk=1, h=2, selector="sketch:candidates=100")
    q = np.random.default_rng(8).standard_normal((2, E)).astype(np.float32) * 3
    rep = c.audit(q, k=32)
    for h in range(2):
        s = K[0].astype(np.float64) @ q[h].astype(np.float64) * c.scale
        w = np.exp(s - s.max())
        w /= w.sum()
        top = np.argsort(-s)[:32]
        slots = c.selected_slots(q[h], h)
        read_pos = c.store.pos[0, slots]
        assert rep["keys_read"][h] == slots.size
        assert rep["recall"][h] == pytest.approx(np.isin(top, read_pos).mean())
        assert rep["mass"][h] == pytest.approx(w[read_pos].sum(), rel=1e-9)
    dense = KVCache(2, E, num_kv_heads=1, selector="dense", **group_options(KW))
    dense.append(K, V)
    full = dense.audit(q[:, None, :])
    assert (full["keys_read"] == 2500).all() and (full["recall"] == 1).all()
    np.testing.assert_allclose(full["mass"], 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="queries must have shape"):
        c.audit(np.zeros((3, E)))


def test_wide_heads_serial_and_parallel_agree() -> None:
    # E = 256, 4 query heads on 1 kv head (Gemma 3's full-attention layers): the step and the scan run in
    # parallel from a smaller key count than at E = 64 (the work counts bytes); rows are independent, so
    # serial and parallel steps give bit-identical outputs, and both match float64 attention over the
    # slots read
    from sparseattn.decode.plan import PARALLEL_MIN_KEYS, parallel_step

    Ew, n = 256, 9000
    rng = np.random.default_rng(11)
    K = rng.standard_normal((1, n, Ew)).astype(np.float32)
    V = rng.standard_normal((1, n, Ew)).astype(np.float32)
    q = rng.standard_normal((4, Ew)).astype(np.float32)
    outs = []
    for par in (False, True, None):
        c = KVCache(4, Ew, num_kv_heads=1, selector="sketch:candidates=256", parallel=par,
                    **group_options({"segment": 1024, "cluster_size": 64, "window": 64, "sinks": 4}))
        c.append(K, V)
        outs.append(c.attend(q))
        for h in range(4):
            slots = c.selected_slots(q[h], h)
            ref = _attend64(q[h], c.store.K[0, slots], c.store.V[0, slots], c.scale)
            np.testing.assert_allclose(outs[-1][h], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    assert parallel_step(PARALLEL_MIN_KEYS, None) and not parallel_step(PARALLEL_MIN_KEYS - 1, None)
    assert parallel_step(0, True) and not parallel_step(10**9, False)


def test_query_rotation_matches_float64_product() -> None:
    rng = np.random.default_rng(12)
    for Ew in (1, 16, 64, 256):
        rot = np.linalg.qr(rng.standard_normal((Ew, Ew)))[0]
        x = (rng.standard_normal(Ew) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
        out = np.empty(Ew)
        ks.rotate_query(rot, x, out)
        np.testing.assert_allclose(out, rot @ x.astype(np.float64), rtol=1e-12,
                                   atol=1e-12 * np.abs(x).max())


def test_encode_runs_on_one_blas_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # the codes of a closed segment are computed on one BLAS thread (a multi-threaded product leaves
    # BLAS's threads spinning against the next decode steps); the user's setting comes back afterwards
    import threadpoolctl

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    seen: list[list[int]] = []
    real = ks.encode_residuals

    def spy(*a, **kw):
        seen.append(blas_threads())
        return real(*a, **kw)

    monkeypatch.setattr(ks, "encode_residuals", spy)
    before = blas_threads()
    c, _, _ = _cache(1200, hk=1, h=1)  # closes four segments of 256
    assert c.debug_view()["n_clusters"][0] > 0 and seen
    assert all(set(t) == {1} for t in seen), seen  # every BLAS library loaded (faiss may add one)
    assert blas_threads()[:len(before)] == before


@pytest.mark.parametrize("Ew", [128, 192, 256])
@pytest.mark.parametrize("n", [1500, 12000])
def test_wide_codes_select_as_the_oracle(Ew: int, n: int) -> None:
    # codes of 2, 3 and 4 words a key (the estimators' compile-time word counts 2 and 4, and the generic
    # path for 3): one stage (1,500 keys: every routed key by its 4-bit estimate) and two stages (12,000)
    # pick what the numpy recomputation of both estimates picks
    rng = np.random.default_rng(Ew + n)
    K = rng.standard_normal((1, n, Ew)).astype(np.float32)
    V = rng.standard_normal((1, n, Ew)).astype(np.float32)
    c = KVCache(2, Ew, num_kv_heads=1, selector="sketch:candidates=64",
                **group_options({"segment": 1024, "cluster_size": 32, "window": 8, "sinks": 2}))
    c.append(K, V)
    assert c.stats["sketch_one_stage"] == (n == 1500)
    for h in range(2):
        _check_two_stage(c, rng.standard_normal(Ew).astype(np.float32), h)
