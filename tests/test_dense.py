"""scaled_dot_product_attention (the exact dense reference) against independent oracles.

Oracles: torch.nn.functional.scaled_dot_product_attention (always called with 4-D tensors), a float64
numpy softmax written here, scipy's logsumexp and the hand-checked seed example.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

import sparseattn as sa
from sparseattn import scaled_dot_product_attention as sdpa

# Per-dtype tolerances (absolute + relative) for outputs of magnitude ~1.  Observed: fp64 vs the fp64
# oracle ~1e-15, fp32 vs torch / oracle ~5e-7, fp16 inputs ~5e-4 (the fp16 rounding of the output).
TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


# ------------------------------------------------------------------------------------------ oracles
def ref_attention(q, k, v, mask=None, is_causal=False, scale=None):
    """Float64 dense attention for 2-D q (L,E), k (S,E), v (S,Ev); mask bool (True = attend) or float.

    A row with no allowed key gives zeros and lse = -inf.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    L, E = q.shape
    S = k.shape[0]
    sc = 1.0 / np.sqrt(E) if scale is None else scale
    s = (q @ k.T) * sc
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            s = np.where(mask, s, -np.inf)
        else:
            s = s + mask.astype(np.float64)
    if is_causal:
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    out = np.zeros((L, v.shape[1]))
    lse = np.full(L, -np.inf)
    for i in range(L):
        row = s[i]
        if row.size == 0 or np.all(np.isneginf(row)):
            continue
        m = row.max()
        w = np.exp(row - m)
        out[i] = (w @ v) / w.sum()
        lse[i] = m + np.log(w.sum())
    return out, lse


def ref_batched(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The float64 oracle over leading dims: explicit broadcasting and explicit GQA head repetition."""
    if enable_gqa:
        rep = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, rep, axis=-3)
        v = np.repeat(v, rep, axis=-3)
    L, S = q.shape[-2], k.shape[-2]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                               () if mask is None else np.shape(mask)[:-2])
    qb = np.broadcast_to(q, lead + q.shape[-2:]).reshape((-1,) + q.shape[-2:])
    kb = np.broadcast_to(k, lead + k.shape[-2:]).reshape((-1,) + k.shape[-2:])
    vb = np.broadcast_to(v, lead + v.shape[-2:]).reshape((-1,) + v.shape[-2:])
    mb = None if mask is None else np.broadcast_to(mask, lead + (L, S)).reshape((-1, L, S))
    outs, lses = [], []
    for g in range(qb.shape[0]):
        o, lse = ref_attention(qb[g], kb[g], vb[g], None if mb is None else mb[g], is_causal, scale)
        outs.append(o)
        lses.append(lse)
    return (np.stack(outs).reshape(lead + (L, v.shape[-1])), np.stack(lses).reshape(lead + (L,)))


def to4(x, lead, tail):
    """Broadcast x to lead + tail and reshape to 4-D (B, H, n, f) for torch."""
    x = np.broadcast_to(x, lead + tail)
    h = lead[-1] if lead else 1
    return np.array(x.reshape((-1, h) + tail))  # a writable copy for torch.from_numpy


def torch_sdpa(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch SDPA with 4-D tensors; mask and causal are combined by hand (torch refuses both at once)."""
    torch = pytest.importorskip("torch")
    L, S = q.shape[-2], k.shape[-2]
    kv_lead = k.shape[:-2]
    if enable_gqa:
        hq, hk = q.shape[-3], k.shape[-3]
        lead = np.broadcast_shapes(q.shape[:-2], kv_lead[:-1] + (hq,))
        kv_full = lead[:-1] + (hk,)
    else:
        lead = np.broadcast_shapes(q.shape[:-2], kv_lead)
        kv_full = lead
    if mask is not None:
        lead = np.broadcast_shapes(lead, np.shape(mask)[:-2])
        kv_full = lead[:-1] + (kv_full[-1],) if enable_gqa else lead
    if is_causal and mask is not None:
        tril = np.tril(np.ones((L, S), dtype=bool))
        mask = (mask & tril) if mask.dtype == np.bool_ else np.where(tril, mask, -np.inf).astype(mask.dtype)
        is_causal = False
    tq = torch.from_numpy(to4(q, lead, q.shape[-2:]))
    tk = torch.from_numpy(to4(k, kv_full, k.shape[-2:]))
    tv = torch.from_numpy(to4(v, kv_full, v.shape[-2:]))
    tm = None if mask is None else torch.from_numpy(to4(mask, lead, (L, S)))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=is_causal,
                                                          scale=scale, enable_gqa=enable_gqa)
    return out.numpy().reshape(lead + (L, v.shape[-1]))


