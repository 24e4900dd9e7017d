"""Numba kernels: plain functions over arrays and scalars, kept apart from the objects holding state."""

from . import _options  # noqa: F401  (must run before any kernel compiles: sets the cache directory)
