"""Numba kernels: plain functions over arrays and scalars, kept apart from the objects holding state.

Every kernel module is imported here, inside ``kernel_cache()``, so that all ``cache=True`` dispatchers
are created while Numba's cache points at sparseattn's digest-keyed directory (see ``_numba_setup``).
"""

from .._numba_setup import kernel_cache

with kernel_cache():
    from . import (  # noqa: F401
        _intrinsics,
        _options,
        bias,
        cluster,
        fused,
        lsh,
        pattern_ops,
        rerank,
        select_topk,
        steps,
        structural,
    )
