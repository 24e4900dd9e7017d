"""Finite values near the dtype's limit give the exact, finite answer on every attention path.

Attention's output is a convex combination of the values, so it is finite whenever they are; the
weighted sums before the division (up to S values with weights of at most 1) and the merges of partial
results are where ``inf`` can appear.  Oracle: float64 dense attention (masked as the path selects).
Tolerance: ``|o - o*| <= 2e-6 * max |v|`` per column for float32 (float64: 1e-13).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import dense64

import sparseattn as sa
from sparseattn.attention.routed import routed_attention
from sparseattn.index import ClusterIndex
from sparseattn.pattern import SparsePattern

F32_MAX = float(np.finfo(np.float32).max)


def _values(kind: str, S: int, Ev: int, rng: np.random.Generator, dtype=np.float32) -> np.ndarray:
    top = float(np.finfo(dtype).max)
    if kind == "full2e38":
        return np.full((S, Ev), 2e38, dtype=dtype)
    if kind == "max":
        return np.full((S, Ev), top, dtype=dtype)
    if kind == "signs":  # +-max: heavy cancellation
        return (np.where(rng.random((S, Ev)) < 0.5, 1.0, -1.0) * top).astype(dtype)
    if kind == "uniform":
        return (rng.uniform(-1, 1, (S, Ev)) * top).astype(dtype)
    if kind == "mixed":  # one huge column next to ordinary ones: each column is scaled on its own
        v = rng.standard_normal((S, Ev)).astype(dtype)
        v[:, 0] = (rng.uniform(0.5, 1.0, S) * top).astype(dtype)
        return v
    raise AssertionError(kind)


def _check(out, ref, v, tol=2e-6):
    assert np.all(np.isfinite(out)), "inf / NaN for finite inputs"
    span = np.abs(v.astype(np.float64)).max(axis=0)
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= tol * span + 1e-30), float((err / np.maximum(span, 1e-300)).max())


KINDS = ["full2e38", "max", "signs", "uniform", "mixed"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_dense(kind, is_causal):
    rng = np.random.default_rng(1)
    L, S, E = 40, 300, 8
    q = rng.standard_normal((2, L, E)).astype(np.float32)
    k = rng.standard_normal((2, S, E)).astype(np.float32)
    v = np.stack([_values(kind, S, 5, rng), _values(kind, S, 5, rng)])
    out = sa.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    mask = np.arange(S)[None, :] <= np.arange(L)[:, None] if is_causal else None
    for g in range(2):
        _check(out[g], dense64(q[g], k[g], v[g], E ** -0.5, mask)[0], v[g])
    if kind == "full2e38":
        np.testing.assert_allclose(out, 2e38, rtol=1e-6)


def test_constant_values_near_the_limit_exact_output():
    """Zero queries over keys whose values are all 2e38: the exact answer is 2e38, not inf."""
    q = np.zeros((1, 1, 4), np.float32)
    k = np.zeros((1, 2, 4), np.float32)
    v = np.full((1, 2, 4), 2e38, np.float32)
    np.testing.assert_allclose(sa.scaled_dot_product_attention(q, k, v), 2e38, rtol=1e-7)
    pat = SparsePattern.from_padded(np.array([[0, 1]]), 2)
    np.testing.assert_allclose(sa.sparse_attention(q, k, v, pat), 2e38, rtol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", ["serial", "parallel"])
def test_fused_pattern_kernel(kind, size):
    """An explicit pattern: the fused kernel (serial and parallel variants, with and without a bias)."""
    rng = np.random.default_rng(2)
    L, S, E, nnz = (30, 200, 8, 40) if size == "serial" else (1024, 2048, 8, 160)
    q = rng.standard_normal((L, E)).astype(np.float32)
    k = rng.standard_normal((S, E)).astype(np.float32)
    v = _values(kind, S, 8, rng)
    ids = np.sort(np.stack([rng.choice(S, nnz, replace=False) for _ in range(L)]), axis=1)
    pat = SparsePattern.from_padded(ids, S)
    mask = pat.to_mask()
    ref = dense64(q, k, v, E ** -0.5, mask)[0]
    _check(sa.sparse_attention(q, k, v, pat), ref, v)
    bias = rng.standard_normal((L, S)).astype(np.float32)
    ref_b = dense64(q, k, v, E ** -0.5, None)  # recompute with the bias added to the selected scores
    s = q.astype(np.float64) @ k.astype(np.float64).T * E ** -0.5 + bias
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    ref_b = (w @ v.astype(np.float64)) / w.sum(axis=1, keepdims=True)
    _check(sa.sparse_attention(q, k, v, pat, bias=bias), ref_b, v)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["topk", "window:width=16", "cluster:mode=block,n_clusters=6,n_probe=6"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_selectors_every_key_or_window(kind, spec, is_causal):
    """Selectors that read every allowed key (topk with k = S, block mode with every cluster probed; causal
    block mode goes through the causal index) or a window, against the dense oracle on their key set."""
    rng = np.random.default_rng(3)
    L, S, E = 64, 256, 8
    q = rng.standard_normal((L, E)).astype(np.float32)
    k = rng.standard_normal((S, E)).astype(np.float32)
    v = _values(kind, S, 4, rng)
    qpos = np.arange(L) * 4
    mask = np.ones((L, S), bool)
    if is_causal:
        mask &= np.arange(S)[None, :] <= qpos[:, None]
    if spec.startswith("window"):
        res = sa.sparse_attention_result(q, k, v, spec, k=S, is_causal=is_causal, query_positions=qpos)
        mask = res.patterns[0].to_mask()
        out = res.output
    else:
        out = sa.sparse_attention(q, k, v, spec, k=S, is_causal=is_causal, query_positions=qpos)
    _check(out, dense64(q, k, v, E ** -0.5, mask)[0], v)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extra", [",estimate=-1", ",top_p=0.9,estimate=2"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_block_mode_with_estimate_stays_finite_and_in_range(kind, extra, is_causal):
    """Routed attention with the estimate: not exact, but finite and inside the values' range (up to
    float32 rounding: 1e-6 of the column's largest magnitude)."""
    rng = np.random.default_rng(4)
    L, S, E = 64, 512, 8
    q = rng.standard_normal((L, E)).astype(np.float32)
    k = rng.standard_normal((S, E)).astype(np.float32)
    v = _values(kind, S, 4, rng)
    spec = "cluster:mode=block,n_clusters=8,n_probe=2" + extra
    out = sa.sparse_attention(q, k, v, spec, is_causal=is_causal)
    assert np.all(np.isfinite(out))
    slack = 1e-6 * np.abs(v.astype(np.float64)).max(axis=0)
    assert np.all(out <= v.max(axis=0) + slack) and np.all(out >= v.min(axis=0) - slack)


