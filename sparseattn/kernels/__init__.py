"""Numba kernels: plain functions over arrays and scalars, kept apart from the objects holding state.

Every module in this folder is imported here, inside ``kernel_cache()``, so that all ``cache=True``
dispatchers are created while Numba's cache points at sparseattn's digest-keyed directory (see
``sparseattn._numba_setup``); a dispatcher fixes its cache location when it is decorated.  A new kernel
module needs no registration: any ``kernels/*.py`` is picked up.
"""

import importlib
import pkgutil

from .._numba_setup import kernel_cache

with kernel_cache():
    for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{_module}")
del _module
