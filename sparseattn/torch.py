"""PyTorch front end: sparse and exact attention on CPU ``torch.Tensor`` inputs (optional extra).

``sparseattn.torch.sparse_attention`` and ``sparseattn.torch.scaled_dot_product_attention`` take and return
torch tensors and run the numpy/Numba implementations of :mod:`sparseattn` underneath.  Importing this
module imports torch (``pip install 'sparseattn[torch]'``); ``import sparseattn`` never does.

Conversions (one place, :func:`to_numpy` / :func:`from_numpy`):

* float32 / float64 CPU tensors are shared with numpy without a copy (``Tensor.numpy()``; strided views
  stay views), and the output is wrapped with ``torch.from_numpy`` (no copy);
* float16 / bfloat16 tensors are upcast to float32 (a copy) and the output is cast back to the promoted
  input dtype, so half inputs give half outputs computed in float32;
* the computation dtype is float64 if any input is float64, else float32 (as in :mod:`sparseattn`).

Refused, with the argument named: tensors on a non-CPU device (CUDA, MPS, meta), numpy arrays mixed with
tensors, integer / complex / bool data (bool only for ``attn_mask``), sparse layouts, and tensors that
require grad while autograd is enabled.  There is no backward pass: a tensor with ``requires_grad=True``
is accepted only under ``torch.no_grad()`` / ``torch.inference_mode()`` (``torch.is_grad_enabled()`` is
False) or after ``.detach()``; the outputs never require grad.

Masks in :func:`sparse_attention` (``attn_mask`` as in SDPA: bool, True = may attend; or float, added to
the scores).  Keys a query may not attend are removed *before* selection where the mask's structure allows,
so a query's ``k`` slots go to keys it may attend.  For each distinct mask slice (e.g. each batch element of
a ``(B, 1, L, S)`` padding mask):

1. keys no query may attend (padding) are dropped; the selector indexes only the remaining keys, with their
   original positions (``key_positions``) so positional selectors (window, sinks) are unaffected;
2. if every remaining (query, key) pair is allowed, that is all;
3. else, if each query may attend exactly the remaining keys up to some position (a causal mask, possibly
   with left padding or an offset), the call is causal with that position as ``query_positions``;
4. else (any other pattern) selection ignores the mask and the forbidden pairs get a ``-inf`` bias: such
   a query may keep fewer than ``k`` keys.

A float mask entry at or below half the most negative value of its dtype (``-inf``, or
``torch.finfo(dtype).min`` as transformers' eager masks use) forbids the pair; other non-zero values are
added to the selected scores as a bias.  Selectors that attend by themselves (``cluster:mode=block``) take
only masks of kinds 1-3 with no additive values.  ``is_causal`` together with ``attn_mask`` applies both.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"sparseattn.torch needs PyTorch ({exc}). Install with: pip install 'sparseattn[torch]'"
                      ) from exc

from .attention.dense import scaled_dot_product_attention as _dense_attention
from .attention.sparse import sparse_attention as _sparse_attention
from .inputs import check_additive, check_additive_range, check_bool, group_maps, mask_2d, result_dtype

__all__ = ["from_numpy", "scaled_dot_product_attention", "sparse_attention", "to_numpy"]

_SHARED = (torch.float32, torch.float64)  # numpy views, no copy
_UPCAST = (torch.float16, torch.bfloat16)  # computed in float32, cast back


# ---------------------------------------------------------------------------------------- conversions
def to_numpy(tensor: object, name: str, *, allow_bool: bool = False) -> np.ndarray:
    """numpy view of a CPU float tensor, after the checks listed in the module docstring.

    Parameters
    ----------
    tensor : torch.Tensor
        float16, bfloat16, float32 or float64 (bool too with ``allow_bool``), strided, on the CPU.
    name : str
        Argument name used in error messages.
    allow_bool : bool
        Accept bool tensors (masks).

    Returns
    -------
    numpy.ndarray
        A view for float32 / float64 / bool (same memory, same strides); a float32 copy for float16 /
        bfloat16.

    Raises
    ------
    TypeError
        Not a torch tensor (numpy arrays included), unsupported dtype, or a sparse layout.
    ValueError
        Not on the CPU, or requires grad while autograd is enabled.
    """
    if isinstance(tensor, np.ndarray):
        raise TypeError(f"{name} is a numpy array, but sparseattn.torch takes torch tensors for every argument; "
                        f"pass torch.from_numpy({name}), or call sparseattn.sparse_attention / "
                        f"sparseattn.scaled_dot_product_attention with numpy arrays only.")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}.")
    if tensor.device.type != "cpu":
        hint = ("meta tensors have no data: materialise the module or tensor first"
                if tensor.device.type == "meta" else f"pass {name}.cpu() and move the result back")
        raise ValueError(f"{name} is on device {tensor.device}; sparseattn runs on the CPU only: {hint}.")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} has layout {tensor.layout}; pass a dense tensor ({name}.to_dense()).")
    if tensor.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad while autograd is enabled, but sparseattn has no backward pass "
                         f"yet. Run the call under torch.no_grad() or torch.inference_mode(), or pass "
                         f"{name}.detach().")
    t = tensor.detach()
    if t.dtype in _SHARED or (allow_bool and t.dtype == torch.bool):
        return t.numpy()
    if t.dtype in _UPCAST:
        return t.to(torch.float32).numpy()
    kinds = "float16, bfloat16, float32 or float64" + (" (or bool)" if allow_bool else "")
    raise TypeError(f"{name} must have dtype {kinds}; got {t.dtype}. Convert with {name}.float().")


def from_numpy(array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Wrap a numpy result as a CPU tensor, cast to ``dtype`` if given (no copy when the dtypes agree).

    Parameters
    ----------
    array : numpy.ndarray
        float32 or float64 result of the numpy implementation.
    dtype : torch.dtype, optional
        Wanted dtype (float16 / bfloat16 outputs are cast from the float32 result); default: the array's.
    """
    if not array.flags.writeable:  # torch.from_numpy warns on read-only memory
        array = array.copy()
    t = torch.from_numpy(array)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _check_tensors(**named: object) -> None:
    """Refuse a mix of numpy arrays and tensors up front, naming the numpy argument."""
    for name, x in named.items():
        if x is not None and not isinstance(x, torch.Tensor):
            to_numpy(x, name)  # raises the precise TypeError


