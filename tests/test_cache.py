"""KVCache: equivalence with float64 dense attention when the selection is full, GQA, causality, segment
boundaries, reduced-precision storage, the memory cap, bad input, empty cache, torch in/out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseattn.cache import Budget, KVCache, Layout, Retention, bf16_bits, bf16_to_f32, group_options

H, HKV, E, EV = 4, 2, 16, 8
SEG = 64  # small segments: several of them in a few hundred keys


def _kv(n: int, seed: int = 0, hkv: int = HKV, e: int = E, ev: int = EV) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hkv, n, e)).astype(np.float32),
            rng.standard_normal((hkv, n, ev)).astype(np.float32))


def _q(t: int, seed: int = 1, h: int = H, e: int = E) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((h, t, e)).astype(np.float32)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, *, keep: np.ndarray | None = None,
              scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of the T newest positions over keys [0, n) (causal), optionally only ``keep``."""
    Hq, T, e = q.shape
    rep = Hq // k.shape[0]
    sc = 1 / np.sqrt(e) if scale is None else scale
    out = np.zeros((Hq, T, v.shape[2]))
    lse = np.full((Hq, T), -np.inf)
    allowed = np.ones(n, bool) if keep is None else np.isin(np.arange(n), keep)
    for h in range(Hq):
        s = q[h].astype(np.float64) @ k[h // rep, :n].T.astype(np.float64) * sc
        for t in range(T):
            mask = allowed & (np.arange(n) <= n - T + t)
            if not mask.any():
                continue
            row = np.where(mask, s[t], -np.inf)
            m = row.max()
            w = np.exp(row - m)
            out[h, t] = w @ v[h // rep, :n] / w.sum()
            lse[h, t] = m + np.log(w.sum())
    return out, lse


FULL = {
    "cluster": dict(selector="cluster", segment=SEG, cluster_size=8, n_probe=10_000),
    "pages": dict(selector="pages", segment=SEG, n_probe=10_000),
    "topk": dict(selector="topk"),
    "dense": dict(selector="dense"),
}


@pytest.mark.parametrize("name", sorted(FULL))
@pytest.mark.parametrize("n", [1, 5, 70, 300])
def test_full_selection_matches_float64_dense(name: str, n: int) -> None:
    k, v = _kv(n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, **group_options(FULL[name]))
    cache.append(k, v)
    q = _q(3)
    if n < 3:  # a query token needs a position: more tokens than positions is refused
        with pytest.raises(ValueError, match=f"queries hold T_q=3 tokens but only {n} positions"):
            cache.attend(q, k=10_000)
        q = q[:, :n]
    out, lse = cache.attend(q, k=10_000, return_lse=True)
    ref, ref_lse = reference(q, k, v, n)
    assert out.shape == (H, q.shape[1], EV) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=2e-5)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=2e-5)
    assert np.all(np.isneginf(lse[~fin])) and np.all(out[~fin] == 0)
    assert len(cache) == n


