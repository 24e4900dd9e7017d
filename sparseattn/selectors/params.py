"""Selector parameters: the :class:`Param` spec, value checks, and the coercion every selector shares.

A selector declares ``params_spec: dict[str, Param]``.  Values given to ``__init__``, to
:meth:`~sparseattn.selectors.base.Selector.set_params` or in a spec string (``"faiss-hnsw:M=32"``, where
every value arrives as text) all pass through :func:`coerce_param`, so the same rules and error messages
apply everywhere.  This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..index.kmeans import SEED_MAX

__all__ = ["Param", "coerce_param", "in_unit_interval", "non_negative", "parse_value", "positive"]

#: When a parameter is read: at ``build()`` (changing it needs a rebuild) or at every ``query()``.
When = Literal["build", "query"]


@dataclass(frozen=True)
class Param:
    """One selector parameter.

    Attributes
    ----------
    type : type
        ``bool``, ``int``, ``float`` or ``str``; values are coerced to it (see :func:`coerce_param`).
    default : Any
        Value used when the parameter is not given; ``None`` means "derived from the data or from k"
        and is always accepted.
    help : str
        One line for ``sparseattn list`` and error messages.
    check : callable, optional
        ``check(value) -> None`` when valid, else a phrase such as ``"must be > 0"``.
    when : {"build", "query"}, default "build"
        ``"build"``: read by ``build()`` (changing it on a built selector needs ``build()`` again);
        ``"query"``: read by every ``query()``, so ``set_params`` takes effect on the next query.
    """

    type: type
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None
    when: When = "build"

    def __post_init__(self) -> None:
        if self.when not in ("build", "query"):
            raise ValueError(f"Param.when must be 'build' or 'query'; got {self.when!r}.")


def positive(v: Any) -> str | None:
    """Check: None or > 0."""
    return None if v is None or v > 0 else "must be > 0"


def non_negative(v: Any) -> str | None:
    """Check: None or >= 0."""
    return None if v is None or v >= 0 else "must be >= 0"


def faiss_seed(v: Any) -> str | None:
    """Check: 0 <= v <= 2**31 - 1 (31-bit k-means seeds)."""
    return None if 0 <= v <= SEED_MAX else f"must lie in [0, {SEED_MAX}] (a 31-bit k-means seed)"


def in_unit_interval(v: Any) -> str | None:
    """Check: 0 <= v <= 1."""
    return None if 0 <= v <= 1 else "must lie in [0, 1]"


def parse_value(text: str) -> Any:
    """A spec-string value as Python: true/false/yes/no/on/off, none/null, a literal, else the text.

    >>> parse_value("32"), parse_value("0.5"), parse_value("off"), parse_value("simhash")
    (32, 0.5, False, 'simhash')
    """
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def coerce_param(selector: str, pname: str, value: Any, spec: Param) -> Any:
    """Validate and convert one parameter value; errors name the selector, the parameter and the rule.

    Parameters
    ----------
    selector : str
        Selector name, for messages.
    pname : str
        Parameter name, for messages.
    value : Any
        As given by the caller; strings (from spec strings) are parsed with :func:`parse_value` first
        unless the parameter is a ``str``.
    spec : Param

    Returns
    -------
    The value as ``spec.type`` (``None`` passes through when the default is ``None``).

    Raises
    ------
    TypeError
        Wrong type, e.g. ``"window: parameter width must be an integer; got 2.5."``
    ValueError
        Fails ``spec.check``, e.g. ``"window: parameter width must be > 0; got 0."``
    """
    if value is None and spec.default is None:
        return None
    if isinstance(value, str) and spec.type is not str:
        value = parse_value(value)
    if spec.type is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{selector}: parameter {pname} must be a bool (true/false); got {value!r}.")
        value = bool(value)
    elif spec.type is int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{selector}: parameter {pname} must be an integer; got {value!r}.")
        value = int(value)
    elif spec.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
                raise ValueError(f"{selector}: parameter {pname} must be finite; got {value!r}.")
            raise TypeError(f"{selector}: parameter {pname} must be a number; got {value!r}.")
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"{selector}: parameter {pname} must be finite; got {value!r}.")
    elif spec.type is str:
        if not isinstance(value, str):
            raise TypeError(f"{selector}: parameter {pname} must be a string; got {value!r}.")
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise ValueError(f"{selector}: parameter {pname} {problem}; got {value!r}.")
    return value
