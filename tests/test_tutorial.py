"""sparseattn.tutorial: the worked example, the eight-step mode, heads, multi-head, self/cross."""

from __future__ import annotations

import doctest
import importlib
import importlib.metadata

import numpy as np
import pytest

import sparseattn as sa
from sparseattn.tutorial import AttentionHead, MultiHeadAttention, attention_steps, seed_example

# The worked example's outputs, worked out by hand independently of this code (the numbers are also in
# sparseattn/tutorial/example.py's docstring).  K, Q, V, the scores and softmax(row 1) are checked below.
OUT_SCALE_1 = np.array([[1.936621, 6.683105, 1.595068],
                        [1.999994, 7.963992, 0.053976],
                        [1.999705, 7.759892, 0.358389]])
OUT_SCALE_DEFAULT = np.array([[1.863874, 6.319371, 1.704189],
                              [1.999110, 7.814124, 0.273472],
                              [1.992555, 7.479636, 0.735877]])


def _example():
    e = seed_example()
    return e["X"], e["W_query"], e["W_key"], e["W_value"]


def test_seed_example_intermediates_match_the_tutorial():
    steps = attention_steps(*_example(), scale=1.0)
    np.testing.assert_array_equal(steps.keys, [[0, 1, 1], [4, 4, 0], [2, 3, 1]])
    np.testing.assert_array_equal(steps.queries, [[1, 0, 2], [2, 2, 2], [2, 1, 3]])
    np.testing.assert_array_equal(steps.values, [[1, 2, 3], [2, 8, 0], [2, 6, 3]])
    np.testing.assert_array_equal(steps.scores, [[2, 4, 4], [4, 16, 12], [4, 12, 10]])
    np.testing.assert_allclose(steps.weights[0], [0.063379, 0.468311, 0.468311], atol=1e-6)
    np.testing.assert_allclose(steps.weights.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(steps.weighted_values.sum(axis=1), steps.outputs, atol=1e-12)
    np.testing.assert_allclose(steps.outputs, OUT_SCALE_1, atol=1e-6)


@pytest.mark.parametrize(("scale", "expected"), [(1.0, OUT_SCALE_1), (None, OUT_SCALE_DEFAULT)])
def test_seed_example_through_every_entry_point(scale, expected):
    X, Wq, Wk, Wv = _example()
    head = AttentionHead(Wq, Wk, Wv)
    np.testing.assert_allclose(head(X, scale=scale), expected, atol=1e-6)
    np.testing.assert_allclose(head(X, scale=scale, sparse=sa.SparsePattern.full(3, 3)), expected, atol=1e-6)
    q, k, v = head.project(X)
    np.testing.assert_allclose(sa.scaled_dot_product_attention(q, k, v, scale=scale), expected, atol=1e-6)
    steps = attention_steps(X, Wq, Wk, Wv, scale=scale, pattern=sa.SparsePattern.full(3, 3))
    np.testing.assert_allclose(steps.outputs, expected, atol=1e-6)


def test_tutorial_rounded_weights_give_its_rounded_output():
    # The tutorial rounds softmax(row 1) to [0, .5, .5] and reports output1 = [2.0, 7.0, 1.5].
    steps = attention_steps(*_example(), scale=1.0)
    np.testing.assert_allclose(np.array([0.0, 0.5, 0.5]) @ steps.values, [2.0, 7.0, 1.5])


def test_steps_equal_the_dense_reference_causal_and_cross(rng):
    x, ctx = rng.standard_normal((6, 4)), rng.standard_normal((9, 5))
    Wq, Wv = rng.standard_normal((4, 3)), rng.standard_normal((5, 2))
    for context, is_causal in ((None, True), (ctx, False), (ctx, True)):
        d_ctx = x.shape[1] if context is None else ctx.shape[1]
        Wk, Wv = rng.standard_normal((d_ctx, 3)), rng.standard_normal((d_ctx, 2))
        steps = attention_steps(x, Wq, Wk, Wv, context=context, is_causal=is_causal)
        ref = sa.scaled_dot_product_attention(steps.queries, steps.keys, steps.values, is_causal=is_causal)
        np.testing.assert_allclose(steps.outputs, ref, atol=1e-12)
        np.testing.assert_allclose(steps.weights.sum(axis=1), 1.0, atol=1e-12)
        if is_causal:
            L, S = steps.scores.shape
            future = np.arange(S)[None, :] > np.arange(L)[:, None]
            assert np.isneginf(steps.scores[future]).all() and (steps.weights[future] == 0).all()


def test_steps_compute_float16_and_float32_in_float32(rng):
    X, Wq, Wk, Wv = _example()
    for dtype in (np.float16, np.float32):
        steps = attention_steps(X.astype(dtype), Wq.astype(dtype), Wk.astype(dtype), Wv.astype(dtype),
                                scale=1.0)
        assert steps.outputs.dtype == steps.weights.dtype == np.float32
        np.testing.assert_allclose(steps.outputs, OUT_SCALE_1, atol=1e-5)
    with pytest.raises(TypeError, match="pattern must be a SparsePattern"):
        attention_steps(X, Wq, Wk, Wv, pattern=np.ones((3, 3), bool))


def test_tutorial_is_a_submodule_not_top_level():
    assert sa.tutorial.MultiHeadAttention is MultiHeadAttention
    for name in sa.tutorial.__all__:
        assert not hasattr(sa, name), name
        assert name not in sa.__all__
    assert "tutorial" in sa.__all__


def test_version_comes_from_the_package_metadata():
    assert sa.__version__ == importlib.metadata.version("sparseattn")


@pytest.mark.parametrize("module", ["sparseattn", "sparseattn.tutorial", "sparseattn.tutorial.example",
                                    "sparseattn.tutorial.steps", "sparseattn.tutorial.layers"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_sparse_steps_zero_the_unselected_keys():
    X, Wq, Wk, Wv = _example()
    pattern = sa.SparsePattern.from_padded(np.array([[1, 2], [0, -1], [2, -1]]), 3)
    steps = attention_steps(X, Wq, Wk, Wv, scale=1.0, pattern=pattern)
    assert steps.weights[0, 0] == 0 and np.isneginf(steps.scores[0, 0])
    np.testing.assert_allclose(steps.weights[0, 1:], [0.5, 0.5], atol=1e-12)
    np.testing.assert_allclose(steps.outputs[1], steps.values[0], atol=1e-12)
    np.testing.assert_allclose(steps.outputs[2], steps.values[2], atol=1e-12)


def test_cross_attention_uses_the_context_for_keys_and_values(rng):
    x = rng.standard_normal((5, 4))
    ctx = rng.standard_normal((9, 6))
    Wq, Wk, Wv = rng.standard_normal((4, 3)), rng.standard_normal((6, 3)), rng.standard_normal((6, 2))
    out = AttentionHead(Wq, Wk, Wv)(x, ctx)
    q, k, v = x @ Wq, ctx @ Wk, ctx @ Wv
    s = q @ k.T / np.sqrt(3)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(out, p @ v, atol=1e-12)
    assert out.shape == (5, 2)


def test_multihead_equals_concatenated_heads_then_projection(rng):
    mha = MultiHeadAttention.random(12, 3, seed=1, dtype=np.float64)
    x = rng.standard_normal((2, 7, 12))
    out = mha(x, is_causal=True)
    heads = [h(x, is_causal=True) for h in mha.heads]
    expected = np.concatenate(heads, axis=-1) @ mha.W_out
    np.testing.assert_allclose(out, expected, atol=1e-12)
    assert out.shape == (2, 7, 12)


def test_multihead_sparse_full_pattern_equals_dense(rng):
    mha = MultiHeadAttention.random(16, 4, seed=2, dtype=np.float64)
    x = rng.standard_normal((10, 16))
    ctx = rng.standard_normal((13, 16))
    dense = mha(x, ctx)
    sparse = mha(x, ctx, sparse=sa.SparsePattern.full(10, 13))
    np.testing.assert_allclose(sparse, dense, atol=1e-12)


def test_layer_errors_name_the_argument(rng):
    with pytest.raises(ValueError, match="W_query and W_key must produce the same dk"):
        AttentionHead(np.ones((4, 3)), np.ones((4, 2)), np.ones((4, 2)))
    head = AttentionHead(np.ones((4, 3)), np.ones((4, 3)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="x has 5 features; W_query expects 4"):
        head(np.ones((2, 5)))
    with pytest.raises(ValueError, match="d_model \\(10\\) must be divisible by num_heads \\(3\\)"):
        MultiHeadAttention.random(10, 3)
    with pytest.raises(ValueError, match="same number of heads"):
        MultiHeadAttention(np.ones((2, 4, 3)), np.ones((3, 4, 3)), np.ones((2, 4, 3)))
    with pytest.raises(TypeError, match="inputs must have dtype float16, float32 or float64"):
        attention_steps(np.ones((2, 4), dtype=int), *_example()[1:])


@pytest.mark.parametrize("scale", [1e308, -1e308])
def test_steps_refuse_overflowing_scores_instead_of_nan(scale):
    # scores of +-1e308 * q.k leave float64: refused as the dense reference refuses them (they gave NaN /
    # all-zero weights)
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    eye = np.eye(2)
    with pytest.raises(ValueError, match=r"step 4: attention scores overflow float64"):
        attention_steps(x, eye, eye, eye, scale=scale)


def test_steps_refuse_overflowing_projections():
    x = np.full((2, 2), 3e38, np.float32)
    with pytest.raises(ValueError, match=r"step 3: the queries \(inputs @ W_query\) overflow float32"):
        attention_steps(x, np.full((2, 2), 2.0, np.float32), np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32))


@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6)])
def test_multi_head_attention_on_an_empty_sequence(shape):
    mha = MultiHeadAttention.random(6, 3)
    assert mha(np.zeros(shape, np.float32)).shape == shape
