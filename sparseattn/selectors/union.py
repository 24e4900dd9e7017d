"""Union of selectors: every key any child selects (duplicates removed), e.g. window + sinks + ANN."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..pattern import SparsePattern
from .base import Selector
from .registry import register_union

__all__ = ["UnionSelector"]


@register_union
class UnionSelector(Selector):
    """Union of child selectors' patterns.

    Guarantee: a key is selected iff at least one child selects it; each child gets the same ``k``,
    so rows can hold up to ``sum`` of the children's sizes.  Built with ``"a+b+c"`` spec strings.

    The union has no parameters of its own: :meth:`get_params` reports the children's
    (``{child name: child params}``) and parameters are changed on the children,
    ``union.children[i].set_params(...)``.

    Parameters
    ----------
    children : list of Selector
        At least one; built and queried with the same keys, queries, ``k`` and positions.
    """

    name = "union"
    guarantee = "exactly the union of the children's selections"

    def __init__(self, children: list[Selector]) -> None:
        super().__init__()
        if not children:
            raise ValueError("union needs at least one child selector.")
        for c in children:
            if not isinstance(c, Selector):
                raise TypeError(f"union children must be Selector objects; got {type(c).__name__}.")
        self.children = list(children)

    def get_params(self) -> dict[str, Any]:
        """``{child name: child.get_params()}`` (the union itself has no parameters)."""
        return {c.name: c.get_params() for c in self.children}

    def set_params(self, **params: Any) -> UnionSelector:
        """The union has no parameters: raises ``ValueError`` unless called without any."""
        if params:
            names = ", ".join(f"children[{i}] ({c.name})" for i, c in enumerate(self.children))
            raise ValueError(f"union: no parameters of its own; got {sorted(params)}. Set them on a child "
                             f"instead, e.g. union.children[0].set_params(...); children: {names}.")
        return self

    @property
    def metric(self) -> str:  # type: ignore[override]
        return " | ".join(sorted({c.metric for c in self.children}))

    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False, bias: bool = False) -> list[str]:
        """Every child's reasons (see :meth:`Selector.not_supported_reasons`)."""
        return [r for c in self.children
                for r in c.not_supported_reasons(n_keys=n_keys, dim=dim, is_causal=is_causal, bias=bias)]

    def _build(self, keys: np.ndarray) -> None:
        for c in self.children:
            c.build(keys, check_finite=False)

    def _query(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
               kpos: np.ndarray) -> SparsePattern:
        patterns = [c.query(q, k, is_causal=is_causal, query_positions=qpos, key_positions=kpos,
                            check_finite=False) for c in self.children]
        return patterns[0].union(*patterns[1:])