@pytest.mark.parametrize("kind", KINDS)
def test_routed_attention_direct_and_tail(kind):
    """The public routed_attention (every cluster probed: exact) and a pattern with a sampled tail."""
    rng = np.random.default_rng(5)
    L, S, E = 50, 400, 8
    q = rng.standard_normal((L, E)).astype(np.float32)
    k = rng.standard_normal((S, E)).astype(np.float32)
    v = _values(kind, S, 4, rng)
    index = ClusterIndex(n_clusters=5, n_probe=5).build(k)
    out, _ = routed_attention(index, q, v)
    _check(out, dense64(q, k, v, E ** -0.5)[0], v)
    out_t = sa.sparse_attention(q, k, v, "window:width=8", tail=32)
    assert np.all(np.isfinite(out_t))


def test_float64_near_its_limit():
    rng = np.random.default_rng(6)
    L, S, E = 20, 100, 4
    q = rng.standard_normal((L, E))
    k = rng.standard_normal((S, E))
    v = rng.uniform(-1, 1, (S, 3)) * np.finfo(np.float64).max
    ref = dense64(q, k, v * 2.0 ** -16, E ** -0.5)[0] * 2.0 ** 16  # the oracle itself would overflow
    _check(sa.scaled_dot_product_attention(q, k, v), ref, v, tol=1e-13)
    pat = SparsePattern.from_padded(np.tile(np.arange(S), (L, 1)), S)
    _check(sa.sparse_attention(q, k, v, pat), ref, v, tol=1e-13)


def test_ordinary_values_are_not_copied_or_changed():
    """Far below the limit nothing is scaled: the results are bit-identical to a computation on values
    of the same magnitude, and the value array is read as is."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((16, 8)).astype(np.float32)
    k = rng.standard_normal((64, 8)).astype(np.float32)
    v = (rng.standard_normal((64, 4)) * 1e30).astype(np.float32)
    a = sa.scaled_dot_product_attention(q, k, v)
    b = sa.scaled_dot_product_attention(q, k, v * np.float32(2.0 ** -40)) * np.float32(2.0 ** 40)
    np.testing.assert_array_equal(a, b)  # powers of two: the same arithmetic, exponent aside
