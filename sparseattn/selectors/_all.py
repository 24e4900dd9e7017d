"""Imports every selector module so that each registers itself (kept explicit: no import magic)."""

from . import (  # noqa: F401
    angular_lsh,
    cluster,
    exact,
    faiss_ann,
    kdtree,
    lsh,
    union,
    window,
)
