"""The eight steps of attention, run one at a time with every intermediate kept.

Steps 4 and 5 (scores, softmax) are the engine's unfused step kernels (``sparseattn.kernels.steps``) over
a CSR pattern: every (query, key) pair for a dense query, the selected pairs for a sparse one.  Steps 6
and 7 are written out in numpy so that the weighted values stay visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..inputs import as_float_array, check_scale, overflow_message, result_dtype
from ..kernels import steps as step_kernels
from ..pattern import SparsePattern
from ._weights import weight

__all__ = ["AttentionSteps", "attention_steps"]


@dataclass
class AttentionSteps:
    """Every intermediate of the eight steps, for inspection and teaching.

    One sequence; arrays are float64 when any input or weight was float64, else float32 (``inputs`` and
    ``context`` are kept as given).

    Attributes
    ----------
    inputs : (L, d_in) the sequence X as given (step 1)
    context : (S, d_ctx) the sequence giving keys and values (``inputs`` for self-attention)
    queries : (L, dk), keys : (S, dk), values : (S, dv) -- step 3
    scores : (L, S) -- step 4, ``scale * q_i . k_j``; ``-inf`` where a pair is not scored
    weights : (L, S) -- step 5, softmax of each row of ``scores``; 0 where a pair is not scored
    weighted_values : (L, S, dv) -- step 6, ``weights[..., None] * values``
    outputs : (L, dv) -- steps 7 and 8, the sum over keys of ``weighted_values`` for every query
    scale : float, the score scale used
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
        """Human-readable walk through the eight steps, for all queries or one (0-based ``query_index``)."""
        np_opts = {"precision": decimals, "suppress_small": True, "floatmode": "maxprec"}

        def f(a: Any) -> str:
            return np.array2string(np.asarray(a), **np_opts)

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
        The sequence producing the queries (float16, float32 or float64).
    W_query, W_key, W_value : float arrays (d_in, dk), (d_ctx, dk), (d_ctx, dv)
    context : float array (S, d_ctx), optional
        Source of keys and values for cross-attention (default: ``inputs``, self-attention).
    scale : float, optional
        Score scale; default ``1/sqrt(dk)``.  The worked example (:mod:`sparseattn.tutorial.example`)
        uses ``scale=1``.
    is_causal : bool
        Query i scores keys j <= i only (top-left aligned, as in the dense reference).
    pattern : SparsePattern (L, S), optional
        Sparse query: only the selected keys are scored.  Default: a dense query (every key).

    Returns
    -------
    AttentionSteps
        Computed in float64 when any input or weight is float64, else in float32.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> eye = np.eye(2)
    >>> s = attention_steps(x, eye, eye, eye, scale=1.0)
    >>> np.round(s.weights, 4).tolist()  # softmax([1, 0]) and softmax([0, 1])
    [[0.7311, 0.2689], [0.2689, 0.7311]]
    """
    # Step 1: the inputs (and the context for cross-attention).
    X = as_float_array(inputs, "inputs")
    C = X if context is None else as_float_array(context, "context")
    if X.ndim != 2 or C.ndim != 2:
        raise ValueError("attention_steps works on one sequence: inputs and context must be 2-D.")
    # Step 2: the weights.
    Wq = weight(W_query, "W_query", X.shape[1])
    Wk = weight(W_key, "W_key", C.shape[1])
    Wv = weight(W_value, "W_value", C.shape[1])
    if Wq.shape[1] != Wk.shape[1]:
        raise ValueError(f"W_query and W_key must produce the same dk; got {Wq.shape[1]} and {Wk.shape[1]}.")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")
    # Step 3: queries, keys and values.
    cdt = result_dtype(X, C, Wq, Wk, Wv)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below
        Q = np.ascontiguousarray(X.astype(cdt, copy=False) @ Wq.astype(cdt, copy=False))
        K = np.ascontiguousarray(C.astype(cdt, copy=False) @ Wk.astype(cdt, copy=False))
        V = C.astype(cdt, copy=False) @ Wv.astype(cdt, copy=False)
    fix = "pass float64 or smaller inputs / weights" if cdt != np.float64 else "pass smaller inputs / weights"
    for name, M in (("queries (inputs @ W_query)", Q), ("keys (context @ W_key)", K), ("values (context @ W_value)", V)):
        if not np.isfinite(M).all():  # finite inputs (checked above): the product overflowed
            raise ValueError(f"step 3: the {name} overflow {cdt.name}; {fix}.")
    sc = check_scale(scale, Q.shape[1])
    L, S = Q.shape[0], K.shape[0]
    if pattern is None:  # dense query: every query scores every (allowed) key
        pattern = SparsePattern.full(L, S, is_causal=bool(is_causal))
    else:
        if not isinstance(pattern, SparsePattern):
            raise TypeError(f"pattern must be a SparsePattern or None; got {type(pattern).__name__}.")
        if pattern.shape != (L, S):
            raise ValueError(f"pattern shape {pattern.shape} does not match (L, S) = {(L, S)}.")
        if is_causal:
            pattern = pattern.causal()
    # Step 4: scores of each query against its keys; step 5: softmax over them (the step kernels).
    pair_scores = step_kernels.sparse_scores(Q, K, pattern.indptr, pattern.indices, sc)
    if not np.isfinite(pair_scores).all():  # an infinite or NaN q.k * scale from finite inputs
        raise ValueError("step 4: " + overflow_message(cdt, sc))
    pair_weights, _ = step_kernels.csr_softmax(pattern.indptr, pair_scores)
    rows = np.repeat(np.arange(L), pattern.nnz_per_row)
    scores = np.full((L, S), -np.inf, dtype=cdt)
    scores[rows, pattern.indices] = pair_scores
    weights = np.zeros((L, S), dtype=cdt)
    weights[rows, pattern.indices] = pair_weights
    # Step 6: each value times its weight; step 7: the sum; step 8: for every query at once.
    weighted = weights[:, :, None] * V[None, :, :]
    with np.errstate(over="ignore", invalid="ignore"):
        outputs = weighted.sum(axis=1)
    if not np.isfinite(outputs).all():  # weights <= 1: the sum of weighted values overflowed
        raise ValueError(f"step 7: the weighted sum of the values overflows {cdt.name}; {fix}.")
    return AttentionSteps(X, C, Q, K, V, scores, weights, weighted, outputs, sc)