def allowed_rows(mask, is_causal, lead, L, S):
    """Boolean (lead..., L): rows with at least one allowed key."""
    ok = np.ones(lead + (L, S), dtype=bool)
    if mask is not None:
        m = np.broadcast_to(mask, lead + (L, S))
        ok &= m if m.dtype == np.bool_ else ~np.isneginf(m)
    if is_causal:
        ok &= np.tril(np.ones((L, S), dtype=bool))
    return ok.any(axis=-1)


def close(a, b, dtype):
    tol = TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------- hypothesis inputs
@st.composite
def attention_case(draw, gqa=False):
    """Random shapes with broadcastable leading dims, an optional bool/float mask, causal and scale."""
    nlead = draw(st.integers(0, 2)) if not gqa else draw(st.integers(1, 2))
    full = [draw(st.integers(1, 3)) for _ in range(nlead)]
    if gqa:
        hk = draw(st.integers(1, 2))
        full[-1] = hk * draw(st.integers(1, 3))

    def sub(shape, keep_last=False):
        # each dim kept or set to 1; leading dims may be dropped (numpy broadcasting)
        drop = draw(st.integers(0, len(shape)))
        out = [d if (draw(st.booleans()) or (keep_last and i == len(shape) - 1)) else 1
               for i, d in enumerate(shape)]
        if keep_last:
            drop = min(drop, len(shape) - 1)
        return tuple(out[drop:])

    q_lead = sub(full, keep_last=gqa)
    if gqa:
        q_lead = q_lead[:-1] + (full[-1],)
        kv_lead = sub(full[:-1] + [hk], keep_last=True)
        kv_lead = kv_lead[:-1] + (hk,)
    else:
        kv_lead = sub(full)
    L = draw(st.integers(1, 9))
    S = draw(st.integers(1, 11))
    E = draw(st.integers(1, 8))
    Ev = draw(st.integers(1, 6))
    mask_kind = "none" if gqa else draw(st.sampled_from(["none", "bool", "float"]))
    # the mask broadcasts to the leading shape of query/key (it may not widen it)
    mask_lead = sub(list(np.broadcast_shapes(q_lead, kv_lead))) if mask_kind != "none" else ()
    is_causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    q_block = draw(st.sampled_from([1, 2, 3, 256]))
    k_block = draw(st.sampled_from([1, 2, 5, 1024]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(q_lead=q_lead, kv_lead=kv_lead, L=L, S=S, E=E, Ev=Ev, mask_kind=mask_kind,
                mask_lead=mask_lead, is_causal=is_causal, scale=scale, q_block=q_block, k_block=k_block,
                seed=seed)


def make_inputs(case, dtype):
    rng = np.random.default_rng(case["seed"])
    q = rng.standard_normal(case["q_lead"] + (case["L"], case["E"])).astype(dtype)
    k = rng.standard_normal(case["kv_lead"] + (case["S"], case["E"])).astype(dtype)
    v = rng.standard_normal(case["kv_lead"] + (case["S"], case["Ev"])).astype(dtype)
    shape = case["mask_lead"] + (case["L"], case["S"])
    if case["mask_kind"] == "bool":
        mask = rng.random(shape) < 0.7
    elif case["mask_kind"] == "float":
        mask = rng.standard_normal(shape).astype(dtype)
        mask[rng.random(shape) < 0.25] = -np.inf
    else:
        mask = None
    return q, k, v, mask


# ---------------------------------------------------------------------------------- torch oracle
@settings(max_examples=60)
@given(case=attention_case())
def test_matches_torch_sdpa_fp32(case):
    pytest.importorskip("torch")
    q, k, v, mask = make_inputs(case, np.float32)
    out, lse = sdpa(q, k, v, attn_mask=mask, is_causal=case["is_causal"], scale=case["scale"],
                    q_block=case["q_block"], k_block=case["k_block"], return_lse=True)
    expected = torch_sdpa(q, k, v, mask, case["is_causal"], case["scale"])
    assert out.shape == expected.shape and out.dtype == np.float32 and lse.dtype == np.float32
    ok = allowed_rows(mask, case["is_causal"], out.shape[:-2], case["L"], case["S"])
    close(out[ok], expected[ok], np.float32)
    # rows with no allowed key: zeros and lse = -inf, never NaN (torch gives NaN or zeros there)
    assert np.all(out[~ok] == 0) and np.all(np.isneginf(lse[~ok])) and not np.isnan(out).any()


@settings(max_examples=50)
@given(case=attention_case())
def test_matches_float64_oracle(case):
    q, k, v, mask = make_inputs(case, np.float64)
    out, lse = sdpa(q, k, v, attn_mask=mask, is_causal=case["is_causal"], scale=case["scale"],
                    q_block=case["q_block"], k_block=case["k_block"], return_lse=True)
    ref_out, ref_lse = ref_batched(q, k, v, mask, case["is_causal"], case["scale"])
    assert out.dtype == np.float64 and lse.dtype == np.float64
    close(out, ref_out, np.float64)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(fin, np.isfinite(lse))
    close(lse[fin], ref_lse[fin], np.float64)


@settings(max_examples=40)
@given(case=attention_case(gqa=True))
def test_gqa_matches_torch_enable_gqa(case):
    pytest.importorskip("torch")
    case = dict(case, mask_kind="none", mask_lead=())
    q, k, v, _ = make_inputs(case, np.float32)
    out = sdpa(q, k, v, is_causal=case["is_causal"], scale=case["scale"], enable_gqa=True,
               q_block=case["q_block"], k_block=case["k_block"])
    expected = torch_sdpa(q, k, v, None, case["is_causal"], case["scale"], enable_gqa=True)
    close(out, expected, np.float32)
    ref_out, _ = ref_batched(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), None,
                             case["is_causal"], case["scale"], enable_gqa=True)
    close(out, ref_out, np.float32)


def test_gqa_head_mapping_explicit(rng):
    # query head h reads K/V head h // (Hq // Hkv): heads 0,1 -> kv 0; heads 2,3 -> kv 1
    q = rng.standard_normal((2, 4, 5, 3))
    k = rng.standard_normal((2, 2, 6, 3))
    v = rng.standard_normal((2, 2, 6, 2))
    out = sdpa(q, k, v, enable_gqa=True)
    for b in range(2):
        for h in range(4):
            expected, _ = ref_attention(q[b, h], k[b, h // 2], v[b, h // 2])
            close(out[b, h], expected, np.float64)


@pytest.mark.parametrize("L,S", [(3, 7), (7, 3), (1, 5), (6, 1), (5, 5)])
def test_causal_top_left_alignment(rng, L, S):
    q = rng.standard_normal((L, 4)).astype(np.float32)
    k = rng.standard_normal((S, 4)).astype(np.float32)
    v = rng.standard_normal((S, 3)).astype(np.float32)
    out = sdpa(q, k, v, is_causal=True, q_block=2, k_block=2)
    ref_out, _ = ref_attention(q, k, v, is_causal=True)
    close(out, ref_out, np.float32)
    # row 0 sees key 0 only: its output is exactly v[0]
    np.testing.assert_allclose(out[0], v[0], rtol=1e-6)
    close(out, torch_sdpa(q, k, v, is_causal=True), np.float32)


def test_causal_combined_with_mask(rng):
    q, k = rng.standard_normal((6, 4)), rng.standard_normal((8, 4))
    v = rng.standard_normal((8, 2))
    mask = rng.random((6, 8)) < 0.6
    mask[:, 0] = True
    out = sdpa(q, k, v, attn_mask=mask, is_causal=True)
    ref_out, _ = ref_attention(q, k, v, mask & np.tril(np.ones((6, 8), dtype=bool)))
    close(out, ref_out, np.float64)


def test_explicit_scale_and_default_scale(rng):
    q, k, v = rng.standard_normal((5, 16)), rng.standard_normal((7, 16)), rng.standard_normal((7, 3))
    close(sdpa(q, k, v), ref_attention(q, k, v, scale=0.25)[0], np.float64)
    close(sdpa(q, k, v, scale=0.7), ref_attention(q, k, v, scale=0.7)[0], np.float64)
    close(sdpa(q, k, v, scale=0.0), np.broadcast_to(v.mean(axis=0), (5, 3)), np.float64)


# ------------------------------------------------------------------------------------ blocking
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-6), (np.float64, 1e-12)])
@pytest.mark.parametrize("q_block,k_block", [(1, 1), (2, 3), (3, 7), (16, 5)])
def test_blocking_invariance(rng, dtype, tol, q_block, k_block):
    q = rng.standard_normal((2, 19, 8)).astype(dtype)
    k = rng.standard_normal((2, 23, 8)).astype(dtype)
    v = rng.standard_normal((2, 23, 5)).astype(dtype)
    mask = rng.random((19, 23)) < 0.5
    for causal in (False, True):
        big, big_lse = sdpa(q, k, v, attn_mask=mask, is_causal=causal, return_lse=True)
        small, small_lse = sdpa(q, k, v, attn_mask=mask, is_causal=causal, q_block=q_block,
                                k_block=k_block, return_lse=True)
        np.testing.assert_allclose(small, big, rtol=tol, atol=tol)
        assert np.array_equal(np.isneginf(small_lse), np.isneginf(big_lse))
        fin = np.isfinite(big_lse)
        np.testing.assert_allclose(small_lse[fin], big_lse[fin], rtol=tol, atol=tol)


