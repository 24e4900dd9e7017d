"""A transformers ``Cache`` whose layers keep keys and values in :class:`sparseattn.cache.KVCache`, and the
attention function that attends through it: ``model.generate()`` with sparse decode attention.

>>> import sparseattn as sa
>>> import sparseattn.hf as sh
>>> model.set_attn_implementation(sh.register_cache())  # doctest: +SKIP
>>> cache = sh.SparseCache(model, selector="cluster", layout=sa.Layout(segment=1024))  # doctest: +SKIP
>>> out = model.generate(ids, cache=cache, max_new_tokens=32)  # doctest: +SKIP

How the pieces meet (transformers 5.x decoder models such as Llama, Mistral, Qwen2):

* The model applies RoPE to queries and keys, then calls ``cache.update(keys, values, layer_idx)``:
  :class:`SparseCacheLayer` appends the rotated keys and the values of the new tokens to its layer's
  ``KVCache`` (created at the first update, with the model's query / kv head counts and head dim).  The
  keys and values live there only: ``update`` returns *handles*, tensors of the full (1, H_kv, S, E)
  shape that are a stride-0 view of one NaN (no memory; any other attention function reading them
  yields NaN instead of a plausible wrong answer) and carry their layer in the ``sparseattn_layer``
  attribute.
* The model then calls its attention function with the handles.  The function :func:`register_cache`
  installs finds the layer through the handle and attends through its ``KVCache``: a prefill (several
  new tokens on an empty cache) runs torch SDPA, causal, on the new tokens' own keys and values
  (``prefill="dense"``, the default: exactly the model's own attention), or the cache's selector
  (``prefill="sparse"``); every decode step (one new token) and every later multi-token chunk runs
  ``KVCache.attend`` with the cache's selector (a chunk after the prefill with ``prefill="dense"`` reads
  every cached key).  Grouped-query attention maps query head h to kv head ``h // (H / H_kv)``, as the
  model's ``repeat_kv``.  Keys and values that are plain tensors (a ``DynamicCache``, or no cache) get
  transformers' SDPA attention, so one attention implementation serves both caches.
* One sequence per cache (batch size 1); no beam search, cropping (assisted decoding) or reordering:
  each raises ``ValueError`` naming the alternative.  Only the causal mask of an unpadded sequence is
  accepted.
* Sliding-window layers (Gemma 2/3, ...: ``layer_types`` ``"sliding_attention"``) keep transformers' own
  ``DynamicSlidingWindowLayer`` (:class:`SlidingWindowCacheLayer`): the last ``sliding_window - 1`` keys as
  plain tensors, so their attention is transformers' SDPA under the model's own sliding-window mask,
  exactly as with ``DynamicCache`` (whatever the selector or ``prefill``).  Only the full-attention
  ("global") layers go through ``KVCache``.  A model without full-attention layers, or with chunked /
  linear-attention layers, is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache import KVCache, group_options
from .inputs import check_positive_int

__all__ = ["CACHE_ATTENTION_NAME", "HANDLE_ATTR", "SlidingWindowCacheLayer", "SparseCache", "SparseCacheLayer",
           "cache_attention_forward", "capture_decode_trace", "register_cache"]

CACHE_ATTENTION_NAME = "sparseattn-cache"
HANDLE_ATTR = "sparseattn_layer"  # attribute of the tensors update() returns: the layer they stand for
SLIDING_ATTR = "sparseattn_sliding_window"  # attribute of a sliding-window layer's keys: its window
_REBUILD = "Build SparseCache(model) from the model that generates."
_NO_BACKWARD = ("{what} grad while autograd is enabled, but SparseCache attention has no backward pass: "
                "generate under torch.no_grad() or torch.inference_mode() (generate() does), or use DynamicCache "
                "with attn_implementation='sdpa' for training.")
_NO_CROP = "SparseCache cannot crop tokens (assisted or speculative decoding need that); use DynamicCache for those."
_PREFILL = ("dense", "sparse")
_MODEL_KEYS = ("num_heads", "head_dim", "num_kv_heads", "value_dim")  # set from the model, not by the caller
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> None:
    """Accept only the causal mask of one unpadded sequence (True / 0 = may attend)."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[-2] != q_len or mask.shape[-1] < kv_len:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not fit one sequence of {q_len} "
                         f"queries over {kv_len} keys; SparseCache takes batch size 1 and no padding.")
    allowed = mask[..., :kv_len] if mask.dtype == torch.bool else mask[..., :kv_len] == 0
    past = kv_len - q_len
    rows = torch.arange(q_len).unsqueeze(1) + past
    causal = torch.arange(kv_len).unsqueeze(0) <= rows
    if not bool((allowed == causal).all()):
        raise ValueError("SparseCache attends causally over every cached token of one sequence; the attention "
                         "mask given is not that (padding or a custom mask). Pass unpadded input_ids and no "
                         "attention_mask zeros, or use DynamicCache.")


