"""One place to set how many threads sparseattn uses: Numba kernels, FAISS, BLAS and the dense path.

Why explicit: on a shared 2-core machine, 2 threads were measured slower than 1 for both Numba and FAISS
when the other core was busy, and FAISS's OpenMP pool slowed ~20x under oversubscription.  The default
is every core Numba sees; ``threads(1)`` makes everything serial (and CI runs that way).

The module is callable: ``sparseattn.threads(n)`` is :func:`threads` (``with sparseattn.threads(2): ...``),
and ``sparseattn.threads`` is still this module, so ``sparseattn.threads.get_num_threads()`` and
``import sparseattn.threads`` reach the helpers below.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numba

from .inputs import check_positive_int

# Per Python thread, like Numba's own setting: overlapping `threads()` blocks in different Python
# threads must not undo each other.
_local = threading.local()
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None
_executors: dict[int, ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()

__all__ = ["executor", "get_num_threads", "run_jobs", "single_threaded_blas", "threads", "worker_threads"]


def get_num_threads() -> int:
    """Threads the dense reference and kernels will use now (in this Python thread)."""
    n = getattr(_local, "n", None)
    return n if n is not None else numba.get_num_threads()


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS pinned to one thread while any caller is inside (reference-counted across Python threads).

    Callers that parallelise over blocks themselves use this so BLAS does not oversubscribe the cores.
    The BLAS thread count is process-wide, so a plain save/restore per call breaks when calls overlap
    (the last to leave would restore the *pinned* value): the first to enter sets it, the last restores.
    """
    global _blas_users, _blas_limiter

    with _blas_lock:
        if _blas_users == 0:
            _release_openblas_control()
            _blas_limiter = _blas_controller().limit(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0 and _blas_limiter is not None:
                _release_openblas_control()
                _blas_limiter.restore_original_limits()
                _release_openblas_control()
                _blas_limiter = None


def _release_openblas_control() -> None:
    """Let this Python thread set OpenBLAS's (process-wide) thread count.

    threadpoolctl (3.8 here) lets only one Python thread, the first to set a limit, change an OpenBLAS pool
    without an OpenMP layer; a limit set from any other thread is silently ignored, and the controlling
    thread is released only by its ``with`` blocks.  The limits here are set and restored outside a
    ``with`` (reference-counted across threads, under ``_blas_lock``), so without this the first thread
    kept control forever and a call from another Python thread (a server's, a Dask worker's) ran its
    per-block products on every BLAS thread: oversubscribed, and different bits.  Older threadpoolctl
    releases have no such state: a no-op.
    """
    from threadpoolctl import OpenBLASController

    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


_controller_cache: list = [None, -1]  # [ThreadpoolController, len(sys.modules) when it was made]


def _blas_controller():
    """A cached ``threadpoolctl.ThreadpoolController``, rebuilt when new modules were imported.

    Why: each ``threadpool_limits()`` call scans every loaded shared library (0.8 ms here), which was
    ~10 % of a cluster-routed attention call at n = 4,096.  Native BLAS libraries arrive through
    Python imports (numpy, scipy, faiss, torch), so a change in ``len(sys.modules)`` triggers a rescan.
    """
    from threadpoolctl import ThreadpoolController

    n_mod = len(sys.modules)
    if _controller_cache[0] is None or _controller_cache[1] != n_mod:
        _controller_cache[0] = ThreadpoolController()
        _controller_cache[1] = n_mod
    return _controller_cache[0]


def _faiss_module():
    # Imported here (not at package import) so `import sparseattn` stays fast; entering `threads()` is an
    # explicit request to control every pool, FAISS's included.  A missing FAISS is not an error.
    if "faiss" in sys.modules:
        return sys.modules["faiss"]
    try:
        import faiss
    except ImportError:
        return None
    return faiss


@contextlib.contextmanager
def threads(n: int) -> Iterator[int]:
    """Context manager: run sparseattn with ``n`` threads, restoring previous settings on exit.

    Sets Numba's thread count, FAISS's OpenMP threads (when FAISS is installed), BLAS threads (via
    threadpoolctl) and the worker count of the dense reference.  Restored even when the body raises.
    Like Numba's own setting, the count applies to the calling Python thread: worker threads started
    inside the block should enter ``threads(n)`` themselves.

    Examples
    --------
    >>> with threads(1):
    ...     pass
    """
    n = check_positive_int(n, "n")
    max_threads = numba.config.NUMBA_NUM_THREADS
    if n > max_threads:
        raise ValueError(f"n={n} exceeds the {max_threads} threads Numba was started with "
                         f"(set NUMBA_NUM_THREADS before importing to raise it).")
    prev_numba = numba.get_num_threads()
    prev_dense = getattr(_local, "n", None)
    faiss = _faiss_module()
    prev_faiss = faiss.omp_get_max_threads() if faiss is not None else None
    from threadpoolctl import threadpool_limits

    with _blas_lock:
        _release_openblas_control()
        limiter = threadpool_limits(limits=n, user_api="blas")
    try:
        numba.set_num_threads(n)
        _local.n = n
        if faiss is not None:
            faiss.omp_set_num_threads(n)
        yield n
    finally:
        numba.set_num_threads(prev_numba)
        _local.n = prev_dense
        if faiss is not None and prev_faiss is not None:
            faiss.omp_set_num_threads(prev_faiss)
        with _blas_lock:
            _release_openblas_control()
            limiter.restore_original_limits()
            _release_openblas_control()


def executor(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``n`` worker threads, created on first use for each size and then reused.

    Why shared: starting the threads of a fresh pool costs ~1 ms per call, 4 ms of a 30 ms cluster-routed
    attention at n = 4,096 (several pool uses per build and attend).  Jobs submitted to these pools must
    not submit further jobs to them and wait (the pool could then deadlock); :func:`run_jobs` jobs never do.
    """
    n = check_positive_int(n, "n")
    with _executors_lock:
        ex = _executors.get(n)
        if ex is None:
            ex = _executors[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"sparseattn-{n}")
        return ex


@contextlib.contextmanager
def worker_threads(n: int) -> Iterator[int]:
    """Context manager for code that parallelises over blocks itself: BLAS pinned to one thread, Numba to n.

    ``n`` is clipped to ``[1, NUMBA_NUM_THREADS]``; the clipped count is yielded.  Numba's count is
    restored on exit (it is per Python thread); the BLAS pin is reference-counted across Python threads
    (:func:`single_threaded_blas`).  Why pin BLAS: the per-block products are small, and multi-threaded
    BLAS on them was measured 10x slower on a machine whose other core was busy.
    """
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        with single_threaded_blas():
            yield n
    finally:
        numba.set_num_threads(old)


def run_jobs(work: Callable[[int], None], jobs: Iterable[int], n: int) -> None:
    """Call ``work(j)`` for every job id, in order on this thread when ``n <= 1``, else on :func:`executor`.

    Blocks until every job has finished; the first exception raised by a job is re-raised here.  Jobs
    should release the GIL for their heavy part (BLAS, ``nogil`` Numba kernels) to run in parallel.
    """
    jobs = list(jobs)
    if n <= 1 or len(jobs) <= 1:
        for j in jobs:
            work(j)
        return
    for _ in executor(n).map(work, jobs):
        pass


class _CallableModule(types.ModuleType):
    """The type of this module: calling it enters :func:`threads`, so ``sparseattn.threads(n)`` works while
    the attribute ``sparseattn.threads`` stays the module."""

    def __call__(self, n: int) -> contextlib.AbstractContextManager[int]:
        return threads(n)


sys.modules[__name__].__class__ = _CallableModule
