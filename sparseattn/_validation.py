"""Input validation shared by every public entry point.

Every user-facing function validates once, at the boundary, so the Numba kernels only ever see
C-contiguous float arrays with consistent shapes.  Errors name the argument, say what was expected and
what was received, and give a hint.
"""

from __future__ import annotations

import numbers

import numpy as np

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def as_float_array(x: object, name: str, *, min_ndim: int = 2, check_finite: bool = True) -> np.ndarray:
    """Return ``x`` as a float16/32/64 ndarray, validating dtype, rank and finiteness.

    Integer, boolean, complex and object inputs are rejected (a silent cast hides bugs such as passing
    token ids instead of embeddings).
    """
    arr = np.asarray(x)
    if arr.dtype.kind == "c":
        raise TypeError(f"{name} must be a real floating array; got complex dtype {arr.dtype}. "
                        f"Pass {name}.real or a float array.")
    if arr.dtype.kind != "f" or arr.dtype.type not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {arr.dtype}. "
                        f"Convert with {name}.astype(np.float32).")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions (..., length, features); "
                         f"got shape {arr.shape}.")
    if check_finite and arr.size and not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"{name} contains NaN or Inf (first at index {tuple(int(i) for i in bad)}). "
                         f"Clean the input, or pass check_finite=False to skip this check.")
    return arr


def result_dtype(*arrays: np.ndarray) -> np.dtype:
    """Computation dtype: float64 if any input is float64, else float32 (float16 is upcast)."""
    if any(a.dtype == np.float64 for a in arrays):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def check_positive_int(value: object, name: str, *, minimum: int = 1) -> int:
    """Validate an integer parameter (bools rejected) and return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}; got {value!r} ({type(value).__name__}).")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {int(value)}.")
    return int(value)


def check_scale(scale: object, head_dim: int) -> float:
    """Resolve the score scale: ``None`` means ``1/sqrt(head_dim)``; otherwise a finite real number."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim)) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r} ({type(scale).__name__}).")
    s = float(scale)
    if not np.isfinite(s):
        raise ValueError(f"scale must be finite; got {scale!r}.")
    return s


def overflow_message(dtype: np.dtype, scale: float) -> str:
    """Error text for attention scores that overflow the computation dtype (finite inputs, +inf score)."""
    return (f"attention scores overflow {np.dtype(dtype).name} (some q.k * scale = +inf with scale={scale:g}); "
            f"pass float64 inputs or a smaller scale.")
