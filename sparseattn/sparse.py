"""Sparse attention: attention of each query over the keys a pattern (or a selector) gives it.

Data path: Q/K/V validated once -> pattern (given, or built per (batch, head) group by a selector) ->
the fused Numba kernel (scores, stable softmax, weighted sum) -> output (+ lse, patterns, timings).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._broadcast import flat3, group_maps
from ._validation import as_float_array, check_positive_int, check_scale, overflow_message, result_dtype
from .kernels import fused
from .kernels.bias import BIAS_DENSE, no_bias_args
from .pattern import SparsePattern, _positions, stack_patterns
from .threads import get_num_threads

CHUNK_ROWS = 64  # rows per prange task: big enough to amortise scratch allocation, small for balance
PARALLEL_MIN_WORK = 1 << 20  # gathered elements below which the serial kernel is faster


@dataclass
class SparseAttentionResult:
    """Output of :func:`sparse_attention` with ``return_result=True``.

    Attributes
    ----------
    output : array (..., L, Ev)
    lse : array (..., L); ``-inf`` on rows that selected no key
    patterns : list of SparsePattern, one per flattened (batch, head) group (or one shared); empty for
        selectors that attend by themselves (``cluster:mode=block``)
    timings : dict with ``build``, ``select``, ``kernel`` seconds (perf_counter)
    selector : the selector's spec string, or None for an explicit pattern
    """

    output: np.ndarray
    lse: np.ndarray
    patterns: list[SparsePattern]
    timings: dict[str, float] = field(default_factory=dict)
    selector: str | None = None


def _bias_args(bias: Any, lead: tuple[int, ...], L: int, S: int, G: int, cdt: np.dtype,
               query_positions: Any, key_positions: Any) -> tuple:
    if bias is None:
        return no_bias_args(G) + (1,)
    qpos = _positions(query_positions, L, "query_positions")
    kpos = _positions(key_positions, S, "key_positions")
    if hasattr(bias, "kernel_args"):
        kind, params, ints = bias.kernel_args()
        n_heads = lead[-1] if lead else 1
        if bias.num_heads != n_heads:
            raise ValueError(f"bias has {bias.num_heads} heads but the inputs have {n_heads} (dimension -3).")
        return (int(kind), np.ascontiguousarray(params, np.float64), np.ascontiguousarray(ints, np.int64),
                qpos, kpos, np.zeros((1, 1, 1), cdt), np.zeros(G, np.int64), int(n_heads))
    arr = as_float_array(bias, "bias", min_ndim=2, check_finite=False)  # -inf forbids a pair: legal
    if arr.shape[-2:] != (L, S):
        raise ValueError(f"bias array must end in (L, S) = {(L, S)}; got {arr.shape}.")
    if np.isnan(arr).any():
        raise ValueError("bias contains NaN; use -inf to forbid a pair.")
    blead, _, bmap = group_maps(lead, arr.shape[:-2], kv_name="bias")
    if tuple(blead) != tuple(lead):
        raise ValueError(f"bias leading dims {arr.shape[:-2]} must broadcast to the inputs' {lead} without "
                         f"widening them.")
    dense = np.ascontiguousarray(flat3(arr), dtype=cdt)
    return (BIAS_DENSE, np.zeros((1, 1)), np.zeros(3, np.int64), qpos, kpos, dense, bmap, 1)


def _uses_attend(selector: Any) -> bool:
    """True for selectors that compute attention themselves (cluster routing in block mode)."""
    return callable(getattr(selector, "attend", None)) and selector.params.get("mode") == "block"


def sparse_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    pattern: SparsePattern | Sequence[SparsePattern] | Any,
    *,
    k: int = 64,
    is_causal: bool = False,
    scale: float | None = None,
    bias: Any = None,
    query_positions: np.ndarray | None = None,
    key_positions: np.ndarray | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    return_result: bool = False,
    check_finite: bool = True,
) -> np.ndarray | tuple[np.ndarray, np.ndarray] | SparseAttentionResult:
    """Attention of each query over the keys selected for it.

    Parameters
    ----------
    query : float array, shape (..., L, E)
    key : float array, shape (..., S, E)
    value : float array, shape (..., S, Ev)
    pattern : SparsePattern, sequence of SparsePattern, Selector, or selector spec string
        A single (L, S) pattern is shared by every (batch, head) group; a sequence gives one pattern
        per group (flattened leading dims, C order).  A selector (object or string such as
        ``"window:width=64+faiss-hnsw:M=32"``) is built on each group's keys and queried with ``k``.
    k : int
        Keys per query asked of a selector (ignored for explicit patterns).
    is_causal : bool
        Only keys with position <= the query's: selectors select accordingly, and an explicit pattern is
        filtered with ``pattern.causal(query_positions, key_positions)`` (top-left alignment by default).
    scale : float, optional
        Default ``1 / sqrt(E)``.
    bias : RelativeBias or float array (..., L, S), optional
        Added to each selected score: ALiBi / T5 objects are evaluated per pair inside the kernel.
    query_positions, key_positions : int arrays, optional
        Positions for causal selection and relative biases (default ``arange``).
    enable_gqa : bool
        Fewer K/V heads than query heads (as in the dense reference).
    return_lse, return_result : bool
        Also return the log-sum-exp (..., L); or return a :class:`SparseAttentionResult`.

    Returns
    -------
    output (..., L, Ev) in the promoted input dtype; with ``return_lse`` also lse (..., L) in the
    computation dtype (float64 if any input is float64, else float32).  Rows with no selected key give
    zeros and ``lse = -inf``.
    """
    q = as_float_array(query, "query", check_finite=check_finite)
    kk = as_float_array(key, "key", check_finite=check_finite)
    v = as_float_array(value, "value", check_finite=check_finite)
    if q.shape[-1] != kk.shape[-1]:
        raise ValueError(f"query and key must have the same feature size E; got {q.shape} and {kk.shape}.")
    if kk.shape[-2] != v.shape[-2] or kk.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"key and value must agree on (..., S); got key {kk.shape} and value {v.shape}.")
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    sc = check_scale(scale, E)
    lead, q_map, kv_map = group_maps(q.shape[:-2], kk.shape[:-2], enable_gqa=enable_gqa)
    G = len(q_map)
    cdt = result_dtype(q, kk, v)
    if not np.isfinite(cdt.type(sc)):
        raise ValueError(f"scale={sc:g} overflows the computation dtype {cdt.name}; pass float64 inputs.")
    out_dtype = np.result_type(q.dtype, kk.dtype, v.dtype)
    q3 = np.ascontiguousarray(flat3(q), dtype=cdt)
    k3 = np.ascontiguousarray(flat3(kk), dtype=cdt)
    v3 = np.ascontiguousarray(flat3(v), dtype=cdt)
    timings = {"build": 0.0, "select": 0.0, "kernel": 0.0}
    spec = None
    selector_spec = None
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")

    if isinstance(pattern, SparsePattern):
        patterns = [pattern]
    elif isinstance(pattern, (list, tuple)):
        patterns = list(pattern)
        if len(patterns) != G:
            raise ValueError(f"pattern sequence has {len(patterns)} entries; expected one per (batch, head) "
                             f"group = {G} for leading dims {lead}, or pass a single SparsePattern.")
    else:
        from .selectors import Selector, get_selector, spec_string
        if not isinstance(pattern, (str, Selector)):
            raise TypeError(f"pattern must be a SparsePattern, a sequence of them, a Selector or a selector "
                            f"spec string; got {type(pattern).__name__}.")
        k = check_positive_int(k, "k")
        template = get_selector(pattern)
        spec = selector_spec = spec_string(template)
        patterns = []
        qpos = _positions(query_positions, L, "query_positions")
        kpos = _positions(key_positions, S, "key_positions")
        built: dict[int, Selector] = {}
        attends = _uses_attend(template)
        if attends and bias is not None:
            raise ValueError(f"bias is not supported by selector {spec!r} (block mode attends by itself); "
                             f"use mode=topk or drop bias.")
        out_direct = np.empty((G, L, Ev), dtype=cdt) if attends else None
        lse_direct = np.empty((G, L), dtype=cdt) if attends else None
        for g in range(G):
            kv = int(kv_map[g])
            if kv not in built:
                sel = get_selector(spec) if built or G > 1 else template
                t0 = time.perf_counter()
                sel.build(k3[kv], check_finite=False)
                timings["build"] += time.perf_counter() - t0
                built[kv] = sel
            t0 = time.perf_counter()
            if attends:
                # Block-mode selectors compute exact attention over their routed key blocks themselves
                # (dense products per cluster): no pattern is materialised.
                o, ls = built[kv].attend(q3[q_map[g]], v3[kv], scale=sc, is_causal=is_causal,
                                         query_positions=qpos, key_positions=kpos, check_finite=False)
                out_direct[g], lse_direct[g] = o, ls
            else:
                patterns.append(built[kv].query(q3[q_map[g]], k, is_causal=is_causal, query_positions=qpos,
                                                key_positions=kpos, check_finite=False))
            timings["select"] += time.perf_counter() - t0
        if attends:
            if np.isposinf(lse_direct).any() or (check_finite and np.isnan(lse_direct).any()):
                raise ValueError(overflow_message(cdt, sc))  # block attention over overflowing scores
            output = out_direct.reshape(lead + (L, Ev)).astype(out_dtype, copy=False)
            lse_out = lse_direct.reshape(lead + (L,))
            if return_result:
                return SparseAttentionResult(output, lse_out, [], timings, spec)
            return (output, lse_out) if return_lse else output

    for i, p in enumerate(patterns):
        if not isinstance(p, SparsePattern):
            raise TypeError(f"pattern[{i}] must be a SparsePattern; got {type(p).__name__}.")
        if p.shape != (L, S):
            raise ValueError(f"pattern shape {p.shape} does not match (L, S) = {(L, S)} of query/key.")
        # Cheap O(nnz) guard before the kernel: an out-of-range id (a pattern built with validate=False or
        # edited in place) would otherwise be an out-of-bounds read inside Numba, not an error.
        ip, ix = p.indptr, p.indices
        if ip[0] != 0 or ip[-1] != ix.shape[0] or (ip.shape[0] > 1 and np.diff(ip).min() < 0) or \
                (ix.size and (int(ix.min()) < 0 or int(ix.max()) >= S)):
            raise ValueError(f"pattern[{i}] is not a valid CSR over {S} keys (row pointers or key ids out of "
                             f"range); call pattern.validate() to see the first problem.")
    if is_causal and selector_spec is None:
        # An explicit pattern with is_causal=True: keep only keys at or before each query (as SDPA would).
        qpos_c = _positions(query_positions, L, "query_positions")
        kpos_c = _positions(key_positions, S, "key_positions")
        patterns = [p.causal(qpos_c, kpos_c) for p in patterns]
    shared = len(patterns) == 1
    if shared:
        indptr, indices = patterns[0].indptr, patterns[0].indices
    else:
        indptr, indices = stack_patterns(patterns)
    max_nnz = int(np.diff(indptr).max()) if indptr.shape[0] > 1 else 0
    bias_args = _bias_args(bias, lead, L, S, G, cdt, query_positions, key_positions)

    out = np.empty((G, L, Ev), dtype=cdt)
    lse = np.empty((G, L), dtype=cdt)
    # Small problems run serially: thread start-up costs more than it saves there, and the serial
    # variant compiles in a fraction of the parallel one's time (first-call latency).
    work = indices.shape[0] * (G if shared else 1) * (E + Ev)
    use_parallel = get_num_threads() > 1 and work > PARALLEL_MIN_WORK
    if bias is None:
        kernel = fused.fused_parallel_nobias if use_parallel else fused.fused_serial_nobias
    else:
        kernel = fused.fused_parallel if use_parallel else fused.fused_serial
    t0 = time.perf_counter()
    if G and L:
        # float32: the vectorised polynomial exp (rel. error <= 2.5e-7); float64 keeps np.exp's precision.
        kernel(q3, k3, v3, q_map, kv_map, indptr, indices, shared, cdt.type(sc), max_nnz, CHUNK_ROWS,
               *bias_args, out, lse, cdt == np.float32)
    timings["kernel"] = time.perf_counter() - t0
    if G and L and np.isposinf(lse).any():
        raise ValueError(overflow_message(cdt, sc))
    output = out.reshape(lead + (L, Ev)).astype(out_dtype, copy=False)
    lse_out = lse.reshape(lead + (L,))
    if return_result:
        return SparseAttentionResult(output, lse_out, patterns, timings, spec)
    if return_lse:
        return output, lse_out
    return output
