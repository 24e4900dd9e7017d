"""The client side of the Dask key store: :class:`ShardedKeyStore` (see :mod:`sparseattn.distributed`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import distributed as _dd
import numpy as np

from ..attention.merge import merge_attention
from ..selectors import get_selector
from ..selectors.registry import parse_spec
from .checks import BATCH_SIZE, SEND_ROWS, check_int, float2d, int1d, max_row_norm, split_block
from .replicas import Replicas, ShardError
from .shard import ShardInfo

__all__ = ["ShardedKeyStore", "check_scores", "keys_source", "store_topk", "stream_blocks",
           "worker_addresses"]


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
        Running totals (see :attr:`stats`).

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
        self._owns_client = False
        if isinstance(client, str):
            client = _dd.Client(client)
            self._owns_client = True
        elif not isinstance(client, _dd.Client):
            raise TypeError(f"client must be a distributed.Client or a scheduler address string; got "
                            f"{type(client).__name__}.")
        self.client = client
        self._rep = Replicas(client, None)
        try:
            self._setup(keys, values, n_shards, selector, key_positions, n_keys, replicas, workers, batch_size,
                        block_rows, timeout)
        except BaseException:
            self._rep.release()
            if self._owns_client:
                client.close()
            raise
        self._closed = False

    def _setup(self, keys, values, n_shards, selector, key_positions, n_keys, replicas, workers, batch_size,
               block_rows, timeout) -> None:
        if not isinstance(selector, str):
            raise TypeError(f"selector must be a spec string such as 'topk' or 'cluster:mode=block'; got "
                            f"{type(selector).__name__}.")
        self._template = get_selector(selector)  # a bad spec fails here, with the selector's own message
        self.selector = selector
        self.batch_size = check_int(batch_size, "batch_size")
        block_rows = check_int(block_rows, "block_rows")
        self.replicas = check_int(replicas, "replicas")
        if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None; got {timeout!r}.")
        self.timeout = self._rep.timeout = None if timeout is None else float(timeout)
        self._rep.check_client()
        nthreads = self.client.nthreads()
        addrs = worker_addresses(nthreads, workers, self.replicas)
        karr, varr, pos, total = keys_source(keys, values, key_positions, n_keys)
        if n_shards is None:
            n_shards = min(len(addrs), total)
        n_shards = check_int(n_shards, "n_shards")
        if n_shards > total:
            raise ValueError(f"n_shards={n_shards} exceeds the {total} keys; pass n_shards <= {total}.")
        if n_shards > 1 and any(name == "sinks" and "positions" not in prm for name, prm in parse_spec(selector)):
            # each shard would pick the g lowest positions of its own keys: g sinks per shard, silently
            raise ValueError(f"selector {selector!r}: 'sinks' with g picks the g lowest positions of each shard, "
                             f"not of the store; with n_shards={n_shards} give the sink positions, e.g. "
                             f"'sinks:positions=0;1;2;3', or pass n_shards=1.")
        self._n = total
        self._bounds = [(i * total) // n_shards for i in range(n_shards + 1)]
        self._rep.spawn(self._bounds, addrs, self.replicas, selector, nthreads)
        if karr is not None:
            self._send(karr, varr, pos, block_rows)
        elif callable(keys):
            calls = [(i, r, a.load(keys, block_rows)) for i in range(n_shards) for r, a in self._rep.each(i)]
            for i, r, c in calls:
                self._rep.wait(c, i, "loading (keys(start, stop) on the worker)", r)
        else:
            stream_blocks(self._rep, self._bounds, iter(keys))
        self._finish()

    def _send(self, karr: np.ndarray, varr: np.ndarray, pos: np.ndarray | None, block_rows: int) -> None:
        """Send the arrays' rows to their shards, ``block_rows`` at a time."""
        for i in range(self.n_shards):
            start, stop = self._bounds[i], self._bounds[i + 1]
            for lo in range(start, stop, block_rows):
                hi = min(lo + block_rows, stop)
                pb = None if pos is None else pos[lo:hi]
                calls = [a.write(lo - start, karr[lo:hi], varr[lo:hi], pb) for _, a in self._rep.each(i)]
                for r, c in enumerate(calls):
                    self._rep.wait(c, i, "loading", r)

    def _finish(self) -> None:
        """Build every shard's selector and check the shards agree (widths, dtype, position order)."""
        summaries = []
        calls = [[a.finalize() for a in actors] for actors in self._rep.actors]
        for i, cs in enumerate(calls):
            summaries.append([self._rep.wait(c, i, "building the selector of", r) for r, c in enumerate(cs)][0])
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
        self.shards = self._rep.shards = [
            ShardInfo(i, self._bounds[i], self._bounds[i + 1], s["first"], s["last"], tuple(self._rep.workers[i]),
                      s["nbytes"]) for i, s in enumerate(summaries)]
        self._first = np.array([s.first_position for s in self.shards], dtype=np.int64)
        self._key_norm = max(s["key_norm"] for s in summaries)

    @property
    def stats(self) -> dict[str, int]:
        """Running totals: ``calls`` (shard calls), ``queries`` (query rows answered), ``bytes_sent`` and
        ``bytes_received`` (array payload, before serialisation framing), ``retries`` (calls re-sent to a
        replica)."""
        return self._rep.stats

    def actor(self, shard: int, replica: int = 0) -> Any:
        """The Dask actor handle of ``replica`` of ``shard`` (for tests and benchmarks: its calls bypass the
        store's retries and counters)."""
        return self._rep.actors[shard][replica]

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
        self._rep.check_client()
        q, k, qpos, scale, bs, timeout = self._attend_args(queries, k, is_causal, query_positions, scale,
                                                          batch_size, k_scope, timeout)
        L = q.shape[0]
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
                    parts.append((i, rows, args, self._rep.call(i, "attend", args)))
                else:
                    args = (qr, k, bool(is_causal), pr)
                    parts.append((i, rows, args, self._rep.call(i, "select", args)))
            batches.append((lo, hi, parts))
        if k_scope == "store":
            batches = [(lo, hi, store_topk(self._rep, parts, hi - lo, k, scale, timeout, self.dtype))
                       for lo, hi, parts in batches]
        for lo, hi, parts in batches:
            if parts:  # else no key is visible to any query of this batch: zeros and -inf stay
                out[lo:hi], lse[lo:hi] = self._merge(parts, hi - lo, "attend" if k_scope == "shard" else "attend_ids",
                                                     timeout)
        return out, lse

    def _attend_args(self, queries: Any, k: Any, is_causal: Any, query_positions: Any, scale: Any, batch_size: Any,
                     k_scope: Any, timeout: Any) -> tuple[np.ndarray, int, np.ndarray, float, int, float | None]:
        """The arguments of :meth:`attend` checked: (queries (L, E) in the store's dtype, k, positions (L,)
        int64, scale, batch size, timeout); TypeError / ValueError naming the argument."""
        q = float2d(queries, "queries")
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
        k = check_int(k, "k")
        if not isinstance(is_causal, (bool, np.bool_)):
            raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")
        L = q.shape[0]
        qpos = (np.arange(L, dtype=np.int64) if query_positions is None
                else int1d(query_positions, "query_positions", L))
        if scale is None:
            scale = 1.0 / math.sqrt(self.dim)
        elif (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)
              or scale == 0):
            raise ValueError(f"scale must be a finite non-zero number; got {scale!r}.")
        fmax = float(np.finfo(self.dtype).max)
        if abs(float(scale)) > fmax:
            raise ValueError(f"scale={scale:g} overflows the store's dtype {self.dtype.name}; pass a smaller "
                             f"scale, or build the store from float64 keys and values.")
        check_scores(q, float(scale), self._key_norm, self.dtype)
        bs = self.batch_size if batch_size is None else check_int(batch_size, "batch_size")
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
        return q, k, qpos, float(scale), bs, timeout

    def _merge(self, parts: list, n: int, method: str, timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Wait for one batch's shard results and merge them; every expected shard must have answered."""
        outs = np.zeros((len(parts), n, self.value_dim), dtype=self.dtype)
        lses = np.full((len(parts), n), -np.inf, dtype=self.dtype)
        merged = 0
        for p, (i, rows, args, call) in enumerate(parts):
            o, ls = self._rep.result(i, method, args, call, timeout)
            if o.shape != (rows.size, self.value_dim) or ls.shape != (rows.size,):
                raise ShardError(f"shard {i} returned shapes {o.shape} and {ls.shape}; expected "
                                 f"{(rows.size, self.value_dim)} and {(rows.size,)}.")
            outs[p, rows] = o
            lses[p, rows] = ls
            merged += 1
        if merged != len(parts):
            raise ShardError(f"merged {merged} shard results; expected {len(parts)}.")
        with self._rep.lock:
            self._rep.stats["queries"] += n
        return merge_attention(outs, lses)

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
            for r in self._rep.live(i):
                targets.setdefault(self._rep.workers[i][r], (i, r))
        sizes = self._rep.ask(list(targets.values()), "memory", "measuring memory of")
        return {w: int(v) for w, v in zip(targets, sizes, strict=True) if v is not None}

    def busy_seconds(self) -> list[float]:
        """Seconds each shard (first live replica) has spent computing in attend, in shard order.

        With the wall time of :meth:`attend` this splits a call into compute and overhead (scheduling,
        serialisation, transfer, merge).  Shards with no live replica are left out.
        """
        self._check_open()
        found: dict[int, float] = {}
        pending = [i for i in range(self.n_shards) if self._rep.live(i)]
        while pending:
            got = self._rep.ask([(i, self._rep.live(i)[0]) for i in pending], "busy_seconds", "reading the timers of")
            found.update((i, float(v)) for i, v in zip(pending, got, strict=True) if v is not None)
            pending = [i for i in pending if i not in found and self._rep.live(i)]
        return [found[i] for i in sorted(found)]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the store is closed; build a new ShardedKeyStore.")

    def close(self) -> None:
        """Free the shards on the workers (and close the client if the store opened it); idempotent."""
        if not self._closed:
            self._closed = True
            self._rep.release()
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> ShardedKeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_shards} shards, {self.nbytes / 2**20:.1f} MiB"
        return f"ShardedKeyStore({self._n} keys, selector={self.selector!r}, {state})"


