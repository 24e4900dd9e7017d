"""sparseattn.torch: torch tensors in and out, checked against torch SDPA and a brute-force top-k oracle.

Oracles: ``torch.nn.functional.scaled_dot_product_attention`` in float64 (full selection must match it to
1e-10), and a float64 brute force that keeps, per query, the k allowed keys of largest q.k and takes the
softmax over them (sparse selection under masks).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
sat = pytest.importorskip("sparseattn.torch")

import sparseattn as sa  # noqa: E402

F = torch.nn.functional
ATOL64 = 1e-10


@pytest.fixture(autouse=True)
def _serial():
    with sa.threads(1):
        yield


def make(shape_q, shape_kv, L, S, E=8, Ev=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape_q, L, E, generator=g, dtype=dtype),
            torch.randn(*shape_kv, S, E, generator=g, dtype=dtype),
            torch.randn(*shape_kv, S, Ev, generator=g, dtype=dtype))


def topk_oracle(q, k, v, allowed, n_keys, scale=None, additive=None):
    """Float64 brute force: per query the n_keys allowed keys of largest q.k, softmax(scores + additive).

    q (B, H, L, E), k/v (B, H, S, *), allowed bool broadcastable to (B, H, L, S).  Rows with no allowed
    key give zeros.
    """
    q, k, v = q.double(), k.double(), v.double()
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    dots = q @ k.transpose(-1, -2)
    allowed = allowed.expand(dots.shape)
    ranked = torch.where(allowed, dots, torch.tensor(-torch.inf, dtype=torch.float64))
    keep = torch.zeros_like(allowed)
    top = ranked.topk(min(n_keys, ranked.shape[-1]), dim=-1).indices
    keep.scatter_(-1, top, True)
    keep &= allowed
    scores = dots * sc + (0 if additive is None else additive.double())
    scores = torch.where(keep, scores, torch.tensor(-torch.inf, dtype=torch.float64))
    w = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return w @ v


# ------------------------------------------------------------------------ full selection == torch SDPA
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shapes", [((2, 3), (2, 3)), ((3,), (3,)), ((2, 3), (1, 3)), ((), ())])
def test_full_topk_matches_torch_sdpa(is_causal, shapes):
    q, k, v = make(*shapes, L=33, S=33, seed=1)
    out = sat.sparse_attention(q, k, v, "topk", k=64, is_causal=is_causal)
    qq, kk, vv = (x.expand(*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), *x.shape[-2:]) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qq.reshape(-1, 1, *q.shape[-2:]), kk.reshape(-1, 1, *k.shape[-2:]),
                                         vv.reshape(-1, 1, *v.shape[-2:]), is_causal=is_causal)
    assert out.dtype == torch.float64 and isinstance(out, torch.Tensor)
    torch.testing.assert_close(out.reshape(ref.shape), ref, atol=ATOL64, rtol=0)


def test_full_topk_gqa_scale_and_lse_match_torch():
    q, k, v = make((2, 4), (2, 2), L=20, S=24, seed=2)
    out, lse = sat.sparse_attention(q, k, v, "topk", k=24, scale=0.3, enable_gqa=True, return_lse=True)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=ATOL64, rtol=0)
    kr = k.repeat_interleave(2, dim=1)
    ref_lse = torch.logsumexp(q @ kr.transpose(-1, -2) * 0.3, dim=-1)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref_lse, atol=ATOL64, rtol=0)


def test_scaled_dot_product_attention_wrapper_matches_torch():
    q, k, v = make((2, 3), (2, 3), L=17, S=21, seed=3)
    g = torch.Generator().manual_seed(9)
    fmask = torch.randn(2, 1, 17, 21, generator=g, dtype=torch.float64)
    bmask = torch.rand(2, 3, 17, 21, generator=g) < 0.7
    bmask[..., 0] = True
    for mask in (None, fmask, bmask):
        out = sat.scaled_dot_product_attention(q, k, v, mask)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, mask), atol=ATOL64, rtol=0)
    out, lse = sat.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=ATOL64, rtol=0)
    causal = torch.ones(17, 21, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~causal, -torch.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=ATOL64, rtol=0)


# ----------------------------------------------------------------------------------------- masks
def _padding_mask(lengths, S, left=False):
    pos = torch.arange(S)
    rows = [(pos >= S - n) if left else (pos < n) for n in lengths]
    return torch.stack(rows)[:, None, None, :]  # (B, 1, 1, S)


@pytest.mark.parametrize("left", [False, True])
def test_padding_mask_full_selection_matches_sdpa(left):
    q, k, v = make((3, 2), (3, 2), L=30, S=30, seed=4)
    mask = _padding_mask([30, 17, 5], 30, left=left)
    out = sat.sparse_attention(q, k, v, "topk", k=30, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=ATOL64, rtol=0)


def test_padded_keys_are_excluded_before_selection():
    """With k smaller than the valid length, each query keeps its k best *valid* keys (not k minus pads)."""
    q, k, v = make((3, 2), (3, 2), L=40, S=40, seed=5)
    k[1, :, 25:] *= 20.0  # padded keys with large norms: top-k over all keys would pick them first
    mask = _padding_mask([40, 25, 9], 40)
    out = sat.sparse_attention(q, k, v, "topk", k=8, attn_mask=mask)
    torch.testing.assert_close(out, topk_oracle(q, k, v, mask, 8), atol=ATOL64, rtol=0)


@pytest.mark.parametrize("left", [False, True])
def test_causal_with_padding_keeps_k_keys_per_query(left):
    """Causal + padding: the selection is causal over the valid keys (kind 3 in the module docstring)."""
    q, k, v = make((2, 2), (2, 2), L=36, S=36, seed=6)
    pad = _padding_mask([36, 20], 36, left=left)
    causal = torch.ones(36, 36, dtype=torch.bool).tril()
    mask = pad & causal
    expected = topk_oracle(q, k, v, mask, 6)
    for kwargs in ({"attn_mask": mask}, {"attn_mask": pad, "is_causal": True}):
        out = sat.sparse_attention(q, k, v, "topk", k=6, **kwargs)
        torch.testing.assert_close(out, expected, atol=ATOL64, rtol=0)


def test_float_mask_additive_values_and_finfo_min():
    q, k, v = make((2, 2), (2, 2), L=12, S=16, seed=7)
    g = torch.Generator().manual_seed(1)
    add = torch.randn(2, 1, 12, 16, generator=g, dtype=torch.float64)
    mask = add.clone()
    mask[1, ..., 10:] = torch.finfo(torch.float64).min  # transformers' eager padding value
    mask[0, ..., 3] = -torch.inf
    out = sat.sparse_attention(q, k, v, "topk", k=16, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=ATOL64, rtol=0)
    allowed = mask > -1e300
    sparse = sat.sparse_attention(q, k, v, "topk", k=5, attn_mask=mask)
    torch.testing.assert_close(sparse, topk_oracle(q, k, v, allowed, 5, additive=torch.where(allowed, add, 0)),
                               atol=ATOL64, rtol=0)


def test_arbitrary_mask_falls_back_to_bias_after_selection():
    """A per-query pattern that is neither padding nor causal: forbidden pairs are dropped after selection."""
    q, k, v = make((1, 2), (1, 2), L=10, S=10, seed=8)
    mask = torch.ones(10, 10, dtype=torch.bool)
    mask[::2, 1::2] = False  # even queries see even keys only
    out = sat.sparse_attention(q, k, v, "topk", k=10, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=ATOL64, rtol=0)
    sc = q.shape[-1] ** -0.5
    dots = q @ k.transpose(-1, -2)
    sel = torch.zeros_like(dots, dtype=torch.bool).scatter_(-1, dots.topk(4, -1).indices, True)  # mask-blind
    keep = sel & mask
    expected = torch.softmax((dots * sc).masked_fill(~keep, -torch.inf), -1) @ v
    out4 = sat.sparse_attention(q, k, v, "topk", k=4, attn_mask=mask)
    torch.testing.assert_close(out4, expected, atol=ATOL64, rtol=0)


def test_fully_masked_rows_give_zeros_and_neg_inf_lse():
    q, k, v = make((2, 1), (2, 1), L=6, S=6, seed=9)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1] = False  # batch element 1: nothing may be attended
    mask[0, 0, 2] = False  # one row of batch element 0
    out, lse = sat.sparse_attention(q, k, v, "topk", k=3, attn_mask=mask, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert torch.equal(out[0, 0, 2], torch.zeros(8, dtype=torch.float64)) and torch.isneginf(lse[0, 0, 2])
    assert torch.isfinite(lse[0, 0, [0, 1, 3, 4, 5]]).all()


def test_window_selector_keeps_original_positions_under_left_padding():
    """Left padding: kept keys retain their positions, so a window stays centred on the query's position."""
    q, k, v = make((1, 1), (1, 1), L=24, S=24, seed=10)
    mask = _padding_mask([14], 24, left=True)  # keys 10..23 valid
    out = sat.sparse_attention(q, k, v, "window:width=5", k=5, attn_mask=mask)
    pos = torch.arange(24)
    band = (pos[None, :] - pos[:, None]).abs() <= 2
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=band & mask)
    torch.testing.assert_close(out, expected, atol=ATOL64, rtol=0)


