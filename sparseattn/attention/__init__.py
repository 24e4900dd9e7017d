"""Attention itself: the stage after selection in Q/K/V -> selector -> pattern -> kernel -> output.

* :mod:`.sparse` — attention of each query over the keys a :class:`~sparseattn.SparsePattern` (or a
  selector) gives it, through the fused Numba kernel;
* :mod:`.routed` — attention over the routed clusters of a :class:`~sparseattn.ClusterIndex` (no
  pattern is materialised), or of a :class:`~sparseattn.index.CausalClusterIndex` (strictly causal);
* :mod:`.cluster` — the attention of the cluster selector (``cluster:mode=block``), registered for it
  with :func:`sparseattn.selectors.registry.register_attention` (imported here, so it is in place
  whenever the package is);
* :mod:`.dense` — the exact reference, SDPA-compatible;
* :mod:`.merge` — the exact log-sum-exp merge of attention over disjoint key sets.
"""

from . import cluster  # noqa: F401  (registers the cluster selector's attention)
