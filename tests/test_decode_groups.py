"""The decode kernel's grouped rows: the query heads of a kv head read its exact keys and values once per
group (``MODE_NONE`` and the one-sweep ``MODE_LIST``).  Oracles: float64 attention over the slots a row
reads, and the per-row kernel (``Qg = 1``), an independent code path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn.decode.plan as plan_mod
from sparseattn.cache import KVCache, Layout, Retention
from sparseattn.decode.plan import group_size
from sparseattn.kernels import decode as kd


def _attend64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    s = k.astype(np.float64) @ q.astype(np.float64) * scale
    w = np.exp(s - s.max())
    return w @ v.astype(np.float64) / w.sum()


def _step(cache: KVCache, q: np.ndarray, monkeypatch: pytest.MonkeyPatch, qg: int | None) -> np.ndarray:
    """``cache.attend(q)`` with the kernel's group size forced to ``qg`` (None: the cache's own choice)."""
    with monkeypatch.context() as m:
        if qg is not None:
            m.setattr(plan_mod, "group_size", lambda *a: qg)
        return cache.attend(q)


def test_group_size_rule() -> None:
    assert group_size(4, 1, 2) == 2  # one kv head, two workers: two groups of two heads
    assert group_size(4, 1, 1) == 4
    assert group_size(3, 3, 2) == 3  # three kv heads already feed two workers
    assert group_size(1, 8, 2) == 1
    assert group_size(6, 1, 4) == 1  # no divisor of 6 leaves four groups but 1
    assert group_size(6, 2, 4) == 3


@settings(max_examples=25, deadline=None)
@given(hk=st.sampled_from([1, 2, 3]), rep=st.sampled_from([2, 3, 4]), T=st.integers(1, 3),
       selector=st.sampled_from(["dense", "window", "sketch:candidates=48"]),
       dtype=st.sampled_from(["float32", "float16", "bfloat16"]), parallel=st.booleans(),
       seed=st.integers(0, 2**16))
def test_grouped_rows_equal_float64_over_the_read_slots(hk: int, rep: int, T: int, selector: str, dtype: str,
                                                         parallel: bool, seed: int) -> None:
    # every row (query head, token) equals float64 attention over the slots it reads: all visible keys
    # (dense), the sinks and window (window), or the sinks, window, unclustered tail and its own candidates
    # (sketch, listed mode at 3,000 keys); and equals the per-row kernel to float32 summation order
    rng = np.random.default_rng(seed)
    h, E, n = hk * rep, 16, 3000
    K = rng.standard_normal((hk, n, E)).astype(np.float32)
    V = rng.standard_normal((hk, n, E)).astype(np.float32)
    cache = KVCache(h, E, num_kv_heads=hk, selector=selector, dtype=dtype if dtype != "float32" else np.float32,
                    retention=Retention(sinks=4, window=32), layout=Layout(segment=256, cluster_size=16),
                    parallel=parallel)
    cache.append(K, V)
    q = (rng.standard_normal((h, T, E)) * 2).astype(np.float32)
    mp = pytest.MonkeyPatch()
    grouped = _step(cache, q, mp, None)
    per_row = _step(cache, q, mp, 1)
    np.testing.assert_allclose(grouped, per_row, rtol=1e-5, atol=2e-6)
    qpos = np.arange(n - T, n)  # the last T positions (the cache's rule for T new queries)
    ks_, vs_ = [cache.store.keys(g) for g in range(hk)], [cache.store.values(g) for g in range(hk)]
    for i in range(h):
        g = i // rep
        for t in range(T):
            if selector == "sketch:candidates=48":
                if t:
                    continue  # selected_slots answers for the last position only
                sel = np.asarray(cache.selected_slots(q[i, -1], i))
                want = _attend64(q[i, -1], ks_[g][sel], vs_[g][sel], cache.scale)
                np.testing.assert_allclose(grouped[i, -1], want, rtol=2e-4, atol=2e-4)
                continue
            vis = np.arange(qpos[t] + 1)
            if selector == "window":
                vis = np.union1d(vis[:4], vis[max(0, qpos[t] + 1 - 32):])  # sinks + the window up to the row
            want = _attend64(q[i, t], ks_[g][vis], vs_[g][vis], cache.scale)
            np.testing.assert_allclose(grouped[i, t], want, rtol=2e-4, atol=2e-4)


def test_kernel_gets_the_rule_group_size_and_rows_count_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernel receives the group size of the rule; the keys-read count per row is that of the per-row path
    seen = []
    real = kd.decode_serial

    def spy(*args):  # noqa: ANN002
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(kd, "decode_serial", spy)
    rng = np.random.default_rng(0)
    K = rng.standard_normal((1, 500, 8)).astype(np.float32)
    cache = KVCache(4, 8, num_kv_heads=1, selector="dense", parallel=False)
    cache.append(K, K)
    cache.attend(rng.standard_normal((4, 1, 8)).astype(np.float32))
    assert seen == [4]  # serial: the four heads of the kv head as one group
    assert cache.stats["keys_read_per_query"] == 500


def test_overflow_in_one_head_of_a_group_is_reported_and_spares_the_others() -> None:
    # a head whose scores overflow float32 gets NaN and lse = +inf; the other heads of its group are exact
    rng = np.random.default_rng(1)
    E, n = 8, 300
    K = (rng.standard_normal((1, n, E)) * 10).astype(np.float32)
    V = rng.standard_normal((1, n, E)).astype(np.float32)
    q = rng.standard_normal((4, 1, E)).astype(np.float32)
    q[2] = np.float32(3e38)  # finite, but q . k is not
    cache = KVCache(4, E, num_kv_heads=1, selector="dense", parallel=False)
    cache.append(K, V)
    with pytest.raises(ValueError, match="overflow"):
        cache.attend(q)
    st_ = cache.store
    res = plan_mod.run_plan(st_, plan_mod.StepPlan(kd.MODE_NONE, st_.s0, st_.s0, st_.slots, work=4 * n), q,
                            np.array([n - 1]), scale=cache.scale, parallel=False)
    assert np.isinf(res.lse[2, 0]) and res.lse[2, 0] > 0 and np.isnan(res.out[2, 0]).all()
    for i in (0, 1, 3):
        np.testing.assert_allclose(res.out[i, 0], _attend64(q[i, 0], K[0], V[0], cache.scale), rtol=2e-4,
                                   atol=2e-5)
