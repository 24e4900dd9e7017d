"""Property tests (hypothesis) over random shapes, dtypes, masks, patterns and every registered selector.

Oracles, all written here and sharing nothing with the code under test: a float64 numpy softmax over the
allowed keys, brute-force boolean masks for every pattern constructor, brute-force causal visibility, and
a brute-force inner-product ranking for the exact selectors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import SparsePattern
from sparseattn.kernels import steps
from sparseattn.selectors import get_selector, selector_classes
from sparseattn.tutorial.steps import attention_steps

DTYPES = [np.float16, np.float32, np.float64]
# Absolute output error allowed, relative to max(1, max|v|): float16 is limited by the float16 output
# rounding (2**-11 = 4.9e-4; observed <= 1e-3), float32 by its logits (observed ~2e-6 at E = 64).
OUT_TOL = {np.float16: 4e-3, np.float32: 5e-5, np.float64: 1e-10}

# Small-size specs of every registered selector (LSH with a tiny candidate cap so that datasketch's
# MinHashLSH really runs at these sizes; IVF-PQ with one sub-quantizer so that it divides every E).
SPECS = {
    "window": ["window", "window:width=3,dilation=2"],
    "sinks": ["sinks:g=2", "sinks:positions=0;3"],
    "random": ["random", "random:n_random=3,seed=5"],
    "topk": ["topk", "topk:block=4"],
    "pages": ["pages", "pages:page_size=2,pages=3"],
    "faiss-flat": ["faiss-flat", "faiss-flat:center=false"],
    "faiss-hnsw": ["faiss-hnsw:M=4,ef_search=8", "faiss-hnsw"],
    "faiss-ivf": ["faiss-ivf:nprobe=1", "faiss-ivf:nlist=2,nprobe=1"],
    "faiss-ivfpq": ["faiss-ivfpq:m=1,nbits=2,nprobe=1"],
    "kdtree": ["kdtree", "kdtree:eps=0.5,leafsize=2", "kdtree:pca_dim=1"],
    "lsh": ["lsh:n_candidates=4,n_tables=4", "lsh:family=simhash,n_bits=3,n_candidates=4,n_tables=4"],
    "angular-lsh": ["angular-lsh:n_rounds=2,chunk_size=2", "angular-lsh:chunk_size=0,rerank=false",
                    "angular-lsh:order=position,n_rounds=2,chunk_size=2"],
    "cluster": ["cluster", "cluster:mode=block", "cluster:n_probe=1,spherical=true,assign=l2"],
    "union": ["window:width=2+sinks:g=1+topk"],
}
# Selectors whose rows hold exactly min(k, allowed) keys, the k best by inner product (exact top-k).
EXACT_TOPK = {"topk", "topk:block=4", "faiss-flat", "faiss-flat:center=false", "kdtree"}
MAX_S = {"lsh": 24, "cluster": 32, "faiss-hnsw": 32}  # the slower builds get smaller inputs


@pytest.fixture(autouse=True)
def _serial():
    with sa.threads(1):
        yield


def test_every_registered_selector_has_property_specs():
    assert set(selector_classes()) <= set(SPECS), "add small specs for the new selector to SPECS"


# ------------------------------------------------------------------------------------------ oracle
def oracle(q, k, v, allowed, scale):
    """float64 attention; q (G,L,E), k (G,S,E), v (G,S,Ev), allowed (G,L,S). No key -> 0 and -inf."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    s = np.where(allowed, scale * np.einsum("gle,gse->gls", q, k), -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    ok = np.isfinite(m)
    w = np.where(allowed, np.exp(s - np.where(ok, m, 0.0)[..., None]), 0.0)
    tot = w.sum(axis=-1)
    out = np.einsum("gls,gse->gle", w, v) / np.where(ok, tot, 1.0)[..., None]
    lse = np.where(ok, m + np.log(np.where(ok, tot, 1.0)), -np.inf)
    return out, lse


def _groups(x, lead, gqa):
    if gqa and x.shape[-3] != lead[-1]:
        x = np.repeat(x, lead[-1] // x.shape[-3], axis=-3)
    return np.broadcast_to(x, lead + x.shape[-2:]).reshape((-1,) + x.shape[-2:])


def _check(out, lse, ref, ref_lse, allowed, dtype, vmax, lead, L, Ev):
    G = ref.shape[0]
    assert out.shape == lead + (L, Ev)
    out = np.asarray(out, dtype=np.float64).reshape(G, L, Ev)
    lse = np.asarray(lse, dtype=np.float64).reshape(G, L)
    none = ~allowed.any(axis=-1)
    assert np.isfinite(out).all(), "NaN/Inf in the output"
    assert np.all(out[none] == 0), "a row with no allowed key is not zero"
    assert np.all(np.isneginf(lse[none])) and np.isfinite(lse[~none]).all()
    np.testing.assert_allclose(out, ref, rtol=0, atol=OUT_TOL[dtype] * max(1.0, vmax))
    np.testing.assert_allclose(lse[~none], ref_lse[~none], rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype])


