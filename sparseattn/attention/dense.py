"""Exact scaled dot-product attention: the reference every sparse result is measured against.

``softmax(q . K^T * scale + mask) . V``, with PyTorch SDPA's signature and semantics, on numpy arrays.

Memory: the work is tiled over query blocks and key blocks ("flash" style, with an online softmax across
key tiles), so no more than one ``q_block x k_block`` tile of scores per worker exists at any time: n =
65,536 needs a few MiB of scratch, not an n x n matrix.

Speed: each tile is one BLAS product for the scores, numpy's SIMD ``exp`` on an L2-resident tile, and one
BLAS product with V.  Query blocks are spread over worker threads (numpy and BLAS release the GIL), with
BLAS itself pinned to one thread so the workers don't oversubscribe the cores.

Conventions (identical to ``torch.nn.functional.scaled_dot_product_attention``):

* shapes ``(..., L, E)``, ``(..., S, E)``, ``(..., S, Ev)`` -> ``(..., L, Ev)``; leading dims broadcast;
* boolean ``attn_mask``: True = may attend; float ``attn_mask``: added to the scores;
* ``is_causal``: query i sees keys ``j <= i`` (top-left aligned, also when L != S);
* default scale ``1 / sqrt(E)``.

A row with no allowed key returns zeros and ``lse = -inf``, never NaN (some PyTorch releases return NaN
there; 2.13 on CPU returns zeros).
Dtypes: float64 inputs compute in float64; float16/float32 compute in float32.  The output has the
promoted input dtype (float16 in -> float16 out), ``lse`` the computation dtype.
"""

from __future__ import annotations

import numbers
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..inputs import (
    AttentionInputs,
    attention_inputs,
    check_additive,
    check_lse,
    check_positive_int,
    mask_2d,
    overflow_message,
    positions,
)
from ..threads import get_num_threads, single_threaded_blas

DEFAULT_Q_BLOCK = 256
DEFAULT_K_BLOCK = 1024


