"""sparseattn.hf: sparse attention as a transformers attn_implementation.

Oracles: the same model with transformers' own eager / SDPA attention (full selection must reproduce it to
1e-4 in float32), and the same sentences run one by one without padding (padded keys must change nothing,
at any k, because they are removed before selection).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("sparseattn.hf")
traces = pytest.importorskip("sparseattn.traces")

import sparseattn as sa  # noqa: E402

SENTENCES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of "
    "God moved upon the face of the waters.",
    "And God said, Let there be light: and there was light.",
    "Jesus wept.",
]
FULL_K = 512
SMALL_K = 4


@pytest.fixture(autouse=True)
def _serial():
    with sa.threads(1):
        yield


@pytest.fixture(scope="module")
def minilm():
    """(eager model, sparse model, tokenizer); the sparse model reads k from its config."""
    try:
        path = traces.model_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"MiniLM weights not installed: {exc}")
    dense, tok = traces.load_model(path)
    hf.register("topk", k=FULL_K)
    sparse = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sparseattn").eval()
    return dense, sparse, tok


def run(model, tok, sentences, padding=True):
    enc = tok(sentences, padding=padding, return_tensors="pt")
    with torch.inference_mode():
        return model(**enc).last_hidden_state, enc["attention_mask"]


def set_k(model, k):
    model.config.sparseattn_k = k


def test_full_k_reproduces_eager_with_padding(minilm):
    dense, sparse, tok = minilm
    set_k(sparse, FULL_K)
    assert sparse.config._attn_implementation == "sparseattn"
    ref, mask = run(dense, tok, SENTENCES)
    assert (mask == 0).any()  # the batch is padded
    out, _ = run(sparse, tok, SENTENCES)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    sdpa = transformers.AutoModel.from_pretrained(str(traces.model_path()), attn_implementation="sdpa").eval()
    torch.testing.assert_close(out, run(sdpa, tok, SENTENCES)[0], atol=1e-4, rtol=0)


def test_small_k_differs_but_stays_finite(minilm):
    dense, sparse, tok = minilm
    set_k(sparse, SMALL_K)
    ref, _ = run(dense, tok, SENTENCES)
    out, _ = run(sparse, tok, SENTENCES)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() > 1e-2


def _torch_topk_attention(n_keys):
    """Oracle attention function in plain torch: per query the n_keys allowed keys of largest q.k."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        dots = query.double() @ key.double().transpose(-1, -2)
        allowed = (torch.ones_like(dots, dtype=torch.bool) if attention_mask is None
                   else attention_mask.bool().expand(dots.shape))
        ranked = dots.masked_fill(~allowed, -torch.inf)
        top = ranked.topk(min(n_keys, dots.shape[-1]), dim=-1).indices
        keep = torch.zeros_like(allowed).scatter_(-1, top, True) & allowed
        w = torch.softmax((dots * scaling).masked_fill(~keep, -torch.inf), dim=-1)
        return (w @ value.double()).to(query.dtype).transpose(1, 2).contiguous(), None

    return forward


