"""The Numba kernels directly: unfused steps (sparse_scores, csr_softmax, csr_matmul) vs the fused kernel,
a float64 dense oracle and hand-worked numbers; -inf handling under the kernels' fastmath flags."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import SparsePattern
from sparseattn.kernels import fused, pattern_ops, steps
from sparseattn.kernels.bias import BIAS_DENSE, no_bias_args

TOL = {np.float64: 1e-12, np.float32: 1e-5}


@pytest.fixture(autouse=True)
def _serial():
    with sa.threads(1):
        yield


def oracle(q, k, v, mask, scale):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s = np.where(mask, q @ k.T * scale, -np.inf)
    out = np.zeros((q.shape[0], v.shape[1]))
    lse = np.full(q.shape[0], -np.inf)
    for i in range(q.shape[0]):
        if mask[i].any():
            m = s[i].max()
            w = np.exp(s[i] - m)
            out[i] = w @ v / w.sum()
            lse[i] = m + np.log(w.sum())
    return out, lse


def run_fused(q, k, v, p, scale, kernel=fused.fused_serial, bias=None):
    """Call the fused kernel on one group (G = 1) with a shared pattern."""
    q3, k3, v3 = q[None], k[None], v[None]
    out = np.empty((1,) + q.shape[:1] + v.shape[1:], q.dtype)
    lse = np.empty((1, q.shape[0]), q.dtype)
    max_nnz = int(p.nnz_per_row.max()) if p.n_queries else 0
    if bias is None:
        bargs = no_bias_args(1)
    else:
        bargs = (BIAS_DENSE, np.zeros((1, 1)), np.zeros(3, np.int64), np.arange(q.shape[0]),
                 np.arange(k.shape[0]), np.ascontiguousarray(bias[None], q.dtype), np.zeros(1, np.int64))
    kernel(q3, k3, v3, np.zeros(1, np.int64), np.zeros(1, np.int64), p.indptr, p.indices, True,
           q.dtype.type(scale), max_nnz, 4, *bargs, 1, out, lse, q.dtype == np.float32)
    return out[0], lse[0]


def run_steps(q, k, v, p, scale):
    scores = steps.sparse_scores(q, k, p.indptr, p.indices, q.dtype.type(scale))
    probs, lse = steps.csr_softmax(p.indptr, scores)
    return steps.csr_matmul(p.indptr, p.indices, probs, v), lse, scores, probs


@settings(max_examples=40)
@given(L=st.integers(1, 10), S=st.integers(1, 12), E=st.integers(1, 6), Ev=st.integers(1, 5),
       density=st.floats(0, 1), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**31 - 1))
def test_steps_composed_equal_fused_and_dense(L, S, E, Ev, density, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((L, E), (S, E), (S, Ev)))
    mask = rng.random((L, S)) < density
    p = SparsePattern.from_mask(mask)
    scale = 0.7
    out_s, lse_s, scores, probs = run_steps(q, k, v, p, scale)
    out_f, lse_f = run_fused(q, k, v, p, scale)
    ref, ref_lse = oracle(q, k, v, mask, scale)
    tol = TOL[dtype]
    assert scores.dtype == dtype and probs.dtype == dtype and out_s.dtype == dtype
    # scores are exactly the selected entries of the dense score matrix (up to rounding)
    rows = np.repeat(np.arange(L), p.nnz_per_row)
    np.testing.assert_allclose(scores, (q.astype(np.float64) @ k.astype(np.float64).T * scale)[rows, p.indices],
                               rtol=tol, atol=tol)
    for got, got_lse in ((out_s, lse_s), (out_f, lse_f)):
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(got_lse[fin], ref_lse[fin], rtol=tol, atol=tol)
    np.testing.assert_allclose(out_s, out_f, rtol=tol, atol=tol)
    # probabilities: each non-empty row sums to 1; empty rows stay all-zero
    sums = np.array([probs[a:b].sum(dtype=np.float64) for a, b in zip(p.indptr[:-1], p.indptr[1:], strict=True)])
    nonempty = p.nnz_per_row > 0
    np.testing.assert_allclose(sums[nonempty], 1.0, rtol=tol * 10, atol=tol * 10)
    assert np.all(probs >= 0)


def test_hand_worked_softmax():
    # row 0: scores [0, ln 3] -> probs [1/4, 3/4], lse = ln 4; row 1 empty; row 2: one score 5 -> [1], lse 5
    indptr = np.array([0, 2, 2, 3], dtype=np.int64)
    scores = np.array([0.0, np.log(3.0), 5.0])
    probs, lse = steps.csr_softmax(indptr, scores)
    np.testing.assert_allclose(probs, [0.25, 0.75, 1.0], rtol=1e-15)
    np.testing.assert_allclose(lse[[0, 2]], [np.log(4.0), 5.0], rtol=1e-15)
    assert np.isneginf(lse[1])
    out = steps.csr_matmul(indptr, np.array([0, 1, 1], dtype=np.int32), probs, np.array([[4.0], [8.0]]))
    np.testing.assert_allclose(out[:, 0], [7.0, 0.0, 8.0], rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_neg_inf_handling(dtype):
    indptr = np.array([0, 3, 5, 5, 7], dtype=np.int64)
    scores = np.array([-np.inf, 1.0, 1.0,   -np.inf, -np.inf,   -np.inf, 2.0], dtype=dtype)
    probs, lse = steps.csr_softmax(indptr, scores)
    assert not np.isnan(probs).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(probs, [0, 0.5, 0.5, 0, 0, 0, 1], rtol=1e-6)
    np.testing.assert_allclose(lse[[0, 3]], [1 + np.log(2.0), 2.0], rtol=1e-6)
    assert np.isneginf(lse[1]) and np.isneginf(lse[2])      # all -inf, and empty


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_large_scores_stable(dtype):
    indptr = np.array([0, 3], dtype=np.int64)
    scores = np.array([1e4, 1e4 - np.log(2.0), -1e4], dtype=dtype)
    probs, lse = steps.csr_softmax(indptr, scores)
    assert np.isfinite(probs).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3, 0], rtol=1e-3 if dtype == np.float32 else 1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_kernel_neg_inf_bias(rng, dtype):
    # a dense bias with -inf entries, given to the kernel directly: -inf scores get zero weight,
    # an all -inf row gives zeros and lse = -inf (fastmath flags must not assume "no inf")
    L, S = 5, 6
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((L, 3), (S, 3), (S, 2)))
    bias = np.zeros((L, S), dtype)
    bias[0, :4] = -np.inf
    bias[2, :] = -np.inf
    out, lse = run_fused(q, k, v, SparsePattern.full(L, S), 0.5, bias=bias)
    ref, ref_lse = oracle(q, k, v, ~np.isneginf(bias), 0.5)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
    assert np.isneginf(lse[2]) and np.all(out[2] == 0)
    np.testing.assert_allclose(lse[[0, 1, 3, 4]], ref_lse[[0, 1, 3, 4]], rtol=TOL[dtype], atol=TOL[dtype])


def test_steps_parallel_equal_serial(rng):
    L, S = 300, 200
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((L, 16), (S, 16), (S, 8)))
    p = SparsePattern.from_padded(rng.integers(-1, S, size=(L, 20)), S)
    one = run_steps(q, k, v, p, 0.25)
    with sa.threads(2):
        two = run_steps(q, k, v, p, 0.25)
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("code,indptr,indices", [
    (0, [0, 1, 2], [1, 0]), (1, [1, 1], [0]), (2, [0, 2, 1], [0, 1]), (3, [0, 1], [0, 1]),
    (4, [0, 1], [9]), (5, [0, 2], [1, 1]), (6, [0, 2], [1, 0]),
])
def test_check_csr_codes(code, indptr, indices):
    got = pattern_ops.check_csr(np.array(indptr, np.int64), np.array(indices, np.int32), 3)
    assert int(got[0]) == code
