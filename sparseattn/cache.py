"""The decode KV cache, :class:`KVCache` (its parts live in :mod:`sparseattn.decode`; this module keeps
the import path ``sparseattn.cache.KVCache``)."""

from __future__ import annotations

from .decode.kvcache import KVCache
from .decode.options import Budget, Layout, Retention, group_options
from .decode.plan import PARALLEL_MIN_KEYS
from .decode.routing.cluster_layout import cluster_segment, routing_codes
from .decode.store import bf16_bits, bf16_to_f32

__all__ = ["PARALLEL_MIN_KEYS", "Budget", "KVCache", "Layout", "Retention", "bf16_bits", "bf16_to_f32", "cluster_segment", "group_options", "routing_codes"]

# former private spellings, kept for callers that imported them
_bf16_bits = bf16_bits
_bf16_to_f32 = bf16_to_f32