def test_block_cluster_selector_takes_padding_masks_only():
    q, k, v = make((2, 2), (2, 2), L=64, S=64, E=16, Ev=16, dtype=torch.float32, seed=11)
    mask = _padding_mask([64, 40], 64)
    out = sat.sparse_attention(q, k, v, "cluster:mode=block", k=64, attn_mask=mask)
    assert out.shape == (2, 2, 64, 16) and torch.isfinite(out).all()
    # batch element 1 never attends keys >= 40: its output is a convex combination of v[1, :, :40]
    lo, hi = v[1, :, :40].min(1).values, v[1, :, :40].max(1).values
    assert ((out[1] >= lo[:, None] - 1e-5) & (out[1] <= hi[:, None] + 1e-5)).all()
    weird = torch.ones(64, 64, dtype=torch.bool)
    weird[::2, 1::2] = False
    with pytest.raises(ValueError, match="attn_mask"):
        sat.sparse_attention(q, k, v, "cluster:mode=block", k=64, attn_mask=weird)


@settings(max_examples=25)
@given(B=st.integers(1, 3), H=st.integers(1, 3), L=st.integers(1, 20), S=st.integers(1, 24),
       n_keys=st.integers(1, 30), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_padding_masks_against_topk_oracle(B, H, L, S, n_keys, causal, seed):
    q, k, v = make((B, H), (B, H), L=L, S=S, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, S + 1, (B,), generator=g).tolist()
    mask = _padding_mask(lengths, S)
    out = sat.sparse_attention(q, k, v, "topk", k=n_keys, attn_mask=mask, is_causal=causal)
    allowed = mask & (torch.ones(L, S, dtype=torch.bool).tril() if causal else True)
    torch.testing.assert_close(out, topk_oracle(q, k, v, allowed, n_keys), atol=ATOL64, rtol=0)


# ------------------------------------------------------------------------------- dtypes and copies
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reduced_precision_computes_in_float32_and_casts_back(dtype):
    q, k, v = make((2, 2), (2, 2), L=16, S=16, dtype=dtype, seed=12)
    out, lse = sat.sparse_attention(q, k, v, "topk", k=16, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


def test_float32_inputs_are_shared_not_copied():
    t = torch.randn(3, 4, 5).transpose(0, 1)  # non-contiguous view
    arr = sat.to_numpy(t, "query")
    assert np.shares_memory(arr, t.numpy()) and arr.strides == tuple(s * 4 for s in t.stride())
    a = np.zeros((2, 3), dtype=np.float64)
    out = sat.from_numpy(a, torch.float64)
    assert out.data_ptr() == a.ctypes.data


# ---------------------------------------------------------------------------------------- errors
def test_requires_grad_refused_unless_grad_disabled_or_detached():
    q, k, v = make((1, 1), (1, 1), L=8, S=8, seed=13)
    qg = q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"query requires grad.*no backward.*torch.no_grad"):
        sat.sparse_attention(qg, k, v, "topk", k=8)
    with torch.no_grad():
        out = sat.sparse_attention(qg, k, v, "topk", k=8)
    assert not out.requires_grad
    with torch.inference_mode():
        out2 = sat.sparse_attention(qg, k, v, "topk", k=8)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    torch.testing.assert_close(sat.sparse_attention(qg.detach(), k, v, "topk", k=8), out, atol=0, rtol=0)


@pytest.mark.parametrize("bad,name,exc,match", [
    ("meta", "key", ValueError, "key is on device meta"),
    ("numpy", "value", TypeError, "value is a numpy array"),
    ("int", "query", TypeError, "query must have dtype"),
    ("complex", "key", TypeError, "key must have dtype"),
    ("bool", "value", TypeError, "value must have dtype"),
    ("sparse", "query", TypeError, "query has layout"),
    ("list", "key", TypeError, "key must be a torch.Tensor"),
])
def test_bad_tensors_are_refused_naming_the_argument(bad, name, exc, match):
    args = dict(zip(("query", "key", "value"), make((1,), (1,), L=4, S=4, seed=14), strict=True))
    x = args[name]
    args[name] = {"meta": lambda: x.to("meta"), "numpy": lambda: x.numpy(), "int": lambda: x.long(),
                  "complex": lambda: x.to(torch.complex128), "bool": lambda: x > 0,
                  "sparse": lambda: x[0].to_sparse(), "list": lambda: x.tolist()}[bad]()
    for fn in (lambda: sat.sparse_attention(args["query"], args["key"], args["value"], "topk", k=4),
               lambda: sat.scaled_dot_product_attention(args["query"], args["key"], args["value"])):
        with pytest.raises(exc, match=match):
            fn()


def test_bad_masks_are_refused():
    q, k, v = make((2, 1), (2, 1), L=4, S=5, seed=15)
    with pytest.raises(TypeError, match="attn_mask is a numpy array"):
        sat.sparse_attention(q, k, v, "topk", k=4, attn_mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="attn_mask contains NaN"):
        sat.sparse_attention(q, k, v, "topk", k=4, attn_mask=torch.full((4, 5), float("nan")))
    with pytest.raises(ValueError, match="attn_mask shape"):
        sat.sparse_attention(q, k, v, "topk", k=4, attn_mask=torch.ones(3, 1, 4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must have dtype"):
        sat.sparse_attention(q, k, v, "topk", k=4, attn_mask=torch.ones(4, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="explicit patterns"):
        sat.sparse_attention(q, k, v, sa.SparsePattern.full(4, 5), attn_mask=torch.ones(4, 5, dtype=torch.bool))
    # a 1-D key mask of the wrong length: the error quotes the shape given, not its (1, S) broadcast form
    with pytest.raises(ValueError, match=r"attn_mask shape \(6,\) must broadcast to \(\.\.\., L, S\)"):
        sat.sparse_attention(q, k, v, "topk", k=4, attn_mask=torch.ones(6, dtype=torch.bool))
    # a float64 additive value beyond float32 over float32 inputs: named, not reported as a score overflow
    big = torch.zeros(4, 5, dtype=torch.float64)
    big[1, 2] = 1e39
    with pytest.raises(ValueError, match=r"attn_mask holds 1e\+39 \(first at index \(1, 2\)\), beyond the "
                                         r"range of float32"):
        sat.sparse_attention(q.float(), k.float(), v.float(), "topk", k=4, attn_mask=big)


def test_import_sparseattn_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, sparseattn; print('torch' in sys.modules, 'transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"]


def test_key_mask_of_one_dimension_broadcasts_as_in_torch():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 7, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 7, 3, generator=g, dtype=torch.float64)
    keep = torch.tensor([True, False, True, True, False, True, True])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out = sat.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_float64_mask_far_below_float32_masks_the_pair_out():
    """A float64 additive mask of -1e300 over float32 inputs becomes -inf in float32: the pair is masked
    out, as with a bool mask (oracle: torch's SDPA with the bool mask, in float64)."""
    q, k, v = make((2,), (2,), L=4, S=6, seed=3)
    m = torch.zeros(4, 6, dtype=torch.float64)
    m[:, 2] = -1e300
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[:, 2] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out = sat.sparse_attention(q.float(), k.float(), v.float(), "topk", k=6, attn_mask=m)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
