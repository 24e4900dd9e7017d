"""The selector registry: names -> classes, spec strings -> configured selectors.

Each selector module decorates its classes with :func:`register`; ``sparseattn.selectors`` imports every
selector module explicitly, so all selectors are registered once the package is imported.  This module
imports nothing from the rest of the package (the selector modules import it, never the reverse), so
there is no import cycle; the combinator used for ``"a+b"`` specs registers itself with
:func:`register_union`.  Selectors that compute attention themselves (``attends``) find that computation
here too: the attention layer registers it with :func:`register_attention` (selectors never import
:mod:`sparseattn.attention`, which builds on them), and the selector's ``attend`` calls
:func:`attention_for`.

Spec strings: ``"name"`` or ``"name:p1=v1,p2=v2"``; ``"+"`` joins parts into a union
(``"window:width=64+sinks:g=4+faiss-hnsw:M=32"``).  Values are text and are coerced by the selector's
``params_spec`` (see :mod:`sparseattn.selectors.params`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "SelectorProtocol", "attention_for", "available_selectors", "get_selector", "parse_spec", "register",
    "register_attention", "register_union", "selector_classes", "spec_string",
]

_REGISTRY: dict[str, type[SelectorProtocol]] = {}
_UNION: list[type[SelectorProtocol]] = []  # at most one class: how "a+b" specs are combined
_ATTENTION: dict[str, Callable[..., Any]] = {}  # selector name -> its attention (register_attention)

_T = TypeVar("_T", bound=type)


@runtime_checkable
class SelectorProtocol(Protocol):
    """The selector surface the registry relies on: every :class:`~sparseattn.selectors.base.Selector`
    satisfies it (the registry types against it so that it imports nothing from ``base``)."""

    name: str
    attends: bool

    def build(self, keys: Any, *, check_finite: bool = True) -> Any: ...

    def query(self, queries: Any, k: int = 64, **kwargs: Any) -> Any: ...

    def get_params(self) -> dict[str, Any]: ...


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cls: _T) -> _T:
    """Class decorator adding a selector class to the registry under ``cls.name``.

    Raises
    ------
    ValueError
        The name is empty, or already taken by a different class (the message names both classes).
        Executing the same class definition again (a module reload) replaces the entry.
    """
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name` to be registered.")
    if "+" in name or ":" in name or "," in name or "=" in name:
        raise ValueError(f"selector name {name!r} of {_qualname(cls)} must not contain '+', ':', ',' or '=' "
                         f"(they delimit spec strings).")
    existing = _REGISTRY.get(name)
    if existing is not None and _qualname(existing) != _qualname(cls):
        raise ValueError(f"selector name {name!r} is already registered by {_qualname(existing)}; cannot "
                         f"register {_qualname(cls)} under the same name. Give one of them another name.")
    _REGISTRY[name] = cls  # type: ignore[assignment]
    return cls


def register_union(cls: _T) -> _T:
    """Class decorator naming the class that :func:`get_selector` builds for ``"a+b"`` specs.

    The class is constructed as ``cls(children)`` and must expose ``children`` (the part selectors).
    It is not listed by :func:`selector_classes` (it has no spec name of its own).
    """
    if _UNION and _qualname(_UNION[0]) != _qualname(cls):
        raise ValueError(f"the union class is already registered ({_qualname(_UNION[0])}); cannot register "
                         f"{_qualname(cls)} too.")
    _UNION[:] = [cls]  # type: ignore[list-item]
    return cls


def register_attention(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``fn`` as the attention computed by the selector named ``name``.

    ``fn(selector, queries, values, *, scale, is_causal, query_positions, key_positions, check_finite,
    stats)`` returns ``(output, lse)``.  The attention modules register these when imported (importing
    :mod:`sparseattn` imports them), so a selector reaches its attention without importing the attention
    layer.
    """
    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        _ATTENTION[name] = fn
        return fn
    return add


def attention_for(name: str) -> Callable[..., Any]:
    """The attention registered for the selector named ``name`` (see :func:`register_attention`).

    Raises
    ------
    NotImplementedError
        Nothing is registered under ``name``.
    """
    fn = _ATTENTION.get(name)
    if fn is None:
        raise NotImplementedError(f"no attention is registered for selector {name!r} (the attention modules "
                                  f"register theirs when sparseattn is imported).")
    return fn


def selector_classes() -> dict[str, type[SelectorProtocol]]:
    """name -> class for every registered selector, sorted by name."""
    return dict(sorted(_REGISTRY.items()))


def available_selectors() -> dict[str, str | None]:
    """name -> None when the selector can run here, else why not (e.g. a missing optional package)."""
    return {name: cls.unavailable_reason() for name, cls in selector_classes().items()}


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``"name:a=1,b=x+other"`` into ``[("name", {"a": "1", "b": "x"}), ("other", {})]``.

    Values stay text; the selector coerces them (``"1"`` -> 1 for an int parameter).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"selector spec must be a non-empty string like 'faiss-hnsw:M=32'; got {spec!r}.")
    parts = []
    for piece in spec.split("+"):
        name, _, rest = piece.strip().partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"selector spec {piece!r}: parameter {item!r} must look like name=value (a "
                                 f"value alone names no parameter; `sparseattn selectors` lists them).")
            if key.strip() in params:
                raise ValueError(f"selector spec {piece!r}: parameter {key.strip()!r} is given twice; give it once.")
            params[key.strip()] = value.strip()
        parts.append((name.strip(), params))
    return parts


def get_selector(spec: str | SelectorProtocol, **params: Any) -> SelectorProtocol:
    """A selector from a name or spec string (``"window:width=64+faiss-hnsw:M=32"``), or an instance as is.

    Keyword parameters apply to a single-name spec and override the string's.  Unknown names or
    parameters raise ``ValueError`` listing the valid ones; an unavailable backend raises ``ImportError``
    saying what to install.  The selector is not built.
    """
    if not isinstance(spec, str) and isinstance(spec, SelectorProtocol):
        if params:
            raise ValueError("parameters cannot be given together with a Selector instance; use "
                             "selector.set_params(...).")
        return spec  # type: ignore[return-value]
    parts = parse_spec(spec)
    if len(parts) > 1:
        if params:
            raise ValueError("keyword parameters are ambiguous for a union spec; put them in the string.")
        if not _UNION:  # pragma: no cover - the package registers it on import
            raise RuntimeError("no union selector is registered; import sparseattn.selectors.")
        return _UNION[0]([_from_part(n, p) for n, p in parts])  # type: ignore[call-arg]
    name, parsed = parts[0]
    parsed.update(params)
    return _from_part(name, parsed)


def _from_part(name: str, params: dict[str, Any]) -> SelectorProtocol:
    classes = selector_classes()
    if name not in classes:
        raise ValueError(f"unknown selector {name!r}; available: {', '.join(classes)}.")
    cls = classes[name]
    reason = cls.unavailable_reason()
    if reason:
        raise ImportError(f"selector {name!r} is unavailable: {reason}")
    return cls(**params)


def spec_string(sel: SelectorProtocol) -> str:
    """The spec string that :func:`get_selector` parses back to an equal selector.

    Parameters whose value is None (derived from the data or from k) are left out.  A union gives its
    children's specs joined by ``"+"``.  ``repr(selector)`` is the same string.
    """
    if _UNION and isinstance(sel, _UNION[0]):
        return "+".join(spec_string(c) for c in sel.children)  # type: ignore[attr-defined]
    items = ",".join(f"{k}={v}" for k, v in sel.get_params().items() if v is not None)
    return f"{sel.name}:{items}" if items else sel.name
