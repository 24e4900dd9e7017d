"""KVCache.attend(tail=...): the sampled tail estimate, against float64 dense attention written here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn.attention.cache_tail import cache_tail
from sparseattn.cache import KVCache, Retention, group_options
from sparseattn.kernels.decode import EVICTED

E, EV = 16, 8
SMALL = dict(segment=64, cluster_size=8, n_probe=2, window=8, sinks=2)


def dense_oracle(cache: KVCache, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 exact attention of q (H, T, E) at the newest T positions over every visible key.

    Returns out (H, T, Ev), lse (H, T) and the denominator Σ exp(s_j) (H, T), all float64.
    """
    H, T, _ = q.shape
    rep = cache.num_heads // cache.num_kv_heads
    d = cache.debug_view()
    out = np.zeros((H, T, cache.value_dim))
    lse = np.full((H, T), -np.inf)
    den = np.zeros((H, T))
    for h in range(H):
        g = h // rep
        K = d["keys"][g].astype(np.float64)
        V = d["values"][g].astype(np.float64)
        pos = d["positions"][g].astype(np.int64)
        for t in range(T):
            qp = cache.positions_appended - T + t
            vis = pos <= qp
            if not vis.any():
                continue
            s = (K[vis] @ q[h, t].astype(np.float64)) * cache.scale
            mx = s.max()
            w = np.exp(s - mx)
            out[h, t] = w @ V[vis] / w.sum()
            lse[h, t] = mx + np.log(w.sum())
            den[h, t] = np.exp(lse[h, t])
    return out, lse, den


def filled(n: int, *, H: int = 2, H_kv: int = 2, seed: int = 0, **kw) -> tuple[KVCache, np.random.Generator]:
    rng = np.random.default_rng(seed)
    cache = KVCache(H, E, num_kv_heads=H_kv, value_dim=EV, **group_options(kw))
    cache.append(rng.standard_normal((H_kv, n, E)).astype(np.float32),
                 rng.standard_normal((H_kv, n, EV)).astype(np.float32))
    return cache, rng


def queries(rng: np.random.Generator, H: int, T: int = 1, gain: float = 2.0) -> np.ndarray:
    return (gain * rng.standard_normal((H, T, E))).astype(np.float32)


