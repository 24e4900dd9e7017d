"""Subcommands that compare selectors and run the benchmark suite (filled in by the report module)."""

from __future__ import annotations

import argparse


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register report-related subcommands (compare, bench, trace)."""
    return None