class SparseCacheLayer(CacheLayerMixin):
    """One decoder layer's cache: a :class:`KVCache` plus the attention that reads it.

    Parameters
    ----------
    num_heads : int
        Query heads H of the layer.
    kv_kwargs : dict
        Keyword arguments of :class:`KVCache` (selector, segment, n_probe, ...), passed through.
    prefill : {"dense", "sparse"}
        How a multi-token update on an empty cache is attended (see the module docstring).
    k : int
        ``KVCache.attend(k=...)``: keys per query of the ``"topk"`` and index selectors.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, num_heads: int, kv_kwargs: dict[str, Any], prefill: str = "dense", k: int = 64) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_kwargs = dict(kv_kwargs)
        self.prefill = prefill
        self.k = k
        self.kv: KVCache | None = None
        self.n_tokens = 0
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # the last update's K/V until attended
        self._nan: torch.Tensor | None = None
        self.attention_seconds = 0.0  # time in this layer's attention calls (all of them)
        self.decode_steps = 0  # single-token attention calls
        self.decode_seconds = 0.0
        self.decode_keys_read = 0.0  # sum over decode steps of the mean keys read per query row
        self.decode_keys_cached = 0  # sum over decode steps of the keys attendable
        self.lock: Any = threading.RLock()  # SparseCache shares one lock among its layers

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("lock", None)  # a lock does not pickle or deep-copy (SparseCache links a new one on load)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create the layer's KVCache for keys (B, H_kv, T, E) and values (B, H_kv, T, Ev)."""
        h_kv, e, ev = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        self.kv = KVCache(num_heads=self.num_heads, head_dim=e, num_kv_heads=h_kv, value_dim=ev,
                          **self.kv_kwargs)
        self.device, self.dtype = key_states.device, key_states.dtype
        self._nan = torch.full((1,), float("nan"), dtype=key_states.dtype)
        self.is_initialized = True

    def _handle(self, width: int) -> torch.Tensor:
        assert self.kv is not None and self._nan is not None
        t = self._nan.expand(1, self.kv.num_kv_heads, self.n_tokens, width)
        setattr(t, HANDLE_ATTR, self)
        return t

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append keys (1, H_kv, T, E) and values (1, H_kv, T, Ev) (keys already rotated by the model);
        return handles of shape (1, H_kv, S, E) / (1, H_kv, S, Ev) for the S tokens cached (no copy)."""
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"SparseCache.update: {name} must be a 4-D tensor (batch, kv_heads, tokens, "
                                 f"head_dim); got {type(t).__name__} {tuple(getattr(t, 'shape', ()))}.")
            if t.shape[0] != 1:
                raise ValueError(f"SparseCache holds one sequence (batch size 1); {name} has batch size "
                                 f"{t.shape[0]}. Generate one prompt per cache, with num_beams=1 and "
                                 f"num_return_sequences=1.")
        if self._new is not None:
            raise ValueError("SparseCache: the previous update's keys were never attended through the cache; "
                             "the model's attention implementation must be sparseattn's cache attention "
                             "(model.set_attn_implementation(sparseattn.hf.register_cache())).")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.kv is not None
        if key_states.shape[2]:
            k, v = key_states[0].detach(), value_states[0].detach()
            if k.shape[1] == 1 and k.dtype == torch.float32 and v.dtype == torch.float32:
                # one decode token: contiguous float32 numpy takes the cache's single-token path
                self.kv.append(np.ascontiguousarray(k.numpy()), np.ascontiguousarray(v.numpy()))
            else:
                self.kv.append(k, v)
            self.n_tokens += key_states.shape[2]
            self._new = (key_states, value_states)
        return self._handle(key_states.shape[-1]), self._handle(value_states.shape[-1])

    def append_attended(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """:meth:`update` for tokens whose attention was computed elsewhere: appended, and no :meth:`attend`
        is expected for them."""
        self.update(key_states, value_states)
        self._new = None

    def attend(self, module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None) -> torch.Tensor:
        """Attention of the new tokens' queries (1, H, T, E) over the cache; returns (1, T, H, Ev)."""
        if query.requires_grad and torch.is_grad_enabled():
            raise ValueError(_NO_BACKWARD.format(what="query requires"))
        with self.lock:
            return self._attend(module, query, attention_mask, scaling)

    def _attend(self, module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
                scaling: float | None) -> torch.Tensor:
        if self._new is None:
            raise ValueError("SparseCache: attention called without a preceding update of this layer "
                             "(or twice for one update).")
        new_k, new_v = self._new
        self._new = None
        assert self.kv is not None
        b, h, t, e = query.shape
        if b != 1 or h != self.kv.num_heads or e != self.kv.head_dim or t != new_k.shape[2]:
            raise ValueError(f"query of shape {tuple(query.shape)} does not match the cache's layer (1, "
                             f"{self.kv.num_heads} heads, {new_k.shape[2]} new tokens, head_dim "
                             f"{self.kv.head_dim}).")
        scale = float(scaling) if scaling is not None else e ** -0.5
        if abs(scale - self.kv.scale) > 1e-6 * self.kv.scale:
            raise ValueError(f"the model's attention scale {scale:.6g} differs from the cache's {self.kv.scale:.6g}; "
                             f"pass scale={scale!r} to SparseCache.")
        if attention_mask is not None:
            _check_mask(attention_mask, t, self.n_tokens)
        t0 = time.perf_counter()
        if t > 1 and self.n_tokens == t and self.prefill == "dense":
            out = torch.nn.functional.scaled_dot_product_attention(
                query, new_k, new_v, is_causal=True, scale=scale, enable_gqa=h != new_k.shape[1])
            out = out.transpose(1, 2)
        else:
            selector = "dense" if t > 1 and self.prefill == "dense" else None
            q = query[0].detach()
            o = self.kv.attend(q if q.dtype in (torch.float32, torch.float64) else q.float(), k=self.k,
                               selector=selector)
            out = o.to(query.dtype).unsqueeze(0).transpose(1, 2)
        dt = time.perf_counter() - t0
        self.attention_seconds += dt
        if t == 1:
            self.decode_steps += 1
            self.decode_seconds += dt
            self.decode_keys_read += self.kv.stats["keys_read_per_query"]
            self.decode_keys_cached += len(self.kv)
        return out.contiguous()

    def get_seq_length(self) -> int:
        """Tokens cached (appended) so far."""
        return self.n_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask for ``query_length`` new tokens: every cached token plus them."""
        return self.n_tokens + query_length, 0

    def get_max_length(self) -> int:
        """-1: no maximum (a ``max_keys`` cap evicts keys but positions go on)."""
        return -1

    def reset(self) -> None:
        """Drop every cached token (a new KVCache is made at the next update)."""
        self.kv, self._new, self._nan = None, None, None
        self.n_tokens = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: a KVCache cannot drop tokens (assisted / speculative decoding need that)."""
        raise ValueError(_NO_CROP)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: one sequence per cache, no beam search."""
        raise ValueError("SparseCache holds one sequence: no beam search (pass num_beams=1).")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Allowed only for ``repeats == 1`` (one sequence per cache)."""
        if repeats != 1:
            raise ValueError(f"SparseCache holds one sequence; cannot repeat it {repeats} times "
                             f"(num_beams / num_return_sequences must be 1).")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Allowed only for selecting the one sequence (index 0)."""
        if [int(i) for i in torch.as_tensor(indices).flatten()] != [0]:
            raise ValueError(f"SparseCache holds one sequence; cannot select batch indices {indices!r}.")

    def offload(self) -> None:  # CPU only: nothing to move
        pass

    def prefetch(self) -> None:
        pass


class SlidingWindowCacheLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer of :class:`SparseCache`: transformers' ``DynamicSlidingWindowLayer`` unchanged
    (keys and values as plain tensors, the last ``sliding_window - 1`` tokens kept; :func:`cache_attention_forward`
    gives them transformers' SDPA under the model's sliding-window mask), plus :meth:`append_attended`."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DynamicSlidingWindowLayer.update``; the keys returned carry the layer's window
        (``SLIDING_ATTR``), so that a full-attention call receiving them is refused."""
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        setattr(keys, SLIDING_ATTR, self.sliding_window)
        return keys, values

    def append_attended(self, key_states: torch.Tensor, value_states: torch.Tensor, n_tokens: int) -> None:
        """Append ``n_tokens`` tokens of which only the last ones are given (keys (1, H_kv, t, E), values
        (1, H_kv, t, Ev), ``t >= min(n_tokens, sliding_window - 1)``: what a ``DynamicSlidingWindowLayer`` holds
        after them), their attention computed elsewhere."""
        t = int(key_states.shape[2])
        if not min(n_tokens, self.sliding_window - 1) <= t <= n_tokens:
            raise ValueError(f"sliding-window layer (window {self.sliding_window}): {t} keys given for "
                             f"{n_tokens} tokens; it needs the last min(tokens, window - 1) = "
                             f"{min(n_tokens, self.sliding_window - 1)} of them at least.")
        self.update(key_states, value_states)  # keeps the last sliding_window - 1
        self.cumulative_length += n_tokens - t


