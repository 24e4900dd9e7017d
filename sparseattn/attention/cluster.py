"""Attention of the cluster selector (``cluster:mode=block``): the attention half of
:class:`~sparseattn.selectors.cluster.ClusterSelector`.

The selector owns the key side (its :class:`~sparseattn.index.cluster.ClusterIndex` ``index_`` and, for
strictly causal queries, its :class:`~sparseattn.index.causal.CausalClusterIndex` ``causal_index()``);
this module adds the values: :func:`~sparseattn.attention.routed.routed_attention` over either, with the
selector's ``exact_prefix`` (always on over the causal index), ``n_threads`` and budget parameters.  It
is registered for the selector name ``"cluster"`` (:func:`sparseattn.selectors.registry.register_attention`),
which is how :meth:`ClusterSelector.attend <sparseattn.selectors.cluster.ClusterSelector.attend>` reaches it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..inputs import check_bool
from ..selectors.registry import register_attention
from .routed import routed_attention

__all__ = ["cluster_attention"]


@register_attention("cluster")
def cluster_attention(selector: Any, queries: np.ndarray, values: np.ndarray, *, scale: float | None = None,
                      is_causal: bool = False, query_positions: object = None, key_positions: object = None,
                      check_finite: bool = True, stats: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact softmax attention of each query over every key of its routed clusters of a built
    :class:`~sparseattn.selectors.cluster.ClusterSelector` (plus its ``estimate`` / ``top_p`` budget).

    Causal queries with ``strict_causal`` go through ``selector.causal_index(key_positions)``, the others
    through ``selector.index_``.  Parameters, results and ``stats`` are those of
    :func:`~sparseattn.attention.routed.routed_attention`.
    """
    prm = selector.get_params()
    budget = dict(estimate=prm["estimate"], top_p=prm["top_p"], min_keys=prm["min_keys"],
                  max_keys=prm["max_keys"])
    if check_bool(is_causal, "is_causal") and prm["strict_causal"]:
        # strictly causal: the causal index (prefix bands), its small rows always exact
        return routed_attention(selector.causal_index(key_positions), queries, values, scale=scale, is_causal=True,
                                query_positions=query_positions, key_positions=key_positions, exact_prefix=True,
                                n_threads=selector.n_threads, check_finite=check_finite, stats=stats, **budget)
    return routed_attention(selector.index_, queries, values, scale=scale, is_causal=is_causal,
                            query_positions=query_positions, key_positions=key_positions,
                            exact_prefix=prm["exact_prefix"], n_threads=selector.n_threads,
                            check_finite=check_finite, stats=stats, **budget)
