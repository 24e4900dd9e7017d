"""The bit and filter intrinsics of ``sparseattn.kernels.intrinsics`` against numpy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from sparseattn.kernels.intrinsics import append_above16, popcount64, trailing_zeros64


@njit(cache=False)
def _per_word(x):
    """(popcount64, trailing_zeros64) of every uint64 (the lowest set bit's index; -1 for 0, not asked)."""
    pop = np.empty(x.shape[0], np.int64)
    low = np.full(x.shape[0], -1, np.int64)
    for i in range(x.shape[0]):
        pop[i] = popcount64(x[i])
        if x[i] != 0:
            low[i] = trailing_zeros64(x[i])
    return pop, low


@njit(cache=False)
def _filter(src, theta, base):
    """append_above16 over every full group of 16, scalar for the rest (the scan's filter)."""
    n = src.shape[0]
    dst = np.full(n + 16, np.nan)
    ids = np.full(n + 16, -7, np.int64)
    m = 0
    i = 0
    while i + 16 <= n:
        m = append_above16(src, i, theta, dst, ids, m, base)
        i += 16
    for r in range(i, n):
        if src[r] > theta:
            dst[m] = src[r]
            ids[m] = base + r
            m += 1
    return dst, ids, m


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40))
def test_popcount(values: list[int]) -> None:
    assert _per_word(np.array(values, np.uint64))[0].tolist() == [bin(v).count("1") for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=40))
def test_trailing_zeros(values: list[int]) -> None:
    assert _per_word(np.array(values, np.uint64))[1].tolist() == [(v & -v).bit_length() - 1 for v in values]


finite = st.floats(-1e300, 1e300, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(finite, st.just(-np.inf), st.just(np.inf), st.just(0.0), st.just(np.nan)), max_size=70),
       st.one_of(finite, st.just(-np.inf)), st.integers(0, 2**40))
def test_append_above16_keeps_the_values_above_theta_in_order(values: list[float], theta: float,
                                                               base: int) -> None:
    src = np.array(values, np.float64)
    dst, ids, m = _filter(src, theta, base)
    with np.errstate(invalid="ignore"):
        keep = np.flatnonzero(src > theta)  # NaN is never above
    assert m == keep.size
    np.testing.assert_array_equal(ids[:m], base + keep)
    np.testing.assert_array_equal(dst[:m], src[keep])
    assert np.isnan(dst[m:]).all() and (ids[m:] == -7).all()  # nothing written past the kept ones
