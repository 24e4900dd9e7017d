"""Bad and edge-case inputs: one test per kind of bad or degenerate input.

Every error is matched against its message (the argument's name, what was expected, what was received).
Known bugs are kept as ``xfail(strict=True)`` tests stating the expected behaviour, so a fix flips them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import SparsePattern
from sparseattn.selectors import get_selector, parse_spec, selector_classes, spec_string

# One small spec per registered selector (IVF-PQ with m=2 so that it divides E=8; LSH with a small
# candidate cap so that datasketch's MinHashLSH is used at these sizes).
SPEC = {
    "window": "window:width=3", "sinks": "sinks:g=2", "random": "random", "topk": "topk", "pages": "pages",
    "faiss-flat": "faiss-flat", "faiss-hnsw": "faiss-hnsw:M=8", "faiss-ivf": "faiss-ivf:nprobe=2",
    "faiss-ivfpq": "faiss-ivfpq:m=2,nbits=2", "kdtree": "kdtree", "lsh": "lsh:n_candidates=8,n_tables=4",
    "angular-lsh": "angular-lsh:n_rounds=2,chunk_size=2", "cluster": "cluster",
}
UNION = "window:width=2+sinks:g=1+topk"


def _specs(extra=(UNION,)):
    out = []
    for name, cls in selector_classes().items():
        reason = cls.unavailable_reason()
        marks = [pytest.mark.skip(reason=f"{name} unavailable: {reason}")] if reason else []
        out.append(pytest.param(SPEC.get(name, name), marks=marks, id=name))
    return out + [pytest.param(s, id="union") for s in extra]


@pytest.fixture(autouse=True)
def _serial():
    with sa.threads(1):
        yield


@pytest.fixture
def qkv(rng):
    return (rng.standard_normal((2, 5, 8)).astype(np.float32), rng.standard_normal((2, 7, 8)).astype(np.float32),
            rng.standard_normal((2, 7, 3)).astype(np.float32))


def dense(q, k, v, **kw):
    return sa.scaled_dot_product_attention(q, k, v, **kw)


def sparse(q, k, v, **kw):
    pattern = kw.pop("pattern", None)
    if pattern is None:  # (rank-1 inputs are rejected before the pattern is looked at)
        pattern = SparsePattern.full(q.shape[-2] if q.ndim > 1 else 1, k.shape[-2] if k.ndim > 1 else 1)
    return sa.sparse_attention(q, k, v, pattern, **kw)


def sparse_selector(q, k, v, **kw):
    return sa.sparse_attention(q, k, v, kw.pop("pattern", "topk"), k=kw.pop("k", 3), **kw)


DENSE_AND_SPARSE = [pytest.param(dense, id="dense"), pytest.param(sparse, id="sparse")]
FUNCS = [*DENSE_AND_SPARSE, pytest.param(sparse_selector, id="sparse-selector")]


def test_spec_table_covers_every_selector():
    assert set(selector_classes()) <= set(SPEC)


# -------------------------------------------------------------------------------- NaN / Inf inputs
@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_names_the_argument(qkv, fn, name, bad):
    args = dict(zip(["query", "key", "value"], (a.copy() for a in qkv), strict=True))
    args[name][1, 2, 0] = bad
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or Inf \(first at index \(1, 2, 0\)\)\. "
                                         r".*check_finite=False"):
        fn(args["query"], args["key"], args["value"])


@pytest.mark.parametrize("fn", FUNCS)
def test_check_finite_false_skips_the_check(qkv, fn):
    q, k, v = qkv
    v = v.copy()
    v[0, 4, 1] = np.nan  # only rows that attend key 4 of group 0 see it
    pattern = SparsePattern.from_rows([[0, 1]] * 4 + [[4]], 7)
    kw = {"pattern": pattern} if fn is sparse else {"pattern": "sinks:g=5"} if fn is sparse_selector else {}
    out = fn(q, k, v, check_finite=False, **kw)
    if fn is sparse:
        assert np.isnan(out[0, 4, 1]) and np.isfinite(out[0, :4]).all() and np.isfinite(out[1]).all()
    else:
        assert np.isnan(out[0, :, 1]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("spec", _specs())
def test_selector_build_and_query_reject_nonfinite(rng, spec):
    keys = rng.standard_normal((40, 8)).astype(np.float32)
    bad_keys = keys.copy()
    bad_keys[3, 5] = np.nan
    with pytest.raises(ValueError, match=r"^keys contains NaN or Inf \(first at index \(3, 5\)\)"):
        get_selector(spec).build(bad_keys)
    q = rng.standard_normal((6, 8)).astype(np.float32)
    q[4, 0] = -np.inf
    sel = get_selector(spec).build(keys)
    with pytest.raises(ValueError, match=r"^queries contains NaN or Inf \(first at index \(4, 0\)\)"):
        sel.query(q, 3)


def test_selector_check_finite_false_skips_the_check(rng):
    keys = rng.standard_normal((10, 4))
    keys[2, 1] = np.inf
    q = rng.standard_normal((10, 4))
    q[0, 0] = np.nan
    p = get_selector("window:width=3").build(keys, check_finite=False).query(q, 3, is_causal=True,
                                                                             check_finite=False)
    assert p == SparsePattern.window(10, 10, 3, is_causal=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fn", DENSE_AND_SPARSE)
@pytest.mark.parametrize("case", ["big-qk-f32", "big-qk-f64", "big-scale-f32"])
def test_overflowing_logits_do_not_crash_nor_give_an_empty_row(fn, case):
    q, k, v, scale = _overflow_case(case)
    try:
        out = fn(q, k, v, scale=scale)  # sparse: SparsePattern.full(1, 2)
    except ValueError as exc:  # an explicit refusal would be acceptable too
        assert "overflow" in str(exc)
        return
    np.testing.assert_allclose(out, _overflow_expected(case))


def _overflow_case(case):
    """One query, two keys; the exact softmax is defined (a one-hot, or uniform) and its output finite."""
    if case == "big-scale-f32":  # q.k = 1 for both keys; 1e39 overflows float32: uniform weights
        return (np.ones((1, 1), np.float32), np.ones((2, 1), np.float32), np.array([[1.0], [2.0]], np.float32),
                1e39)
    dt, big = (np.float32, 1e20) if case.endswith("f32") else (np.float64, 1e160)
    # logits 1e40 / 1e320 (overflow) vs 1e20 / 1e160: all the mass on key 0
    return (np.array([[big]], dt), np.array([[big], [1.0]], dt), np.array([[1.0], [2.0]], dt), 1.0)


def _overflow_expected(case):
    return [[1.5]] if case == "big-scale-f32" else [[1.0]]


# ------------------------------------------------------------------- one empty-row / overflow policy
def _scaled_normal(seed, shapes, mag, dtype):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * mag).astype(dtype) for s in shapes]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fn", DENSE_AND_SPARSE)
def test_overflowing_scores_always_raise_never_empty_rows(fn):
    # Finite float32 inputs of magnitude 1e20: every q.k overflows to +inf, -inf or NaN (inf - inf inside
    # the dot product).  Each seed must raise the overflow error; a row must never come back as an empty
    # row (zeros, lse = -inf), which is what a NaN maximum used to turn into.
    for seed in range(40):
        k, q, v = _scaled_normal(seed, [(80, 16), (4, 16), (80, 16)], 1e20, np.float32)
        with pytest.raises(ValueError, match=r"attention scores overflow float32"):
            fn(q, k, v, return_lse=True)


def test_nan_scores_are_reported_not_taken_as_empty_rows():
    # check_finite=False with a NaN query: the row's scores are all NaN.  Not an empty row (zeros, -inf):
    # NaN output and NaN lse; and a NaN score next to finite ones is not silently dropped by the float32 exp.
    q = np.array([[np.nan, 1.0], [1.0, 1.0], [1.0, np.nan]], np.float32)
    k = np.ones((3, 2), np.float32)
    v = np.ones((3, 2), np.float32)
    p = SparsePattern.from_rows([[0, 1], [0, 2], [0]], 3)
    for dt in (np.float32, np.float64):
        out, lse = sa.sparse_attention(q.astype(dt), k.astype(dt), v.astype(dt), p, return_lse=True,
                                       check_finite=False)
        assert np.isnan(lse[[0, 2]]).all() and np.isnan(out[[0, 2]]).all()
        assert np.isfinite(lse[1]) and np.allclose(out[1], 1.0)
    k2 = np.array([[1.0, 1.0], [np.nan, 0.0], [1.0, 1.0]], np.float32)  # row 0: one NaN score, one finite
    for dt in (np.float32, np.float64):
        out, lse = sa.sparse_attention(q[[1]].astype(dt), k2.astype(dt), v.astype(dt),
                                       SparsePattern.from_rows([[0, 1]], 3), return_lse=True, check_finite=False)
        assert np.isnan(lse).all() and np.isnan(out).all()


def test_check_lse_policy():
    from sparseattn.inputs import check_lse

    check_lse(np.array([-np.inf, 0.0, 3.0], np.float32), np.float32, 1.0)  # empty rows are legal
    check_lse(np.zeros(0), np.float64, 1.0)
    with pytest.raises(ValueError, match=r"attention scores overflow float32 .*scale=0\.5"):
        check_lse(np.array([1.0, np.inf], np.float32), np.float32, 0.5)
    with pytest.raises(ValueError, match=r"overflow float32 .*; pass float64 inputs or a smaller scale\.$"):
        check_lse(np.array([np.inf]), np.float32, 1.0)
    # float64 callers are not told to pass float64
    with pytest.raises(ValueError, match=r"overflow float64 .*; scale the queries or keys down, or pass a smaller "
                                         r"scale \(float64 is the widest dtype\)\.$"):
        check_lse(np.array([np.nan]), np.float64, 1.0)
    check_lse(np.array([np.nan]), np.float64, 1.0, nan_is_overflow=False)


def _oracle64(q, k, v, scale):
    """Float64 full attention of (L, E), (S, E), (S, Ev): output, lse, and whether a score overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
        bad = not np.isfinite(s).all()
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        out = (w @ v.astype(np.float64)) / w.sum(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(w.sum(axis=1))
    return out, lse, bad


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([np.float32, np.float64]),
       lq=st.floats(0, 1), lk=st.floats(0, 1), lv=st.floats(0, 1), L=st.integers(1, 5), S=st.integers(1, 80),
       fn=st.sampled_from(["sparse", "dense"]))
