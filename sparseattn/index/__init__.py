"""Key indexes that know nothing about values: they cluster, route and search keys.

* :class:`~sparseattn.index.cluster.ClusterIndex`: spherical k-means over the centred keys, keys stored in
  cluster order, query -> cluster routing and the exact top-k among the routed clusters' keys.  Routed
  attention over such an index is :func:`sparseattn.attention.routed.routed_attention`.
* :class:`~sparseattn.index.causal.CausalClusterIndex`: the strictly causal form routed attention uses: one
  ClusterIndex whose codebook is trained on the earliest keys only (queries that see fewer are exact).
* :class:`~sparseattn.index.segments.SegmentedClusterIndex`: the strictly causal form of the top-k search:
  keys in position order, an exact tail and aligned dyadic segments, each a ClusterIndex over its own keys
  only (:func:`~sparseattn.index.segments.dyadic_cover` is the decomposition every causal index search
  uses).  Attention over it is :func:`sparseattn.attention.segmented.segmented_attention`.
* :mod:`~sparseattn.index.routing`: routing by estimated mass (``top_p``) and the per-row planning
  routed attention consumes; keys and key statistics only.

Nothing here imports :mod:`sparseattn.attention` (attention builds on indexes, never the reverse).
"""

from .causal import CausalClusterIndex
from .cluster import ClusterIndex
from .segments import SegmentedClusterIndex

__all__ = ["CausalClusterIndex", "ClusterIndex", "SegmentedClusterIndex"]
