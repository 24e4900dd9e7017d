"""KVCache input hardening and resource bounds: overflow of the weighted value sum, kv-head and query-token
bounds, autograd tensors, a key array passed as the budget, cumulative counters, and the memory of a
multi-token attend through an index selector."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from sparseattn.cache import KVCache, Retention


def _dense64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """float64 causal attention of q (H, T, E) at the newest T positions over k, v (H_kv, S, E)."""
    H, T, _ = q.shape
    rep = H // k.shape[0]
    S = k.shape[1]
    out = np.zeros((H, T, v.shape[2]))
    for h in range(H):
        for t in range(T):
            s = k[h // rep, :S - T + t + 1].astype(np.float64) @ q[h, t].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[h, t] = w @ v[h // rep, :S - T + t + 1].astype(np.float64) / w.sum()
    return out


def test_values_near_float32_max_are_exact_or_refused() -> None:
    c = KVCache(1, 4, selector="dense")
    c.append(np.zeros((1, 2, 4)), np.full((1, 2, 4), 2e38))
    with pytest.raises(ValueError, match="values: the step.s running sum of weighted values overflowed float32"):
        c.attend(np.zeros((1, 1, 4), np.float32))
    # scaled down as the message says, the answer is exact (the true one is 2e38)
    d = KVCache(1, 4, selector="dense")
    d.append(np.zeros((1, 2, 4)), np.full((1, 2, 4), 2e38) / 4)
    np.testing.assert_allclose(d.attend(np.zeros((1, 1, 4), np.float32)) * 4, 2e38, rtol=1e-6)
    # values that stay in range next to the large ones are unaffected
    e = KVCache(1, 4, selector="dense")
    e.append(np.zeros((1, 2, 4)), np.array([[[1e38] * 4, [-1e38] * 4]]))
    np.testing.assert_allclose(e.attend(np.zeros((1, 1, 4), np.float32)), 0.0, atol=1e32)


@pytest.mark.parametrize("head", [5, 2, -1])
def test_kv_head_out_of_range_is_a_named_error(head: int) -> None:
    c = KVCache(4, 8, num_kv_heads=2, retention=Retention(policy="h2o", max_keys=100))
    c.append(np.zeros((2, 3, 8)), np.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match=r"kv_head must be (<= 1|>= 0); got"):
        c.positions(head)
    with pytest.raises(ValueError, match=r"kv_head must be (<= 1|>= 0); got"):
        c.heavy_hitter_weights(head)
    np.testing.assert_array_equal(c.positions(1), [0, 1, 2])


def test_more_query_tokens_than_positions_is_refused() -> None:
    c = KVCache(2, 8, selector="dense")
    c.append(np.ones((2, 3, 8)), np.ones((2, 3, 8)))
    with pytest.raises(ValueError, match="queries hold T_q=4 tokens but only 3 positions were appended"):
        c.attend(np.zeros((2, 4, 8), np.float32))


def test_tensors_that_require_grad_are_refused() -> None:
    torch = pytest.importorskip("torch")
    c = KVCache(2, 8, selector="dense")
    k = torch.ones(2, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="keys requires grad while autograd is enabled"):
        c.append(k, torch.ones(2, 3, 8))
    c.append(k.detach(), torch.ones(2, 3, 8))
    q = torch.ones(2, 1, 8, requires_grad=True)
    with pytest.raises(ValueError, match="queries requires grad"):
        c.attend(q)
    with torch.no_grad():  # like sparseattn.torch: allowed where autograd is off
        out = c.attend(q)
    np.testing.assert_allclose(out.numpy(), 1.0, atol=1e-6)


def test_key_array_passed_as_k_is_refused_in_one_line() -> None:
    rng = np.random.default_rng(0)
    K = rng.standard_normal((2, 500, 8))
    c = KVCache(2, 8)
    c.append(K, K)
    with pytest.raises(TypeError, match=r"k must be an integer .* got an array of shape \(2, 500, 8\)") as info:
        c.attend(np.zeros((2, 1, 8), np.float32), K)
    assert len(str(info.value)) < 300 and "\n" not in str(info.value)
    with pytest.raises(TypeError, match=r"k must be an integer .* got an array of shape \(2, 500, 8\)"):
        c.selected_slots(np.zeros(8, np.float32), 0, K)


def test_stats_keep_cumulative_counters_and_the_last_call() -> None:
    rng = np.random.default_rng(1)
    c = KVCache(2, 8, selector="window", retention=Retention(sinks=2, window=10))
    c.append(rng.standard_normal((2, 100, 8)), rng.standard_normal((2, 100, 8)))
    c.attend(rng.standard_normal((2, 1, 8)).astype(np.float32))  # 12 keys per row, 2 rows
    c.attend(rng.standard_normal((2, 3, 8)).astype(np.float32), selector="dense")  # 98..100 keys, 6 rows
    s = c.stats
    assert s["attends"] == 2 and s["queries"] == 2 + 6
    assert s["keys_read"] == 2 * 12 + 2 * (98 + 99 + 100)
    assert s["keys_read_per_query"] == pytest.approx(99.0) and s["keys_read_min"] == 98  # the last call


@pytest.mark.parametrize("spec", ["faiss-flat", "faiss-hnsw:M=16"])
def test_index_prefill_memory_is_linear_and_exact(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-token attend through an index selector goes through the rows in blocks: its peak memory
    stays far below the (rows, candidates, E) gather (it peaked at 553 MiB here before the blocks), and the
    blocks give the same answer as one block; with k above the keys it equals float64 attention."""
    from sparseattn.decode.routing import index as index_mod

    rng = np.random.default_rng(2)
    S, T, H, HK, E = 1024, 512, 8, 2, 32
    k = rng.standard_normal((HK, S, E)).astype(np.float32)
    v = rng.standard_normal((HK, S, E)).astype(np.float32)
    q = rng.standard_normal((H, T, E)).astype(np.float32)
    c = KVCache(H, E, num_kv_heads=HK, selector=spec)
    c.append(k, v)
    c.attend(q[:, :1])
    tracemalloc.start()
    out = c.attend(q)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    gather = H * T * (64 + 64 + T + 16) * E * 4  # the candidate keys of every row at once: 172 MiB
    assert peak < gather / 4, f"peak {peak / 2**20:.0f} MiB"
    monkeypatch.setattr(index_mod, "SELECT_BLOCK_BYTES", 1 << 16)  # many small blocks
    np.testing.assert_array_equal(c.attend(q), out)
    if spec == "faiss-flat":  # exact search: every key read, the float64 answer
        np.testing.assert_allclose(c.attend(q, k=S), _dense64(q, k, v, E ** -0.5), atol=2e-5)


