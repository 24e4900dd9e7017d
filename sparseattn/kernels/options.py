"""Numba compilation options shared by every kernel.

Why these fastmath flags: the kernels must handle ``-inf`` scores (masked keys, empty rows) correctly,
so the flags that let LLVM assume "no NaN" / "no Inf" (``nnan``, ``ninf``) are left out.  The rest
(reassociation for vectorised dot products, contraction into FMA, approximate functions) buys ~2x on
gathered rows on AVX-512 machines without changing the IEEE special-value behaviour we test for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


def serial_and_parallel(impl: Callable[..., Any], *, constants: dict[str, Any] | None = None, suffix: str = "",
                        **options: Any) -> tuple[Any, Any]:
    """Compile ``impl`` twice, serial and ``parallel=True``, each with its own on-disk cache entry.

    Returns ``(serial, parallel)`` dispatchers.  ``constants`` replace module globals for this pair only,
    ``suffix`` distinguishes several pairs made from one function, ``options`` go to ``njit``.

    Why the clone: Numba names cache files after the function's qualified name and line, and does not
    key them by the ``parallel`` flag.  Two dispatchers over the same Python function would share one
    cache index, and whichever variant compiled first would be loaded for both (a "parallel" kernel
    running serial code).  Distinct qualnames give distinct cache files.
    """
    import types

    from numba import njit

    # ``constants`` override module globals for this pair only: Numba treats globals as compile-time
    # constants and prunes dead branches on them (e.g. a no-bias kernel never types the bias code).
    namespace = impl.__globals__ if not constants else {**impl.__globals__, **constants}

    def clone(variant: str) -> types.FunctionType:
        fn = types.FunctionType(impl.__code__, namespace, impl.__name__ + suffix + variant,
                                impl.__defaults__, impl.__closure__)
        fn.__qualname__ = impl.__qualname__ + suffix + variant
        fn.__module__ = impl.__module__
        fn.__doc__ = impl.__doc__
        return fn

    serial = njit(cache=True, **options)(clone("_serial"))
    parallel = njit(cache=True, parallel=True, **options)(clone("_parallel"))
    return serial, parallel