# ----------------------------------------------------------------------- sparse(full) == dense
LEADS = [((), (), False), ((1,), (1,), False), ((2,), (2,), False), ((2, 3), (2, 3), False),
         ((2, 3), (3,), False), ((1, 2), (1, 1), True), ((2, 4), (2, 2), True)]


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from(LEADS), L=st.integers(1, 200), S=st.integers(1, 200), E=st.integers(1, 64),
       Ev=st.integers(1, 64), dtype=st.sampled_from(DTYPES), mask_kind=st.sampled_from(["none", "2d", "full"]),
       density=st.floats(0.0, 1.0), is_causal=st.booleans(),
       scale=st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False)), seed=st.integers(0, 2**32 - 1))
def test_sparse_full_pattern_equals_dense(lead, L, S, E, Ev, dtype, mask_kind, density, is_causal, scale, seed):
    rng = np.random.default_rng(seed)
    q_lead, kv_lead, gqa = lead
    if (L * S * E) * max(1, int(np.prod(q_lead))) > 400_000:  # keep each example small
        L, S = min(L, 60), min(S, 60)
    q = rng.standard_normal(q_lead + (L, E)).astype(dtype)
    k = rng.standard_normal(kv_lead + (S, E)).astype(dtype)
    v = rng.standard_normal(kv_lead + (S, Ev)).astype(dtype)
    full_lead = tuple(np.broadcast_shapes(q_lead, kv_lead[:-1] + q_lead[-1:] if gqa else kv_lead))
    G = int(np.prod(full_lead, dtype=np.int64))
    mask = None
    if mask_kind != "none":
        mask = rng.random((L, S) if mask_kind == "2d" else full_lead + (L, S)) < density
        mask[..., rng.integers(L), :] = False  # a row with nothing allowed
    causal = np.arange(S)[None, :] <= np.arange(L)[:, None] if is_causal else np.ones((L, S), bool)
    allowed = np.broadcast_to((mask if mask is not None else True) & causal, full_lead + (L, S)).reshape(G, L, S)
    if mask is None:
        pattern = SparsePattern.full(L, S, is_causal=is_causal)
    elif mask_kind == "2d":
        pattern = SparsePattern.from_mask(mask & causal)
    else:
        pattern = [SparsePattern.from_mask(a) for a in allowed]
    dense = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                            enable_gqa=gqa, return_lse=True)
    sparse = sa.sparse_attention(q, k, v, pattern, scale=scale, enable_gqa=gqa, return_lse=True)
    sc = 1.0 / np.sqrt(E) if scale is None else scale
    ref, ref_lse = oracle(_groups(q, full_lead, False), _groups(k, full_lead, gqa), _groups(v, full_lead, gqa),
                          allowed, sc)
    vmax = float(np.abs(v.astype(np.float64)).max(initial=0.0))
    for out, lse in (dense, sparse):
        assert out.dtype == dtype and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
        _check(out, lse, ref, ref_lse, allowed, dtype, vmax, full_lead, L, Ev)
    np.testing.assert_allclose(dense[0].astype(np.float64), sparse[0].astype(np.float64), rtol=0,
                               atol=2 * OUT_TOL[dtype] * max(1.0, vmax))


# ------------------------------------------------------------------------- softmax rows sum to 1
@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 60), S=st.integers(1, 80), E=st.integers(1, 64), density=st.floats(0.0, 1.0),
       dtype=st.sampled_from([np.float32, np.float64]), logit=st.sampled_from([1.0, 30.0, 1e3, 1e4]),
       seed=st.integers(0, 2**32 - 1))
