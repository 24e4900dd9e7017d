"""The selector protocol, the registry, parameter parsing, and causal search for index backends.

A selector answers "which keys should each query attend to?" with a :class:`~sparseattn.SparsePattern`.

* ``__init__(**params)`` only stores (validated) parameters: cheap, so specs can be parsed and listed;
* ``build(keys)`` does the work (index construction) once;
* ``query(queries, k, is_causal=..., query_positions=..., key_positions=...)`` is cheap to sweep.

Every selector states the ``metric`` it approximates (always maximum inner product here: the keys that
carry the softmax mass are those with the largest q.k, not the nearest in Euclidean distance) and a
``guarantee`` string (what is exact, what is approximate).

Causal masking (key j visible to query i iff ``key_positions[j] <= query_positions[i]``) is enforced for
every selector by a final filter at this boundary, so no selector can leak a future key.  Index-based
selectors (:class:`IndexSelector`) additionally search *only the allowed prefix* so early queries keep their
recall: the prefix ``[0, c)`` is split into an exact tail ``[B*floor(c/B), c)`` and aligned dyadic blocks
``[t*2^l*B, (t+1)*2^l*B)`` covering the rest, each with its own index (built lazily, cached); candidates
from all pieces are re-ranked exactly.
"""

from __future__ import annotations

import ast
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .._validation import as_float_array, check_positive_int
from ..kernels.rerank import rerank_topk
from ..pattern import SparsePattern, _positions


@dataclass(frozen=True)
class Param:
    """One selector parameter: type, default, help text, and an optional check returning an error."""

    type: type
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None


def positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def non_negative(v: Any) -> str | None:
    return None if v is None or v >= 0 else "must be >= 0"


