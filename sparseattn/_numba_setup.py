"""Numba's cache location for sparseattn's kernels, and OpenMP's wait policy.

Cache: :func:`kernel_cache` points ``numba.config.CACHE_DIR`` at :func:`cache_dir` only while
``sparseattn.kernels`` imports its modules (each ``cache=True`` dispatcher fixes its cache location when
it is decorated), then restores the previous value; nothing process-wide is changed, so other libraries'
Numba caches stay where they were.

Why a directory of our own, named after a digest of every ``kernels/*.py``: Numba keys a cache entry on
the source file that defines the function only, but our kernels inline helpers from sibling modules
(``_intrinsics``, ``bias``); without the digest, editing a helper (or upgrading sparseattn) would keep a
stale compiled kernel in use.

Where: ``kernels/__pycache__/numba-<digest>`` inside the package when it is writable; else
``$XDG_CACHE_HOME/sparseattn/numba-<digest>`` (default ``~/.cache``); else the temp directory.  A
user-set ``NUMBA_CACHE_DIR`` is the base directory instead (``$NUMBA_CACHE_DIR/sparseattn-<digest>``).

Why not set the ``NUMBA_CACHE_DIR`` environment variable: Numba reads it once, when it is first imported
(too late if the user imported Numba first), and it would redirect every other library's cache too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator

_KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")


def kernels_digest() -> str:
    """Short sha256 over the sources of every kernel module (names and contents)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(_KERNELS_DIR)):
        if name.endswith(".py"):
            h.update(name.encode())
            with open(os.path.join(_KERNELS_DIR, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, delete=True):
            pass
        return True
    except OSError:
        return False


def cache_dir() -> str:
    """Where sparseattn's compiled kernels are cached (see the module docstring)."""
    digest = kernels_digest()
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:  # the user's base directory wins; the digest still keys our entries inside it
        return os.path.join(user, f"sparseattn-{digest}")
    candidates = [
        os.path.join(_KERNELS_DIR, "__pycache__", f"numba-{digest}"),
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
                     "sparseattn", f"numba-{digest}"),
        os.path.join(tempfile.gettempdir(), "sparseattn-numba-cache", digest),
    ]
    for path in candidates:
        if _writable(path):
            return path
    return candidates[-1]


@contextlib.contextmanager
def kernel_cache() -> Iterator[str]:
    """Point Numba's cache at :func:`cache_dir` while kernel modules are imported, then restore it."""
    from numba.core import config

    path = cache_dir()
    previous = config.CACHE_DIR
    config.CACHE_DIR = path
    try:
        yield path
    finally:
        config.CACHE_DIR = previous


def passive_openmp_waits() -> None:
    """Make idle OpenMP threads sleep instead of spin (unless the user set ``OMP_WAIT_POLICY``).

    FAISS (and Numba's OpenMP layer, when TBB is missing) use OpenMP.  With the default active wait, idle
    pool threads spin and, on a busy machine with few cores, starve the threads doing the work: a small
    parallel region such as ``SparsePattern.window(512, 512, 64)`` can take hundreds of times longer.
    OpenMP reads the variable when its runtime starts, so this runs when sparseattn is imported.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


passive_openmp_waits()
