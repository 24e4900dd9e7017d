"""Routing strategies of the decode cache behind one interface (:class:`Routing`).

Built in (by ``selector=`` name, in this order): ``cluster`` (segments of k-means clusters),
``pages`` (Quest page bounds), ``sketch`` (4-bit residual codes of every clustered key, scanned by their sign plane and re-ranked), ``window``, ``topk`` and ``dense``; any other selector spec names an
index selector (:class:`IndexRouting`).
"""

from __future__ import annotations

from typing import Any

from .base import Routing, register_routing, routing_classes
from .cluster import ClusterRouting
from .exact import DenseRouting, TopKRouting, WindowRouting
from .index import IndexRouting, index_selector_names, parse_index_selector
from .pages import PagesRouting
from .sketch import SketchRouting, parse_sketch

__all__ = ["ClusterRouting", "DenseRouting", "IndexRouting", "PagesRouting", "Routing", "SketchRouting", "TopKRouting",
           "WindowRouting", "index_selector_names", "parse_index_selector", "register_routing",
           "routing_class", "routing_classes"]


def routing_class(selector: Any) -> type[Routing]:
    """The strategy class of ``selector`` (a built-in name, else an index selector spec, validated)."""
    own = routing_classes()
    if isinstance(selector, str) and selector in own:
        return own[selector]
    if parse_sketch(selector) is not None:  # "sketch:<options>" (ValueError naming a bad option)
        return SketchRouting
    parse_index_selector(selector)  # ValueError naming the accepted selectors
    return IndexRouting
