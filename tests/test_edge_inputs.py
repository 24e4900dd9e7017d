"""Edge inputs of the attention entry points: zero (batch, head) groups, and +inf in masks and biases.

Oracles: the shapes dense attention returns for the same inputs; a ValueError naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparseattn as sa
import sparseattn.torch as sat
from sparseattn.pattern import SparsePattern

SPECS = ["topk", "window:width=2", "cluster:mode=topk", "cluster:mode=block", "faiss-flat"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("lead", [(0,), (0, 2), (2, 0)])
def test_zero_groups_give_the_empty_output(spec, lead):
    """Every selector returns what dense attention returns for zero groups: empty output and lse."""
    q = np.zeros(lead + (4, 8), np.float32)
    k = np.zeros(lead + (6, 8), np.float32)
    v = np.zeros(lead + (6, 3), np.float32)
    ref, ref_lse = sa.scaled_dot_product_attention(q, k, v, return_lse=True)
    out, lse = sa.sparse_attention(q, k, v, spec, k=2, return_lse=True)
    assert out.shape == ref.shape == lead + (4, 3) and out.dtype == ref.dtype
    assert lse.shape == ref_lse.shape == lead + (4,)
    res = sa.sparse_attention_result(q, k, v, spec, k=2)
    assert res.keys_read.shape == lead + (4,)


@pytest.mark.parametrize("spec", ["topk", "window:width=2"])
def test_zero_groups_with_a_tail(spec):
    q = np.zeros((0, 4, 8), np.float32)
    k = np.zeros((0, 6, 8), np.float32)
    v = np.zeros((0, 6, 3), np.float32)
    assert sa.sparse_attention(q, k, v, spec, k=2, tail=3).shape == (0, 4, 3)


def test_zero_groups_with_explicit_patterns():
    q = np.zeros((0, 4, 8), np.float32)
    k = np.zeros((0, 6, 8), np.float32)
    v = np.zeros((0, 6, 3), np.float32)
    p = SparsePattern.from_padded(np.array([[0, 1]] * 4), 6)
    assert sa.sparse_attention(q, k, v, p).shape == (0, 4, 3)
    assert sa.sparse_attention(q, k, v, []).shape == (0, 4, 3)  # one pattern per group: none


def _qkv(rng):
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8)))


def test_plus_inf_in_a_float_mask_is_named_not_an_overflow(rng):
    q, k, v = _qkv(rng)
    m = np.zeros((4, 6), np.float32)
    m[1, 2] = np.inf
    tq, tk, tv, tm = (torch.from_numpy(x) for x in (q, k, v, m))
    calls = [lambda: sat.sparse_attention(tq, tk, tv, "topk", k=6, attn_mask=tm),
             lambda: sat.scaled_dot_product_attention(tq, tk, tv, tm),
             lambda: sa.scaled_dot_product_attention(q, k, v, attn_mask=m)]
    for call in calls:
        with pytest.raises(ValueError, match=r"attn_mask contains \+inf \(first at index \(1, 2\)\)"):
            call()
    with pytest.raises(ValueError, match=r"bias contains \+inf \(first at index \(1, 2\)\)"):
        sa.sparse_attention(q, k, v, "topk", k=6, bias=m)


def test_minus_inf_and_finite_masks_still_work(rng):
    """-inf masks a pair out (the legal use), finite values add: torch SDPA is the oracle."""
    q, k, v = _qkv(rng)
    m = rng.standard_normal((4, 6)).astype(np.float32)
    m[1, 2] = -np.inf
    tq, tk, tv, tm = (torch.from_numpy(x) for x in (q, k, v, m))
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, tm)
    torch.testing.assert_close(sat.sparse_attention(tq, tk, tv, "topk", k=6, attn_mask=tm), ref, atol=2e-6,
                               rtol=1e-5)
    torch.testing.assert_close(sat.scaled_dot_product_attention(tq, tk, tv, tm), ref, atol=2e-6, rtol=1e-5)
