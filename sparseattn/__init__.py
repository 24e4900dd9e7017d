"""sparseattn: sparse attention over each query's nearest keys by inner product.

Data path (one module each): Q/K/V -> ``selectors`` (which keys) -> ``pattern.SparsePattern`` (CSR) ->
``kernels`` (Numba: scores, stable softmax, weighted sum) -> output -> ``metrics`` against the exact
``dense`` reference.

>>> import numpy as np, sparseattn as sa
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((128, 16)).astype(np.float32) for _ in range(3))
>>> dense = sa.scaled_dot_product_attention(q, k, v)
>>> full = sa.sparse_attention(q, k, v, sa.SparsePattern.full(128, 128))
>>> bool(np.allclose(dense, full, atol=1e-5))
True
"""

from . import _numba_setup, data, metrics  # noqa: F401  (_numba_setup first: writable Numba cache)
from .dense import scaled_dot_product_attention
from .layers import AttentionHead, AttentionSteps, MultiHeadAttention, attention_steps, seed_example
from .merge import merge_attention, merge_pair
from .pattern import SparsePattern
from .selectors import Selector, available_selectors, get_selector
from .sparse import SparseAttentionResult, sparse_attention
from .threads import get_num_threads, threads
from .topk import exact_topk

__version__ = "0.1.0"

__all__ = [
    "AttentionHead", "AttentionSteps", "MultiHeadAttention", "Selector", "SparseAttentionResult",
    "SparsePattern", "attention_steps", "available_selectors", "exact_topk", "get_num_threads",
    "data", "get_selector", "merge_attention", "merge_pair", "metrics", "scaled_dot_product_attention", "seed_example", "sparse_attention", "threads",
]
