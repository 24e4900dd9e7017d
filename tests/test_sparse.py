"""sparse_attention with explicit patterns against a float64 dense oracle and the dense reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
import sparseattn.attention.sparse as sparse_mod
from sparseattn import SparsePattern, scaled_dot_product_attention, sparse_attention
from sparseattn.attention.sparse import sparse_attention_result
from sparseattn.kernels import fused
from sparseattn.kernels.bias import no_bias_args

# fp64 ~1e-15 observed, fp32 ~3e-7 observed (outputs of magnitude ~1), fp16 inputs limited by fp16 output.
TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


@pytest.fixture(autouse=True)
def _serial():
    # CI runs with one thread (DESIGN.md); the parallel kernel is tested explicitly below with 2 threads.
    with sa.threads(1):
        yield


def close(a, b, dtype):
    tol = TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def oracle(q, k, v, mask, scale=None, bias=None):
    """Float64 masked softmax attention for 2-D inputs; mask bool (L, S); no key -> zeros, lse -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    sc = 1.0 / np.sqrt(q.shape[1]) if scale is None else scale
    s = q @ k.T * sc
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    s = np.where(mask, s, -np.inf)
    out = np.zeros((q.shape[0], v.shape[1]))
    lse = np.full(q.shape[0], -np.inf)
    for i in range(q.shape[0]):
        if np.all(np.isneginf(s[i])):
            continue
        m = s[i].max()
        w = np.exp(s[i] - m)
        out[i] = w @ v / w.sum()
        lse[i] = m + np.log(w.sum())
    return out, lse


def qkv(rng, lead_q, lead_kv, L, S, E, Ev, dtype):
    return (rng.standard_normal(lead_q + (L, E)).astype(dtype), rng.standard_normal(lead_kv + (S, E)).astype(dtype),
            rng.standard_normal(lead_kv + (S, Ev)).astype(dtype))


# ------------------------------------------------------------------------------ full == dense
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead_q,lead_kv", [((), ()), ((3,), (3,)), ((2, 3), (2, 3)), ((2, 3), (3,)),
                                            ((2, 1), (1, 3))])
def test_full_pattern_equals_dense(rng, dtype, lead_q, lead_kv):
    q, k, v = qkv(rng, lead_q, lead_kv, 11, 13, 8, 5, dtype)
    out, lse = sparse_attention(q, k, v, SparsePattern.full(11, 13), return_lse=True)
    ref, ref_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == dtype and out.shape == ref.shape
    close(out, ref, dtype)
    close(lse, ref_lse, dtype)


