"""Key indexes that know nothing about values: they cluster, route and search keys.

* :class:`~sparseattn.index.cluster.ClusterIndex`: spherical k-means over the centred keys, keys stored in
  cluster order, query -> cluster routing and the exact top-k among the routed clusters' keys.  Routed
  attention over such an index is :func:`sparseattn.attention.routed.routed_attention`.
* :class:`~sparseattn.index.causal.CausalClusterIndex`: the strictly causal form: queries that see few
  keys read them all exactly, longer ones route through one of a few nested prefix indexes
  (:class:`~sparseattn.index.causal.PrefixClusterIndex`) whose codebook was trained on keys they see.
* :mod:`~sparseattn.index.segments`: :func:`~sparseattn.index.segments.dyadic_cover`, the aligned dyadic
  blocks of a causal prefix that the other selectors' per-block indexes use.
* :mod:`~sparseattn.index.routing`: routing by estimated mass (``top_p``) and the per-row planning
  routed attention consumes; keys and key statistics only.

Nothing here imports :mod:`sparseattn.attention` (attention builds on indexes, never the reverse).
"""

from .causal import CausalClusterIndex, PrefixClusterIndex
from .cluster import ClusterIndex

__all__ = ["CausalClusterIndex", "ClusterIndex", "PrefixClusterIndex"]
