"""Exact merging of partial attention results computed over disjoint key sets.

Attention over a key set ``A ∪ B`` (disjoint) follows from the attention over ``A`` and over ``B`` alone,
given each part's log-sum-exp of scores ``lse = log Σ_j exp(s_j)``::

    lse  = log(exp(lse_A) + exp(lse_B))
    out  = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

This is how split-KV (flash-decoding), ring attention and cluster routing combine their pieces.  The
computation is shifted by the largest part's lse so nothing overflows; it runs in the one merge kernel
:func:`sparseattn.kernels.merge.merge_partials` (weights and totals in float64), shared with routed
attention.  A part with ``lse = -inf``
(attention over no key, or only masked keys) has weight zero and contributes nothing, whatever its output
holds (even NaN); when every part is ``-inf`` the result is zeros with ``lse = -inf``, never NaN.

Examples
--------
>>> import numpy as np
>>> s = np.array([0.5, -1.0, 2.0]); v = np.array([[1.0], [2.0], [3.0]])
>>> def attend(idx):
...     w = np.exp(s[idx] - s[idx].max())
...     return (w @ v[idx]) / w.sum(), s[idx].max() + np.log(w.sum())
>>> (o1, l1), (o2, l2) = attend([0, 2]), attend([1])
>>> out, lse = merge_attention(np.stack([o1, o2])[:, None], np.array([[l1], [l2]]))
>>> full, full_lse = attend([0, 1, 2])
>>> bool(np.allclose(out[0], full) and np.isclose(lse[0], full_lse))
True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..inputs import as_float_array
from ..kernels.merge import PARALLEL_MIN_WORK, merge_partials, merge_partials_serial

__all__ = ["merge_attention", "merge_pair", "merge_parts"]


def _as_array(x: object, name: str, min_ndim: int) -> np.ndarray:
    if isinstance(x, (list, tuple)):
        try:
            x = np.stack([np.asarray(p) for p in x])
        except ValueError as exc:
            raise ValueError(f"{name}: the parts must all have the same shape ({exc}).") from None
    return as_float_array(x, name, min_ndim=min_ndim, check_finite=False)


def _check_lse(lse: np.ndarray, name: str) -> None:
    if np.isnan(lse).any() or np.isposinf(lse).any():
        bad = np.argwhere(np.isnan(lse) | np.isposinf(lse))[0]
        raise ValueError(f"{name} must be finite or -inf (an empty part); got {lse[tuple(bad)]} at index "
                         f"{tuple(int(i) for i in bad)}. A NaN lse usually means a NaN score upstream.")


def _dtype(*arrays: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if any(a.dtype == np.float64 for a in arrays) else np.dtype(np.float32)


def merge_parts(parts: tuple[np.ndarray, ...], lses: np.ndarray, dtype: np.dtype,
                 out: np.ndarray | None = None, lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge normalised parts by :func:`~sparseattn.kernels.merge.merge_partials`.

    parts: P arrays (N, Ev) (read in place when C-contiguous in ``dtype``), or one (P * N, Ev) array with
    part t of row i at row ``t * N + i``; lses (P, N).  A normalised part with lse l is the partial
    (output, row sum 1, shift l).  Writes and returns (N, Ev) and (N,) arrays of ``dtype`` (``out`` /
    ``lse`` when given; they must not overlap the parts).
    """
    P, N = lses.shape
    Ev = parts[0].shape[-1]
    flat = tuple(np.ascontiguousarray(x, dtype=dtype) for x in parts)
    shifts = np.ascontiguousarray(lses, dtype=dtype).reshape(P * N)
    slot = (np.arange(P, dtype=np.int64)[None, :] * N + np.arange(N, dtype=np.int64)[:, None]).reshape(-1)
    out = np.empty((N, Ev), dtype=dtype) if out is None else out
    lse = np.empty(N, dtype=dtype) if lse is None else lse
    kernel = merge_partials if P * N * Ev >= PARALLEL_MIN_WORK else merge_partials_serial
    kernel(flat, np.ones(P * N, dtype=dtype), shifts, slot, P, np.zeros(N, dtype=dtype), out, lse)
    return out, lse


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    """True when a and b are the same elements in the same layout (same start, shape and strides)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _raise_non_finite(parts: np.ndarray, lses: np.ndarray) -> None:
    """Raise for the first NaN/Inf output entry of a part whose weight is non-zero (the kernel read it)."""
    dtype = _dtype(parts, lses)
    lse_p = lses.astype(dtype, copy=False)
    m = lse_p.max(axis=0)
    m_safe = np.where(m == -np.inf, 0.0, m).astype(dtype, copy=False)
    live = np.exp(lse_p - m_safe) > 0
    bad = live[..., None] & ~np.isfinite(parts)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"outputs contains NaN or Inf at index {idx} in a part whose lse is finite; "
                         f"clean the input or pass check_finite=False.")


def merge_attention(outputs: np.ndarray | Sequence[np.ndarray],
                    lses: np.ndarray | Sequence[np.ndarray], *,
                    check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Combine P partial attention results over disjoint key sets into the exact full result.

    Parameters
    ----------
    outputs : float array, shape (P, ..., L, Ev), or a sequence of P arrays of shape (..., L, Ev)
        Part p's attention output (softmax-normalised over its own keys).
    lses : float array, shape (P, ..., L), or a sequence of P arrays of shape (..., L)
        Part p's log-sum-exp of (scaled) scores; ``-inf`` marks a part without any key.
    check_finite : bool, default True
        Reject outputs holding NaN/Inf where their part's lse is finite (such parts would poison the
        result).  Outputs of ``-inf`` parts are never read.

    Returns
    -------
    output : array, shape (..., L, Ev)
        float64 if any input is float64, else float32.  Zeros where every part is ``-inf``.
    lse : array, shape (..., L)
        Combined log-sum-exp; ``-inf`` where every part is ``-inf``.

    Raises
    ------
    ValueError
        Mismatched shapes, no part, an lse that is NaN or ``+inf``.
    TypeError
        Non-float inputs.
    """
    out_parts = _as_array(outputs, "outputs", 3)
    lse_parts = _as_array(lses, "lses", 2)
    if out_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(f"lses must have shape outputs.shape[:-1] = {out_parts.shape[:-1]} "
                         f"(P, ..., L); got {lse_parts.shape}. Pass one lse per output row.")
    if out_parts.shape[0] == 0:
        raise ValueError("outputs must hold at least one part (P >= 1); got P = 0.")
    _check_lse(lse_parts, "lses")
    dtype = _dtype(out_parts, lse_parts)
    P, lead, Ev = out_parts.shape[0], out_parts.shape[1:-1], out_parts.shape[-1]
    N = int(np.prod(lead, dtype=np.int64))
    out, lse = merge_parts((out_parts.reshape(P * N, Ev),), lse_parts.reshape(P, N), dtype)
    # A live part holding NaN/Inf leaves NaN/Inf in its rows of the result: check only the (P times
    # smaller) result, and look for the culprit only then.
    if check_finite and not np.isfinite(out).all():
        _raise_non_finite(out_parts, lse_parts)
    return out.reshape(lead + (Ev,)), lse.reshape(lead)


