"""The tail estimate (``sparse_attention(..., tail=...)``) against a float64 dense oracle.

Oracle: numpy float64 softmax attention over every visible key (``dense64`` below).  The estimator is
exact when the sample is the whole tail, unbiased for the softmax denominator (checked over many seeds
with a 5-standard-error bound), and its draws are distinct, unselected and visible.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn.attention.tail import Tail


def dense64(q, k, v, scale, qpos=None, kpos=None, causal=False):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ k.T * scale
    if causal:
        qpos = np.arange(q.shape[0]) if qpos is None else qpos
        kpos = np.arange(k.shape[0]) if kpos is None else kpos
        s = np.where(kpos[None, :] <= qpos[:, None], s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    lse = m[:, 0] + np.log(w.sum(axis=1))
    return (w @ v) / w.sum(axis=1, keepdims=True), lse


def data(L, S, E=16, seed=0, spread=0.3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, E)) * spread, rng.standard_normal((S, E)) * spread,
            rng.standard_normal((S, 8)))


@pytest.mark.parametrize("causal", [False, True])
def test_whole_tail_is_exact(causal):
    q, k, v = data(40, 60)
    out, lse = sa.sparse_attention(q, k, v, "topk", k=5, is_causal=causal, tail=1000, return_lse=True)
    ref, ref_lse = dense64(q, k, v, 0.25, causal=causal)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


def test_whole_tail_exact_with_cache_positions_and_unsorted_keys():
    q, k, v = data(6, 50, seed=1)
    kpos = np.random.default_rng(3).permutation(50).astype(np.int64)
    qpos = np.arange(44, 50, dtype=np.int64)
    out = sa.sparse_attention(q, k, v, "topk", k=3, is_causal=True, query_positions=qpos, key_positions=kpos,
                              tail=Tail(100, seed=7))
    ref, _ = dense64(q, k, v, 0.25, qpos, kpos, causal=True)
    np.testing.assert_allclose(out, ref, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 12), S=st.integers(1, 40), k=st.integers(1, 8), causal=st.booleans(),
       f32=st.booleans(), seed=st.integers(0, 2**31))
def test_property_sample_covering_tail_equals_dense(L, S, k, causal, f32, seed):
    q, k_, v = data(L, S, E=4, seed=seed, spread=1.0)
    dt = np.float32 if f32 else np.float64
    out, lse = sa.sparse_attention(q.astype(dt), k_.astype(dt), v.astype(dt), "topk", k=k, is_causal=causal,
                                   tail=Tail(S, seed=seed), return_lse=True)
    ref, ref_lse = dense64(q.astype(dt), k_.astype(dt), v.astype(dt), 0.5, causal=causal)
    tol = 2e-5 if f32 else 1e-12
    np.testing.assert_allclose(out, ref, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, atol=tol)


def test_draws_are_distinct_unselected_visible_and_counted():
    q, k, v = data(30, 200, seed=2)
    qpos = np.arange(170, 200, dtype=np.int64)
    res = sa.sparse_attention_result(q, k, v, "topk", k=16, is_causal=True, query_positions=qpos, tail=24)
    (pat,), (tp,) = res.patterns, res.tail_patterns
    for i in range(30):
        sel, drawn = set(pat.row(i).tolist()), tp.row(i)
        visible = qpos[i] + 1
        assert len(set(drawn.tolist())) == len(drawn) == min(24, visible - len(sel))
        assert not sel & set(drawn.tolist())
        assert (drawn <= qpos[i]).all() and (drawn >= 0).all()
    assert "tail" in res.timings


def test_denominator_is_unbiased_over_seeds():
    """E[exp(lse)] over seeds equals the true row sum exp(lse_dense) (Horvitz-Thompson)."""
    q, k, v = data(3, 400, seed=4, spread=0.5)
    _, ref_lse = dense64(q, k, v, 0.25)
    est = np.array([np.exp(sa.sparse_attention(q, k, v, "topk", k=8, tail=Tail(10, seed=s),
                                               return_lse=True)[1]) for s in range(300)])
    mean, se = est.mean(axis=0), est.std(axis=0, ddof=1) / np.sqrt(est.shape[0])
    assert (np.abs(mean - np.exp(ref_lse)) <= 5 * se + 1e-12).all(), (mean, np.exp(ref_lse), se)


def test_same_seed_same_answer_any_thread_count_and_seed_changes_it():
    q, k, v = data(64, 500, seed=5)
    with sa.threads(1):
        a = sa.sparse_attention(q, k, v, "topk", k=8, tail=Tail(16, seed=3))
    with sa.threads(2):
        b = sa.sparse_attention(q, k, v, "topk", k=8, tail=Tail(16, seed=3))
    c = sa.sparse_attention(q, k, v, "topk", k=8, tail=Tail(16, seed=4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_error_shrinks_as_the_sample_grows():
    """Consistency: flat attention over 2,000 keys; mean error over 5 seeds falls with the sample size."""
    q, k, v = data(32, 2000, E=16, seed=6, spread=0.3)
    v = v + 1.0  # values with a common component, as real value vectors have
    ref, _ = dense64(q, k, v, 0.25)

    def err(m):
        outs = [sa.sparse_attention(q, k, v, "topk", k=16, tail=Tail(m, seed=s)) for s in range(5)]
        return float(np.mean([np.linalg.norm(o - ref) / np.linalg.norm(ref) for o in outs]))

    e16, e128, e1024 = err(16), err(128), err(1024)
    assert e1024 < e128 < e16, (e16, e128, e1024)
    assert e1024 < 0.5 * e16


def test_multi_head_gqa_and_explicit_patterns_per_group():
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 4, 20, 8)), rng.standard_normal((2, 2, 30, 8)), rng.standard_normal((2, 2, 30, 8))
    pats = [sa.SparsePattern.window(20, 30, 3 + g) for g in range(8)]
    out = sa.sparse_attention(q, k, v, pats, enable_gqa=True, tail=100)
    ref = sa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    np.testing.assert_allclose(out, ref, atol=1e-12)


def test_bias_is_applied_to_the_sampled_keys():
    q, k, v = data(10, 25, seed=9)
    bias = np.random.default_rng(1).standard_normal((10, 25))
    out = sa.sparse_attention(q, k, v, "topk", k=2, bias=bias, tail=25)
    ref = sa.scaled_dot_product_attention(q, k, v, bias)
    np.testing.assert_allclose(out, ref, atol=1e-12)


def test_empty_inputs():
    q, k, v = data(5, 0)
    out, lse = sa.sparse_attention(q, k, v, sa.SparsePattern.full(5, 0), tail=4, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()
    q, k, v = data(0, 10)
    assert sa.sparse_attention(q, k, v, "topk", k=2, tail=4).shape == (0, 8)


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "8", Tail])
def test_bad_tail_values_name_the_argument(bad):
    q, k, v = data(4, 10)
    with pytest.raises((ValueError, TypeError), match="tail"):
        sa.sparse_attention(q, k, v, "topk", k=2, tail=bad)


def test_bad_seed_names_it():
    with pytest.raises(ValueError, match="seed"):
        Tail(4, seed=-1)


def test_selector_that_attends_is_refused_with_the_alternative():
    q, k, v = data(8, 64)
    with pytest.raises(ValueError, match="estimate="):
        sa.sparse_attention(q, k, v, "cluster:mode=block", tail=8)


def test_shrink_matches_a_hand_computed_oracle():
    """out = (D_P o_P + λ D̂_U ȳ_U) / (D_P + λ D̂_U), λ = ESS / (ESS + c), from the keys the result reports."""
    q, k, v = data(6, 40, seed=11, spread=1.0)
    c = 3.0
    res = sa.sparse_attention_result(q, k, v, "topk", k=4, tail=Tail(5, seed=2, shrink=c))
    s = q @ k.T * 0.25
    for i in range(6):
        sel, drawn = res.patterns[0].row(i), res.tail_patterns[0].row(i)
        u = 40 - sel.size
        a_p, a_u = np.exp(s[i, sel]), np.exp(s[i, drawn])
        ess = a_u.sum() ** 2 / (a_u ** 2).sum()
        lam = ess / (ess + c)
        num = a_p @ v[sel] + lam * (u / drawn.size) * (a_u @ v[drawn])
        den = a_p.sum() + lam * (u / drawn.size) * a_u.sum()
        np.testing.assert_allclose(res.output[i], num / den, rtol=1e-10)


def test_shrink_keeps_a_whole_tail_exact_and_bad_shrink_is_named():
    q, k, v = data(5, 30)
    out = sa.sparse_attention(q, k, v, "topk", k=3, tail=Tail(100, shrink=10.0))
    np.testing.assert_allclose(out, dense64(q, k, v, 0.25)[0], atol=1e-12)
    for bad in (-1.0, float("inf"), "x"):
        with pytest.raises(ValueError, match="shrink"):
            Tail(4, shrink=bad)


def test_keys_read_are_reported_for_patterns_tails_and_block_mode():
    q, k, v = data(16, 300, seed=12)
    res = sa.sparse_attention_result(q, k, v, "topk", k=8, tail=20, is_causal=True)
    want = res.patterns[0].nnz_per_row + res.tail_patterns[0].nnz_per_row
    np.testing.assert_array_equal(res.keys_read, want)
    qh, kh, vh = (np.stack([x, x]) for x in (q, k, v))  # (2, L, E): one row of counts per head
    res = sa.sparse_attention_result(qh, kh, vh, "cluster:mode=block,n_clusters=4,n_probe=1")
    assert res.keys_read.shape == (2, 16) and (res.keys_read > 0).all() and (res.keys_read < 300).all()
    sel = sa.get_selector("cluster:mode=block,n_clusters=4,n_probe=1").build(k)
    sel.attend(q, v)
    np.testing.assert_array_equal(res.keys_read[0], sel.last_keys_read_)
