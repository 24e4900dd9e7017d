"""Numba's cache location for sparseattn's kernels, its threading layer, and OpenMP's wait policy.

Cache: :func:`kernel_cache` points ``numba.config.CACHE_DIR`` at :func:`cache_dir` only while
``sparseattn.kernels`` imports its modules (each ``cache=True`` dispatcher fixes its cache location when
it is decorated), then restores the previous value; nothing process-wide is changed, so other libraries'
Numba caches stay where they were.

Why a directory of our own, named after a digest of every ``kernels/*.py``: Numba keys a cache entry on
the source file that defines the function only, but our kernels inline helpers from sibling modules
(``intrinsics``, ``bias``); without the digest, editing a helper (or upgrading sparseattn) would keep a
stale compiled kernel in use.

Where: ``kernels/__pycache__/numba-<digest>`` inside the package when it is writable; else
``$XDG_CACHE_HOME/sparseattn/numba-<digest>`` (default ``~/.cache``); else the temp directory.  A
user-set ``NUMBA_CACHE_DIR`` is the base directory instead (``$NUMBA_CACHE_DIR/sparseattn-<digest>``).

Why not set the ``NUMBA_CACHE_DIR`` environment variable: Numba reads it once, when it is first imported
(too late if the user imported Numba first), and it would redirect every other library's cache too.

Threading layer: the intended one is TBB (the ``tbb`` dependency).  The ``tbb`` wheel installs
``libtbb.so.12`` into ``<prefix>/lib``, a directory the dynamic loader does not search for a virtual
environment's interpreter, so Numba's TBB layer failed to load there and Numba fell back to OpenMP without
a word, loading the system ``libgomp.so.1``; PyTorch imported afterwards then ran on that runtime instead
of its own, and its SDPA time (the harness's baseline) moved 2-3x.  :func:`preload_tbb` (run when
sparseattn is imported, before any parallel kernel) loads that library by path with ``RTLD_GLOBAL``;
Numba then finds it by its soname.  :func:`threading_status` says which layer Numba started and which
library was preloaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import site
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

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


_set_by_us: set[str] = set()  # environment variables sparseattn set (not the user)


def passive_openmp_waits() -> None:
    """Make idle OpenMP threads sleep instead of spin (unless the user set ``OMP_WAIT_POLICY``).

    FAISS (and Numba's OpenMP layer, when TBB is missing) use OpenMP.  With the default active wait, idle
    pool threads spin and, on a busy machine with few cores, starve the threads doing the work: a small
    parallel region such as ``SparsePattern.window(512, 512, 64)`` can take hundreds of times longer.
    OpenMP reads the variable when its runtime starts, so this runs when sparseattn is imported.
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _set_by_us.add("OMP_WAIT_POLICY")


def user_environ() -> dict[str, str]:
    """The process environment without the variables sparseattn set itself (``OMP_WAIT_POLICY``).

    For child processes that must run as the user's own code would, e.g. a baseline timed in a fresh
    process (:func:`sparseattn.tools.bench.fresh_sdpa_seconds`).
    """
    env = dict(os.environ)
    for name in _set_by_us:
        env.pop(name, None)
    return env


TBB_SONAME = "libtbb.so.12"  # the soname Numba's TBB layer (tbbpool) links against on Linux
PRELOAD_ENV = "SPARSEATTN_PRELOAD_TBB"  # "0" turns the preload off (diagnosis: reproduce the fallback)
_preload: dict[str, Any] = {"path": None, "reason": "not attempted"}


def _numba_parallel_started() -> bool:
    """True once Numba has started its threading layer in this process (its choice is then final)."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(getattr(parallel, "_is_initialized", False))


def tbb_candidates() -> list[str]:
    """Where a ``tbb`` wheel puts ``libtbb.so.12``: ``<prefix>/lib`` of this environment, then the user base.

    ``sys.prefix`` is the virtual environment when one is active (``pip install``), ``site.getuserbase()``
    the target of ``pip install --user``.  Existing files only, in that order, without duplicates.
    """
    out: list[str] = []
    for base in (sys.prefix, sys.exec_prefix, site.getuserbase()):
        path = os.path.join(base, "lib", TBB_SONAME)
        if os.path.isfile(path) and path not in out:
            out.append(path)
    return out


def preload_tbb() -> str | None:
    """Load the environment's ``libtbb.so.12`` with ``RTLD_GLOBAL`` so Numba's TBB threading layer starts.

    Returns the path loaded, or None with the reason in :func:`threading_status`.  Does nothing (and says
    why) when: not on Linux; the preload is turned off (``SPARSEATTN_PRELOAD_TBB=0``); the user chose
    another layer (``NUMBA_THREADING_LAYER=omp`` or ``workqueue``); Numba's threading layer has already
    started (its choice is final); a ``libtbb.so.12`` is already loaded (a second copy of the TBB runtime
    in one process would be worse than none); or no tbb wheel is installed.
    """
    def skip(reason: str) -> None:
        _preload.update(path=None, reason=reason)

    if not sys.platform.startswith("linux"):
        return skip(f"not Linux ({sys.platform}): the loader finds TBB by its own rules")
    if os.environ.get(PRELOAD_ENV, "1").strip() == "0":
        return skip(f"{PRELOAD_ENV}=0")
    from numba.core import config

    if config.THREADING_LAYER in ("omp", "workqueue"):
        return skip(f"NUMBA_THREADING_LAYER={config.THREADING_LAYER} chosen by the user")
    if _numba_parallel_started():
        return skip("Numba's threading layer had already started before sparseattn was imported")
    try:
        ctypes.CDLL(TBB_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)  # succeeds only if already loaded
        return skip(f"{TBB_SONAME} was already loaded")
    except OSError:
        pass
    errors = []
    for path in tbb_candidates():
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        _preload.update(path=path, reason="preloaded")
        return path
    return skip("; ".join(errors) if errors else
                f"no {TBB_SONAME} under {sys.prefix}/lib or the user base (is the tbb wheel installed?); "
                f"the loader's own search decides")


def threading_status() -> dict[str, Any]:
    """Numba's threading layer and the TBB preload, for result files and diagnosis.

    ``layer``: ``"tbb"``, ``"omp"`` or ``"workqueue"`` once a parallel kernel has run, else None
    (Numba chooses at its first parallel region).  ``tbb_preloaded``: the library :func:`preload_tbb`
    loaded, or None; ``preload``: why not, or ``"preloaded"``.
    """
    layer = None
    if _numba_parallel_started():
        import numba

        layer = numba.threading_layer()
    return {"layer": layer, "tbb_preloaded": _preload["path"], "preload": _preload["reason"]}


passive_openmp_waits()
preload_tbb()
