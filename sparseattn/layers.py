"""The tutorial's attention concepts as objects: heads, multi-head, self/cross, and a step-by-step mode.

The eight steps of attention (for inputs X and, for cross-attention, a context C):

1. prepare the inputs X (and C);
2. initialise the weights W_query, W_key, W_value;
3. queries Q = X W_query, keys K = C W_key, values V = C W_value (C = X for self-attention);
4. scores of query i against every key: q_i . k_j (times ``scale``);
5. softmax over those scores -> attention weights;
6. multiply each value v_j by its weight;
7. sum the weighted values -> output i;
8. repeat 4-7 for every query.

Multi-head attention runs several independent (W_query, W_key, W_value) sets, concatenates the head
outputs and applies an output projection W_out.  Every layer can run dense (the exact reference) or
sparse (a SparsePattern, or a selector picking keys per head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._validation import as_float_array, check_positive_int, check_scale
from .dense import scaled_dot_product_attention
from .kernels import steps as step_kernels
from .pattern import SparsePattern


def seed_example() -> dict[str, np.ndarray]:
    """The tutorial's worked example: inputs X (3, 4) and trained weights W_key/W_query/W_value (4, 3).

    See ``shared/seed-example.md``: with ``scale=1`` output 1 is [1.936621, 6.683105, 1.595068].
    """
    return {
        "X": np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=np.float64),
        "W_key": np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=np.float64),
        "W_query": np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=np.float64),
        "W_value": np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=np.float64),
    }


def _weight(w: Any, name: str, in_dim: int | None = None) -> np.ndarray:
    arr = as_float_array(w, name, min_ndim=2)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (d_in, d_out); got shape {arr.shape}.")
    if in_dim is not None and arr.shape[0] != in_dim:
        raise ValueError(f"{name} expects inputs with {arr.shape[0]} features; got {in_dim}.")
    return arr


def _inputs(x: Any, context: Any, d_query: int, d_key: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated (x, context) for a layer whose projections read d_query / d_key features."""
    x = as_float_array(x, "x", min_ndim=2)
    c = x if context is None else as_float_array(context, "context", min_ndim=2)
    if x.shape[-1] != d_query:
        raise ValueError(f"x has {x.shape[-1]} features; W_query expects {d_query}.")
    if c.shape[-1] != d_key:
        raise ValueError(f"context has {c.shape[-1]} features; W_key expects {d_key}.")
    return x, c


@dataclass
class AttentionSteps:
    """Every intermediate of the eight steps, for inspection and teaching.

    Shapes (dense): queries (L, dk), keys (S, dk), values (S, dv), scores (L, S), weights (L, S),
    weighted_values (L, S, dv) = weights[..., None] * values, outputs (L, dv).  With a sparse pattern,
    non-selected pairs have score -inf and weight 0.
    """

    inputs: np.ndarray
    context: np.ndarray
    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    scores: np.ndarray
    weights: np.ndarray
    weighted_values: np.ndarray
    outputs: np.ndarray
    scale: float

    def format(self, decimals: int = 6, query_index: int | None = None) -> str:
        """Human-readable walk through the eight steps (all queries, or one)."""
        np_opts = {"precision": decimals, "suppress_small": True, "floatmode": "maxprec"}
        f = lambda a: np.array2string(np.asarray(a), **np_opts)  # noqa: E731
        rows = range(self.queries.shape[0]) if query_index is None else [query_index]
        lines = [
            "Step 1  inputs X:", f(self.inputs),
            "Step 2  weights W_query, W_key, W_value (given)",
            "Step 3  K = X W_key:", f(self.keys), "        Q = X W_query:", f(self.queries),
            "        V = X W_value:", f(self.values),
        ]
        for i in rows:
            lines += [
                f"--- query {i + 1} ---",
                f"Step 4  scores q{i + 1} . k_j (x scale {self.scale:.6g}): {f(self.scores[i])}",
                f"Step 5  softmax -> weights: {f(self.weights[i])}",
                "Step 6  weighted values w_j * v_j:", f(self.weighted_values[i]),
                f"Step 7  sum -> output {i + 1}: {f(self.outputs[i])}",
            ]
        lines.append("Step 8  repeated for every query: outputs =")
        lines.append(f(self.outputs))
        return "\n".join(lines)


