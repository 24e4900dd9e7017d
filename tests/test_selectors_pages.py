"""The Quest page selector: its bound is a true upper bound, the pages chosen are the brute-force top pages
by that bound, add() equals build() over all keys, causal rows never see future keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import sparseattn.selectors.pages  # noqa: F401  (registers "pages")
from sparseattn.selectors import get_selector
from sparseattn.selectors.pages import PagesSelector, page_min_max

finite = st.floats(-100, 100, allow_nan=False, width=64)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), S=st.integers(1, 70), E=st.integers(1, 6), ps=st.integers(1, 9))
def test_bound_is_an_upper_bound(data, S: int, E: int, ps: int) -> None:
    keys = data.draw(arrays(np.float64, (S, E), elements=finite))
    q = data.draw(arrays(np.float64, (3, E), elements=finite))
    sel = PagesSelector(page_size=ps).build(keys)
    b = sel.bounds(q)
    scores = q @ keys.T
    for j in range(S):
        assert np.all(scores[:, j] <= b[:, j // ps] + 1e-9 * (1 + np.abs(q) @ np.abs(keys[j])))


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 200), ps=st.integers(1, 20), pages=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_top_pages_equal_brute_force(S: int, ps: int, pages: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((S, 8))
    q = rng.standard_normal((5, 8))
    sel = PagesSelector(page_size=ps, pages=pages).build(keys)
    pat = sel.query(q, k=1)
    pmin, pmax = page_min_max(keys, ps)
    bound = np.maximum(q[:, None, :] * pmin[None], q[:, None, :] * pmax[None]).sum(-1)  # (L, n_pages)
    n_pages = pmin.shape[0]
    for i in range(5):
        got = set(pat.row(i).tolist()) if hasattr(pat, "row") else set(
            pat.indices[pat.indptr[i]:pat.indptr[i + 1]].tolist())
        if 1 >= S:  # k >= S: every key
            assert got == set(range(S))
            continue
        best = np.argsort(-bound[i], kind="stable")[:min(pages, n_pages)]
        want = {j for p in best for j in range(p * ps, min((p + 1) * ps, S))}
        assert got == want


def test_add_equals_build() -> None:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((203, 16)).astype(np.float32)
    grown = PagesSelector(page_size=16, pages=4).build(keys[:37])
    for a, b in ((37, 38), (38, 100), (100, 203)):
        grown.add(keys[a:b])
    whole = PagesSelector(page_size=16, pages=4).build(keys)
    np.testing.assert_array_equal(grown.pmin_, whole.pmin_)
    np.testing.assert_array_equal(grown.pmax_, whole.pmax_)
    q = rng.standard_normal((9, 16)).astype(np.float32)
    a, b = grown.query(q, k=64), whole.query(q, k=64)
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)


def test_causal_rows_see_no_future_key_and_default_budget() -> None:
    rng = np.random.default_rng(1)
    S = 300
    keys = rng.standard_normal((S, 8)).astype(np.float32)
    q = rng.standard_normal((S, 8)).astype(np.float32)
    sel = get_selector("pages:page_size=16")
    sel.build(keys)
    pat = sel.query(q, k=32, is_causal=True)
    for i in range(S):
        row = pat.indices[pat.indptr[i]:pat.indptr[i + 1]]
        assert row.size and row.max() <= i
        assert row.size <= max(32, i + 1)  # ceil(32 / 16) = 2 pages, or every allowed key


def test_bad_new_keys() -> None:
    sel = PagesSelector().build(np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="new_keys"):
        sel.add(np.zeros((2, 4), np.float32))