def test_overflow_policy_against_float64_oracle(seed, dtype, lq, lk, lv, L, S, fn):
    """Any magnitude: the float64 oracle's answer (within a forward-error bound) or the overflow error.

    float32 magnitudes 1e-40..1e38 for q and k (1e-40..1e36 for v: a weighted sum of values near the
    float32 maximum can overflow the accumulator, which is not a score overflow); float64 1e-300..1e300.
    Never zeros with ``lse = -inf`` (every row has keys here).
    """
    lo, hi = (-40.0, 38.0) if dtype == np.float32 else (-300.0, 300.0)
    hi_v = 36.0 if dtype == np.float32 else 300.0
    mags = [10.0 ** (lo + (hi - lo) * lq), 10.0 ** (lo + (hi - lo) * lk), 10.0 ** (lo + (hi_v - lo) * lv)]
    E = 16
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        q, k, v = ((rng.standard_normal(shape) * m).astype(dtype) for shape, m in
                   zip([(L, E), (S, E), (S, E)], mags, strict=True))
    assume(all(np.isfinite(x).all() for x in (q, k, v)))
    scale = 1.0 / np.sqrt(E)
    ref, ref_lse, ref_overflow = _oracle64(q, k, v, scale)
    call = (lambda: sa.sparse_attention(q, k, v, SparsePattern.full(L, S), return_lse=True)) if fn == "sparse" \
        else (lambda: sa.scaled_dot_product_attention(q, k, v, return_lse=True))
    info = np.finfo(dtype)
    # Forward-error bound of a score: E * eps * scale * sum_e |q_e k_e| (+ the dtype's smallest normal).
    with np.errstate(over="ignore"):
        abs_dot = (np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).T) * scale
    ds = float(E * info.eps * abs_dot.max() + info.tiny)
    safe = abs_dot.max() < float(info.max) / 64 and not ref_overflow  # no partial sum can overflow
    try:
        out, lse = call()
    except ValueError as exc:
        assert f"attention scores overflow {np.dtype(dtype).name}" in str(exc)
        assert not safe, f"raised although no score can overflow (max sum |q_e k_e| = {abs_dot.max():.3g})"
        return
    assert not ref_overflow or np.isfinite(lse).all()
    assert np.isfinite(lse).all(), f"rows with keys returned lse {lse} (silent empty rows)"
    assert np.isfinite(out).all()
    vmax = float(np.abs(v.astype(np.float64)).max())
    tol = min(vmax * (4 * ds + 1e-4) + 1e-44, 1e300)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=0, atol=tol)
    np.testing.assert_allclose(lse.astype(np.float64), ref_lse, rtol=1e-5, atol=4 * ds + 1e-5)


