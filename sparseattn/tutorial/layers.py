"""Attention layers with explicit projections: one head, several heads, self- or cross-attention.

Both layers run dense attention through the engine's exact reference
(:func:`sparseattn.attention.dense.scaled_dot_product_attention`) or, with ``sparse=``, sparse attention
over a SparsePattern or the keys a selector picks per head (:func:`sparseattn.attention.sparse.sparse_attention`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..attention.dense import scaled_dot_product_attention
from ..inputs import as_float_array, check_positive_int
from ._weights import layer_inputs, weight

__all__ = ["AttentionHead", "MultiHeadAttention"]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, attn_mask: Any, is_causal: bool,
            scale: float | None, sparse: Any, top_k: int, bias: Any) -> np.ndarray:
    """Dense reference when ``sparse`` is None, else sparse attention over the selected keys."""
    if sparse is None:
        return scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                            bias=bias)
    if attn_mask is not None:
        raise ValueError("attn_mask is for dense attention; with sparse= restrict the pattern instead.")
    from ..attention.sparse import sparse_attention

    return sparse_attention(q, k, v, sparse, k=top_k, is_causal=is_causal, scale=scale, bias=bias)


class AttentionHead:
    """One attention head with explicit projections.

    Parameters
    ----------
    W_query : float array (d_model, dk)
    W_key : float array (d_ctx, dk)
    W_value : float array (d_ctx, dv)

    Examples
    --------
    >>> from sparseattn.tutorial import AttentionHead, seed_example
    >>> e = seed_example()
    >>> head = AttentionHead(e["W_query"], e["W_key"], e["W_value"])
    >>> head(e["X"], scale=1.0).round(6)[0].tolist()
    [1.936621, 6.683105, 1.595068]
    """

    def __init__(self, W_query: Any, W_key: Any, W_value: Any) -> None:
        self.W_query = weight(W_query, "W_query")
        self.W_key = weight(W_key, "W_key")
        self.W_value = weight(W_value, "W_value", self.W_key.shape[0])
        if self.W_query.shape[1] != self.W_key.shape[1]:
            raise ValueError(f"W_query and W_key must produce the same dk; got {self.W_query.shape[1]} "
                             f"and {self.W_key.shape[1]}.")

    def project(self, x: np.ndarray, context: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step 3: Q (..., L, dk), K (..., S, dk), V (..., S, dv) from x (..., L, d_model) and context."""
        x, c = layer_inputs(x, context, self.W_query.shape[0], self.W_key.shape[0])
        return x @ self.W_query, c @ self.W_key, c @ self.W_value

    def __call__(self, x: np.ndarray, context: np.ndarray | None = None, *, attn_mask: Any = None,
                 is_causal: bool = False, scale: float | None = None, sparse: Any = None, k: int = 64,
                 bias: Any = None) -> np.ndarray:
        """Attention output; self-attention when ``context`` is None, else cross-attention.

        Parameters
        ----------
        x : float array (..., L, d_model)
        context : float array (..., S, d_ctx), optional
            Source of keys and values (default: ``x``).
        attn_mask, is_causal, scale, bias
            As in :func:`sparseattn.scaled_dot_product_attention` (``attn_mask`` for dense only).
        sparse : SparsePattern, selector or selector spec, optional
            Attend only to the selected keys (``k`` per query for top-k selectors).

        Returns
        -------
        array (..., L, dv), the promoted input dtype.
        """
        q, kk, v = self.project(x, context)
        return _attend(q, kk, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, sparse=sparse,
                       top_k=k, bias=bias)


