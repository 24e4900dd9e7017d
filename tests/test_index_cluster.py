"""ClusterIndex on its own: parameters, built attributes (shapes, dtypes, invariants), routing and search."""

from __future__ import annotations

import numpy as np
import pytest

from sparseattn.index import ClusterIndex


@pytest.fixture
def keys() -> np.ndarray:
    rng = np.random.default_rng(11)
    cent = rng.standard_normal((12, 8)) * 2
    return (cent[rng.integers(0, 12, 600)] + 0.3 * rng.standard_normal((600, 8))).astype(np.float32)


def test_params_round_trip_and_unbuilt_state():
    index = ClusterIndex(n_clusters=6, n_probe=2, split=1.5, assign="l2")
    params = index.get_params()
    assert params["n_clusters"] == 6 and params["split"] == 1.5 and params["assign"] == "l2"
    assert ClusterIndex(**params).get_params() == params
    assert "n_probe=2" in repr(index)
    assert not index.is_built
    with pytest.raises(RuntimeError, match="not built"):
        index.route(np.zeros((1, 8), np.float32))


def test_parameter_errors():
    with pytest.raises(ValueError, match=r"n_probe must be <= n_clusters; got n_probe=5 > n_clusters=4"):
        ClusterIndex(n_clusters=4, n_probe=5)
    with pytest.raises(ValueError, match="train_sample must be >= n_clusters"):
        ClusterIndex(n_clusters=4, train_sample=3)
    with pytest.raises(ValueError, match="assign must be one of"):
        ClusterIndex(assign="cos")
    with pytest.raises(ValueError, match="route_by must be one of"):
        ClusterIndex(route_by="max")
    with pytest.raises(ValueError, match="keys must be a 2-D float32 or float64 array"):
        ClusterIndex().build(np.zeros((4, 3), dtype=np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_built_attributes(keys, dtype):
    k = keys.astype(dtype)
    index = ClusterIndex(n_clusters=10, n_probe=3).build(k)
    S, E = k.shape
    C = index.n_clusters_
    assert index.keys_ is k or np.shares_memory(index.keys_, k)
    assert index.centroids_.shape == (C, E) and index.centroids_.dtype == dtype
    assert index.mean_.shape == (E,) and index.mean_.dtype == dtype
    assert index.assignment_.shape == (S,) and index.assignment_.dtype == np.int32
    assert index.perm_.dtype == np.int64 and np.array_equal(np.sort(index.perm_), np.arange(S))
    assert index.cluster_ptr_.shape == (C + 1,) and index.cluster_ptr_[-1] == S
    for c in range(C):
        members = index.perm_[index.cluster_ptr_[c]:index.cluster_ptr_[c + 1]]
        assert np.all(index.assignment_[members] == c) and np.all(np.diff(members) > 0)
    kc = k.astype(np.float64) - index.mean_
    np.testing.assert_allclose(index.keys_perm_, kc[index.perm_], atol=1e-5)
    dist = np.linalg.norm(kc - index.centroids_[index.assignment_].astype(np.float64), axis=1)
    radius = np.zeros(C)
    np.maximum.at(radius, index.assignment_, dist)
    assert index.radius_.dtype == np.float64
    np.testing.assert_allclose(index.radius_, radius, rtol=1e-5, atol=1e-5)
    # estimation statistics: additive sums per cluster, float64, centred coordinates
    np.testing.assert_array_equal(index.count_, np.diff(index.cluster_ptr_))
    assert index.key_sum_.shape == (C, E) and index.key_sum_.dtype == np.float64
    sums = np.zeros((C, E))
    np.add.at(sums, index.assignment_, kc)
    np.testing.assert_allclose(index.key_sum_, sums, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(index.key_sqsum_, np.bincount(index.assignment_, (kc ** 2).sum(axis=1), C),
                               rtol=1e-5)
    assert index.keys_as(np.float64).dtype == np.float64
    assert index.prefix_budget() == int(np.ceil(3 * S / C))


def test_route_and_search(keys):
    rng = np.random.default_rng(2)
    q = keys[rng.integers(0, 600, 40)] + 0.1 * rng.standard_normal((40, 8)).astype(np.float32)
    index = ClusterIndex(n_clusters=10, n_probe=3).build(keys)
    ids, scores = index.route(q)
    assert ids.shape == (40, 3) and ids.dtype == np.int32 and scores.dtype == np.float32
    s = q.astype(np.float64) @ index.centroids_.T.astype(np.float64)
    np.testing.assert_allclose(scores, np.take_along_axis(s, ids.astype(np.int64), axis=1), rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
    # n_probe = n_clusters: search is the exact top-k over every key
    full = ClusterIndex(n_clusters=10, n_probe=10).build(keys)
    got = full.search(q, 7)
    exact = np.argsort(-(q.astype(np.float64) @ keys.T.astype(np.float64)), axis=1)[:, :7]
    assert np.mean([len(np.intersect1d(got.row(i), exact[i])) / 7 for i in range(40)]) > 0.99
    # causal: only keys at or before the query's position
    pat = full.search(q, 7, is_causal=True, query_positions=np.arange(40) * 10)
    for i in range(40):
        assert np.all(pat.row(i) <= 10 * i)


@pytest.mark.parametrize("S,E,C", [(4096, 64, 64), (300, 12, 5), (1000, 7, 31), (50, 3, 1)])
def test_labels_equal_build_assignment(S: int, E: int, C: int) -> None:
    """labels() runs the k-means alone: the same assignment build() computes (split = 0)."""
    x = np.random.default_rng(S).standard_normal((S, E)).astype(np.float32)
    kw = dict(n_clusters=C, n_probe=1, n_iter=5, seed=3, spherical=True, assign="ip", n_threads=1)
    built = ClusterIndex(**kw).build(x).assignment_
    lab = ClusterIndex(**kw).labels(x)
    assert lab.dtype == np.int64 and lab.shape == (S,)
    np.testing.assert_array_equal(lab, built)
    with pytest.raises(ValueError, match="split"):
        ClusterIndex(split=2.0).labels(x)
    with pytest.raises(ValueError, match="keys must be"):
        ClusterIndex().labels(x[0])


def test_causal_index_labels_are_its_last_band_assignment():
    from sparseattn.index import CausalClusterIndex

    rng = np.random.default_rng(3)
    keys = rng.standard_normal((3000, 8)).astype(np.float32)
    kpos = rng.permutation(3000)
    index = CausalClusterIndex(n_clusters=6, n_probe=2).build(keys, kpos)
    # exact up to max(n_probe S / C, 16 C) = 1,000 keys; one band (1000, 3000] over every key by position,
    # trained on the first 1,000 of them, whatever the storage order
    order = np.argsort(kpos, kind="stable")
    assert index.prefix_budget() == 1000 and [(b.lo, b.hi) for b in index.bands_] == [(1000, 3000)]
    band = index.bands_[0]
    np.testing.assert_array_equal(band.ids, order)
    np.testing.assert_array_equal(band.index.keys_, keys[order])
    expected = np.empty(3000, dtype=np.int64)
    expected[order] = band.index.assignment_
    np.testing.assert_array_equal(CausalClusterIndex(n_clusters=6, n_probe=2).labels(keys, kpos), expected)
    # S <= T (every cluster probed: T = S): no band, every query exact, no label
    assert CausalClusterIndex(n_clusters=6, n_probe=6).build(keys[:900]).bands_ == []
    np.testing.assert_array_equal(CausalClusterIndex(n_clusters=6, n_probe=6).labels(keys[:900]), -1)


def test_causal_index_bands_grow_by_four():
    from sparseattn.index import CausalClusterIndex

    keys = np.random.default_rng(4).standard_normal((9000, 4)).astype(np.float32)
    index = CausalClusterIndex(n_clusters=8, n_probe=1).build(keys)
    # T = max(ceil(9000 / 8), 128) = 1,125; (1125, 4500], then 4 * 4500 >= 9000: the last band to S
    assert index.prefix_budget() == 1125
    assert [(b.lo, b.hi) for b in index.bands_] == [(1125, 4500), (4500, 9000)]
    for b in index.bands_:
        assert b.leading and b.index.prefix_budget() == b.lo and b.index.keys_.shape[0] == b.hi
        assert b.index.keys_.base is keys or b.index.keys_ is keys  # a view: keys already in position order
    # T = 16 C = 128: 700 keys -> (128, 512], (512, 700]; at 600 the remainder 88 < 128 joins: (128, 600]
    assert [(b.lo, b.hi) for b in CausalClusterIndex(n_clusters=8, n_probe=1).build(keys[:700]).bands_] == [
        (128, 512), (512, 700)]
    assert [(b.lo, b.hi) for b in CausalClusterIndex(n_clusters=8, n_probe=1).build(keys[:600]).bands_] == [
        (128, 600)]
    # 5,000 keys: T = 625, (625, 2500], then 4 * 2500 >= 5000: (2500, 5000]
    index = CausalClusterIndex(n_clusters=8, n_probe=1).build(keys[:5000])
    assert [(b.lo, b.hi) for b in index.bands_] == [(625, 2500), (2500, 5000)]
    index = CausalClusterIndex(n_clusters=8, n_probe=1).build(keys[:3300])
    # T = 413, 4 T = 1652, 3300 - 1652 = 1648 >= 413: (413, 1652], then 4 * 1652 >= 3300: (1652, 3300]
    assert [(b.lo, b.hi) for b in index.bands_] == [(413, 1652), (1652, 3300)]


@pytest.mark.parametrize("cls", ["ClusterIndex", "CausalClusterIndex"])
@pytest.mark.parametrize("case", ["E=0", "S=0", "nan", "inf", "int", "n_clusters>S"])
def test_index_build_refuses_bad_keys_with_a_clear_error(cls, case):
    # never FAISS's C++ error, and never the SIGFPE E = 0 used to end the process with
    import sparseattn.index as ix

    keys = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    params = {}
    if case == "E=0":
        keys = np.zeros((64, 0), np.float32)
    elif case == "S=0":
        keys = np.zeros((0, 4), np.float32)
    elif case in ("nan", "inf"):
        keys[5, 1] = np.nan if case == "nan" else np.inf
    elif case == "int":
        keys = np.zeros((64, 4), np.int64)
    else:
        params = {"n_clusters": 65}
    with pytest.raises(ValueError, match="keys|n_clusters"):
        getattr(ix, cls)(**params).build(keys)


@pytest.mark.parametrize("bad, err", [(3.5, TypeError), (True, TypeError), ("1000", TypeError), (-1, ValueError),
                                      (7, ValueError), (501, ValueError)])
def test_prefix_index_refuses_bad_training_counts(bad, err):
    from sparseattn.index import PrefixClusterIndex

    keys = np.random.default_rng(0).standard_normal((500, 4)).astype(np.float32)
    with pytest.raises(err, match="n_train_keys"):
        PrefixClusterIndex(n_clusters=8).build(keys, bad)


def test_prefix_index_trains_on_its_first_keys_only():
    # the codebook and the routing vectors come from keys[:T]: changing later keys changes neither
    from sparseattn.index import PrefixClusterIndex

    rng = np.random.default_rng(5)
    keys = rng.standard_normal((2000, 6)).astype(np.float32)
    a = PrefixClusterIndex(n_clusters=8, n_probe=2).build(keys, 400)
    later = keys.copy()
    later[400:] = 30.0 * rng.standard_normal((1600, 6))
    b = PrefixClusterIndex(n_clusters=8, n_probe=2).build(later, 400)
    assert a.prefix_budget() == 400
    np.testing.assert_array_equal(a.kmeans_centroids_, b.kmeans_centroids_)
    np.testing.assert_array_equal(a.centroids_, b.centroids_)
    np.testing.assert_array_equal(a.assignment_[:400], b.assignment_[:400])


def test_concurrent_kmeans_equal_sequential_on_any_thread_count():
    # Six k-means at once from Python threads (each on 1-3 workers) give the centroids of one run alone.
    import threading

    from sparseattn.index.kmeans import train_kmeans

    x = np.random.default_rng(0).standard_normal((3000, 16)).astype(np.float32)
    want = train_kmeans(x, 32, 3000, seed=1, n_iter=3, spherical=True, n_threads=1)
    barrier = threading.Barrier(6)
    out = [None] * 6

    def work(t):
        barrier.wait()
        for _ in range(3):
            out[t] = train_kmeans(x, 32, 3000, seed=1, n_iter=3, spherical=True, n_threads=1 + t % 3)

    ths = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    for o in out:
        np.testing.assert_array_equal(o, want)


def _numpy_rounds(x, cent, n_iter, spherical):
    """Oracle: Lloyd rounds written plainly in numpy float64 from the start cent (the same empty-cluster rule)."""
    C = cent.shape[0]
    cent = cent.astype(np.float64)
    if spherical:
        cent /= np.linalg.norm(cent, axis=1, keepdims=True)
    for _ in range(n_iter):
        sc = x @ cent.T - (0 if spherical else 0.5 * (cent ** 2).sum(axis=1))
        lab = sc.argmax(axis=1)
        best = sc.max(axis=1)
        new = np.array([x[lab == c].mean(axis=0) if (lab == c).any() else np.nan * x[0] for c in range(C)])
        empty = np.flatnonzero(np.isnan(new[:, 0]))
        new[empty] = x[np.argsort(best, kind="stable")[:empty.size]]
        cent = new / np.linalg.norm(new, axis=1, keepdims=True) if spherical else new
    return cent


@pytest.mark.parametrize("spherical", [True, False])
@pytest.mark.parametrize("n, E, C, n_iter", [(5000, 16, 40, 4), (2049, 8, 7, 6), (300, 3, 300, 2)])
def test_lloyd_rounds_match_numpy_oracle(spherical, n, E, C, n_iter):
    # The rounds against float64 numpy rounds from the same start, on every thread count.
    from sparseattn.index.kmeans import lloyd_rounds
    from sparseattn.threads import worker_threads

    x = np.random.default_rng(n).standard_normal((n, E)).astype(np.float32)
    start = x[np.sort(np.random.default_rng(7).choice(n, C, replace=False))]
    want = _numpy_rounds(x.astype(np.float64), start.astype(np.float64), n_iter, spherical)
    got = []
    for t in (1, 2, 3):
        with worker_threads(t) as w:
            got.append(lloyd_rounds(x, start.copy(), n_iter, spherical, w))
        assert got[-1].dtype == np.float32 and got[-1].shape == (C, E)
        np.testing.assert_array_equal(got[-1], got[0])  # the thread count changes nothing
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("m, E, C", [(500, 8, 40), (64, 3, 64), (1000, 32, 1)])
def test_kmeanspp_seeds_match_numpy_oracle(m, E, C):
    # Oracle: k-means++ in numpy float64 with the same uniform draws (first row uniform, then the first row
    # whose running sum of squared distances exceeds u * total).
    from sparseattn.kernels import cluster as ck

    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, E)).astype(np.float32)
    u = rng.random(C)
    want = [min(m - 1, int(u[0] * m))]
    d2 = ((x.astype(np.float64) - x[want[0]].astype(np.float64)) ** 2).sum(axis=1)
    for c in range(1, C):
        cs = np.cumsum(d2)
        want.append(int(np.searchsorted(cs, u[c] * cs[-1], side="right")))
        d2 = np.minimum(d2, ((x.astype(np.float64) - x[want[-1]].astype(np.float64)) ** 2).sum(axis=1))
    got = np.empty(C, dtype=np.int64)
    ck.kmeanspp_seeds(x, u, got)
    np.testing.assert_array_equal(got, want)
    assert np.unique(got).size == C


def test_kmeanspp_seeds_distinct_on_duplicate_rows():
    # Three distinct points repeated: after the three, every distance is 0; the seeds stay distinct rows.
    from sparseattn.kernels import cluster as ck

    x = np.repeat(np.eye(3, dtype=np.float32), 5, axis=0)
    got = np.empty(7, dtype=np.int64)
    ck.kmeanspp_seeds(x, np.random.default_rng(0).random(7), got)
    assert np.unique(got).size == 7
    assert np.unique(x[got[:3]], axis=0).shape[0] == 3  # the first three cover the three points


def test_lloyd_finds_planted_clusters_and_relocates_empty_ones():
    # Three tight, far-apart groups and C = 3: every centroid lands on one group's centre.  With C = 5 over
    # rows of only three distinct values, two centroids start as (or become) duplicates and lose their
    # members: they are moved to rows, never NaN, and the groups stay found.
    from sparseattn.index.kmeans import lloyd

    rng = np.random.default_rng(3)
    centres = np.array([[10.0, 0, 0], [0, 10.0, 0], [0, 0, 10.0]], dtype=np.float32)
    x = (centres[rng.integers(0, 3, 900)] + 0.01 * rng.standard_normal((900, 3))).astype(np.float32)
    for seed in range(5):
        cent = lloyd(x, 3, 5, np.random.default_rng(seed), False, 1)
        d = np.linalg.norm(cent[:, None] - centres[None], axis=2).min(axis=0)
        assert (d < 0.05).all(), (seed, d)
    dup = centres[rng.integers(0, 3, 60)]
    for spherical in (False, True):
        cent = lloyd(dup, 5, 4, np.random.default_rng(0), spherical, 2)
        assert np.isfinite(cent).all()
        unit = centres / 10 if spherical else centres
        d = np.linalg.norm(cent[:, None] - unit[None], axis=2)
        assert (d.min(axis=1) < 1e-6).all()  # every centroid sits on one of the three points
        assert (d.min(axis=0) < 1e-6).all()  # and every point has one


def test_one_centroid_beyond_float32_is_the_float64_mean():
    # C = 1 (also each part count of 1 in split_large): the mean of float64 keys far beyond float32's range,
    # in float64 (it overflowed to inf in float32, and routing by that centroid read the wrong keys).
    from sparseattn.index.kmeans import train_kmeans

    k = np.random.default_rng(0).standard_normal((300, 4)) * 1e100
    cent = train_kmeans(k, 1, 300, seed=0, n_iter=5, spherical=False)
    assert cent.dtype == np.float64
    np.testing.assert_allclose(cent[0], k.mean(axis=0), rtol=1e-6)
    idx = ClusterIndex(n_clusters=1, n_probe=1, spherical=False, route_by="centroid").build(k)
    assert np.isfinite(idx.centroids_).all()


def test_build_refuses_a_nan_key_outside_the_training_sample():
    # The k-means sees only its sample: a NaN key elsewhere was assigned and dropped out of attention silently.
    k = np.random.default_rng(0).standard_normal((3000, 8))
    k[2500, 0] = np.nan
    for call in (lambda: ClusterIndex(n_clusters=10, train_sample=100).build(k),
                 lambda: ClusterIndex(n_clusters=10, train_sample=100).labels(k)):
        with pytest.raises(ValueError, match="finite"):
            call()


def test_cache_clustering_under_the_workqueue_threading_layer():
    # The decode cache clusters its heads' segments on worker threads: the k-means may only call serial
    # kernels there (Numba's workqueue layer aborts the process on concurrent entry into its parallel pool).
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from sparseattn import KVCache, Layout\n"
        "rng = np.random.default_rng(0)\n"
        "c = KVCache(4, 16, selector='cluster', layout=Layout(segment=1024, cluster_size=32))\n"
        "k = rng.standard_normal((4, 5000, 16)).astype(np.float32)\n"
        "c.append(k, k)\n"
        "out = c.attend(rng.standard_normal((4, 1, 16)).astype(np.float32))\n"
        "import numba\n"
        "assert numba.threading_layer() == 'workqueue'\n"
        "print('ok', bool(np.isfinite(out).all()))\n")
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok True")


@pytest.mark.parametrize("dtype, mag", [(np.float64, 1e-300), (np.float64, 1e-310), (np.float32, 1e-30),
                                        (np.float32, 1e-40), (np.float32, 1e37), (np.float64, 1e100)])
@pytest.mark.parametrize("spherical", [True, False])
def test_tiny_and_huge_keys_cluster_like_unit_keys(dtype, mag, spherical):
    # Keys scaled by a power-of-two-free factor cluster as the unit keys do: the planted groups are found
    # (squared norms near 1e-600, or products near 1e-60 in float32, had put every key in one cluster).
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((8, 16)) * 4
    unit = centres[rng.integers(0, 8, 2000)] + 0.05 * rng.standard_normal((2000, 16))
    idx = ClusterIndex(n_clusters=8, n_probe=1, spherical=spherical).build((unit * mag).astype(dtype))
    sizes = np.diff(idx.cluster_ptr_)
    assert sizes.max() < 2000 / 2, sizes
    ref = ClusterIndex(n_clusters=8, n_probe=1, spherical=spherical).build(unit.astype(dtype))
    # the same partition of the keys as the unit-scale build (cluster ids may differ)
    pairs = set(zip(idx.assignment_.tolist(), ref.assignment_.tolist(), strict=True))
    assert len(pairs) == len(set(ref.assignment_.tolist())) == len(set(idx.assignment_.tolist()))


@pytest.mark.parametrize("rule", ["ip", "l2"])
def test_assign_keys_at_the_ends_of_float32_match_a_float64_oracle(rule):
    # Centroids with an entry near float32's largest (2**128 as a scale was inf in float32) and keys near
    # 1e37: the labels are float64's argmax over the same values divided by 1e37.
    from sparseattn.index.kmeans import assign_keys
    from sparseattn.threads import worker_threads

    rng = np.random.default_rng(1)
    keys = (rng.standard_normal((1000, 4)) * 1e37).astype(np.float32)
    cent = (rng.standard_normal((8, 4)) * 1e37).astype(np.float32)
    cent[0, 0] = 3e38
    k64, c64 = keys.astype(np.float64) / 1e37, cent.astype(np.float64) / 1e37
    sc = k64 @ c64.T - (0.5 * (c64 ** 2).sum(axis=1) if rule == "l2" else 0.0)
    with worker_threads(2) as n:
        got = assign_keys(keys, cent, rule, n)
    np.testing.assert_array_equal(got, sc.argmax(axis=1))
