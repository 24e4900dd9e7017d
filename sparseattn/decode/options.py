"""The grouped options of :class:`sparseattn.KVCache`: which keys are always exact and which survive a
memory cap (:class:`Retention`), how keys are grouped for routing (:class:`Layout`), and how many keys a
step reads beyond the exact ones (:class:`Budget`).

Each group is a frozen dataclass of plain values; :class:`~sparseattn.KVCache` validates them (a bad
value is refused naming the field).  The flat keywords these replace (``KVCache(segment=...)``) are still
accepted for one release, with a ``DeprecationWarning`` naming the group to use.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Budget", "Layout", "Retention", "group_options", "resolve_options"]


@dataclass(frozen=True)
class Retention:
    """Which keys a step always reads exactly, and which survive a memory cap.

    Parameters
    ----------
    sinks : int, default 4
        The first ``sinks`` positions are always attended exactly (and never evicted).
    window : int, default 64
        The newest ``window`` positions are always attended exactly (and never evicted).
    max_keys : int, optional
        Memory cap in keys: at most ``max_keys`` keys stay attendable (``policy`` says which); >= ``sinks +
        window``.  None: no cap.
    policy : {"streaming", "h2o"}, default "streaming"
        Which keys the cap keeps besides sinks and window: the newest (``"streaming"``) or those with the
        largest accumulated attention weight (``"h2o"``); see :mod:`sparseattn.decode`.
    """

    sinks: int = 4
    window: int = 64
    max_keys: int | None = None
    policy: str = "streaming"


@dataclass(frozen=True)
class Layout:
    """How the cache groups its keys for routing (clustered segments, Quest pages).

    Parameters
    ----------
    segment : int, default 4096
        Keys clustered together once the tail holds ``segment + window`` keys (multiple of
        ``page_size``; 4,096-16,384 recommended).  The exact tail averages ``segment / 2 + window`` keys.
    open_step : int, optional
        Granularity of the open segment (default ``segment // 2``): once the tail holds ``open_step +
        window`` keys beyond it, the open (newest, not yet full) segment is re-clustered with them, so the
        exact tail stays below ``open_step + window`` keys; ``open_step = segment`` turns it off.  Each
        re-clustering runs a k-means over the whole open segment, so a small ``open_step`` multiplies the
        append cost (up to ``segment / open_step`` k-means runs per segment instead of about two).
    cluster_size : int, default 64
        Mean keys per cluster: each segment gets ``segment // cluster_size`` clusters.
    page_size : int, default 16
        Keys per page of the ``"pages"`` selector.
    seed : int, default 0
        Seed of the k-means of every segment (the same keys always give the same clusters).
    """

    segment: int = 4096
    open_step: int | None = None
    cluster_size: int = 64
    page_size: int = 16
    seed: int = 0


@dataclass(frozen=True)
class Budget:
    """How many keys a step reads beyond the exact sinks and window (``"cluster"`` and ``"pages"``; the
    ``"sketch"`` selector's budget is its spec, ``"sketch:candidates=N"``).

    Parameters
    ----------
    n_probe : int, optional
        Clusters (``"cluster"``, default 32) or pages (``"pages"``, default 128) read per query; the other
        selectors refuse it.
    estimate : int, default 0
        ``"cluster"`` only: clusters per query estimated from their statistics after the routed ones
        (the estimation zone, see :mod:`sparseattn.decode`); 0 = off.
    top_p : float in (0, 1], optional
        ``"cluster"`` only: a mass-driven budget instead of ``n_probe``; 1.0 reads every cluster with a
        visible key (within ``top_p_max_keys``).
    top_p_min_keys : int, default 0
        ``top_p`` only: floor of routed keys read per query.
    top_p_max_keys : int, optional
        ``top_p`` only: cap of routed keys read per query (default: none, so ``top_p`` alone decides); the
        walk stops before a cluster that would pass it, and ``stats["top_p_capped"]`` counts the rows it
        stopped short of their goal.
    """

    n_probe: int | None = None
    estimate: int = 0
    top_p: float | None = None
    top_p_min_keys: int = 0
    top_p_max_keys: int | None = None


_GROUPS: dict[str, type] = {"retention": Retention, "layout": Layout, "budget": Budget}
_GROUP_OF = {f.name: name for name, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


def resolve_options(groups: dict[str, Any], legacy: dict[str, Any]) -> dict[str, Any]:
    """The flat option values of the three groups: ``groups`` maps "retention" / "layout" / "budget" to an
    instance (or None: the defaults); ``legacy`` holds flat keywords (deprecated), each applied to its group
    with a ``DeprecationWarning``.  TypeError for an unknown keyword or a group of the wrong type;
    ValueError when a flat keyword and its group are both given."""
    for name in legacy:
        if name not in _GROUP_OF:
            raise TypeError(f"KVCache() got an unexpected keyword argument {name!r}; the options are grouped as "
                            f"retention=Retention(...), layout=Layout(...) and budget=Budget(...).")
    out: dict[str, Any] = {}
    for gname, cls in _GROUPS.items():
        obj = groups.get(gname)
        if obj is not None and not isinstance(obj, cls):
            raise TypeError(f"{gname} must be a sparseattn.{cls.__name__} (or None); got {type(obj).__name__}.")
        flat = {k: v for k, v in legacy.items() if _GROUP_OF[k] == gname}
        if flat:
            if obj is not None:
                raise ValueError(f"pass {', '.join(sorted(flat))} inside {gname}={cls.__name__}(...), not both as "
                                 f"keywords and {gname}=.")
            args = ", ".join(f"{k}={v!r}" for k, v in flat.items())
            warnings.warn(f"KVCache({args}) is deprecated and will be removed in the next release; pass "
                          f"{gname}={cls.__name__}({args}).", DeprecationWarning, stacklevel=3)
            obj = cls(**flat)
        out.update(dataclasses.asdict(obj if obj is not None else cls()))
    return out


def group_options(options: Mapping[str, Any] | None = None, /, **more: Any) -> dict[str, Any]:
    """KVCache keywords from flat options kept as data (a JSON config, a CLI flag, a benchmark setting).

    ``options`` and ``more`` (merged, ``more`` winning) may hold any :class:`~sparseattn.KVCache` keyword;
    the fields of :class:`Retention`, :class:`Layout` and :class:`Budget` are gathered into instances under
    ``retention`` / ``layout`` / ``budget``, the other keys pass through unchanged, so
    ``KVCache(H, E, **group_options({"selector": "cluster", "n_probe": 64}))`` is
    ``KVCache(H, E, selector="cluster", budget=Budget(n_probe=64))``.  A group given whole and one of its
    fields given flat at once is refused (ValueError naming both).
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of KVCache keywords (or None); got {type(options).__name__}.")
    flat = {**(options or {}), **more}
    out = {k: v for k, v in flat.items() if k not in _GROUP_OF}
    for gname, cls in _GROUPS.items():
        fields = {k: v for k, v in flat.items() if _GROUP_OF.get(k) == gname}
        if fields and out.get(gname) is not None:
            raise ValueError(f"pass {', '.join(sorted(fields))} inside {gname}={cls.__name__}(...), not both.")
        if fields:
            out[gname] = cls(**fields)
    return out
