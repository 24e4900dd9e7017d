"""Sparse attention: attention of each query over the keys a pattern (or a selector) gives it.

Data path: Q/K/V validated once (:func:`sparseattn.inputs.attention_inputs`) -> patterns, given
(:func:`_explicit_patterns`) or built per (batch, head) group by a selector (:func:`_run_selector`) -> the
fused Numba kernel (:func:`_run_kernel`: scores, stable softmax, weighted sum) -> output and log-sum-exp.
A selector that declares ``attends`` (cluster routing in block mode) computes attention itself and no
pattern is made.

Two entry points share that path: :func:`sparse_attention` returns the output (and the lse with
``return_lse=True``); :func:`sparse_attention_result` also returns the patterns used and the time spent in
each step, as a :class:`SparseAttentionResult`.

Empty-row and overflow policy (:func:`sparseattn.inputs.check_lse`): a row with no selected key gives
zeros and ``lse = -inf``; finite inputs whose scores overflow the computation dtype raise ``ValueError``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..inputs import (
    AttentionInputs,
    as_float_array,
    attention_inputs,
    check_additive,
    check_lse,
    check_position_span,
    check_positive_int,
    flat3,
    group_maps,
    positions,
)
from ..kernels import fused
from ..kernels.bias import BIAS_DENSE, no_bias_args
from ..pattern import SparsePattern, stack_patterns
from ..threads import get_num_threads
from .merge import merge_parts
from .tail import Tail, as_tail, shrink_log_weights, tail_patterns

CHUNK_ROWS = 64  # rows per prange task: big enough to amortise scratch allocation, small for balance
PARALLEL_MIN_WORK = 1 << 20  # gathered elements below which the serial kernel is faster

PatternArg = SparsePattern | Sequence[SparsePattern] | Any  # also a Selector or a selector spec string


@dataclass
class SparseAttentionResult:
    """What :func:`sparse_attention_result` returns.

    Attributes
    ----------
    output : array (..., L, Ev)
        Promoted input dtype (float16 in -> float16 out).
    lse : array (..., L)
        Computation dtype (float64 if any input is float64, else float32); ``-inf`` on rows that selected
        no key.
    patterns : list of SparsePattern
        One (L, S) pattern per flattened (batch, head) group, or a single one shared by all groups; empty
        for selectors that attend by themselves (``selector.attends``, e.g. ``cluster:mode=block``).
    timings : dict
        ``build``, ``select`` and ``kernel`` seconds (``perf_counter``), summed over groups (and ``tail``
        with a tail estimate).
    selector : str or None
        The selector's spec string, or None for explicit patterns.
    tail_patterns : list of SparsePattern
        With ``tail=``: the sampled tail keys of each group (one pattern per group); else empty.  Keys read
        per query = selected + sampled.
    keys_read : int64 array (..., L)
        Keys each query read exactly: its pattern row (plus the sampled tail keys), or, for a selector that
        attends by itself, the keys of its routed clusters (the selector's per-row count).
    """

    output: np.ndarray
    lse: np.ndarray
    patterns: list[SparsePattern]
    timings: dict[str, float] = field(default_factory=dict)
    selector: str | None = None
    tail_patterns: list[SparsePattern] = field(default_factory=list)
    keys_read: np.ndarray | None = None


# ------------------------------------------------------------------------------------ public API
def sparse_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, pattern: PatternArg, *,
                     k: int = 64, is_causal: bool = False, scale: float | None = None, bias: Any = None,
                     query_positions: np.ndarray | None = None, key_positions: np.ndarray | None = None,
                     enable_gqa: bool = False, return_lse: bool = False, check_finite: bool = True,
                     tail: int | Tail | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention of each query over the keys selected for it.

    Parameters
    ----------
    query : float array, shape (..., L, E)
    key : float array, shape (..., S, E)
    value : float array, shape (..., S, Ev)
        float16, float32 or float64; leading (batch, head) dims of query against key/value broadcast like
        numpy's (key and value share theirs).
    pattern : SparsePattern, sequence of SparsePattern, Selector, or selector spec string
        A single (L, S) pattern is shared by every (batch, head) group; a sequence gives one pattern
        per group (flattened leading dims, C order).  A selector (object or string such as
        ``"window:width=64+faiss-hnsw:M=32"``) is built on each group's keys and queried with ``k``;
        a selector whose ``attends`` is True computes the attention itself.  A selector object is only
        a template: each call builds private clones (``selector.clone()``: same class, same
        ``get_params()``) on this call's keys, so the caller's object is never built, rebuilt or
        otherwise changed, and one object may be passed from several threads at once.  An
        already-built selector is treated the same way whether it was built on these keys or on
        others: its index is not reused (to reuse it, call ``selector.query(...)`` and pass the pattern).
    k : int
        Keys per query asked of a selector (ignored for explicit patterns).
    is_causal : bool
        Only keys with position <= the query's: selectors select accordingly, and an explicit pattern is
        filtered with ``pattern.causal(query_positions, key_positions)`` (top-left alignment by default).
    scale : float, optional
        Default ``1 / sqrt(E)``.
    bias : RelativeBias or float array (..., L, S), optional
        Added to each selected score: ALiBi / T5 objects are evaluated per pair inside the kernel.
    query_positions, key_positions : int arrays (L,), (S,), optional
        Positions for causal selection and relative biases (default ``arange``).
    enable_gqa : bool
        Fewer K/V heads than query heads (as in the dense reference).
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's selected scores.
    check_finite : bool
        Reject NaN/Inf in query, key and value (default).  False skips the O(n) check.
    tail : int or Tail, optional
        Estimate the unselected keys' contribution from a seeded uniform sample of them (``int`` = samples
        per query, or ``sparseattn.Tail(samples, seed)``) instead of treating them as zero; see
        :mod:`sparseattn.attention.tail` for the estimator and its bias.  Causal rows sample only visible
        keys.  Not for selectors that attend by themselves (``cluster:mode=block`` has ``estimate=``).

    Returns
    -------
    output : array (..., L, Ev)
        The promoted input dtype.  Rows with no selected key give zeros.
    lse : array (..., L), only with ``return_lse``
        The computation dtype (float64 if any input is float64, else float32); ``-inf`` for rows with no
        selected key.

    Raises
    ------
    ValueError
        Bad shapes or arguments; a selector that does not support the input (its
        ``not_supported_reasons`` are listed); scores that overflow the computation dtype.

    See Also
    --------
    sparse_attention_result : the same computation, also returning the patterns and timings.
    """
    res = sparse_attention_result(query, key, value, pattern, k=k, is_causal=is_causal, scale=scale, bias=bias,
                                  query_positions=query_positions, key_positions=key_positions,
                                  enable_gqa=enable_gqa, check_finite=check_finite, tail=tail)
    return (res.output, res.lse) if return_lse else res.output


def sparse_attention_result(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    pattern: PatternArg,
    *,
    k: int = 64,
    is_causal: bool = False,
    scale: float | None = None,
    bias: Any = None,
    query_positions: np.ndarray | None = None,
    key_positions: np.ndarray | None = None,
    enable_gqa: bool = False,
    check_finite: bool = True,
    tail: int | Tail | None = None,
) -> SparseAttentionResult:
    """:func:`sparse_attention` returning a :class:`SparseAttentionResult`: output, lse, patterns, timings.

    Parameters are those of :func:`sparse_attention` (without ``return_lse``: the lse is always there).
    Used by the benchmark harness and by callers that want to inspect the selected keys.
    """
    inp = attention_inputs(query, key, value, scale, is_causal, enable_gqa=enable_gqa,
                           check_finite=check_finite).in_computation_dtype()
    tail = as_tail(tail)
    if tail is not None and not isinstance(pattern, (SparsePattern, list, tuple)):
        _refuse_tail_for_attending(pattern)
    args = (pattern, k, is_causal, bias, query_positions, key_positions, check_finite, tail)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing scores: check_lse; values: below
        res = _result(inp, *args)
    if not np.isfinite(res.output).all():
        # Values near the dtype's limit: the weighted sums overflowed although the output is finite.
        # Computed again on power-of-two scaled value columns (rare: the check is one pass over the output).
        safe = inp.with_safe_values()
        if safe is not inp:
            res = _result(safe, *args)
    return res


def _result(inp: AttentionInputs, pattern: PatternArg, k: int, is_causal: bool, bias: Any, query_positions: Any,
            key_positions: Any, check_finite: bool, tail: Tail | None) -> SparseAttentionResult:
    """The body of :func:`sparse_attention_result` on validated inputs."""
    timings = {"build": 0.0, "select": 0.0, "kernel": 0.0}
    if isinstance(pattern, (SparsePattern, list, tuple)):
        patterns = _explicit_patterns(pattern, inp, is_causal, query_positions, key_positions)
        spec = None
    else:
        spec, patterns, direct = _run_selector(pattern, inp, k, is_causal, bias, query_positions, key_positions,
                                               timings)
        if direct is not None:
            out, lse, read = direct
            check_lse(lse, inp.cdt, inp.scale, nan_is_overflow=check_finite)
            return SparseAttentionResult(*inp.finish(out, lse), [], timings, spec,
                                         keys_read=read.reshape(*inp.lead, inp.L))
    bias_args = _bias_args(bias, inp, query_positions, key_positions)
    t0 = time.perf_counter()
    out, lse = _run_kernel(inp, patterns, bias_args, with_bias=bias is not None)
    timings["kernel"] = time.perf_counter() - t0
    check_lse(lse, inp.cdt, inp.scale, nan_is_overflow=check_finite)
    sampled: list[SparsePattern] = []
    if tail is not None and inp.G:  # zero groups: nothing to sample
        t0 = time.perf_counter()
        out, lse, sampled = _add_tail(inp, patterns, out, lse, bias_args, bias is not None, tail, is_causal,
                                      query_positions, key_positions, check_finite)
        timings["tail"] = time.perf_counter() - t0
    read = np.empty((inp.G, inp.L), dtype=np.int64)
    for g in range(inp.G):
        read[g] = (patterns[0] if len(patterns) == 1 else patterns[g]).nnz_per_row
        if sampled:
            read[g] += sampled[g].nnz_per_row
    return SparseAttentionResult(*inp.finish(out, lse), patterns, timings, spec, sampled,
                                 read.reshape(*inp.lead, inp.L))


# --------------------------------------------------------------------------------------- helpers
def _explicit_patterns(pattern: SparsePattern | Sequence[SparsePattern], inp: AttentionInputs, is_causal: bool,
                       query_positions: Any, key_positions: Any) -> list[SparsePattern]:
    """Check a given pattern (or one per group) against (L, S); filter it causally when asked.

    No per-call CSR check: a SparsePattern is validated when constructed and its arrays are read-only.
    """
    if isinstance(pattern, SparsePattern):
        patterns = [pattern]
    else:
        patterns = list(pattern)
        if len(patterns) != inp.G:
            raise ValueError(f"pattern sequence has {len(patterns)} entries; expected one per (batch, head) "
                             f"group = {inp.G} for leading dims {inp.lead}, or pass a single SparsePattern.")
    for i, p in enumerate(patterns):
        if not isinstance(p, SparsePattern):
            raise TypeError(f"pattern[{i}] must be a SparsePattern; got {type(p).__name__}.")
        if p.shape != (inp.L, inp.S):
            raise ValueError(f"pattern shape {p.shape} does not match (L, S) = {(inp.L, inp.S)} of query/key.")
    if is_causal:  # keep only keys at or before each query (as SDPA's is_causal would)
        qpos = positions(query_positions, inp.L, "query_positions")
        kpos = positions(key_positions, inp.S, "key_positions")
        patterns = [p.causal(qpos, kpos) for p in patterns]
    return patterns


def _resolve_selector(pattern: Any, inp: AttentionInputs, is_causal: bool, bias: Any) -> tuple[Any, str]:
    """A Selector (or spec string) -> (template selector, spec string), refused when it cannot run here.

    The one place where a selector's declared capabilities are checked: ``not_supported_reasons``
    (keys, dimension, causal, bias) here, ``attends`` in :func:`_run_selector`.
    """
    from ..selectors import Selector, get_selector, spec_string

    if not isinstance(pattern, (str, Selector)):
        raise TypeError(f"pattern must be a SparsePattern, a sequence of them, a Selector or a selector spec "
                        f"string; got {type(pattern).__name__}.")
    template = get_selector(pattern)
    spec = spec_string(template)
    # no key at all: nothing is built (see _run_selector), so no selector needs a number of keys
    reasons = template.not_supported_reasons(n_keys=inp.S or None, dim=inp.E, is_causal=is_causal,
                                             bias=bias is not None)
    if not inp.scale > 0:
        reasons.append(f"scale={inp.scale:g}: a selector keeps the keys it expects to carry the softmax mass "
                       f"(large q.k, or keys near the query), which they do only when scale > 0; pass a "
                       f"positive scale, or an explicit SparsePattern to attend with this one")
    if reasons:
        raise ValueError(f"selector {spec!r} cannot run here: {'; '.join(reasons)}.")
    return template, spec


def _run_selector(pattern: Any, inp: AttentionInputs, k: int, is_causal: bool, bias: Any, query_positions: Any,
                  key_positions: Any, timings: dict[str, float]
                  ) -> tuple[str, list[SparsePattern], tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """Build the selector once per distinct K/V group and query it (or let it attend) for every group.

    Returns (spec, patterns, direct): ``direct`` is the (G, L, Ev) output, (G, L) lse and (G, L) keys read
    when the selector attends by itself (then ``patterns`` is empty), else None.
    """
    k = check_positive_int(k, "k")
    template, spec = _resolve_selector(pattern, inp, is_causal, bias)  # the caller's object: read, never built
    attends = bool(template.attends)
    qpos = positions(query_positions, inp.L, "query_positions")
    kpos = positions(key_positions, inp.S, "key_positions")
    G = inp.G
    if inp.S == 0:  # every row is empty whatever the selector: the empty-row policy (zeros, lse -inf)
        if attends:
            return spec, [], (np.zeros((G, inp.L, inp.Ev), inp.cdt), np.full((G, inp.L), -np.inf, inp.cdt),
                              np.zeros((G, inp.L), np.int64))
        return spec, [SparsePattern.full(inp.L, 0) for _ in range(G)], None
    patterns: list[SparsePattern] = []
    out = np.empty((G, inp.L, inp.Ev), dtype=inp.cdt) if attends else None
    lse = np.empty((G, inp.L), dtype=inp.cdt) if attends else None
    read = np.empty((G, inp.L), dtype=np.int64) if attends else None
    built: dict[int, Any] = {}
    for g in range(G):
        kv = int(inp.kv_map[g])
        if kv not in built:
            sel = template.clone()  # private: the caller's selector is never mutated (thread-safe)
            t0 = time.perf_counter()
            sel.build(inp.k3[kv], check_finite=False)
            timings["build"] += time.perf_counter() - t0
            built[kv] = sel
        qg = inp.q3[inp.q_map[g]]
        t0 = time.perf_counter()
        if attends:
            out[g], lse[g] = built[kv].attend(qg, inp.v3[kv], scale=inp.scale, is_causal=is_causal,
                                              query_positions=qpos, key_positions=kpos, check_finite=False)
            counts = getattr(built[kv], "last_keys_read_", None)
            if counts is not None and np.shape(counts) == (inp.L,):
                read[g] = counts
            else:  # a selector without its own count attends every allowed key
                read[g] = (np.searchsorted(np.sort(kpos), qpos, side="right") if is_causal else inp.S)
        else:
            patterns.append(built[kv].query(qg, k, is_causal=is_causal, query_positions=qpos,
                                            key_positions=kpos, check_finite=False))
        timings["select"] += time.perf_counter() - t0
    return spec, patterns, ((out, lse, read) if attends else None)


def _refuse_tail_for_attending(pattern: object) -> None:
    """``tail=`` needs a pattern: refuse selectors that attend by themselves, naming the alternative."""
    from ..selectors import Selector, get_selector

    if isinstance(pattern, (str, Selector)) and get_selector(pattern).attends:
        raise ValueError(f"tail= needs a selector that returns a pattern; {pattern!r} attends by itself. For "
                         f"cluster:mode=block use its estimate= parameter, or mode=topk with tail=.")


def _add_tail(inp: AttentionInputs, patterns: list[SparsePattern], out: np.ndarray, lse: np.ndarray,
              bias_args: tuple, with_bias: bool, tail: Tail, is_causal: bool, query_positions: Any,
              key_positions: Any, check_finite: bool) -> tuple[np.ndarray, np.ndarray, list[SparsePattern]]:
    """Merge the selected keys' (out, lse) with the tail estimate (:mod:`sparseattn.attention.tail`)."""
    qpos = positions(query_positions, inp.L, "query_positions")
    kpos = positions(key_positions, inp.S, "key_positions")
    sampled, log_w = tail_patterns(patterns, inp.G, tail, is_causal, qpos, kpos)
    if tail.shrink > 0:
        shrunk = log_w + shrink_log_weights(inp.q3, inp.k3, inp.q_map, inp.kv_map, inp.scale, sampled,
                                            float(tail.shrink))
        log_w = np.where(log_w > 0, shrunk, log_w)  # a row that read its whole tail stays exact
    out_t, lse_t = _run_kernel(inp, sampled, bias_args, with_bias=with_bias)
    check_lse(lse_t, inp.cdt, inp.scale, nan_is_overflow=check_finite)
    G, L, Ev = out.shape
    lses = np.stack([lse.reshape(G * L), (lse_t.astype(np.float64) + log_w).reshape(G * L)])
    m_out, m_lse = merge_parts((out.reshape(G * L, Ev), out_t.reshape(G * L, Ev)), lses, inp.cdt)
    return m_out.reshape(G, L, Ev), m_lse.reshape(G, L), sampled


def _bias_args(bias: Any, inp: AttentionInputs, query_positions: Any, key_positions: Any) -> tuple:
    """The kernel's bias arguments: none, a relative-position bias object, or a dense (..., L, S) array."""
    G, L, S, lead, cdt = inp.G, inp.L, inp.S, inp.lead, inp.cdt
    if bias is None:
        return no_bias_args(G) + (1,)
    qpos = positions(query_positions, L, "query_positions")
    kpos = positions(key_positions, S, "key_positions")
    if hasattr(bias, "kernel_args"):
        check_position_span(qpos, kpos)
        kind, params, ints = bias.kernel_args()
        n_heads = lead[-1] if lead else 1
        if bias.num_heads != n_heads:
            raise ValueError(f"bias has {bias.num_heads} heads but the inputs have {n_heads} (dimension -3).")
        return (int(kind), np.ascontiguousarray(params, np.float64), np.ascontiguousarray(ints, np.int64),
                qpos, kpos, np.zeros((1, 1, 1), cdt), np.zeros(G, np.int64), int(n_heads))
    arr = as_float_array(bias, "bias", min_ndim=2, check_finite=False)  # -inf forbids a pair: legal
    if arr.shape[-2:] != (L, S):
        raise ValueError(f"bias array must end in (L, S) = {(L, S)}; got {arr.shape}.")
    check_additive(arr, "bias", "a bias", "-inf to forbid a pair", cdt)
    blead, _, bmap = group_maps(lead, arr.shape[:-2], kv_name="bias")
    if tuple(blead) != tuple(lead):
        raise ValueError(f"bias leading dims {arr.shape[:-2]} must broadcast to the inputs' {lead} without "
                         f"widening them.")
    dense = np.ascontiguousarray(flat3(arr), dtype=cdt)
    return (BIAS_DENSE, np.zeros((1, 1)), np.zeros(3, np.int64), qpos, kpos, dense, bmap, 1)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (same memory, no copy)."""
    view = a.view()
    view.flags.writeable = False
    return view


def _run_kernel(inp: AttentionInputs, patterns: list[SparsePattern], bias_args: tuple, *, with_bias: bool
                ) -> tuple[np.ndarray, np.ndarray]:
    """The fused kernel over all groups: (G, L, Ev) output and (G, L) lse in the computation dtype."""
    G, L, cdt = inp.G, inp.L, inp.cdt
    out = np.empty((G, L, inp.Ev), dtype=cdt)
    lse = np.empty((G, L), dtype=cdt)
    if not (G and L):  # nothing to compute (a selector gave no pattern for zero groups)
        return out, lse
    shared = len(patterns) == 1
    if shared:
        indptr, indices = patterns[0].indptr, patterns[0].indices
    else:
        indptr, indices = stack_patterns(patterns)
    max_nnz = int(np.diff(indptr).max()) if indptr.shape[0] > 1 else 0
    # Small problems run serially: thread start-up costs more than it saves there, and the serial
    # variant compiles in a fraction of the parallel one's time (first-call latency).
    work = indices.shape[0] * (G if shared else 1) * (inp.E + inp.Ev)
    use_parallel = get_num_threads() > 1 and work > PARALLEL_MIN_WORK
    if with_bias:
        kernel = fused.fused_parallel if use_parallel else fused.fused_serial
    else:
        kernel = fused.fused_parallel_nobias if use_parallel else fused.fused_serial_nobias
    # float32: the vectorised polynomial exp (rel. error <= 2.5e-7); float64 keeps np.exp's precision.
    # Read-only views: the kernel only reads q, k, v and the bias arrays, and one array type whatever the
    # caller's writable flags means one compiled variant per dtype instead of one per combination of flags.
    q3, k3, v3 = (_read_only(a) for a in (inp.q3, inp.k3, inp.v3))
    bias_args = tuple(_read_only(a) if isinstance(a, np.ndarray) else a for a in bias_args)
    kernel(q3, k3, v3, inp.q_map, inp.kv_map, indptr, indices, shared, cdt.type(inp.scale), max_nnz,
           CHUNK_ROWS, *bias_args, out, lse, cdt == np.float32)
    return out, lse