def test_step_softmax_rows_sum_to_one(L, S, E, density, dtype, logit, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((L, E)).astype(dtype)
    k = rng.standard_normal((S, E)).astype(dtype)
    mask = rng.random((L, S)) < density
    mask[rng.integers(L)] = False
    p = SparsePattern.from_mask(mask)
    scale = logit / np.sqrt(E)  # logits up to ~ +-logit * few
    scores = steps.sparse_scores(q, k, p.indptr, p.indices, dtype(scale))
    probs, lse = steps.csr_softmax(p.indptr, scores)
    assert np.isfinite(probs).all() and (probs >= 0).all() and (probs <= 1).all()
    sums = np.bincount(np.repeat(np.arange(L), p.nnz_per_row), weights=probs.astype(np.float64), minlength=L)
    empty = p.nnz_per_row == 0
    np.testing.assert_allclose(sums[~empty], 1.0, rtol=0, atol=1e-5 if dtype == np.float32 else 1e-12)
    assert np.all(np.isneginf(lse[empty])) and np.isfinite(lse[~empty]).all()
    ref_scores = np.where(mask, scale * (q.astype(np.float64) @ k.astype(np.float64).T), -np.inf)
    m = ref_scores.max(axis=1)
    ref_lse = m[~empty] + np.log(np.exp(ref_scores[~empty] - m[~empty, None]).sum(axis=1))
    # float32 scores carry an absolute error ~ eps * E * scale * sum_e |q_e k_e| (not * |lse| or * |score|,
    # either of which can be ~0 after cancellation; hypothesis found S = 1, E = 3, logit 1e3).
    abs_dot = np.abs(scale) * (np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).T)
    mag = np.where(mask, abs_dot, 0).max(axis=1)[~empty]
    tol = (4e-7 * E if dtype == np.float32 else 1e-13 * E) * (1 + np.abs(ref_lse) + mag)
    assert np.all(np.abs(lse[~empty] - ref_lse) <= tol)


@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 30), S=st.integers(1, 30), d=st.integers(1, 16), is_causal=st.booleans(),
       sparse=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_attention_steps_weights_rows_sum_to_one(L, S, d, is_causal, sparse, seed):
    rng = np.random.default_rng(seed)
    x, ctx = rng.standard_normal((L, d)), rng.standard_normal((S, d))
    Wq, Wk, Wv = (rng.standard_normal((d, d)) for _ in range(3))
    pattern = SparsePattern.from_mask(rng.random((L, S)) < 0.5) if sparse else None
    st_ = attention_steps(x, Wq, Wk, Wv, context=ctx, is_causal=is_causal, pattern=pattern)
    allowed = np.ones((L, S), bool) if pattern is None else pattern.to_mask()
    if is_causal:
        allowed &= np.arange(S)[None, :] <= np.arange(L)[:, None]
    sums = st_.weights.sum(axis=1)
    has = allowed.any(axis=1)
    np.testing.assert_allclose(sums[has], 1.0, rtol=0, atol=1e-12)
    assert np.all(sums[~has] == 0) and np.all(st_.weights[~allowed] == 0)
    assert np.isfinite(st_.outputs).all()


# ------------------------------------------------------------------------------ pattern invariants
def _brute_band(L, S, before, after, dilation, offset):
    d = np.arange(S)[None, :] - (np.arange(L)[:, None] + offset)
    return (d >= -before * dilation) & (d <= after * dilation) & (d % dilation == 0)