def test_cluster_segments_clustered_and_exact_part() -> None:
    n = 5 * SEG + 100
    k, v = _kv(n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster", retention=Retention(window=16),
                    layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=2))
    cache.append(k, v)
    st_ = cache.stats
    assert st_["segments"] == (n - 4 - 16) // SEG  # the tail keeps >= window keys unclustered
    assert 16 <= st_["tail_keys"] < SEG // 2 + 16  # the open segment takes the rest
    assert st_["open_segment_keys"] in (0, SEG // 2)
    cache.attend(_q(1))
    # sinks + tail exactly, plus at most 2 clusters per query
    assert cache.stats["keys_read_per_query"] >= 4 + st_["tail_keys"]


def test_window_selector_reads_sinks_and_window_only() -> None:
    n = 300
    k, v = _kv(n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="window",
                    retention=Retention(sinks=4, window=32))
    cache.append(k, v)
    q = _q(1)
    out = cache.attend(q)
    keep = np.r_[np.arange(4), np.arange(n - 32, n)]
    np.testing.assert_allclose(out, reference(q, k, v, n, keep=keep)[0], atol=2e-5)
    assert cache.stats["keys_read_per_query"] == 36


def test_topk_selector_is_exact_topk() -> None:
    n = 200
    k, v = _kv(n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="topk")
    cache.append(k, v)
    q = _q(1)
    out = cache.attend(q, k=10)
    ref = np.zeros((H, 1, EV))
    for h in range(H):
        s = k[h // 2] @ q[h, 0]
        top = np.argsort(-s)[:10]
        ref[h] = reference(q[h:h + 1], k[h // 2:h // 2 + 1], v[h // 2:h // 2 + 1], n, keep=top)[0][0]
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_gqa_head_mapping() -> None:
    n = 150
    k, v = _kv(n, hkv=2)
    cache = KVCache(8, E, num_kv_heads=2, value_dim=EV, selector="dense")
    cache.append(k, v)
    q = _q(2, h=8)
    out = cache.attend(q)
    np.testing.assert_allclose(out, reference(q, k, v, n)[0], atol=2e-5)  # head h reads kv head h // 4
    assert not np.allclose(out[3], out[4])


@pytest.mark.parametrize("name", ["cluster", "pages", "window", "topk"])
def test_causal_multi_token_queries(name: str) -> None:
    n, T = 400, 6
    k, v = _kv(n)
    k2, v2 = k.copy(), v.copy()
    k2[:, n - 2:] += 5.0  # the last two positions differ
    v2[:, n - 2:] -= 3.0
    q = _q(T)
    outs = []
    for kk, vv in ((k, v), (k2, v2)):
        cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=name, retention=Retention(window=16),
                        layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3))
        cache.append(kk[:, :n - T], vv[:, :n - T])
        cache.append(kk[:, n - T:], vv[:, n - T:])
        outs.append(cache.attend(q, k=8))
    np.testing.assert_array_equal(outs[0][:, :T - 2], outs[1][:, :T - 2])  # rows before the change
    assert not np.allclose(outs[0][:, T - 1], outs[1][:, T - 1])


@pytest.mark.parametrize("name", ["cluster", "pages"])
def test_segment_boundaries_piecewise_equals_one_append(name: str) -> None:
    n = 1 + (SEG - 1) + (3 * SEG + 5) + 40
    k, v = _kv(n, seed=3)
    kw = dict(num_kv_heads=HKV, value_dim=EV, selector=name, segment=SEG, cluster_size=8, n_probe=3,
              window=8)
    whole = KVCache(H, E, **group_options(kw))
    whole.append(k, v)
    pieces = KVCache(H, E, **group_options(kw))
    a = 0
    for size in (1, SEG - 1, 3 * SEG + 5, 1, 1, 38):
        pieces.append(k[:, a:a + size], v[:, a:a + size])
        a += size
    assert a == n and len(pieces) == len(whole) == n
    q = _q(2)
    np.testing.assert_array_equal(whole.attend(q), pieces.attend(q))
    assert whole.stats["segments"] == pieces.stats["segments"]


@pytest.mark.parametrize("storage,tol", [(np.float16, 2e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("name", ["cluster", "pages", "dense", "topk", "window"])
def test_reduced_precision_storage(storage: object, tol: float, name: str) -> None:
    n = 300
    k, v = _kv(n)
    kw = dict(num_kv_heads=HKV, value_dim=EV, selector=name, segment=SEG, cluster_size=8, n_probe=10_000)
    lo = KVCache(H, E, dtype=storage, **group_options(kw))
    lo.append(k, v)
    q = _q(2)
    out = lo.attend(q, k=10_000)
    # exact on the rounded keys and values (float32 accumulation) ...
    if storage == "bfloat16":
        kr, vr = bf16_to_f32(bf16_bits(k)), bf16_to_f32(bf16_bits(v))
    else:
        kr, vr = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    if name in ("cluster", "pages", "dense", "topk"):
        np.testing.assert_allclose(out, reference(q, kr, vr, n)[0], atol=3e-5)
    # ... and within the storage rounding of float32 storage
    hi = KVCache(H, E, **group_options(kw))
    hi.append(k, v)
    assert np.abs(out - hi.attend(q, k=10_000)).max() < tol
    assert lo.kv_nbytes * 2 == hi.kv_nbytes


def test_bf16_rounding_is_nearest_even() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, 1e-30], np.float32)
    back = bf16_to_f32(bf16_bits(x))
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == np.float32(1.015625)
    assert back[3] == -2.5
    assert np.all(np.abs(back - x) <= np.abs(x) * 2**-8)


@pytest.mark.parametrize("name", ["cluster", "pages", "window", "dense"])
def test_memory_cap_streaming(name: str) -> None:
    n, cap = 1000, 200
    k, v = _kv(n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=name,
                    retention=Retention(max_keys=cap, sinks=4, window=16),
                    layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=10_000))
    for a in range(0, n, 37):
        cache.append(k[:, a:a + 37], v[:, a:a + 37])
    keep = np.r_[np.arange(4), np.arange(n - (cap - 4), n)]
    assert len(cache) == cap
    assert cache.positions_appended == n
    for g in range(HKV):
        np.testing.assert_array_equal(cache.positions(g), keep)
    # storage freed by compaction once a segment's worth is evicted: fewer than cap + segment slots held
    assert cache.stats["slots"] < cap + SEG
    assert cache.kv_nbytes == cache.stats["slots"] * HKV * (E + EV) * 4
    q = _q(2)
    out = cache.attend(q)
    if name != "window":
        np.testing.assert_allclose(out, reference(q, k, v, n, keep=keep)[0], atol=2e-5)
    assert cache.stats["evicted_keys"] == n - cap


def test_query_tokens_without_positions_are_refused() -> None:
    """Query t sits at position n - T_q + t: more query tokens than positions appended is a caller error
    (an empty cache included), refused naming the argument instead of returning rows of zeros."""
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    with pytest.raises(ValueError, match=r"queries hold T_q=2 tokens but only 0 positions were appended"):
        cache.attend(_q(2), return_lse=True)
    assert len(cache) == 0
    cache.append(*_kv(1))
    with pytest.raises(ValueError, match=r"T_q=2 tokens but only 1 positions"):
        cache.attend(_q(2), return_lse=True)
    out, lse = cache.attend(_q(1), return_lse=True)  # as many tokens as positions: every row sees a key
    assert np.all(np.isfinite(lse)) and out.shape == (H, 1, EV)


def test_single_token_query_2d() -> None:
    k, v = _kv(50)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    cache.append(k, v)
    q = _q(1)
    out, lse = cache.attend(q[:, 0], return_lse=True)
    assert out.shape == (H, EV) and lse.shape == (H,)
    np.testing.assert_array_equal(out, cache.attend(q)[:, 0])


@pytest.mark.parametrize("bad,match", [
    (lambda c, k, v: c.append(k[:1], v[:1]), "keys must have shape"),
    (lambda c, k, v: c.append(k[..., :3], v), "keys must have shape"),
    (lambda c, k, v: c.append(k, v[..., :3]), "values must have shape"),
    (lambda c, k, v: c.append(k, v[:, :5]), "same number of tokens"),
    (lambda c, k, v: c.append(k[:, :0], v[:, :0]), "T >= 1"),
    (lambda c, k, v: c.append(np.where(k > 1, np.nan, k), v), "keys contains NaN"),
    (lambda c, k, v: c.append(k, np.where(v > 1, np.inf, v)), "values contains NaN"),
    (lambda c, k, v: c.attend(np.zeros((H + 1, 1, E), np.float32)), "queries must have shape"),
    (lambda c, k, v: c.attend(np.zeros((H, 1, E + 1), np.float32)), "queries must have shape"),
    (lambda c, k, v: c.attend(np.full((H, 1, E), np.nan, np.float32)), "queries contains NaN"),
])
def test_bad_input_names_the_argument(bad, match: str) -> None:
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    k, v = _kv(10)
    with pytest.raises(ValueError, match=match):
        bad(cache, k, v)
    assert len(cache) == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(selector="nope"), "selector must be one of"),
    (dict(dtype=np.int8), "dtype must be"),
    (dict(policy="h3o"), "policy must be one of"),
    (dict(max_keys=10, window=64), "max_keys"),
    (dict(segment=100, page_size=16), "multiple of page_size"),
    (dict(scale=-1.0), "scale must be > 0"),
])
def test_bad_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVCache(H, E, **group_options(kwargs))