def test_thread_count_does_not_change_result(rng):
    q = rng.standard_normal((3, 40, 8)).astype(np.float32)
    k = rng.standard_normal((3, 50, 8)).astype(np.float32)
    v = rng.standard_normal((3, 50, 4)).astype(np.float32)
    with sa.threads(1):
        one = sdpa(q, k, v, q_block=8, k_block=16)
    with sa.threads(2):
        two = sdpa(q, k, v, q_block=8, k_block=16)
    assert np.array_equal(one, two)  # each tile is computed by one worker in a fixed order


# ---------------------------------------------------------------------------- masked rows / lse
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_row_gives_zeros_and_neg_inf_lse(rng, kind):
    q = rng.standard_normal((4, 3)).astype(np.float32)
    k = rng.standard_normal((5, 3)).astype(np.float32)
    v = rng.standard_normal((5, 2)).astype(np.float32)
    if kind == "bool":
        mask = np.ones((4, 5), dtype=bool)
        mask[1] = False
    else:
        mask = np.zeros((4, 5), dtype=np.float32)
        mask[1] = -np.inf
    for qb, kb in [(256, 1024), (1, 2)]:
        out, lse = sdpa(q, k, v, attn_mask=mask, return_lse=True, q_block=qb, k_block=kb)
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        assert np.all(out[1] == 0) and np.isneginf(lse[1])
        assert np.all(np.isfinite(lse[[0, 2, 3]]))
        close(out[[0, 2, 3]], torch_sdpa(q, k, v, mask)[[0, 2, 3]], np.float32)


