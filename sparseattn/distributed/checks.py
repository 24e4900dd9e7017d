"""Argument checks and block handling shared by the client side and the shards of the Dask key store."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..inputs import positions

__all__ = ["BATCH_SIZE", "SEND_ROWS", "check_int", "describe", "float2d", "int1d", "max_row_norm", "split_block"]

#: Rows per message when keys are sent from the client to a shard (bounds each message to ~32 MiB at
#: E = Ev = 64, float32).
SEND_ROWS = 1 << 16
#: Default number of queries per shard call.
BATCH_SIZE = 1024
_FLOATS = (np.float16, np.float32, np.float64)


def split_block(block: Any, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(keys, values, positions or None) from a ``(keys, values)`` or ``(keys, values, positions)`` block."""
    if not isinstance(block, (tuple, list)) or len(block) not in (2, 3):
        raise TypeError(f"{name} must give (keys, values) or (keys, values, positions) tuples; got "
                        f"{type(block).__name__}.")
    kb = float2d(block[0], f"{name} keys")
    vb = float2d(block[1], f"{name} values")
    if kb.shape[0] != vb.shape[0]:
        raise ValueError(f"{name}: keys and values blocks must have the same rows; got {kb.shape} and {vb.shape}.")
    pb = None
    if len(block) == 3 and block[2] is not None:
        pb = int1d(block[2], f"{name} positions", kb.shape[0])
    return kb, vb, pb


def max_row_norm(x: np.ndarray) -> float:
    """Largest Euclidean norm of the rows of a finite 2-D array, in float64 without overflow."""
    m = float(np.abs(x).max()) if x.size else 0.0
    if m == 0.0:
        return 0.0
    return m * float(np.sqrt(np.square(x / m, dtype=np.float64).sum(axis=1)).max())


def describe(exc: BaseException | None) -> str:
    """An exception as ``"Type: message"`` for error messages."""
    return "no error recorded" if exc is None else f"{type(exc).__name__}: {exc}"


def float2d(x: Any, name: str) -> np.ndarray:
    """``x`` as a 2-D float16/32/64 array (TypeError / ValueError naming ``name``)."""
    arr = np.asarray(x)
    if arr.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a float16/32/64 array; got dtype {arr.dtype}.")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, features); got shape {arr.shape}.")
    return arr


def int1d(x: Any, name: str, length: int) -> np.ndarray:
    """``x`` as an int64 array of shape (length,) (TypeError / ValueError naming ``name``; uint64 values
    beyond int64 refused): :func:`sparseattn.inputs.positions`, with None refused too."""
    if x is None:
        raise TypeError(f"{name} must be an integer array; got None.")
    return positions(x, length, name)


def check_int(x: Any, name: str, minimum: int = 1) -> int:
    """``x`` as an int >= ``minimum`` (a bool is refused; TypeError / ValueError naming ``name``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(x).__name__}.")
    if int(x) < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {x}.")
    return int(x)

