"""Tests for the structural selectors (window, sinks, random) and the exact top-k selector.

Oracles: SparsePattern.window / band, brute-force position masks in numpy, sparseattn.topk.exact_topk and
a brute-force stable sort for ties, chi-square tests for uniform sampling.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from sparseattn.pattern import SparsePattern
from sparseattn.selectors import get_selector, spec_string
from sparseattn.selectors.exact import TopKSelector, topk_pattern
from sparseattn.selectors.window import RandomSelector, SinksSelector, WindowSelector
from sparseattn.topk import exact_topk


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def _data(rng, L, S, E=8, dtype=np.float32):
    return (rng.standard_normal((L, E)).astype(dtype), rng.standard_normal((S, E)).astype(dtype))


def _window_mask(qpos, kpos, before, after, dilation):
    """Brute force: key j in row i iff kpos[j] - qpos[i] = t*dilation with t in [-before, after]."""
    d = kpos[None, :] - qpos[:, None]
    return (d >= -before * dilation) & (d <= after * dilation) & (d % dilation == 0)


def _causal_mask(qpos, kpos):
    return kpos[None, :] <= qpos[:, None]


def _assert_causal(p, qpos, kpos):
    mask = p.to_mask()
    assert not (mask & ~_causal_mask(qpos, kpos)).any(), "a key after its query was selected"


# ---------------------------------------------------------------------------------------------- window
@pytest.mark.parametrize("width", [1, 2, 5, 8, 64])
@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_equals_pattern_window(rng, width, dilation, is_causal):
    q, k = _data(rng, 40, 40)
    sel = WindowSelector(width=width, dilation=dilation).build(k)
    got = sel.query(q, 7, is_causal=is_causal)
    assert got == SparsePattern.window(40, 40, width, is_causal=is_causal, dilation=dilation)


def test_window_width_none_uses_k(rng):
    q, k = _data(rng, 30, 30)
    sel = WindowSelector().build(k)
    assert sel.query(q, 6, is_causal=True) == SparsePattern.window(30, 30, 6, is_causal=True)
    assert sel.query(q, 5) == SparsePattern.window(30, 30, 5)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["decode", "offset_keys", "scattered_queries", "gaps", "unsorted_repeats"])
def test_window_custom_positions_brute_force(rng, is_causal, layout):
    L, S = 25, 60
    if layout == "decode":  # L new queries after a cache: bottom-right alignment
        qpos, kpos = np.arange(S - L, S), np.arange(S)
    elif layout == "offset_keys":  # consecutive keys not starting at 0, queries scattered
        qpos, kpos = rng.integers(90, 170, L), 100 + np.arange(S)
    elif layout == "scattered_queries":
        qpos, kpos = rng.integers(-10, 70, L), np.arange(S)
    elif layout == "gaps":
        kpos = np.sort(rng.choice(200, S, replace=False))
        qpos = rng.integers(0, 200, L)
    else:
        kpos = rng.integers(0, 30, S)  # any order, repeated positions
        qpos = rng.integers(0, 30, L)
    q, k = _data(rng, L, S)
    for width, dil in [(1, 1), (4, 1), (7, 2), (10, 3)]:
        sel = WindowSelector(width=width, dilation=dil).build(k)
        got = sel.query(q, 3, is_causal=is_causal, query_positions=qpos, key_positions=kpos)
        before, after = (width - 1, 0) if is_causal else (width // 2, width - 1 - width // 2)
        want = _window_mask(qpos, kpos, before, after, dil)
        if is_causal:
            want &= _causal_mask(qpos, kpos)
        np.testing.assert_array_equal(got.to_mask(), want, err_msg=f"{layout} width={width} dilation={dil}")
        got.validate()


def test_window_decode_rows_match_full_pass(rng):
    S, L = 50, 6
    q, k = _data(rng, S, S)
    sel = WindowSelector(width=9).build(k)
    full = sel.query(q, 1, is_causal=True)
    step = sel.query(q[S - L:], 1, is_causal=True, query_positions=np.arange(S - L, S))
    assert step == full.select_rows(np.arange(S - L, S))


def test_window_huge_width_is_clipped(rng):
    q, k = _data(rng, 10, 12)
    sel = WindowSelector(width=2**40).build(k)
    assert sel.query(q, is_causal=True) == SparsePattern.from_mask(np.tril(np.ones((10, 12), bool)))
    p = sel.query(q, key_positions=np.arange(12) * 5, query_positions=np.arange(10) * 5)  # general path
    assert p == SparsePattern.from_mask(np.ones((10, 12), bool))


def test_window_empty_inputs(rng):
    sel = WindowSelector(width=3).build(np.zeros((0, 4), np.float32))
    p = sel.query(np.zeros((5, 4), np.float32))
    assert p.shape == (5, 0) and p.nnz == 0


def test_window_errors():
    with pytest.raises(ValueError, match="window: parameter width must be > 0; got 0"):
        WindowSelector(width=0)
    with pytest.raises(ValueError, match="window: parameter dilation must be > 0; got -1"):
        WindowSelector(dilation=-1)
    with pytest.raises(TypeError, match="window: parameter width must be an integer; got 2.5"):
        WindowSelector(width=2.5)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['causal_only'\] for selector 'window'"):
        WindowSelector(causal_only=True)


def test_window_spec_round_trip():
    sel = get_selector("window:width=16,dilation=2")
    assert isinstance(sel, WindowSelector) and sel.params == {"width": 16, "dilation": 2}
    assert spec_string(get_selector(spec_string(sel))) == spec_string(sel)


# ----------------------------------------------------------------------------------------------- sinks
def test_sinks_default_first_four(rng):
    q, k = _data(rng, 10, 20)
    sel = SinksSelector().build(k)
    want = np.zeros((10, 20), bool)
    want[:, :4] = True
    np.testing.assert_array_equal(sel.query(q).to_mask(), want)
    causal = sel.query(q, is_causal=True)
    np.testing.assert_array_equal(causal.to_mask(), want & _causal_mask(np.arange(10), np.arange(20)))
    assert causal.nnz_per_row.tolist()[:5] == [1, 2, 3, 4, 4]


def test_sinks_g_uses_lowest_positions(rng):
    q, k = _data(rng, 3, 8)
    kpos = np.array([50, 7, 30, 7, 2, 99, 40, 8])  # the 3 lowest: 2 (id 4), 7 (id 1), 7 (id 3)
    p = SinksSelector(g=3).build(k).query(q, key_positions=kpos)
    assert all(p.row(i).tolist() == [1, 3, 4] for i in range(3))
    p = SinksSelector(g=100).build(k).query(q)  # g > S: every key
    assert p == SparsePattern.from_mask(np.ones((3, 8), bool))


@pytest.mark.parametrize("positions", [[9, 0, 5, 5], (0, 5, 9), "0;5;9", "9; 5;0", np.array([5, 0, 9])])
def test_sinks_positions_forms(rng, positions):
    q, k = _data(rng, 4, 12)
    sel = SinksSelector(positions=positions)
    assert sel.params == {"g": None, "positions": "0;5;9"}
    p = sel.build(k).query(q)
    assert all(p.row(i).tolist() == [0, 5, 9] for i in range(4))


def test_sinks_positions_are_key_positions(rng):
    q, k = _data(rng, 3, 6)
    kpos = np.array([10, 20, 30, 40, 20, 60])
    sel = SinksSelector(positions=[20, 60, 1000]).build(k)
    p = sel.query(q, key_positions=kpos, query_positions=np.array([15, 25, 100]), is_causal=True)
    assert [p.row(i).tolist() for i in range(3)] == [[], [1, 4], [1, 4, 5]]


def test_sinks_spec_round_trip():
    sel = get_selector("sinks:positions=0;5;9")
    assert sel.params["positions"] == "0;5;9" and spec_string(sel) == "sinks:positions=0;5;9"
    assert spec_string(get_selector(spec_string(sel))) == "sinks:positions=0;5;9"
    assert spec_string(get_selector("sinks:g=2")) == "sinks:g=2"
    assert spec_string(get_selector("sinks:positions=7")) == "sinks:positions=7"


def test_sinks_errors():
    with pytest.raises(ValueError, match="sinks: parameter g must be > 0; got 0"):
        SinksSelector(g=0)
    with pytest.raises(ValueError, match="sinks: give either g or positions, not both"):
        SinksSelector(g=2, positions=[0])
    with pytest.raises(ValueError, match="sinks: give either g or positions, not both"):
        get_selector("sinks:g=2,positions=0;1")
    with pytest.raises(ValueError, match="positions must be integers separated by ';'"):
        SinksSelector(positions="0;a")
    with pytest.raises(ValueError, match="positions must list at least one position"):
        SinksSelector(positions=[])
    with pytest.raises(TypeError, match="positions must hold integers; got 1.5"):
        SinksSelector(positions=[0, 1.5])
    with pytest.raises(TypeError, match="positions must be an int, a list/tuple of ints"):
        SinksSelector(positions=2.0)


# ---------------------------------------------------------------------------------------------- random
@pytest.mark.parametrize("is_causal", [False, True])
def test_random_row_sizes_unique_causal(rng, is_causal):
    L, S, n = 200, 150, 16
    q, k = _data(rng, L, S)
    p = RandomSelector(n_random=n, seed=3).build(k).query(q, is_causal=is_causal)
    p.validate()  # sorted, unique, in range
    allowed = np.arange(L) + 1 if is_causal else np.full(L, S)
    np.testing.assert_array_equal(p.nnz_per_row, np.minimum(n, np.minimum(allowed, S)))
    if is_causal:
        _assert_causal(p, np.arange(L), np.arange(S))


def test_random_causal_custom_positions_never_empties_rows(rng):
    S, L = 80, 40
    kpos = rng.permutation(np.arange(0, 3 * S, 3))  # unsorted, with gaps
    qpos = rng.integers(-5, 3 * S, L)
    q, k = _data(rng, L, S)
    p = RandomSelector(n_random=7).build(k).query(q, is_causal=True, query_positions=qpos, key_positions=kpos)
    p.validate()
    _assert_causal(p, qpos, kpos)
    allowed = (kpos[None, :] <= qpos[:, None]).sum(axis=1)
    np.testing.assert_array_equal(p.nnz_per_row, np.minimum(7, allowed))


def test_random_reproducible_and_seeded(rng):
    q, k = _data(rng, 64, 500)
    a = RandomSelector(n_random=8, seed=11).build(k).query(q)
    b = RandomSelector(n_random=8, seed=11).build(k).query(q)
    c = RandomSelector(n_random=8, seed=12).build(k).query(q)
    d = RandomSelector(n_random=8, seed=-12).build(k).query(q)
    assert a == b
    assert a != c and c != d
    assert (a.to_mask() & c.to_mask()).sum() / a.nnz < 0.1  # independent draws overlap 8/500 = 0.016
    # Batch invariance: a query's sample depends on its position, not its row or batch.
    sub = RandomSelector(n_random=8, seed=11).build(k).query(q[[40, 3]], query_positions=np.array([40, 3]))
    assert sub == a.select_rows([40, 3])


def test_random_n_none_uses_k(rng):
    q, k = _data(rng, 10, 100)
    p = RandomSelector().build(k).query(q, 13)
    assert p.nnz_per_row.tolist() == [13] * 10


def test_random_marginals_uniform_over_allowed_keys(rng):
    # 20 keys, 10 of them (shuffled ids) at positions <= every query's position: samples must stay in those
    # 10 and hit each equally often.  20000 queries * 3 draws = 6000 expected hits per key.
    S, L, n = 20, 20000, 3
    kpos = np.concatenate([np.arange(10), 10**6 + np.arange(10)])
    perm = rng.permutation(S)
    kpos = kpos[perm]
    allowed_ids = np.nonzero(kpos < 10)[0]
    q = np.zeros((L, 4), np.float32)
    k = np.zeros((S, 4), np.float32)
    p = RandomSelector(n_random=n, seed=5).build(k).query(q, is_causal=True, key_positions=kpos,
                                                           query_positions=100 + np.arange(L))
    counts = np.bincount(p.indices, minlength=S)
    assert counts.sum() == L * n and counts[np.setdiff1d(np.arange(S), allowed_ids)].sum() == 0
    chi2 = stats.chisquare(counts[allowed_ids])
    assert chi2.pvalue > 1e-4, chi2  # observed p = 0.22; a biased sampler gives p ~ 0


def test_random_subsets_uniform(rng):
    # S = 5, n = 2: the 10 possible pairs must be equally likely (Floyd's algorithm draws subsets uniformly).
    L = 30000
    q = np.zeros((L, 2), np.float32)
    p = RandomSelector(n_random=2, seed=9).build(np.zeros((5, 2), np.float32)).query(q)
    pairs = p.indices.reshape(L, 2)
    code = pairs[:, 0] * 5 + pairs[:, 1]
    counts = np.bincount(code, minlength=25)[[a * 5 + b for a in range(5) for b in range(a + 1, 5)]]
    assert counts.sum() == L
    assert stats.chisquare(counts).pvalue > 1e-4  # observed p = 0.37


def test_random_errors():
    with pytest.raises(ValueError, match="random: parameter n_random must be > 0; got 0"):
        RandomSelector(n_random=0)
    with pytest.raises(TypeError, match="random: parameter seed must be an integer; got 'abc'"):
        RandomSelector(seed="abc")


# ------------------------------------------------------------------------------------------------ topk
def _exact_pattern(q, k, kk, **kw):
    return SparsePattern.from_padded(exact_topk(q, k, kk, **kw)[1], k.shape[0])


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kk", [1, 7, 64, 500])
def test_topk_equals_exact_topk(rng, is_causal, kk):
    q, k = _data(rng, 150, 300, E=16)
    sel = TopKSelector(block=37).build(k)
    assert sel.query(q, kk, is_causal=is_causal) == _exact_pattern(q, k, kk, is_causal=is_causal)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_custom_positions(rng, dtype):
    L, S = 40, 200
    q, k = _data(rng, L, S, dtype=dtype)
    sel = TopKSelector().build(k)
    for qpos, kpos in [(np.arange(S - L, S), np.arange(S)),
                       (rng.integers(0, 400, L), rng.permutation(2 * np.arange(S)))]:
        got = sel.query(q, 10, is_causal=True, query_positions=qpos, key_positions=kpos)
        assert got == _exact_pattern(q, k, 10, is_causal=True, query_positions=qpos, key_positions=kpos)
        _assert_causal(got, qpos, kpos)


def test_topk_ties_broken_by_lower_id(rng):
    # Keys repeat in groups, so scores tie exactly; the oracle is a stable sort by (-score, id).
    L, base = 30, rng.standard_normal((6, 4)).astype(np.float32)
    k = np.repeat(base, 5, axis=0)[rng.permutation(30)]
    q = rng.standard_normal((L, 4)).astype(np.float32)
    for kk in [1, 3, 5, 8, 12]:
        p = TopKSelector().build(k).query(q, kk)
        s = q @ k.T
        for i in range(L):
            want = np.sort(np.argsort(-s[i], kind="stable")[:kk])
            np.testing.assert_array_equal(p.row(i), want)


def test_topk_pattern_function_handles_empty_and_needs_positions(rng):
    q, k = _data(rng, 3, 0)
    assert topk_pattern(q, k, 4).shape == (3, 0)
    q, k = _data(rng, 3, 5)
    with pytest.raises(ValueError, match="is_causal=True needs query_positions and key_positions"):
        topk_pattern(q, k, 2, is_causal=True)


def test_topk_errors(rng):
    with pytest.raises(ValueError, match="topk: parameter block must be > 0; got 0"):
        TopKSelector(block=0)
    q, k = _data(rng, 3, 5)
    with pytest.raises(ValueError, match="k must be >= 1; got 0"):
        TopKSelector().build(k).query(q, 0)


# ------------------------------------------------------------------------------------------ properties
_SPECS = ["window:width=3", "window:width=4,dilation=2", "sinks:g=2", "sinks:positions=1;4",
          "random:n_random=3,seed=1", "topk", "window:width=2+sinks+random:n_random=2"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(L=st.integers(0, 12), S=st.integers(0, 15), kk=st.integers(1, 6), is_causal=st.booleans(),
       spec=st.sampled_from(_SPECS), seed=st.integers(0, 2**32 - 1), positions=st.sampled_from(
           ["default", "decode", "random"]))
def test_property_patterns_valid_and_causal(L, S, kk, is_causal, spec, seed, positions):
    r = np.random.default_rng(seed)
    q = r.standard_normal((L, 3)).astype(np.float32)
    k = r.standard_normal((S, 3)).astype(np.float32)
    if positions == "default":
        qpos, kpos = np.arange(L), np.arange(S)
    elif positions == "decode":
        qpos, kpos = np.arange(S - L, S), np.arange(S)
    else:
        qpos, kpos = r.integers(-3, 20, L), r.integers(0, 20, S)
    p = get_selector(spec).build(k).query(q, kk, is_causal=is_causal, query_positions=qpos,
                                          key_positions=kpos)
    assert p.shape == (L, S)
    p.validate()  # indices in range, sorted, unique per row
    if is_causal:
        _assert_causal(p, qpos, kpos)
    if spec == "topk":
        allowed = _causal_mask(qpos, kpos).sum(axis=1) if is_causal else np.full(L, S)
        np.testing.assert_array_equal(p.nnz_per_row, np.minimum(kk, allowed))
