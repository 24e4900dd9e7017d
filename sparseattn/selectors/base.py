"""The selector protocol and causal search for index backends.

A selector answers "which keys should each query attend to?" with a :class:`~sparseattn.SparsePattern`.

* ``__init__(**params)`` only stores (validated) parameters: cheap, so specs can be parsed and listed;
* ``build(keys)`` does the work (index construction) once;
* ``query(queries, k, is_causal=..., query_positions=..., key_positions=...)`` is cheap to sweep.

Parameters (declared in ``params_spec`` with :class:`~sparseattn.selectors.params.Param`) are read with
:meth:`Selector.get_params` and changed with :meth:`Selector.set_params`; each is either build-time
(changing it on a built selector requires ``build()`` again) or query-time (takes effect on the next
query).  Optional capabilities are declared, never discovered: ``supports_add`` (``add()`` appends keys
to a built index) and ``attends`` (``attend()`` computes attention itself instead of returning a
pattern).  :meth:`Selector.not_supported_reasons` says up front why a configuration cannot run on some
input.  Registration and spec strings live in :mod:`sparseattn.selectors.registry`.

Every selector states the ``metric`` it approximates (always maximum inner product here: the keys that
carry the softmax mass are those with the largest q.k, not the nearest in Euclidean distance) and a
``guarantee`` string (what is exact, what is approximate).

Input policies enforced here, once, for every selector:

* **No features (E = 0).**  Every score ``q.k`` is 0, so a content-scored selector (``metric`` an inner
  product) has nothing to search: :meth:`Selector.build` does not call the backend (no FAISS index, no
  k-means), :meth:`Selector.query` returns, per query, the ``k`` allowed keys of smallest id (ties broken
  by id, causality respected; every allowed key for a selector without a budget, e.g. block-mode cluster
  routing), :meth:`Selector.attend` is the exact attention over every allowed key (the mean of their values)
  and :meth:`Selector.add` appends.  Positional selectors (window, sinks, random) ignore E anyway.
* **Magnitudes.**  :class:`IndexSelector` backends (FAISS, kd-tree, LSH) accept any finite value: they index the centred keys scaled by a power of two (exact, and the same for every key,
  so no ranking changes) and search with each query scaled by its own power of two (the same for every
  key of that query), so float64 keys or queries beyond the float32 range (or tiny ones) are searched in
  range; candidates are re-ranked exactly on the original values.  A backend that takes the values as
  they are in a narrower dtype declares ``index_dtype`` (e.g. float32 for the k-means of cluster
  routing), and :meth:`Selector.build` / :meth:`Selector.add` refuse keys whose squared norms would
  overflow it with a ``ValueError`` that names the argument and the fix (rescale the keys, or use topk /
  window, computed in the input dtype, or an index selector).

Causal masking (key j visible to query i iff ``key_positions[j] <= query_positions[i]``) is enforced for
every selector by a final filter at this boundary, so no selector can leak a future key.  Index-based
selectors (:class:`IndexSelector`) additionally search *only the allowed prefix* so early queries keep their
recall: the prefix ``[0, c)`` is split into an exact tail ``[B*floor(c/B), c)`` and aligned dyadic blocks
``[t*2^l*B, (t+1)*2^l*B)`` covering the rest, each with its own index (built lazily, cached); candidates
from all pieces are re-ranked exactly.  Each block is centred, scaled and indexed from its own keys only,
so causal selection is strictly causal: which past keys a row gets never depends on later keys (tested by
perturbing future keys in ``tests/test_causality.py``).  The cluster selector does the same with its own
segments (:mod:`sparseattn.index.segments`).  Index backends require non-decreasing ``key_positions`` in
causal mode.
"""

from __future__ import annotations

import functools
import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..index.segments import dyadic_cover, scatter_rows
from ..inputs import as_float_array, check_bool, check_positive_int, check_scale, positions
from ..kernels.topk import ORDER_NONE, block_topk, rerank_topk
from ..pattern import SparsePattern
from .params import Param, coerce_param, in_unit_interval, non_negative, positive
from .registry import get_selector, register, selector_classes, spec_string

__all__ = [
    "IndexSelector", "Param", "Selector", "fill_small_rows", "first_allowed", "get_selector", "in_unit_interval",
    "non_negative", "positive", "register", "selector_classes",
]