# -------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("fn", FUNCS)
def test_feature_size_mismatch(qkv, fn):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"query and key must have the same feature size E; got .*\(2, 5, 8\)"
                                         r".*\(2, 7, 6\)"):
        fn(q, k[..., :6], v)


def test_key_value_length_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"key and value must have the same length S; got key \(2, 7, 8\) and "
                                         r"value \(2, 6, 3\)"):
        dense(q, k, v[:, :6])
    with pytest.raises(ValueError, match=r"key and value must have the same length S; got key \(2, 7, 8\) and "
                                         r"value \(2, 6, 3\)"):
        sparse(q, k, v[:, :6])
    with pytest.raises(ValueError, match=r"key and value must have the same leading dims; got \(2,\) and \(1,\)"):
        dense(q, k, v[:1])


@pytest.mark.parametrize("fn", FUNCS)
def test_head_dims_mismatch(rng, fn):
    q = rng.standard_normal((4, 5, 8))
    k, v = rng.standard_normal((3, 7, 8)), rng.standard_normal((3, 7, 2))
    with pytest.raises(ValueError, match=r"leading dimensions of query \(4,\) and key \(3,\) do not broadcast; "
                                         r"for fewer K/V heads than query heads pass enable_gqa=True"):
        fn(q, k, v)
    with pytest.raises(ValueError, match=r"enable_gqa: query heads \(4\) must be a multiple of key heads \(3\)"):
        fn(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"enable_gqa needs a heads dimension at position -3"):
        fn(q[0], k[0], v[0], enable_gqa=True)


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_rank_one_input(qkv, fn, name):
    args = dict(zip(["query", "key", "value"], qkv, strict=True))
    args[name] = args[name].reshape(-1)
    with pytest.raises(ValueError, match=rf"{name} must have at least 2 dimensions \(\.\.\., length, features\)"):
        fn(args["query"], args["key"], args["value"])


def test_selector_shape_errors(rng):
    keys = rng.standard_normal((10, 4))
    with pytest.raises(ValueError, match=r"keys must be 2-D \(S, E\) for a selector; got shape \(2, 10, 4\)"):
        get_selector("topk").build(np.stack([keys, keys]))
    sel = get_selector("topk").build(keys)
    with pytest.raises(ValueError, match=r"queries have E=5 features but the keys have 4"):
        sel.query(rng.standard_normal((3, 5)), 2)
    with pytest.raises(ValueError, match=r"queries must be 2-D \(L, E\); got shape \(1, 3, 4\)"):
        sel.query(rng.standard_normal((1, 3, 4)), 2)
    with pytest.raises(ValueError, match=r"query_positions must have shape \(3,\); got \(4,\)"):
        sel.query(rng.standard_normal((3, 4)), 2, is_causal=True, query_positions=np.arange(4))
    with pytest.raises(TypeError, match=r"key_positions must be an integer array; got dtype float64"):
        sel.query(rng.standard_normal((3, 4)), 2, key_positions=np.arange(10.0))


# -------------------------------------------------------------------------------- dtypes
BAD_DTYPES = [
    pytest.param(np.int64, TypeError, r"must have dtype float16, float32 or float64; got int64", id="int64"),
    pytest.param(np.int8, TypeError, r"must have dtype float16, float32 or float64; got int8", id="int8"),
    pytest.param(np.bool_, TypeError, r"must have dtype float16, float32 or float64; got bool", id="bool"),
    pytest.param(np.complex128, TypeError, r"must be a real floating array; got complex dtype complex128",
                 id="complex"),
    pytest.param(object, TypeError, r"must have dtype float16, float32 or float64; got object", id="object"),
]


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("dtype,etype,msg", BAD_DTYPES)
def test_non_float_dtypes(qkv, fn, name, dtype, etype, msg):
    args = dict(zip(["query", "key", "value"], qkv, strict=True))
    args[name] = args[name].astype(dtype)
    with pytest.raises(etype, match=rf"^{name} {msg}"):
        fn(args["query"], args["key"], args["value"])


@pytest.mark.parametrize("dtype,etype,msg", BAD_DTYPES)
def test_selector_non_float_dtypes(rng, dtype, etype, msg):
    keys = rng.standard_normal((10, 4))
    with pytest.raises(etype, match=rf"^keys {msg}"):
        get_selector("topk").build(keys.astype(dtype))
    with pytest.raises(etype, match=rf"^queries {msg}"):
        get_selector("topk").build(keys).query(keys.astype(dtype), 2)


