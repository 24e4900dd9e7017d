"""Imports every selector module so that each registers itself (kept explicit: no import magic)."""

from . import union  # noqa: F401