@pytest.mark.parametrize("spec, where", [("cluster:n_probe=8", r"budget=Budget\(n_probe="),
                                         ("window:width=8", r"retention=Retention\(sinks=\.\.\., window="),
                                         ("pages:n_probe=3", r"layout=Layout\(page_size="),
                                         ("topk:k=4", r"its k is attend\(k=\.\.\.\)"),
                                         ("dense:x=1", "it has no parameters")])
def test_own_selector_with_spec_options_points_at_where_its_parameters_go(spec: str, where: str) -> None:
    name = spec.split(":")[0]
    with pytest.raises(ValueError, match=rf"the cache's '{name}' selector takes no options in its spec string "
                                         rf"\(only 'sketch' does.*{where}"):
        KVCache(H, E, selector=spec)


def test_integer_inputs_rejected() -> None:
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    with pytest.raises(TypeError, match="keys must have dtype"):
        cache.append(np.zeros((HKV, 2, E), np.int32), np.zeros((HKV, 2, EV), np.float32))


def test_overflow_raises() -> None:
    cache = KVCache(1, 4, selector="dense")
    cache.append(np.full((1, 2, 4), 1e30, np.float32), np.ones((1, 2, 4), np.float32))
    with pytest.raises(ValueError, match="overflow"):
        cache.attend(np.full((1, 1, 4), 1e30, np.float32))