# -------------------------------------------------------------------------------- k
@pytest.mark.parametrize("k,etype,msg", [
    (0, ValueError, r"k must be >= 1; got 0\."),
    (-2, ValueError, r"k must be >= 1; got -2\."),
    (2.5, TypeError, r"k must be an integer >= 1; got 2\.5 \(float\)\."),
    (3.0, TypeError, r"k must be an integer >= 1; got 3\.0 \(float\)\."),
    (True, TypeError, r"k must be an integer >= 1; got True \(bool\)\."),
    ("4", TypeError, r"k must be an integer >= 1; got '4' \(str\)\."),
    (None, TypeError, r"k must be an integer >= 1; got None \(NoneType\)\."),
])
def test_bad_k(qkv, k, etype, msg):
    q, kk, v = qkv
    with pytest.raises(etype, match=msg):
        sa.sparse_attention(q, kk, v, "topk", k=k)
    with pytest.raises(etype, match=msg):
        get_selector("topk").build(kk[0]).query(q[0], k)


def test_numpy_integer_k_is_accepted(qkv):
    q, kk, v = qkv
    out = sa.sparse_attention(q, kk, v, "topk", k=np.int64(7))  # k = S: every key
    np.testing.assert_allclose(out, sa.scaled_dot_product_attention(q, kk, v), atol=1e-5)


# k > S: documented in Selector.query ("k > S is legal and means every allowed key").  Window and sinks
# are excluded: they are positional and document their own use of k (window width, ignored).
_SHORT = "BUG: k > S must give every allowed key (Selector.query docstring); this approximate selector " \
         "returns only its candidates"
_K_BIG_SMALL_BUGS: set = set()  # fixed: Selector.query fills rows with at most k allowed keys
K_BIG_SMALL_S = [
    pytest.param(p.values[0], c, marks=list(p.marks) + (
        [pytest.mark.xfail(strict=True, reason=_SHORT)] if (p.values[0], c) in _K_BIG_SMALL_BUGS else []),
        id=f"{p.id}-{'causal' if c else 'full'}")
    for p in _specs() if p.values[0] not in (SPEC["window"], SPEC["sinks"]) for c in (False, True)]
K_BIG_400 = [
    ("random", False, None), ("random", True, None), ("topk", False, None), ("topk", True, None),
    ("faiss-flat", False, None), ("faiss-flat", True, None), ("kdtree", False, None), ("kdtree", True, None),
    ("kdtree:eps=1.0", False, None), ("faiss-hnsw", False, None), ("faiss-hnsw", True, None),
    ("lsh", False, None), ("window:width=2+topk", False, None),
    ("faiss-hnsw:M=4,ef_search=8", False, None), ("faiss-hnsw:M=4,ef_search=8", True, None),
    ("faiss-ivf", False, None), ("faiss-ivf", True, None),
    ("faiss-ivfpq:m=2", False, None), ("faiss-ivfpq:m=2", True, None),
    ("lsh:n_candidates=16", False, None), ("lsh:n_candidates=16", True, None),
    ("angular-lsh", False, None), ("angular-lsh", True, None),
    ("cluster", False, None), ("cluster", True, None),
    # cluster:mode=block is exempt by design: its pattern is exactly the routed key set attend() uses.
]


def _assert_every_allowed_key(spec, S, is_causal, seed=7):
    rng = np.random.default_rng(seed)
    L = 24
    q = rng.standard_normal((L, 8)).astype(np.float32)
    keys = rng.standard_normal((S, 8)).astype(np.float32)
    sel = get_selector(spec)
    if sel.not_supported_reasons(n_keys=S, dim=8):
        pytest.skip(f"{spec} does not run on S={S}: {sel.not_supported_reasons(n_keys=S, dim=8)}")
    p = sel.build(keys).query(q, S + 5, is_causal=is_causal)
    allowed = np.arange(S)[None, :] <= np.arange(L)[:, None] if is_causal else np.ones((L, S), bool)
    np.testing.assert_array_equal(p.nnz_per_row, allowed.sum(axis=1))
    np.testing.assert_array_equal(p.to_mask(), allowed)


@pytest.mark.parametrize("spec,is_causal", K_BIG_SMALL_S)
def test_k_larger_than_s_small(spec, is_causal):
    _assert_every_allowed_key(spec, 12, is_causal)


@pytest.mark.parametrize("spec,is_causal,bug", [
    pytest.param(s, c, b, id=f"{s}-{'causal' if c else 'full'}",
                 marks=[pytest.mark.xfail(strict=True, reason=b)] if b else []) for s, c, b in K_BIG_400])
def test_k_larger_than_s_400_keys(spec, is_causal, bug):
    _assert_every_allowed_key(spec, 400, is_causal)


def test_k_larger_than_s_sparse_attention_equals_dense(qkv):
    q, k, v = qkv
    out = sa.sparse_attention(q, k, v, "topk", k=100, is_causal=True)
    np.testing.assert_allclose(out, sa.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)


# -------------------------------------------------------------------------------- L = 0, S = 0
@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_no_queries_gives_empty_output(rng, fn, dtype):
    q = np.zeros((2, 0, 4), dtype)
    k, v = rng.standard_normal((2, 6, 4)).astype(dtype), rng.standard_normal((2, 6, 3)).astype(dtype)
    out, lse = fn(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 3) and out.dtype == dtype and lse.shape == (2, 0)


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_no_keys_gives_zeros_and_neg_inf_lse(rng, fn, is_causal):
    q = rng.standard_normal((2, 5, 4)).astype(np.float32)
    k, v = np.zeros((2, 0, 4), np.float32), np.zeros((2, 0, 3), np.float32)
    kw = {"is_causal": is_causal} if fn is not sparse else {}
    out, lse = fn(q, k, v, return_lse=True, **kw)
    assert out.shape == (2, 5, 3) and np.all(out == 0)
    assert lse.shape == (2, 5) and np.all(np.isneginf(lse))


