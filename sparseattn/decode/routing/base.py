"""The routing-strategy interface of the decode cache: which keys beyond the exact part a step reads.

A strategy owns whatever index it keeps over the store's keys (cluster statistics, page bounds, an
index selector) and keeps it in step with the store through the hooks below; the cache calls them at
the right moments.  Each step it turns the queries into a :class:`~sparseattn.decode.plan.StepPlan`
(:meth:`Routing.plan`), which the decode kernel runs, and :meth:`Routing.selected` replays the same
choice for one query in numpy (for measuring recall).  A new index is one new subclass registered with
:func:`register_routing`.

Adding an index: subclass :class:`Routing`, keep the index in step through the hooks (``committed`` for
new slots, ``evict`` / ``compaction_sources`` / ``compacted`` under a memory cap, ``grown``), and return
from :meth:`Routing.plan` either a ``MODE_LIST`` plan (the slots each row reads, -1 padded: any index
that names keys) or a ``MODE_CLUSTER`` / ``MODE_MASS`` plan over cluster arrays (contiguous slot ranges
with routing vectors and per-cluster statistics, which also enables the estimation zone); register it
with :func:`register_routing` under its selector name.  The kernel, the store and the eviction policies
need no change.

Capabilities are declared, not discovered: ``supports`` lists the cache options a strategy honours
(``"n_probe"``, ``"estimate"``, ``"top_p"``, ``"k"``), ``any_cache`` marks strategies that need no
index of their own (usable as a per-call override on any cache), and :meth:`Routing.not_supported_reasons`
says why a configuration cannot run.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..config import CacheConfig
from ..plan import StepPlan
from ..store import EVICTED, SlotStore

__all__ = ["Routing", "register_routing", "routing_classes"]

_REGISTRY: dict[str, type[Routing]] = {}
_ORDER = ("cluster", "sketch", "pages", "window", "topk", "dense")  # as error messages list them


def register_routing(cls: type[Routing]) -> type[Routing]:
    """Class decorator: make ``cls`` the strategy of ``selector=cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"routing {cls.name!r} is registered twice: {_REGISTRY[cls.name].__qualname__} and "
                         f"{cls.__qualname__}.")
    _REGISTRY[cls.name] = cls
    return cls


def routing_classes() -> dict[str, type[Routing]]:
    """Registered built-in strategies by selector name (the built-in ones first, in a fixed order)."""
    rank = {n: i for i, n in enumerate(_ORDER)}
    return dict(sorted(_REGISTRY.items(), key=lambda item: rank.get(item[0], len(rank))))


class Routing:
    """A decode routing strategy over a :class:`~sparseattn.decode.store.SlotStore`."""

    name: ClassVar[str] = ""
    #: cache options the strategy honours
    supports: ClassVar[frozenset[str]] = frozenset()
    #: default ``n_probe`` of a cache using it
    default_probe: ClassVar[int] = 0
    #: needs no index of its own: works as a per-call override on any cache
    any_cache: ClassVar[bool] = False
    #: slots after the sinks hold their keys in position order (streaming eviction then takes the next slots)
    position_order: ClassVar[bool] = True

    def __init__(self, cfg: CacheConfig, store: SlotStore) -> None:
        self.cfg = cfg
        self.store = store

    @classmethod
    def not_supported_reasons(cls, cfg: CacheConfig) -> list[str]:
        """Reasons ``cfg`` cannot run with this strategy (empty: supported)."""
        out = []
        if cfg.estimate and "estimate" not in cls.supports:
            out.append(f"estimate={cfg.estimate} needs a strategy that estimates clusters")
        if cfg.top_p is not None and "top_p" not in cls.supports:
            out.append(f"top_p={cfg.top_p} needs a strategy that ranks clusters by mass")
        return out

    # ------------------------------------------------------------------ hooks (the store changed)
    def grown(self, cap: int) -> None:
        """The store's capacity grew to ``cap`` slots."""

    def committed(self, a: int, b: int) -> None:
        """Slots [a, b) were appended."""

    def evict(self, kill: np.ndarray) -> None:
        """Evict slots ``kill[g]`` (H_kv, e) of every kv head: their position becomes ``EVICTED``."""
        for g in range(self.store.num_kv_heads):
            self.store.pos[g, kill[g]] = EVICTED

    def compaction_sources(self, live: np.ndarray) -> list[np.ndarray]:
        """Per kv head, the source slot of each slot after the sinks once compacted (see
        :meth:`SlotStore.compact`); ``live`` (H_kv, slots) bool.  Updates the strategy's own layout."""
        s0 = self.store.s0
        return self.store.plain_sources(live, s0, self.store.slots)[1]

    def compacted(self) -> None:
        """Slots moved (after :meth:`SlotStore.compact`)."""

    # ------------------------------------------------------------------------------------ layout
    def tail_start(self) -> int:
        """First slot of the exact tail (keys the strategy has not indexed)."""
        return self.store.s0

    def region_starts(self) -> list[int]:
        """First slots of the regions whose keys are not in position order (streaming's scan)."""
        return []

    # ------------------------------------------------------------------------------------- a step
    def plan(self, q: np.ndarray, qpos: np.ndarray, k: int) -> StepPlan:
        """The step of queries ``q`` (H, T, E) float32 at positions ``qpos`` (T,) int64; ``k`` the budget of
        strategies that honour ``"k"``."""
        raise NotImplementedError

    def max_tokens(self, num_heads: int) -> int | None:
        """Query tokens one plan may hold (None: any number); the cache runs longer calls in blocks."""
        return None

    def token_blocks(self, qpos: np.ndarray, num_heads: int) -> list[tuple[int, int]]:
        """Token ranges ``[a, b)`` of the queries at ``qpos`` (T,) int64, ascending, each planned on its own:
        blocks of at most :meth:`max_tokens` tokens, cut where :meth:`straddle_ids` changes."""
        T = qpos.shape[0]
        if T == 1:  # a decode step
            return [(0, 1)]
        step = self.max_tokens(num_heads) or T
        cuts = set(range(0, T, step))
        cuts |= set((np.flatnonzero(np.diff(self.straddle_ids(qpos))) + 1).tolist())
        edges = sorted(cuts | {T})
        return list(zip(edges[:-1], edges[1:], strict=True))

    def straddle_ids(self, qpos: np.ndarray) -> np.ndarray:
        """Per position of ``qpos`` (T,) int64, the index of the indexed region (a segment, a page) holding
        keys both at or before it and after it, or -1: a row must not rank through such a region (its
        summary was made with keys the row may not see); rows with the same index share a plan.  (T,)
        int64; the default: no region."""
        return np.full(qpos.shape[0], -1, np.int64)

    def selected(self, q: np.ndarray, g: int, k: int) -> list[np.ndarray]:
        """Slots (unsorted parts, may repeat or hold evicted slots) the step of one query ``q`` (E,) float32
        of kv head ``g`` at the newest position reads."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------- report
    def index_nbytes(self) -> int:
        """Bytes the strategy keeps beyond the store."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Counters the strategy adds to ``KVCache.stats``."""
        return {}

    def debug_arrays(self) -> dict[str, Any]:
        """Read-only views of the strategy's arrays (for tests and benchmarks; layout may change)."""
        return {}
