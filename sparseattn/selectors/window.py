"""Structural selectors: sliding window, attention sinks and random keys (BigBird's three patterns).

They ignore the key *contents* and choose keys by position only, so they are exact by construction and
cheap (no scoring).  Typical use is in a union with a content-based selector:
``get_selector("window:width=128+sinks:g=4+faiss-hnsw")``.

Positions follow :meth:`sparseattn.selectors.base.Selector.query`: ``query_positions`` (L,) and
``key_positions`` (S,) are integers, default ``arange``.  Key positions may be arbitrary (gaps, any order,
repeats); everything below is defined in *position space*.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import pattern_ops, structural
from ..pattern import SparsePattern
from .base import Selector
from .params import Param, positive
from .registry import register

__all__ = ["RandomSelector", "SinksSelector", "WindowSelector"]


def _is_consecutive(pos: np.ndarray) -> bool:
    """True when ``pos == pos[0] + arange(len(pos))`` (the common layout of keys in a sequence)."""
    return pos.size == 0 or (int(pos[-1]) - int(pos[0]) == pos.size - 1 and bool(np.all(np.diff(pos) == 1)))


def _sorted_positions(kpos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted positions, stable order) with ``sorted == kpos[order]``; no copy work for sorted input."""
    if kpos.size < 2 or bool(np.all(np.diff(kpos) >= 0)):
        return kpos, np.arange(kpos.size, dtype=np.int64)
    order = np.argsort(kpos, kind="stable").astype(np.int64)
    return np.ascontiguousarray(kpos[order]), order


class _PositionalSelector(Selector):
    """Base of the structural selectors: keys chosen by position only, so nothing to build."""

    fills_small_rows = False  # positional: k is not its budget (see each selector's docstring)
    metric = "position"

    def _build(self, keys: np.ndarray) -> None:
        pass


# -------------------------------------------------------------------------------------------- window
@register
class WindowSelector(_PositionalSelector):
    """Sliding window in position space.

    With ``w = width`` (or ``k`` when ``width`` is None) and dilation ``d``, query i at position
    ``p = query_positions[i]`` selects every key whose position is ``p + t*d`` for an integer t in

    * causal (``is_causal=True``): ``t in [-(w - 1), 0]`` -- the w keys ending at the query's position;
    * bidirectional: ``t in [-(w // 2), w - 1 - w // 2]`` -- centred, like :meth:`SparsePattern.window`.

    When key positions are consecutive (``key_positions = c + arange(S)``, the usual case) this is a band
    of key ids, built by the band kernel in O(L*w) with exactly :meth:`SparsePattern.window`'s result for
    ``query_positions = key_positions = arange``.  For general key positions the keys are sorted by
    position once and each row is a binary-searched position range (O(L*(log S + w))); rows then hold
    fewer than w keys where positions have gaps, and more where several keys share a position.

    Examples
    --------
    >>> import numpy as np
    >>> sel = WindowSelector(width=3).build(np.zeros((5, 2), np.float32))
    >>> sel.query(np.zeros((5, 2), np.float32), is_causal=True).row(3).tolist()
    [1, 2, 3]
    """

    name = "window"
    guarantee = ("exact: query at position p selects exactly the keys at positions p + t*dilation for t in "
                 "the window (causal: the width positions ending at p; bidirectional: centred on p)")
    params_spec = {
        "width": Param(int, None, "keys per window (None: use the query budget k)", positive, when="query"),
        "dilation": Param(int, 1, "stride between window positions", positive, when="query"),
    }

    def window_offsets(self, k: int, is_causal: bool) -> tuple[int, int]:
        """(before, after): the window covers ``t in [-before, after]`` steps of ``dilation``."""
        w = self._params["width"] if self._params["width"] is not None else k
        if is_causal:
            return w - 1, 0
        before = w // 2
        return before, w - 1 - before

    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        L, S = q.shape[0], kpos.shape[0]
        before, after = self.window_offsets(k, is_causal)
        dil = self._params["dilation"]
        if S == 0 or L == 0:
            return SparsePattern(np.zeros(L + 1, np.int64), np.zeros(0, np.int32), S, validate=False)
        if _is_consecutive(kpos):
            if _is_consecutive(qpos):
                return SparsePattern.band(L, S, before=before, after=after, dilation=dil,
                                          offset=int(qpos[0]) - int(kpos[0]))
            reach = S + L + int(np.abs(qpos - kpos[0]).max())  # beyond this no key can be hit
            centers = np.ascontiguousarray(qpos - kpos[0])
            ptr, idx = pattern_ops.band(L, S, centers, min(before, reach), min(after, reach), dil)
            return SparsePattern(ptr, idx, S, validate=False)
        sorted_pos, order = _sorted_positions(kpos)
        # Offsets in position units, clipped to the span of positions (same result, no overflow).
        span = int(max(qpos.max(), sorted_pos[-1]) - min(qpos.min(), sorted_pos[0]))
        lo_off = min(before * dil, span)
        hi_off = min(after * dil, span)
        ptr, idx = structural.window_by_position(qpos, sorted_pos, order, lo_off, hi_off, dil)
        return SparsePattern(ptr, idx, S, validate=False)


