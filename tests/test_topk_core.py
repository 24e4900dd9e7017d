"""The shared top-k core (sparseattn.kernels.topk) against a numpy oracle, and every selector using it
under extreme magnitudes (overflowing / NaN-producing products must never crash or yield bad ids).

Policy checked: ties broken by the smaller key id; NaN and -inf never selected; rows with fewer than k
candidates padded with -1 / -inf; ids always a key id or -1.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn.kernels.topk import (
    ORDER_BEST,
    ORDER_ID,
    ORDER_NONE,
    block_topk,
    merge_topk,
    rerank_topk,
    rows_topk,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _serial():
    with sa.threads(1):
        yield


def oracle(scores, ids, k, allowed=None):
    """(scores, ids) of the k best entries of one row: argsort on float64 by (-score, id)."""
    s = np.asarray(scores, np.float64)
    ids = np.asarray(ids, np.int64)
    ok = s > -np.inf  # False for NaN and -inf
    if allowed is not None:
        ok &= allowed
    s, ids = s[ok], ids[ok]
    order = np.lexsort((ids, -s))[:k]
    out_s = np.full(k, -np.inf)
    out_i = np.full(k, -1, dtype=np.int64)
    out_s[:order.size] = s[order]
    out_i[:order.size] = ids[order]
    return out_s, out_i


def _canon(s, i):
    """Entries of an unordered row, sorted by (-score, id) (padding last)."""
    o = np.lexsort((i, -np.asarray(s, np.float64)))
    return np.asarray(s, np.float64)[o], np.asarray(i, np.int64)[o]


@st.composite
def score_rows(draw):
    b = draw(st.integers(0, 5))
    n = draw(st.integers(0, 30))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    levels = draw(st.sampled_from([2, 5, 1000]))  # few levels: many ties
    s = rng.integers(-levels, levels, (b, n)).astype(np.float64)
    special = rng.random((b, n))
    s[special < draw(st.sampled_from([0.0, 0.1, 0.5]))] = np.nan
    s[(special > 0.9) & (special < 0.95)] = -np.inf
    s[special > 0.98] = np.inf
    return s.astype(dtype), rng


@SETTINGS
@given(data=score_rows(), k=st.integers(0, 35), order=st.sampled_from([ORDER_NONE, ORDER_BEST, ORDER_ID]),
       causal=st.booleans(), permute=st.booleans(), id32=st.booleans())
def test_block_topk_matches_oracle(data, k, order, causal, permute, id32):
    s, rng = data
    b, n = s.shape
    key_ids = rng.permutation(n).astype(np.int64) if permute else np.arange(n, dtype=np.int64)
    qpos = rng.integers(-1, n + 1, b).astype(np.int64)
    kpos = rng.integers(0, n + 1, n).astype(np.int64)
    width = k + int(rng.integers(0, 3))  # output rows may be wider than k: padded
    out_s = np.full((b, width), 7.0, dtype=s.dtype)  # garbage the kernel must overwrite
    out_i = np.full((b, width), 12345, dtype=np.int32 if id32 else np.int64)
    counts = block_topk(s, k, causal, qpos, kpos, key_ids, out_s, out_i, order, False)
    for r in range(b):
        allowed = kpos <= qpos[r] if causal else None
        want_s, want_i = oracle(s[r], key_ids, width, allowed)
        m = min(k, int((want_i >= 0).sum()))
        want_s[m:], want_i[m:] = -np.inf, -1
        got_s, got_i = out_s[r].astype(np.float64), out_i[r].astype(np.int64)
        assert counts[r] == m
        assert np.all((got_i == -1) | ((got_i >= 0) & (got_i < max(n, 1))))
        if order == ORDER_NONE:
            got_s, got_i = _canon(got_s, got_i)
        elif order == ORDER_ID:
            assert np.all(np.diff(got_i[:m]) > 0) and np.all(got_i[m:] == -1)
            got_s, got_i = _canon(got_s, got_i)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_s, want_s)


@SETTINGS
@given(data=score_rows(), k=st.integers(1, 12), split=st.integers(0, 30))
def test_block_topk_accumulate_equals_one_pass(data, k, split):
    s, _ = data
    b, n = s.shape
    split = min(split, n)
    ids = np.arange(n, dtype=np.int64)
    z = np.zeros(max(b, n), np.int64)
    one_s = np.empty((b, k), s.dtype)
    one_i = np.empty((b, k), np.int64)
    block_topk(s, k, False, z[:b], z[:n], ids, one_s, one_i, ORDER_BEST, False)
    run_s = np.full((b, k), -np.inf, s.dtype)
    run_i = np.full((b, k), -1, np.int64)
    for a, c in ((0, split), (split, n)):
        block_topk(np.ascontiguousarray(s[:, a:c]), k, False, z[:b], z[:c - a], ids[a:c], run_s, run_i,
                   ORDER_NONE, True)
    for r in range(b):
        np.testing.assert_array_equal(_canon(run_s[r], run_i[r])[1], one_i[r])


@SETTINGS
@given(L=st.integers(0, 6), S=st.integers(0, 25), E=st.integers(0, 4), C=st.integers(0, 40),
       k=st.integers(1, 30), unique=st.booleans(), f64=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rerank_topk_matches_oracle(L, S, E, C, k, unique, f64, seed):
    rng = np.random.default_rng(seed)
    dtype = np.float64 if f64 else np.float32
    q = rng.integers(-3, 4, (L, E)).astype(dtype)  # small integers: exact dot products, many ties
    keys = rng.integers(-3, 4, (S, E)).astype(dtype)
    cand = rng.integers(-2, S + 2, (L, C)).astype(np.int64)  # -1 / out-of-range ids are ignored
    if unique:
        for i in range(L):
            row = cand[i]
            _, first = np.unique(row, return_index=True)
            dup = np.ones(C, bool)
            dup[first] = False
            row[dup] = -1
    scores, ids = rerank_topk(q, keys, cand, k, unique)
    full = q.astype(np.float64) @ keys.astype(np.float64).T
    for i in range(L):
        c = np.unique(cand[i][(cand[i] >= 0) & (cand[i] < S)])
        want_s, want_i = oracle(full[i, c], c, k)
        np.testing.assert_array_equal(ids[i], want_i)
        np.testing.assert_array_equal(scores[i].astype(np.float64), want_s)


@SETTINGS
@given(data=score_rows(), k=st.integers(1, 35))
def test_rows_topk_dropin(data, k):
    s, rng = data
    b, n = s.shape
    key_ids = rng.permutation(n).astype(np.int64)
    out_s = np.empty((b, k), s.dtype)
    out_i = np.empty((b, k), np.int32)
    rows_topk(s, k, key_ids, out_s, out_i)
    for r in range(b):
        want_s, want_i = oracle(s[r], key_ids, k)
        got_s, got_i = _canon(out_s[r], out_i[r])
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_s, want_s)


@SETTINGS
@given(L=st.integers(0, 6), p=st.integers(1, 4), k=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_merge_topk_dropin(L, p, k, seed):
    rng = np.random.default_rng(seed)
    n_pairs = L * p
    perm = rng.permutation(max(n_pairs * k, 1))[:n_pairs * k].reshape(n_pairs, k).astype(np.int32)
    cand_i = np.where(rng.random((n_pairs, k)) < 0.2, -1, perm).astype(np.int32)
    cand_s = rng.integers(-3, 3, (n_pairs, k)).astype(np.float32)
    cand_s[rng.random((n_pairs, k)) < 0.1] = np.nan
    slot = rng.permutation(n_pairs).astype(np.int64)
    indptr, indices = merge_topk(cand_s, cand_i, slot, p, k)
    assert indptr.shape == (L + 1,) and indices.dtype == np.int32
    for i in range(L):
        rows = slot[i * p:(i + 1) * p]
        valid = cand_i[rows].ravel() >= 0
        _, want_i = oracle(np.where(valid, cand_s[rows].ravel(), np.nan), cand_i[rows].ravel(), k)
        want = np.sort(want_i[want_i >= 0])
        np.testing.assert_array_equal(indices[indptr[i]:indptr[i + 1]], want)


@SETTINGS
@given(L=st.integers(0, 8), S=st.integers(0, 30), k=st.integers(1, 40), causal=st.booleans(),
       f64=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_exact_topk_ties_and_overflow(L, S, k, causal, f64, seed):
    rng = np.random.default_rng(seed)
    dtype = np.float64 if f64 else np.float32
    big = 1e300 if f64 else 1e37
    q = (rng.integers(-2, 3, (L, 4)) * big).astype(dtype)  # products overflow: +-inf and NaN scores
    kk = rng.integers(-2, 3, (S, 4)).astype(dtype)
    kk[: S // 2] *= big
    scores, ids = sa.exact_topk(q, kk, k, is_causal=causal)
    with np.errstate(over="ignore", invalid="ignore"):
        full = q @ kk.T  # the same GEMM the function runs, so the same NaN / inf pattern
    for i in range(L):
        allowed = np.arange(S) <= i if causal else None
        want_s, want_i = oracle(full[i], np.arange(S), k, allowed)
        np.testing.assert_array_equal(ids[i], want_i)
        np.testing.assert_array_equal(scores[i].astype(np.float64), want_s)


# --------------------------------------------------------------------- selectors under extreme inputs
SELECTORS = ["topk", "angular-lsh", "angular-lsh:chunk_size=0", "lsh", "lsh:n_candidates=4", "faiss-flat",
             "kdtree"]


def _available(spec):
    name = spec.split(":")[0]
    return sa.selectors.available_selectors().get(name, "missing") is None


@pytest.mark.parametrize("spec", SELECTORS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(L=st.integers(0, 20), S=st.integers(0, 40), E=st.integers(0, 6), k=st.integers(1, 50),
       causal=st.booleans(), f64=st.booleans(), log_mag=st.floats(-40, 38), seed=st.integers(0, 2**32 - 1))
def test_selectors_extreme_magnitudes(spec, L, S, E, k, causal, f64, log_mag, seed):
    if not _available(spec):
        pytest.skip(f"{spec} unavailable")
    dtype = np.float64 if f64 else np.float32
    mag = 10.0 ** (log_mag * (300 / 38) if f64 else log_mag)
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((S, E)) * mag).astype(dtype)
    q = (rng.standard_normal((L, E)) * mag).astype(dtype)
    if not (np.isfinite(keys).all() and np.isfinite(q).all()):
        return
    try:
        pat = sa.get_selector(spec).build(keys).query(q, k, is_causal=causal)
    except ValueError:  # a backend refusing inputs it cannot index (e.g. non-finite lifted norms)
        return
    assert pat.indptr.shape == (L + 1,)
    for i in range(L):
        row = pat.indices[pat.indptr[i]:pat.indptr[i + 1]].astype(np.int64)
        assert np.all((row >= 0) & (row < S))
        assert np.unique(row).size == row.size
        if causal:
            assert np.all(row <= i)