def _check_mask(attn_mask: Any, lead: tuple[int, ...], L: int, S: int, cdt: np.dtype | None = None
                ) -> np.ndarray | None:
    """The mask broadcast to ``lead + (L, S)`` (a view), or None; errors name the argument.  With ``cdt``
    (the computation dtype) a finite positive additive value beyond its range is refused
    (:func:`~sparseattn.inputs.check_additive`)."""
    if attn_mask is None:
        return None
    m = np.asarray(attn_mask)
    if m.dtype.kind not in "bf":
        raise TypeError(f"attn_mask must be boolean (True = may attend) or float (added to the scores); "
                        f"got dtype {m.dtype}.")
    shape = m.shape
    m = mask_2d(m)
    try:
        full = np.broadcast_to(m, lead + (L, S))
    except ValueError:
        raise ValueError(f"attn_mask shape {shape} does not broadcast to (..., L, S) = {lead + (L, S)}.") from None
    check_additive(m, "attn_mask", "an additive mask", "-inf for masked-out positions", cdt)
    return full


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_lse: bool = False,
    bias: Any = None,
    query_positions: np.ndarray | None = None,
    key_positions: np.ndarray | None = None,
    q_block: int = DEFAULT_Q_BLOCK,
    k_block: int = DEFAULT_K_BLOCK,
    check_finite: bool = True,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Exact attention ``softmax(query @ key^T * scale + mask) @ value``, blocked.

    The positional parameters follow ``torch.nn.functional.scaled_dot_product_attention``:
    ``(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)``; the extras are
    keyword-only.

    Parameters
    ----------
    query : float array, shape (..., L, E)
    key : float array, shape (..., S, E)
    value : float array, shape (..., S, Ev)
    attn_mask : bool or float array broadcastable to (..., L, S), optional
        Boolean: True = may attend.  Float: added to the scores (use -inf to forbid).
    dropout_p : float
        Must be 0.0: dropout is not supported in this reference (it exists for SDPA's positional order).
    is_causal : bool
        Query i attends keys j <= i (top-left alignment, as in PyTorch).  Combined with ``attn_mask``
        both restrictions apply.
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool
        Allow fewer key/value heads (dim -3) than query heads; query head h uses K/V head
        ``h // (Hq // Hkv)``.
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's (scaled, masked) scores, shape (..., L).
    bias : RelativeBias, optional
        A relative position bias (``sparseattn.positional.ALiBi`` / ``T5RelativeBias``) added to the
        scores; its heads are dimension -3.
    query_positions, key_positions : int arrays (L,), (S,), optional
        Positions for ``bias`` (default ``arange``).
    q_block, k_block : int
        Tile sizes (memory per worker: ``q_block * k_block`` floats).
    check_finite : bool
        Reject NaN/Inf in the inputs (default).  Pass False to skip the O(n) check.

    Returns
    -------
    output : array (..., L, Ev), the promoted input dtype
    lse : array (..., L), only with ``return_lse``; the computation dtype, ``-inf`` for rows with no
        allowed key.

    Raises
    ------
    ValueError
        Bad shapes or arguments, ``dropout_p != 0``, or scores that overflow the computation dtype
        (finite inputs, some score ``+inf``; see :func:`sparseattn.inputs.check_lse`).

    Examples
    --------
    >>> q = np.array([[1.0, 0.0]]); k = np.array([[1.0, 0.0], [0.0, 1.0]]); v = np.array([[1.0], [3.0]])
    >>> out = scaled_dot_product_attention(q, k, v, scale=1.0)
    >>> float(out[0, 0].round(6))  # weights softmax([1, 0]) = [0.731059, 0.268941]
    1.537883
    """
    inp = attention_inputs(query, key, value, scale, is_causal, enable_gqa=enable_gqa, check_finite=check_finite)
    _check_dropout(dropout_p)
    q_block = check_positive_int(q_block, "q_block")
    k_block = check_positive_int(k_block, "k_block")
    L, S, lead, sc, cdt = inp.L, inp.S, inp.lead, inp.scale, inp.cdt
    mask = _check_mask(attn_mask, lead, L, S, cdt)
    qpos = kpos = None
    if bias is not None:
        n_heads = lead[-1] if lead else 1
        if getattr(bias, "num_heads", None) != n_heads:
            raise ValueError(f"bias has {getattr(bias, 'num_heads', None)} heads but the inputs have "
                             f"{n_heads} (dimension -3).")
        qpos = positions(query_positions, L, "query_positions")
        kpos = positions(key_positions, S, "key_positions")
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing scores: check_lse; values: below
        out, lse = _attend_all(inp, mask, is_causal, q_block, k_block, bias, qpos, kpos)
    check_lse(lse, cdt, sc, nan_is_overflow=check_finite)
    if not np.isfinite(out).all():
        # Values near the dtype's limit: the weighted sums overflowed although the output is finite.
        # Computed again on power-of-two scaled value columns (rare: the check is one pass over the output).
        safe = inp.with_safe_values()
        if safe is not inp:
            inp = safe
            out, lse = _attend_all(inp, mask, is_causal, q_block, k_block, bias, qpos, kpos)
    result, lse = inp.finish(out, lse)
    return (result, lse) if return_lse else result


def _attend_all(inp: AttentionInputs, mask: np.ndarray | None, is_causal: bool, q_block: int, k_block: int,
                bias: Any, qpos: np.ndarray | None, kpos: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Every group and query block of :func:`scaled_dot_product_attention`: (G, L, Ev) output and (G, L)
    lse in the computation dtype."""
    G, L, S, lead, sc, cdt = inp.G, inp.L, inp.S, inp.lead, inp.scale, inp.cdt
    out = np.zeros((G, L, inp.Ev), dtype=cdt)
    lse = np.full((G, L), -np.inf, dtype=cdt)
    q3, k3, v3, q_map, kv_map = inp.q3, inp.k3, inp.v3, inp.q_map, inp.kv_map
    if G and L and S:
        tasks = [(g, r0) for g in range(G) for r0 in range(0, L, q_block)]
        n_workers = min(get_num_threads(), len(tasks))

        def run(task: tuple[int, int]) -> None:
            g, r0 = task
            r1 = min(r0 + q_block, L)
            m_g = mask[np.unravel_index(g, lead)] if mask is not None else None
            # overflowing scores are reported by check_lse, overflowing value sums recomputed on scaled
            # values by the caller (np.errstate is per thread: set here, in the worker)
            with np.errstate(over="ignore", invalid="ignore"):
                _attend_block(q3[q_map[g]], k3[kv_map[g]], v3[kv_map[g]], m_g, g, lead, r0, r1, is_causal, sc,
                              cdt, k_block, bias, qpos, kpos, out[g], lse[g])

        if n_workers <= 1:
            for t in tasks:
                run(t)
        else:
            with single_threaded_blas(), ThreadPoolExecutor(n_workers) as pool:
                list(pool.map(run, tasks))
    return out, lse


def _check_dropout(dropout_p: object) -> None:
    """Accept only ``dropout_p == 0`` (SDPA's positional slot; this reference has no dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number (0.0); got {dropout_p!r} ({type(dropout_p).__name__}).")
    if float(dropout_p) != 0.0:
        raise ValueError(f"dropout_p={dropout_p!r}: dropout is not supported in this reference "
                         f"implementation; pass dropout_p=0.0 (apply dropout outside if you need it).")


def _attend_block(qg, kg, vg, mask_g, g, lead, r0, r1, is_causal, scale, cdt, k_block, bias, qpos, kpos,
                  out_g, lse_g, probe: bool = False) -> None:
    """Rows [r0, r1) of one group: online softmax over key tiles, written into out_g / lse_g.

    ``probe``: queries scaled by 2**-140 so no product overflows; only which rows have an allowed key
    (finite lse) is read from such a pass.
    """
    S = kg.shape[0]
    b = r1 - r0
    q_raw = np.asarray(qg[r0:r1], dtype=cdt)
    with np.errstate(over="ignore"):
        qb = q_raw * cdt.type(scale)
    post = not np.isfinite(qb).all() and np.isfinite(q_raw).all()
    if post:
        # q * scale alone left the dtype (q ~ 1e200, scale ~ 1e200) though q.k * scale may not (k ~ 1e-300):
        # the scale goes onto q.k instead (then |scale| > 1, so a q.k that overflows is a true overflow)
        qb = q_raw
    if probe:
        qb *= cdt.type(2.0**-140)
    # Top-left causal: rows < r1 never see keys >= r1, so those tiles are skipped outright.
    k_end = min(S, r1) if is_causal else S
    m = np.full(b, -np.inf, dtype=cdt)
    acc = np.zeros((b, vg.shape[1]), dtype=cdt)
    total = np.zeros(b, dtype=cdt)
    head = np.unravel_index(g, lead)[-1] if (bias is not None and lead) else 0
    rows = np.arange(r0, r1)
    for c0 in range(0, k_end, k_block):
        c1 = min(c0 + k_block, k_end)
        kt = np.asarray(kg[c0:c1], dtype=cdt)
        s = qb @ kt.T
        if post:
            with np.errstate(over="ignore", invalid="ignore"):
                s *= cdt.type(scale)
        if is_causal and c1 - 1 > r0:  # some key in the tile lies after some row
            s[np.arange(c0, c1)[None, :] > rows[:, None]] = -np.inf
        if mask_g is not None:
            mt = mask_g[r0:r1, c0:c1]
            if mt.dtype == np.bool_:
                np.copyto(s, -np.inf, where=~mt)
            else:
                s += mt
        if bias is not None:
            s += bias.block(qpos[r0:r1], kpos[c0:c1], head=head)
        m_tile = s.max(axis=1)
        if np.isposinf(m_tile).any():  # overflow: fail fast (check_lse would raise on the result too)
            raise ValueError(overflow_message(cdt, scale))
        m_new = np.maximum(m, m_tile)
        # Rows whose every score so far is -inf keep a finite shift of 0 so exp gives 0, not NaN.
        shift = np.where(np.isneginf(m_new), 0, m_new).astype(cdt, copy=False)
        s -= shift[:, None]
        np.exp(s, out=s)
        alpha = np.exp(np.where(np.isneginf(m), -np.inf, m - shift))
        total *= alpha
        total += s.sum(axis=1)
        acc *= alpha[:, None]
        acc += s @ np.asarray(vg[c0:c1], dtype=cdt)
        m = m_new
    ok = total > 0
    out_g[r0:r1][ok] = acc[ok] / total[ok, None]
    lse_g[r0:r1] = np.where(ok, np.where(np.isneginf(m), 0, m) + np.log(np.where(ok, total, 1)), -np.inf)
    # A NaN score (inf - inf inside an overflowing product, or a NaN input) is not an empty row: report
    # NaN, which check_lse turns into the overflow error.
    nan_rows = np.isnan(total) | np.isnan(m)
    if nan_rows.any():
        out_g[r0:r1][nan_rows] = np.nan
        lse_g[r0:r1][nan_rows] = np.nan
    if not probe and np.isneginf(m).any():
        # Rows without a finite score: masked out entirely (an empty row), or every allowed product q.k
        # overflowed to -inf (finite inputs: an overflow, not an empty row).  A probe pass with scaled
        # queries tells them apart (rare: only blocks holding such rows pay for it).
        p_out, p_lse = np.empty_like(out_g), np.empty_like(lse_g)
        _attend_block(qg, kg, vg, mask_g, g, lead, r0, r1, is_causal, scale, cdt, k_block, bias, qpos, kpos,
                      p_out, p_lse, probe=True)
        if np.isfinite(p_lse[r0:r1][np.isneginf(m)]).any():
            raise ValueError(overflow_message(cdt, scale))
