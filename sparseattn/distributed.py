"""A key store sharded over Dask workers, queried with exact log-sum-exp merging.

Attention over a union of disjoint key sets is exactly the log-sum-exp merge of the attention over each
set (:func:`sparseattn.merge_attention`), so keys and values can be split over many worker processes
with no approximation added by the split: each worker attends over its own shard and sends back an
``(output, lse)`` pair per query, and the client merges them.

Layout: shard ``i`` holds the keys ``[start_i, stop_i)`` of the store, and the store's key positions must
be non-decreasing, so each shard is also a *position range*.  Position ranges (rather than hashing or
round-robin) are what make causal attention cheap: a query at position ``p`` cannot see a key at a larger
position, so it is sent only to the shards whose first position is ``<= p`` and skips every whole future
shard.  The price is that a batch of early queries (e.g. prefill of the first tokens) loads only the
first shards.

Each shard lives in one worker process (a Dask actor) together with its selector's index, built once when
the store is made and reused by every :meth:`ShardedKeyStore.attend`; queries travel to the workers and
``(output, lse)`` travel back, never the keys.  With ``replicas=r`` each shard is held by ``r`` workers
and a call that fails on one is retried on the next (also when the worker died between two calls); a
replica is dropped for good only when its worker is lost, so a timeout or a failed computation does not
condemn a live one.  A shard with no working replica raises :class:`ShardError`, never a partial answer;
a closed client raises :class:`ClientClosedError` before anything is sent.

What the result equals: with ``k_scope="shard"`` (the default, one round trip) each shard's selector
picks up to ``k`` of *its own* keys per query, and the merged answer is the attention over the union of
the shards' selections (up to ``n_shards * k`` keys per query: with exact ``"topk"`` a superset of the
store's top-``k``).  For position-based selectors (``"window"``) that union is exactly the single-process
selection; attending selectors (``"cluster:mode=block"``) attend over the keys of each shard's routed
clusters.  With ``k_scope="store"`` (two round trips, selectors that rank keys by score) the shards send
their candidates' scores, the client keeps each query's ``k`` best over the whole store and the shards
attend over their share: for exact ``"topk"`` this is the single-process
``sparse_attention(q, keys, values, "topk", k=k)``.  Either way the answer equals the single-process
attention over the same selected keys up to float rounding.

Example (from one process to a Dask cluster; a script that starts a LocalCluster needs the
``__main__`` guard, since its worker processes import the script)::

    from dask.distributed import Client, LocalCluster
    from sparseattn.distributed import ShardedKeyStore

    if __name__ == "__main__":
        with LocalCluster(n_workers=4, threads_per_worker=1) as cluster, Client(cluster) as client:
            store = ShardedKeyStore(client, keys, values, selector="topk")  # keys (S, E), values (S, Ev)
            out, lse = store.attend(queries, k=64)                          # (L, Ev), (L,)

Needs the optional extra ``dask`` (``pip install "sparseattn[dask]"``); sparseattn must be installed on
every worker too.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import distributed as _dd
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sparseattn.distributed needs Dask's distributed scheduler, which is an optional extra: "
        "install it with  pip install 'sparseattn[dask]'  (or  pip install 'dask[distributed]>=2024.1')."
    ) from _exc

from . import SparsePattern, get_selector, merge_attention, sparse_attention, threads

__all__ = ["ClientClosedError", "Shard", "ShardError", "ShardInfo", "ShardedKeyStore"]

#: Rows per message when keys are sent from the client to a shard (bounds each message to ~32 MiB at
#: E = Ev = 64, float32).
SEND_ROWS = 1 << 16
#: Default number of queries per shard call.
BATCH_SIZE = 1024
_FLOATS = (np.float16, np.float32, np.float64)
#: Seconds a health check waits for a shard's answer to a ping before calling it unresponsive (which does
#: not condemn it: only a shard whose worker or state is gone is dropped).
PING_TIMEOUT = 10.0
#: Seconds between checks, while a shard call runs, that the client is still open and the shard's worker
#: still holds it (so a wait ends soon after either is lost, whatever the timeout).
_POLL = 0.2
#: Status of an actor's key once its worker is gone (or its client released it).
_GONE = ("lost", "error", "cancelled")


class ShardError(RuntimeError):
    """A shard could not answer (its worker died, or its computation raised); no partial result is given."""


class ClientClosedError(RuntimeError):
    """The store's Dask client is closed (or not connected), so the store cannot reach its shards.

    The cluster drops a closed client's shards, so the store cannot be reused: build a new
    :class:`ShardedKeyStore` with a live client.
    """


class _ShardGone(Exception):
    """Internal: the key of a shard's actor is no longer held by the cluster (worker lost)."""


@dataclass(frozen=True)
class ShardInfo:
    """Where shard ``index`` lives and what it holds.

    Attributes
    ----------
    index : int
    start, stop : int
        The store rows ``[start, stop)`` it holds.
    first_position, last_position : int
        Smallest and largest key position in it (causal queries at a position below ``first_position``
        skip it).
    workers : tuple of str
        Addresses of the workers holding it (one per replica).
    nbytes : int
        Bytes of its keys, values and positions (the selector's index comes on top).
    """

    index: int
    start: int
    stop: int
    first_position: int
    last_position: int
    workers: tuple[str, ...]
    nbytes: int


