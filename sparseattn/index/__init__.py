"""Key indexes that know nothing about values: they cluster, route and search keys.

* :class:`~sparseattn.index.cluster.ClusterIndex`: spherical k-means over the centred keys, keys stored in
  cluster order, query -> cluster routing and the exact top-k among the routed clusters' keys.  Routed
  attention over such an index is :func:`sparseattn.attention.routed.routed_attention`.
"""

from .cluster import ClusterIndex

__all__ = ["ClusterIndex"]