_S0 = "BUG: S = 0 crashes inside FAISS instead of giving empty rows (or the documented 'cannot run here' ValueError)"
_S0_BUGS: dict = {}  # fixed: Selector.query returns empty rows when S = 0


def _s0_params():
    out = []
    for p in _specs():
        for causal in (False, True):
            name = p.id
            bug = _S0_BUGS.get((name, causal))
            marks = list(p.marks) + ([pytest.mark.xfail(strict=True, reason=bug)] if bug else [])
            out.append(pytest.param(p.values[0], causal, marks=marks, id=f"{name}-{'causal' if causal else 'full'}"))
    return out


@pytest.mark.parametrize("spec,is_causal", _s0_params())
def test_selectors_with_no_keys(rng, spec, is_causal):
    """S = 0: through sparse_attention every selector gives empty rows (zeros, lse -inf: the one empty-row
    policy), also those that cannot be built on no key (cluster routing: nothing is built); a selector
    used directly either builds on no key and returns an empty pattern or refuses with its reason."""
    q = rng.standard_normal((5, 8)).astype(np.float32)
    keys, v = np.zeros((0, 8), np.float32), np.zeros((0, 3), np.float32)
    out, lse = sa.sparse_attention(q, keys, v, spec, k=3, is_causal=is_causal, return_lse=True)
    assert out.shape == (5, 3) and np.all(out == 0) and np.all(np.isneginf(lse))
    sel = get_selector(spec)
    if sel.not_supported_reasons(n_keys=0, dim=8):
        with pytest.raises(ValueError, match=r"needs at least"):
            sel.build(keys)
        return
    p = sel.build(keys).query(q, 3, is_causal=is_causal)
    assert p.shape == (5, 0) and p.nnz == 0


@pytest.mark.parametrize("spec", _specs())
def test_selectors_with_no_queries(rng, spec):
    keys = rng.standard_normal((40, 8)).astype(np.float32)
    sel = get_selector(spec).build(keys)
    for causal in (False, True):
        p = sel.query(np.zeros((0, 8), np.float32), 3, is_causal=causal)
        assert p.shape == (0, 40) and p.nnz == 0


# -------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("mask,etype,msg", [
    (np.ones((6, 7), bool), ValueError, r"attn_mask shape \(6, 7\) does not broadcast to \(\.\.\., L, S\) = "
                                        r"\(2, 5, 7\)"),
    (np.ones((3, 5, 7), bool), ValueError, r"attn_mask shape \(3, 5, 7\) does not broadcast"),
    (np.ones(6, bool), ValueError, r"attn_mask shape \(6,\) does not broadcast to \(\.\.\., L, S\) = \(2, 5, 7\)"),
    (np.ones((5, 7), np.int64), TypeError, r"attn_mask must be boolean \(True = may attend\) or float \(added "
                                           r"to the scores\); got dtype int64"),
    (np.ones((5, 7), np.complex64), TypeError, r"attn_mask must be boolean .*; got dtype complex64"),
    (np.full((5, 7), np.nan), ValueError, r"attn_mask contains NaN; use -inf for masked-out positions"),
])
def test_bad_attn_mask(qkv, mask, etype, msg):
    with pytest.raises(etype, match=msg):
        dense(*qkv, attn_mask=mask)


def test_bad_bias_and_pattern_masks(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"bias array must end in \(L, S\) = \(5, 7\); got \(5, 6\)"):
        sparse(q, k, v, bias=np.zeros((5, 6)))
    with pytest.raises(ValueError, match=r"bias contains NaN; use -inf to forbid a pair"):
        sparse(q, k, v, bias=np.full((5, 7), np.nan))
    with pytest.raises(TypeError, match=r"mask must be a boolean array \(True = may attend\); got dtype int64"):
        SparsePattern.from_mask(np.ones((5, 7), np.int64))
    with pytest.raises(ValueError, match=r"mask must be 2-D \(L, S\); got shape \(2, 5, 7\)"):
        SparsePattern.from_mask(np.ones((2, 5, 7), bool))
    with pytest.raises(ValueError, match=r"pattern shape \(5, 6\) does not match \(L, S\) = \(5, 7\)"):
        sparse(q, k, v, pattern=SparsePattern.full(5, 6))
    with pytest.raises(ValueError, match=r"pattern sequence has 3 entries; expected one per \(batch, head\) "
                                         r"group = 2"):
        sparse(q, k, v, pattern=[SparsePattern.full(5, 7)] * 3)
    with pytest.raises(TypeError, match=r"pattern must be a SparsePattern, a sequence of them, a Selector or a "
                                        r"selector spec string; got ndarray"):
        sparse(q, k, v, pattern=np.ones((5, 7), bool))


def test_additive_values_beyond_the_computation_dtype_are_named(qkv):
    """A float64 mask or bias holding 1e39 over float32 inputs: cast to float32 it would be +inf, reported as
    an overflow of the scores; the error names the argument and its value.  Over float64 inputs it is a
    legal (huge) additive value: the row's weight goes to that key, as a float64 oracle says."""
    q, k, v = qkv
    m = np.zeros((5, 7))
    m[2, 3] = 1e39
    msg = r"holds 1e\+39 \(first at index \(2, 3\)\), beyond the range of float32 .* pass float64 inputs"
    with pytest.raises(ValueError, match="attn_mask " + msg):
        dense(q, k, v, attn_mask=m)
    with pytest.raises(ValueError, match="bias " + msg):
        sparse(q, k, v, bias=m)
    q64, k64, v64 = (x.astype(np.float64) for x in qkv)
    for out in (dense(q64, k64, v64, attn_mask=m), sparse(q64, k64, v64, bias=m)):
        np.testing.assert_allclose(out[:, 2], v64[:, 3], rtol=1e-12)
    # a negative value beyond float32 becomes -inf there: that pair masked out, as meant (oracle: float64
    # softmax over the other keys)
    for low in (-1e300, np.finfo(np.float64).min, -1e39):
        m = np.zeros((5, 7))
        m[:, 0] = low
        s = np.einsum("gld,gsd->gls", q64, k64) / np.sqrt(8.0)
        s[:, :, 0] = -np.inf
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        expected = (w / w.sum(axis=-1, keepdims=True)) @ v64
        for out in (dense(q, k, v, attn_mask=m), sparse(q, k, v, bias=m)):
            np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("scale", [-1.0, 0.0])