@pytest.mark.parametrize("score, warns", [(2.0**22, True), (-(2.0**22), True), (3e9, True),
                                          (2.0**22 - 1, False), (-(2.0**22 - 1), False), (100.0, False)])
def test_scores_float32_cannot_resolve_warn_naming_the_fix(score: float, warns: bool) -> None:
    """One key, scale 1: the step's lse is the score itself.  From |score| = 2**22 float32 spaces scores
    0.5 or more apart (softmax weights uncertain by e**0.25 and more): a RuntimeWarning says so and names
    the fix; below it nothing is said.  The output is the one value either way."""
    import warnings

    c = KVCache(1, 4, selector="dense", scale=1.0)
    c.append(np.array([[[1.0, 0, 0, 0]]], np.float32), np.array([[[2.0, -3.0, 0, 1.0]]], np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = c.attend(np.array([[[score, 0, 0, 0]]], np.float32), return_lse=True)
    mine = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert float(lse[0, 0]) == np.float32(score)
    np.testing.assert_array_equal(out[0, 0], [2.0, -3.0, 0, 1.0])
    if warns:
        assert len(mine) == 1, [str(w.message) for w in caught]
        msg = str(mine[0].message)
        assert "float32 spaces its values" in msg and "scale the keys or queries down" in msg
        assert mine[0].filename == __file__  # points at the caller's attend
    else:
        assert not mine, [str(w.message) for w in mine]


def test_default_cache_warns_when_scores_outgrow_float32_resolution() -> None:
    """The default selector on keys and queries of magnitude 1e4 (scores ~1e8): the warning is raised;
    at magnitude 1 it is not."""
    import warnings

    rng = np.random.default_rng(3)
    for mag, warns in ((1e4, True), (1.0, False)):
        c = KVCache(2, 64)
        c.append((rng.standard_normal((2, 300, 64)) * mag).astype(np.float32),
                 rng.standard_normal((2, 300, 64)).astype(np.float32))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = c.attend((rng.standard_normal((2, 1, 64)) * mag).astype(np.float32))
        assert np.isfinite(out).all()
        assert any("float32 spaces" in str(w.message) for w in caught) == warns


def test_float16_range_overflow_on_append() -> None:
    cache = KVCache(1, 4, dtype=np.float16)
    with pytest.raises(ValueError, match="float16"):
        cache.append(np.full((1, 2, 4), 1e6, np.float32), np.ones((1, 2, 4), np.float32))


def test_torch_tensors_in_and_out() -> None:
    torch = pytest.importorskip("torch")
    k, v = _kv(120)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector="cluster",
                    layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=10_000))
    cache.append(torch.from_numpy(k), torch.from_numpy(v).to(torch.bfloat16))
    q = _q(1)
    out, lse = cache.attend(torch.from_numpy(q), return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == torch.float32 and tuple(out.shape) == (H, 1, EV)
    vb = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
    np.testing.assert_allclose(out.numpy(), reference(q, k, vb, 120)[0], atol=2e-5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q)[None], torch.from_numpy(k).repeat_interleave(2, 0)[None],
        torch.from_numpy(vb).repeat_interleave(2, 0)[None])
    np.testing.assert_allclose(out.numpy(), ref[0].numpy(), atol=2e-5)



