"""exact_topk against brute force (np.argsort over the full float64 score matrix), tie-aware."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import exact_topk

TOL = {np.float64: 1e-12, np.float32: 1e-5}


@pytest.fixture(autouse=True)
def _serial():
    # CI runs with one thread (DESIGN.md); test_thread_count_invariance covers 2 threads.
    with sa.threads(1):
        yield


def check_topk(scores, ids, q, kk, k, allowed=None, tol=1e-12):
    """Tie-aware: returned scores are the k best allowed brute-force scores (sorted descending), each id
    really has its score, ids are unique, padding is -1 / -inf, and every strictly better key is returned."""
    s = np.asarray(q, np.float64) @ np.asarray(kk, np.float64).T
    L, S = s.shape
    if allowed is None:
        allowed = np.ones((L, S), dtype=bool)
    s = np.where(allowed, s, -np.inf)
    assert scores.shape == (L, k) and ids.shape == (L, k) and ids.dtype == np.int64
    for i in range(L):
        n = min(k, int(allowed[i].sum()))
        best = np.sort(s[i][allowed[i]])[::-1][:n]
        np.testing.assert_allclose(scores[i, :n], best, rtol=tol, atol=tol)
        assert np.all(np.diff(scores[i, :n]) <= 0)
        assert np.all(ids[i, n:] == -1) and np.all(np.isneginf(scores[i, n:]))
        got = ids[i, :n]
        assert len(set(got.tolist())) == n and np.all(allowed[i, got])
        np.testing.assert_allclose(s[i, got], scores[i, :n], rtol=tol, atol=tol)
        if 0 < n:
            kth = best[-1]
            must = np.flatnonzero(allowed[i] & (s[i] > kth + tol * (1 + abs(kth))))
            assert set(must.tolist()) <= set(got.tolist())


@settings(max_examples=60)
@given(L=st.integers(1, 10), S=st.integers(1, 15), E=st.integers(1, 6), k=st.integers(1, 18),
       dtype=st.sampled_from([np.float32, np.float64]), block=st.sampled_from([1, 3, 512]),
       ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_matches_brute_force(L, S, E, k, dtype, block, ties, seed):
    rng = np.random.default_rng(seed)
    if ties:   # small integers: many exactly equal scores
        q = rng.integers(-2, 3, (L, E)).astype(dtype)
        kk = rng.integers(-2, 3, (S, E)).astype(dtype)
    else:
        q = rng.standard_normal((L, E)).astype(dtype)
        kk = rng.standard_normal((S, E)).astype(dtype)
    scores, ids = exact_topk(q, kk, k, block=block)
    assert scores.dtype == dtype
    check_topk(scores, ids, q, kk, k, tol=TOL[dtype])


@settings(max_examples=40)
@given(L=st.integers(1, 10), S=st.integers(1, 12), k=st.integers(1, 14), custom=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_causal_matches_brute_force(L, S, k, custom, seed):
    rng = np.random.default_rng(seed)
    q, kk = rng.standard_normal((L, 4)), rng.standard_normal((S, 4))
    if custom:
        qpos, kpos = rng.integers(-2, 12, L), rng.integers(-2, 12, S)
        scores, ids = exact_topk(q, kk, k, is_causal=True, query_positions=qpos, key_positions=kpos, block=2)
    else:
        qpos, kpos = np.arange(L), np.arange(S)
        scores, ids = exact_topk(q, kk, k, is_causal=True, block=2)
    check_topk(scores, ids, q, kk, k, allowed=kpos[None, :] <= qpos[:, None])


def test_hand_example_and_padding():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    kk = np.array([[3.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    scores, ids = exact_topk(q, kk, 2)
    assert ids.tolist() == [[0, 1], [2, 1]] and scores.tolist() == [[3.0, 1.0], [2.0, 1.0]]
    scores, ids = exact_topk(q, kk, 5)             # k > S: padded
    assert ids.tolist() == [[0, 1, 2, -1, -1], [2, 1, 0, -1, -1]]
    assert scores[:, 3:].tolist() == [[-np.inf] * 2] * 2 and scores[0, 2] == 0.0
    scores, ids = exact_topk(q, kk, 3, is_causal=True)   # query 0 sees key 0; query 1 keys 0, 1
    assert ids.tolist() == [[0, -1, -1], [1, 0, -1]]
    assert scores.tolist() == [[3.0, -np.inf, -np.inf], [1.0, 0.0, -np.inf]]


def test_block_invariance(rng):
    q = rng.standard_normal((37, 8)).astype(np.float32)
    kk = rng.standard_normal((50, 8)).astype(np.float32)
    ref_s, ref_i = exact_topk(q, kk, 7)
    for block in (1, 4, 36, 37, 1000):
        for causal in (False, True):
            s, i = exact_topk(q, kk, 7, block=block, is_causal=causal)
            r_s, r_i = exact_topk(q, kk, 7, block=10**6, is_causal=causal)
            np.testing.assert_allclose(s, r_s, rtol=1e-6, atol=1e-6)  # GEMM rounding differs by block: ~2e-7
            # random data has no ties: the ids agree exactly
            assert np.array_equal(i, r_i)


def test_dtype_and_empty_inputs(rng):
    q32, k64 = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((5, 4))
    assert exact_topk(q32, k64, 2)[0].dtype == np.float64
    assert exact_topk(q32, k64.astype(np.float16), 2)[0].dtype == np.float32
    s, i = exact_topk(q32, np.zeros((0, 4), np.float32), 3)
    assert s.shape == (3, 3) and np.all(np.isneginf(s)) and np.all(i == -1)
    s, i = exact_topk(np.zeros((0, 4)), k64, 3)
    assert s.shape == (0, 3) and i.shape == (0, 3)


def test_errors(rng):
    q, kk = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    with pytest.raises(ValueError, match=r"queries must have at least 2 dimensions"):
        exact_topk(q[0], kk, 2)
    with pytest.raises(ValueError, match=r"queries and keys must be 2-D \(n, E\); got \(1, 3, 4\) and \(5, 4\)"):
        exact_topk(q[None], kk, 2)
    with pytest.raises(ValueError, match=r"same feature size E; got 3 and 4"):
        exact_topk(q[:, :3], kk, 2)
    with pytest.raises(ValueError, match=r"k must be >= 1; got 0"):
        exact_topk(q, kk, 0)
    with pytest.raises(TypeError, match=r"k must be an integer >= 1; got True"):
        exact_topk(q, kk, True)
    with pytest.raises(ValueError, match=r"block must be >= 1; got 0"):
        exact_topk(q, kk, 2, block=0)
    with pytest.raises(TypeError, match=r"keys must have dtype float16, float32 or float64; got int64"):
        exact_topk(q, kk.astype(np.int64), 2)
    bad = kk.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"keys contains NaN or Inf \(first at index \(2, 1\)\)"):
        exact_topk(q, bad, 2)
    with pytest.raises(ValueError, match=r"query_positions must have shape \(3,\); got \(2,\)"):
        exact_topk(q, kk, 2, is_causal=True, query_positions=np.arange(2))
    with pytest.raises(TypeError, match=r"key_positions must be an integer array; got dtype float64"):
        exact_topk(q, kk, 2, is_causal=True, key_positions=np.arange(5.0))


def test_ties_keep_lower_ids_sorted_ascending():
    # documented: among keys tied with the k-th score the lower ids are kept; equal scores list ids ascending
    q = np.array([[1.0]])
    kk = np.array([[1.0], [2.0], [1.0], [3.0], [1.0], [2.0]])
    scores, ids = exact_topk(q, kk, 4)
    assert ids.tolist() == [[3, 1, 5, 0]] and scores.tolist() == [[3.0, 2.0, 2.0, 1.0]]
    scores, ids = exact_topk(q, np.ones((5, 1)), 3)
    assert ids.tolist() == [[0, 1, 2]]


def test_thread_count_invariance(rng):
    q = rng.standard_normal((300, 8))
    kk = rng.standard_normal((200, 8))
    one = exact_topk(q, kk, 9, is_causal=True, block=64)
    with sa.threads(2):
        two = exact_topk(q, kk, 9, is_causal=True, block=64)
    assert np.array_equal(one[0], two[0]) and np.array_equal(one[1], two[1])
