"""Key selectors: each turns (queries, keys) into a SparsePattern. See base.py for the protocol."""

from .base import (
    IndexSelector,
    Param,
    Selector,
    available_selectors,
    get_selector,
    parse_spec,
    register,
    selector_classes,
    spec_string,
)

__all__ = [
    "IndexSelector", "Param", "Selector", "available_selectors", "get_selector", "parse_spec",
    "register", "selector_classes", "spec_string",
]