@settings(max_examples=60, deadline=None)
@given(L=st.integers(0, 40), S=st.integers(0, 40), op=st.sampled_from(
    ["from_mask", "from_rows", "from_padded", "band", "window", "full", "union", "causal", "select_rows"]),
    a=st.integers(0, 9), b=st.integers(0, 9), dilation=st.integers(1, 4), offset=st.integers(-12, 12),
    is_causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_pattern_constructors_and_algebra_keep_invariants(L, S, op, a, b, dilation, offset, is_causal, seed):
    rng = np.random.default_rng(seed)
    m1 = rng.random((L, S)) < rng.random()
    m2 = rng.random((L, S)) < rng.random()
    if op == "from_mask":
        p, want = SparsePattern.from_mask(m1), m1
    elif op == "from_rows":  # unsorted, with duplicates
        rows = [rng.permutation(np.repeat(np.nonzero(r)[0], 2)).tolist() for r in m1]
        p, want = SparsePattern.from_rows(rows, S), m1
    elif op == "from_padded":
        w = int(m1.sum(axis=1).max(initial=0)) + 2
        ids = np.full((L, w), -1)
        for i, r in enumerate(m1):
            nz = rng.permutation(np.nonzero(r)[0])
            ids[i, :nz.size] = nz
            if nz.size:
                ids[i, -1] = nz[0]  # a duplicate in the padding
        p, want = SparsePattern.from_padded(ids, S), m1
    elif op == "band":
        p = SparsePattern.band(L, S, before=a, after=b, dilation=dilation, offset=offset)
        want = _brute_band(L, S, a, b, dilation, offset)
    elif op == "window":
        w = a + 1
        p = SparsePattern.window(L, S, w, is_causal=is_causal, dilation=dilation)
        want = _brute_band(L, S, w - 1, 0, dilation, 0) if is_causal else \
            _brute_band(L, S, w // 2, w - 1 - w // 2, dilation, 0)
    elif op == "full":
        p = SparsePattern.full(L, S, is_causal=is_causal)
        want = (np.arange(S)[None, :] <= np.arange(L)[:, None]) if is_causal else np.ones((L, S), bool)
    elif op == "union":
        p, want = SparsePattern.from_mask(m1) | SparsePattern.from_mask(m2), m1 | m2
    elif op == "causal":
        qpos, kpos = rng.integers(-5, 45, L), rng.integers(-5, 45, S)
        p = SparsePattern.from_mask(m1).causal(qpos, kpos)
        want = m1 & (kpos[None, :] <= qpos[:, None])
    else:
        rows = rng.integers(0, L, size=a) if L else np.zeros(0, np.int64)
        p, want = SparsePattern.from_mask(m1).select_rows(rows), m1[rows]
    assert p.validate() is p
    assert p.indptr.dtype == np.int64 and p.indices.dtype == np.int32
    assert p.shape == want.shape
    np.testing.assert_array_equal(p.to_mask(), want)
    assert p.nnz == int(want.sum())
    # re-validating the raw arrays through the checked constructor accepts them
    SparsePattern(p.indptr, p.indices, p.n_keys)


# -------------------------------------------------------------------------------------- selectors
def _all_specs():
    out = []
    for name, cls in selector_classes().items():
        reason = cls.unavailable_reason()
        for spec in SPECS.get(name, [name]):
            marks = [pytest.mark.skip(reason=f"{name} unavailable: {reason}")] if reason else []
            out.append(pytest.param(name, spec, marks=marks, id=spec))
    out += [pytest.param("union", s, id=s) for s in SPECS["union"]]
    return out


@pytest.mark.parametrize("name,spec", _all_specs())
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_selector_indices_in_range_unique_causal(name, spec, data):
    S = data.draw(st.integers(1, MAX_S.get(name, 48)), label="S")
    L = data.draw(st.integers(0, 40), label="L")
    E = data.draw(st.integers(1, 16), label="E")
    k = data.draw(st.integers(1, S + 6), label="k")  # includes k > S
    is_causal = data.draw(st.booleans(), label="is_causal")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    decode = is_causal and S >= L and data.draw(st.booleans(), label="decode")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    q = rng.standard_normal((L, E)).astype(dtype)
    keys = rng.standard_normal((S, E)).astype(dtype)
    sel = get_selector(spec)
    reasons = sel.not_supported_reasons(n_keys=S, dim=E)
    if reasons:  # documented refusal: a ValueError at build, never a crash inside the backend
        with pytest.raises(ValueError, match="cannot run here"):
            sel.build(keys)
        return
    sel.build(keys)
    qpos = np.arange(S - L, S) if decode else np.arange(L)
    p = sel.query(q, k, is_causal=is_causal, query_positions=qpos if decode else None)
    assert p.shape == (L, S)
    p.validate()  # in range [0, S), sorted and unique per row, consistent indptr
    assert p.indptr.dtype == np.int64 and p.indices.dtype == np.int32
    mask = p.to_mask()
    visible = np.arange(S)[None, :] <= qpos[:, None] if is_causal else np.ones((L, S), bool)
    assert not (mask & ~visible).any(), "a key after its query was selected"
    n_allowed = visible.sum(axis=1)
    if spec in EXACT_TOPK:
        np.testing.assert_array_equal(p.nnz_per_row, np.minimum(k, n_allowed))
        # tie-aware: every selected key scores at least as high as every allowed key left out
        s = q.astype(np.float32).astype(np.float64) @ keys.astype(np.float32).astype(np.float64).T
        tol = 1e-4 * (1 + np.abs(s).max(initial=0.0))
        sel_min = np.where(mask, s, np.inf).min(axis=1, initial=np.inf)
        out_max = np.where(visible & ~mask, s, -np.inf).max(axis=1, initial=-np.inf)
        assert np.all(sel_min >= out_max - tol)
    elif name == "random":
        n = sel.params["n_random"] or k
        np.testing.assert_array_equal(p.nnz_per_row, np.minimum(n, n_allowed))
    elif name == "sinks" and spec == "sinks:g=2":
        np.testing.assert_array_equal(mask, visible & (np.arange(S) < 2)[None, :])