_S = TypeVar("_S", bound="Selector")
#: Magnitudes an index backend sees unscaled (see :class:`IndexSelector`): squares and float32 products of
#: values in this range neither overflow nor underflow.
_SAFE_LO, _SAFE_HI = 2.0 ** -40, 2.0 ** 40


def scale_exponent(x: np.ndarray) -> int:
    """0 when the largest ``|x|`` is 0 or lies in ``[2**-40, 2**40]``, else ``e`` with ``max|x| * 2**-e`` in
    ``[0.5, 1)``: ``np.ldexp(x, -e)`` then brings ``x`` into range exactly (see :class:`IndexSelector`)."""
    big = float(np.abs(x).max(initial=0.0))
    return 0 if big == 0.0 or _SAFE_LO <= big <= _SAFE_HI else int(np.frexp(big)[1])


class Selector(ABC):
    """Base class: parameter handling, input validation, declared capabilities and the causal filter.

    Subclasses set ``name``, ``metric``, ``guarantee``, ``params_spec`` and implement ``_build`` and
    ``_query``.  ``k`` is the per-query budget of top-k style selectors; structural selectors
    (window, sinks, random) document how they use it.

    Capabilities (class attributes, read by callers instead of probing for methods):

    * ``supports_add``: :meth:`add` appends keys to a built selector (else it raises
      ``NotImplementedError``); a subclass declaring it must override :meth:`add`, and vice versa.
    * ``attends``: :meth:`attend` computes attention over the selected keys itself (else it raises
      ``NotImplementedError``; use :meth:`query` and :func:`sparseattn.sparse_attention`).
    * ``fills_small_rows``: see below.
    * ``query_params``: names of the query-time parameters (derived from ``params_spec``).
    * ``index_dtype``: the narrower dtype the backend takes the keys in as they are (see below).

    Inputs without features (E = 0) never reach the backend of a content-scored selector (``metric`` an
    inner product): see the module notes.  The guard covers :meth:`build`, :meth:`query` and the
    :meth:`add` / :meth:`attend` of every subclass (they are wrapped when the subclass is created).
    """

    name: ClassVar[str] = ""
    metric: ClassVar[str] = "inner_product"
    guarantee: ClassVar[str] = ""
    params_spec: ClassVar[dict[str, Param]] = {}
    #: Parameters with ``Param.when == "query"``: :meth:`set_params` changes them without a rebuild.
    query_params: ClassVar[tuple[str, ...]] = ()
    #: True exactly when :meth:`add` can append keys to a built selector.
    supports_add: ClassVar[bool] = False
    #: True when :meth:`attend` computes attention itself (selectors may make this a property).
    attends: ClassVar[bool] = False
    #: Top-k style selectors promise every allowed key when a row has at most k of them (k >= S, or the
    #: first rows of a causal sequence); structural selectors (window, sinks, random) opt out.
    fills_small_rows: ClassVar[bool] = True
    #: (module, install hint) of the optional package the backend imports, checked by
    #: :meth:`unavailable_reason`; None when it needs nothing beyond numpy and numba.
    requires: ClassVar[tuple[str, str] | None] = None
    #: The dtype (e.g. ``np.float32``) in which the backend computes on the keys *as they are* (products
    #: and squared norms): :meth:`build` and :meth:`add` refuse keys of magnitude beyond
    #: ``sqrt(finfo(index_dtype).max) / 2**14`` (2**50 ~ 1.1e15 for float32, so squared norms of up to
    #: 2**27 features stay finite) with a ``ValueError`` naming the fix.  None: any finite key works (the
    #: keys' own dtype, or a backend that rescales, as :class:`IndexSelector` does).  A class that requires
    #: faiss and does not set it gets ``np.float32`` (FAISS computes in float32 only).
    index_dtype: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for pname, spec in cls.params_spec.items():
            if not isinstance(spec, Param):
                raise TypeError(f"{cls.__qualname__}.params_spec[{pname!r}] must be a Param; got {spec!r}.")
        cls.query_params = tuple(p for p, spec in cls.params_spec.items() if spec.when == "query")
        overrides_add = cls.add is not Selector.add
        if bool(cls.supports_add) != overrides_add:
            raise TypeError(f"{cls.__qualname__}: supports_add={cls.supports_add} but add() is "
                            f"{'overridden' if overrides_add else 'not overridden'}; declare supports_add = "
                            f"True exactly when the class implements add().")
        declared = any("index_dtype" in c.__dict__ for c in cls.__mro__ if c is not Selector)
        if not declared and cls.requires is not None and cls.requires[0] == "faiss":
            cls.index_dtype = np.float32
        # E = 0 and the key range are checked before a subclass's own add() / attend() runs.
        if "add" in cls.__dict__:
            cls.add = _guard_add(cls.__dict__["add"])  # type: ignore[method-assign]
        if "attend" in cls.__dict__:
            cls.attend = _guard_attend(cls.__dict__["attend"])  # type: ignore[method-assign]

    def __init__(self, **params: Any) -> None:
        self._params: dict[str, Any] = self._coerce_params(params)
        self.keys_: np.ndarray | None = None
        self.key_positions_: np.ndarray | None = None
        self._stale: tuple[str, ...] = ()  # build-time parameters changed since build()
        self._featureless = False  # built on E = 0 keys by a content-scored selector (backend skipped)

    def clone(self: _S) -> _S:
        """A new, unbuilt selector of the same class with the same parameters (:meth:`get_params`).

        Shares no state with ``self`` (building or querying one never changes the other).  A selector with
        ``children`` (the union of ``"a+b"`` specs) is cloned part by part.
        """
        children = getattr(self, "children", None)
        if children is not None:
            return type(self)([c.clone() for c in children])  # type: ignore[call-arg]
        # None means "derived" and is left out, as in spec strings (exclusive parameters stay consistent)
        return type(self)(**{p: v for p, v in self.get_params().items() if v is not None})

    # ---------------------------------------------------------------------------------- parameters
    def _coerce_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Check names and coerce every value, defaults filled in."""
        unknown = sorted(set(params) - set(self.params_spec))
        if unknown:
            valid = ", ".join(sorted(self.params_spec)) or "(none)"
            raise ValueError(f"unknown parameter(s) {unknown} for selector {self.name!r}; valid: {valid}.")
        return {p: coerce_param(self.name, p, params.get(p, spec.default), spec)
                for p, spec in self.params_spec.items()}

    @property
    def params(self) -> dict[str, Any]:
        """The parameters in force (defaults filled in), for reports; the same as :meth:`get_params`."""
        return self.get_params()

    def get_params(self) -> dict[str, Any]:
        """name -> value of every parameter in force (defaults filled in; None means "derived").

        ``get_selector(spec_string(sel))`` rebuilds an equal selector from these.
        """
        return dict(self._params)

    def _merge_params(self, current: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
        """The full parameter set after ``set_params(**changes)`` (override for exclusive parameters)."""
        return {**current, **changes}

    def set_params(self: _S, **params: Any) -> _S:
        """Change parameters in place, validated exactly as by ``__init__``; returns ``self``.

        * Query-time parameters (``Param(..., when="query")``, listed in ``query_params``) take effect
          on the next :meth:`query`; the built index is kept.
        * Changing a build-time parameter drops the built state: the next ``query()`` or ``add()``
          raises ``RuntimeError`` naming the changed parameters and asking for ``build(keys)`` again.
          Setting a parameter to its current value changes nothing.

        Raises
        ------
        ValueError
            Unknown parameter (the message lists the valid ones) or an invalid value (the message names
            the parameter and the rule, e.g. ``"window: parameter width must be > 0; got -1."``).
        TypeError
            A value of the wrong type.  On any error the selector is left unchanged.
        """
        if not params:
            return self
        unknown = sorted(set(params) - set(self.params_spec))
        if unknown:
            valid = ", ".join(sorted(self.params_spec)) or "(none)"
            raise ValueError(f"unknown parameter(s) {unknown} for selector {self.name!r}; valid: {valid}.")
        merged = self._merge_params(dict(self._params), dict(params))
        fresh = type(self)(**merged)  # the same coercion and cross-parameter rules as __init__
        rebuild = [p for p, spec in self.params_spec.items()
                   if spec.when == "build" and fresh._params[p] != self._params[p]]
        if not rebuild:
            self._params = fresh._params
            return self
        was_built = self.keys_ is not None or bool(self._stale)
        stale = tuple(dict.fromkeys(self._stale + tuple(rebuild)))
        self.__dict__.clear()  # drop the index and caches built with the old values
        self.__dict__.update(fresh.__dict__)
        if was_built:
            self._stale = stale
        return self

    def _require_built(self, action: str) -> None:
        """Raise ``RuntimeError`` unless the selector is built with its current parameters."""
        if self._stale:
            changed = ", ".join(self._stale)
            raise RuntimeError(f"selector {self.name!r}: build-time parameter(s) {changed} changed by "
                               f"set_params() after build(); call build(keys) again before {action}().")
        if self.keys_ is None:
            raise RuntimeError(f"selector {self.name!r} is not built: call build(keys) before {action}().")

    # ------------------------------------------------------------------------------------ metadata
    def __repr__(self) -> str:
        return spec_string(self)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can be imported, else why not (e.g. a missing optional package)."""
        if cls.requires is None:
            return None
        module, hint = cls.requires
        try:
            importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - the packages named by selectors are dependencies
            return f"{module} is not importable ({exc}); {hint}."
        return None

    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False, bias: bool = False) -> list[str]:
        """Reasons this configured selector cannot run on such input (empty list: supported).

        Every argument is optional; pass what is known (``build()`` passes ``n_keys`` and ``dim``).

        Parameters
        ----------
        n_keys : int, optional
            Number of keys S to be indexed (e.g. an IVF index needs at least ``nlist`` keys).
        dim : int, optional
            Key dimension E (e.g. PQ sub-quantizers must divide E).
        is_causal : bool, default False
            Whether queries will be causal.
        bias : bool, default False
            Whether an additive score bias will be applied to the selected scores (a selector that
            attends by itself may not support one).

        Returns
        -------
        list of str, one sentence per problem, each saying what to change.
        """
        reason = self.unavailable_reason()
        return [reason] if reason else []

    # ----------------------------------------------------------------------------------------- work
    def build(self: _S, keys: np.ndarray, *, check_finite: bool = True) -> _S:
        """Index the keys.

        Parameters
        ----------
        keys : float array, shape (S, E)
            float16 is upcast to float32; float64 stays float64.
        check_finite : bool, default True
            Reject NaN / inf keys.

        Returns
        -------
        ``self``, built (clears any "call build() again" state left by :meth:`set_params`).
        """
        kk = as_float_array(keys, "keys", min_ndim=2, check_finite=check_finite)
        if kk.ndim != 2:
            raise ValueError(f"keys must be 2-D (S, E) for a selector; got shape {kk.shape}. "
                             f"Build one selector per head.")
        reasons = self.not_supported_reasons(n_keys=kk.shape[0], dim=kk.shape[1])
        if reasons:
            raise ValueError(f"selector {self.name!r} cannot run here: {'; '.join(reasons)}")
        dtype = np.float64 if kk.dtype == np.float64 else np.float32
        keys_ = np.ascontiguousarray(kk, dtype=dtype)
        featureless = keys_.shape[1] == 0 and self._scores_by_content()
        if not featureless:
            self._check_index_range(keys_, "keys")
        self.keys_ = keys_
        self._stale = ()
        self._featureless = featureless
        if not featureless:  # E = 0: every score is 0, nothing for a backend to index (see the module notes)
            self._build(self.keys_)
        return self

    @classmethod
    def _scores_by_content(cls) -> bool:
        """Whether the selection depends on q.k (``metric`` an inner product), so E = 0 means all ties."""
        metric = None
        for c in cls.__mro__:  # the class attribute, not an instance property (a union's is per instance)
            if "metric" in c.__dict__:
                metric = c.__dict__["metric"]
                break
        return isinstance(metric, str) and metric.startswith("inner_product")

    def _check_query_range(self, q: np.ndarray) -> None:
        """ValueError for float64 queries whose squared norms overflow float64 (``|x| > 2**498``) at a selector
        with ``index_dtype``: it scores them without rescaling (any larger query row gave zeros).  Queries
        within that range go on to the score-overflow check."""
        if self.index_dtype is None or q.size == 0 or q.dtype != np.float64:
            return
        limit = math.ldexp(1.0, np.finfo(np.float64).maxexp // 2 - 14)
        big = float(np.abs(q).max())
        if big > limit:
            raise ValueError(f"queries has values of magnitude up to {big:.3g}; selector {self.name!r} needs "
                             f"|x| <= {limit:.3g} (so that squared norms stay finite in float64). Rescale the "
                             f"queries (multiplying the queries by c and the attention scale by 1/c leaves the "
                             f"softmax unchanged), or use topk, window, faiss-* or kdtree, which take any "
                             f"finite magnitude.")

    def _check_index_range(self, x: np.ndarray, name: str) -> None:
        """ValueError when ``x`` holds values outside the finite range of ``index_dtype``."""
        if self.index_dtype is None or x.size == 0:
            return
        info = np.finfo(self.index_dtype)
        limit = math.ldexp(1.0, info.maxexp // 2 - 14)  # float32: 2**50
        big = float(np.abs(x).max())
        if big > limit:
            raise ValueError(
                f"{name} has values of magnitude up to {big:.3g}, outside the {info.dtype} range "
                f"(|x| <= {limit:.3g}, so that squared norms stay finite) in which selector {self.name!r} "
                f"indexes the keys. Rescale the "
                f"{name} (multiplying the keys by c and the attention scale by 1/c leaves the softmax "
                f"unchanged), or use a selector that takes any float64 magnitude: topk or window (computed in "
                f"float64), or faiss-* / kdtree (which rescale before indexing).")

    def add(self: _S, new_keys: np.ndarray, *, check_finite: bool = True) -> _S:
        """Append keys to a built selector; their ids continue after the existing ones (``S, S + 1, ...``).

        Only selectors with ``supports_add = True`` implement it.

        Parameters
        ----------
        new_keys : float array, shape (N, E)
        check_finite : bool, default True

        Raises
        ------
        NotImplementedError
            This selector cannot grow in place (``supports_add`` is False).
        """
        raise NotImplementedError(f"selector {self.name!r} cannot add keys in place (supports_add is False); "
                                  f"call build() with all the keys instead.")

    def attend(self, queries: np.ndarray, values: np.ndarray, *, scale: float | None = None,
               is_causal: bool = False, query_positions: object = None, key_positions: object = None,
               check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Softmax attention of each query over the keys this selector picks, computed by the selector.

        Only selectors with ``attends`` true implement it; the others return patterns from
        :meth:`query`, to be used with :func:`sparseattn.sparse_attention`.

        Parameters
        ----------
        queries : float array, shape (L, E)
        values : float array, shape (S, Ev)
            One row per key given to :meth:`build`, in the same order.
        scale : float, optional
            Score scale (default ``1/sqrt(E)``).
        is_causal, query_positions, key_positions, check_finite
            As for :meth:`query`.

        Returns
        -------
        output : (L, Ev) array, float64 if any input is float64, else float32
        lse : (L,) array, same dtype: log-sum-exp of the scaled scores of each row's keys

        Raises
        ------
        NotImplementedError
            This selector does not attend by itself (``attends`` is False).
        """
        raise NotImplementedError(f"selector {self.name!r} does not compute attention itself (attends is "
                                  f"False); use query() to get a pattern and pass it to sparse_attention.")

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
        check_finite : bool, default True
            Reject NaN / inf queries.

        Returns
        -------
        SparsePattern with ``n_queries = L`` and ``n_keys = S``.

        Raises
        ------
        RuntimeError
            Not built, or a build-time parameter changed since :meth:`build`.
        """
        self._require_built("query")
        q = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
        if q.ndim != 2:
            raise ValueError(f"queries must be 2-D (L, E); got shape {q.shape}.")
        if q.shape[1] != self.keys_.shape[1]:
            raise ValueError(f"queries have E={q.shape[1]} features but the keys have {self.keys_.shape[1]}.")
        k = check_positive_int(k, "k")
        check_bool(is_causal, "is_causal")
        q = np.ascontiguousarray(q, dtype=self.keys_.dtype)
        if not getattr(self, "_featureless", False):
            self._check_query_range(q)
        L, S = q.shape[0], self.keys_.shape[0]
        qpos = positions(query_positions, L, "query_positions")
        kpos = positions(key_positions, S, "key_positions")
        if S == 0:  # nothing to select from: every row empty (attention over it gives zeros)
            return SparsePattern(np.zeros(L + 1, np.int64), np.zeros(0, np.int32), 0, validate=False)
        if self.fills_small_rows and k >= S:
            # Every row has at most k allowed keys, so the documented result is all of them: skip the
            # search (an index scan or a full top-k over S keys would only confirm it).
            full = SparsePattern.full(L, S)
            return full.causal(qpos, kpos) if is_causal else full
        if getattr(self, "_featureless", False):  # E = 0: all scores tie at 0 -> the k allowed keys of smallest id
            return first_allowed(L, S, k if self.fills_small_rows else S, bool(is_causal), qpos, kpos)
        pattern = self._query(q, k, bool(is_causal), qpos, kpos)
        if pattern.shape != (L, S):  # pragma: no cover - a selector bug, not a user error
            raise RuntimeError(f"selector {self.name!r} returned a pattern of shape {pattern.shape}, "
                               f"expected {(L, S)}.")
        if is_causal:
            pattern = pattern.causal(qpos, kpos)
        if self.fills_small_rows:
            pattern = fill_small_rows(pattern, k, bool(is_causal), qpos, kpos)
        return pattern

    @abstractmethod
    def _build(self, keys: np.ndarray) -> None:
        """Backend work on validated (S, E) float32/float64 C-contiguous keys."""

    @abstractmethod
    def _query(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
               kpos: np.ndarray) -> SparsePattern:
        """Return an (L, S) pattern; causal selectors should already respect positions."""


def first_allowed(L: int, S: int, k: int, is_causal: bool, qpos: np.ndarray, kpos: np.ndarray) -> SparsePattern:
    """Per query, the ``k`` allowed keys of smallest id: the top-k when every score ties (E = 0).

    Parameters
    ----------
    L, S : int
        Queries and keys.
    k : int
        Keys per query (``S``: every allowed key).
    is_causal : bool
        Key j is allowed for query i only when ``kpos[j] <= qpos[i]``; else every key is.
    qpos, kpos : int64 arrays, shapes (L,) and (S,)

    Returns
    -------
    SparsePattern (L, S) with ``min(k, allowed)`` keys per row.
    """
    kk = min(k, S)
    if not is_causal:
        ids = np.broadcast_to(np.arange(kk, dtype=np.int64), (L, kk))
        return SparsePattern.from_padded(np.ascontiguousarray(ids), S)
    ids = np.full((L, kk), -1, dtype=np.int64)
    if np.all(kpos[1:] >= kpos[:-1]):  # sorted positions: the allowed keys are a prefix of the ids
        n = np.minimum(np.searchsorted(kpos, qpos, side="right"), kk)
        cols = np.arange(kk, dtype=np.int64)
        ids = np.where(cols[None, :] < n[:, None], cols[None, :], -1)
    else:  # one scan of the keys per distinct query position
        for t in np.unique(qpos):
            first = np.flatnonzero(kpos <= t)[:kk]
            ids[np.ix_(qpos == t, np.arange(first.size))] = first
    return SparsePattern.from_padded(ids, S)


def _guard_add(add: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a subclass's ``add``: E = 0 selectors append without the backend; keys checked for range."""
    @functools.wraps(add)
    def guarded(self: Selector, new_keys: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_featureless", False):
            if self.index_dtype is not None:
                self._check_index_range(as_float_array(new_keys, "new_keys", min_ndim=0, check_finite=False),
                                        "new_keys")
            return add(self, new_keys, *args, **kwargs)
        self._require_built("add")
        nk = as_float_array(new_keys, "new_keys", min_ndim=2, check_finite=kwargs.get("check_finite", True))
        if nk.ndim != 2 or nk.shape[1] != 0:
            raise ValueError(f"new_keys must have shape (N, E=0) like the built keys; got {nk.shape}.")
        self.keys_ = np.concatenate([self.keys_, nk.astype(self.keys_.dtype)])
        return self
    return guarded


def _guard_attend(attend: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a subclass's ``attend``: with E = 0 every score is 0, so it is the mean of the allowed values."""
    @functools.wraps(attend)
    def guarded(self: Selector, queries: np.ndarray, values: np.ndarray, *, scale: float | None = None,
                is_causal: bool = False, query_positions: object = None, key_positions: object = None,
                check_finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
        if not getattr(self, "_featureless", False):
            self._check_query_range(as_float_array(queries, "queries", min_ndim=0, check_finite=False))
            return attend(self, queries, values, scale=scale, is_causal=is_causal,
                          query_positions=query_positions, key_positions=key_positions,
                          check_finite=check_finite)
        return _featureless_attend(self, queries, values, scale, is_causal, query_positions, key_positions,
                                   check_finite)
    return guarded


def _featureless_attend(sel: Selector, queries: np.ndarray, values: np.ndarray, scale: Any, is_causal: bool,
                        query_positions: object, key_positions: object, check_finite: bool
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention with E = 0 (every score 0): the mean of the allowed values, ``lse = log(count)``."""
    sel._require_built("attend")
    q = as_float_array(queries, "queries", min_ndim=2, check_finite=check_finite)
    v = as_float_array(values, "values", min_ndim=2, check_finite=check_finite)
    S = sel.keys_.shape[0]
    if q.ndim != 2 or q.shape[1] != 0:
        raise ValueError(f"queries must have shape (L, E=0) like the built keys; got {q.shape}.")
    if v.ndim != 2 or v.shape[0] != S:
        raise ValueError(f"values must have shape (S={S}, Ev), one row per built key; got {v.shape}.")
    check_scale(scale, 0)
    check_bool(is_causal, "is_causal")
    L = q.shape[0]
    qpos = positions(query_positions, L, "query_positions")
    kpos = positions(key_positions, S, "key_positions")
    dtype = np.float64 if np.float64 in (q.dtype, v.dtype, sel.keys_.dtype) else np.float32
    order = np.argsort(kpos, kind="stable")
    csum = np.zeros((S + 1, v.shape[1]))
    np.cumsum(v[order].astype(np.float64), axis=0, out=csum[1:])
    count = np.searchsorted(kpos[order], qpos, side="right") if is_causal else np.full(L, S)
    seen = count > 0
    out = np.where(seen[:, None], csum[count] / np.maximum(count, 1)[:, None], 0.0)
    lse = np.where(seen, np.log(np.maximum(count, 1).astype(np.float64)), -np.inf)
    return out.astype(dtype), lse.astype(dtype)


def fill_small_rows(pattern: SparsePattern, k: int, is_causal: bool, qpos: np.ndarray,
                    kpos: np.ndarray) -> SparsePattern:
    """Union each row that has at most k allowed keys with all of them (the documented k >= S rule).

    Parameters
    ----------
    pattern : SparsePattern, shape (L, S)
    k : int
        The per-query budget.
    is_causal : bool
        Whether key j is allowed for query i only when ``kpos[j] <= qpos[i]`` (else all S keys are).
    qpos, kpos : int64 arrays, shapes (L,) and (S,)
        Query and key positions.

    Returns
    -------
    SparsePattern (L, S): ``pattern`` with every row that has between 1 and k allowed keys completed to
    all of them (non-causal: the full pattern when ``k >= S``, else ``pattern`` unchanged).
    """
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

    Magnitudes: keys whose largest ``|value|`` lies outside ``[2**-40, 2**40]`` are scaled by
    ``2**-key_exp_`` (exact, the same for every key: no ranking changes) before centring, so the index
    holds values of magnitude < 2 (``centered_`` is then in those units; ``key_exp_`` is 0 otherwise).
    Likewise each query row outside that range is scaled by its own power of two before the backend
    searches (the same factor for all keys of that query).  So backends computing in float32 (FAISS) or
    squaring norms (the kd-tree lift) see no overflow or underflow for any finite float64 input, and the
    candidates are re-ranked exactly on the original keys and queries.
    """

    causal_block: ClassVar[int] = 1024
    rerank: ClassVar[bool] = True
    index_dtype: ClassVar[Any] = None  # any finite magnitude: rescaled into range (see above)

    def _build(self, keys: np.ndarray) -> None:
        self._blocks: dict[tuple[int, int], Any] = {}
        center = self._params.get("center", True)
        self.key_exp_ = scale_exponent(keys)
        if keys.shape[0] == 0:  # no index over nothing (FAISS cannot train or search an empty index)
            self.mean_ = np.zeros(keys.shape[1], keys.dtype)
            self._mean_scaled = np.zeros(keys.shape[1])
            self.centered_ = keys
            self.index_ = None
            return
        if self.key_exp_ == 0:
            self.mean_ = keys.mean(axis=0, dtype=np.float64).astype(keys.dtype) if center \
                else np.zeros(keys.shape[1], keys.dtype)
            self._mean_scaled = self.mean_.astype(np.float64)
        else:
            scaled = np.ldexp(keys.astype(np.float64), -self.key_exp_)  # |scaled| < 1, exact
            self._mean_scaled = scaled.mean(axis=0) if center else np.zeros(keys.shape[1])
            self.mean_ = np.ldexp(self._mean_scaled, self.key_exp_).astype(keys.dtype)
        self.centered_ = self._to_index_space(keys)
        self.index_ = self._make_index(self.centered_)

    def _to_index_space(self, keys: np.ndarray) -> np.ndarray:
        """Keys (n, E) -> the centred (and, when ``key_exp_`` != 0, scaled) keys the index holds."""
        if self.key_exp_ == 0:
            center = self._params.get("center", True)
            return np.ascontiguousarray(keys - self.mean_) if center else keys
        scaled = np.ldexp(keys.astype(np.float64), -self.key_exp_) - self._mean_scaled
        return np.ascontiguousarray(scaled, dtype=keys.dtype)

    @staticmethod
    def _index_queries(q: np.ndarray) -> np.ndarray:
        """Queries for the backend: each row outside ``[2**-40, 2**40]`` scaled by its own power of two."""
        if q.size == 0:
            return q
        big = np.abs(q).max(axis=1).astype(np.float64)
        out = (big != 0) & ((big < _SAFE_LO) | (big > _SAFE_HI))
        if not out.any():
            return q
        exp = np.where(out, np.frexp(big)[1], 0)
        return np.ascontiguousarray(np.ldexp(q.astype(np.float64), -exp[:, None]), dtype=q.dtype)

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
            cand = self._candidates(self._index_queries(q), min(k, S))
            if self.rerank:
                _, ids = rerank_topk(q, self.keys_, cand, k, False)
            else:
                ids = cand
            return SparsePattern.from_padded(ids, S)
        return SparsePattern.from_padded(self._causal_ids(q, k, qpos, kpos), S)

    def _block_index(self, level: int, t: int) -> Any:
        key = (level, t)
        if key not in self._blocks:
            size = self.causal_block << level
            self._blocks[key] = self._make_index(self._block_space(t * size, (t + 1) * size))
        return self._blocks[key]

    def _block_space(self, lo: int, hi: int) -> np.ndarray:
        """Keys ``[lo, hi)`` as a causal block's index holds them, (hi - lo, E) in the keys' dtype.

        Centred by the block's *own* mean and scaled by its *own* power of two (the rules of
        :meth:`_build`, applied to the block alone), so a block index is a function of its keys only:
        causal search never depends on keys after a query's prefix.  Both shifts are exact for the
        ranking inside the block (a per-query constant, one factor for all its keys), and each block's
        candidates are re-ranked exactly on the original keys.
        """
        keys = self.keys_[lo:hi]
        center = self._params.get("center", True)
        exp = scale_exponent(keys)
        if exp == 0:
            if not center or keys.shape[0] == 0:
                return keys
            return np.ascontiguousarray(keys - keys.mean(axis=0, dtype=np.float64).astype(keys.dtype))
        scaled = np.ldexp(keys.astype(np.float64), -exp)  # |scaled| < 1, exact
        if center:
            scaled -= scaled.mean(axis=0)
        return np.ascontiguousarray(scaled, dtype=keys.dtype)

    def _causal_ids(self, q: np.ndarray, k: int, qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
        if np.any(np.diff(kpos) < 0):
            raise ValueError("causal search with an index needs key_positions sorted ascending; "
                             "sort the keys by position first.")
        B = self.causal_block
        L = q.shape[0]
        q_index = self._index_queries(q)  # what the block indexes search with (exact tail and re-rank: q)
        prefix = np.searchsorted(kpos, qpos, side="right").astype(np.int64)  # allowed keys [0, c)
        n_full = prefix // B  # whole blocks before the exact tail
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
            kk = min(k, hi - lo)
            top_s = np.empty((rows.size, kk), dtype=s.dtype)
            top_i = np.empty((rows.size, kk), dtype=np.int64)
            key_ids = np.arange(lo, hi, dtype=np.int64)  # a key's id is also its rank in position order
            block_topk(s, kk, True, prefix[rows] - 1, key_ids, key_ids, top_s, top_i, ORDER_NONE, False)
            tail[rows, :kk] = top_i
        pieces.append(tail)
        # Dyadic blocks covering [0, B*floor(c/B)): a binary decomposition of the rest of the prefix.
        for level, blocks in dyadic_cover(n_full * B, B):
            found: list[tuple[np.ndarray, np.ndarray]] = []
            for t, rows in blocks:
                index = self._block_index(level, t)
                _, ids = self._search(index, q_index[rows], min(k, B << level))
                ids = np.asarray(ids, dtype=np.int64)
                offset = t * (B << level)
                found.append((rows, np.where(ids >= 0, ids + offset, -1)))
            # Backends may return more than k candidates (e.g. for their own re-rank): size by the widest.
            pieces.append(scatter_rows(found, L))
        cand = np.concatenate(pieces, axis=1)
        _, ids = rerank_topk(q, self.keys_, cand, k, False)
        return ids

