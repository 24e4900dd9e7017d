"""Imports every selector module so that each registers itself (kept explicit: no import magic)."""

from . import (  # noqa: F401
    cluster,
    exact,
    faiss_ann,
    kdtree,
    union,
    window,
)