@pytest.mark.parametrize("spec", ["topk", "window", "cluster", "faiss-flat"])
def test_selectors_refuse_a_scale_that_is_not_positive(rng, spec, scale):
    """With scale <= 0 the keys of largest q.k carry the least (or no particular) softmax mass: topk's
    output was 0.99 off dense attention while its recall@k read 1.0.  Refused with the fix; an explicit
    pattern attends with any finite scale, exactly (float64 oracle: the dense reference)."""
    q, k, v = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 100, 8)), rng.standard_normal((1, 100, 4))
    with pytest.raises(ValueError, match=f"scale={scale:g}: a selector keeps the keys it expects to carry the "
                                         f"softmax mass .* pass a positive scale, or an explicit SparsePattern"):
        sa.sparse_attention(q, k, v, spec, k=10, scale=scale)
    got = sa.sparse_attention(q, k, v, SparsePattern.full(4, 100), scale=scale)
    np.testing.assert_allclose(got, dense(q, k, v, scale=scale), rtol=1e-12, atol=1e-14)


# -------------------------------------------------------------------------------- selector names / params
def test_unknown_selector_lists_the_valid_ones(qkv):
    names = ", ".join(selector_classes())
    with pytest.raises(ValueError, match=rf"^unknown selector 'nosuch'; available: {names}\.$"):
        get_selector("nosuch")
    with pytest.raises(ValueError, match=r"^unknown selector 'nosuch'; available: angular-lsh, "):
        sa.sparse_attention(*qkv, "window:width=2+nosuch")


@pytest.mark.parametrize("name", list(selector_classes()))
def test_unknown_parameter_lists_the_valid_ones(name):
    valid = ", ".join(sorted(selector_classes()[name].params_spec))
    with pytest.raises(ValueError, match=rf"^unknown parameter\(s\) \['bogus'\] for selector '{name}'; "
                                         rf"valid: {valid}\.$"):
        get_selector(f"{name}:bogus=1")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['bogus'\]"):
        get_selector(name, bogus=1)


@pytest.mark.parametrize("spec,etype,msg", [
    ("window:width=0", ValueError, r"^window: parameter width must be > 0; got 0\.$"),
    ("window:dilation=-1", ValueError, r"^window: parameter dilation must be > 0; got -1\.$"),
    ("window:width=2.5", TypeError, r"^window: parameter width must be an integer; got 2\.5\.$"),
    ("window:width=abc", TypeError, r"^window: parameter width must be an integer; got 'abc'\.$"),
    ("random:n_random=0", ValueError, r"^random: parameter n_random must be > 0; got 0\.$"),
    ("topk:block=0", ValueError, r"^topk: parameter block must be > 0; got 0\.$"),
    ("faiss-hnsw:M=1", ValueError, r"^faiss-hnsw: parameter M must be >= 2; got 1\.$"),
    ("faiss-hnsw:efsearch=10", ValueError,
     r"unknown parameter\(s\) \['efsearch'\] for selector 'faiss-hnsw'; valid: M, center, ef_construction, "
     r"ef_search, hnsw_min_block"),
    ("faiss-hnsw:center=2", TypeError, r"^faiss-hnsw: parameter center must be a bool \(true/false\); "
                                       r"got 2\.$"),
    ("faiss-hnsw:ef_construction=0", ValueError, r"^faiss-hnsw: parameter ef_construction must be > 0; "
                                                 r"got 0\.$"),
    ("faiss-ivf:nlist=0", ValueError, r"faiss-ivf: parameter nlist must be >= 1 \(or None"),
    ("faiss-ivf:nprobe=x", TypeError, r"faiss-ivf: parameter nprobe must be an integer; got 'x'"),
    ("faiss-ivfpq:nbits=17", ValueError, r"^faiss-ivfpq: parameter nbits must lie in \[1, 16\]; got 17\.$"),
    ("faiss-ivfpq:nbits=20", ValueError, r"parameter nbits must lie in \[1, 16\]; got 20"),
    ("faiss-ivfpq:nprob=3", ValueError, r"valid: center, k_factor, m, nbits, nlist, nprobe"),
    ("faiss-flat:center=maybe", TypeError, r"^faiss-flat: parameter center must be a bool \(true/false\); "
                                           r"got 'maybe'\.$"),
    ("kdtree:eps=-1", ValueError, r"^kdtree: parameter eps must be >= 0; got -1\.0\.$"),
    ("lsh:family=foo", ValueError, r"^lsh: parameter family must be one of 'crosspolytope', 'simhash'; "
                                   r"got 'foo'\.$"),
    ("angular-lsh:n_buckets=3", ValueError, r"^angular-lsh: parameter n_buckets must be an even integer >= 2"),
    ("cluster:n_probe=5,n_clusters=2", ValueError, r"^cluster: n_probe must be <= n_clusters; got n_probe=5 > "
                                                   r"n_clusters=2\."),
    ("sinks:g=2,positions=1", ValueError, r"^sinks: give either g or positions, not both"),
    ("window:width", ValueError, r"^selector spec 'window:width': parameter 'width' must look like name=value \("),
    ("", ValueError, r"^selector spec must be a non-empty string like 'faiss-hnsw:M=32'; got ''\.$"),
])
def test_bad_parameter_values(spec, etype, msg):
    with pytest.raises(etype, match=msg):
        get_selector(spec)