def test_scale_beyond_float32_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="scale must be <= 3.4e38"):
        KVCache(1, 4, scale=1e39)


def test_audit_and_selected_slots_check_queries_like_attend() -> None:
    c = KVCache(2, 4)
    with pytest.raises(ValueError, match="positions were appended"):
        c.audit(np.ones((2, 4), np.float32))  # an empty cache: attend refuses it too
    rng = np.random.default_rng(0)
    c.append(rng.standard_normal((2, 50, 4)).astype(np.float32), rng.standard_normal((2, 50, 4)).astype(np.float32))
    with pytest.raises(ValueError, match="float32's range"):
        c.audit(np.full((2, 4), 1e200))
    with pytest.raises(TypeError, match="queries must have dtype"):
        c.audit(np.ones((2, 4), np.int64))
    with pytest.raises(TypeError, match="query must have dtype"):
        c.selected_slots(np.array(list("abcd")), 0)
    with pytest.raises(ValueError, match="float32's range"):
        c.selected_slots(np.full(4, 1e300), 0)


def test_audit_recall_counts_copies_of_a_tied_key() -> None:
    # ten distinct keys, each repeated 200 times: the window step reads the newest 640 slots (64 copies of
    # each key); the exact top 64 are 64 of the 200 copies of the best key, by a stable sort the oldest
    # ones, none in the window.  Copies are the same key: recall counts the read keys tying with the
    # 64th best score, all 64 copies of the best key (it was 0)
    rng = np.random.default_rng(2)
    base = rng.standard_normal((10, 8)).astype(np.float32)
    K = np.tile(base, (200, 1))[None]
    V = rng.standard_normal((1, 2000, 8)).astype(np.float32)
    c = KVCache(1, 8, selector="window", retention=Retention(sinks=0, window=640))
    c.append(K, V)
    q = base[3] * 3
    rep = c.audit(q[None], k=64)
    assert rep["keys_read"][0] == 640
    assert rep["recall"][0] == 1.0