@pytest.mark.parametrize("dtype", ["int64", "float8_e4m3fn", "complex64", "bool"])
def test_torch_tensors_of_other_dtypes_are_refused_naming_the_argument(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    if not hasattr(torch, dtype):
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV)
    k, v = _kv(3)
    bad = torch.zeros(k.shape).to(getattr(torch, dtype))
    with pytest.raises(TypeError, match="keys must have dtype float16, bfloat16, float32 or float64"):
        cache.append(bad, torch.from_numpy(v))
    cache.append(k, v)
    with pytest.raises(TypeError, match="queries must have dtype"):
        cache.attend(torch.zeros((H, 1, E)).to(getattr(torch, dtype)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 260), t=st.integers(1, 4), sinks=st.integers(0, 6), window=st.integers(0, 40),
       chunk=st.integers(1, 97), name=st.sampled_from(["cluster", "pages", "dense"]))
def test_full_selection_property(n: int, t: int, sinks: int, window: int, chunk: int, name: str) -> None:
    k, v = _kv(n, seed=n)
    cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, selector=name,
                    retention=Retention(sinks=sinks, window=window),
                    layout=Layout(segment=32, cluster_size=4), budget=Budget(n_probe=10_000))
    for a in range(0, n, chunk):
        cache.append(k[:, a:a + chunk], v[:, a:a + chunk])
    q = _q(min(t, n), seed=t)  # a query token needs a position (more are refused)
    out = cache.attend(q)
    np.testing.assert_allclose(out, reference(q, k, v, n)[0], atol=3e-5)