def test_small_k_matches_a_torch_topk_oracle(minilm):
    """At k=4 the whole model equals the same model with a brute-force torch top-k attention."""
    _, sparse, tok = minilm
    transformers.AttentionInterface.register("torch-topk-oracle", _torch_topk_attention(SMALL_K))
    transformers.masking_utils.AttentionMaskInterface.register("torch-topk-oracle",
                                                               transformers.masking_utils.sdpa_mask)
    oracle = transformers.AutoModel.from_pretrained(str(traces.model_path()),
                                                    attn_implementation="torch-topk-oracle").eval()
    set_k(sparse, SMALL_K)
    out, _ = run(sparse, tok, SENTENCES)
    torch.testing.assert_close(out, run(oracle, tok, SENTENCES)[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("k", [FULL_K, SMALL_K])
def test_padded_batch_equals_single_unpadded_runs(minilm, k):
    _, sparse, tok = minilm
    set_k(sparse, k)
    batch, mask = run(sparse, tok, SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        single, _ = run(sparse, tok, [sentence], padding=False)
        n = int(mask[i].sum())
        assert single.shape[1] == n
        torch.testing.assert_close(batch[i, :n], single[0], atol=1e-4, rtol=0)


def test_config_selector_overrides_registration(minilm):
    """config.sparseattn_selector replaces the registered selector: a width-1 window keeps only the query's
    own token, so layer 0's attention output is its value projection."""
    _, sparse, tok = minilm
    set_k(sparse, FULL_K)
    attn = sparse.encoder.layer[0].attention.self
    seen = {}

    def keep(name, pick):
        def hook(_module, _inputs, output):
            seen.setdefault(name, pick(output))  # returns None: the output is left unchanged
        return hook

    hooks = [attn.value.register_forward_hook(keep("value", lambda o: o)),
             attn.register_forward_hook(keep("context", lambda o: o[0]))]
    sparse.config.sparseattn_selector = "window:width=1"
    try:
        out, _ = run(sparse, tok, SENTENCES[:1])
    finally:
        sparse.config.sparseattn_selector = None
        for h in hooks:
            h.remove()
    torch.testing.assert_close(seen["context"], seen["value"], atol=1e-6, rtol=0)
    assert torch.isfinite(out).all()


def test_inference_only_errors(minilm):
    _, sparse, tok = minilm
    enc = tok(SENTENCES[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="torch.no_grad"):
        sparse(**enc)
    sparse.train()
    try:
        with torch.inference_mode(), pytest.raises(ValueError, match=r"no dropout.*model.eval\(\)"):
            sparse(**enc)
    finally:
        sparse.eval()


def test_register_validates_arguments():
    with pytest.raises(ValueError, match="unknown selector"):
        hf.register("no-such-selector")
    with pytest.raises(ValueError, match="k must be >= 1"):
        hf.register("topk", k=0)
    with pytest.raises(ValueError, match="name must be a new"):
        hf.register("topk", name="sdpa")
    with pytest.raises(ValueError, match="unknown parameter"):
        hf.register("window", k=8, bogus=3)
    assert hf.register("window", k=8, width=16, name="sparseattn-window-test") == "sparseattn-window-test"
    assert "sparseattn-window-test" in transformers.AttentionInterface()


# ------------------------------------------------------------------ a causal decoder with GQA (random)
@pytest.fixture(scope="module")
def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).eval()
    model.set_attn_implementation("sdpa")
    hf.register("topk", k=FULL_K, name="sparseattn-llama-test")
    ids = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, :10] = 0  # left padding, as decoders are batched
    mask[2, :3] = 0
    return model, ids, mask


def _llama(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("padded", [False, True])
def test_causal_gqa_decoder_full_k_matches_sdpa(tiny_llama, padded):
    model, ids, mask = tiny_llama
    m = mask if padded else None
    ref = _llama(model, "sdpa", ids, m)
    out = _llama(model, "sparseattn-llama-test", ids, m)
    valid = (mask if padded else torch.ones_like(mask)).bool()
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-4, rtol=0)


def test_causal_decoder_small_k_padding_changes_nothing(tiny_llama):
    """Left padding + causal at k=3: each real token keeps its 3 best earlier real tokens, as unpadded."""
    model, ids, mask = tiny_llama
    model.config.sparseattn_k = 3
    try:
        batch = _llama(model, "sparseattn-llama-test", ids, mask)
        dense = _llama(model, "sdpa", ids, mask)
        for b in range(ids.shape[0]):
            start = int((mask[b] == 0).sum())
            single = _llama(model, "sparseattn-llama-test", ids[b:b + 1, start:])
            torch.testing.assert_close(batch[b, start:], single[0], atol=1e-4, rtol=0)
    finally:
        model.config.sparseattn_k = None
    valid = mask.bool()
    assert (batch[valid] - dense[valid]).abs().max() > 1e-3  # k=3 < 24 keys: not the dense result