# -------------------------------------------------------------------------- whole tail read: exact
CASES = {
    "cluster": (dict(selector="cluster", **SMALL), {}, 1),
    "window": (dict(selector="window", sinks=2, window=8), {}, 1),
    "topk": (dict(selector="window", sinks=2, window=8), dict(selector="topk", k=5), 1),
    "pages": (dict(selector="pages", sinks=2, window=8, n_probe=2, page_size=16, segment=64), {}, 1),
    "gqa": (dict(selector="cluster", **SMALL), {}, 1),
    "multi_token": (dict(selector="cluster", **SMALL), {}, 3),
    "float16": (dict(selector="cluster", dtype=np.float16, **SMALL), {}, 1),
    "capped": (dict(selector="cluster", max_keys=150, **SMALL), {}, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_whole_tail_is_exact(name: str) -> None:
    ckw, akw, T = CASES[name]
    H, H_kv = (4, 2) if name == "gqa" else (2, 2)
    cache, rng = filled(400, H=H, H_kv=H_kv, **ckw)
    q = queries(rng, H, T)
    ref, ref_lse, _ = dense_oracle(cache, q)
    part, part_lse = cache.attend(q, return_lse=True, **akw)
    read = cache.stats["keys_read_per_query"]
    visible = np.array([len(cache) - (T - 1 - t) for t in range(T)])
    assert read < visible.min(), "the selector must leave keys unread for the test to mean something"
    assert np.abs(part - ref).max() > 1e-3  # the exact part alone is not exact attention
    out, lse = cache.attend(q, return_lse=True, tail=10**6, **akw)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
    # every visible key read exactly once: keys read per query = visible keys per row
    assert cache.stats["keys_read_per_query"] == pytest.approx(float(np.mean(np.tile(visible, H))))


def test_capped_never_samples_evicted() -> None:
    """With a streaming cap the sampler draws only live, unread slots (both sampling paths)."""
    from sparseattn.attention import cache_tail as ct

    cache, rng = filled(400, selector="cluster", max_keys=150, **SMALL)
    assert cache.stats["evicted_keys"] == 250
    assert np.count_nonzero(cache.debug_view()["positions"] == EVICTED) > 0  # evicted slots still held
    R = 2
    q = queries(rng, R)
    qpos = np.array([cache.positions_appended - 1], dtype=np.int64)
    _, _, nread, _, rec, n_rec = cache.debug_step(q, qpos, 64, "cluster", record=True)
    u = 150 - nread
    for enum in (False, True):
        for seed in range(20):
            idx = np.full((R, 40), -1, dtype=np.int64)
            found = np.full(R, -1, dtype=np.int64)
            ct._sample_serial(cache.store.pos, cache.store.slots, qpos, 1, rec, n_rec, u, np.full(R, 40),
                              np.full(R, enum), seed, idx, found)
            for r in range(R):
                pos = cache.debug_view()["positions"]
                assert np.all(pos[r, idx[r]] != EVICTED) and np.unique(idx[r]).size == 40
                read = np.zeros(cache.store.slots, bool)
                for a, b, lim in rec[r, :n_rec[r]]:
                    read[a:b] |= (pos[r, a:b] <= qpos[0]) & (pos[r, a:b] < lim)
                assert not read[idx[r]].any()


# ------------------------------------------------------------------------------------ unbiasedness
@pytest.mark.parametrize("selector,akw", [("cluster", {}), ("window", {}), ("window", {"selector": "topk", "k": 4})])
def test_unbiased_numerator_and_denominator(selector: str, akw: dict) -> None:
    ckw = dict(SMALL) if selector == "cluster" else dict(sinks=2, window=8)
    cache, rng = filled(500, selector=selector, seed=3, **ckw)
    q = queries(rng, 2, gain=1.5)
    ref, _, den = dense_oracle(cache, q)
    num = ref * den[..., None]
    n_seeds = 400
    d_hat = np.empty((n_seeds,) + den.shape)
    n_hat = np.empty((n_seeds,) + num.shape)
    for s in range(n_seeds):
        o, lse = cache.attend(q, return_lse=True, tail=sa.Tail(8, seed=s), **akw)
        d_hat[s] = np.exp(lse.astype(np.float64))
        n_hat[s] = o * d_hat[s][..., None]
    se_d = d_hat.std(axis=0, ddof=1) / np.sqrt(n_seeds)
    assert np.all(se_d > 0)  # a random estimate (not a whole tail read)
    assert np.all(np.abs(d_hat.mean(axis=0) - den) <= 5 * se_d)
    se_n = n_hat.std(axis=0, ddof=1) / np.sqrt(n_seeds)
    assert np.all(np.abs(n_hat.mean(axis=0) - num) <= 5 * se_n + 1e-9)


def test_shrink_lowers_tail_weight_and_keeps_exact_rows() -> None:
    cache, rng = filled(500, selector="window", sinks=2, window=8)
    q = queries(rng, 2)
    _, lse0 = cache.attend(q, return_lse=True, tail=sa.Tail(16, seed=1))
    _, lse1 = cache.attend(q, return_lse=True, tail=sa.Tail(16, seed=1, shrink=8.0))
    _, part = cache.attend(q, return_lse=True)
    assert np.all(lse1 < lse0) and np.all(lse1 > part)  # 0 < ESS / (ESS + c) < 1 on the tail term
    ref, ref_lse, _ = dense_oracle(cache, q)
    out, lse = cache.attend(q, return_lse=True, tail=sa.Tail(10**6, shrink=8.0))
    np.testing.assert_allclose(out, ref, atol=2e-5)  # the whole tail read: exact, shrink or not
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


# ------------------------------------------------------------------------------------ determinism
def test_deterministic_per_seed_and_batching() -> None:
    cache, rng = filled(600, H=4, H_kv=2, selector="cluster", **SMALL)
    q = queries(rng, 4, 3)
    a = cache.attend(q, return_lse=True, tail=sa.Tail(16, seed=7))
    b = cache.attend(q, return_lse=True, tail=sa.Tail(16, seed=7))
    c = cache.attend(q, return_lse=True, tail=sa.Tail(16, seed=8))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    # the stream depends only on (seed, head, position): a single-token call at the last position draws
    # the same keys as the last token of the 3-token call
    last = cache.attend(q[:, 2:], return_lse=True, tail=sa.Tail(16, seed=7))
    np.testing.assert_allclose(last[0][:, 0], a[0][:, 2], atol=1e-6)
    np.testing.assert_allclose(last[1][:, 0], a[1][:, 2], atol=1e-6)
    # and the serial and parallel samplers (threads) give the same draw
    cache.parallel = True
    p = cache.attend(q, return_lse=True, tail=sa.Tail(16, seed=7))
    np.testing.assert_allclose(p[0], a[0], atol=1e-6)


def test_same_draw_enumerated_or_rejected_rows_are_valid_subsets() -> None:
    """Both sampling paths return m' distinct unread visible slots, and spread over the whole unread set."""
    from sparseattn.attention import cache_tail as ct

    cache, rng = filled(300, H=1, H_kv=1, selector="window", sinks=2, window=8)
    q = queries(rng, 1)
    qpos = np.array([299], dtype=np.int64)
    out, lse, nread, _, rec, n_rec = cache.debug_step(q, qpos, 64, "window", record=True)
    u = np.array([300 - int(nread[0])])
    assert u[0] == 290
    for enum in (False, True):
        hits = np.zeros(300, int)
        for seed in range(300):
            idx = np.full((1, 10), -1, dtype=np.int64)
            found = np.full(1, -1, dtype=np.int64)
            ct._sample_serial(cache.store.pos, 300, qpos, 1, rec, n_rec, u, np.array([10]), np.array([enum]), seed,
                              idx, found)
            assert np.unique(idx).size == 10 and idx.min() >= 2 and idx.max() < 292
            hits[idx[0]] += 1
        # uniform: each of the 290 unread keys drawn with probability 10/290 per seed
        expect = 300 * 10 / 290
        assert hits[:2].sum() == 0 and hits[292:].sum() == 0
        assert abs(hits[2:292].mean() - expect) < 1e-9
        assert hits[2:292].max() < expect + 6 * np.sqrt(expect) and hits[2:292].min() > 0


# ------------------------------------------------------------------------------------ stats, errors
def test_stats_count_the_samples() -> None:
    cache, rng = filled(400, selector="window", sinks=2, window=8)
    q = queries(rng, 2)
    cache.attend(q)
    base = cache.stats["keys_read_per_query"]
    assert base == 10
    cache.attend(q, tail=32)
    assert cache.stats["keys_read_per_query"] == base + 32


@pytest.mark.parametrize("bad,exc,word", [(0, ValueError, "samples"), (-3, ValueError, "samples"),
                                          (2.5, TypeError, "tail"), ("8", TypeError, "tail"),
                                          (True, TypeError, "tail")])
def test_bad_tail(bad: object, exc: type, word: str) -> None:
    cache, rng = filled(50, selector="window", sinks=2, window=8)
    with pytest.raises(exc, match=word):
        cache.attend(queries(rng, 2), tail=bad)


def test_empty_cache_is_refused() -> None:
    cache = KVCache(2, E, value_dim=EV, selector="window")
    with pytest.raises(ValueError, match="queries hold T_q=1 tokens but only 0 positions were appended"):
        cache.attend(np.ones((2, 1, E), np.float32), return_lse=True, tail=16)


def test_empty_exact_part_gets_the_tail_alone() -> None:
    """A row whose exact part read nothing (lse = -inf) is the tail estimate alone: exact for m' = u, and for
    m' < u the Horvitz-Thompson output of the sample (a convex combination of its values)."""
    cache, rng = filled(120, selector="window", sinks=2, window=8)
    q = queries(rng, 2)
    qpos = np.array([119], dtype=np.int64)
    out0 = np.full((2, 1, EV), np.nan, np.float32)  # never read: the part has no key
    lse0 = np.full((2, 1), -np.inf, np.float32)
    rec = np.zeros((2, 2, 3), np.int64)
    n_rec = np.zeros(2, np.int64)
    nread = np.zeros(2, np.int64)
    ref, ref_lse, _ = dense_oracle(cache, q)
    out, lse, n_tail = cache_tail(cache, q, qpos, out0, lse0, rec, n_rec, nread, sa.Tail(500))
    assert n_tail.tolist() == [120, 120] and n_tail.dtype == np.int64
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
    out, lse, n_tail = cache_tail(cache, q, qpos, out0, lse0, rec, n_rec, nread, sa.Tail(10, seed=4))
    assert n_tail.tolist() == [10, 10] and np.isfinite(out).all() and np.isfinite(lse).all()
    V = cache.debug_view()["values"][:, :120].astype(np.float64)
    assert np.all(out[:, 0] <= V.max(axis=1) + 1e-6) and np.all(out[:, 0] >= V.min(axis=1) - 1e-6)


def test_nothing_unread_is_unchanged() -> None:
    cache, rng = filled(30, selector="window", sinks=2, window=64)
    q = queries(rng, 2)
    a = cache.attend(q, return_lse=True)
    b = cache.attend(q, return_lse=True, tail=16)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert cache.stats["tail_samples_per_query"] == 0


# ------------------------------------------------------------------------------------ property test
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), window=st.integers(0, 40), samples=st.integers(1, 400),
       selector=st.sampled_from(["cluster", "window", "topk", "pages"]), T=st.integers(1, 3),
       seed=st.integers(0, 2**20))
