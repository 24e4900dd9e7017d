"""Input checks of the decode cache's calls (appended keys/values, queries)."""

from __future__ import annotations

import numpy as np

from .config import CacheConfig
from .store import check_float, to_numpy

__all__ = ["OVERFLOW_FIX", "check_kv", "check_queries"]

# what to change when scores overflow (the kernels compute in float32 whatever the inputs)
OVERFLOW_FIX = "the cache computes in float32: scale the keys or queries down, or pass a smaller scale"


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
    q_in = q
    with np.errstate(over="ignore"):  # beyond float32's range: refused just below
        q = np.ascontiguousarray(q, dtype=np.float32)
    if q.dtype != q_in.dtype and not np.isfinite(q).all():
        raise ValueError(f"queries exceed float32's range (largest magnitude {np.abs(q_in).max():.3g}); "
                         f"{OVERFLOW_FIX}.")
    return q, squeeze