@pytest.mark.parametrize("L,S", [(9, 12), (12, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_full_pattern_equals_causal_dense(rng, dtype, L, S):
    q, k, v = qkv(rng, (2,), (2,), L, S, 6, 4, dtype)
    out = sparse_attention(q, k, v, SparsePattern.full(L, S, is_causal=True))
    close(out, scaled_dot_product_attention(q, k, v, is_causal=True), dtype)
    close(sparse_attention(q, k, v, SparsePattern.full(L, S)), scaled_dot_product_attention(q, k, v), dtype)


def test_pattern_list_one_per_group(rng):
    B, H, L, S = 2, 3, 7, 10
    q, k, v = qkv(rng, (B, H), (B, H), L, S, 5, 4, np.float64)
    masks = rng.random((B * H, L, S)) < 0.5
    pats = [SparsePattern.from_mask(m) for m in masks]
    out, lse = sparse_attention(q, k, v, pats, return_lse=True)
    for g in range(B * H):
        b, h = divmod(g, H)
        o, s = oracle(q[b, h], k[b, h], v[b, h], masks[g])
        close(out[b, h], o, np.float64)
        np.testing.assert_array_equal(np.isneginf(lse[b, h]), np.isneginf(s))
        close(lse[b, h][np.isfinite(s)], s[np.isfinite(s)], np.float64)
    # a tuple works like a list; a shared pattern equals a list of copies
    close(sparse_attention(q, k, v, tuple(pats)), out, np.float64)
    shared = SparsePattern.from_mask(masks[0])
    close(sparse_attention(q, k, v, shared), sparse_attention(q, k, v, [shared] * (B * H)), np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gqa_matches_dense_and_per_group_patterns(rng, dtype):
    B, Hq, Hk, L, S = 2, 4, 2, 6, 9
    q, k, v = qkv(rng, (B, Hq), (B, Hk), L, S, 4, 3, dtype)
    out = sparse_attention(q, k, v, SparsePattern.full(L, S), enable_gqa=True)
    close(out, scaled_dot_product_attention(q, k, v, enable_gqa=True), dtype)
    masks = rng.random((B * Hq, L, S)) < 0.6
    out = sparse_attention(q, k, v, [SparsePattern.from_mask(m) for m in masks], enable_gqa=True)
    for g in range(B * Hq):
        b, h = divmod(g, Hq)
        close(out[b, h], oracle(q[b, h], k[b, h // 2], v[b, h // 2], masks[g])[0], dtype)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key heads \(3\)"):
        sparse_attention(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), SparsePattern.full(L, S),
                         enable_gqa=True)


# ------------------------------------------------------------------------- window == band dense
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_window_pattern_equals_band_masked_dense(rng, dtype, is_causal):
    L = S = 24
    q, k, v = qkv(rng, (3,), (3,), L, S, 8, 6, dtype)
    p = SparsePattern.window(L, S, 5, is_causal=is_causal, dilation=2)
    idx = np.arange(L)
    diff = idx[:, None] - idx[None, :]
    if is_causal:
        band = (diff >= 0) & (diff <= 8) & (diff % 2 == 0)
    else:
        band = (diff >= -4) & (diff <= 4) & (diff % 2 == 0)
    assert np.array_equal(p.to_mask(), band)
    out, lse = sparse_attention(q, k, v, p, return_lse=True)
    ref, ref_lse = scaled_dot_product_attention(q, k, v, attn_mask=band, return_lse=True)
    close(out, ref, dtype)
    close(lse, ref_lse, dtype)


# ------------------------------------------------------------------ random patterns (hypothesis)
@settings(max_examples=60)
@given(lead=st.sampled_from([(), (1,), (2,), (2, 2), (1, 3)]), L=st.integers(1, 9), S=st.integers(1, 12),
       E=st.integers(1, 7), Ev=st.integers(1, 5), density=st.floats(0.0, 1.0), per_group=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), scale=st.one_of(st.none(), st.floats(0.1, 3.0)),
       seed=st.integers(0, 2**31 - 1))
def test_random_patterns_equal_masked_dense(lead, L, S, E, Ev, density, per_group, dtype, scale, seed):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, lead, lead, L, S, E, Ev, dtype)
    G = int(np.prod(lead, dtype=np.int64))
    if per_group:
        masks = rng.random((G, L, S)) < density
        pattern = [SparsePattern.from_mask(m) for m in masks]
        dense_mask = masks.reshape(lead + (L, S))
    else:
        dense_mask = rng.random((L, S)) < density
        pattern = SparsePattern.from_mask(dense_mask)
    out, lse = sparse_attention(q, k, v, pattern, scale=scale, return_lse=True)
    ref, ref_lse = scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, scale=scale, return_lse=True)
    close(out, ref, dtype)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    close(lse[fin], ref_lse[fin], dtype)
    assert np.all(out[~fin] == 0) and not np.isnan(out).any()
    # and the independent float64 oracle, group by group
    q3, k3, v3 = (x.reshape((-1,) + x.shape[-2:]) for x in (q, k, v))
    m3 = np.broadcast_to(dense_mask, lead + (L, S)).reshape(-1, L, S)
    for g in range(G):
        close(out.reshape(-1, L, Ev)[g], oracle(q3[g], k3[g], v3[g], m3[g], scale)[0], dtype)


def test_empty_rows_give_zeros_and_neg_inf(rng):
    q, k, v = qkv(rng, (2,), (2,), 4, 6, 3, 2, np.float32)
    p = SparsePattern.from_rows([[0, 5], [], [1], []], n_keys=6)
    out, lse = sparse_attention(q, k, v, p, return_lse=True)
    assert np.all(out[:, [1, 3]] == 0) and np.all(np.isneginf(lse[:, [1, 3]]))
    assert np.all(np.isfinite(lse[:, [0, 2]]))
    np.testing.assert_allclose(out[:, 2], v[:, 1], rtol=1e-6)   # one key: its value exactly
    np.testing.assert_allclose(lse[:, 2], np.einsum("ge,ge->g", q[:, 2], k[:, 1]) / np.sqrt(3), rtol=1e-5)
    empty = sparse_attention(q, k, v, SparsePattern.from_rows([[]] * 4, n_keys=6))
    assert np.all(empty == 0)


# ---------------------------------------------------------------------------------- NaN poisoning
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_in_unselected_keys_values_does_not_leak(rng, dtype):
    L, S = 8, 20
    q, k, v = qkv(rng, (2,), (2,), L, S, 5, 4, dtype)
    poisoned = np.array([0, 3, 11, S - 2, S - 1])           # keys that no row selects
    mask = rng.random((L, S)) < 0.5
    mask[:, poisoned] = False
    mask[:, 5] = True
    keep = SparsePattern.from_mask(mask)
    assert not np.isin(keep.indices, poisoned).any()
    clean, clean_lse = sparse_attention(q, k, v, keep, return_lse=True)
    kp, vp = k.copy(), v.copy()
    kp[:, poisoned] = np.nan
    vp[:, poisoned] = np.nan
    out, lse = sparse_attention(q, kp, vp, keep, return_lse=True, check_finite=False)
    assert np.isfinite(out).all()
    assert np.array_equal(out, clean) and np.array_equal(lse, clean_lse)
    # the same with one pattern per group and GQA-style sharing of K/V
    out2 = sparse_attention(np.stack([q, q], 1), kp[:, None], vp[:, None], [keep] * 4, enable_gqa=True,
                            check_finite=False)
    assert np.array_equal(out2[:, 0], clean) and np.array_equal(out2[:, 1], clean)


def test_nan_rejected_without_check_finite_false(rng):
    q, k, v = qkv(rng, (), (), 3, 4, 2, 2, np.float64)
    k[3, 0] = np.nan
    with pytest.raises(ValueError, match=r"key contains NaN or Inf \(first at index \(3, 0\)\)"):
        sparse_attention(q, k, v, SparsePattern.full(3, 4))


# --------------------------------------------------------------------------- reproducibility
def test_serial_path_is_bit_reproducible(rng):
    q, k, v = qkv(rng, (2, 2), (2, 2), 50, 80, 16, 8, np.float32)
    p = SparsePattern.from_padded(rng.integers(-1, 80, size=(50, 24)), 80)
    with sa.threads(1):
        a = sparse_attention(q, k, v, p, return_lse=True)
    with sa.threads(1):
        b = sparse_attention(q, k, v, p, return_lse=True)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _direct(kernel, q3, k3, v3, indptr, indices, shared, scale, chunk, G):
    out = np.empty((G, q3.shape[1], v3.shape[2]), q3.dtype)
    lse = np.empty((G, q3.shape[1]), q3.dtype)
    max_nnz = int(np.diff(indptr).max())
    kernel(q3, k3, v3, np.arange(G), np.arange(G), indptr, indices, shared, q3.dtype.type(scale), max_nnz,
           chunk, *no_bias_args(G), 1, out, lse, q3.dtype == np.float32)
    return out, lse


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_parallel_kernel_equals_serial_bit_for_bit(rng, dtype, chunk):
    G, L, S, E, Ev = 3, 90, 120, 24, 12
    q3, k3, v3 = qkv(rng, (G,), (G,), L, S, E, Ev, dtype)
    p = SparsePattern.from_padded(rng.integers(-1, S, size=(L, 30)), S)
    pats = [SparsePattern.from_padded(rng.integers(-1, S, size=(L, 30)), S) for _ in range(G)]
    from sparseattn.pattern import stack_patterns
    ptr_g, idx_g = stack_patterns(pats)
    for indptr, indices, shared in ((p.indptr, p.indices, True), (ptr_g, idx_g, False)):
        ser = _direct(fused.fused_serial, q3, k3, v3, indptr, indices, shared, 0.3, chunk, G)
        with sa.threads(2):
            par = _direct(fused.fused_parallel, q3, k3, v3, indptr, indices, shared, 0.3, chunk, G)
        assert np.array_equal(ser[0], par[0]) and np.array_equal(ser[1], par[1])


def test_public_parallel_path_equals_serial(rng, monkeypatch):
    q, k, v = qkv(rng, (2,), (2,), 70, 90, 16, 8, np.float32)
    p = SparsePattern.from_padded(rng.integers(-1, 90, size=(70, 20)), 90)
    serial = sparse_attention(q, k, v, p, return_lse=True)
    monkeypatch.setattr(sparse_mod, "PARALLEL_MIN_WORK", 0)  # force the parallel kernel on a small input
    calls = []
    real = fused.fused_parallel_nobias  # no bias: the variant with the bias code pruned
    monkeypatch.setattr(fused, "fused_parallel_nobias", lambda *a: (calls.append(1), real(*a))[1])
    with sa.threads(2):
        par = sparse_attention(q, k, v, p, return_lse=True)
    assert calls, "the parallel kernel was not used"
    assert np.array_equal(serial[0], par[0]) and np.array_equal(serial[1], par[1])


# ------------------------------------------------------------------------------------- biases
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_bias_array_equals_dense_float_mask(rng, dtype):
    L, S = 7, 9
    q, k, v = qkv(rng, (2, 3), (2, 3), L, S, 4, 3, dtype)
    bias = rng.standard_normal((3, L, S)).astype(dtype)   # per head, broadcast over the batch
    p = SparsePattern.full(L, S)
    out, lse = sparse_attention(q, k, v, p, bias=bias, return_lse=True)
    ref, ref_lse = scaled_dot_product_attention(q, k, v, attn_mask=bias, return_lse=True)
    close(out, ref, dtype)
    close(lse, ref_lse, dtype)
    # with a sparse pattern: bias added on the selected pairs only
    mask = rng.random((L, S)) < 0.5
    mask[:, 0] = True
    out = sparse_attention(q, k, v, SparsePattern.from_mask(mask), bias=bias)
    fmask = np.where(mask, bias, -np.inf).astype(dtype)
    close(out, scaled_dot_product_attention(q, k, v, attn_mask=fmask), dtype)




def test_dense_bias_with_neg_inf_equals_dense_float_mask(rng):
    L, S = 5, 6
    q, k, v = qkv(rng, (), (), L, S, 4, 3, np.float32)
    bias = rng.standard_normal((L, S)).astype(np.float32)
    bias[1, :] = -np.inf
    bias[2, :3] = -np.inf
    out, lse = sparse_attention(q, k, v, SparsePattern.full(L, S), bias=bias, return_lse=True)
    ref, ref_lse = scaled_dot_product_attention(q, k, v, attn_mask=bias, return_lse=True)
    close(out, ref, np.float32)
    assert np.isneginf(lse[1]) and np.all(out[1] == 0)


def test_dense_bias_errors(rng):
    q, k, v = qkv(rng, (3,), (3,), 4, 5, 2, 2, np.float64)
    p = SparsePattern.full(4, 5)
    with pytest.raises(ValueError, match=r"bias array must end in \(L, S\) = \(4, 5\); got \(5, 4\)"):
        sparse_attention(q, k, v, p, bias=np.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"leading dimensions of query \(3,\) and bias \(2,\) do not broadcast"):
        sparse_attention(q, k, v, p, bias=np.zeros((2, 4, 5)))
    with pytest.raises(TypeError, match=r"bias must have dtype float16, float32 or float64; got int64"):
        sparse_attention(q, k, v, p, bias=np.zeros((4, 5), dtype=np.int64))




def test_dense_bias_wider_than_inputs_is_rejected(rng):
    q, k, v = qkv(rng, (3,), (3,), 4, 5, 2, 2, np.float64)
    with pytest.raises(ValueError, match=r"bias"):
        sparse_attention(q, k, v, SparsePattern.full(4, 5), bias=rng.standard_normal((2, 3, 4, 5)))


# --------------------------------------------------------------------------------- large logits
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_stay_finite(rng, dtype):
    L, S, E = 6, 10, 4
    q, k, v = qkv(rng, (), (), L, S, E, 3, dtype)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(dtype)
    k = (k / np.linalg.norm(k, axis=1, keepdims=True)).astype(dtype)
    scale = 1e4   # logits in [-1e4, 1e4]
    mask = rng.random((L, S)) < 0.6
    mask[:, 0] = True
    out, lse = sparse_attention(q, k, v, SparsePattern.from_mask(mask), scale=scale, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    scores = np.where(mask, q.astype(np.float64) @ k.astype(np.float64).T * scale, -np.inf)
    # lse lies between the max score and max + log(count)
    mx = scores.max(axis=1)
    assert np.all(lse >= mx - 1e-2 * (dtype == np.float32) - 1e-9)
    assert np.all(lse <= mx + np.log(mask.sum(axis=1)) + 1e-2)
    # each output is a convex combination of its selected values
    for i in range(L):
        sel = v[mask[i]]
        assert np.all(out[i] >= sel.min(axis=0) - 1e-5) and np.all(out[i] <= sel.max(axis=0) + 1e-5)
    if dtype == np.float64:
        ref, ref_lse = oracle(q, k, v, mask, scale)
        np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    neg, neg_lse = sparse_attention(q, k, v, SparsePattern.from_mask(mask), scale=-scale, return_lse=True)
    assert np.isfinite(neg).all() and np.isfinite(neg_lse).all()


# ------------------------------------------------------------------------------------- dtypes
def test_dtype_rules(rng):
    q, k, v = qkv(rng, (), (), 5, 6, 4, 3, np.float64)
    p = SparsePattern.full(5, 6)
    for dts, out_dt, lse_dt in [((np.float16,) * 3, np.float16, np.float32),
                                ((np.float32, np.float16, np.float32), np.float32, np.float32),
                                ((np.float32, np.float32, np.float64), np.float64, np.float64)]:
        out, lse = sparse_attention(q.astype(dts[0]), k.astype(dts[1]), v.astype(dts[2]), p, return_lse=True)
        assert out.dtype == out_dt and lse.dtype == lse_dt
    out16 = sparse_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), p)
    ref = oracle(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), np.ones((5, 6), bool))[0]
    close(out16.astype(np.float64), ref, np.float16)


def test_non_contiguous_and_read_only_inputs(rng):
    q = rng.standard_normal((2, 12, 9))[:, ::2, 1::2]         # (2, 6, 4) strided
    k = np.swapaxes(rng.standard_normal((2, 4, 8)), -1, -2)     # (2, 8, 4) transposed
    v = rng.standard_normal((2, 8, 3))
    for x in (q, k, v):
        x.flags.writeable = False
    mask = rng.random((6, 8)) < 0.5
    out = sparse_attention(q, k, v, SparsePattern.from_mask(mask))
    close(out, scaled_dot_product_attention(np.array(q), np.array(k), np.array(v), attn_mask=mask), np.float64)


def test_sparse_attention_result(rng):
    q, k, v = qkv(rng, (2,), (2,), 4, 5, 3, 2, np.float64)
    p = SparsePattern.window(4, 5, 2, is_causal=True)
    res = sparse_attention_result(q, k, v, p)
    assert isinstance(res, sa.SparseAttentionResult)
    out, lse = sparse_attention(q, k, v, p, return_lse=True)
    assert np.array_equal(res.output, out) and np.array_equal(res.lse, lse)
    assert np.array_equal(sparse_attention(q, k, v, p), out)
    assert res.patterns == [p] and res.selector is None
    assert set(res.timings) == {"build", "select", "kernel"} and res.timings["kernel"] >= 0
    sel = sparse_attention_result(q, k, v, "topk", k=2)
    assert sel.selector.startswith("topk") and len(sel.patterns) == 2 and sel.timings["build"] >= 0
    np.testing.assert_array_equal(sel.output, sparse_attention(q, k, v, "topk", k=2))


def test_return_result_is_gone(rng):
    q, k, v = qkv(rng, (), (), 4, 5, 3, 2, np.float64)
    with pytest.raises(TypeError, match="return_result"):
        sparse_attention(q, k, v, SparsePattern.full(4, 5), return_result=True)


def test_is_causal_filters_an_explicit_pattern(rng):
    # documented: is_causal=True keeps only keys at or before each query, as SDPA does
    q, k, v = qkv(rng, (), (), 5, 5, 3, 2, np.float64)
    p = SparsePattern.full(5, 5)
    exact = scaled_dot_product_attention(q, k, v, is_causal=True)
    close(sparse_attention(q, k, v, p, is_causal=True), exact, np.float64)
    close(sparse_attention(q, k, v, p.causal()), exact, np.float64)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        sparse_attention(q, k, v, p, is_causal="yes")


def test_patterns_are_immutable_so_the_kernel_can_trust_them(rng):
    # No per-call CSR re-check: a pattern is validated once, when built, and cannot be edited afterwards.
    q, k, v = qkv(rng, (), (), 6, 6, 3, 2, np.float32)
    p = SparsePattern.full(6, 6)
    with pytest.raises(ValueError, match="read-only"):
        p.indices[0] = 10**8
    with pytest.raises(ValueError, match="read-only"):
        p.indptr[1] = 0
    with pytest.raises(ValueError, match="outside"):
        SparsePattern(np.array([0, 1, 1, 1, 1, 1, 1]), np.array([10**8]), 6)
    close(sparse_attention(q, k, v, p), scaled_dot_product_attention(q, k, v), np.float32)


# -------------------------------------------------------------------------------- empty inputs


def test_zero_queries(rng):
    out, lse = sparse_attention(np.zeros((0, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2)),
                                SparsePattern.full(0, 5), return_lse=True)
    assert out.shape == (0, 2) and lse.shape == (0,)


def test_zero_keys(rng):
    out, lse = sparse_attention(rng.standard_normal((2, 4, 3)), np.zeros((2, 0, 3)), np.zeros((2, 0, 2)),
                                SparsePattern.full(4, 0), return_lse=True)
    assert out.shape == (2, 4, 2) and np.all(out == 0) and np.all(np.isneginf(lse))


# ------------------------------------------------------------------------------------- errors
def test_pattern_errors(rng):
    q, k, v = qkv(rng, (2, 3), (2, 3), 4, 5, 3, 2, np.float32)
    with pytest.raises(ValueError, match=r"pattern shape \(4, 6\) does not match \(L, S\) = \(4, 5\)"):
        sparse_attention(q, k, v, SparsePattern.full(4, 6))
    with pytest.raises(ValueError, match=r"pattern shape \(5, 5\) does not match \(L, S\) = \(4, 5\)"):
        sparse_attention(q, k, v, [SparsePattern.full(4, 5)] * 5 + [SparsePattern.full(5, 5)])
    with pytest.raises(ValueError, match=r"pattern sequence has 2 entries; expected one per \(batch, head\) "
                                         r"group = 6 for leading dims \(2, 3\)"):
        sparse_attention(q, k, v, [SparsePattern.full(4, 5)] * 2)
    with pytest.raises(ValueError, match=r"pattern sequence has 0 entries"):
        sparse_attention(q, k, v, [])
    with pytest.raises(TypeError, match=r"pattern must be a SparsePattern, a sequence of them, a Selector or a "
                                        r"selector spec string; got ndarray"):
        sparse_attention(q, k, v, np.ones((4, 5), dtype=bool))
    with pytest.raises(TypeError, match=r"got NoneType"):
        sparse_attention(q, k, v, None)
    with pytest.raises(TypeError, match=r"pattern\[1\] must be a SparsePattern; got ndarray"):
        sparse_attention(q, k, v, [SparsePattern.full(4, 5), np.ones((4, 5), dtype=bool)] * 3)


def test_shape_errors(rng):
    q, k, v = qkv(rng, (), (), 4, 5, 3, 2, np.float64)
    p = SparsePattern.full(4, 5)
    with pytest.raises(ValueError, match=r"query and key must have the same feature size E; got query \(4, 2\) and key \(5, 3\)"):
        sparse_attention(q[:, :2], k, v, p)
    with pytest.raises(ValueError, match=r"key and value must have the same length S; got key \(5, 3\) and value \(4, 2\)"):
        sparse_attention(q, k, v[:4], p)
    with pytest.raises(TypeError, match=r"query must have dtype float16, float32 or float64; got int64"):
        sparse_attention(q.astype(np.int64), k, v, p)
    with pytest.raises(ValueError, match=r"scale must be finite; got nan"):
        sparse_attention(q, k, v, p, scale=float("nan"))


# ------------------------------------------------------------------------- declared capabilities
def test_selector_that_attends_is_dispatched_by_its_declaration(rng):
    from sparseattn.selectors import Selector, get_selector

    q, k, v = qkv(rng, (2,), (2,), 16, 64, 8, 3, np.float64)
    spec = "cluster:mode=block,n_clusters=4,n_probe=2"
    assert get_selector(spec).attends is True and get_selector("cluster").attends is False
    assert Selector.attends is False
    res = sparse_attention_result(q, k, v, spec, k=8)
    assert res.patterns == [] and res.selector.startswith("cluster")
    for g in range(2):
        out, lse = get_selector(spec).build(k[g]).attend(q[g], v[g])
        close(res.output[g], out, np.float64)
        close(res.lse[g], lse, np.float64)


def test_unsupported_input_is_refused_with_the_selectors_reasons(rng):
    q, k, v = qkv(rng, (), (), 8, 32, 4, 2, np.float64)
    with pytest.raises(ValueError, match=r"selector 'cluster:.*mode=block.*' cannot run here: bias is not "
                                         r"supported by cluster:mode=block"):
        sparse_attention(q, k, v, "cluster:mode=block,n_clusters=4", bias=np.zeros((8, 32)))
    with pytest.raises(ValueError, match=r"cannot run here: n_clusters=50 > n_keys=32"):
        sparse_attention(q, k, v, "cluster:n_clusters=50")
    # a selector that only selects keys supports a bias: the kernel adds it to the selected scores
    bias = rng.standard_normal((8, 32))
    ref = sparse_attention(q, k, v, SparsePattern.full(8, 32), bias=bias)
    close(sparse_attention(q, k, v, "topk", k=32, bias=bias), ref, np.float64)