def attention_steps(inputs: Any, W_query: Any, W_key: Any, W_value: Any, *, context: Any = None,
                    scale: float | None = None, is_causal: bool = False,
                    pattern: SparsePattern | None = None) -> AttentionSteps:
    """Run the eight steps explicitly and keep every intermediate.

    Parameters
    ----------
    inputs : float array (L, d_in)
        The sequence producing the queries.
    W_query, W_key, W_value : float arrays (d_in, dk), (d_ctx, dk), (d_ctx, dv)
    context : float array (S, d_ctx), optional
        Source of keys and values for cross-attention (default: ``inputs``, self-attention).
    scale : float, optional
        Score scale; default ``1/sqrt(dk)``.  The tutorial's example uses ``scale=1``.
    pattern : SparsePattern, optional
        Sparse query: only the selected keys are scored (computed by the unfused Numba step kernels).
    """
    X = as_float_array(inputs, "inputs")
    C = X if context is None else as_float_array(context, "context")
    if X.ndim != 2 or C.ndim != 2:
        raise ValueError("attention_steps works on one sequence: inputs and context must be 2-D.")
    Wq = _weight(W_query, "W_query", X.shape[1])
    Wk = _weight(W_key, "W_key", C.shape[1])
    Wv = _weight(W_value, "W_value", C.shape[1])
    if Wq.shape[1] != Wk.shape[1]:
        raise ValueError(f"W_query and W_key must produce the same dk; got {Wq.shape[1]} and {Wk.shape[1]}.")
    Q, K, V = X @ Wq, C @ Wk, C @ Wv
    sc = check_scale(scale, Q.shape[1])
    L, S = Q.shape[0], K.shape[0]
    if pattern is None:
        allowed = np.tril(np.ones((L, S), bool)) if is_causal else np.ones((L, S), bool)
        scores = np.where(allowed, (Q @ K.T) * sc, -np.inf)
        m = scores.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(scores - m)
        tot = e.sum(axis=1, keepdims=True)
        weights = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    else:
        if pattern.shape != (L, S):
            raise ValueError(f"pattern shape {pattern.shape} does not match (L, S) = {(L, S)}.")
        if is_causal:
            pattern = pattern.causal()
        qc, kc = np.ascontiguousarray(Q), np.ascontiguousarray(K)
        data = step_kernels.sparse_scores(qc, kc, pattern.indptr, pattern.indices, sc)
        probs, _ = step_kernels.csr_softmax(pattern.indptr, data)
        rows = np.repeat(np.arange(L), pattern.nnz_per_row)
        scores = np.full((L, S), -np.inf)
        scores[rows, pattern.indices] = data
        weights = np.zeros((L, S))
        weights[rows, pattern.indices] = probs
    weighted = weights[:, :, None] * V[None, :, :]
    outputs = weighted.sum(axis=1)
    return AttentionSteps(X, C, Q, K, V, scores, weights, weighted, outputs, sc)