def test_property(n: int, window: int, samples: int, selector: str, T: int, seed: int) -> None:
    T = min(T, n)
    base = "window" if selector == "topk" else selector
    kw = dict(SMALL, window=window) if base in ("cluster", "pages") else dict(sinks=2, window=window)
    if base == "pages":
        kw = dict(sinks=2, window=window, n_probe=2, page_size=16, segment=64)
    cache, rng = filled(n, seed=seed, selector=base, **kw)
    akw = dict(selector="topk", k=3) if selector == "topk" else {}
    q = queries(rng, 2, T)
    part, part_lse = cache.attend(q, return_lse=True, **akw)
    qpos = np.arange(n - T, n, dtype=np.int64)
    _, _, nread, _, _, _ = cache.debug_step(q, qpos, akw.get("k", 64), selector if selector == "topk" else base,
                                            record=False)
    read0 = cache.stats["keys_read_per_query"]
    out, lse = cache.attend(q, return_lse=True, tail=sa.Tail(samples, seed=seed), **akw)
    assert out.dtype == np.float32 and lse.dtype == np.float32 and out.shape == (2, T, EV)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    visible = np.tile(qpos + 1, 2)  # rows h * T + t see positions <= qpos[t]
    expect = np.minimum(samples, visible - nread)
    assert cache.stats["keys_read_per_query"] - read0 == pytest.approx(expect.mean())
    assert np.all(lse >= part_lse - 1e-5)  # the tail only adds mass
    if samples >= n:
        ref, ref_lse, _ = dense_oracle(cache, q)
        np.testing.assert_allclose(out, ref, atol=2e-5)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


def test_inconsistent_read_counts_raise_instead_of_hanging() -> None:
    """Rejection sampling draws a bounded number of times: recorded ranges that cover every key while
    nread claims none was read end in a RuntimeError, not an endless loop."""

    c = KVCache(2, 8, selector="window", retention=Retention(window=4, sinks=0))
    rng = np.random.default_rng(3)
    c.append(rng.standard_normal((2, 400, 8)), rng.standard_normal((2, 400, 8)))
    q = rng.standard_normal((2, 1, 8)).astype(np.float32)
    out = np.zeros((2, 1, 8), np.float32)
    lse = np.zeros((2, 1), np.float32)
    rec = np.array([[[0, 400, 2**31 - 1]]] * 2, np.int64)  # every slot read ...
    n_rec = np.ones(2, np.int64)
    nread = np.zeros(2, np.int64)  # ... but counted as none
    with pytest.raises(RuntimeError, match="disagree"):
        cache_tail(c, q, np.array([399]), out, lse, rec, n_rec, nread, sa.Tail(100))
