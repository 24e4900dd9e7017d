"""merge_attention / merge_pair against an independent float64 dense attention oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.attention.merge import merge_attention, merge_pair

# Tolerances: float64 merges are exact up to a few ulps of the softmax; float32 parts carry ~1e-7
# relative rounding each (observed max error ~3e-7 on these sizes).
TOL = {np.float64: 1e-12, np.float32: 1e-5}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def dense(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Float64 softmax attention over all given keys; no key -> zeros and -inf (the oracle)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], v.shape[1])), np.full(q.shape[0], -np.inf)
    s = q @ k.T * scale
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    tot = w.sum(axis=1, keepdims=True)
    return (w @ v) / tot, (m + np.log(tot))[:, 0]


def random_shards(rng: np.random.Generator, n: int, parts: int) -> list[np.ndarray]:
    """A random partition of range(n) into `parts` disjoint (possibly empty) index sets."""
    label = rng.integers(0, parts, n)
    return [np.nonzero(label == p)[0] for p in range(parts)]


def part_results(q, k, v, shards, scale, dtype):
    outs, lses = [], []
    for idx in shards:
        o, lse = dense(q.astype(dtype), k[idx].astype(dtype), v[idx].astype(dtype), scale)
        outs.append(o.astype(dtype))
        lses.append(lse.astype(dtype))
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("parts", [1, 2, 5, 17])
def test_merge_of_shards_equals_full_attention(rng, dtype, parts):
    L, S, E, Ev = 33, 200, 8, 5
    q = rng.standard_normal((L, E)) * 2
    k = rng.standard_normal((S, E))
    v = rng.standard_normal((S, Ev))
    scale = E ** -0.5
    ref, ref_lse = dense(q, k, v, scale)
    outs, lses = part_results(q, k, v, random_shards(rng, S, parts), scale, dtype)
    out, lse = merge_attention(outs, lses)
    assert out.dtype == dtype and lse.dtype == dtype
    assert out.shape == (L, Ev) and lse.shape == (L,)
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(lse, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])


def test_merge_is_order_invariant_and_accepts_sequences(rng):
    q, k, v = rng.standard_normal((7, 4)), rng.standard_normal((50, 4)), rng.standard_normal((50, 3))
    outs, lses = part_results(q, k, v, random_shards(rng, 50, 4), 0.5, np.float64)
    a = merge_attention(outs, lses)
    perm = rng.permutation(4)
    b = merge_attention([outs[i] for i in perm], [lses[i] for i in perm])
    np.testing.assert_allclose(a[0], b[0], atol=1e-14)
    np.testing.assert_allclose(a[1], b[1], atol=1e-14)


def test_merge_with_batch_dimensions(rng):
    P, B, H, L, E, Ev, S = 3, 2, 3, 6, 4, 5, 40
    q = rng.standard_normal((B, H, L, E))
    k = rng.standard_normal((B, H, S, E))
    v = rng.standard_normal((B, H, S, Ev))
    shards = random_shards(rng, S, P)
    outs = np.zeros((P, B, H, L, Ev))
    lses = np.zeros((P, B, H, L))
    ref = np.zeros((B, H, L, Ev))
    ref_lse = np.zeros((B, H, L))
    for b in range(B):
        for h in range(H):
            ref[b, h], ref_lse[b, h] = dense(q[b, h], k[b, h], v[b, h], 0.3)
            for p, idx in enumerate(shards):
                outs[p, b, h], lses[p, b, h] = dense(q[b, h], k[b, h, idx], v[b, h, idx], 0.3)
    out, lse = merge_attention(outs, lses)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_empty_parts_contribute_nothing_even_nan(rng):
    o = rng.standard_normal((3, 4, 2))
    lse = rng.standard_normal((3, 4))
    lse[1] = -np.inf
    o[1] = np.nan  # garbage in an empty part must not be read
    out, l_out = merge_attention(o, lse)
    ref, ref_lse = merge_attention(o[[0, 2]], lse[[0, 2]])
    np.testing.assert_allclose(out, ref, atol=1e-15)
    np.testing.assert_allclose(l_out, ref_lse, atol=1e-15)


def test_all_parts_empty_gives_zeros_and_minus_inf():
    o = np.full((4, 3, 2), np.nan, dtype=np.float32)
    lse = np.full((4, 3), -np.inf, dtype=np.float32)
    lse[2, 1] = 0.5  # row 1 has one live part
    o[2, 1] = [1.0, -2.0]
    with np.errstate(all="raise"):  # no warning-producing arithmetic (log 0, 0/0) reaches the user
        out, l_out = merge_attention(o, lse)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[[0, 2]], 0.0)
    np.testing.assert_array_equal(l_out[[0, 2]], -np.inf)
    np.testing.assert_allclose(out[1], [1.0, -2.0])
    assert l_out[1] == np.float32(0.5)


def test_tiny_weights_do_not_underflow_to_nan():
    # A part 1e4 below the best one underflows to weight 0: the result is the best part, not NaN.
    o = np.array([[[1.0]], [[5.0]]])
    lse = np.array([[0.0], [-1e4]])
    out, l_out = merge_attention(o, lse)
    assert out[0, 0] == 1.0 and l_out[0] == 0.0


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merge_pair_matches_merge_attention_and_accumulates_in_place(rng, dtype):
    L, S, E, Ev = 9, 300, 6, 4
    q, k, v = rng.standard_normal((L, E)), rng.standard_normal((S, E)), rng.standard_normal((S, Ev))
    ref, ref_lse = dense(q, k, v, 0.7)
    blocks = np.array_split(np.arange(S), 6)
    outs, lses = part_results(q, k, v, blocks, 0.7, dtype)
    pair = merge_pair(outs[0], lses[0], outs[1], lses[1])
    two = merge_attention(outs[:2], lses[:2])
    np.testing.assert_allclose(pair[0], two[0], atol=TOL[dtype])
    np.testing.assert_allclose(pair[1], two[1], atol=TOL[dtype])
    acc_o = np.zeros((L, Ev), dtype=dtype)  # start from "no key"
    acc_l = np.full(L, -np.inf, dtype=dtype)
    for o, lse in zip(outs, lses, strict=True):
        res = merge_pair(acc_o, acc_l, o, lse, out=(acc_o, acc_l))
        assert res[0] is acc_o and res[1] is acc_l
    np.testing.assert_allclose(acc_o, ref, atol=TOL[dtype])
    np.testing.assert_allclose(acc_l, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])


def test_merge_pair_with_empty_sides():
    o1 = np.array([[np.nan, np.nan]])
    l1 = np.array([-np.inf])
    o2 = np.array([[1.0, 2.0]])
    l2 = np.array([0.25])
    out, lse = merge_pair(o1, l1, o2, l2)
    np.testing.assert_array_equal(out, o2)
    assert lse[0] == 0.25
    out, lse = merge_pair(o1, l1, o1.copy(), l1.copy())
    np.testing.assert_array_equal(out, 0.0)
    assert lse[0] == -np.inf


def test_errors_name_the_argument():
    o = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"lses must have shape outputs.shape\[:-1\]"):
        merge_attention(o, np.zeros((2, 4)))
    with pytest.raises(ValueError, match="at least one part"):
        merge_attention(np.zeros((0, 3, 4)), np.zeros((0, 3)))
    with pytest.raises(ValueError, match="lses must be finite or -inf"):
        merge_attention(o, np.array([[0.0, np.nan, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="lses must be finite or -inf"):
        merge_attention(o, np.array([[0.0, np.inf, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(TypeError, match="outputs must have dtype float"):
        merge_attention(np.zeros((2, 3, 4), dtype=np.int64), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="outputs must have at least 3 dimensions"):
        merge_attention(np.zeros((3, 4)), np.zeros(3))
    with pytest.raises(ValueError, match="same shape"):
        merge_attention([np.zeros((3, 4)), np.zeros((2, 4))], [np.zeros(3), np.zeros(2)])
    bad = o.copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"outputs contains NaN or Inf at index \(0, 1, 2\)"):
        merge_attention(bad, np.zeros((2, 3)))
    out, _ = merge_attention(bad, np.zeros((2, 3)), check_finite=False)
    assert np.isnan(out[1, 2])
    with pytest.raises(ValueError, match="o1 and o2 must have the same shape"):
        merge_pair(np.zeros((3, 4)), np.zeros(3), np.zeros((3, 5)), np.zeros(3))
    with pytest.raises(ValueError, match=r"l2 must have shape o1.shape\[:-1\]"):
        merge_pair(np.zeros((3, 4)), np.zeros(3), np.zeros((3, 4)), np.zeros(4))
    with pytest.raises(ValueError, match="l1 must be finite or -inf"):
        merge_pair(np.zeros((1, 4)), np.array([np.nan]), np.zeros((1, 4)), np.zeros(1))
    with pytest.raises(ValueError, match="out must hold arrays of shapes"):
        merge_pair(np.zeros((3, 4)), np.zeros(3), np.zeros((3, 4)), np.zeros(3),
                   out=(np.zeros((3, 4), dtype=np.float32), np.zeros(3, dtype=np.float32)))
    with pytest.raises(TypeError, match="out must be a tuple"):
        merge_pair(np.zeros((3, 4)), np.zeros(3), np.zeros((3, 4)), np.zeros(3), out=np.zeros((3, 4)))


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 6), S=st.integers(0, 30), parts=st.integers(1, 6), seed=st.integers(0, 2**32 - 1),
       spread=st.floats(0.0, 30.0))
def test_property_sharded_equals_full(L, S, parts, seed, spread):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, 3)) * spread
    k = rng.standard_normal((S, 3))
    v = rng.standard_normal((S, 2))
    ref, ref_lse = dense(q, k, v, 1.0)
    outs, lses = part_results(q, k, v, random_shards(rng, S, parts), 1.0, np.float64)
    out, lse = merge_attention(outs, lses)
    np.testing.assert_allclose(out, ref, atol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-10)
    assert not np.isnan(out).any()


def test_merge_kernel_on_strided_partials_skips_dead_ones():
    # The kernel routed attention uses: partials with a row-sum column (strided views), a slot map,
    # garbage in dead partials (sum 0, shift -inf, or a weight that underflows), an lse offset.
    from sparseattn.kernels.merge import merge_partials

    rng = np.random.default_rng(4)
    Ev, p, L = 3, 3, 5
    po = rng.standard_normal((L * p, Ev + 1))
    po[:, Ev] = rng.uniform(0.5, 2.0, L * p)
    pm = rng.standard_normal(L * p)
    po[1, :Ev], pm[1] = np.nan, -np.inf  # dead: shift -inf
    po[4, :Ev], po[4, Ev] = np.nan, 0.0  # dead: sum 0
    po[7, :Ev], pm[7] = np.nan, -1e4  # dead: weight exp(-1e4 - M) = 0
    pm[[9, 10, 11]] = -np.inf  # a row without a live partial
    slot = rng.permutation(L * p).astype(np.int64)
    shift = rng.standard_normal(L)
    out = np.full((L, Ev), np.nan)
    lse = np.full(L, np.nan)
    merge_partials((po[:, :Ev],), po[:, Ev], pm, slot, p, shift, out, lse)
    for i in range(L):
        parts = slot[i * p:(i + 1) * p]
        live = [s for s in parts if po[s, Ev] > 0 and pm[s] > -100]
        if not live:
            assert np.all(out[i] == 0) and lse[i] == -np.inf
            continue
        M = max(pm[s] for s in live)
        w = np.array([np.exp(pm[s] - M) for s in live])
        tot = (w * po[live, Ev]).sum()
        np.testing.assert_allclose(out[i], (w[:, None] * po[live, :Ev]).sum(0) / tot, atol=1e-14)
        assert lse[i] == pytest.approx(M + np.log(tot) + shift[i], abs=1e-14)


def test_merge_pair_with_overlapping_out_views(rng):
    # out overlapping an input in another layout (here: shifted by one row, still contiguous): the
    # inputs are copied before the merge; out being o1 itself is the in-place accumulation case.
    big = rng.standard_normal((7, 4))
    o2 = rng.standard_normal((6, 4))
    l1, l2 = rng.standard_normal(6), rng.standard_normal(6)
    want = merge_attention(np.stack([big[:6], o2]), np.stack([l1, l2]))
    res = merge_pair(big[:6], l1, o2, l2, out=(big[1:], np.empty(6)))
    assert res[0].base is big or res[0] is big[1:] or np.shares_memory(res[0], big)
    np.testing.assert_allclose(big[1:], want[0], atol=1e-14)
    o1 = rng.standard_normal((6, 4))
    want = merge_attention(np.stack([o1, o2]), np.stack([l1, l2]))
    acc = (o1, l1.copy())
    merge_pair(*acc, o2, l2, out=acc)
    np.testing.assert_allclose(o1, want[0], atol=1e-14)
    np.testing.assert_allclose(acc[1], want[1], atol=1e-14)


@pytest.mark.parametrize("dtype, big", [(np.float32, 3.0e38), (np.float64, 1.5e308)])
def test_parts_near_the_dtype_max_merge_to_a_finite_output(dtype, big):
    # each part is a finite attention output near the largest finite value; the merge is their convex
    # combination (equal lse: 1/2, 1/2; unequal: a weighted mean), so it must stay finite and exact to rounding
    import sparseattn as sa

    o = np.stack([np.full((2, 3), big, dtype), np.full((2, 3), big * 0.9, dtype)])
    lse = np.array([[0.0, 0.0], [0.0, np.log(3.0)]], dtype)
    out, _ = sa.merge_attention(o, lse)
    want = np.array([0.5 * big + 0.5 * 0.9 * big, 0.25 * big + 0.75 * 0.9 * big])
    np.testing.assert_allclose(out.astype(np.float64), np.repeat(want[:, None], 3, axis=1), rtol=1e-6)
    out2, _ = sa.merge_pair(o[0], lse[0], o[1], lse[1])
    assert np.isfinite(out2).all()
    np.testing.assert_allclose(out2.astype(np.float64), out.astype(np.float64), rtol=1e-6)