class AttentionHead:
    """One attention head with explicit projections.

    Parameters
    ----------
    W_query : (d_model, dk)
    W_key : (d_ctx, dk)
    W_value : (d_ctx, dv)
    """

    def __init__(self, W_query: Any, W_key: Any, W_value: Any) -> None:
        self.W_query = _weight(W_query, "W_query")
        self.W_key = _weight(W_key, "W_key")
        self.W_value = _weight(W_value, "W_value", self.W_key.shape[0])
        if self.W_query.shape[1] != self.W_key.shape[1]:
            raise ValueError(f"W_query and W_key must produce the same dk; got {self.W_query.shape[1]} "
                             f"and {self.W_key.shape[1]}.")

    def project(self, x: np.ndarray, context: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step 3: (Q (..., L, dk), K (..., S, dk), V (..., S, dv))."""
        x, c = _inputs(x, context, self.W_query.shape[0], self.W_key.shape[0])
        return x @ self.W_query, c @ self.W_key, c @ self.W_value

    def __call__(self, x: np.ndarray, context: np.ndarray | None = None, *, attn_mask: Any = None,
                 is_causal: bool = False, scale: float | None = None, sparse: Any = None, k: int = 64,
                 bias: Any = None) -> np.ndarray:
        """Attention output (..., L, dv); self-attention when ``context`` is None, else cross-attention.

        ``sparse``: a SparsePattern, selector or selector spec to attend only to selected keys.
        """
        q, kk, v = self.project(x, context)
        if sparse is None:
            return scaled_dot_product_attention(q, kk, v, attn_mask, is_causal, scale, bias=bias)
        if attn_mask is not None:
            raise ValueError("attn_mask is for dense attention; with sparse= restrict the pattern instead.")
        from .sparse import sparse_attention
        return sparse_attention(q, kk, v, sparse, k=k, is_causal=is_causal, scale=scale, bias=bias)


class MultiHeadAttention:
    """Several heads side by side; outputs concatenated and projected by ``W_out``.

    Parameters
    ----------
    W_query : (H, d_model, dk)
    W_key : (H, d_ctx, dk)
    W_value : (H, d_ctx, dv)
    W_out : (H * dv, d_out), optional
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
        self.W_out = None
        if W_out is not None:
            self.W_out = _weight(W_out, "W_out", H * self.W_value.shape[2])

    @property
    def num_heads(self) -> int:
        return int(self.W_query.shape[0])

    @property
    def heads(self) -> list[AttentionHead]:
        """Each head as an :class:`AttentionHead` (same weights)."""
        return [AttentionHead(self.W_query[h], self.W_key[h], self.W_value[h]) for h in range(self.num_heads)]

    @classmethod
    def random(cls, d_model: int, num_heads: int, *, d_head: int | None = None, seed: int = 0,
               dtype: Any = np.float32, output_projection: bool = True) -> MultiHeadAttention:
        """Seeded Xavier-style initialisation (a stand-in for trained weights)."""
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
        x, c = _inputs(x, context, self.W_query.shape[1], self.W_key.shape[1])
        xq = x[..., None, :, :]
        xc = c[..., None, :, :]
        return xq @ self.W_query, xc @ self.W_key, xc @ self.W_value

    def __call__(self, x: np.ndarray, context: np.ndarray | None = None, *, attn_mask: Any = None,
                 is_causal: bool = False, scale: float | None = None, sparse: Any = None, k: int = 64,
                 bias: Any = None, rope: bool = False) -> np.ndarray:
        """Multi-head attention of x (..., L, d_model) over context (..., S, d_ctx) (default: x).

        Returns (..., L, d_out) with ``W_out``, else the concatenated heads (..., L, H * dv).
        ``rope=True`` rotates queries and keys by their positions (RoPE) before scoring.
        """
        q, kk, v = self.project(x, context)
        if rope:
            from .positional import rope as apply_rope_qk
            q, kk = apply_rope_qk(q, kk)
        if sparse is None:
            heads = scaled_dot_product_attention(q, kk, v, attn_mask, is_causal, scale, bias=bias)
        else:
            if attn_mask is not None:
                raise ValueError("attn_mask is for dense attention; with sparse= restrict the pattern instead.")
            from .sparse import sparse_attention
            heads = sparse_attention(q, kk, v, sparse, k=k, is_causal=is_causal, scale=scale, bias=bias)
        concat = np.moveaxis(heads, -3, -2)  # (..., L, H, dv)
        concat = concat.reshape(concat.shape[:-2] + (-1,))
        return concat @ self.W_out if self.W_out is not None else concat