# ------------------------------------------------------------------------------------------ public API
def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                                 *, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention on CPU tensors: :func:`sparseattn.scaled_dot_product_attention` with torch in and out.

    The positional order is ``torch.nn.functional.scaled_dot_product_attention``'s.

    Parameters
    ----------
    query : torch.Tensor, shape (..., L, E)
    key : torch.Tensor, shape (..., S, E)
    value : torch.Tensor, shape (..., S, Ev)
        float16, bfloat16, float32 or float64 CPU tensors; leading dims broadcast.
    attn_mask : torch.Tensor, optional
        Bool (True = may attend) or float (added to the scores), broadcastable to (..., L, S).
    dropout_p : float
        Must be 0.0 (no dropout).
    is_causal : bool
        Query i attends keys j <= i (top-left alignment).
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Fewer key/value heads (dim -3) than query heads.
    return_lse : bool
        Also return the natural-log log-sum-exp per row.

    Returns
    -------
    output : torch.Tensor (..., L, Ev)
        The promoted input dtype, on the CPU.
    lse : torch.Tensor (..., L), only with ``return_lse``
        float64 if any input is float64, else float32; ``-inf`` for rows with no allowed key.
    """
    _check_tensors(query=query, key=key, value=value, attn_mask=attn_mask)
    q, k, v = to_numpy(query, "query"), to_numpy(key, "key"), to_numpy(value, "value")
    mask = None if attn_mask is None else to_numpy(attn_mask, "attn_mask", allow_bool=True)
    out, lse = _dense_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, return_lse=True)
    result = from_numpy(out, _result_dtype(query, key, value))
    return (result, from_numpy(lse)) if return_lse else result


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, selector: Any, *, k: int = 64,
                     attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, return_lse: bool = False,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention on CPU tensors: :func:`sparseattn.sparse_attention` with torch in and out, plus masks.

    Parameters
    ----------
    query : torch.Tensor, shape (..., L, E)
    key : torch.Tensor, shape (..., S, E)
    value : torch.Tensor, shape (..., S, Ev)
        float16, bfloat16, float32 or float64 CPU tensors; leading (batch, head) dims broadcast.
    selector : str, Selector, SparsePattern or sequence of SparsePattern
        What :func:`sparseattn.sparse_attention` takes as ``pattern``, e.g. ``"topk"``, ``"window:width=64"``,
        ``"cluster:mode=block"``, ``"faiss-hnsw"``.  Explicit patterns cannot be combined with ``attn_mask``.
    k : int
        Keys per query asked of the selector.
    attn_mask : torch.Tensor, optional
        Bool (True = may attend) or float (added to the scores), broadcastable to (..., L, S) without
        widening the leading dims of the inputs.  How masked keys are excluded: see the module docstring.
    is_causal : bool
        Query i attends keys j <= i (top-left alignment).  With ``attn_mask`` both apply.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Fewer key/value heads (dim -3) than query heads.
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's selected scores.

    Returns
    -------
    output : torch.Tensor (..., L, Ev)
        The promoted input dtype, on the CPU; rows with no selected key are zeros.
    lse : torch.Tensor (..., L), only with ``return_lse``
        float64 if any input is float64, else float32; ``-inf`` for rows with no selected key.

    Raises
    ------
    TypeError, ValueError
        See :func:`to_numpy` for the tensor checks; the numpy implementation's errors otherwise.

    Examples
    --------
    >>> import torch
    >>> q, k, v = (torch.randn(2, 4, 128, 16) for _ in range(3))
    >>> out = sparse_attention(q, k, v, "topk", k=128)  # every key: exact attention
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
    """
    _check_tensors(query=query, key=key, value=value, attn_mask=attn_mask)
    q, kk, v = to_numpy(query, "query"), to_numpy(key, "key"), to_numpy(value, "value")
    out_dtype = _result_dtype(query, key, value)
    if attn_mask is None:
        out, lse = _sparse_attention(q, kk, v, selector, k=k, is_causal=is_causal, scale=scale,
                                     enable_gqa=enable_gqa, return_lse=True)
    else:
        allowed, additive = _mask_parts(attn_mask)
        out, lse = _masked_sparse(q, kk, v, selector, k, allowed, additive, check_bool(is_causal, "is_causal"),
                                  scale, enable_gqa, mask_shape=tuple(attn_mask.shape))
    result = from_numpy(out, out_dtype)
    return (result, from_numpy(lse)) if return_lse else result