class MultiHeadAttention:
    """Several heads side by side; outputs concatenated and projected by ``W_out``.

    Parameters
    ----------
    W_query : float array (H, d_model, dk)
    W_key : float array (H, d_ctx, dk)
    W_value : float array (H, d_ctx, dv)
    W_out : float array (H * dv, d_out), optional
        Output projection; None returns the concatenated heads (..., L, H * dv).
    """

    def __init__(self, W_query: Any, W_key: Any, W_value: Any, W_out: Any = None) -> None:
        self.W_query = as_float_array(W_query, "W_query", min_ndim=3)
        self.W_key = as_float_array(W_key, "W_key", min_ndim=3)
        self.W_value = as_float_array(W_value, "W_value", min_ndim=3)
        for name, w in (("W_query", self.W_query), ("W_key", self.W_key), ("W_value", self.W_value)):
            if w.ndim != 3:
                raise ValueError(f"{name} must be 3-D (heads, d_in, d_head); got shape {w.shape}.")
        H = self.W_query.shape[0]
        if self.W_key.shape[0] != H or self.W_value.shape[0] != H:
            raise ValueError(f"W_query, W_key and W_value must have the same number of heads; got "
                             f"{H}, {self.W_key.shape[0]}, {self.W_value.shape[0]}.")
        if self.W_query.shape[2] != self.W_key.shape[2]:
            raise ValueError("W_query and W_key must produce the same head dimension dk.")
        if self.W_key.shape[1] != self.W_value.shape[1]:
            raise ValueError("W_key and W_value must read the same context features.")
        self.W_out: np.ndarray | None = None
        if W_out is not None:
            self.W_out = weight(W_out, "W_out", H * self.W_value.shape[2])

    @property
    def num_heads(self) -> int:
        """Number of heads H."""
        return int(self.W_query.shape[0])

    @property
    def heads(self) -> list[AttentionHead]:
        """Each head as an :class:`AttentionHead` (same weights)."""
        return [AttentionHead(self.W_query[h], self.W_key[h], self.W_value[h]) for h in range(self.num_heads)]

    @classmethod
    def random(cls, d_model: int, num_heads: int, *, d_head: int | None = None, seed: int = 0,
               dtype: Any = np.float32, output_projection: bool = True) -> MultiHeadAttention:
        """Seeded Xavier-style initialisation (a stand-in for trained weights).

        Weights are (num_heads, d_model, d_head) in ``dtype``; ``d_head`` defaults to
        ``d_model // num_heads``; ``W_out`` is (num_heads * d_head, d_model) unless
        ``output_projection=False``.
        """
        d_model = check_positive_int(d_model, "d_model")
        num_heads = check_positive_int(num_heads, "num_heads")
        if d_head is None:
            if d_model % num_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}), "
                                 f"or pass d_head.")
            d_head = d_model // num_heads
        d_head = check_positive_int(d_head, "d_head")
        rng = np.random.default_rng(seed)
        std = (2.0 / (d_model + d_head)) ** 0.5
        w = [rng.normal(0, std, (num_heads, d_model, d_head)).astype(dtype) for _ in range(3)]
        w_out = rng.normal(0, std, (num_heads * d_head, d_model)).astype(dtype) if output_projection else None
        return cls(*w, W_out=w_out)

    def project(self, x: np.ndarray, context: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-head Q (..., H, L, dk), K (..., H, S, dk), V (..., H, S, dv)."""
        x, c = layer_inputs(x, context, self.W_query.shape[1], self.W_key.shape[1])
        xq = x[..., None, :, :]
        xc = c[..., None, :, :]
        return xq @ self.W_query, xc @ self.W_key, xc @ self.W_value

    def __call__(self, x: np.ndarray, context: np.ndarray | None = None, *, attn_mask: Any = None,
                 is_causal: bool = False, scale: float | None = None, sparse: Any = None, k: int = 64,
                 bias: Any = None, rope: bool = False) -> np.ndarray:
        """Multi-head attention of x over context (default: x).

        Parameters
        ----------
        x : float array (..., L, d_model)
        context : float array (..., S, d_ctx), optional
        attn_mask, is_causal, scale, bias, sparse, k
            As in :meth:`AttentionHead.__call__`; a bias's heads are the H heads here.
        rope : bool
            Rotate queries and keys by their positions (RoPE, :func:`sparseattn.positional.rope`) first.

        Returns
        -------
        array (..., L, d_out) with ``W_out``, else the concatenated heads (..., L, H * dv).
        """
        q, kk, v = self.project(x, context)
        if rope:
            from ..positional import rope as apply_rope_qk

            q, kk = apply_rope_qk(q, kk)
        heads = _attend(q, kk, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, sparse=sparse,
                        top_k=k, bias=bias)
        concat = np.moveaxis(heads, -3, -2)  # (..., L, H, dv)
        concat = concat.reshape(concat.shape[:-2] + (concat.shape[-2] * concat.shape[-1],))  # (-1 fails at L = 0)
        return concat @ self.W_out if self.W_out is not None else concat
