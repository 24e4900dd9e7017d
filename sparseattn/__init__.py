"""sparseattn: sparse attention over each query's nearest keys by inner product, measured against exact.

Data path (one folder or module per stage)::

    Q (..., L, E), K (..., S, E), V (..., S, Ev)    float16 / float32 / float64 numpy arrays
      -> selectors/     which keys: each query's best keys by inner product (window, sinks, random,
                        exact top-k, LSH, kd-tree, FAISS, cluster routing, unions); get_selector("spec")
      -> pattern.py     SparsePattern: the selected (query, key) pairs in CSR form (indptr, indices)
      -> kernels/       Numba kernels over the selected pairs: scores, stable softmax, weighted sum
      -> attention/     the output (..., L, Ev):
                          sparse.py  sparse_attention over a pattern or a selector's choice
                          dense.py   scaled_dot_product_attention, the exact reference
                          routed.py  attention over the clusters each query is routed to
                          cluster.py  the cluster selector's block attention (over either index below)
                          merge.py   partial results combined by log-sum-exp
      -> metrics.py     recall@k, softmax mass and output error against the dense reference

The cluster index sits beside the selectors: ``index/cluster.py`` (ClusterIndex) clusters the keys only;
the ``cluster`` selector turns its routing into a pattern, and ``attention/routed.py`` attends over the
routed clusters directly (no pattern), merging per-cluster partial results with ``attention/merge.py``.
Causal queries use ``index/causal.py`` instead (rows that see few keys exact, longer ones through a prefix
index whose codebook they see whole), so no row depends on a later key.
``index/routing.py`` routes by estimated mass (``top_p``) from key statistics alone.  The layers import
downwards: ``selectors/`` and ``index/`` never import ``attention/`` or ``tools/``.

Around the path: ``inputs`` (validation shared by every stage), ``positional`` (RoPE, ALiBi, T5 biases),
``threads`` (Numba, FAISS and BLAS thread counts: ``with sparseattn.threads(n):``), ``data`` (real and
synthetic Q/K/V) and ``tutorial`` (the eight steps of attention, heads, multi-head, the worked example).
The measurement tools and the ``sparseattn`` command live in ``tools/`` (bench, suite, report,
decode_report, traces, cli); the library never imports them.

>>> import numpy as np, sparseattn as sa
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((128, 16)).astype(np.float32) for _ in range(3))
>>> dense = sa.scaled_dot_product_attention(q, k, v)
>>> full = sa.sparse_attention(q, k, v, sa.SparsePattern.full(128, 128))
>>> bool(np.allclose(dense, full, atol=1e-5))
True
>>> pattern = sa.get_selector("topk").build(k).query(q, k=32)
>>> pattern.shape, pattern.nnz
((128, 128), 4096)
>>> out = sa.sparse_attention(q, k, v, pattern)
>>> report = sa.metrics.compare(q, k, v, pattern, sparse_output=out, k=32)
>>> float(report.recall.mean())
1.0
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from . import _numba_setup, data, metrics, threads, tutorial  # noqa: F401  (_numba_setup first: OpenMP wait policy)
from .attention.dense import scaled_dot_product_attention
from .attention.merge import merge_attention, merge_pair
from .attention.routed import routed_attention
from .attention.sparse import SparseAttentionResult, sparse_attention, sparse_attention_result
from .attention.tail import Tail
from .cache import Budget, KVCache, Layout, Retention
from .index import ClusterIndex
from .pattern import SparsePattern
from .selectors import Selector, available_selectors, get_selector
from .threads import get_num_threads
from .topk import exact_topk

try:
    __version__ = _dist_version("sparseattn")  # the one version, from pyproject.toml
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Budget", "ClusterIndex", "KVCache", "Layout", "Retention", "Selector", "SparseAttentionResult", "SparsePattern", "Tail", "available_selectors", "data",
    "exact_topk", "get_num_threads", "get_selector", "merge_attention", "merge_pair", "metrics",
    "routed_attention", "scaled_dot_product_attention", "sparse_attention", "sparse_attention_result",
    "threads", "tutorial",
]
