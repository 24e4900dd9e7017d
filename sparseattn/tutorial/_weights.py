"""Validation shared by the tutorial's step-by-step mode and layers."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..inputs import as_float_array


def weight(w: Any, name: str, in_dim: int | None = None) -> np.ndarray:
    """A 2-D float weight matrix (d_in, d_out), optionally checked to read ``in_dim`` features."""
    arr = as_float_array(w, name, min_ndim=2)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (d_in, d_out); got shape {arr.shape}.")
    if in_dim is not None and arr.shape[0] != in_dim:
        raise ValueError(f"{name} expects inputs with {arr.shape[0]} features; got {in_dim}.")
    return arr


def layer_inputs(x: Any, context: Any, d_query: int, d_key: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated (x, context) for a layer whose projections read d_query / d_key features."""
    x = as_float_array(x, "x", min_ndim=2)
    c = x if context is None else as_float_array(context, "context", min_ndim=2)
    if x.shape[-1] != d_query:
        raise ValueError(f"x has {x.shape[-1]} features; W_query expects {d_query}.")
    if c.shape[-1] != d_key:
        raise ValueError(f"context has {c.shape[-1]} features; W_key expects {d_key}.")
    return x, c