@pytest.mark.parametrize("mag", [1e30, 1e37])
def test_pages_selection_is_scale_invariant_up_to_float32_range(mag: float) -> None:
    # Quest page bounds scale with the keys; summed in float32 they overflowed to inf near 1e37 and the
    # ranking lost the page of the best key.  Bounds are summed in float64: the same pages as at scale 1,
    # and the step returns the best key's value as dense attention does
    import warnings

    rng = np.random.default_rng(6)
    n, E = 20000, 32
    K0 = rng.standard_normal((1, n, E)).astype(np.float32)
    V = rng.standard_normal((1, n, E)).astype(np.float32)
    q = rng.standard_normal((1, E)).astype(np.float32)
    K0[0, 7777] = q[0] / np.linalg.norm(q[0]) * 6  # clearly the best key
    ref = KVCache(1, E, selector="pages")
    ref.append(K0, V)
    c = KVCache(1, E, selector="pages")
    c.append((K0 * np.float32(mag)).astype(np.float32), V)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scores' float32 resolution warning at 1e37
        np.testing.assert_array_equal(c.selected_slots(q[0], 0), ref.selected_slots(q[0], 0))
        np.testing.assert_allclose(c.attend(q)[0], V[0, 7777], atol=1e-6)


def test_audit_recall_ties_do_not_stand_in_for_a_better_unread_key() -> None:
    # one best key early (outside the window) and 200 copies of the second best spread over the cache: the
    # exact top 64 are the best key and 63 copies; the window reads 64 copies but not the best key, so
    # recall is 63/64 (ties fill only the slots left after the strictly better keys)
    rng = np.random.default_rng(3)
    base = rng.standard_normal((10, 8)).astype(np.float32)
    K = np.tile(base, (200, 1))
    q = base[3] * 3
    K[5] = q / np.linalg.norm(q) * (np.linalg.norm(base[3]) * 2)  # better than every copy of base[3]
    V = rng.standard_normal((1, 2000, 8)).astype(np.float32)
    c = KVCache(1, 8, selector="window", retention=Retention(sinks=0, window=640))
    c.append(K[None], V)
    rep = c.audit(q[None], k=64)
    assert rep["recall"][0] == 63 / 64


def test_k_as_a_zero_d_integer_array_is_its_value_and_sketch_counts_are_plain_digits() -> None:
    import torch

    rng = np.random.default_rng(0)
    c = KVCache(2, 4, selector="topk")
    c.append(rng.standard_normal((2, 20, 4)).astype(np.float32), rng.standard_normal((2, 20, 4)).astype(np.float32))
    q = rng.standard_normal((2, 4)).astype(np.float32)
    ref = c.attend(q, k=3)
    for k in (np.array(3), torch.tensor(3), np.int64(3)):
        np.testing.assert_array_equal(c.attend(q, k=k), ref)
    for bad in (np.array(3.0), np.array([3]), np.array(True), 2.5):
        with pytest.raises(TypeError, match="k must be an integer"):
            c.attend(q, k=bad)
    with pytest.raises(ValueError, match="candidates must be an integer"):
        KVCache(2, 4, selector="sketch:candidates=5_0")