def test_masked_tile_then_allowed_tile(rng):
    # the first key tiles of a row are fully masked, later ones are not: the online softmax must not NaN
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((12, 4)), rng.standard_normal((12, 2))
    mask = np.zeros((3, 12), dtype=bool)
    mask[:, 9:] = True
    out, lse = sdpa(q, k, v, attn_mask=mask, k_block=2, return_lse=True)
    ref_out, ref_lse = ref_attention(q, k, v, mask)
    close(out, ref_out, np.float64)
    close(lse, ref_lse, np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lse_equals_float64_logsumexp(rng, dtype):
    L, S, E = 9, 13, 6
    q = rng.standard_normal((2, L, E)).astype(dtype)
    k = rng.standard_normal((2, S, E)).astype(dtype)
    v = rng.standard_normal((2, S, 3)).astype(dtype)
    fmask = rng.standard_normal((L, S))
    fmask[rng.random((L, S)) < 0.3] = -np.inf
    fmask[:, 0] = 0.5
    _, lse = sdpa(q, k, v, attn_mask=fmask.astype(dtype), scale=0.3, is_causal=True, q_block=4, k_block=3,
                  return_lse=True)
    tril = np.tril(np.ones((L, S), dtype=bool))
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    scores = np.einsum("gle,gse->gls", q64, k64) * 0.3 + fmask.astype(dtype).astype(np.float64)
    scores = np.where(tril, scores, -np.inf)
    np.testing.assert_allclose(lse, logsumexp(scores, axis=-1), rtol=TOL[dtype], atol=TOL[dtype])


# ------------------------------------------------------------------------------------ dtype rules
def test_dtype_rules(rng):
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    cases = [((np.float64,) * 3, np.float64, np.float64), ((np.float32,) * 3, np.float32, np.float32),
             ((np.float16,) * 3, np.float16, np.float32),
             ((np.float16, np.float32, np.float16), np.float32, np.float32),
             ((np.float32, np.float64, np.float32), np.float64, np.float64)]
    for dts, out_dt, lse_dt in cases:
        out, lse = sdpa(q.astype(dts[0]), k.astype(dts[1]), v.astype(dts[2]), return_lse=True)
        assert out.dtype == out_dt and lse.dtype == lse_dt, dts


def test_float16_computed_in_float32(rng):
    q, k, v = (rng.standard_normal((2, 11, 8)).astype(np.float16) for _ in range(3))
    out16, lse16 = sdpa(q, k, v, is_causal=True, return_lse=True)
    out32, lse32 = sdpa(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), is_causal=True,
                        return_lse=True)
    assert np.array_equal(out16, out32.astype(np.float16))
    assert np.array_equal(lse16, lse32)
    ref_out, _ = ref_batched(q, k, v, is_causal=True)
    close(out16.astype(np.float64), ref_out, np.float16)