@pytest.mark.parametrize("spec,S,msg", [
    ("faiss-ivfpq:m=3,nbits=2", 40, r"^selector 'faiss-ivfpq' cannot run here: m=3 PQ sub-quantizers must divide "
                                    r"the key dimension E=8; valid m for E=8: 1, 2, 4, 8\."),
    ("faiss-ivfpq:m=2", 40, r"cannot run here: nbits=8 needs at least 2\*\*nbits = 256 keys to train the PQ "
                            r"codebooks; got S=40"),
    ("faiss-ivf:nlist=50", 40, r"cannot run here: nlist=50 exceeds the number of keys S=40"),
    ("kdtree:pca_dim=8", 40, r"cannot run here: pca_dim=8 must be < E=8 \(the key dimension\)"),
    ("cluster:n_clusters=50", 40, r"cannot run here: n_clusters=50 > n_keys=40"),
])
def test_bad_parameter_values_for_the_data(rng, spec, S, msg):
    with pytest.raises(ValueError, match=msg):
        get_selector(spec).build(rng.standard_normal((S, 8)))


# -------------------------------------------------------------------------------- patterns
@pytest.mark.parametrize("indptr,indices,etype,msg", [
    ([0, 2], [0, 7], ValueError, r"invalid SparsePattern: row 0 has key id 7, outside \[0, n_keys\) "
                                 r"\(n_queries=1, n_keys=7\)"),
    ([0, 1, 2], [1, -1], ValueError, r"invalid SparsePattern: row 1 has key id -1, outside \[0, n_keys\)"),
    ([0, 3], [1, 2, 2], ValueError, r"invalid SparsePattern: row 0 has duplicate key id 2"),
    ([0, 2], [3, 1], ValueError, r"invalid SparsePattern: row 0 is not sorted ascending \(at key id 1\)"),
    ([1, 2], [0, 1], ValueError, r"invalid SparsePattern: indptr\[0\] must be 0; got 1"),
    ([0, 2, 1], [0, 1], ValueError, r"invalid SparsePattern: indptr must be non-decreasing"),
    ([0, 1], [0, 1], ValueError, r"invalid SparsePattern: indptr\[-1\] must equal len\(indices\)"),
    ([0, 1], [0.0], TypeError, r"indices must be an integer array; got dtype float64"),
    ([], np.zeros(0, np.int32), ValueError, r"indptr must have length L \+ 1 >= 1; got an empty array"),
])
def test_invalid_csr_is_rejected(indptr, indices, etype, msg):
    with pytest.raises(etype, match=msg):
        SparsePattern(np.array(indptr, dtype=np.int64), np.asarray(indices), 7)


def test_invalid_pattern_constructor_input():
    with pytest.raises(ValueError, match=r"rows contain key ids outside \[0, n_keys=5\)"):
        SparsePattern.from_rows([[0, 5]], 5)
    with pytest.raises(ValueError, match=r"rows contain key ids outside \[0, n_keys=5\)"):
        SparsePattern.from_rows([[-1]], 5)
    with pytest.raises(ValueError, match=r"ids\[1\] contains 5: ids must be -1 \(no key\) or in \[0, n_keys=5\)"):
        SparsePattern.from_padded(np.array([[0, -1], [5, 1]]), 5)
    with pytest.raises(ValueError, match=r"ids\[0\] contains -2"):
        SparsePattern.from_padded(np.array([[-2]]), 5)
    with pytest.raises(ValueError, match=r"n_keys must be >= 0; got -1"):
        SparsePattern.full(3, -1)
    # duplicates in constructor *input* are merged (documented), never passed on
    assert SparsePattern.from_padded(np.array([[3, 3, -1, 1]]), 5).row(0).tolist() == [1, 3]
    assert SparsePattern.from_rows([[4, 0, 4]], 5).row(0).tolist() == [0, 4]


# -------------------------------------------------------------------------------- layouts
def _layouts(x):
    """Equal-valued views of x: strided, Fortran order, negative strides, read-only."""
    strided = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)[..., ::2]
    strided[...] = x
    reversed_ = np.ascontiguousarray(x[..., ::-1, :])[..., ::-1, :]
    ro = x.copy()
    ro.flags.writeable = False
    ro_strided = strided.copy()[..., ::1]
    ro_strided = np.asfortranarray(ro_strided)
    ro_strided.flags.writeable = False
    return {"strided": strided, "fortran": np.asfortranarray(x), "negative": reversed_, "readonly": ro,
            "readonly-fortran": ro_strided}


@pytest.mark.parametrize("layout", ["strided", "fortran", "negative", "readonly", "readonly-fortran"])
def test_non_contiguous_and_read_only_dense_sparse(rng, layout):
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 6, 8), (2, 9, 8), (2, 9, 4)))
    mask = rng.random((6, 9)) < 0.6
    odd = [_layouts(a)[layout] for a in (q, k, v)]
    assert all(np.array_equal(a, b) for a, b in zip(odd, (q, k, v), strict=True))
    m_odd = _layouts(mask)[layout]
    np.testing.assert_array_equal(dense(*odd, attn_mask=m_odd, is_causal=True),
                                  dense(q, k, v, attn_mask=mask, is_causal=True))
    p = SparsePattern.from_mask(m_odd)
    np.testing.assert_array_equal(sparse(*odd, pattern=p), sparse(q, k, v, pattern=SparsePattern.from_mask(mask)))
    np.testing.assert_array_equal(sa.sparse_attention(*odd, "window:width=3+topk", k=2, is_causal=True),
                                  sa.sparse_attention(q, k, v, "window:width=3+topk", k=2, is_causal=True))


