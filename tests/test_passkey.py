"""Tests of sparseattn.data.passkey: shapes, dtypes, seeds, the planted keys' softmax share (float64
oracle computed here), depth bands, backgrounds and argument errors."""

from __future__ import annotations

import numpy as np
import pytest

from sparseattn import data


def _oracle(keys: np.ndarray, queries: np.ndarray, scale: float) -> np.ndarray:
    """float64 softmax weights (H, n_queries, n) of every key for every query."""
    lg = np.einsum("htd,hnd->htn", queries.astype(np.float64), keys.astype(np.float64)) * scale
    lg -= lg.max(axis=-1, keepdims=True)
    w = np.exp(lg)
    return w / w.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("background", ["clustered", "gaussian"])
@pytest.mark.parametrize("n_planted", [1, 4, 16])
def test_shapes_dtypes_and_planted_mass(background: str, n_planted: int) -> None:
    w = data.passkey(8192, 32, heads=3, n_planted=n_planted, n_queries=5, background=background, dv=24,
                     seed=1)
    assert w.keys.shape == (3, 8192, 32) and w.keys.dtype == np.float32
    assert w.values.shape == (3, 8192, 24) and w.values.dtype == np.float32
    assert w.queries.shape == (3, 5, 32) and w.queries.dtype == np.float32
    assert w.positions.shape == (3, 5, n_planted) and w.positions.dtype == np.int64
    assert w.mass.shape == (3, 5) and w.mass.dtype == np.float64
    _check(w, n_planted)


def test_planted_keys_top_with_many_similar_queries() -> None:
    # 16 queries of a clustered background in 64 dimensions: some pairs point nearly the same way, so a
    # key planted for one scores high for another; each query's own planted keys must still be its top
    w = data.passkey(16384, 64, heads=4, n_planted=4, n_queries=16, seed=0)
    _check(w, 4)


def _check(w: data.Passkey, n_planted: int) -> None:
    H, nq = w.queries.shape[:2]
    p = _oracle(w.keys, w.queries, w.scale)
    for h in range(H):
        assert np.unique(w.positions[h]).size == nq * n_planted  # distinct within a head
        for t in range(nq):
            own = p[h, t, w.positions[h, t]].sum()
            assert own >= 0.5 - 1e-9  # observed 0.50-0.93
            np.testing.assert_allclose(own, w.mass[h, t], rtol=1e-9)
            # every planted key beats every other key (other queries' planted ones too) by the margin
            lg = w.keys[h].astype(np.float64) @ w.queries[h, t].astype(np.float64) * w.scale
            bg = np.delete(lg, w.positions[h, t])
            assert lg[w.positions[h, t]].min() - bg.max() >= w.margin - 1e-6
            # the planted keys are the query's exact top-n_planted
            top = np.argsort(-lg, kind="stable")[:n_planted]
            assert set(top) == set(w.positions[h, t])


def test_mass_and_margin_arguments_are_met() -> None:
    w = data.passkey(4096, 16, heads=2, n_planted=2, n_queries=4, mass=0.9, margin=5.0, seed=3)
    p = _oracle(w.keys, w.queries, w.scale)
    own = np.take_along_axis(p, w.positions, axis=-1).sum(-1)
    assert (own >= 0.9 - 1e-9).all()
    assert w.margin == 5.0