# --------------------------------------------------------------------------------------------- sinks
def _parse_positions(value: Any) -> str | None:
    """Normalise ``positions`` (int, sequence of ints, or "0;5;9") to the canonical "0;5;9" string."""
    if value is None:
        return None
    if isinstance(value, str):
        items = [x.strip() for x in value.replace(",", ";").split(";") if x.strip()]
        out = []
        for x in items:
            try:
                out.append(int(x))
            except ValueError:
                raise ValueError(f"sinks: parameter positions must be integers separated by ';' "
                                 f"(e.g. '0;5;9'); got {value!r}.") from None
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        out = [int(value)]
    elif isinstance(value, (list, tuple, np.ndarray)):
        out = []
        for x in np.asarray(value, dtype=object).ravel():
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise TypeError(f"sinks: parameter positions must hold integers; got {x!r} in {value!r}.")
            out.append(int(x))
    else:
        raise TypeError(f"sinks: parameter positions must be an int, a list/tuple of ints or a string "
                        f"like '0;5;9'; got {value!r} ({type(value).__name__}).")
    if not out:
        raise ValueError(f"sinks: parameter positions must list at least one position; got {value!r}.")
    return ";".join(str(p) for p in sorted(set(out)))


@register
class SinksSelector(_PositionalSelector):
    """Attention sinks: every query attends to a fixed set of keys.

    Either the ``g`` keys with the smallest positions (ties: lower id first; with the default
    ``arange`` positions these are keys ``0 .. g-1``), or, when ``positions`` is given, every key whose
    position is in that set.  ``positions`` accepts a list/tuple of ints from Python or ``"0;5;9"`` in a
    spec string (``"sinks:positions=0;5;9"``); give either ``g`` or ``positions``, not both.
    ``k`` is ignored.  The causal filter of the base class still applies: a sink after the query's
    position is dropped from that row.
    """

    name = "sinks"
    guarantee = ("exact: every query selects exactly the sink keys (the g lowest key positions, or the keys "
                 "at the given positions) that are not after it")
    params_spec = {
        "g": Param(int, 4, "number of sink keys: the g lowest key positions", positive, when="query"),
        "positions": Param(str, None, "explicit sink key positions, e.g. '0;5;9' (overrides g)",
                           when="query"),
    }

    def __init__(self, **params: Any) -> None:
        if params.get("positions") is not None:
            if params.get("g") is not None:
                raise ValueError(f"sinks: give either g or positions, not both; got g={params['g']!r} and "
                                 f"positions={params['positions']!r}.")
            params = dict(params, positions=_parse_positions(params["positions"]))
        super().__init__(**params)
        if self._params["positions"] is not None:
            self._params["g"] = None  # not in force; keeps spec_string round-trippable

    def _merge_params(self, current: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
        """``g`` and ``positions`` exclude each other: setting one (not None) clears the other."""
        merged = {**current, **changes}
        if changes.get("g") is not None and "positions" not in changes:
            merged["positions"] = None
        if merged.get("g") is None or (changes.get("positions") is not None and "g" not in changes):
            merged.pop("g", None)  # not in force (or the default 4 when positions is cleared too)
        return merged

    @property
    def sink_positions(self) -> np.ndarray | None:
        """The explicit sink positions (int64, sorted), or None when ``g`` is used."""
        text = self._params["positions"]
        return None if text is None else np.array([int(x) for x in text.split(";")], dtype=np.int64)

    def sink_ids(self, kpos: np.ndarray) -> np.ndarray:
        """Sorted int32 ids of the sink keys for these key positions."""
        explicit = self.sink_positions
        if explicit is None:
            g = min(self._params["g"], kpos.size)
            ids = np.argsort(kpos, kind="stable")[:g]
        else:
            ids = np.nonzero(np.isin(kpos, explicit))[0]
        return np.sort(ids).astype(np.int32)

    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        L, S = q.shape[0], kpos.shape[0]
        ids = self.sink_ids(kpos)
        indptr = np.arange(L + 1, dtype=np.int64) * ids.size
        return SparsePattern(indptr, np.tile(ids, L), S, validate=False)


# -------------------------------------------------------------------------------------------- random
@register
class RandomSelector(_PositionalSelector):
    """BigBird-style random keys: each query gets ``n_random`` distinct keys drawn uniformly.

    The draw is among the keys the query may see -- all S keys, or with ``is_causal=True`` those with
    ``key_positions[j] <= query_positions[i]`` -- so causal rows are never emptied by the causal filter;
    rows with fewer allowed keys hold all of them.  ``n_random=None`` uses the query budget ``k``.

    Reproducible: the sample of a query depends only on ``(seed, its position, its allowed keys)`` --
    not on thread count, row order or how the queries are batched (a decoding step at position p draws
    the same keys as row p of a full pass).  Queries sharing a position therefore share their sample.
    Built in Numba (Floyd's algorithm, SplitMix64): O(n_random) per query.
    """

    name = "random"
    metric = "none (uniform sample)"
    guarantee = ("exact sampling: each query gets min(n_random, allowed) distinct keys, every such subset of "
                 "its allowed keys equally likely; deterministic given seed and positions")
    params_spec = {
        "n_random": Param(int, None, "random keys per query (None: use the query budget k)", positive,
                          when="query"),
        "seed": Param(int, 0, "random seed (any integer)", when="query"),
    }

    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        S = kpos.shape[0]
        n = self._params["n_random"] if self._params["n_random"] is not None else k
        if is_causal:
            sorted_pos, order = _sorted_positions(kpos)
            allowed = np.searchsorted(sorted_pos, qpos, side="right").astype(np.int64)
        else:
            order = np.arange(S, dtype=np.int64)
            allowed = np.full(qpos.shape[0], S, dtype=np.int64)
        seed = np.uint64(self._params["seed"] % (1 << 64))
        ptr, idx = structural.random_rows(allowed, order, int(min(n, max(S, 1))), seed, qpos)
        return SparsePattern(ptr, idx, S, validate=False)
