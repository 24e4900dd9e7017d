"""Union of selectors: every key any child selects (duplicates removed), e.g. window + sinks + ANN."""

from __future__ import annotations

import numpy as np

from ..pattern import SparsePattern
from .base import Selector


class UnionSelector(Selector):
    """Union of child selectors' patterns.

    Guarantee: a key is selected iff at least one child selects it; each child gets the same ``k``,
    so rows can hold up to ``sum`` of the children's sizes.  Built with ``"a+b+c"`` spec strings.
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

    @property
    def params(self) -> dict:
        return {c.name: c.params for c in self.children}

    @property
    def metric(self) -> str:  # type: ignore[override]
        return " | ".join(sorted({c.metric for c in self.children}))

    def not_supported_reasons(self, **kwargs) -> list[str]:
        return [r for c in self.children for r in c.not_supported_reasons(**kwargs)]

    def _build(self, keys: np.ndarray) -> None:
        for c in self.children:
            c.build(keys, check_finite=False)

    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        patterns = [c.query(q, k, is_causal=is_causal, query_positions=qpos, key_positions=kpos,
                            check_finite=False) for c in self.children]
        return patterns[0].union(*patterns[1:])