@pytest.mark.parametrize("storage", [np.float32, "bfloat16"])
def test_parallel_and_serial_kernels_agree(storage: object) -> None:
    n = 5 * SEG + 30
    k, v = _kv(n)
    q = _q(3)
    outs = []
    for parallel in (False, True):
        cache = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, dtype=storage, parallel=parallel,
                        selector="cluster", layout=Layout(segment=SEG, cluster_size=8),
                        budget=Budget(n_probe=3))
        cache.append(k, v)
        outs.append(cache.attend(q, return_lse=True))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_selected_slots_match_keys_read() -> None:
    n = 6 * SEG + 10
    k, v = _kv(n)
    for name in ("cluster", "pages", "window", "topk"):
        cache = KVCache(H, E, num_kv_heads=1, value_dim=EV, selector=name,
                        layout=Layout(segment=SEG, cluster_size=8), budget=Budget(n_probe=3))
        cache.append(k[:1], v[:1])  # every query head reads kv head 0
        q = _q(1)
        cache.attend(q[:1].repeat(H, 0), k=20)
        sel = cache.selected_slots(q[0, 0], 0, k=20)
        assert sel.size == cache.stats["keys_read_max"]
        # attention over exactly those keys reproduces the step
        keep = cache.debug_view()["positions"][0, sel]
        ref = reference(q[:1], k[:1], v[:1], n, keep=keep)[0]
        np.testing.assert_allclose(cache.attend(q[:1].repeat(H, 0), k=20)[0], ref[0], atol=2e-5)


@pytest.mark.parametrize("kmag,vmag", [(1e-40, 1.0), (1e-20, 1e30), (1.0, 1e-30), (1e10, 1.0), (1e17, 1e-20)])
@pytest.mark.parametrize("name", ["cluster", "dense", "pages"])
def test_extreme_magnitudes_match_float64(kmag: float, vmag: float, name: str) -> None:
    """Keys and values from 1e-40 (subnormal float32) to 1e30, through one-token and chunk appends: the
    output matches float64 attention over the stored (float32) keys to 1e-4 of the value scale, or the
    step raises the overflow error (never NaN or inf)."""
    n = 150
    rng = np.random.default_rng(int(-np.log10(kmag) * 7 + np.log10(vmag)) % 1000)
    k = (rng.standard_normal((HKV, n, E)) * kmag).astype(np.float32)
    v = (rng.standard_normal((HKV, n, EV)) * vmag).astype(np.float32)
    q = _q(1, seed=5)
    c = KVCache(H, E, num_kv_heads=HKV, value_dim=EV, **group_options(FULL[name]))
    c.append(k[:, :100], v[:, :100])
    for i in range(100, n):  # the one-token path
        c.append(k[:, i:i + 1], v[:, i:i + 1])
    try:
        out, lse = c.attend(q, return_lse=True)
    except ValueError as exc:  # scores beyond float32: only for the largest keys
        assert "overflow" in str(exc) and kmag >= 1e17
        return
    ref, ref_lse = reference(q, k, v, n)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, ref, atol=1e-4 * vmag * 4, rtol=1e-3)


def test_routing_codes_keep_relative_precision_at_any_magnitude() -> None:
    from sparseattn.cache import routing_codes

    rng = np.random.default_rng(9)
    means = rng.uniform(-1, 1, (6, 16)) * np.array([1e-40, 1e-10, 1.0, 1e10, 3e38, 1.0])[:, None]
    means[2] = 0.0  # an all-zero vector stays zero
    means[5] *= 0.4
    means[5, 3] = 0.5  # hand-worked: largest element 0.5 -> scale 0.5 / 127, code 127
    codes, sc = routing_codes(means.astype(np.float32))
    assert codes.dtype == np.int8 and sc.dtype == np.float32
    back = codes.astype(np.float64) * sc[:, None]
    big = np.abs(means.astype(np.float32).astype(np.float64)).max(axis=1, keepdims=True)
    assert np.isfinite(back).all() and (back[2] == 0).all()
    assert codes[5, 3] == 127 and np.isclose(sc[5], 0.5 / 127, rtol=1e-7)
    # half a code step (1/254 of the largest element) plus float32 rounding of the scale; the 1e-40 row
    # has a subnormal scale (about 3 significant digits)
    tol = big / 254 * (1 + 1e-6) + np.array([1e-3, 0, 0, 0, 0, 0])[:, None] * big
    assert (np.abs(back - means.astype(np.float32)) <= tol).all()
    assert (np.abs(codes) <= 127).all()
