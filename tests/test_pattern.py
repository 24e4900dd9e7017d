"""SparsePattern constructors, conversions, algebra and invariants against brute-force dense masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import SparsePattern
from sparseattn.pattern import stack_patterns


@pytest.fixture(autouse=True)
def _serial():
    # CI runs with one thread (DESIGN.md); on a loaded 2-core box each 2-thread OpenMP launch of a tiny
    # pattern kernel was measured at ~80 ms vs ~30 us serial.  test_thread_count_invariance covers 2 threads.
    with sa.threads(1):
        yield


def rows_of(p: SparsePattern) -> list[list[int]]:
    return [p.row(i).tolist() for i in range(p.n_queries)]


def assert_canonical(p: SparsePattern) -> None:
    assert p.indptr.dtype == np.int64 and p.indices.dtype == np.int32
    assert p.indptr.flags.c_contiguous and p.indices.flags.c_contiguous
    p.validate()
    for r in rows_of(p):
        assert r == sorted(set(r))


def band_mask(L, S, before, after, dilation=1, offset=0):
    """Brute force: M[i, j] iff j == i + offset + t * dilation for some t in [-before, after]."""
    m = np.zeros((L, S), dtype=bool)
    for i in range(L):
        for t in range(-before, after + 1):
            j = i + offset + t * dilation
            if 0 <= j < S:
                m[i, j] = True
    return m


# ------------------------------------------------------------------------------------ from_padded
def test_from_padded_hand_example():
    p = SparsePattern.from_padded(np.array([[2, -1, 0], [1, 1, -1], [-1, -1, -1]]), n_keys=3)
    assert p.indptr.tolist() == [0, 2, 3, 3]
    assert p.indices.tolist() == [0, 2, 1]
    assert p.shape == (3, 3) and p.nnz == 3
    assert_canonical(p)


@settings(max_examples=50)
@given(L=st.integers(0, 8), k=st.integers(0, 7), S=st.integers(1, 12), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([np.int64, np.int32, np.int16, np.uint8]))
def test_from_padded_drops_sentinels_dedups_sorts(L, k, S, seed, dtype):
    rng = np.random.default_rng(seed)
    lo = 0 if np.dtype(dtype).kind == "u" else -1
    ids = rng.integers(lo, S, size=(L, k)).astype(dtype)
    p = SparsePattern.from_padded(ids, S)
    assert_canonical(p)
    assert rows_of(p) == [sorted({int(x) for x in row if x >= 0}) for row in ids]
    # round trip through to_padded (the canonical form is a fixed point)
    assert SparsePattern.from_padded(p.to_padded(), S) == p




@pytest.mark.parametrize("bad", [-2,
                                 -3, -100, 5, 17])
def test_from_padded_out_of_range_ids_raise_with_value(bad):
    ids = np.array([[0, 1, -1], [2, bad, 3]])
    with pytest.raises(ValueError, match=rf"ids\[1\] contains {bad}: ids must be -1 \(no key\) or in \[0, n_keys=5\)"):
        SparsePattern.from_padded(ids, n_keys=5)


def test_from_padded_type_and_shape_errors():
    with pytest.raises(TypeError, match=r"ids must be an integer array; got dtype float64"):
        SparsePattern.from_padded(np.zeros((2, 2)), 3)
    with pytest.raises(ValueError, match=r"ids must be 2-D \(n_queries, k\); got shape \(3,\)"):
        SparsePattern.from_padded(np.zeros(3, dtype=int), 3)
    with pytest.raises(ValueError, match=r"n_keys must be >= 0; got -1"):
        SparsePattern.from_padded(np.zeros((1, 1), dtype=int), -1)


# -------------------------------------------------------------------------------- from_mask / to_mask
@settings(max_examples=50)
@given(L=st.integers(0, 9), S=st.integers(0, 9), density=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_from_mask_round_trip(L, S, density, seed):
    mask = np.random.default_rng(seed).random((L, S)) < density
    p = SparsePattern.from_mask(mask)
    assert_canonical(p)
    assert p.shape == (L, S) and p.nnz == int(mask.sum())
    assert np.array_equal(p.to_mask(), mask)
    assert rows_of(p) == [np.flatnonzero(r).tolist() for r in mask]
    assert np.array_equal(p.nnz_per_row, mask.sum(axis=1))


def test_from_mask_errors():
    with pytest.raises(TypeError, match=r"mask must be a boolean array \(True = may attend\); got dtype int64"):
        SparsePattern.from_mask(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"mask must be 2-D \(L, S\); got shape \(1, 2, 2\)"):
        SparsePattern.from_mask(np.ones((1, 2, 2), dtype=bool))


def test_from_rows():
    p = SparsePattern.from_rows([[3, 1, 1], [], [0]], n_keys=4)
    assert rows_of(p) == [[1, 3], [], [0]]
    assert_canonical(p)
    with pytest.raises(ValueError, match=r"rows contain key ids outside \[0, n_keys=4\)"):
        SparsePattern.from_rows([[4]], n_keys=4)
    # float ids are refused, not truncated (2.7 would silently become key 2)
    with pytest.raises(TypeError, match=r"rows\[1\] must hold integer ids; got dtype float64"):
        SparsePattern.from_rows([[1], [2.7]], n_keys=4)
    with pytest.raises(TypeError, match=r"rows\[0\] must hold integer ids; got dtype bool"):
        SparsePattern.from_rows([[True]], n_keys=4)
    with pytest.raises(ValueError, match="n_keys"):
        SparsePattern.from_rows([[0]], n_keys=-1)


# ----------------------------------------------------------------------------------- band / window
@settings(max_examples=60)
@given(L=st.integers(0, 12), S=st.integers(0, 12), before=st.integers(0, 6), after=st.integers(0, 6),
       dilation=st.integers(1, 4), offset=st.integers(-6, 6))
def test_band_matches_brute_force(L, S, before, after, dilation, offset):
    p = SparsePattern.band(L, S, before=before, after=after, dilation=dilation, offset=offset)
    assert_canonical(p)
    assert np.array_equal(p.to_mask(), band_mask(L, S, before, after, dilation, offset))


@settings(max_examples=50)
@given(L=st.integers(0, 12), S=st.integers(0, 12), width=st.integers(1, 7), dilation=st.integers(1, 3),
       is_causal=st.booleans())
def test_window_matches_brute_force(L, S, width, dilation, is_causal):
    p = SparsePattern.window(L, S, width, is_causal=is_causal, dilation=dilation)
    assert_canonical(p)
    expected = np.zeros((L, S), dtype=bool)
    for i in range(L):
        if is_causal:
            ts = range(-(width - 1), 1)                         # the width keys ending at i
        else:
            ts = range(-(width // 2), width - width // 2)       # width keys centred on i
        assert len(ts) == width
        for t in ts:
            if 0 <= i + t * dilation < S:
                expected[i, i + t * dilation] = True
    assert np.array_equal(p.to_mask(), expected)
    if is_causal:
        assert not np.any(p.to_mask() & ~np.tril(np.ones((L, S), dtype=bool)))


def test_window_hand_examples():
    assert rows_of(SparsePattern.window(4, 4, 2, is_causal=True)) == [[0], [0, 1], [1, 2], [2, 3]]
    assert rows_of(SparsePattern.window(4, 4, 3)) == [[0, 1], [0, 1, 2], [1, 2, 3], [2, 3]]
    assert rows_of(SparsePattern.window(4, 4, 4)) == [[0, 1], [0, 1, 2], [0, 1, 2, 3], [1, 2, 3]]
    assert rows_of(SparsePattern.window(5, 8, 3, is_causal=True, dilation=2)) == [
        [0], [1], [0, 2], [1, 3], [0, 2, 4]]


def test_band_and_window_argument_errors():
    with pytest.raises(ValueError, match=r"width must be >= 1; got 0"):
        SparsePattern.window(3, 3, 0)
    with pytest.raises(ValueError, match=r"dilation must be >= 1; got 0"):
        SparsePattern.band(3, 3, before=1, dilation=0)
    with pytest.raises(ValueError, match=r"before must be >= 0; got -1"):
        SparsePattern.band(3, 3, before=-1)
    with pytest.raises(TypeError, match=r"offset must be an integer; got 1.5"):
        SparsePattern.band(3, 3, before=1, offset=1.5)
    with pytest.raises(TypeError, match=r"n_queries must be an integer >= 0; got True"):
        SparsePattern.band(True, 3, before=1)


def test_band_huge_reach_is_clipped():
    p = SparsePattern.band(3, 4, before=10**15, after=10**15)
    assert np.array_equal(p.to_mask(), np.ones((3, 4), dtype=bool))


# ------------------------------------------------------------------------------------------- full
@settings(max_examples=40)
@given(L=st.integers(0, 14), S=st.integers(0, 14))
def test_full_matches_ones_and_tril(L, S):
    # includes L > 2 S: row i's band must still reach key 0 (regression: full(5, 2) had empty rows)
    p = SparsePattern.full(L, S)
    assert_canonical(p)
    assert np.array_equal(p.to_mask(), np.ones((L, S), dtype=bool))
    c = SparsePattern.full(L, S, is_causal=True)
    assert_canonical(c)
    assert np.array_equal(c.to_mask(), np.tril(np.ones((L, S), dtype=bool)))


@pytest.mark.parametrize("L,S", [(5, 2), (9, 3), (4, 2), (1, 7)])
def test_full_hand_cases(L, S):
    assert np.array_equal(SparsePattern.full(L, S).to_mask(), np.ones((L, S), dtype=bool))
    assert np.array_equal(SparsePattern.full(L, S, is_causal=True).to_mask(),
                          np.tril(np.ones((L, S), dtype=bool)))


# ------------------------------------------------------------------------------------------ union
@settings(max_examples=50)
@given(L=st.integers(0, 8), S=st.integers(1, 10), n=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_union_is_set_union(L, S, n, seed):
    rng = np.random.default_rng(seed)
    masks = [rng.random((L, S)) < rng.random() for _ in range(n)]
    pats = [SparsePattern.from_mask(m) for m in masks]
    u = pats[0].union(*pats[1:])
    assert_canonical(u)
    assert np.array_equal(u.to_mask(), np.logical_or.reduce(masks))
    assert (pats[0] | pats[-1]) == SparsePattern.from_mask(masks[0] | masks[-1])


def test_union_errors_and_identity():
    a = SparsePattern.full(3, 4)
    assert a.union() == a
    with pytest.raises(ValueError, match=r"union needs patterns of the same shape; got \(3, 4\) and \(3, 5\)"):
        a.union(SparsePattern.full(3, 5))
    with pytest.raises(TypeError, match=r"union expects SparsePattern objects; got ndarray"):
        a.union(np.ones((3, 4), dtype=bool))


# ----------------------------------------------------------------------------------------- causal
@settings(max_examples=50)
@given(L=st.integers(0, 8), S=st.integers(0, 10), seed=st.integers(0, 2**31 - 1), custom=st.booleans())
def test_causal_filter_matches_brute_force(L, S, seed, custom):
    rng = np.random.default_rng(seed)
    mask = rng.random((L, S)) < 0.6
    p = SparsePattern.from_mask(mask)
    if custom:
        qpos = rng.integers(-3, 12, size=L)
        kpos = rng.integers(-3, 12, size=S)
        c = p.causal(qpos, kpos)
    else:
        qpos, kpos = np.arange(L), np.arange(S)
        c = p.causal()
        assert np.array_equal(c.to_mask(), mask & np.tril(np.ones((L, S), dtype=bool)))
    assert_canonical(c)
    assert np.array_equal(c.to_mask(), mask & (kpos[None, :] <= qpos[:, None]))


def test_causal_bottom_right_for_kv_cache():
    # 2 new queries at positions 3, 4 over a cache of 5 keys
    c = SparsePattern.full(2, 5).causal(query_positions=np.arange(3, 5))
    assert rows_of(c) == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_causal_position_errors():
    p = SparsePattern.full(3, 4)
    with pytest.raises(ValueError, match=r"query_positions must have shape \(3,\); got \(4,\)"):
        p.causal(np.arange(4))
    with pytest.raises(TypeError, match=r"key_positions must be an integer array; got dtype float64"):
        p.causal(None, np.arange(4.0))


# ---------------------------------------------------------------------------- select_rows / padded
def test_select_rows():
    p = SparsePattern.from_rows([[0, 2], [], [1, 2, 3], [3]], n_keys=4)
    s = p.select_rows([2, 0, 2, 1])
    assert rows_of(s) == [[1, 2, 3], [0, 2], [1, 2, 3], []]
    assert s.shape == (4, 4)
    assert_canonical(s)
    e = p.select_rows(np.zeros(0, dtype=np.int64))
    assert e.shape == (0, 4) and e.nnz == 0
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
        p.select_rows([4])
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
        p.select_rows([-1])
    with pytest.raises(TypeError, match=r"rows must hold integer ids; got dtype float64"):
        p.select_rows([0.0, 1.5])
    with pytest.raises(ValueError, match=r"rows must be 1-D"):
        p.select_rows([[0, 1]])


def test_to_padded():
    p = SparsePattern.from_rows([[0, 2], [], [1, 2, 3]], n_keys=4)
    assert p.to_padded().tolist() == [[0, 2, -1], [-1, -1, -1], [1, 2, 3]]
    assert p.to_padded().dtype == np.int64
    assert p.to_padded(2).tolist() == [[0, 2], [-1, -1], [1, 2]]           # truncates
    assert p.to_padded(4).tolist() == [[0, 2, -1, -1], [-1, -1, -1, -1], [1, 2, 3, -1]]
    assert p.to_padded(0).shape == (3, 0)
    assert SparsePattern.full(0, 3).to_padded().shape == (0, 0)


# ------------------------------------------------------------------------------------------ stats
def test_stats_hand_example():
    p = SparsePattern.from_rows([[0, 2], [], [1, 2, 3], []], n_keys=5)
    assert p.stats() == {"n_queries": 4, "n_keys": 5, "nnz": 5, "min_per_row": 0, "mean_per_row": 1.25,
                         "max_per_row": 3, "density": 0.25, "empty_rows": 2}
    assert "empty_rows=2" in repr(p) and "nnz=5" in repr(p)
    z = SparsePattern.full(0, 0).stats()
    assert z["density"] == 0.0 and z["nnz"] == 0 and z["empty_rows"] == 0


# ------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("indptr,indices,n_keys,match", [
    ([1, 2], [0, 1], 3, r"indptr\[0\] must be 0; got 1"),
    ([0, 2, 1], [0, 1], 3, r"indptr must be non-decreasing; indptr\[2\] = 1 is smaller than indptr\[1\]"),
    ([0, 1, 3], [0, 1], 3, r"indptr\[-1\] must equal len\(indices\); got indptr\[-1\] = 3"),
    ([0, 1, 2], [0, 3], 3, r"row 1 has key id 3, outside \[0, n_keys\)"),
    ([0, 2], [-1, 0], 3, r"row 0 has key id -1, outside \[0, n_keys\)"),
    ([0, 1, 3], [0, 2, 2], 3, r"row 1 has duplicate key id 2"),
    ([0, 3], [0, 2, 1], 3, r"row 0 is not sorted ascending \(at key id 1\)"),
])
def test_validation_errors(indptr, indices, n_keys, match):
    with pytest.raises(ValueError, match=r"invalid SparsePattern: " + match + r".*from_padded or from_mask"):
        SparsePattern(np.array(indptr), np.array(indices), n_keys)
    # validate=False skips the check; validate() finds the same violation later
    p = SparsePattern(np.array(indptr), np.array(indices), n_keys, validate=False)
    with pytest.raises(ValueError, match=match):
        p.validate()


def test_constructor_type_errors():
    with pytest.raises(TypeError, match=r"indptr must be an integer array; got dtype float64"):
        SparsePattern(np.array([0.0, 1.0]), np.array([0]), 2)
    with pytest.raises(TypeError, match=r"indices must be an integer array; got dtype float64"):
        SparsePattern(np.array([0, 1]), np.array([0.0]), 2)
    with pytest.raises(ValueError, match=r"indices must be 1-D; got shape \(1, 1\)"):
        SparsePattern(np.array([0, 1]), np.array([[0]]), 2)
    with pytest.raises(ValueError, match=r"indptr must have length L \+ 1 >= 1; got an empty array"):
        SparsePattern(np.zeros(0, dtype=np.int64), np.array([], dtype=np.int64), 2)
    with pytest.raises(ValueError, match=r"indices must fit in int32"):
        SparsePattern(np.array([0, 1]), np.array([2**31]), 2**32)


def test_valid_construction_converts_dtypes():
    p = SparsePattern(np.array([0, 1, 1], dtype=np.int32), np.array([4], dtype=np.uint8), 5)
    assert p.indptr.dtype == np.int64 and p.indices.dtype == np.int32
    assert rows_of(p) == [[4], []]


# ------------------------------------------------------------------------------------------ equality
def test_equality():
    a = SparsePattern.from_rows([[0, 1], [2]], n_keys=3)
    assert a == SparsePattern.from_mask(np.array([[1, 1, 0], [0, 0, 1]], dtype=bool))
    assert a != SparsePattern.from_rows([[0, 1], [2]], n_keys=4)        # n_keys differs
    assert a != SparsePattern.from_rows([[0, 1], [1]], n_keys=3)        # indices differ
    assert a != SparsePattern.from_rows([[0], [1, 2]], n_keys=3)        # indptr differs
    assert a != "pattern" and (a == 3) is False
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


def test_stack_patterns():
    a = SparsePattern.from_rows([[0], [1, 2]], n_keys=3)
    b = SparsePattern.from_rows([[], [0, 2]], n_keys=3)
    indptr, indices = stack_patterns([a, b])
    assert indptr.tolist() == [0, 1, 3, 3, 5] and indices.tolist() == [0, 1, 2, 0, 2]
    with pytest.raises(ValueError, match=r"patterns\[1\] has shape \(2, 4\); expected \(2, 3\)"):
        stack_patterns([a, SparsePattern.full(2, 4)])
    with pytest.raises(ValueError, match=r"patterns must not be empty"):
        stack_patterns([])


def test_thread_count_invariance(rng):
    mask_a = rng.random((70, 50)) < 0.3
    mask_b = rng.random((70, 50)) < 0.3
    ids = rng.integers(-1, 50, size=(70, 9))
    qpos = rng.integers(0, 60, size=70)

    def build():
        a = SparsePattern.from_mask(mask_a)
        return (SparsePattern.from_padded(ids, 50), a | SparsePattern.from_mask(mask_b),
                a.causal(qpos), SparsePattern.band(70, 50, before=3, after=2, dilation=2, offset=-4),
                SparsePattern.from_rows([[int(x) for x in r[::-1] if x >= 0] for r in ids], 50))

    one = build()
    with sa.threads(2):
        two = build()
    for x, y in zip(one, two, strict=True):
        assert x == y


def test_pattern_arrays_are_read_only():
    p = SparsePattern.from_rows([[0, 2], [1]], 3)
    for arr in (p.indptr, p.indices):
        assert not arr.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        p.indices[0] = 5
    with pytest.raises(ValueError, match="read-only"):
        p.indptr[0] = 1
    for made in (SparsePattern.full(3, 4), SparsePattern.window(5, 5, 2), SparsePattern.from_mask(np.eye(3, dtype=bool)),
                 SparsePattern.from_padded(np.array([[0, -1]]), 2), p | p, p.causal(), p.select_rows([1, 0])):
        assert not made.indptr.flags.writeable and not made.indices.flags.writeable
    ptr, idx = stack_patterns([p, p])
    assert not ptr.flags.writeable and not idx.flags.writeable


def test_caller_arrays_are_copied_not_frozen():
    indptr = np.array([0, 2, 3], dtype=np.int64)
    indices = np.array([0, 2, 1], dtype=np.int32)
    p = SparsePattern(indptr, indices, 3)
    assert indptr.flags.writeable and indices.flags.writeable  # the caller's arrays stay writable
    indices[0] = 1  # ... and editing them does not change the pattern
    assert p.indices.tolist() == [0, 2, 1]
    q = SparsePattern(p.indptr, p.indices, 3)  # already read-only: shared, no copy
    assert np.shares_memory(q.indices, p.indices)