@pytest.mark.parametrize("spec", _specs())
@pytest.mark.parametrize("layout", ["strided", "readonly-fortran", "negative"])
def test_non_contiguous_and_read_only_selectors(rng, spec, layout):
    keys = rng.standard_normal((40, 8)).astype(np.float32)
    q = rng.standard_normal((12, 8)).astype(np.float32)
    want = get_selector(spec).build(keys).query(q, 4, is_causal=True)
    got = get_selector(spec).build(_layouts(keys)[layout]).query(_layouts(q)[layout], 4, is_causal=True)
    assert got == want


def test_read_only_pattern_arrays(rng):
    p = SparsePattern.window(6, 9, 3)
    indptr, indices = p.indptr.copy(), p.indices.copy()
    indptr.flags.writeable = indices.flags.writeable = False
    ro = SparsePattern(indptr, indices, 9)
    q, k, v = (rng.standard_normal(s) for s in ((6, 4), (9, 4), (9, 2)))
    np.testing.assert_array_equal(sa.sparse_attention(q, k, v, ro), sa.sparse_attention(q, k, v, p))
    assert ro.union(SparsePattern.full(6, 9, is_causal=True)).causal() == SparsePattern.full(6, 9, is_causal=True)


# -------------------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize("spec", _specs())
def test_query_before_build_raises(rng, spec):
    sel = get_selector(spec)
    with pytest.raises(RuntimeError, match=rf"selector '{sel.name}' is not built: call build\(keys\)"):
        sel.query(rng.standard_normal((3, 8)), 2)


def test_cluster_attend_and_faiss_add_before_build(rng):
    with pytest.raises(RuntimeError, match=r"selector 'cluster' is not built: call build\(keys\) (first|before)"):
        get_selector("cluster").attend(rng.standard_normal((3, 8)), rng.standard_normal((5, 2)))
    with pytest.raises(RuntimeError, match=r"selector 'faiss-flat' is not built: call build\(keys\) before add"):
        get_selector("faiss-flat").add(rng.standard_normal((3, 8)))


# -------------------------------------------------------------------------------- spec strings
def test_union_spec_parses_and_round_trips(rng):
    spec = "window:width=8+sinks:g=2"
    assert parse_spec(spec) == [("window", {"width": "8"}), ("sinks", {"g": "2"})]
    sel = get_selector(spec)
    assert [c.name for c in sel.children] == ["window", "sinks"]
    assert sel.params == {"window": {"width": 8, "dilation": 1}, "sinks": {"g": 2, "positions": None}}
    text = spec_string(sel)
    assert text == "window:width=8,dilation=1+sinks:g=2"
    again = get_selector(text)
    assert spec_string(again) == text and again.params == sel.params
    keys, q = rng.standard_normal((30, 4)), rng.standard_normal((30, 4))
    for causal in (False, True):
        want = SparsePattern.window(30, 30, 8, is_causal=causal) | SparsePattern.from_rows([[0, 1]] * 30, 30)
        if causal:
            want = want.causal()
        assert sel.build(keys).query(q, 5, is_causal=causal) == want
        assert again.build(keys).query(q, 5, is_causal=causal) == want
    with pytest.raises(ValueError, match=r"keyword parameters are ambiguous for a union spec; put them in the "
                                         r"string"):
        get_selector(spec, width=3)


@pytest.mark.parametrize("spec", [p.values[0] for p in _specs(extra=(
    UNION, "sinks:positions=0;5;9", "angular-lsh:order=position,rerank=false",
    "kdtree:eps=0.25,pca_dim=4,candidates=12", "window:width=4,dilation=2+faiss-hnsw:M=8,ef_search=16"))])
def test_spec_string_round_trips(spec):
    sel = get_selector(spec)
    text = spec_string(sel)
    again = get_selector(text)
    assert spec_string(again) == text
    assert again.params == sel.params
    assert repr(sel) == text


# -------------------------------------------------------------------------------- threads
@pytest.mark.parametrize("n,etype,msg", [
    (0, ValueError, r"^n must be >= 1; got 0\.$"),
    (-1, ValueError, r"^n must be >= 1; got -1\.$"),
    (1.5, TypeError, r"^n must be an integer >= 1; got 1\.5 \(float\)\.$"),
    (True, TypeError, r"^n must be an integer >= 1; got True \(bool\)\.$"),
    (10_000, ValueError, r"^n=10000 exceeds the \d+ threads Numba was started with"),
])
def test_bad_thread_counts(n, etype, msg):
    before = sa.get_num_threads()
    with pytest.raises(etype, match=msg), sa.threads(n):
        pass  # pragma: no cover - never entered
    assert sa.get_num_threads() == before


def test_threads_restores_after_an_exception():
    before = sa.get_num_threads()
    with pytest.raises(KeyError, match="boom"), sa.threads(1):
        assert sa.get_num_threads() == 1
        raise KeyError("boom")
    assert sa.get_num_threads() == before


def test_uint64_positions_beyond_int64_are_refused_not_wrapped(qkv):
    # 2**63 cast to int64 is -2**63: the latest position would become the earliest, silently
    q, k, v = qkv
    S = k.shape[-2]
    kpos = np.arange(S, dtype=np.uint64)
    kpos[-1] = np.uint64(2**63)
    with pytest.raises(ValueError, match="key_positions must fit in int64"):
        sa.sparse_attention(q, k, v, "window:width=4", is_causal=True, key_positions=kpos)
    fine = np.arange(S, dtype=np.uint64)  # in range: accepted, same result as int64
    np.testing.assert_array_equal(
        sa.sparse_attention(q, k, v, "window:width=4", is_causal=True, key_positions=fine),
        sa.sparse_attention(q, k, v, "window:width=4", is_causal=True, key_positions=fine.astype(np.int64)))