def merge_pair(o1: np.ndarray, l1: np.ndarray, o2: np.ndarray, l2: np.ndarray, *,
               out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge two partial results over disjoint key sets; can accumulate in place.

    Parameters
    ----------
    o1, o2 : float arrays, shape (..., L, Ev)
        Partial outputs (softmax-normalised over their own keys).
    l1, l2 : float arrays, shape (..., L)
        Their log-sum-exps; ``-inf`` = no key (the output is then ignored, whatever it holds).
    out : (output, lse) pair of arrays, optional
        Where to write the result; may be ``(o1, l1)`` to accumulate a running result in place, e.g.
        ``acc = merge_pair(*acc, o, l, out=acc)`` over a stream of key blocks.  Must have the result
        dtype (float64 if any input is float64, else float32) and the input shapes.

    Returns
    -------
    (output (..., L, Ev), lse (..., L)) : the arrays of ``out`` when given, else new arrays.
    """
    arrays = []
    for name, x, nd in (("o1", o1, 2), ("l1", l1, 1), ("o2", o2, 2), ("l2", l2, 1)):
        arrays.append(as_float_array(x, name, min_ndim=nd, check_finite=False))
    a1, b1, a2, b2 = arrays
    if a1.shape != a2.shape:
        raise ValueError(f"o1 and o2 must have the same shape (..., L, Ev); got {a1.shape} and {a2.shape}.")
    for name, lse in (("l1", b1), ("l2", b2)):
        if lse.shape != a1.shape[:-1]:
            raise ValueError(f"{name} must have shape o1.shape[:-1] = {a1.shape[:-1]}; got {lse.shape}.")
        _check_lse(lse, name)
    dtype = _dtype(a1, b1, a2, b2)
    if out is None:
        o_out = np.empty(a1.shape, dtype=dtype)
        l_out = np.empty(b1.shape, dtype=dtype)
    else:
        if not (isinstance(out, tuple) and len(out) == 2
                and all(isinstance(x, np.ndarray) for x in out)):
            raise TypeError("out must be a tuple (output array, lse array); got "
                            f"{type(out).__name__}.")
        o_out, l_out = out
        if o_out.shape != a1.shape or l_out.shape != b1.shape or o_out.dtype != dtype \
                or l_out.dtype != dtype:
            raise ValueError(f"out must hold arrays of shapes {a1.shape} and {b1.shape} with dtype {dtype}; "
                             f"got {o_out.shape} {o_out.dtype} and {l_out.shape} {l_out.dtype}.")
    Ev = a1.shape[-1]
    N = int(np.prod(a1.shape[:-1], dtype=np.int64))
    # The kernel reads o1 and o2 in place and writes ``out``.  ``out`` may be (o1, l1) itself (in-place
    # accumulation): each output row is written only after its own input rows were read.  Any other
    # overlap is resolved by copying the inputs first.
    x1, x2 = a1.reshape(N, Ev), a2.reshape(N, Ev)
    if any(np.shares_memory(o_out, x) and not _same_view(o_out, x) for x in (a1, a2)):
        x1, x2 = np.array(x1, dtype=dtype), np.array(x2, dtype=dtype)
    lse_in = np.stack([b1.reshape(N), b2.reshape(N)]).astype(dtype, copy=False)
    direct = o_out.flags.c_contiguous and l_out.flags.c_contiguous
    o, lse = merge_parts((x1, x2), lse_in, dtype, o_out.reshape(N, Ev) if direct else None,
                          l_out.reshape(N) if direct else None)
    if not direct:
        o_out[...] = o.reshape(a1.shape)
        l_out[...] = lse.reshape(b1.shape)
    return o_out, l_out
