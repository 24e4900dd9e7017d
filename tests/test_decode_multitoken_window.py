"""Multi-token ``attend`` (a prefill through the cache) keeps every row's own exact window: ``window`` rows
equal the decode step at the same position, ``pages`` rows read at least the sinks and their own window
(all of it exactly: float64 attention when the window covers the cache)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparseattn import KVCache
from sparseattn.decode import Budget, Retention

E = 8


def _attend64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    s = k.astype(np.float64) @ q.astype(np.float64) * scale
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v.astype(np.float64)


def _data(n: int, T: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((1, n, E)).astype(np.float32)
    V = rng.standard_normal((1, n, E)).astype(np.float32)
    Q = rng.standard_normal((1, T, E)).astype(np.float32)
    return K, V, Q


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 400), frac=st.floats(0.0, 1.0), window=st.integers(0, 120), sinks=st.integers(0, 5),
       seed=st.integers(0, 2**16))
@example(n=30, frac=0.1, window=0, sinks=2, seed=0)  # window 0: every row reads its sinks only
def test_window_rows_equal_the_decode_step_at_their_position(n: int, frac: float, window: int, sinks: int,
                                                              seed: int) -> None:
    T = max(1, int(frac * n))
    K, V, Q = _data(n, T, seed)
    ret = Retention(window=window, sinks=sinks)
    c = KVCache(1, E, selector="window", retention=ret)
    c.append(K, V)
    out = c.attend(Q)
    for t in range(T):
        p = n - T + t  # row t's position
        one = KVCache(1, E, selector="window", retention=ret)
        one.append(K[:, :p + 1], V[:, :p + 1])
        np.testing.assert_allclose(out[0, t], one.attend(Q[:, t])[0], rtol=1e-5, atol=1e-6)
        # and the float64 oracle: the sinks and the window keys up to the row's own
        idx = np.unique(np.r_[np.arange(min(sinks, p + 1)), np.arange(max(0, p + 1 - window), p + 1)])
        want = _attend64(Q[0, t], K[0, idx], V[0, idx], c.scale) if idx.size else np.zeros(E)  # no key: zeros
        np.testing.assert_allclose(out[0, t], want, rtol=2e-5, atol=2e-5)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(40, 1500), T=st.integers(2, 40), window=st.integers(1, 200), n_probe=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_pages_rows_read_their_own_window(n: int, T: int, window: int, n_probe: int, seed: int) -> None:
    T = min(T, n)
    K, V, Q = _data(n, T, seed)
    c = KVCache(1, E, selector="pages", retention=Retention(window=window), budget=Budget(n_probe=n_probe))
    c.append(K, V)
    out = c.attend(Q)
    assert np.isfinite(out).all()
    s0 = c.store.s0
    nread = c._last_read[0]  # keys each row read
    for t in range(T):
        p = n - T + t
        assert nread[t] >= min(p + 1, s0 + window), (t, nread[t])


def test_pages_window_covering_the_cache_is_exact_on_every_row() -> None:
    n, T = 3000, 5
    K, V, Q = _data(n, T, 3)
    c = KVCache(1, E, selector="pages", retention=Retention(window=10 * n), budget=Budget(n_probe=1))
    c.append(K, V)
    out = c.attend(Q)
    for t in range(T):
        p = n - T + t
        np.testing.assert_allclose(out[0, t], _attend64(Q[0, t], K[0, :p + 1], V[0, :p + 1], c.scale),
                                   rtol=2e-5, atol=2e-5)
