"""Validated options of a decode cache: layout, routing and memory policy, checked once."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..inputs import check_bool, check_positive_int, check_scale
from .store import INT32_MAX

__all__ = ["MAX_SEGMENT", "POLICIES", "CacheConfig"]

POLICIES = ("streaming", "h2o")
MAX_SEGMENT = 1 << 24  # keys clustered at once per segment (one k-means)


class CacheConfig:
    """The keyword options of :class:`sparseattn.KVCache`, validated (see its docstring for each).

    ``routing_cls`` is the routing strategy class the selector names; options a strategy does not
    support (``estimate``, ``top_p``) are refused naming the selector.
    """

    def __init__(self, num_heads: int, head_dim: int, *, num_kv_heads: int | None, value_dim: int | None,
                 selector: Any, routing_cls: type, dtype: object, sinks: int, window: int,
                 max_keys: int | None, policy: str, segment: int, open_step: int | None,
                 n_probe: int | None, estimate: int, top_p: float | None, top_p_min_keys: int,
                 top_p_max_keys: int | None, cluster_size: int, page_size: int, scale: float | None,
                 seed: int, parallel: bool | None) -> None:
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else check_positive_int(
            num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention.")
        self.value_dim = self.head_dim if value_dim is None else check_positive_int(value_dim, "value_dim")
        self.selector = selector
        self.dtype = dtype
        big = INT32_MAX - 1  # counts of keys or positions: int32
        self.sinks = check_positive_int(sinks, "sinks", minimum=0, maximum=big)
        self.window = check_positive_int(window, "window", minimum=0, maximum=big)
        self.page_size = check_positive_int(page_size, "page_size", maximum=MAX_SEGMENT)
        self.segment = check_positive_int(segment, "segment", minimum=self.page_size, maximum=MAX_SEGMENT)
        if self.segment % self.page_size:
            raise ValueError(f"segment ({self.segment}) must be a multiple of page_size ({self.page_size}).")
        self.cluster_size = check_positive_int(cluster_size, "cluster_size", maximum=MAX_SEGMENT)
        self.open_step = self.segment // 2 if open_step is None else check_positive_int(open_step, "open_step")
        if self.open_step > self.segment:
            raise ValueError(f"open_step ({self.open_step}) must be <= segment ({self.segment}).")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}.")
        self.policy = policy
        self.max_keys = None if max_keys is None else check_positive_int(max_keys, "max_keys", maximum=big)
        if self.max_keys is not None and self.max_keys < self.sinks + max(self.window, 1):
            raise ValueError(f"max_keys ({self.max_keys}) must be >= sinks + window "
                             f"({self.sinks} + {self.window}); raise Retention.max_keys or lower Retention.window.")
        self.estimate = check_positive_int(estimate, "estimate", minimum=0, maximum=big)
        if self.estimate and "estimate" not in routing_cls.supports:
            raise ValueError(f"estimate applies to selector='cluster' only; got selector={selector!r} with "
                             f"estimate={self.estimate}. Pass Budget(estimate=0), or selector='cluster'.")
        if n_probe is not None and "n_probe" not in routing_cls.supports and not routing_cls.any_cache:
            raise ValueError(f"n_probe applies to selector='cluster' (clusters) and 'pages' (pages) only; got "
                             f"selector={selector!r} with n_probe={n_probe!r}. Drop Budget.n_probe (the sketch selector's "
                             f"budget is 'sketch:candidates=N'), or pass selector='cluster'.")
        self.n_probe = routing_cls.default_probe if n_probe is None else check_positive_int(
            n_probe, "n_probe", maximum=big)
        self.top_p = None
        if top_p is not None:
            if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < float(top_p) <= 1:
                raise ValueError(f"top_p must be a float in (0, 1] (or None: fixed n_probe); got {top_p!r}.")
            if "top_p" not in routing_cls.supports:
                raise ValueError(f"top_p applies to selector='cluster' only (it ranks clusters by estimated "
                                 f"mass); got selector={selector!r}. Pass Budget(top_p=None) or selector='cluster'.")
            self.top_p = float(top_p)
        self.top_p_min_keys = check_positive_int(top_p_min_keys, "top_p_min_keys", minimum=0, maximum=big)
        self.top_p_max_keys = (big if top_p_max_keys is None
                               else check_positive_int(top_p_max_keys, "top_p_max_keys", minimum=0, maximum=big))
        if self.top_p is None and (self.top_p_min_keys or top_p_max_keys is not None):
            raise ValueError(f"top_p_min_keys / top_p_max_keys bound the top_p walk and do nothing without it; got "
                             f"top_p=None with top_p_min_keys={self.top_p_min_keys}, top_p_max_keys={top_p_max_keys}. "
                             f"Pass Budget(top_p=...) with them, or drop them.")
        if self.top_p_min_keys > self.top_p_max_keys:
            raise ValueError(f"top_p_min_keys ({self.top_p_min_keys}) must be <= top_p_max_keys "
                             f"({self.top_p_max_keys}) (the floor and the cap of routed keys per query).")
        self.scale = check_scale(scale, self.head_dim)
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0; got {scale!r}.")
        if not self.scale <= float(np.finfo(np.float32).max):  # the kernels scale float32 scores by it
            raise ValueError(f"scale must be <= 3.4e38 (the cache computes in float32); got {scale!r}. Scale the "
                             f"queries up instead.")
        self.seed = check_positive_int(seed, "seed", minimum=0, maximum=INT32_MAX)
        self.parallel = None if parallel is None else check_bool(parallel, "parallel")

    @property
    def rep(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def public(self) -> dict[str, Any]:
        """The options as the cache's attributes."""
        names = ("num_heads", "head_dim", "num_kv_heads", "value_dim", "selector", "sinks", "window",
                 "page_size", "segment", "cluster_size", "open_step", "policy", "max_keys", "estimate",
                 "n_probe", "top_p", "top_p_min_keys", "top_p_max_keys", "scale", "seed", "parallel")
        return {n: getattr(self, n) for n in names}

