"""Numba cache location, settled before Numba is imported anywhere in the package.

``cache=True`` writes compiled kernels next to the source file; in a read-only install (system
site-packages, a container image) that fails, so we fall back to a per-user directory.  Numba reads
NUMBA_CACHE_DIR when it is first imported, hence this module imports nothing heavy and runs first.
"""

from __future__ import annotations

import os
import tempfile


def ensure_cache_dir() -> None:
    """Point Numba's cache at a writable directory when the package directory is read-only.

    ``cache=True`` writes next to the source file; in a read-only install (system site-packages, a
    container image) that fails, so fall back to a per-user directory.  A user-set NUMBA_CACHE_DIR wins.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
    pycache = os.path.join(here, "__pycache__")
    try:
        os.makedirs(pycache, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=pycache, delete=True)
        probe.close()
    except OSError:
        fallback = os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
            "sparseattn", "numba",
        )
        try:
            os.makedirs(fallback, exist_ok=True)
        except OSError:
            fallback = os.path.join(tempfile.gettempdir(), "sparseattn-numba-cache")
            os.makedirs(fallback, exist_ok=True)
        os.environ["NUMBA_CACHE_DIR"] = fallback


def passive_openmp_waits() -> None:
    """Make idle OpenMP threads sleep instead of spin (unless the user chose otherwise).

    Numba's default threading layer and FAISS both use OpenMP.  With the default active wait, idle pool
    threads spin; on a shared 2-core machine that turned a 0.25 ms parallel region into 60 ms (measured:
    ``SparsePattern.window(512, 512, 64)`` at load average 9).  Must be set before OpenMP starts.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


ensure_cache_dir()
passive_openmp_waits()