# ---------------------------------------------------------------------------------- seed example
SEED_X = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=np.float64)
W_KEY = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=np.float64)
W_QUERY = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=np.float64)
W_VALUE = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=np.float64)


def test_seed_example_unscaled_and_scaled():
    K, Q, V = SEED_X @ W_KEY, SEED_X @ W_QUERY, SEED_X @ W_VALUE
    assert K.tolist() == [[0, 1, 1], [4, 4, 0], [2, 3, 1]]
    assert Q.tolist() == [[1, 0, 2], [2, 2, 2], [2, 1, 3]]
    assert V.tolist() == [[1, 2, 3], [2, 8, 0], [2, 6, 3]]
    out1, lse1 = sdpa(Q, K, V, scale=1.0, return_lse=True)
    np.testing.assert_allclose(out1, [[1.936621, 6.683105, 1.595068], [1.999994, 7.963992, 0.053976],
                                      [1.999705, 7.759892, 0.358389]], atol=1e-6)
    # softmax of row 1, recovered from the lse: exp(score - lse)
    np.testing.assert_allclose(np.exp(np.array([2.0, 4.0, 4.0]) - lse1[0]), [0.063379, 0.468311, 0.468311],
                               atol=1e-6)
    out_s = sdpa(Q, K, V)
    np.testing.assert_allclose(out_s, [[1.863874, 6.319371, 1.704189], [1.999110, 7.814124, 0.273472],
                                       [1.992555, 7.479636, 0.735877]], atol=1e-6)
    close(out_s, sdpa(Q, K, V, scale=1 / np.sqrt(3)), np.float64)