def test_planted_keys_keep_their_background_off_the_query_direction() -> None:
    w = data.passkey(4096, 32, heads=1, n_planted=3, n_queries=2, seed=4)
    ref = data.passkey(4096, 32, heads=1, n_planted=3, n_queries=2, mass=0.01, margin=0.0, seed=4)
    # same background draw; only the component along each query differs at the planted positions
    mask = np.ones(4096, bool)
    mask[w.positions[0].ravel()] = False
    np.testing.assert_array_equal(w.keys[0][mask], ref.keys[0][mask])
    for t in range(2):
        qh = w.queries[0, t].astype(np.float64)
        qh /= np.linalg.norm(qh)
        a = w.keys[0][w.positions[0, t]].astype(np.float64)
        b = ref.keys[0][w.positions[0, t]].astype(np.float64)
        a -= (a @ qh)[:, None] * qh
        b -= (b @ qh)[:, None] * qh
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("depth", [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0), (0.2, 0.3)])
def test_depth_band(depth: tuple[float, float]) -> None:
    n = 10000
    w = data.passkey(n, 16, heads=2, n_planted=4, n_queries=3, depth=depth, seed=5)
    need = 12
    lo = min(int(depth[0] * n), n - need)
    hi = max(int(np.ceil(depth[1] * n)), lo + need)
    assert w.positions.min() >= lo and w.positions.max() < hi
    if depth == (1.0, 1.0):
        assert w.positions.min() == n - need  # the newest keys


def test_reproducible_by_seed() -> None:
    a = data.passkey(2048, 16, heads=2, n_queries=3, seed=7)
    b = data.passkey(2048, 16, heads=2, n_queries=3, seed=7)
    c = data.passkey(2048, 16, heads=2, n_queries=3, seed=8)
    for x, y in ((a.keys, b.keys), (a.values, b.values), (a.queries, b.queries), (a.positions, b.positions)):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.keys, c.keys)
    assert not np.array_equal(a.positions, c.positions)


def test_real_keys_background_with_planted_keys_inserted() -> None:
    k = data.load("store", head=0, dtype="float32").k[:4096]
    w = data.passkey(4096, 32, heads=2, n_planted=8, n_queries=4, background=k, seed=2)
    mask = np.ones(4096, bool)
    mask[w.positions[1].ravel()] = False
    np.testing.assert_array_equal(w.keys[1][mask], k[mask])  # the real keys, untouched off the plants
    p = _oracle(w.keys, w.queries, w.scale)
    assert (np.take_along_axis(p, w.positions, axis=-1).sum(-1) >= 0.5 - 1e-9).all()


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"n": 0}, ValueError, "n must be >= 1"),
    ({"d": 2.5}, TypeError, "d must be an integer"),
    ({"heads": 0}, ValueError, "heads must be >= 1"),
    ({"n_planted": 0}, ValueError, "n_planted must be >= 1"),
    ({"n_queries": True}, TypeError, "n_queries must be an integer"),
    ({"mass": 1.0}, ValueError, "mass must be in \\(0, 1\\)"),
    ({"mass": "half"}, TypeError, "mass must be a finite real"),
    ({"margin": -1.0}, ValueError, "margin must be in >= 0"),
    ({"scale": 0.0}, ValueError, "scale must be > 0"),
    ({"depth": 0.5}, TypeError, "depth must be a pair"),
    ({"depth": (0.6, 0.4)}, ValueError, "depth must be \\(low, high\\) with low <= high"),
    ({"depth": (0.0, 1.5)}, ValueError, "depth\\[1\\] must be in"),
    ({"n_planted": 16, "n_queries": 100}, ValueError, "do not fit in the depth band"),
    ({"background": "uniform"}, ValueError, "background must be one of"),
    ({"background": [[1.0]]}, TypeError, "background must be one of"),
    ({"background": np.ones((10, 16), np.float32)}, ValueError, "background keys must have shape"),
    ({"background": np.ones((1000, 16), np.int32)}, TypeError, "background keys must be a float array"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
])
def test_bad_arguments_are_named(kwargs: dict, exc: type, match: str) -> None:
    args = {"n": 1000, "d": 16, "heads": 1, "n_queries": 2, **kwargs}
    with pytest.raises(exc, match=match):
        data.passkey(**args)


def test_nan_background_rejected() -> None:
    k = np.ones((1000, 16), np.float32)
    k[3, 2] = np.nan
    with pytest.raises(ValueError, match="background keys contain NaN"):
        data.passkey(1000, 16, heads=1, n_queries=2, background=k)
