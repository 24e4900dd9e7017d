"""The worker side of the Dask key store: :class:`Shard`, the state one worker holds for one shard (keys,
values, positions, the built selector), and :class:`ShardInfo`, what the client knows of it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..attention.sparse import sparse_attention
from ..pattern import SparsePattern
from ..selectors import get_selector
from ..threads import threads
from .checks import SEND_ROWS, max_row_norm, split_block

__all__ = ["Shard", "ShardInfo"]


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
            kb, vb, pb = split_block(block, "keys(start, stop)")
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
        if pos.size > 1 and bool(np.any(pos[1:] < pos[:-1])):  # not np.diff: it can overflow int64
            raise ValueError("key_positions must be non-decreasing within the store; sort keys, values and "
                             "key_positions by position first.")
        with threads(self.n_threads):
            self.selector = get_selector(self.spec).build(self.keys)
        nbytes = self.keys.nbytes + self.values.nbytes + (0 if self.positions is None else self.positions.nbytes)
        norm = max((max_row_norm(self.keys[lo:lo + SEND_ROWS]) for lo in range(0, self.n_rows, SEND_ROWS)),
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