# ------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("name,pos", [("query", 0), ("key", 1), ("value", 2)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_rejected(rng, name, pos, bad):
    args = [rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))]
    args[pos][1, 1] = bad
    with pytest.raises(ValueError, match=rf"{name} contains NaN or Inf \(first at index \(1, 1\)\).*check_finite=False"):
        sdpa(*args)


def test_check_finite_false_skips_the_check(rng):
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    clean = sdpa(q, k, v)
    q[0, 0] = np.nan
    out = sdpa(q, k, v, check_finite=False)
    close(out[1:], clean[1:], np.float64)  # a NaN query affects only its own row


def test_shape_errors(rng):
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    with pytest.raises(ValueError, match=r"same feature size E; got query \(4, 2\) and key \(5, 3\)"):
        sdpa(q[:, :2], k, v)
    with pytest.raises(ValueError, match=r"same length S; got key \(5, 3\) and value \(6, 2\)"):
        sdpa(q, k, rng.standard_normal((6, 2)))
    with pytest.raises(ValueError, match=r"same leading dims; got \(2,\) and \(3,\)"):
        sdpa(q, np.stack([k] * 2), np.stack([v] * 3))
    with pytest.raises(ValueError, match=r"query must have at least 2 dimensions .* got shape \(3,\)"):
        sdpa(q[0], k, v)
    with pytest.raises(ValueError, match=r"do not broadcast; for fewer K/V heads .* pass enable_gqa=True"):
        sdpa(np.stack([q] * 4), np.stack([k] * 2), np.stack([v] * 2))


@pytest.mark.parametrize("bad,match", [
    (np.int64, r"query must have dtype float16, float32 or float64; got int64"),
    (np.int32, r"query must have dtype float16, float32 or float64; got int32"),
    (np.bool_, r"query must have dtype float16, float32 or float64; got bool"),
    (np.complex128, r"query must be a real floating array; got complex dtype complex128"),
])
def test_bad_dtypes_raise_type_error(rng, bad, match):
    q = np.ones((4, 3), dtype=bad)
    with pytest.raises(TypeError, match=match):
        sdpa(q, rng.standard_normal((5, 3)), rng.standard_normal((5, 2)))
    with pytest.raises(TypeError, match=match.replace("query", "value")):
        sdpa(rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), np.ones((5, 2), dtype=bad))


def test_mask_errors(rng):
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    with pytest.raises(TypeError, match=r"attn_mask must be boolean .* or float .*got dtype int64"):
        sdpa(q, k, v, attn_mask=np.ones((4, 5), dtype=np.int64))
    with pytest.raises(ValueError, match=r"attn_mask shape \(4, 4\) does not broadcast to \(\.\.\., L, S\) = \(4, 5\)"):
        sdpa(q, k, v, attn_mask=np.ones((4, 4), dtype=bool))
    # a key mask (S,) or a scalar broadcasts to (L, S), as in torch
    keep = np.array([True, False, True, True, False])
    np.testing.assert_array_equal(sdpa(q, k, v, attn_mask=keep), sdpa(q, k, v, attn_mask=np.tile(keep, (4, 1))))
    np.testing.assert_array_equal(sdpa(q, k, v, attn_mask=np.array(True)), sdpa(q, k, v))
    with pytest.raises(ValueError, match=r"attn_mask contains NaN; use -inf"):
        sdpa(q, k, v, attn_mask=np.full((4, 5), np.nan))


