"""Numba cache location and OpenMP behaviour, settled before any kernel is compiled.

Why a cache directory of our own, keyed by a digest of the kernel sources: Numba keys a cache entry on
the file that defines the function only, but our kernels inline helpers from sibling modules
(``_intrinsics``, ``bias``); editing a helper (or upgrading sparseattn) then left a stale compiled kernel
in use.  A directory named after a hash of every ``kernels/*.py`` makes any source change a fresh cache.

Why not the NUMBA_CACHE_DIR environment variable: it is read once, when Numba is first imported (too late
if the user imported Numba first), and it would redirect every other library's cache too.  Instead
``numba.config.CACHE_DIR`` is set only while our kernel modules are imported (each ``cache=True``
dispatcher fixes its cache location when it is decorated), then restored.  A user-set NUMBA_CACHE_DIR
is the base directory (our digest-named subdirectory goes inside it).  A read-only package directory falls back to a per-user cache directory, then to the temp dir.
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


def ensure_cache_dir() -> str:
    """Compatibility helper: the directory :func:`kernel_cache` will use."""
    return cache_dir()


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
    """Make idle OpenMP threads sleep instead of spin (unless the user chose otherwise).

    FAISS (and Numba's OpenMP layer, when TBB is missing) use OpenMP.  With the default active wait,
    idle pool threads spin; on a shared 2-core machine that turned a 0.25 ms parallel region into 60 ms
    (measured: ``SparsePattern.window(512, 512, 64)`` at load average 9).  Must be set before OpenMP starts.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


passive_openmp_waits()
