"""Key selectors: each turns (queries, keys) into a SparsePattern.

* :mod:`~sparseattn.selectors.base`: the :class:`Selector` protocol (parameters, capabilities, the causal
  filter) and :class:`IndexSelector` (prefix-exact causal search for index backends);
* :mod:`~sparseattn.selectors.params`: :class:`Param` and the shared parameter coercion;
* :mod:`~sparseattn.selectors.registry`: names, spec strings and :func:`get_selector`.

Every selector module is imported here explicitly, which registers its selectors.
"""

from . import angular_lsh, cluster, exact, faiss_ann, kdtree, lsh, pages, union, window  # noqa: F401  (registration)
from .base import IndexSelector, Selector, fill_small_rows
from .params import Param, coerce_param
from .registry import (
    available_selectors,
    get_selector,
    parse_spec,
    register,
    register_union,
    selector_classes,
    spec_string,
)

__all__ = [
    "IndexSelector", "Param", "Selector", "available_selectors", "coerce_param", "fill_small_rows",
    "get_selector", "parse_spec", "register", "register_union", "selector_classes", "spec_string",
]