# ----------------------------------------------------------------------------------------- worker side
class Shard:
    """Worker-resident state of one shard: keys, values, positions and the built selector.

    Created as a Dask actor pinned to one worker; every method runs in that worker process.  It needs no
    Dask itself: ``benchmarks/bench_distributed.py`` drives one in a single process (``load``, ``finalize``,
    ``attend``) to time the same shard code without the cluster.
    """

    def __init__(self, spec: str, n_rows: int, start: int, n_threads: int) -> None:
        self.spec = spec
        self.n_rows = int(n_rows)
        self.start = int(start)
        import numba

        self.n_threads = max(1, min(int(n_threads), numba.config.NUMBA_NUM_THREADS))
        self.keys: np.ndarray | None = None
        self.values: np.ndarray | None = None
        self.positions: np.ndarray | None = None  # None: consecutive, start + arange(n_rows)
        self.written = 0
        self.selector: Any = None
        self.busy = 0.0

    def _allocate(self, kb: np.ndarray, vb: np.ndarray, pb: np.ndarray | None) -> None:
        dtype = np.float64 if np.float64 in (kb.dtype, vb.dtype) else np.float32
        self.keys = np.empty((self.n_rows, kb.shape[1]), dtype=dtype)
        self.values = np.empty((self.n_rows, vb.shape[1]), dtype=dtype)
        if pb is not None:
            self.positions = np.empty(self.n_rows, dtype=np.int64)

    def write(self, offset: int, kb: np.ndarray, vb: np.ndarray, pb: np.ndarray | None) -> int:
        """Copy a block of rows into place at shard row ``offset``; returns the rows written so far."""
        kb = np.asarray(kb)
        vb = np.asarray(vb)
        if self.keys is None:
            self._allocate(kb, vb, pb)
        n = kb.shape[0]
        if offset < 0 or offset + n > self.n_rows:
            raise ValueError(f"block of {n} rows at offset {offset} does not fit a shard of {self.n_rows} rows.")
        if kb.shape[1] != self.keys.shape[1] or vb.shape != (n, self.values.shape[1]):
            raise ValueError(f"block shapes keys {kb.shape} / values {vb.shape} differ from the first block's "
                             f"widths E = {self.keys.shape[1]}, Ev = {self.values.shape[1]}.")
        if (pb is None) != (self.positions is None):
            raise ValueError("every block must carry key positions, or none may.")
        self.keys[offset:offset + n] = kb
        self.values[offset:offset + n] = vb
        if pb is not None:
            self.positions[offset:offset + n] = pb
        self.written += n
        return self.written

    def load(self, source: Callable[[int, int], tuple], block_rows: int) -> int:
        """Fill the shard by calling ``source(start, stop)`` here, on the worker, for global row ranges."""
        for lo in range(0, self.n_rows, block_rows):
            hi = min(lo + block_rows, self.n_rows)
            block = source(self.start + lo, self.start + hi)
            kb, vb, pb = _split_block(block, "keys(start, stop)")
            if kb.shape[0] != hi - lo:
                raise ValueError(f"keys(start, stop) returned {kb.shape[0]} rows for the range "
                                 f"[{self.start + lo}, {self.start + hi}); expected {hi - lo}.")
            self.write(lo, kb, vb, pb)
        return self.written

    def finalize(self) -> dict[str, Any]:
        """Check completeness, build the selector once; returns a summary for the client."""
        if self.written != self.n_rows or self.keys is None:
            raise ValueError(f"shard received {self.written} rows; expected {self.n_rows}.")
        if not (np.isfinite(self.keys).all() and np.isfinite(self.values).all()):
            raise ValueError("keys and values must be finite (no NaN or inf).")
        pos = self._positions()
        if pos.size > 1 and bool(np.any(np.diff(pos) < 0)):
            raise ValueError("key_positions must be non-decreasing within the store; sort keys, values and "
                             "key_positions by position first.")
        with threads(self.n_threads):
            self.selector = get_selector(self.spec).build(self.keys)
        nbytes = self.keys.nbytes + self.values.nbytes + (0 if self.positions is None else self.positions.nbytes)
        norm = max((_max_row_norm(self.keys[lo:lo + SEND_ROWS]) for lo in range(0, self.n_rows, SEND_ROWS)),
                   default=0.0)
        return {"first": int(pos[0]), "last": int(pos[-1]), "E": int(self.keys.shape[1]),
                "Ev": int(self.values.shape[1]), "dtype": self.keys.dtype.str, "nbytes": int(nbytes),
                "pid": os.getpid(), "key_norm": norm}

    async def ping(self) -> bool:
        """True while the shard is built.  A coroutine, so the worker answers it on its event loop at once,
        not after the computation its actor thread may be running."""
        return self.selector is not None

    def _positions(self) -> np.ndarray:
        if self.positions is not None:
            return self.positions
        return np.arange(self.start, self.start + self.n_rows, dtype=np.int64)

    def attend(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
               scale: float) -> tuple[np.ndarray, np.ndarray]:
        """(output (L, Ev), lse (L,)) of the queries over this shard's selected keys."""
        if self.selector is None:
            raise RuntimeError("shard is not built (or was closed).")
        t0 = time.perf_counter()
        try:
            return self._attend(q, k, is_causal, qpos, scale)
        finally:
            self.busy += time.perf_counter() - t0

    def _attend(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
                scale: float) -> tuple[np.ndarray, np.ndarray]:
        kpos = self._positions()
        with threads(self.n_threads):
            if self.selector.attends:
                return self.selector.attend(q, self.values, scale=scale, is_causal=is_causal,
                                            query_positions=qpos, key_positions=kpos)
            pattern = self.selector.query(q, k, is_causal=is_causal, query_positions=qpos, key_positions=kpos)
            return self._attend_pattern(q, pattern, scale)

    def _attend_pattern(self, q: np.ndarray, pattern: SparsePattern,
                        scale: float) -> tuple[np.ndarray, np.ndarray]:
        dtype = np.result_type(q.dtype, self.keys.dtype)
        if pattern.nnz == 0:
            return np.zeros((q.shape[0], self.values.shape[1]), dtype), np.full(q.shape[0], -np.inf, dtype)
        # Attend over the selected rows only: gathering them is cheaper than passing the whole shard.
        ids = np.unique(pattern.indices)
        local = SparsePattern(pattern.indptr, np.searchsorted(ids, pattern.indices), ids.size, validate=False)
        return sparse_attention(q, self.keys[ids], self.values[ids], local, scale=scale, return_lse=True)

    def select(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each query's selected keys: (scores q.k (L, w) with -inf padding, shard row ids (L, w) with -1)."""
        if self.selector is None:
            raise RuntimeError("shard is not built (or was closed).")
        t0 = time.perf_counter()
        try:
            with threads(self.n_threads):
                p = self.selector.query(q, k, is_causal=is_causal, query_positions=qpos,
                                        key_positions=self._positions())
                counts = np.diff(p.indptr)
                L = q.shape[0]
                width = int(counts.max()) if L else 0
                rows = np.repeat(np.arange(L), counts)
                cols = np.arange(p.nnz) - np.repeat(p.indptr[:-1], counts)
                scores = np.full((L, width), -np.inf, dtype=np.result_type(q.dtype, self.keys.dtype))
                scores[rows, cols] = np.einsum("ij,ij->i", q[rows], self.keys[p.indices])
                ids = np.full((L, width), -1, dtype=np.int32)
                ids[rows, cols] = p.indices
            return scores, ids
        finally:
            self.busy += time.perf_counter() - t0

    def attend_ids(self, q: np.ndarray, indptr: np.ndarray, ids: np.ndarray,
                   scale: float) -> tuple[np.ndarray, np.ndarray]:
        """(output, lse) of each query over the shard rows given as CSR ``(indptr (L + 1,), ids (nnz,))``."""
        if self.selector is None:
            raise RuntimeError("shard is not built (or was closed).")
        t0 = time.perf_counter()
        try:
            with threads(self.n_threads):
                return self._attend_pattern(q, SparsePattern(indptr, ids, self.n_rows), scale)
        finally:
            self.busy += time.perf_counter() - t0

    def memory(self) -> int:
        """Resident set size of this worker process in bytes."""
        import psutil

        return int(psutil.Process().memory_info().rss)

    def busy_seconds(self) -> float:
        """Seconds spent computing (attend, select, attend_ids) since the shard was made."""
        return self.busy

    def clear(self) -> None:
        """Drop the keys, values and index (the worker frees the memory now, not when the actor goes)."""
        self.keys = self.values = self.positions = self.selector = None


# ----------------------------------------------------------------------------------------- client side
def _split_block(block: Any, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(keys, values, positions or None) from a ``(keys, values)`` or ``(keys, values, positions)`` block."""
    if not isinstance(block, (tuple, list)) or len(block) not in (2, 3):
        raise TypeError(f"{name} must give (keys, values) or (keys, values, positions) tuples; got "
                        f"{type(block).__name__}.")
    kb = _float2d(block[0], f"{name} keys")
    vb = _float2d(block[1], f"{name} values")
    if kb.shape[0] != vb.shape[0]:
        raise ValueError(f"{name}: keys and values blocks must have the same rows; got {kb.shape} and {vb.shape}.")
    pb = None
    if len(block) == 3 and block[2] is not None:
        pb = _int1d(block[2], f"{name} positions", kb.shape[0])
    return kb, vb, pb


def _max_row_norm(x: np.ndarray) -> float:
    """Largest Euclidean norm of the rows of a finite 2-D array, in float64 without overflow."""
    m = float(np.abs(x).max()) if x.size else 0.0
    if m == 0.0:
        return 0.0
    return m * float(np.sqrt(np.square(x / m, dtype=np.float64).sum(axis=1)).max())


def _describe(exc: BaseException | None) -> str:
    return "no error recorded" if exc is None else f"{type(exc).__name__}: {exc}"


def _float2d(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a float16/32/64 array; got dtype {arr.dtype}.")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, features); got shape {arr.shape}.")
    return arr


def _int1d(x: Any, name: str, length: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {arr.dtype}.")
    if arr.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},); got {arr.shape}.")
    return arr.astype(np.int64, copy=False)


def _check_int(x: Any, name: str, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(x).__name__}.")
    if int(x) < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {x}.")
    return int(x)


class ShardedKeyStore:
    """Keys and values split by position range over Dask workers, each shard indexed where it lives.

    Parameters
    ----------
    client : distributed.Client or str
        A connected client, or a scheduler address such as ``"tcp://10.0.0.5:8786"`` (the store then owns
        the client it opens and closes it in :meth:`close`).
    keys : float array (S, E), iterable of blocks, or callable
        * an array: sent to the workers shard by shard (the client already holds the whole store);
        * an iterable of ``(keys (n, E), values (n, Ev))`` or ``(keys, values, positions (n,))`` blocks in
          position order: streamed, the client holds one block at a time (``n_keys`` required);
        * a callable ``keys(start, stop) -> (keys, values[, positions])`` for global rows
          ``[start, stop)``: called *on the workers* (it must pickle), so no key passes through the
          client; each shard asks for ``block_rows`` rows at a time (``n_keys`` required).
        float16 is stored as float32; float64 stays float64.
    values : float array (S, Ev), optional
        Required with an array of keys; must be None otherwise.
    n_shards : int, optional
        Default: one shard per worker.  Shards are contiguous, near-equal row ranges.
    selector : str, default "topk"
        Any selector spec (``sa.available_selectors()``), built once per shard on the shard's keys.
    key_positions : int array (S,), optional
        Global positions of the keys, non-decreasing (default ``arange(S)``); with an iterable or a
        callable, give positions inside the blocks instead.
    n_keys : int, optional
        Total rows; required for an iterable or a callable (the shard ranges are fixed up front).
    replicas : int, default 1
        Workers holding each shard (a failed call is retried on the next replica); at most the number of
        workers.  A replica is dropped only when a health check finds it lost (its worker gone, or its
        shard state gone): a timeout or an error on a live worker fails that call only.
    workers : sequence of str, optional
        Worker addresses to use (default: every worker of the cluster).
    batch_size : int, default 1024
        Queries per shard call in :meth:`attend`.
    block_rows : int, default 65,536
        Rows per message (array input) or per ``keys(start, stop)`` call (callable input).
    timeout : float, optional
        Seconds to wait for one shard call before that call fails and is retried on the next replica
        (default: no limit on a live shard's work).  A timed-out replica stays in use.  Whatever the
        timeout, a wait ends soon after the client closes (:class:`ClientClosedError`) or the shard's worker
        is lost (retry, or :class:`ShardError`).

    Attributes
    ----------
    shards : list of ShardInfo
        Rows, positions, workers and bytes of each shard.
    dim, value_dim : int
        E and Ev.
    dtype : numpy dtype
        float32 (float64 when the keys or values were float64).
    stats : dict
        Running totals: ``calls`` (shard calls), ``queries`` (query rows answered), ``bytes_sent`` and
        ``bytes_received`` (array payload, before serialisation framing), ``retries`` (calls re-sent to a
        replica).

    Raises
    ------
    ImportError
        Dask is not installed (at import of this module).
    TypeError, ValueError
        Bad arguments; the message names the argument.
    ShardError
        A shard could not be built.
    """

    def __init__(self, client: _dd.Client | str, keys: np.ndarray | Iterable[tuple] | Callable[[int, int], tuple],
                 values: np.ndarray | None = None, *, n_shards: int | None = None, selector: str = "topk",
                 key_positions: np.ndarray | None = None, n_keys: int | None = None, replicas: int = 1,
                 workers: Iterable[str] | None = None, batch_size: int = BATCH_SIZE, block_rows: int = SEND_ROWS,
                 timeout: float | None = None) -> None:
        self._closed = True
        self._futures: list[list[Any]] = []
        self._owns_client = False
        if isinstance(client, str):
            client = _dd.Client(client)
            self._owns_client = True
        elif not isinstance(client, _dd.Client):
            raise TypeError(f"client must be a distributed.Client or a scheduler address string; got "
                            f"{type(client).__name__}.")
        self.client = client
        try:
            self._setup(keys, values, n_shards, selector, key_positions, n_keys, replicas, workers, batch_size,
                        block_rows, timeout)
        except BaseException:
            self._release()
            raise
        self._closed = False

    # ------------------------------------------------------------------------------------ construction
    def _setup(self, keys, values, n_shards, selector, key_positions, n_keys, replicas, workers, batch_size,
               block_rows, timeout) -> None:
        if not isinstance(selector, str):
            raise TypeError(f"selector must be a spec string such as 'topk' or 'cluster:mode=block'; got "
                            f"{type(selector).__name__}.")
        self._template = get_selector(selector)  # a bad spec fails here, with the selector's own message
        self.selector = selector
        self.batch_size = _check_int(batch_size, "batch_size")
        block_rows = _check_int(block_rows, "block_rows")
        self.replicas = _check_int(replicas, "replicas")
        if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None; got {timeout!r}.")
        self.timeout = None if timeout is None else float(timeout)

        self._check_client()
        nthreads = self.client.nthreads()
        if workers is None:
            addrs = sorted(nthreads)
        else:
            addrs = [str(w) for w in workers]
            unknown = [w for w in addrs if w not in nthreads]
            if unknown or not addrs:
                raise ValueError(f"workers {unknown or addrs} are not workers of this cluster; known: "
                                 f"{sorted(nthreads)}.")
        if not addrs:
            raise ValueError("the cluster has no workers; start some (e.g. LocalCluster(n_workers=2)) first.")
        if self.replicas > len(addrs):
            raise ValueError(f"replicas={self.replicas} exceeds the {len(addrs)} workers; pass replicas <= "
                             f"{len(addrs)}.")

        is_array = isinstance(keys, np.ndarray) or (hasattr(keys, "__array__") and not callable(keys))
        if is_array:
            karr = _float2d(keys, "keys")
            if values is None:
                raise ValueError("values is required with an array of keys: pass values of shape (S, Ev).")
            varr = _float2d(values, "values")
            if varr.shape[0] != karr.shape[0]:
                raise ValueError(f"keys and values must have the same number of rows S; got keys {karr.shape} "
                                 f"and values {varr.shape}.")
            if n_keys is not None and int(n_keys) != karr.shape[0]:
                raise ValueError(f"n_keys={n_keys} disagrees with keys.shape[0] = {karr.shape[0]}; omit n_keys.")
            total = karr.shape[0]
            pos = None
            if key_positions is not None:
                pos = _int1d(key_positions, "key_positions", total)
                if total > 1 and bool(np.any(np.diff(pos) < 0)):
                    raise ValueError("key_positions must be non-decreasing (shards are position ranges); sort "
                                     "keys, values and key_positions by position first.")
        else:
            if values is not None:
                raise ValueError("values must be None when keys is an iterable or a callable of blocks: the "
                                 "blocks carry the values.")
            if key_positions is not None:
                raise ValueError("key_positions must be None when keys is an iterable or a callable: give "
                                 "positions as the third item of each block.")
            if n_keys is None:
                raise ValueError("n_keys is required when keys is an iterable or a callable of blocks (the "
                                 "shard ranges are fixed before the first block arrives).")
            if not callable(keys) and not isinstance(keys, Iterable):
                raise TypeError(f"keys must be an array, an iterable of blocks or a callable; got "
                                f"{type(keys).__name__}.")
            total = _check_int(n_keys, "n_keys")
        if total < 1:
            raise ValueError("keys must hold at least one row.")
        if n_shards is None:
            n_shards = min(len(addrs), total)
        n_shards = _check_int(n_shards, "n_shards")
        if n_shards > total:
            raise ValueError(f"n_shards={n_shards} exceeds the {total} keys; pass n_shards <= {total}.")

        self._n = total
        self._bounds = [(i * total) // n_shards for i in range(n_shards + 1)]
        self._actors: list[list[Any]] = []
        self._workers: list[list[str]] = []
        # Create every actor first, then fill them: shard i, replica r lives on worker (i + r) mod W.
        for i in range(n_shards):
            start, stop = self._bounds[i], self._bounds[i + 1]
            ws = [addrs[(i + r) % len(addrs)] for r in range(self.replicas)]
            futs = [self.client.submit(Shard, selector, stop - start, start, nthreads[w], actor=True,
                                       workers=[w], allow_other_workers=False, pure=False) for w in ws]
            self._futures.append(futs)
            self._workers.append(ws)
        self._actors = [[self._wait(f, i, "creating", r) for r, f in enumerate(futs)]
                        for i, futs in enumerate(self._futures)]

        if is_array:
            for i in range(n_shards):
                start, stop = self._bounds[i], self._bounds[i + 1]
                for lo in range(start, stop, block_rows):
                    hi = min(lo + block_rows, stop)
                    pb = None if pos is None else pos[lo:hi]
                    calls = [a.write(lo - start, karr[lo:hi], varr[lo:hi], pb) for a in self._actors[i]]
                    for r, c in enumerate(calls):
                        self._wait(c, i, "loading", r)
        elif callable(keys):
            calls = [(i, r, a.load(keys, block_rows)) for i in range(n_shards)
                     for r, a in enumerate(self._actors[i])]
            for i, r, c in calls:
                self._wait(c, i, "loading (keys(start, stop) on the worker)", r)
        else:
            self._stream(iter(keys))

        summaries = []
        calls = [[a.finalize() for a in actors] for actors in self._actors]
        for i, cs in enumerate(calls):
            summaries.append([self._wait(c, i, "building the selector of", r) for r, c in enumerate(cs)][0])
        first = summaries[0]
        for i, s in enumerate(summaries):
            if (s["E"], s["Ev"], s["dtype"]) != (first["E"], first["Ev"], first["dtype"]):
                raise ValueError(f"shard {i} has E={s['E']}, Ev={s['Ev']}, dtype {s['dtype']} but shard 0 has "
                                 f"E={first['E']}, Ev={first['Ev']}, dtype {first['dtype']}: every block must "
                                 f"have the same widths and dtype.")
            if i and s["first"] < summaries[i - 1]["last"]:
                raise ValueError("key_positions must be non-decreasing across the store (shards are position "
                                 "ranges); sort the blocks by position first.")
        self.dim = first["E"]
        self.value_dim = first["Ev"]
        self.dtype = np.dtype(first["dtype"])
        self.shards = [ShardInfo(i, self._bounds[i], self._bounds[i + 1], s["first"], s["last"],
                                 tuple(self._workers[i]), s["nbytes"]) for i, s in enumerate(summaries)]
        self._first = np.array([s.first_position for s in self.shards], dtype=np.int64)
        self._key_norm = max(s["key_norm"] for s in summaries)
        self._dead: dict[tuple[int, int], str] = {}
        self._order = [list(range(len(actors))) for actors in self._actors]
        self._lock = threading.Lock()
        self.stats = {"calls": 0, "queries": 0, "bytes_sent": 0, "bytes_received": 0, "retries": 0}

    def _stream(self, blocks: Iterator[Any]) -> None:
        """Send an iterable of blocks to the shards in order, holding one block at a time."""
        row = 0
        for block in blocks:
            kb, vb, pb = _split_block(block, "keys (an iterable of blocks)")
            n = kb.shape[0]
            if row + n > self._n:
                raise ValueError(f"the blocks hold more than n_keys={self._n} rows; pass the right n_keys.")
            calls = []
            lo = row
            while lo < row + n:
                i = int(np.searchsorted(self._bounds, lo, side="right")) - 1
                hi = min(row + n, self._bounds[i + 1])
                sl = slice(lo - row, hi - row)
                calls += [(i, r, a.write(lo - self._bounds[i], kb[sl], vb[sl], None if pb is None else pb[sl]))
                          for r, a in enumerate(self._actors[i])]
                lo = hi
            for i, r, c in calls:
                self._wait(c, i, "loading", r)
            row += n
        if row != self._n:
            raise ValueError(f"the blocks held {row} rows but n_keys={self._n}; pass the right n_keys.")

    def _wait(self, fut: Any, shard: int, action: str, replica: int | None = None) -> Any:
        """Result of one construction call to ``replica`` of ``shard``, within the store's timeout."""
        try:
            return self._await(fut, self.timeout, shard, replica)
        except ClientClosedError:
            raise
        except (ValueError, TypeError) as exc:  # the shard rejected its input: the caller's mistake
            raise type(exc)(f"shard {shard}: {exc}") from exc
        except Exception as exc:
            raise ShardError(f"{action} shard {shard} on worker(s) {self._workers[shard]} failed: "
                             f"{_describe(exc)}") from exc

    def _check_client(self) -> None:
        """Raise ClientClosedError unless the client can reach the cluster (checked before any blocking call)."""
        status = getattr(self.client, "status", "closed")
        if status != "running":
            raise ClientClosedError(
                f"the store's Dask client is {status}, not running, so the store cannot reach its shards (and "
                f"the cluster drops the shards of a closed client). Keep the client open while the store is in "
                f"use, or build a new ShardedKeyStore with a live client.")

    def _gone(self, i: int, r: int) -> str | None:
        """Why replica r of shard i is lost for good, from the cluster's own record; None while it is held."""
        futs = self._futures[i] if i < len(self._futures) else []
        status = futs[r].status if r < len(futs) else "finished"
        if status in _GONE:
            return f"its worker {self._workers[i][r]} was lost (the cluster reports the shard {status})"
        return None

    def _await(self, fut: Any, timeout: float | None, i: int | None = None, r: int | None = None) -> Any:
        """``fut.result()``, waited in short slices: ends with ClientClosedError once the client closes,
        ``_ShardGone`` once replica r of shard i is lost, TimeoutError after ``timeout`` seconds."""
        t0 = time.monotonic()
        while not fut.done():
            self._check_client()
            if r is not None and (why := self._gone(i, r)) is not None:
                raise _ShardGone(why)
            step = _POLL
            if timeout is not None:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError(f"no answer within timeout={timeout:g} s")
                step = min(step, left)
            try:
                return fut.result(timeout=step)
            except TimeoutError:
                continue  # the slice ran out (or the call itself raised TimeoutError: done, re-raised below)
        self._check_client()
        return fut.result(timeout=_POLL * 10)

    def _health(self, i: int, r: int) -> str | None:
        """Health check of replica r of shard i after a failed call: why it is lost for good, or None.

        Only a replica whose worker is gone, whose worker refuses the ping, or whose shard state is gone is
        lost; a slow or busy one (a timeout, or a ping unanswered within PING_TIMEOUT) is not condemned.
        """
        self._check_client()
        why = self._gone(i, r)
        if why is not None:
            return why
        try:
            built = self._await(self._actors[i][r].ping(), PING_TIMEOUT, i, r)
        except ClientClosedError:
            raise
        except _ShardGone as exc:
            return str(exc)
        except TimeoutError:
            return None  # busy (or slow to answer): not evidence of death
        except Exception as exc:
            return self._gone(i, r) or f"its worker {self._workers[i][r]} does not answer ({_describe(exc)})"
        return None if built else f"its shard state on worker {self._workers[i][r]} is gone (cleared)"

    # ----------------------------------------------------------------------------------------- queries
    def attend(self, queries: np.ndarray, k: int = 64, *, is_causal: bool = False,
               query_positions: np.ndarray | None = None, scale: float | None = None,
               batch_size: int | None = None, k_scope: str = "shard",
               timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Attention of every query over the whole store: per-shard results merged exactly.

        Parameters
        ----------
        queries : float array, shape (L, E)
            Cast to the store's dtype (float32 unless the store is float64).
        k : int >= 1
            Keys per query: per shard (``k_scope="shard"``) or over the whole store (``"store"``); ignored
            by attending selectors.
        is_causal : bool
            Key j is visible to query i only when ``key_positions[j] <= query_positions[i]``; shards whose
            first position is above a query's position are not asked at all.
        query_positions : int array (L,), optional
            Global positions (default ``arange(L)``, as in :func:`sparseattn.sparse_attention`); for L new
            tokens after a cache of S keys pass ``np.arange(S, S + L)``.
        scale : float, optional
            Score scale, default ``1 / sqrt(E)``.
        batch_size : int, optional
            Queries per shard call (default: the store's ``batch_size``).
        k_scope : {"shard", "store"}, default "shard"
            ``"shard"``: each shard attends over the k keys its selector picks among its own keys, one
            round trip; the answer is attention over the union of those selections (up to
            ``n_shards * k`` keys per query).  ``"store"``: the k best keys by ``q.k`` over the whole store,
            like a single selector over every key (for exact ``"topk"`` the single-process answer of
            ``sparse_attention(q, keys, values, "topk", k=k)``): each shard sends its selection's scores,
            the client ranks them and asks each shard for attention over its share; two round trips, and
            only for selectors that rank keys by score.
        timeout : float, optional
            Seconds to wait for each shard call of this attend (default: the store's ``timeout``).  A call
            that times out is retried on the shard's next replica; the replica itself stays in use.

        Returns
        -------
        output : array (L, Ev), the store's dtype
        lse : array (L,), the store's dtype; ``-inf`` (and a zero output row) where no key was visible

        Raises
        ------
        ValueError, TypeError
            Bad arguments, named; among them queries whose scores could overflow the store's dtype
            (``|q| * max |k| * max(|scale|, 1)`` beyond its largest value), refused before anything is sent.
        ClientClosedError
            The store's client is closed: checked before any call is sent, and while waiting.
        ShardError
            A shard failed on every replica (worker lost, computation raised, timeout): the answer would
            be partial, so none is returned.  A replica is dropped for good only when its worker is lost
            (or its shard state is gone); after a timeout or an error of a live worker, later calls use it
            again.

        Notes
        -----
        No wait is unbounded by a fault: while a shard call runs, the client and the shard's worker are
        checked every fraction of a second, so the call ends with an error soon after either is lost.
        """
        self._check_open()
        self._check_client()
        q = _float2d(queries, "queries")
        if q.shape[1] != self.dim:
            raise ValueError(f"queries must have E = {self.dim} features like the keys; got shape {q.shape}.")
        if not np.isfinite(q).all():
            raise ValueError("queries must be finite (no NaN or inf).")
        with np.errstate(over="ignore"):  # beyond the store dtype's range: refused just below
            qc = np.ascontiguousarray(q, dtype=self.dtype)
        if not np.isfinite(qc).all():
            raise ValueError(f"queries exceed {self.dtype.name}'s range, the store's dtype (largest magnitude "
                             f"{float(np.abs(q).max()):.3g}); scale the queries down, or build the store from "
                             f"float64 keys and values.")
        q = qc
        k = _check_int(k, "k")
        if not isinstance(is_causal, (bool, np.bool_)):
            raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")
        L = q.shape[0]
        qpos = (np.arange(L, dtype=np.int64) if query_positions is None
                else _int1d(query_positions, "query_positions", L))
        if scale is None:
            scale = 1.0 / math.sqrt(self.dim)
        elif (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)
              or scale == 0):
            raise ValueError(f"scale must be a finite non-zero number; got {scale!r}.")
        fmax = float(np.finfo(self.dtype).max)
        if abs(float(scale)) > fmax:
            raise ValueError(f"scale={scale:g} overflows the store's dtype {self.dtype.name}; pass a smaller "
                             f"scale, or build the store from float64 keys and values.")
        self._check_scores(q, float(scale), fmax)
        bs = self.batch_size if batch_size is None else _check_int(batch_size, "batch_size")
        if timeout is None:
            timeout = self.timeout
        elif isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None (the store's timeout); "
                             f"got {timeout!r}.")
        timeout = None if timeout is None else float(timeout)

        if k_scope not in ("shard", "store"):
            raise ValueError(f"k_scope must be 'shard' (each shard picks k keys) or 'store' (the k best keys of "
                             f"the whole store); got {k_scope!r}.")
        if k_scope == "store" and (self._template.attends or not self._template.fills_small_rows):
            raise ValueError(f"k_scope='store' needs a selector that ranks keys by score (topk, faiss-*, "
                             f"cluster:mode=topk, ...); {self.selector!r} does not. Use k_scope='shard'.")

        out = np.zeros((L, self.value_dim), dtype=self.dtype)
        lse = np.full(L, -np.inf, dtype=self.dtype)
        # Dispatch every (batch, shard) call before waiting on any, so the shards work in parallel with
        # full queues; then merge batch by batch.
        batches = []
        for lo in range(0, L, bs):
            hi = min(lo + bs, L)
            parts = []
            for i in range(self.n_shards):
                rows = (np.nonzero(qpos[lo:hi] >= self._first[i])[0] if is_causal
                        else np.arange(hi - lo))
                if rows.size == 0:
                    continue  # causal: the whole shard is in the future of these queries
                qr = np.ascontiguousarray(q[lo:hi][rows])
                pr = np.ascontiguousarray(qpos[lo:hi][rows])
                if k_scope == "shard":
                    args: tuple = (qr, k, bool(is_causal), pr, float(scale))
                    parts.append((i, rows, args, self._call(i, "attend", args)))
                else:
                    args = (qr, k, bool(is_causal), pr)
                    parts.append((i, rows, args, self._call(i, "select", args)))
            batches.append((lo, hi, parts))
        if k_scope == "store":
            batches = [(lo, hi, self._store_topk(parts, hi - lo, k, float(scale), timeout))
                       for lo, hi, parts in batches]
        for lo, hi, parts in batches:
            if parts:  # else no key is visible to any query of this batch: zeros and -inf stay
                out[lo:hi], lse[lo:hi] = self._merge(parts, hi - lo, "attend" if k_scope == "shard" else "attend_ids",
                                                     timeout)
        return out, lse

    def _check_scores(self, q: np.ndarray, scale: float, fmax: float) -> None:
        """Refuse queries whose scores could overflow the store's dtype, before anything is sent.

        Every product, partial sum and score of ``q . k * scale`` (in either order of the scaling) is bounded
        by ``|q| * max_j |k_j| * max(|scale|, 1)`` (Cauchy-Schwarz), so below the dtype's largest value no
        score can overflow on any shard.
        """
        if not q.size or self._key_norm == 0:
            return
        qn = _max_row_norm(q)
        bound = qn * self._key_norm * max(abs(scale), 1.0)
        if bound > fmax:
            raise ValueError(
                f"queries could overflow the attention scores in {self.dtype.name}, the store's dtype: the "
                f"largest query norm {qn:.3g} times the largest key norm {self._key_norm:.3g} times "
                f"max(|scale|, 1) = {max(abs(scale), 1.0):.3g} is {bound:.3g}, beyond {fmax:.3g}. Scale the "
                f"queries down (or pass a smaller scale), or build the store from float64 keys and values.")

    def _store_topk(self, parts: list, n: int, k: int, scale: float, timeout: float | None) -> list:
        """Second round of k_scope="store": each query's k best keys over all shards, asked of their shards."""
        results = [self._result(i, "select", args, call, timeout) for i, rows, args, call in parts]
        width = sum(r[0].shape[1] for r in results)
        scores = np.full((n, width), -np.inf, dtype=self.dtype)
        gid = np.full((n, width), np.iinfo(np.int64).max, dtype=np.int64)
        label = np.full((n, width), -1, dtype=np.int64)
        local = np.full((n, width), -1, dtype=np.int64)
        off = 0
        for p, ((i, rows, _, _), (sc, ids)) in enumerate(zip(parts, results, strict=True)):
            w = sc.shape[1]
            if sc.shape[0] != rows.size or ids.shape != sc.shape:
                raise ShardError(f"shard {i} returned selections of shape {sc.shape} / {ids.shape}; expected "
                                 f"({rows.size}, w).")
            ok = ids >= 0
            cols = slice(off, off + w)
            scores[rows, cols] = sc
            gid[rows, cols] = np.where(ok, ids.astype(np.int64) + self.shards[i].start, gid[rows, cols])
            label[rows, cols] = np.where(ok, p, -1)
            local[rows, cols] = ids
            off += w
        # Rank by score, ties to the lower store row (as the single-process exact top-k does).
        order = np.lexsort((gid, -scores), axis=-1)[:, :k]
        chosen = np.take_along_axis(scores, order, axis=1) > -np.inf
        chosen_label = np.take_along_axis(label, order, axis=1)
        chosen_local = np.take_along_axis(local, order, axis=1)
        second = []
        big = np.iinfo(np.int64).max
        for p, (i, rows, args, _) in enumerate(parts):
            mine = chosen[rows] & (chosen_label[rows] == p)
            if not mine.any():
                continue
            ids = np.sort(np.where(mine, chosen_local[rows], big), axis=1)
            indptr = np.zeros(rows.size + 1, dtype=np.int64)
            np.cumsum(mine.sum(axis=1), out=indptr[1:])
            args2 = (args[0], indptr, ids[ids != big].astype(np.int32), scale)
            second.append((i, rows, args2, self._call(i, "attend_ids", args2)))
        return second

    def _merge(self, parts: list, n: int, method: str, timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Wait for one batch's shard results and merge them; every expected shard must have answered."""
        outs = np.zeros((len(parts), n, self.value_dim), dtype=self.dtype)
        lses = np.full((len(parts), n), -np.inf, dtype=self.dtype)
        merged = 0
        for p, (i, rows, args, call) in enumerate(parts):
            o, ls = self._result(i, method, args, call, timeout)
            if o.shape != (rows.size, self.value_dim) or ls.shape != (rows.size,):
                raise ShardError(f"shard {i} returned shapes {o.shape} and {ls.shape}; expected "
                                 f"{(rows.size, self.value_dim)} and {(rows.size,)}.")
            outs[p, rows] = o
            lses[p, rows] = ls
            merged += 1
        if merged != len(parts):
            raise ShardError(f"merged {merged} shard results; expected {len(parts)}.")
        with self._lock:
            self.stats["queries"] += n
        return merge_attention(outs, lses)

    def _live(self, i: int) -> list[int]:
        """Replicas of shard i not found lost, in order of preference."""
        with self._lock:
            return [r for r in self._order[i] if (i, r) not in self._dead]

    def _submit(self, i: int, r: int, method: str, args: tuple) -> tuple[Any, BaseException | None]:
        """Send one call to replica r of shard i: (future, None), or (None, the error) if it could not go."""
        try:
            return getattr(self._actors[i][r], method)(*args), None
        except Exception as exc:  # e.g. dask's "Worker holding Actor was lost" for a worker gone since
            return None, exc

    def _call(self, i: int, method: str, args: tuple) -> tuple[int, Any, BaseException | None]:
        live = self._live(i)
        if not live:
            raise self._lost(i, [])
        r = live[0]
        with self._lock:
            self.stats["calls"] += 1
            self.stats["bytes_sent"] += sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        return (r, *self._submit(i, r, method, args))

    def _result(self, i: int, method: str, args: tuple, call: tuple[int, Any, BaseException | None],
                timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """The answer of shard i, retried on its other live replicas after a failure.

        A failed replica is dropped only when its health check says it is lost (:meth:`_health`); a
        timeout or an error of a healthy replica fails this call only.
        """
        r, fut, err = call
        tried = [r]
        failures: list[str] = []
        while True:
            if fut is not None:
                try:
                    res = self._await(fut, timeout, i, r)
                    err = None
                except ClientClosedError:
                    raise
                except (ValueError, TypeError) as exc:  # the shard's own checks refused the input
                    raise type(exc)(f"queries refused by shard {i}: {exc}") from exc
                except Exception as exc:
                    err = exc
                if err is None:
                    a, b = (np.asarray(x) for x in res)
                    with self._lock:
                        self.stats["bytes_received"] += a.nbytes + b.nbytes
                    return a, b
            why = self._health(i, r)
            with self._lock:
                if why is not None:
                    self._dead[(i, r)] = why
                elif len(self._order[i]) > 1:  # alive but failed: ask the other replicas first next time
                    self._order[i].remove(r)
                    self._order[i].append(r)
            if why is not None:
                state = f"dropped: {why}"
            elif isinstance(err, TimeoutError):
                state = ("the worker is alive and may still be computing the abandoned call, which later calls "
                         "to it wait behind; the replica stays in use")
            else:
                state = "the worker is alive; the replica stays in use"
            failures.append(f"replica {r} on {self._workers[i][r]}: {_describe(err)} ({state})")
            nxt = [x for x in self._live(i) if x not in tried]
            if not nxt:
                raise self._lost(i, failures) from err
            r = nxt[0]
            tried.append(r)
            with self._lock:
                self.stats["retries"] += 1
            fut, err = self._submit(i, r, method, args)

    def _lost(self, i: int, failures: list[str]) -> ShardError:
        s = self.shards[i]
        dropped = [f"replica {r} on {self._workers[i][r]}: {why}" for (j, r), why in list(self._dead.items()) if j == i]
        cause = "; ".join(failures) if failures else "every replica was lost earlier: " + "; ".join(dropped)
        alive = len(self._live(i))
        advice = (f"{alive} replica(s) are still alive: the call can be repeated (raise timeout= if it timed "
                  f"out)" if alive else "no replica is left: rebuild the store (ShardedKeyStore(...)) on live "
                  "workers, or build it with replicas=2 to survive a worker loss")
        return ShardError(
            f"shard {i} (rows [{s.start}, {s.stop}), positions [{s.first_position}, {s.last_position}]) on "
            f"worker(s) {list(s.workers)} failed ({cause}). No partial answer is returned; {advice}.")

    # ------------------------------------------------------------------------------------ housekeeping
    def __len__(self) -> int:
        return self._n

    @property
    def n_shards(self) -> int:
        """Number of shards."""
        return len(self._bounds) - 1

    @property
    def nbytes(self) -> int:
        """Bytes of keys, values and positions over all shards, one replica (selector indexes come on top)."""
        return sum(s.nbytes for s in self.shards)

    def worker_memory(self) -> dict[str, int]:
        """Resident set size in bytes of each worker process holding a live replica of a shard."""
        self._check_open()
        targets: dict[str, tuple[int, int]] = {}
        for i in range(self.n_shards):
            for r in self._live(i):
                targets.setdefault(self._workers[i][r], (i, r))
        sizes = self._ask(list(targets.values()), "memory", "measuring memory of")
        return {w: int(v) for w, v in zip(targets, sizes, strict=True) if v is not None}

    def busy_seconds(self) -> list[float]:
        """Seconds each shard (first live replica) has spent computing in attend, in shard order.

        With the wall time of :meth:`attend` this splits a call into compute and overhead (scheduling,
        serialisation, transfer, merge).  Shards with no live replica are left out.
        """
        self._check_open()
        found: dict[int, float] = {}
        pending = [i for i in range(self.n_shards) if self._live(i)]
        while pending:
            got = self._ask([(i, self._live(i)[0]) for i in pending], "busy_seconds", "reading the timers of")
            found.update((i, float(v)) for i, v in zip(pending, got, strict=True) if v is not None)
            pending = [i for i in pending if i not in found and self._live(i)]
        return [found[i] for i in sorted(found)]

    def _ask(self, targets: list[tuple[int, int]], method: str, action: str) -> list[Any]:
        """One argument-free call per (shard, replica), sent together; None for a replica found lost."""
        self._check_client()
        calls = [(i, r, *self._submit(i, r, method, ())) for i, r in targets]
        out = []
        for i, r, fut, err in calls:
            if fut is not None:
                try:
                    out.append(self._await(fut, self.timeout, i, r))
                    continue
                except ClientClosedError:
                    raise
                except Exception as exc:
                    err = exc
            why = self._health(i, r)
            if why is None:
                raise ShardError(f"{action} shard {i} on worker {self._workers[i][r]} failed: "
                                 f"{_describe(err)}") from err
            with self._lock:
                self._dead[(i, r)] = why
            out.append(None)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the store is closed; build a new ShardedKeyStore.")

    def _release(self) -> None:
        if getattr(self.client, "status", "closed") == "running":  # else the cluster dropped the shards
            calls = []
            for actors in getattr(self, "_actors", []):
                for a in actors:
                    try:
                        calls.append(a.clear())
                    except Exception:  # a lost worker holds nothing any more
                        pass
            deadline = time.monotonic() + 10.0
            for c in calls:
                try:
                    c.result(timeout=max(0.01, deadline - time.monotonic()))
                except Exception:
                    pass
        for futs in self._futures:
            for f in futs:
                try:
                    f.release()
                except Exception:  # a closed client has released them already
                    pass
        self._futures = []
        self._actors = []
        if self._owns_client:
            self.client.close()

    def close(self) -> None:
        """Free the shards on the workers (and close the client if the store opened it); idempotent."""
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self) -> ShardedKeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_shards} shards, {self.nbytes / 2**20:.1f} MiB"
        return f"ShardedKeyStore({self._n} keys, selector={self.selector!r}, {state})"
