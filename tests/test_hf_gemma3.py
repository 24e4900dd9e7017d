"""SparseCache under a tiny random-weight Gemma3ForCausalLM (no download): sliding-window layers next to
full-attention ("global") layers.

The sliding layers stay transformers' own (exact SDPA over the last ``sliding_window`` tokens); only the
global layers go through KVCache.  Oracle: the same model with DynamicCache and SDPA.  With a cache that
reads every key (selector "dense", or "cluster" probing every cluster) tokens and logits must agree to 1e-4,
for prompts shorter and (much) longer than the window.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from sparseattn import Budget, Layout, Retention  # noqa: E402
from sparseattn.hf import SparseCache, register_cache  # noqa: E402
from sparseattn.hf_cache import SlidingWindowCacheLayer, SparseCacheLayer  # noqa: E402

VOCAB = 128
WINDOW = 8
ATOL = 1e-4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # 4 layers (sliding, global, sliding, global), 4 query heads over 2 kv heads, head_dim 16, window 8;
    # query_pre_attn_scalar 32 != head_dim: the score scale must come from the config, as in Gemma
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                           initializer_range=0.15, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                           query_pre_attn_scalar=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Gemma3ForCausalLM(cfg).eval()


def _ids(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))  # never pad/bos/eos


def _generate(model, ids, cache=None, *, impl, n=8, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=n, return_dict_in_generate=True,
                              output_logits=True, do_sample=False, pad_token_id=0, eos_token_id=None, **kw)


def _assert_same(ref, out, n_prompt):
    assert out.sequences[0, n_prompt:].tolist() == ref.sequences[0, n_prompt:].tolist()
    diff = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits, strict=True))
    assert diff < ATOL, diff


def test_layers_follow_the_layer_types(model):
    cache = SparseCache(model, selector="dense")
    kinds = [type(la) for la in cache.layers]
    assert kinds == [SlidingWindowCacheLayer, SparseCacheLayer, SlidingWindowCacheLayer, SparseCacheLayer]
    assert all(la.sliding_window == WINDOW for la in cache.layers[::2])
    assert cache.is_sliding == [True, False, True, False]


@pytest.mark.parametrize("n_prompt", [5, 24, 40])  # shorter than the window, 3x and 5x longer
def test_dense_selector_greedy_equals_dynamic_cache(model, n_prompt):
    ids = _ids(n_prompt, n_prompt)
    ref = _generate(model, ids, impl="sdpa")
    cache = SparseCache(model, selector="dense")
    out = _generate(model, ids, cache, impl=register_cache())
    _assert_same(ref, out, n_prompt)
    st = cache.stats()
    n = n_prompt + 7  # the last generated token is never fed back
    assert st["tokens"] == n and st["layers"] == 2 and st["keys_per_layer"] == n
    assert st["decode_steps"] == 7 and st["read_fraction"] == 1.0
    # global layers: every token in their KVCache; sliding layers: the last window - 1 tokens, plain tensors
    assert [kv is None for kv in cache.kv_caches()] == [True, False, True, False]
    assert [len(kv) for kv in cache.kv_caches()[1::2]] == [n, n]
    for la in cache.layers[::2]:
        assert la.get_seq_length() == n and la.keys.shape == (1, 2, min(n, WINDOW - 1), 16)
    assert cache.window_nbytes == 2 * 2 * (1 * 2 * min(n, WINDOW - 1) * 16 * 4)
    assert cache.kv_nbytes == 2 * (n * 2 * 32 * 4) + cache.window_nbytes


def test_sparse_prefill_with_every_cluster_probed_equals_dense(model):
    # the global layers' prefill rows and decode steps go through clusters covering every key; the sliding
    # layers stay exact SDPA under their window whatever the prefill
    ids = _ids(300, 2)
    ref = _generate(model, ids, impl="sdpa", n=5)
    cache = SparseCache(model, prefill="sparse", selector="cluster", retention=Retention(window=16, sinks=4),
                        layout=Layout(segment=64, cluster_size=16), budget=Budget(n_probe=64))
    out = _generate(model, ids, cache, impl=register_cache(), n=5)
    _assert_same(ref, out, ids.shape[1])
    assert cache.kv_caches()[1].stats["segments"] >= 3  # keys were clustered: the routed path ran


def test_sparse_selector_reads_fewer_keys_and_sliding_layers_stay_exact(model):
    ids = _ids(600, 3)
    cache = SparseCache(model, selector="cluster", retention=Retention(window=16, sinks=4),
                        layout=Layout(segment=128, cluster_size=16), budget=Budget(n_probe=2))
    out = _generate(model, ids, cache, impl=register_cache(), n=4)
    assert torch.isfinite(torch.stack(out.logits)).all()
    st = cache.stats()
    assert st["keys_cached_per_step"] >= 600 and st["keys_read_per_step"] < 0.5 * st["keys_cached_per_step"]
    assert all(la.keys.shape[2] == WINDOW - 1 for la in cache.layers[::2])


def test_fill_from_dynamic_cache_then_chunk_and_decode_equal_dense(model):
    # the benchmark's path: a dense DynamicCache prefill (its sliding layers keep window - 1 tokens), copied
    # into the SparseCache with fill(), then a multi-token chunk and a decode step
    ids = _ids(50, 4)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ids[:, :30], cache=dyn)
        kv = [(la.keys, la.values) for la in dyn.layers]
        assert isinstance(dyn.layers[0], DynamicSlidingWindowLayer) and kv[0][0].shape[2] == WINDOW - 1
        cache = SparseCache(model, selector="dense")
        cache.fill(kv)
        assert cache.get_seq_length() == 30 and cache.get_seq_length(1) == 30
        ref = torch.cat([model(ids[:, 30:49], cache=dyn).logits, model(ids[:, 49:], cache=dyn).logits], 1)
        model.set_attn_implementation(register_cache())
        out = torch.cat([model(ids[:, 30:49], cache=cache).logits, model(ids[:, 49:], cache=cache).logits], 1)
    assert float((out - ref).abs().max()) < ATOL
    with pytest.raises(ValueError, match=r"every full-attention layer must hold the same tokens.*\[29, 30\]"):
        SparseCache(model).fill(kv, n_tokens=29)
    with pytest.raises(ValueError, match=r"window 8\): 3 keys given for 30 tokens"):
        SparseCache(model).fill([(k[:, :, -3:], v[:, :, -3:]) if i % 2 == 0 else (k, v)
                                 for i, (k, v) in enumerate(kv)])


def test_handle_in_a_sliding_attention_call_refused(model):
    from sparseattn.hf_cache import cache_attention_forward

    cache = SparseCache(model, selector="dense")
    model.set_attn_implementation(register_cache())
    keys, values = cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 1)
    with pytest.raises(ValueError, match=r"sliding-window attention call \(window 8\)"):
        cache_attention_forward(model.model.layers[0].self_attn, torch.randn(1, 4, 3, 16), keys, values, None,
                                sliding_window=WINDOW)


def test_cache_of_a_sliding_window_model_refused_by_a_full_attention_model(model):
    # a Gemma-3 cache (layers 0 and 2 keep the last 8 tokens) under a Llama of the same shapes, whose every
    # layer attends to every token: its layers 0 and 2 would silently read 7 keys; refused instead
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).eval()
    cache = SparseCache(model, selector="dense")
    model.set_attn_implementation(register_cache())
    with pytest.raises(ValueError, match=r"layer 0 of the model attends with sliding window None but its "
                                         r"SparseCache layer is a sliding-window layer \(window 8\)"):
        _generate(llama, _ids(12, 3), cache, impl=register_cache())


def test_all_sliding_model_refused():
    cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=64)
    with pytest.raises(ValueError, match=r"every layer of MistralConfig is sliding_attention.*DynamicCache"):
        SparseCache(cfg)


def test_crop_refused_before_any_layer_changes(model):
    cache = SparseCache(model, selector="dense")
    _generate(model, _ids(5, 9), cache, impl=register_cache(), n=2)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(1)
    assert [la.get_seq_length() for la in cache.layers] == [6, 6, 6, 6]


def test_capture_decode_trace_chunked_equals_one_pass_and_refuses_sliding_layers(model, tmp_path):
    # a chunked capture (a DynamicCache prefill in 7-token chunks) saves what one pass saves; its keys and
    # values are the model's own cache's for that global layer; a sliding layer's trace is refused (its
    # queries never saw keys beyond the window), naming the full-attention layers
    from sparseattn.hf_cache import capture_decode_trace

    ids = _ids(40, 11)
    model.set_attn_implementation("sdpa")
    one = capture_decode_trace(model, ids, tmp_path / "one.npz", layer=3, n_queries=10)
    chunked = capture_decode_trace(model, ids, tmp_path / "chunked.npz", layer=3, n_queries=10, chunk=7)
    assert model.config._attn_implementation == "sdpa"
    for name in ("q", "k", "v"):
        assert one[name].shape == chunked[name].shape
        assert float(abs(one[name] - chunked[name]).max()) < 1e-5, name
    assert chunked["q_pos"].tolist() == list(range(30, 40)) and float(chunked["scale"]) == 32 ** -0.5
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ids, cache=dyn)
    # query heads 0-3 read kv heads 0, 0, 1, 1
    assert torch.allclose(torch.from_numpy(chunked["k"]), dyn.layers[3].keys[0][[0, 0, 1, 1]], atol=1e-5)
    assert torch.allclose(torch.from_numpy(chunked["v"]), dyn.layers[3].values[0][[0, 0, 1, 1]], atol=1e-5)
    with pytest.raises(ValueError, match=r"layer 2 is a sliding_attention layer.*\[1, 3\]"):
        capture_decode_trace(model, ids, tmp_path / "s.npz", layer=2)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        capture_decode_trace(model, ids, tmp_path / "no" / "t.npz", layer=1, n_queries=10)
    with pytest.raises(ValueError, match=r"heads must be <= 3; got 4"):
        capture_decode_trace(model, ids, tmp_path / "h.npz", layer=1, n_queries=10, heads=[0, 4])
    with pytest.raises(ValueError, match="chunk"):
        capture_decode_trace(model, ids, tmp_path / "c.npz", layer=1, n_queries=10, chunk=0)
    # refused before the model runs, with what to pass instead; nothing written
    with pytest.raises(ValueError, match=r"heads must list at least one query head in \[0, 4\)"):
        capture_decode_trace(model, ids, tmp_path / "e.npz", layer=1, n_queries=10, heads=[])
    with pytest.raises(ValueError, match=r"integer token ids; got dtype torch.float32 \(use torch.long\)"):
        capture_decode_trace(model, ids.float(), tmp_path / "f.npz", layer=1, n_queries=10)
    with pytest.raises(ValueError, match=r"token ids in \[0, \d+\) \(the model's vocab_size\); got values from -1"):
        capture_decode_trace(model, ids - ids.min() - 1, tmp_path / "n.npz", layer=1, n_queries=10)
    with pytest.raises(ValueError, match=r"with S >= 1; got \(1, 0\)"):
        capture_decode_trace(model, ids[:, :0], tmp_path / "z.npz", layer=1, n_queries=10)
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(ValueError, match="is a folder; give a file name such as"):
        capture_decode_trace(model, ids, tmp_path / "d.npz", layer=1, n_queries=10)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ValueError, match="its folder .*plain is a file, not a folder"):
        capture_decode_trace(model, ids, tmp_path / "plain" / "t.npz", layer=1, n_queries=10)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["chunked.npz", "d.npz", "one.npz", "plain"]