def worker_addresses(nthreads: dict[str, int], workers: Iterable[str] | None, replicas: int) -> list[str]:
    """The worker addresses a store uses (``workers``, or every worker of ``nthreads``), checked against the
    cluster and against ``replicas`` (ValueError naming the argument)."""
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
    if replicas > len(addrs):
        raise ValueError(f"replicas={replicas} exceeds the {len(addrs)} workers; pass replicas <= "
                         f"{len(addrs)}.")
    return addrs


def keys_source(keys: Any, values: Any, key_positions: Any, n_keys: Any
                ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, int]:
    """(keys (S, E), values (S, Ev), positions (S,) int64 or None, S) of array input, or (None, None, None,
    n_keys) for an iterable or a callable of blocks; TypeError / ValueError naming the argument."""
    karr = varr = pos = None
    if isinstance(keys, np.ndarray) or (hasattr(keys, "__array__") and not callable(keys)):
        karr = float2d(keys, "keys")
        if values is None:
            raise ValueError("values is required with an array of keys: pass values of shape (S, Ev).")
        varr = float2d(values, "values")
        if varr.shape[0] != karr.shape[0]:
            raise ValueError(f"keys and values must have the same number of rows S; got keys {karr.shape} "
                             f"and values {varr.shape}.")
        if n_keys is not None and int(n_keys) != karr.shape[0]:
            raise ValueError(f"n_keys={n_keys} disagrees with keys.shape[0] = {karr.shape[0]}; omit n_keys.")
        total = karr.shape[0]
        if key_positions is not None:
            pos = int1d(key_positions, "key_positions", total)
            if total > 1 and bool(np.any(pos[1:] < pos[:-1])):  # not np.diff: it can overflow int64
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
        total = check_int(n_keys, "n_keys")
    if total < 1:
        raise ValueError("keys must hold at least one row.")
    return karr, varr, pos, total