def test_scalar_argument_errors(rng):
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    with pytest.raises(TypeError, match=r"is_causal must be a bool; got 1"):
        sdpa(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match=r"is_causal must be a bool; got 'yes'"):
        sdpa(q, k, v, is_causal="yes")
    with pytest.raises(ValueError, match=r"scale must be finite; got nan"):
        sdpa(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match=r"scale must be finite; got inf"):
        sdpa(q, k, v, scale=float("inf"))
    with pytest.raises(TypeError, match=r"scale must be a real number or None; got '1'"):
        sdpa(q, k, v, scale="1")
    with pytest.raises(ValueError, match=r"q_block must be >= 1; got 0"):
        sdpa(q, k, v, q_block=0)
    with pytest.raises(TypeError, match=r"k_block must be an integer >= 1; got 2.5"):
        sdpa(q, k, v, k_block=2.5)
    out = sdpa(q, k, v, is_causal=np.bool_(True))  # numpy bools are accepted
    close(out, ref_attention(q, k, v, is_causal=True)[0], np.float64)


def test_gqa_errors(rng):
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key heads \(3\)"):
        sdpa(rng.standard_normal((4, 2, 3)), rng.standard_normal((3, 5, 3)), rng.standard_normal((3, 5, 2)),
             enable_gqa=True)
    with pytest.raises(ValueError, match=r"enable_gqa needs a heads dimension at position -3"):
        sdpa(rng.standard_normal((2, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2)),
             enable_gqa=True)


# --------------------------------------------------------------------------------- memory layout
def test_non_contiguous_and_read_only_inputs(rng):
    base_q = rng.standard_normal((3, 12, 10))
    q = base_q[:, ::2, 1:9:2]                         # strided view (3, 6, 4)
    k = np.swapaxes(rng.standard_normal((3, 4, 7)), -1, -2)   # transposed view (3, 7, 4)
    v = np.asfortranarray(rng.standard_normal((3, 7, 5)))
    for x in (q, k, v):
        x.flags.writeable = False
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    mask = np.broadcast_to(rng.random((1, 7)) < 0.8, (6, 7))  # read-only broadcast view
    out = sdpa(q, k, v, attn_mask=mask, q_block=4, k_block=3)
    ref = ref_batched(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), mask)[0]
    close(out, ref, np.float64)


# --------------------------------------------------------------------------------- empty inputs


def test_zero_queries(rng):
    out2, lse2 = sdpa(np.zeros((0, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 4)),
                      return_lse=True)
    assert out2.shape == (0, 4) and lse2.shape == (0,)
    out, lse = sdpa(np.zeros((2, 0, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 4)),
                    return_lse=True)
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_keys_gives_zeros_and_neg_inf(rng, dtype):
    q = rng.standard_normal((2, 3, 4, 3)).astype(dtype)
    out, lse = sdpa(q, np.zeros((2, 1, 0, 3), dtype), np.zeros((2, 1, 0, 5), dtype), return_lse=True,
                    is_causal=True, enable_gqa=True)
    assert out.shape == (2, 3, 4, 5) and out.dtype == dtype and np.all(out == 0)
    assert lse.shape == (2, 3, 4) and np.all(np.isneginf(lse))
    out2, lse2 = sdpa(q[0, 0], np.zeros((0, 3), dtype), np.zeros((0, 5), dtype), return_lse=True)
    assert out2.shape == (4, 5) and np.all(out2 == 0) and np.all(np.isneginf(lse2))


# --------------------------------------------------------------------------------------- memory
def test_memory_stays_far_below_the_score_matrix():
    rng = np.random.default_rng(7)
    n, d = 8192, 64
    q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = sdpa(q, k, v)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # observed peak ~7 MiB (output 2 MiB + a few score tiles); the full score matrix would be 256 MiB
    assert peak < 64 * 2**20, peak
    assert out.shape == (n, d) and np.isfinite(out).all()
    # spot-check a few rows against the float64 oracle
    rows = np.array([0, 4097, n - 1])
    ref, _ = ref_attention(q[rows], k, v)
    close(out[rows], ref, np.float32)


