"""Multi-token ``attend`` (a prefill through the cache) keeps every row's own exact window: ``window`` rows
equal the decode step at the same position (and float64 attention over their window, also on a clustered
cache), ``pages`` rows' recorded exact ranges cover their own window (float64 attention when the window
covers the cache)."""

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


def test_window_override_on_a_clustered_cache_reads_each_rows_window_by_position() -> None:
    # a sketch cache keeps its older slots in cluster order: the rows' windows are found by position, so a
    # multi-token attend with selector="window" reaching into the clustered part reads exactly the sinks
    # and the window positions of each row (float64 oracle)
    from sparseattn.decode import Layout

    n, T, window, sinks = 3000, 300, 40, 4
    K, V, Q = _data(n, T, 7)
    c = KVCache(1, E, retention=Retention(window=window, sinks=sinks), layout=Layout(segment=256, cluster_size=16))
    c.append(K, V)
    out = c.attend(Q, selector="window")
    for t in range(0, T, 7):
        p = n - T + t
        idx = np.unique(np.r_[np.arange(sinks), np.arange(p + 1 - window, p + 1)])
        np.testing.assert_allclose(out[0, t], _attend64(Q[0, t], K[0, idx], V[0, idx], c.scale), rtol=2e-5,
                                   atol=2e-5)


def test_pages_rows_window_is_in_the_recorded_exact_ranges() -> None:
    # the slot ranges each row's step recorded (debug_step) cover the row's own window
    n, T, window = 1000, 40, 64
    K, V, Q = _data(n, T, 11)
    c = KVCache(1, E, selector="pages", retention=Retention(window=window), budget=Budget(n_probe=1))
    c.append(K, V)
    qpos = np.arange(n - T, n, dtype=np.int64)
    *_, rec, n_rec = c.debug_step(np.ascontiguousarray(Q), qpos, record=True)
    for t in range(T):
        p = int(qpos[t])
        covered = np.zeros(n, bool)
        for first, stop, lim in rec[t, :n_rec[t]]:
            slots = np.arange(first, stop)
            ok = (c.store.pos[0, slots] <= p) & (c.store.pos[0, slots] < lim)
            covered[c.store.pos[0, slots[ok]]] = True
        assert covered[max(0, p + 1 - window):p + 1].all(), t