def check_scores(q: np.ndarray, scale: float, key_norm: float, dtype: np.dtype) -> None:
    """Refuse queries (L, E) whose scores could overflow the store's ``dtype``, before anything is sent.

    Every product, partial sum and score of ``q . k * scale`` (in either order of the scaling) is bounded
    by ``|q| * max_j |k_j| * max(|scale|, 1)`` (Cauchy-Schwarz), so below the dtype's largest value no
    score can overflow on any shard.
    """
    fmax = float(np.finfo(dtype).max)
    if not q.size or key_norm == 0:
        return
    qn = max_row_norm(q)
    bound = qn * key_norm * max(abs(scale), 1.0)
    if bound > fmax:
        raise ValueError(
            f"queries could overflow the attention scores in {dtype.name}, the store's dtype: the "
            f"largest query norm {qn:.3g} times the largest key norm {key_norm:.3g} times "
            f"max(|scale|, 1) = {max(abs(scale), 1.0):.3g} is {bound:.3g}, beyond {fmax:.3g}. Scale the "
            f"queries down (or pass a smaller scale), or build the store from float64 keys and values.")


def store_topk(rep: Replicas, parts: list, n: int, k: int, scale: float, timeout: float | None,
               dtype: np.dtype) -> list:
    """Second round of ``k_scope="store"``: each query's k best keys over all shards, asked of their shards.

    ``parts`` are the first round's (shard, query rows, args, call); returns the second round's calls."""
    results = [rep.result(i, "select", args, call, timeout) for i, rows, args, call in parts]
    width = sum(r[0].shape[1] for r in results)
    scores = np.full((n, width), -np.inf, dtype=dtype)
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
        gid[rows, cols] = np.where(ok, ids.astype(np.int64) + rep.shards[i].start, gid[rows, cols])
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
        second.append((i, rows, args2, rep.call(i, "attend_ids", args2)))
    return second


def stream_blocks(rep: Replicas, bounds: list[int], blocks: Iterator[Any]) -> None:
    """Send an iterable of blocks to the shards of row ranges ``bounds`` in order, holding one block at a
    time (ValueError unless they hold ``bounds[-1]`` rows in all)."""
    row = 0
    for block in blocks:
        kb, vb, pb = split_block(block, "keys (an iterable of blocks)")
        n = kb.shape[0]
        if row + n > bounds[-1]:
            raise ValueError(f"the blocks hold more than n_keys={bounds[-1]} rows; pass the right n_keys.")
        calls = []
        lo = row
        while lo < row + n:
            i = int(np.searchsorted(bounds, lo, side="right")) - 1
            hi = min(row + n, bounds[i + 1])
            sl = slice(lo - row, hi - row)
            calls += [(i, r, a.write(lo - bounds[i], kb[sl], vb[sl], None if pb is None else pb[sl]))
                      for r, a in enumerate(rep.actors[i])]
            lo = hi
        for i, r, c in calls:
            rep.wait(c, i, "loading", r)
        row += n
    if row != bounds[-1]:
        raise ValueError(f"the blocks held {row} rows but n_keys={bounds[-1]}; pass the right n_keys.")