def in_unit_interval(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must lie in [0, 1]"


class Selector(ABC):
    """Base class: parameter handling, input validation and the causal safety filter.

    Subclasses set ``name``, ``metric``, ``guarantee``, ``params_spec`` and implement ``_build`` and
    ``_query``.  ``k`` is the per-query budget of top-k style selectors; structural selectors
    (window, sinks, random) document how they use it.
    """

    name: ClassVar[str] = ""
    metric: ClassVar[str] = "inner_product"
    guarantee: ClassVar[str] = ""
    params_spec: ClassVar[dict[str, Param]] = {}
    supports_add: ClassVar[bool] = False
    #: Top-k style selectors promise every allowed key when a row has at most k of them (k >= S, or the
    #: first rows of a causal sequence); structural selectors (window, sinks, random) opt out.
    fills_small_rows: ClassVar[bool] = True

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.params_spec))
        if unknown:
            valid = ", ".join(sorted(self.params_spec)) or "(none)"
            raise ValueError(f"unknown parameter(s) {unknown} for selector {self.name!r}; valid: {valid}.")
        self._params: dict[str, Any] = {}
        for pname, spec in self.params_spec.items():
            value = params.get(pname, spec.default)
            self._params[pname] = _coerce(self.name, pname, value, spec)
        self.keys_: np.ndarray | None = None
        self.key_positions_: np.ndarray | None = None

    # ------------------------------------------------------------------------------------ metadata
    @property
    def params(self) -> dict[str, Any]:
        """The parameters in force (defaults filled in), for reports."""
        return dict(self._params)

    def __repr__(self) -> str:
        return spec_string(self)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can be imported, else why not (e.g. a missing optional package)."""
        return None

    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False) -> list[str]:
        """Reasons this selector cannot run on such input (empty list: supported)."""
        reason = self.unavailable_reason()
        return [reason] if reason else []

    # ----------------------------------------------------------------------------------------- work
    def build(self, keys: np.ndarray, *, check_finite: bool = True) -> Selector:
        """Index the keys.

        Parameters
        ----------
        keys : float array, shape (S, E)
            float16 is upcast to float32; float64 stays float64.
        """
        kk = as_float_array(keys, "keys", min_ndim=2, check_finite=check_finite)
        if kk.ndim != 2:
            raise ValueError(f"keys must be 2-D (S, E) for a selector; got shape {kk.shape}. "
                             f"Build one selector per head.")
        reasons = self.not_supported_reasons(n_keys=kk.shape[0], dim=kk.shape[1])
        if reasons:
            raise ValueError(f"selector {self.name!r} cannot run here: {'; '.join(reasons)}")
        dtype = np.float64 if kk.dtype == np.float64 else np.float32
        self.keys_ = np.ascontiguousarray(kk, dtype=dtype)
        self._build(self.keys_)
        return self

    def add(self, new_keys: np.ndarray) -> Selector:
        """Append keys (ids continue after the existing ones), where the backend supports growth."""
        raise NotImplementedError(f"selector {self.name!r} cannot grow in place; call build() with all keys.")

    def query(self, queries: np.ndarray, k: int = 64, *, is_causal: bool = False,
              query_positions: object = None, key_positions: object = None,
              check_finite: bool = True) -> SparsePattern:
        """Select keys for each query.

        Parameters
        ----------
        queries : float array, shape (L, E)
        k : int >= 1
            Keys per query for top-k selectors.  When fewer keys are allowed (small S, causal prefix),
            rows hold all of them: k > S is legal and means "every allowed key".
        is_causal : bool
            Key j is visible to query i only when ``key_positions[j] <= query_positions[i]``.
        query_positions, key_positions : int arrays of shape (L,) and (S,), optional
            Default ``arange`` (SDPA's top-left alignment). For L new queries after a cache of S keys use
            ``query_positions=np.arange(S - L, S)``.

        Returns
        -------
        SparsePattern with ``n_queries = L`` and ``n_keys = S``.
        """
        if self.keys_ is None:
            raise RuntimeError(f"selector {self.name!r} is not built: call build(keys) before query().")
        q = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
        if q.ndim != 2:
            raise ValueError(f"queries must be 2-D (L, E); got shape {q.shape}.")
        if q.shape[1] != self.keys_.shape[1]:
            raise ValueError(f"queries have E={q.shape[1]} features but the keys have {self.keys_.shape[1]}.")
        k = check_positive_int(k, "k")
        if not isinstance(is_causal, (bool, np.bool_)):
            raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")
        q = np.ascontiguousarray(q, dtype=self.keys_.dtype)
        L, S = q.shape[0], self.keys_.shape[0]
        qpos = _positions(query_positions, L, "query_positions")
        kpos = _positions(key_positions, S, "key_positions")
        if S == 0:  # nothing to select from: every row empty (attention over it gives zeros)
            return SparsePattern(np.zeros(L + 1, np.int64), np.zeros(0, np.int32), 0, validate=False)
        if self.fills_small_rows and k >= S:
            # Every row has at most k allowed keys, so the documented result is all of them: skip the
            # search (an index scan or a full top-k over S keys would only confirm it).
            full = SparsePattern.full(L, S)
            return full.causal(qpos, kpos) if is_causal else full
        pattern = self._query(q, k, bool(is_causal), qpos, kpos)
        if pattern.shape != (L, S):  # pragma: no cover - a selector bug, not a user error
            raise RuntimeError(f"selector {self.name!r} returned a pattern of shape {pattern.shape}, "
                               f"expected {(L, S)}.")
        if is_causal:
            pattern = pattern.causal(qpos, kpos)
        if self.fills_small_rows:
            pattern = _fill_small_rows(pattern, k, bool(is_causal), qpos, kpos)
        return pattern

    @abstractmethod
    def _build(self, keys: np.ndarray) -> None:
        """Backend work on validated (S, E) float32/float64 C-contiguous keys."""

    @abstractmethod
    def _query(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
               kpos: np.ndarray) -> SparsePattern:
        """Return an (L, S) pattern; causal selectors should already respect positions."""


def _fill_small_rows(pattern: SparsePattern, k: int, is_causal: bool, qpos: np.ndarray,
                     kpos: np.ndarray) -> SparsePattern:
    """Union each row that has at most k allowed keys with all of them (the documented k >= S rule)."""
    L, S = pattern.shape
    if not is_causal:
        return SparsePattern.full(L, S) if k >= S else pattern
    order = np.argsort(kpos, kind="stable")
    allowed = np.searchsorted(kpos[order], qpos, side="right")  # keys with position <= query's
    small = (allowed <= k) & (allowed > 0)
    if not small.any():
        return pattern
    counts = np.where(small, allowed, 0).astype(np.int64)
    indptr = np.zeros(L + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    within = np.arange(indptr[-1], dtype=np.int64) - np.repeat(indptr[:-1], counts)
    from ..kernels.pattern_ops import canonicalize_rows
    ptr, idx = canonicalize_rows(indptr, order[within].astype(np.int32))
    extra = SparsePattern(ptr, idx, S, validate=False)
    return pattern.union(extra)


class IndexSelector(Selector):
    """A k-nearest-neighbour backend over (optionally centred) keys, with prefix-exact causal search.

    Subclasses implement ``_make_index(keys)`` and ``_search(index, queries, k) -> (scores, ids)`` with
    local ids and -1 sentinels; this class handles centring, sentinels, causal prefixes and exact
    re-ranking.  Subtracting the mean key changes no softmax (q.mu is a per-query constant) but makes
    inner-product indexes much better conditioned.
    """

    causal_block: ClassVar[int] = 1024
    rerank: ClassVar[bool] = True

    def _build(self, keys: np.ndarray) -> None:
        self._blocks: dict[tuple[int, int], Any] = {}
        if keys.shape[0] == 0:  # no index over nothing (FAISS cannot train or search an empty index)
            self.mean_ = np.zeros(keys.shape[1], keys.dtype)
            self.centered_ = keys
            self.index_ = None
            return
        center = self._params.get("center", True)
        self.mean_ = keys.mean(axis=0, dtype=np.float64).astype(keys.dtype) if center and keys.shape[0] \
            else np.zeros(keys.shape[1], keys.dtype)
        self.centered_ = np.ascontiguousarray(keys - self.mean_) if center else keys
        self.index_ = self._make_index(self.centered_)
        self._blocks: dict[tuple[int, int], Any] = {}

    @abstractmethod
    def _make_index(self, keys: np.ndarray) -> Any:
        """Build the backend index over an (n, E) block of centred keys."""

    @abstractmethod
    def _search(self, index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Search: (scores (L, k'), ids (L, k') int64 local to the index, -1 = none)."""

    def _candidates(self, q: np.ndarray, k: int) -> np.ndarray:
        _, ids = self._search(self.index_, q, k)
        return np.asarray(ids, dtype=np.int64)

    def _query(self, q, k, is_causal, qpos, kpos):
        S = self.keys_.shape[0]
        if not is_causal:
            cand = self._candidates(q, min(k, S))
            if self.rerank:
                _, ids = rerank_topk(q, self.keys_, cand, k)
            else:
                ids = cand
            return SparsePattern.from_padded(ids, S)
        return SparsePattern.from_padded(self._causal_ids(q, k, qpos, kpos), S)

    def _block_index(self, level: int, t: int) -> Any:
        key = (level, t)
        if key not in self._blocks:
            size = self.causal_block << level
            self._blocks[key] = self._make_index(self.centered_[t * size:(t + 1) * size])
        return self._blocks[key]

    def _causal_ids(self, q: np.ndarray, k: int, qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
        if np.any(np.diff(kpos) < 0):
            raise ValueError("causal search with an index needs key_positions sorted ascending; "
                             "sort the keys by position first.")
        B = self.causal_block
        L = q.shape[0]
        prefix = np.searchsorted(kpos, qpos, side="right").astype(np.int64)  # allowed keys [0, c)
        n_full = prefix // B  # whole blocks before the exact tail
        max_level = int(n_full.max()).bit_length() if L else 0
        pieces: list[np.ndarray] = []
        # Exact tail [B*floor(c/B), c): brute force, grouped by block.
        tail = np.full((L, min(k, B)), -1, dtype=np.int64)
        for b in np.unique(n_full):
            rows = np.nonzero(n_full == b)[0]
            lo = int(b) * B
            hi = min(lo + B, self.keys_.shape[0])
            if hi <= lo:
                continue
            s = q[rows] @ self.keys_[lo:hi].T
            s[np.arange(lo, hi)[None, :] >= prefix[rows, None]] = -np.inf
            kk = min(k, hi - lo)
            part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
            ok = np.isfinite(np.take_along_axis(s, part, axis=1))
            tail[rows, :kk] = np.where(ok, part + lo, -1)
        pieces.append(tail)
        # Dyadic blocks covering [0, B*floor(c/B)): bit l of n_full selects block t = (n_full >> l) - 1
        # at level l after clearing lower bits, i.e. a binary decomposition of the prefix.
        for level in range(max_level):
            has = ((n_full >> level) & 1) == 1
            if not has.any():
                continue
            starts = ((n_full >> (level + 1)) << (level + 1))  # in units of B
            t_idx = starts >> level  # block index at this level
            found: list[tuple[np.ndarray, np.ndarray]] = []
            for t in np.unique(t_idx[has]):
                rows = np.nonzero(has & (t_idx == t))[0]
                index = self._block_index(level, int(t))
                _, ids = self._search(index, q[rows], min(k, B << level))
                ids = np.asarray(ids, dtype=np.int64)
                offset = int(t) * (B << level)
                found.append((rows, np.where(ids >= 0, ids + offset, -1)))
            # Backends may return more than k candidates (e.g. for their own re-rank): size by the widest.
            width = max(ids.shape[1] for _, ids in found)
            block_ids = np.full((L, width), -1, dtype=np.int64)
            for rows, ids in found:
                block_ids[rows, :ids.shape[1]] = ids
            pieces.append(block_ids)
        cand = np.concatenate(pieces, axis=1)
        _, ids = rerank_topk(q, self.keys_, cand, k)
        return ids


# ------------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[Selector]] = {}


def register(cls: type[Selector]) -> type[Selector]:
    """Class decorator adding a selector to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty name")
    _REGISTRY[cls.name] = cls
    return cls


def _ensure_loaded() -> None:
    from . import _all  # noqa: F401  (imports every selector module, each registering itself)


def selector_classes() -> dict[str, type[Selector]]:
    """name -> class for every registered selector."""
    _ensure_loaded()
    return dict(sorted(_REGISTRY.items()))


def available_selectors() -> dict[str, str | None]:
    """name -> None when usable here, else the reason it is unavailable."""
    return {name: cls.unavailable_reason() for name, cls in selector_classes().items()}


def _coerce(selector: str, pname: str, value: Any, spec: Param) -> Any:
    if value is None and spec.default is None:
        return None
    if isinstance(value, str) and spec.type is not str:
        value = _parse_value(value)
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


def _parse_value(text: str) -> Any:
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


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``"name:a=1,b=x+other"`` into ``[(name, {a: 1, b: 'x'}), (other, {})]``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"selector spec must be a non-empty string like 'faiss-hnsw:M=32'; got {spec!r}.")
    parts = []
    for piece in spec.split("+"):
        name, _, rest = piece.strip().partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"selector spec {piece!r}: parameter {item!r} must look like name=value.")
            params[key.strip()] = value.strip()
        parts.append((name.strip(), params))
    return parts


def get_selector(spec: str | Selector, **params: Any) -> Selector:
    """A selector from a name or spec string (``"window:width=64+faiss-hnsw:M=32"``) or an instance.

    Keyword parameters apply to a single-name spec.  Unknown names or parameters raise ``ValueError``
    listing the valid ones; an unavailable backend raises ``ImportError`` saying what to install.
    """
    if isinstance(spec, Selector):
        if params:
            raise ValueError("parameters cannot be given together with a Selector instance.")
        return spec
    parts = parse_spec(spec)
    classes = selector_classes()
    if len(parts) > 1:
        if params:
            raise ValueError("keyword parameters are ambiguous for a union spec; put them in the string.")
        from .union import UnionSelector
        return UnionSelector([get_selector_from_part(n, p, classes) for n, p in parts])
    name, parsed = parts[0]
    parsed.update(params)
    return get_selector_from_part(name, parsed, classes)


def get_selector_from_part(name: str, params: dict[str, Any], classes: dict[str, type[Selector]]) -> Selector:
    if name not in classes:
        raise ValueError(f"unknown selector {name!r}; available: {', '.join(classes)}.")
    cls = classes[name]
    reason = cls.unavailable_reason()
    if reason:
        raise ImportError(f"selector {name!r} is unavailable: {reason}")
    return cls(**params)


def spec_string(sel: Selector) -> str:
    """The string form that ``get_selector`` parses back to an equal selector."""
    if hasattr(sel, "children"):
        return "+".join(spec_string(c) for c in sel.children)  # type: ignore[attr-defined]
    items = ",".join(f"{k}={v}" for k, v in sel.params.items() if v is not None)
    return f"{sel.name}:{items}" if items else sel.name