def cache_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """transformers attention function: through the :class:`SparseCache` layer when ``key`` is one of its
    handles, else transformers' SDPA attention.

    Parameters
    ----------
    query : torch.Tensor, (1, H, T, E)
        Rotated queries of the new tokens.
    key, value : torch.Tensor, (1, H_kv, S, E) / (1, H_kv, S, Ev)
        Handles returned by ``SparseCache.update`` (or plain tensors: SDPA).

    Returns
    -------
    (torch.Tensor (1, T, H, Ev), None)
    """
    layer = getattr(key, HANDLE_ATTR, None)
    window = getattr(key, SLIDING_ATTR, None)
    # the model's window of this call: passed by most models, an attribute of the module in others (its mask)
    wanted = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None and wanted != window:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} of the model attends with sliding window "
                         f"{wanted} but its SparseCache layer is a sliding-window layer "
                         f"(window {window}): the cache was built for another model. {_REBUILD}")
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout:
        raise ValueError(f"SparseCache attention has no dropout (got dropout={dropout}, i.e. the module is in "
                         f"training mode); call model.eval() for inference.")
    for name in ("softcap", "position_bias", "sinks", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"SparseCache attention does not support {name!r}; use DynamicCache with "
                             f"attn_implementation='sdpa' for this model.")
    if wanted is not None:  # SparseCache gives sliding layers plain tensors, never handles
        raise ValueError(f"a sliding-window attention call (window {wanted}) received a "
                         f"SparseCache full-attention layer's keys; the cache's layer types do not match the model. "
                         f"{_REBUILD}")
    return layer.attend(module, query, attention_mask, scaling), None