# ------------------------------------------------------------------------ SDPA-compatible signature
def test_positional_order_matches_torch_sdpa(rng):
    # (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa): torch's order (torch makes
    # scale and enable_gqa keyword-only; here they may also be given by position).
    q, k, v = (rng.standard_normal((2, 4, 6, 8)).astype(np.float32) for _ in range(3))
    causal = sdpa(q, k, v, is_causal=True)
    np.testing.assert_array_equal(sdpa(q, k, v, None, 0.0, True), causal)
    np.testing.assert_array_equal(sdpa(q, k, v, None, 0.0, False, 0.5), sdpa(q, k, v, scale=0.5))
    kg, vg = k[:, :2], v[:, :2]
    np.testing.assert_array_equal(sdpa(q, kg, vg, None, 0.0, True, None, True),
                                  sdpa(q, kg, vg, is_causal=True, enable_gqa=True))
    torch = pytest.importorskip("torch")
    tq, tk, tv, tkg, tvg = (torch.from_numpy(x) for x in (q, k, v, np.ascontiguousarray(kg),
                                                          np.ascontiguousarray(vg)))
    F = torch.nn.functional
    mask = rng.random((6, 6)) < 0.7
    mask[:, 0] = True
    for ours, theirs in [
        (sdpa(q, k, v, None, 0.0, True), F.scaled_dot_product_attention(tq, tk, tv, None, 0.0, True)),
        (sdpa(q, k, v, mask, 0.0, False, 0.3),
         F.scaled_dot_product_attention(tq, tk, tv, torch.from_numpy(mask), 0.0, False, scale=0.3)),
        (sdpa(q, kg, vg, None, 0.0, True, None, True),
         F.scaled_dot_product_attention(tq, tkg, tvg, None, 0.0, True, scale=None, enable_gqa=True)),
    ]:
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-5)


def test_dropout_is_refused(rng):
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    with pytest.raises(ValueError, match=r"dropout_p=0.1: dropout is not supported in this reference"):
        sdpa(q, k, v, None, 0.1)
    with pytest.raises(ValueError, match="dropout is not supported"):
        sdpa(q, k, v, dropout_p=0.5)
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        sdpa(q, k, v, None, True)  # is_causal passed in dropout_p's slot
    np.testing.assert_array_equal(sdpa(q, k, v, None, 0), sdpa(q, k, v))
    with pytest.raises(TypeError):
        sdpa(q, k, v, None, 0.0, False, None, False, True)  # extras are keyword-only


def test_scale_that_overflows_the_queries_alone_is_not_an_overflow():
    # q ~ 1e200 times scale 1e200 leaves float64, but q.k * scale does not (k ~ 1e-300): every score is
    # finite (largest ~1e100), so the answer is torch's / the numpy formula's, not an overflow error
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4)) * 1e200
    k = rng.standard_normal((5, 4)) * 1e-300
    v = rng.standard_normal((5, 2))
    s = (q @ k.T) * 1e200
    w = np.exp(s - s.max(axis=1, keepdims=True))
    want = (w / w.sum(axis=1, keepdims=True)) @ v
    np.testing.assert_allclose(sa.scaled_dot_product_attention(q, k, v, scale=1e200), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sa.scaled_dot_product_attention(q, k, v, scale=-1e200),
                               (lambda z: (z / z.sum(axis=1, keepdims=True)) @ v)(np.exp(-s - (-s).max(axis=1, keepdims=True))),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("qmag, kmag, scale", [(1e300, 1e-300, 1e20), (1e200, 1e-300, 1e200)])
def test_scale_applied_to_the_scores_when_the_queries_cannot_take_it(qmag, kmag, scale):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4)) * qmag
    k = rng.standard_normal((5, 4)) * kmag
    v = rng.standard_normal((5, 2))
    s = (q @ k.T) * scale
    w = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(sa.scaled_dot_product_attention(q, k, v, scale=scale),
                               (w / w.sum(axis=1, keepdims=True)) @ v, rtol=1e-12, atol=1e-14)