# ------------------------------------------------------------------------------------------ masks
def _mask_parts(attn_mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """(allowed bool array, additive float array or None) from a bool or float SDPA mask."""
    m = to_numpy(attn_mask, "attn_mask", allow_bool=True)
    m = mask_2d(m)
    if m.dtype == np.bool_:
        return m, None
    check_additive(m, "attn_mask", "an additive mask", "-inf (or False in a bool mask) for masked-out pairs")
    floor = float(torch.finfo(attn_mask.dtype).min) / 2  # transformers' eager masks use finfo.min
    allowed = m > floor
    additive = np.where(allowed, m, 0.0)
    return allowed, (additive if additive.any() else None)


def _masked_sparse(q: np.ndarray, k: np.ndarray, v: np.ndarray, selector: Any, n_keys: int,
                   allowed: np.ndarray, additive: np.ndarray | None, is_causal: bool, scale: float | None,
                   enable_gqa: bool, *, mask_shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sparse attention under a mask, one call per distinct mask slice (see the module docstring).

    q (..., L, E), k (..., S, E), v (..., S, Ev); allowed (..., L, S) bool; additive like allowed or None;
    ``mask_shape``: the shape the caller gave (errors quote it; ``allowed`` of a 1-D mask is (1, S)).
    Returns the output (lead..., L, Ev) in the promoted dtype and the lse (lead..., L) in the computation dtype.
    """
    from .pattern import SparsePattern
    from .selectors import get_selector

    if isinstance(selector, (SparsePattern, list, tuple)):
        raise TypeError("attn_mask needs a selector (name, spec string or Selector), not explicit patterns; "
                        "filter the pattern yourself instead.")
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:  # let the numpy implementation word the error
        return _sparse_attention(q, k, v, selector, k=n_keys, scale=scale, return_lse=True)
    L, S = q.shape[-2], k.shape[-2]
    lead, _, _ = group_maps(q.shape[:-2], k.shape[:-2], enable_gqa=enable_gqa)
    try:
        full_shape = np.broadcast_shapes(allowed.shape, lead + (L, S))
    except ValueError:
        full_shape = None
    if full_shape != lead + (L, S):
        shown = allowed.shape if mask_shape is None else mask_shape
        raise ValueError(f"attn_mask shape {shown} must broadcast to (..., L, S) = {lead + (L, S)} "
                         f"without widening the leading dims of query/key/value.")
    if additive is not None:
        check_additive_range(additive, result_dtype(q, k, v), "attn_mask")
    nd = len(lead)
    ml = (1,) * (nd - (allowed.ndim - 2)) + allowed.shape[:-2]  # the mask's own leading dims, rank nd
    allowed = np.broadcast_to(allowed.reshape(ml + allowed.shape[-2:]), ml + (L, S))
    if is_causal:  # top-left: query i sees keys j <= i
        allowed = allowed & (np.arange(S)[None, :] <= np.arange(L)[:, None])
    if additive is not None:
        additive = np.broadcast_to(additive.reshape(ml + additive.shape[-2:]), ml + (L, S))
    qf, kf, vf = (x.reshape((1,) * (nd - (x.ndim - 2)) + x.shape) for x in (q, k, v))
    rep = lead[-1] // kf.shape[-3] if (enable_gqa and nd) else 1
    attends = bool(get_selector(selector).attends)

    out: np.ndarray | None = None
    lse: np.ndarray | None = None
    for idx in np.ndindex(*ml):
        qsl, kvsl, osl = [], [], []
        for a, i in enumerate(idx):
            j = i // rep if a == nd - 1 else i  # K/V head of query head i under GQA
            varies = ml[a] > 1  # the mask differs along this axis: take one index of it
            osl.append(slice(i, i + 1) if varies else slice(None))
            qsl.append(slice(i, i + 1) if varies and qf.shape[a] > 1 else slice(None))
            kvsl.append(slice(j, j + 1) if varies and kf.shape[a] > 1 else slice(None))
        qs, ks, vs = qf[tuple(qsl)], kf[tuple(kvsl)], vf[tuple(kvsl)]
        gqa = enable_gqa and ml[-1] == 1 if nd else False
        a2 = allowed[idx]
        add2 = None if additive is None else additive[idx]
        res_out, res_lse = _masked_slice(qs, ks, vs, a2, add2, selector, n_keys, scale, gqa, attends)
        if out is None:
            out = np.empty(lead + (L, res_out.shape[-1]), dtype=res_out.dtype)
            lse = np.empty(lead + (L,), dtype=res_lse.dtype)
        out[tuple(osl)] = res_out
        lse[tuple(osl)] = res_lse
    assert out is not None and lse is not None  # ml has at least one index
    return out, lse


def _masked_slice(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, additive: np.ndarray | None,
                  selector: Any, n_keys: int, scale: float | None, enable_gqa: bool, attends: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
    """One mask slice (L, S) over the (batch, head) dims of q/k/v that share it."""
    L, S = allowed.shape
    cols = np.flatnonzero(allowed.any(axis=0))
    if cols.size == 0:  # no key may be attended: zeros and lse = -inf (the library's empty-row policy)
        lead, _, _ = group_maps(q.shape[:-2], k.shape[:-2], enable_gqa=enable_gqa)
        cdt = np.float64 if np.float64 in (q.dtype, k.dtype, v.dtype) else np.float32
        return (np.zeros(lead + (L, v.shape[-1]), np.result_type(q.dtype, k.dtype, v.dtype)),
                np.full(lead + (L,), -np.inf, cdt))
    if cols.size == S:
        ksel = slice(None)
    elif cols[-1] - cols[0] + 1 == cols.size:  # a contiguous run (right or left padding): a view
        ksel = slice(int(cols[0]), int(cols[-1]) + 1)
    else:
        ksel = cols
    sub = allowed[:, cols]
    kpos = cols.astype(np.int64)
    qpos: np.ndarray | None = None
    causal = False
    bias: np.ndarray | None = None
    if not sub.all():
        any_row = sub.any(axis=1)
        last = np.where(any_row, kpos[sub.shape[1] - 1 - np.argmax(sub[:, ::-1], axis=1)], kpos[0] - 1)
        if np.array_equal(sub, kpos[None, :] <= last[:, None]):  # causal prefix of the kept keys
            causal, qpos = True, last.astype(np.int64)
        else:
            bias = np.where(sub, 0.0, -np.inf)
    if additive is not None:
        add = additive[:, cols]
        bias = add if bias is None else bias + add
        if causal:
            bias = np.where(sub, bias, -np.inf)
    if bias is not None and attends:
        raise ValueError(f"attn_mask: selector {selector!r} attends by itself and takes only key-padding or "
                         f"causal-prefix masks without additive values; this mask has "
                         f"{'additive float values' if additive is not None else 'another pattern'}. "
                         f"Use a selector that returns a pattern (e.g. 'cluster:mode=topk', 'topk').")
    return _sparse_attention(q, k[..., ksel, :], v[..., ksel, :], selector, k=n_keys, is_causal=causal,
                             scale=scale, bias=bias, query_positions=qpos if causal else None,
                             key_positions=kpos, enable_gqa=enable_gqa, return_lse=True)

