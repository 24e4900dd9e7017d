"""Input checks of the decode cache's calls (appended keys/values, queries)."""

from __future__ import annotations

import numbers
import warnings

import numpy as np

from ..inputs import check_positive_int
from .config import CacheConfig
from .store import check_float, to_numpy

__all__ = ["OVERFLOW_FIX", "RESOLUTION_LIMIT", "check_budget", "check_kv", "check_kv_head", "check_output",
           "check_queries", "check_query", "check_query_tokens", "warn_resolution"]

# what to change when scores overflow (the kernels compute in float32 whatever the inputs)
OVERFLOW_FIX = "the cache computes in float32: scale the keys or queries down, or pass a smaller scale"
#: |log-sum-exp| from which float32 spaces scores 0.5 or more apart (2**22): a row's softmax weights are
#: then uncertain by a factor e**0.25 or more, and equally exact computations (another selector, another
#: summation order) give visibly different outputs
RESOLUTION_LIMIT = float(2**22)


def warn_resolution(big: float) -> None:
    """RuntimeWarning for a step whose largest finite ``|lse|`` is ``big`` >= :data:`RESOLUTION_LIMIT`."""
    gap = float(np.spacing(np.float32(big)))
    warnings.warn(f"attention scores reach |q.k * scale| ~ {big:.3g}, where float32 spaces its values {gap:g} "
                  f"apart: softmax weights are uncertain by up to a factor e**{gap / 2:g}, so outputs can differ "
                  f"between selectors (even selector='dense') and from a float64 reference; {OVERFLOW_FIX}.",
                  RuntimeWarning, stacklevel=4)  # the caller of KVCache.attend (through its lock wrapper)


def check_kv(cfg: CacheConfig, keys: object, values: object) -> tuple[np.ndarray, np.ndarray]:
    """keys (H_kv, T, E) and values (H_kv, T, Ev) as finite float arrays, T >= 1 (ValueError / TypeError
    naming the argument otherwise)."""
    k = to_numpy(keys, "keys")
    v = to_numpy(values, "values")
    check_float(k, "keys")
    check_float(v, "values")
    hk, E, Ev = cfg.num_kv_heads, cfg.head_dim, cfg.value_dim
    if k.ndim != 3 or k.shape[0] != hk or k.shape[2] != E:
        raise ValueError(f"keys must have shape (num_kv_heads={hk}, T, head_dim={E}); got {k.shape}.")
    if v.ndim != 3 or v.shape[0] != hk or v.shape[2] != Ev:
        raise ValueError(f"values must have shape (num_kv_heads={hk}, T, value_dim={Ev}); got {v.shape}.")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"keys and values must hold the same number of tokens T; got keys T={k.shape[1]} "
                         f"and values T={v.shape[1]}.")
    if k.shape[1] == 0:
        raise ValueError("keys and values must hold at least one token (T >= 1); got T = 0.")
    for arr, name in ((k, "keys"), (v, "values")):
        if not np.isfinite(arr).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
            raise ValueError(f"{name} contains NaN or Inf (first at index {bad}); clean the input.")
    return k, v


def check_queries(cfg: CacheConfig, queries: object) -> tuple[np.ndarray, bool]:
    """(queries as C-contiguous float32 (H, T, E), whether they were given as (H, E)); ValueError /
    TypeError naming ``queries`` for a wrong shape or dtype, NaN/Inf, or values beyond float32."""
    q = to_numpy(queries, "queries")
    check_float(q, "queries")
    squeeze = q.ndim == 2
    if squeeze:
        q = q[:, None, :]
    H, E = cfg.num_heads, cfg.head_dim
    if q.ndim != 3 or q.shape[0] != H or q.shape[2] != E or q.shape[1] < 1:
        raise ValueError(f"queries must have shape (num_heads={H}, T_q >= 1, head_dim={E}) or "
                         f"(num_heads, head_dim); got {q.shape}.")
    if not np.isfinite(q).all():
        raise ValueError("queries contains NaN or Inf; clean the input.")
    if q.dtype == np.float32 and q.flags.c_contiguous:  # the common case: nothing to convert
        return q, squeeze
    q_in = q
    with np.errstate(over="ignore"):  # beyond float32's range: refused just below
        q = np.ascontiguousarray(q, dtype=np.float32)
    if q.dtype != q_in.dtype and not np.isfinite(q).all():
        raise ValueError(f"queries exceed float32's range (largest magnitude {np.abs(q_in).max():.3g}); "
                         f"{OVERFLOW_FIX}.")
    return q, squeeze


def check_query(cfg: CacheConfig, query: object) -> np.ndarray:
    """One query (E,) as float32 (TypeError / ValueError naming ``query`` for a non-float dtype, a wrong size,
    NaN/Inf, or values beyond float32), checked as :func:`check_queries` checks an attend's."""
    q = to_numpy(query, "query")
    check_float(q, "query")
    if q.size != cfg.head_dim:
        raise ValueError(f"query must hold head_dim={cfg.head_dim} values (shape (E,)); got shape {q.shape}.")
    if not np.isfinite(q).all():
        raise ValueError("query contains NaN or Inf; clean the input.")
    with np.errstate(over="ignore"):  # beyond float32's range: refused just below
        q32 = np.asarray(q, np.float32).reshape(cfg.head_dim)
    if not np.isfinite(q32).all():
        raise ValueError(f"query exceeds float32's range (largest magnitude {np.abs(q).max():.3g}); {OVERFLOW_FIX}.")
    return q32


def check_kv_head(cfg: CacheConfig, kv_head: object) -> int:
    """``kv_head`` as an int in ``[0, H_kv)`` (a negative index is refused, not counted from the end)."""
    return check_positive_int(kv_head, "kv_head", minimum=0, maximum=cfg.num_kv_heads - 1)


def check_budget(k: object) -> int:
    """The ``k`` of an attend: None means 64; an array (the keys passed where the budget goes) or another
    non-integer is refused in one line, whichever the selector."""
    if k is None:
        return 64
    if not isinstance(k, numbers.Number) and hasattr(k, "item") and np.ndim(k) == 0:
        v = k.item()  # a 0-d array or tensor: its value, when that is an integer
        if isinstance(v, int) and not isinstance(v, bool):
            k = v
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        what = f"an array of shape {np.shape(k)}" if np.ndim(k) else repr(k)[:40]
        raise TypeError(f"k must be an integer (keys per query of the 'topk' and index selectors); got {what} "
                        f"({type(k).__name__}). Keys are not passed to attend(): append them with "
                        f"append(keys, values) first, then call attend(queries).")
    return check_positive_int(k, "k")


def check_query_tokens(T: int, n: int) -> None:
    """ValueError unless the T query tokens of an attend have positions: query t sits at ``n - T + t``."""
    if T > n:
        raise ValueError(f"queries hold T_q={T} tokens but only {n} positions were appended; query t sits at "
                         f"position n - T_q + t, so append each token's key and value (append(keys, values)) "
                         f"before attending with its query.")


def check_output(out: np.ndarray) -> None:
    """ValueError when a step's output left float32's range (finite scores, but the weighted sum of the
    values overflowed: the kernels accumulate in float32)."""
    if not np.isfinite(out).all():
        raise ValueError("values: the step's running sum of weighted values overflowed float32 (the kernels sum "
                         "up to one weight-1 value per key read before dividing by the weights' total, so values "
                         "near 3.4e38 / keys read are too large even when the output itself would fit); append "
                         "the values scaled down (the output is linear in them) and scale the result back up.")