cache_attention_forward.sparseattn_cache_aware = True  # type: ignore[attr-defined]


def register_cache(name: str = CACHE_ATTENTION_NAME) -> str:
    """Register :func:`cache_attention_forward` (and transformers' SDPA mask builder) under ``name``.

    Returns
    -------
    str
        ``name``, for ``model.set_attn_implementation(name)`` or ``attn_implementation=name``.
    """
    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or name.startswith("flash"):
        raise ValueError(f"name must be a new attention-implementation name; got {name!r}.")
    AttentionInterface.register(name, cache_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


class _PassGuard:
    """One forward pass at a time through a :class:`SparseCache`'s layers: the lock they share (update,
    fill and attention take it) and the thread of the last update.  :meth:`claim` lets the calling thread
    update a layer, or raises with nothing changed."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.lock = threading.RLock()
        self.owner: threading.Thread | None = None  # the thread of the last update
        for layer in layers:
            if isinstance(layer, SparseCacheLayer):
                layer.lock = self.lock

    @staticmethod
    def lengths(layers: Sequence[Any]) -> list[int]:
        """Tokens each layer holds (a sliding-window layer: tokens appended)."""
        return [layer.n_tokens if isinstance(layer, SparseCacheLayer) else int(getattr(layer, "cumulative_length", 0))
                for layer in layers]

    @classmethod
    def mid_forward(cls, layers: Sequence[Any]) -> bool:
        """True while a forward pass is under way (or was left unfinished): a layer's new keys not yet
        attended, or layers holding different numbers of tokens (some updated by the pass, some not)."""
        if any(isinstance(la, SparseCacheLayer) and la._new is not None for la in layers):
            return True
        return len(set(cls.lengths(layers))) > 1

    def claim(self, layers: Sequence[Any], layer_idx: int) -> None:
        """Make the calling thread the cache's user (the lock held), or raise with nothing changed: another
        thread's pass under way (RuntimeError); a pass started (layer 0) while the last one was left
        unfinished, by an error in it, an interruption, or a model with fewer layers (ValueError)."""
        me = threading.current_thread()
        owner = self.owner
        if owner is me and layer_idx > 0:  # the owner's pass going on: nothing to check (per-layer hot path)
            return
        busy = self.mid_forward(layers)
        if busy and owner is not None and owner is not me and owner.is_alive():
            raise RuntimeError(f"SparseCache is in use by another thread ({owner.name}: a forward pass through it "
                               f"is under way, or was left unfinished there); a cache holds one sequence: use one "
                               f"SparseCache per thread (cache.reset() drops its tokens).")
        if busy and (layer_idx == 0 or owner is not me):
            pending = [i for i, la in enumerate(layers) if isinstance(la, SparseCacheLayer) and la._new is not None]
            why = (f"layer {pending[0]}'s new keys were never attended: an error in the pass, or a model whose "
                   f"attention does not read the cache (model.set_attn_implementation(sparseattn.hf."
                   f"register_cache()))" if pending else
                   f"an error or interruption in it, or a model with fewer layers than the cache's {len(layers)}")
            raise ValueError(f"SparseCache: the previous forward pass through the cache did not finish ({why}); its "
                             f"layers hold {self.lengths(layers)} tokens. Call cache.reset() (drops every token) or "
                             f"build a new SparseCache from the model that generates.")
        self.owner = me


class SparseCache(Cache):
    """transformers ``Cache`` for decoder-only models whose layers keep keys and values in ``KVCache``.

    Parameters
    ----------
    model : transformers.PreTrainedModel or PreTrainedConfig
        The model (or its config) the cache serves: query heads, kv heads and layer count come from it,
        and every ``update`` checks that its ``_attn_implementation`` is :func:`register_cache`'s.
    prefill : {"dense", "sparse"}, default "dense"
        Attention of the prompt (several tokens on an empty cache): exact SDPA, or the cache's selector.
    k : int, default 64
        ``KVCache.attend(k=...)`` (``"topk"`` and index selectors).
    scale : float, optional
        Score scale (default ``1 / sqrt(query_pre_attn_scalar)`` when the config has it (Gemma), else
        ``1 / sqrt(head_dim)``, that of Llama-style models); checked against the model's at every attention call.
    **kv_kwargs
        :class:`sparseattn.cache.KVCache` keywords (``selector``, ``dtype``, ``retention=Retention(...)``,
        ``layout=Layout(...)``, ``budget=Budget(...)``, ``parallel``), one KVCache per layer.

    Layers whose type is ``"sliding_attention"`` (Gemma 3: 5 of every 6) are :class:`SlidingWindowCacheLayer`
    (transformers' own, exact); the KVCache keywords, ``prefill`` and ``k`` apply to the full-attention layers.

    The cache serves the model it was built from: other kv heads or head_dim are refused at the first
    update, other layer types at the first attention call of such a layer, more layers at the first extra
    one, fewer at the second pass.  One sequence, one forward pass at a time: a call from another thread
    while a pass is under way raises RuntimeError and changes nothing (passes of two threads that alternate
    are not detected: give each thread its own cache); a pass left unfinished by an error inside the
    attention layers is reported at the next one (call :meth:`reset`; an error after the last layer's
    attention, in the final norm or head, leaves the layers in step and is not detected).  No backward
    pass: keys that require grad under autograd raise ValueError.

    Raises
    ------
    TypeError
        ``model`` is neither a model nor a config; a KVCache keyword that the model fixes.
    ValueError
        An encoder-decoder model, a model with chunked / linear-attention layers or no full-attention layer,
        bad keywords.
    """

    def __init__(self, model: Any, *, prefill: str = "dense", k: int = 64, scale: float | None = None,
                 **kv_kwargs: Any) -> None:
        config = getattr(model, "config", model)
        if not hasattr(config, "get_text_config"):
            raise TypeError(f"SparseCache(model): expected a transformers model or its config; got "
                            f"{type(model).__name__}.")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"SparseCache serves decoder-only models; {type(config).__name__} is an "
                             f"encoder-decoder model. Use its own cache (EncoderDecoderCache).")
        text = config.get_text_config(decoder=True)
        n_heads = getattr(text, "num_attention_heads", None)
        n_layers = getattr(text, "num_hidden_layers", None)
        if not isinstance(n_heads, int) or not isinstance(n_layers, int):
            raise ValueError(f"SparseCache: {type(config).__name__} has no num_attention_heads / "
                             f"num_hidden_layers; it needs a decoder-only causal LM config (Llama, Mistral, ...).")
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        other = sorted({lt for lt in layer_types if lt not in _LAYER_TYPES})
        if other:
            raise ValueError(f"SparseCache supports full-attention and sliding-window layers only; "
                             f"{type(config).__name__} has layer types {other}. Use DynamicCache for this model.")
        if "full_attention" not in layer_types:
            raise ValueError(f"SparseCache: every layer of {type(config).__name__} is sliding_attention (window "
                             f"{getattr(text, 'sliding_window', None)}); no full-attention layer for the sparse "
                             f"cache. Use DynamicCache for this model.")
        if prefill not in _PREFILL:
            raise ValueError(f"prefill must be one of {_PREFILL}; got {prefill!r}.")
        fixed = sorted(set(kv_kwargs) & set(_MODEL_KEYS))
        if fixed:
            raise TypeError(f"SparseCache takes {fixed} from the model; do not pass them.")
        k = check_positive_int(k, "k")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        if scale is None and getattr(text, "query_pre_attn_scalar", None):  # Gemma: scores scaled by this
            scale = float(text.query_pre_attn_scalar) ** -0.5
        if scale is not None:
            kv_kwargs["scale"] = scale
        KVCache(num_heads=n_heads, head_dim=head_dim, num_kv_heads=n_kv, **kv_kwargs)  # validates the kwargs now
        kv_kwargs = group_options(kv_kwargs)  # deprecated flat keywords: warned once above, not once per layer
        self.config = config
        self.prefill = prefill
        self._shape = (n_heads, n_kv, head_dim)
        super().__init__(layers=[
            SparseCacheLayer(n_heads, kv_kwargs, prefill, k) if lt == "full_attention"
            else SlidingWindowCacheLayer(sliding_window=int(kw["sliding_window"]))
            for lt, kw in zip(layer_types, layer_kwargs, strict=True)])
        self._guard = _PassGuard(self.layers)

    _lock = property(lambda self: self._guard.lock, doc="The lock every layer's update and attention take.")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_guard", None)  # a lock (or a thread) does not pickle or deep-copy; made anew on load
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guard = _PassGuard(self.layers)

    def __copy__(self) -> SparseCache:
        raise TypeError("SparseCache cannot be shallow-copied (the copy would share its layers); use "
                        "copy.deepcopy(cache) for an independent copy.")

    def _check_fits(self, key_states: Any, value_states: Any, layer_idx: Any) -> None:
        """ValueError when the calling layer is not one of the model the cache was built for (layer index,
        kv heads, head_dim) or its attention is not the cache's (TypeError for a non-int ``layer_idx``).
        Shapes are read from 4-D tensors only; the layer's own update checks the rest."""
        _, n_kv, head_dim = self._shape
        name = type(self.config).__name__
        fix = _REBUILD
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"SparseCache.update: layer_idx must be an int; got {layer_idx!r}.")
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"SparseCache.update: layer_idx {layer_idx} is not a layer of the cache, which was "
                             f"built for a {len(self.layers)}-layer model ({name}). {fix}")
        for what, t in (("key_states", key_states), ("value_states", value_states)):
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] != n_kv:
                raise ValueError(f"SparseCache.update: layer {layer_idx}'s {what} have {t.shape[1]} kv heads; the "
                                 f"cache was built for a model ({name}) with {n_kv}. {fix}")
        if isinstance(key_states, torch.Tensor) and key_states.dim() == 4 and key_states.shape[-1] != head_dim:
            raise ValueError(f"SparseCache.update: layer {layer_idx}'s keys have head_dim {key_states.shape[-1]}; "
                             f"the cache was built for a model ({name}) with head_dim {head_dim}. {fix}")
        impl = getattr(self.config, "_attn_implementation", None)
        fn = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else None
        if not getattr(fn, "sparseattn_cache_aware", False):
            raise ValueError(f"SparseCache needs the model's attention to read from it; the attn_implementation "
                             f"of the model it was built for ({name}) is {impl!r}. Call "
                             f"model.set_attn_implementation(sparseattn.hf.register_cache()) first (on the model "
                             f"that generates, and build the cache from that model).")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys/values of layer ``layer_idx``; returns handles (see the module docs).

        Refused before anything changes: a layer of another model (:meth:`_check_fits`), keys that require
        grad under autograd (no backward pass), a call from another thread while a forward pass is under way
        (RuntimeError), and a new pass while the previous one was left unfinished (ValueError: call
        :meth:`reset`).  Passes from two threads that alternate between passes are not detected: one cache
        holds one sequence, so give each thread its own."""
        self._check_fits(key_states, value_states, layer_idx)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (key_states, value_states)):
            raise ValueError(_NO_BACKWARD.format(what="keys require"))
        with self._guard.lock:
            self._guard.claim(self.layers, layer_idx)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def fill(self, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], n_tokens: int | None = None) -> None:
        """Append prompt keys and values computed elsewhere, e.g. the layers of a ``DynamicCache`` after the
        model's own dense prefill (``[(layer.keys, layer.values) for layer in dynamic.layers]``): the same
        state a dense prefill through this cache leaves, so several caches can share one prefill.

        Parameters
        ----------
        layer_kv : sequence of (keys (1, H_kv, T, E), values (1, H_kv, T, Ev)) torch tensors, one per layer
            Keys already rotated (RoPE), as the model hands them to ``update``; the same T for every
            full-attention layer.  A sliding-window layer may hold only the last ``min(T, sliding_window - 1)``
            tokens or more (what a ``DynamicCache``'s sliding layer keeps).
        n_tokens : int, optional
            Tokens appended, T (default: the full-attention layers' length).
        """
        if len(layer_kv) != len(self.layers):
            raise ValueError(f"layer_kv must hold one (keys, values) pair per layer ({len(self.layers)}); "
                             f"got {len(layer_kv)}.")
        lengths = {int(k.shape[2]) for (k, _), layer in zip(layer_kv, self.layers, strict=True)
                   if isinstance(layer, SparseCacheLayer)}
        if n_tokens is not None:
            lengths.add(check_positive_int(n_tokens, "n_tokens", minimum=0))
        if len(lengths) != 1:
            raise ValueError(f"layer_kv: every full-attention layer must hold the same tokens (n_tokens, when "
                             f"given, too); got lengths {sorted(lengths)}.")
        (n,) = lengths
        with self._guard.lock:
            self._guard.claim(self.layers, 0)
            for layer, (k, v) in zip(self.layers, layer_kv, strict=True):
                if isinstance(layer, SparseCacheLayer):
                    layer.append_attended(k, v)
                else:
                    layer.append_attended(k, v, n)

    def crop(self, tokens_to_remove: int) -> None:
        """Refused before any layer changes (a sliding-window layer could crop, the KVCache layers cannot)."""
        raise ValueError(_NO_CROP)

    def kv_caches(self) -> list[KVCache | None]:
        """The KVCache of each layer (None before its first update, and for sliding-window layers)."""
        return [getattr(layer, "kv", None) for layer in self.layers]

    @property
    def kv_nbytes(self) -> int:
        """Bytes held by the keys and values of every layer's KVCache (plus :attr:`window_nbytes`)."""
        return sum(kv.kv_nbytes for kv in self.kv_caches() if kv is not None) + self.window_nbytes

    @property
    def window_nbytes(self) -> int:
        """Bytes of the keys and values the sliding-window layers hold (0 for a model without them)."""
        return sum(la.keys.nbytes + la.values.nbytes for la in self.layers
                   if isinstance(la, SlidingWindowCacheLayer) and la.is_initialized)

    def stats(self) -> dict[str, Any]:
        """Totals over the layers: tokens cached, keys attendable per layer, decode steps, seconds in
        attention (all calls / decode steps), mean keys read per query row and step and its fraction of the
        keys attendable, KV bytes.  Layers, steps, seconds and keys count the full-attention (KVCache) layers
        only; ``kv_nbytes`` includes the sliding-window layers' keys and values."""
        layers = [la for la in self.layers if isinstance(la, SparseCacheLayer) and la.kv is not None]
        steps = sum(la.decode_steps for la in layers)
        read = sum(la.decode_keys_read for la in layers)
        cached = sum(la.decode_keys_cached for la in layers)
        return {"tokens": self.get_seq_length(), "layers": len(layers),
                "keys_per_layer": len(layers[0].kv) if layers else 0,
                "decode_steps": steps // max(len(layers), 1),
                "attention_seconds": sum(la.attention_seconds for la in layers),
                "decode_attention_seconds": sum(la.decode_seconds for la in layers),
                "keys_read_per_step": read / steps if steps else 0.0,
                "keys_cached_per_step": cached / steps if steps else 0.0,
                "read_fraction": read / cached if cached else 0.0,
                "kv_nbytes": self.kv_nbytes}


def capture_decode_trace(model: Any, input_ids: Any, path: str | Any, *, layer: int, heads: Sequence[int] | None = None,
                         n_queries: int = 256, chunk: int | None = None) -> dict[str, np.ndarray]:
    """Save one layer's rotated keys, values and decode queries over a text, for ``sparseattn decode --data``.

    The model runs over ``input_ids`` (SDPA, a DynamicCache; in chunks of ``chunk`` tokens when given, as a
    chunked prefill); the attention calls of ``layer`` are recorded: its queries and keys after RoPE, and
    its values.  The queries of the last ``n_queries`` positions are exactly the queries a decode step at
    those positions computes (the model is causal), so the file is a real decode workload: each query may
    attend the keys at positions up to its own.  ``layer`` must be a full-attention layer: a sliding-window
    layer's queries never see keys beyond their window, so its trace would not be that workload.

    Parameters
    ----------
    model : transformers causal LM (decoder-only, full attention)
    input_ids : int tensor (1, S)
    path : path-like
        ``.npz`` written with ``q`` (h, n_queries, E), ``k`` (h, S, E), ``v`` (h, S, Ev) float32 (the kv head of
        each chosen query head: ``h // (H / H_kv)``), ``q_pos`` (n_queries,), ``k_pos`` (S,) int64, ``scale``.
    layer : int
        Decoder layer (0-based).
    heads : sequence of int, optional
        Query heads to keep (default all).
    n_queries : int, default 256
        Decode queries saved (the last positions), <= S.
    chunk : int, optional
        Tokens per forward pass (default: all S in one): memory and time of a long text's attention grow
        with the chunk (Gemma 3 270M at 32,768 tokens here: one pass 616 s, 2,048-token chunks about 3 minutes).

    Returns
    -------
    dict of the arrays written.

    Raises
    ------
    ValueError
        ``layer`` out of range or a sliding-window layer (the message lists the full-attention layers),
        ``n_queries``, ``chunk`` or a head out of range, an empty ``heads``, ``input_ids`` that are not
        integer token ids of shape (1, S) below the vocabulary size, a ``path`` that is a folder or whose
        folder does not exist (all checked before the model runs).
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (1, S) with S >= 1; got {tuple(ids.shape)}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids; got dtype {ids.dtype} (use torch.long).")
    S = int(ids.shape[1])
    text = model.config.get_text_config(decoder=True)
    vocab = int(text.vocab_size)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the model's vocab_size); got values from "
                         f"{lo} to {hi}.")
    n_layers = text.num_hidden_layers
    layer = check_positive_int(layer, "layer", minimum=0, maximum=n_layers - 1)
    layer_types, _ = get_layer_types_and_kwargs(text)
    if layer_types[layer] != "full_attention":
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        raise ValueError(f"layer {layer} is a {layer_types[layer]} layer: its queries see only their window, so "
                         f"its trace is not a decode workload over the whole text; pick a full-attention layer "
                         f"({full if full else 'this model has none'}).")
    n_queries = check_positive_int(n_queries, "n_queries", maximum=S)
    chunk = S if chunk is None else check_positive_int(chunk, "chunk")
    folder = Path(path).parent
    if Path(path).is_dir():  # checked before the forward pass, not after minutes of it
        raise ValueError(f"path {path} is a folder; give a file name such as {Path(path) / 'trace.npz'}.")
    if not folder.is_dir():
        why = "is a file, not a folder" if folder.exists() else "does not exist; create it first"
        raise ValueError(f"path {path}: its folder {folder} {why}.")
    n_heads = int(text.num_attention_heads)
    if heads is not None and len(heads) == 0:
        raise ValueError(f"heads must list at least one query head in [0, {n_heads}); got an empty list (or "
                         f"leave heads=None for all).")
    keep = list(range(n_heads)) if heads is None else [
        check_positive_int(h, "heads", minimum=0, maximum=n_heads - 1) for h in heads]
    seen: dict[str, Any] = {"q": []}

    def record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if getattr(module, "layer_idx", None) == layer:  # keys / values: every token so far (the last call's)
            seen["q"].append(query[0, :, -n_queries:].detach().float().numpy().copy())
            seen.update(k=key[0].detach(), v=value[0].detach(), scale=kwargs.get("scaling") or query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = "sparseattn-capture"
    AttentionInterface.register(name, record)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            if chunk >= S:
                model(ids, logits_to_keep=1)
            else:
                from transformers import DynamicCache

                cache = DynamicCache(config=model.config)
                for a in range(0, S, chunk):
                    model(ids[:, a:a + chunk], cache=cache, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    if not seen["q"]:
        raise ValueError(f"layer {layer} made no attention call through transformers' attention interface.")
    seen["q"] = np.concatenate(seen["q"], axis=1)[:, -n_queries:]
    seen["k"], seen["v"] = (seen[n].float().numpy().copy() for n in ("k", "v"))
    if seen["k"].shape[1] != S:
        raise ValueError(f"layer {layer}'s last attention call saw {seen['k'].shape[1]} keys, not the {S} tokens "
                         f"of the text; its cache keeps fewer (a sliding or chunked layer).")
    H, h_kv = seen["q"].shape[0], seen["k"].shape[0]
    kv_of = [h // (H // h_kv) for h in keep]
    out = {"q": seen["q"][keep], "k": seen["k"][kv_of], "v": seen["v"][kv_of],
           "q_pos": np.arange(S - n_queries, S, dtype=np.int64), "k_pos": np.arange(S, dtype=np.int64),
           "scale": np.float64(seen["scale"])}
    np.savez(path, **out)
    return out
