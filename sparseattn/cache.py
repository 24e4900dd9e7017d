"""A growing key/value cache for long-context decoding, with an incremental index so each step reads a few
per cent of it.

Layout per kv head (slots of one contiguous array, each slot holding one key, its value and its position)::

    [ sinks | segment 0 | ... | segment s | open segment | tail ]
      exact    routed: clustered once, keys    routed,         exact: the newest keys (>= window
               stored in cluster order         re-clustered    of them), not yet clustered
                                               as it grows

* ``append`` writes new keys into the tail.  When the tail holds ``segment + window`` keys beyond the
  closed segments, the oldest ``segment`` of them are clustered on their own (spherical k-means on the
  segment's centred keys, about ``cluster_size`` keys per cluster), reordered in place into cluster
  order, and their routing vectors (member means) join the head's routed set for good.  In between, the
  *open segment* (the next, partly filled segment) is re-clustered each time the tail gains
  ``open_step`` keys, so the exact tail stays below ``open_step + window`` keys.  Nothing outside the
  open segment is ever clustered twice.
* ``attend`` scores a query against every routing vector of its kv head at once, takes the ``n_probe``
  best clusters, and computes one online softmax over sinks + tail (exact) + the chosen clusters: every
  key counted exactly once, since the routed segments and the exact part hold disjoint positions.  The
  whole step (all heads, all query tokens) is one Numba call.

Other selectors share the storage: ``"pages"`` (Quest: per page of ``page_size`` keys the element-wise
min and max, updated on append; the ``n_probe`` pages of largest bound ``sum_e max(q_e min_e, q_e max_e)``
are attended), ``"window"`` (sinks + recent window only), ``"topk"`` (exact top-k over the whole cache:
the accuracy reference, reads everything) and ``"dense"`` (every key: exact attention).

Estimation zone (``selector="cluster"``, ``estimate=N``): the ``N`` clusters ranked right after the
``n_probe`` routed ones are not read but *estimated* from statistics kept per cluster when it is made
(key count ``n_c``, member mean key ``μ_c`` = its routing vector, member mean value ``v̄_c``): the cluster
enters the online softmax as one pseudo-key of score ``scale·q·μ_c + log n_c`` and value ``v̄_c``, i.e.
``n_c·exp(scale·q·μ_c)`` stands for ``Σ_j exp(scale·q·k_j)``.  By Jensen's inequality this is at most
the true sum (exp of the mean under-estimates the mean of exp), so the estimate is biased low, least for
tight clusters.  Clusters holding a key the row may not see (a later position, or an evicted one) are
never estimated.  Clusters beyond ``n_probe + N`` are ignored, as before.

Memory cap: ``max_keys`` with ``policy="streaming"`` keeps the ``sinks`` first positions and the newest
``max_keys - sinks`` (StreamingLLM); older keys are masked at once and their storage is freed a segment at
a time, so the bytes held stay below ``max_keys + segment + window`` keys.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .inputs import check_positive_int, check_scale, overflow_message
from .threads import executor, get_num_threads, single_threaded_blas

__all__ = ["KVCache"]

_SELECTORS = ("cluster", "pages", "window", "topk", "dense")
_POLICIES = ("streaming",)
_BF16_NAMES = ("bfloat16", "bf16")
_INT32_MAX = 2**31 - 1
# Keys scored per call below which the kernel runs on one thread: a parallel launch waits for every
# worker thread, and on a busy shared machine a descheduled worker costs up to a scheduler time slice
# (measured ~10-20 ms per step at load average 9 on 2 cores, for a step of ~1 ms of work).
PARALLEL_MIN_KEYS = 32768


# ---------------------------------------------------------------------------------------- conversions
def _is_torch(x: object) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and type(x).__name__ in ("Tensor", "Parameter")


def _to_numpy(x: object, name: str) -> np.ndarray:
    """numpy view of an array-like or a torch CPU tensor (bfloat16 tensors are widened to float32)."""
    if _is_torch(x):
        t = x.detach()
        if t.device.type != "cpu":
            raise ValueError(f"{name} is a torch tensor on {t.device}; KVCache runs on the CPU. "
                             f"Pass {name}.cpu().")
        import torch

        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:  # e.g. ml_dtypes bfloat16 seen as void
        raise TypeError(f"{name}: unsupported dtype {arr.dtype}; pass float16/32/64.")
    return arr


def _check_float(arr: np.ndarray, name: str) -> None:
    if arr.dtype.kind != "f" or arr.dtype.type not in (np.float16, np.float32, np.float64):
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {arr.dtype}. "
                        f"Convert with {name}.astype(np.float32).")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _resolve_storage(dtype: object) -> tuple[str, np.dtype]:
    """(storage name, numpy dtype of the stored arrays) for ``dtype``."""
    if isinstance(dtype, str) and dtype.lower() in _BF16_NAMES:
        return "bfloat16", np.dtype(np.uint16)
    if type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
        if name == "bfloat16":
            return "bfloat16", np.dtype(np.uint16)
        dtype = name
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt == np.float32:
        return "float32", dt
    if dt == np.float16:
        return "float16", dt
    raise ValueError(f"dtype must be numpy.float32, numpy.float16 or 'bfloat16' (storage; accumulation is "
                     f"float32 in every case); got {dtype!r}.")


# ---------------------------------------------------------------------------------------- clustering
def cluster_segment(keys: np.ndarray, n_clusters: int, *, seed: int = 0, niter: int = 5) -> np.ndarray:
    """Cluster labels of one segment's keys: spherical k-means on the centred keys
    (:class:`sparseattn.index.cluster.ClusterIndex`, single-threaded; callers parallelise over heads).

    Parameters
    ----------
    keys : (n, E) float32
    n_clusters : int >= 1

    Returns
    -------
    labels : (n,) int64 in ``[0, n_clusters)``: each key's centroid of largest inner product with the
    centred key (the same as the largest cosine).
    """
    from .index.cluster import ClusterIndex

    n = keys.shape[0]
    c = max(1, min(n_clusters, n))
    if c == 1:
        return np.zeros(n, dtype=np.int64)
    index = ClusterIndex(n_clusters=c, n_probe=1, n_iter=niter, seed=seed, spherical=True, assign="ip",
                         n_threads=1).build(np.ascontiguousarray(keys, dtype=np.float32))
    return index.assignment_.astype(np.int64)


# ---------------------------------------------------------------------------------------------- cache
class KVCache:
    """Key/value cache for autoregressive decoding with sparse attention over an incremental index.

    Parameters
    ----------
    num_heads : int
        Query heads H.
    head_dim : int
        Query/key dimension E.
    num_kv_heads : int, optional
        Key/value heads H_kv (default H); H must be a multiple (grouped-query attention: query head h
        reads kv head ``h // (H // H_kv)``).
    value_dim : int, optional
        Value dimension Ev (default E).
    selector : {"cluster", "pages", "window", "topk", "dense"}, default "cluster"
        How each step picks keys beyond the exact sinks + window (see the module docstring).
    dtype : numpy.float32, numpy.float16 or "bfloat16", default float32
        Storage of keys and values (bfloat16 is held as uint16 bit patterns); scores and sums are
        float32 in every case.  Appended inputs are rounded to it.
    sinks : int, default 4
        The first ``sinks`` positions are always attended exactly (and never evicted).
    window : int, default 64
        The newest ``window`` positions are always attended exactly.
    max_keys : int, optional
        Memory cap in keys (``policy="streaming"``): attend only to the ``sinks`` first and the
        ``max_keys - sinks`` newest positions.  Must be >= ``sinks + window``.
    policy : {"streaming"}, default "streaming"
    segment : int, default 4096
        Keys clustered together once the tail holds ``segment + window`` keys (multiple of
        ``page_size``; 4,096-16,384 recommended).  The exact tail averages ``segment / 2 + window`` keys.
    open_step : int, optional
        Granularity of the open segment (default ``segment // 2``): once the tail holds ``open_step +
        window`` keys beyond it, the open segment (the newest, not yet full segment) is re-clustered with
        them, so the exact tail stays below ``open_step + window`` keys; a full segment is closed and
        never clustered again.  ``open_step = segment`` turns the open segment off.
    n_probe : int, optional
        Clusters (``"cluster"``, default 32) or pages (``"pages"``, default 128) attended per query.
    estimate : int, default 0
        ``"cluster"`` only: clusters per query estimated from their statistics after the ``n_probe``
        routed ones (see the module docstring); 0 = off.
    cluster_size : int, default 64
        Mean keys per cluster: each segment gets ``segment // cluster_size`` clusters.
    page_size : int, default 16
        Keys per page of the ``"pages"`` selector.
    scale : float, optional
        Score scale, > 0 (default ``1 / sqrt(E)``).
    seed : int, default 0
        Seed of the k-means of every segment (the same keys always give the same clusters).
    parallel : bool, optional
        Run the step's rows (heads x tokens) on Numba's threads (``True``) or on one thread (``False``);
        default: parallel when the step scores at least ``PARALLEL_MIN_KEYS`` keys in total.

    Examples
    --------
    >>> import numpy as np
    >>> from sparseattn.cache import KVCache
    >>> rng = np.random.default_rng(0)
    >>> cache = KVCache(num_heads=4, head_dim=16, segment=256, cluster_size=16, n_probe=4)
    >>> cache.append(rng.standard_normal((4, 1000, 16)), rng.standard_normal((4, 1000, 16)))
    >>> out = cache.attend(rng.standard_normal((4, 1, 16)).astype(np.float32))
    >>> len(cache), out.shape, out.dtype
    (1000, (4, 1, 16), dtype('float32'))
    """

    def __init__(self, num_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
                 value_dim: int | None = None, selector: str = "cluster", dtype: object = np.float32,
                 sinks: int = 4, window: int = 64, max_keys: int | None = None, policy: str = "streaming",
                 segment: int = 4096, open_step: int | None = None, n_probe: int | None = None,
                 estimate: int = 0, cluster_size: int = 64,
                 page_size: int = 16, scale: float | None = None, seed: int = 0,
                 parallel: bool | None = None) -> None:
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else check_positive_int(
            num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention.")
        self.value_dim = self.head_dim if value_dim is None else check_positive_int(value_dim, "value_dim")
        if selector not in _SELECTORS:
            raise ValueError(f"selector must be one of {_SELECTORS}; got {selector!r}.")
        self.selector = selector
        self.storage, self._sdtype = _resolve_storage(dtype)
        self.sinks = check_positive_int(sinks, "sinks", minimum=0)
        self.window = check_positive_int(window, "window", minimum=0)
        self.page_size = check_positive_int(page_size, "page_size")
        self.segment = check_positive_int(segment, "segment", minimum=self.page_size)
        if self.segment % self.page_size:
            raise ValueError(f"segment ({self.segment}) must be a multiple of page_size ({self.page_size}).")
        self.cluster_size = check_positive_int(cluster_size, "cluster_size")
        self.open_step = self.segment // 2 if open_step is None else check_positive_int(open_step, "open_step")
        if self.open_step > self.segment:
            raise ValueError(f"open_step ({self.open_step}) must be <= segment ({self.segment}).")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}; got {policy!r}.")
        self.policy = policy
        self.max_keys = None if max_keys is None else check_positive_int(max_keys, "max_keys")
        if self.max_keys is not None and self.max_keys < self.sinks + max(self.window, 1):
            raise ValueError(f"max_keys ({self.max_keys}) must be >= sinks + window "
                             f"({self.sinks} + {self.window}); raise max_keys or lower window.")
        self.estimate = check_positive_int(estimate, "estimate", minimum=0)
        if self.estimate and selector != "cluster":
            raise ValueError(f"estimate applies to selector='cluster' only; got selector={selector!r} with "
                             f"estimate={self.estimate}. Pass estimate=0.")
        default_probe = {"cluster": 32, "pages": 128}.get(selector, 0)
        self.n_probe = default_probe if n_probe is None else check_positive_int(n_probe, "n_probe")
        self.scale = check_scale(scale, self.head_dim)
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0; got {scale!r}.")
        self.seed = int(seed)
        self.parallel = None if parallel is None else bool(parallel)
        hk, E, Ev = self.num_kv_heads, self.head_dim, self.value_dim
        self._n = 0  # positions appended so far (the next key's position)
        self._slots = 0  # slots in use
        self._cap = 0
        self._K = np.zeros((hk, 0, E), self._sdtype)
        self._V = np.zeros((hk, 0, Ev), self._sdtype)
        self._pos = np.zeros((hk, 0), np.int32)
        self._seg_end = 0  # cluster: end of the closed segments
        self._open_end = 0  # cluster: first tail slot; [seg_end, open_end) is the open segment
        self._closed_cent = np.zeros(hk, np.int64)  # routing vectors of the closed segments, per kv head
        self._segments: list[tuple[int, np.ndarray]] = []  # (first slot, first centroid per kv head)
        self._cent = np.zeros((hk, 0, E), np.uint16)  # routing vectors, float16 bit patterns
        self._cptr = np.zeros((hk, 1), np.int64)
        self._n_cent = np.zeros(hk, np.int64)
        self._cvmean = np.zeros((hk, 0, Ev), np.float32)  # per cluster: mean value (estimation zone)
        self._cminpos = np.zeros((hk, 0), np.int32)  # per cluster: smallest and largest key position
        self._cmaxpos = np.zeros((hk, 0), np.int32)
        self._pmin = np.zeros((hk, 0, E), self._sdtype)
        self._pmax = np.zeros((hk, 0, E), self._sdtype)
        self._stats: dict[str, Any] = {
            "appends": 0, "append_seconds": 0.0, "cluster_seconds": 0.0, "segments_clustered": 0,
            "attends": 0, "attend_seconds": 0.0, "kernel_seconds": 0.0, "keys_read_per_query": 0.0,
            "keys_read_max": 0, "evicted_keys": 0, "clusters_estimated_per_query": 0.0,
        }

    # ------------------------------------------------------------------------------------- metadata
    def __len__(self) -> int:
        """Keys attendable now: every appended key, or ``sinks + (max_keys - sinks)`` under the cap."""
        if self.max_keys is None or self._n <= self.max_keys:
            return self._n
        return self.max_keys

    def __repr__(self) -> str:
        return (f"KVCache(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim="
                f"{self.head_dim}, value_dim={self.value_dim}, selector={self.selector!r}, dtype="
                f"{self.storage}, len={len(self)}, segments={len(self._segments)})")

    @property
    def positions_appended(self) -> int:
        """Positions appended so far (the position the next key will get)."""
        return self._n

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values (slots in use)."""
        return self._slots * self.num_kv_heads * (self.head_dim + self.value_dim) * self._sdtype.itemsize

    @property
    def index_nbytes(self) -> int:
        """Bytes of everything beyond the keys and values: positions, routing vectors, page bounds."""
        hk = self.num_kv_heads
        total = self._slots * hk * 4  # int32 position per slot
        if self.selector == "cluster":
            total += int(self._n_cent.sum()) * (self.head_dim * 2 + 8 + 8 + 4 * self.value_dim)
        if self.selector == "pages":
            total += 2 * self._n_pages() * hk * self.head_dim * self._sdtype.itemsize
        return total

    @property
    def nbytes(self) -> int:
        """Bytes held for the slots in use: keys, values and index (``kv_nbytes + index_nbytes``)."""
        return self.kv_nbytes + self.index_nbytes

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and timings: appends, seconds in append / clustering / attend (and in the kernel),
        keys read per query of the last attend (mean and max), segments, clusters, evicted keys, bytes."""
        out = dict(self._stats)
        out.update(segments=len(self._segments), open_segment_keys=self._open_end - self._seg_end,
                   clusters_per_head=float(self._n_cent.mean()),
                   tail_keys=self._slots - self._tail_start(), len=len(self), kv_nbytes=self.kv_nbytes,
                   index_nbytes=self.index_nbytes,
                   append_us_per_token=(1e6 * self._stats["append_seconds"] / self._n) if self._n else 0.0)
        return out

    def positions(self, kv_head: int = 0) -> np.ndarray:
        """Sorted positions (int64) of the keys kv head ``kv_head`` can attend to now."""
        p = self._pos[kv_head, :self._slots].astype(np.int64)
        lo = self._lo_pos()
        return np.sort(p[(p < self.sinks) | (p >= lo)])

    # ------------------------------------------------------------------------------------- internals
    def _lo_pos(self) -> int:
        """First non-sink position still attended (everything before it, sinks apart, is evicted)."""
        if self.max_keys is None or self._n <= self.max_keys:
            return 0
        return self._n - (self.max_keys - self.sinks)

    def _tail_start(self) -> int:
        return self._open_end if self.selector == "cluster" else min(self.sinks, self._slots)

    def _n_pages(self) -> int:
        span = max(self._slots - self.sinks, 0)
        return (span + self.page_size - 1) // self.page_size

    def _reserve(self, extra: int) -> None:
        need = self._slots + extra
        if need <= self._cap:
            return
        new_cap = max(need + self.segment, int(self._cap * 1.5))  # headroom: a prompt, then steps
        if self.max_keys is not None:
            new_cap = max(need, min(new_cap, self.max_keys + 2 * self.segment + self.window + self.sinks))
        new_cap = -(-new_cap // self.page_size) * self.page_size
        hk = self.num_kv_heads
        for name, width in (("_K", self.head_dim), ("_V", self.value_dim)):
            old = getattr(self, name)
            arr = np.empty((hk, new_cap, width), self._sdtype)
            arr[:, :self._slots] = old[:, :self._slots]
            setattr(self, name, arr)
        pos = np.empty((hk, new_cap), np.int32)
        pos[:, :self._slots] = self._pos[:, :self._slots]
        self._pos = pos
        if self.selector == "pages":
            n_pages = -(-new_cap // self.page_size) + 1
            for name in ("_pmin", "_pmax"):
                old = getattr(self, name)
                arr = np.zeros((hk, n_pages, self.head_dim), self._sdtype)
                arr[:, :old.shape[1]] = old
                setattr(self, name, arr)
        self._cap = new_cap

    def _encode(self, x: np.ndarray, name: str) -> np.ndarray:
        """Round validated float input to the storage dtype (float16 overflow -> ValueError)."""
        if self.storage == "bfloat16":
            bits = _bf16_bits(x)
            if (bits & 0x7F80 == 0x7F80).any():
                raise ValueError(f"{name} has values beyond bfloat16's range (|x| > 3.39e38 after rounding); "
                                 f"use dtype=np.float32 storage.")
            return bits
        with np.errstate(over="ignore"):
            out = np.asarray(x, dtype=self._sdtype)
        if self.storage == "float16" and x.dtype != np.float16 and not np.isfinite(out).all():
            raise ValueError(f"{name} has values beyond float16's range (|x| > 65504); use dtype=np.float32 "
                             f"or 'bfloat16' storage.")
        return out

    def _decode(self, x: np.ndarray) -> np.ndarray:
        """Stored values as float32."""
        if self.storage == "bfloat16":
            return _bf16_to_f32(x)
        return x.astype(np.float32)

    def _validate_kv(self, keys: object, values: object) -> tuple[np.ndarray, np.ndarray]:
        k = _to_numpy(keys, "keys")
        v = _to_numpy(values, "values")
        _check_float(k, "keys")
        _check_float(v, "values")
        hk, E, Ev = self.num_kv_heads, self.head_dim, self.value_dim
        if k.ndim != 3 or k.shape[0] != hk or k.shape[2] != E:
            raise ValueError(f"keys must have shape (num_kv_heads={hk}, T, head_dim={E}); got {k.shape}.")
        if v.ndim != 3 or v.shape[0] != hk or v.shape[2] != Ev:
            raise ValueError(f"values must have shape (num_kv_heads={hk}, T, value_dim={Ev}); got {v.shape}.")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"keys and values must hold the same number of tokens T; got keys T={k.shape[1]} "
                             f"and values T={v.shape[1]}.")
        if k.shape[1] == 0:
            raise ValueError("keys and values must hold at least one token (T >= 1); got T = 0.")
        for arr, name in ((k, "keys"), (v, "values")):
            if not np.isfinite(arr).all():
                bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
                raise ValueError(f"{name} contains NaN or Inf (first at index {bad}); clean the input.")
        return k, v

    # ---------------------------------------------------------------------------------------- append
    def append(self, keys: object, values: object) -> None:
        """Append T new tokens (positions ``len .. len + T - 1``) for every kv head.

        Parameters
        ----------
        keys : float array or torch CPU tensor, shape (H_kv, T, E), T >= 1
        values : float array or torch CPU tensor, shape (H_kv, T, Ev)
            Rounded to the storage dtype.  A long prompt is one append; full segments are clustered
            during the call.

        Raises
        ------
        ValueError
            Wrong shapes (naming the argument and the expected shape), T = 0, NaN or Inf, float16 overflow.
        TypeError
            Non-float dtypes.
        """
        t0 = time.perf_counter()
        k, v = self._validate_kv(keys, values)
        T = k.shape[1]
        if self._n + T > _INT32_MAX:
            raise ValueError(f"the cache holds positions as int32: at most {_INT32_MAX} tokens in total.")
        ks = self._encode(k, "keys")
        vs = self._encode(v, "values")
        done = 0
        while done < T:
            # bounded pieces: under a memory cap, storage is freed between pieces
            step = T - done
            if self.max_keys is not None:
                step = min(step, self.segment)
            self._reserve(step)
            a, b = self._slots, self._slots + step
            self._K[:, a:b] = ks[:, done:done + step]
            self._V[:, a:b] = vs[:, done:done + step]
            self._pos[:, a:b] = np.arange(self._n, self._n + step, dtype=np.int32)
            self._slots = b
            self._n += step
            done += step
            if self.selector == "pages":
                self._update_pages(a, b)
            if self.selector == "cluster":
                self._cluster_full_segments()
            self._evict()
        self._stats["appends"] += 1
        self._stats["append_seconds"] += time.perf_counter() - t0

    def _update_pages(self, a: int, b: int) -> None:
        """Recompute the min/max of the pages holding slots [a, b) (pages start at slot ``sinks``)."""
        s0 = self.sinks  # pages start at slot `sinks`
        a = max(a, s0)
        if a >= b:
            return
        P = self.page_size
        p0 = (a - s0) // P
        p1 = (b - s0 + P - 1) // P
        start = s0 + p0 * P
        full = (b - start) // P
        if full:
            blk = self._K[:, start:start + full * P].reshape(self.num_kv_heads, full, P, self.head_dim)
            if self.storage == "bfloat16":
                f = _bf16_to_f32(blk)
                self._pmin[:, p0:p0 + full] = _bf16_bits(f.min(axis=2))
                self._pmax[:, p0:p0 + full] = _bf16_bits(f.max(axis=2))
            else:
                self._pmin[:, p0:p0 + full] = blk.min(axis=2)
                self._pmax[:, p0:p0 + full] = blk.max(axis=2)
        if p0 + full < p1:  # the last, partial page
            blk = self._K[:, start + full * P:b]
            f = self._decode(blk) if self.storage == "bfloat16" else blk
            lo, hi = f.min(axis=1), f.max(axis=1)
            if self.storage == "bfloat16":
                lo, hi = _bf16_bits(lo), _bf16_bits(hi)
            self._pmin[:, p0 + full] = lo
            self._pmax[:, p0 + full] = hi

    def _cluster_full_segments(self) -> None:
        """Close every segment the tail can fill, then grow the open segment by whole ``open_step``s.

        The result depends only on the keys appended, not on how appends were split: a segment is
        clustered from its keys in position order, the open segment likewise.
        """
        if self._seg_end < self.sinks:
            self._seg_end = self._open_end = min(self.sinks, self._slots)
        if self._slots < self.sinks:
            return
        t0 = time.perf_counter()
        changed = False
        while self._slots - self._seg_end >= self.segment + self.window:
            self._cluster_one(self._seg_end, self._seg_end + self.segment, closed=True)
            self._seg_end += self.segment
            self._open_end = self._seg_end
            self._stats["segments_clustered"] += 1
            changed = True
        step = self.open_step
        grow = ((self._slots - self._open_end - self.window) // step) * step
        grow = min(grow, ((self.segment - 1 - (self._open_end - self._seg_end)) // step) * step)
        if grow > 0:
            self._cluster_one(self._seg_end, self._open_end + grow, closed=False)
            self._open_end += grow
            changed = True
        if changed:
            self._stats["cluster_seconds"] += time.perf_counter() - t0

    def _cluster_one(self, a: int, b: int, *, closed: bool) -> None:
        """Cluster slots [a, b) of every kv head, reorder them by cluster, add their routing vectors
        (replacing those of the open segment, which [a, b) always contains)."""
        hk = self.num_kv_heads
        n_clusters = max(1, (b - a) // self.cluster_size)
        firsts = self._closed_cent.copy()
        self._n_cent[:] = self._closed_cent  # the open segment's routing vectors are recomputed
        for g in range(hk):  # back to position order: the clusters depend on the keys only
            if b - a > 1 and np.any(np.diff(self._pos[g, a:b]) < 0):
                order0 = np.argsort(self._pos[g, a:b], kind="stable")
                self._K[g, a:b] = self._K[g, a:b][order0]
                self._V[g, a:b] = self._V[g, a:b][order0]
                self._pos[g, a:b] = self._pos[g, a:b][order0]
        xs = [self._decode(self._K[g, a:b]) for g in range(hk)]
        n_threads = min(get_num_threads(), hk)
        with single_threaded_blas():  # parallel over heads, not inside BLAS (oversubscription: ~10x slower)
            if n_threads > 1:  # one head per worker, each k-means single-threaded (FAISS releases the GIL)
                all_labels = list(executor(n_threads).map(
                    lambda x: cluster_segment(x, n_clusters, seed=self.seed), xs))
            else:
                all_labels = [cluster_segment(x, n_clusters, seed=self.seed) for x in xs]
        for g in range(hk):
            x, labels = xs[g], all_labels[g]
            order = np.argsort(labels, kind="stable")
            counts = np.bincount(labels, minlength=n_clusters)
            live = counts > 0
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[live]
            sums = np.add.reduceat(x[order].astype(np.float64), starts, axis=0)
            means = (sums / counts[live, None]).astype(np.float32)
            self._K[g, a:b] = self._K[g, a:b][order]
            self._V[g, a:b] = self._V[g, a:b][order]
            self._pos[g, a:b] = self._pos[g, a:b][order]
            vsum = np.add.reduceat(self._decode(self._V[g, a:b]).astype(np.float64), starts, axis=0)
            seg_pos = self._pos[g, a:b]
            nc = int(self._n_cent[g])
            self._grow_centroids(nc + means.shape[0])
            m = means.shape[0]
            self._cvmean[g, nc:nc + m] = (vsum / counts[live, None]).astype(np.float32)
            self._cminpos[g, nc:nc + m] = np.minimum.reduceat(seg_pos, starts)
            self._cmaxpos[g, nc:nc + m] = np.maximum.reduceat(seg_pos, starts)
            self._cent[g, nc:nc + means.shape[0]] = means.astype(np.float16).view(np.uint16)
            self._cptr[g, nc + 1:nc + 1 + means.shape[0]] = a + np.cumsum(counts[live])
            self._cptr[g, nc] = a
            self._n_cent[g] = nc + means.shape[0]
        if closed:
            self._segments.append((a, firsts))
            self._closed_cent = self._n_cent.copy()

    def _grow_centroids(self, need: int) -> None:
        if need <= self._cent.shape[1]:
            return
        hk, E = self.num_kv_heads, self.head_dim
        cap = max(need, 2 * self._cent.shape[1], 64)
        cent = np.zeros((hk, cap, E), np.uint16)
        cent[:, :self._cent.shape[1]] = self._cent
        cptr = np.zeros((hk, cap + 1), np.int64)
        cptr[:, :self._cptr.shape[1]] = self._cptr
        self._cent, self._cptr = cent, cptr
        cvm = np.zeros((hk, cap, self.value_dim), np.float32)
        cvm[:, :self._cvmean.shape[1]] = self._cvmean
        cmin = np.zeros((hk, cap), np.int32)
        cmin[:, :self._cminpos.shape[1]] = self._cminpos
        cmax = np.zeros((hk, cap), np.int32)
        cmax[:, :self._cmaxpos.shape[1]] = self._cmaxpos
        self._cvmean, self._cminpos, self._cmaxpos = cvm, cmin, cmax

    def _evict(self) -> None:
        """Free storage of keys older than the cap (whole segments, or page-aligned runs)."""
        lo = self._lo_pos()
        if lo == 0:
            return
        self._stats["evicted_keys"] = self._n - len(self)
        s0 = min(self.sinks, self._slots)
        if self.selector == "cluster":
            drop = 0
            while drop < len(self._segments):
                start = self._segments[drop][0]
                stop = self._segments[drop + 1][0] if drop + 1 < len(self._segments) else self._seg_end
                # positions in a segment are contiguous: dead when its newest position is evicted
                if int(self._pos[0, start:stop].max()) >= lo:
                    break
                drop += 1
            if drop == 0:
                return
            n_slots = (self._segments[drop][0] if drop < len(self._segments) else self._seg_end) - s0
            n_cent = np.array([self._segments[drop][1][g] if drop < len(self._segments) else self._n_cent[g]
                               for g in range(self.num_kv_heads)], np.int64)
            self._shift_slots(s0, n_slots)
            for g in range(self.num_kv_heads):
                c, total = int(n_cent[g]), int(self._n_cent[g])
                self._cent[g, :total - c] = self._cent[g, c:total]
                self._cvmean[g, :total - c] = self._cvmean[g, c:total]
                self._cminpos[g, :total - c] = self._cminpos[g, c:total]
                self._cmaxpos[g, :total - c] = self._cmaxpos[g, c:total]
                self._cptr[g, :total - c + 1] = self._cptr[g, c:total + 1] - n_slots
                self._n_cent[g] = total - c
            self._segments = [(a - n_slots, f - n_cent) for a, f in self._segments[drop:]]
            self._seg_end -= n_slots
            self._open_end -= n_slots
            self._closed_cent -= n_cent
            return
        else:
            dead = int(np.searchsorted(self._pos[0, s0:self._slots], lo))  # position-ordered storage
            dead -= dead % self.page_size
            if dead < self.segment:
                return
            self._shift_slots(s0, dead)
            if self.selector == "pages":
                n_p = dead // self.page_size
                for name in ("_pmin", "_pmax"):
                    arr = getattr(self, name)
                    arr[:, :arr.shape[1] - n_p] = arr[:, n_p:].copy()

    def _shift_slots(self, start: int, n: int) -> None:
        """Delete slots [start, start + n) by moving the later slots down."""
        end = self._slots
        for arr in (self._K, self._V, self._pos):
            arr[:, start:end - n] = arr[:, start + n:end].copy()
        self._slots -= n

    def selected_slots(self, query: object, head: int, k: int = 64, *, selector: str | None = None
                       ) -> np.ndarray:
        """Storage slots the step of one query token of head ``head`` reads (for measuring recall).

        ``query`` is (E,) at the newest position; the result is sorted int64 slot ids of kv head
        ``head // (H // H_kv)``, with the same selection as :meth:`attend` (``cluster``: routed clusters by
        a stable sort, so ties at the last routed score may differ from the kernel's heap).  ``selector``
        overrides the cache's as in :meth:`attend`.
        """
        sel_name = selector or self.selector
        q = np.asarray(_to_numpy(query, "query"), np.float32).reshape(self.head_dim)
        g = head // (self.num_heads // self.num_kv_heads)
        n_slots, s0 = self._slots, min(self.sinks, self._slots)
        pos = self._pos[g, :n_slots].astype(np.int64)
        lo = self._lo_pos()
        visible = (pos < self.sinks) | (pos >= lo)
        parts = [np.arange(s0)]
        if sel_name == "cluster":
            parts.append(np.arange(self._open_end, n_slots))
            nc = int(self._n_cent[g])
            if nc:
                sc = self._cent[g, :nc].view(np.float16).astype(np.float32) @ q
                top = np.argsort(-sc, kind="stable")[:self.n_probe]
                parts += [np.arange(self._cptr[g, c], self._cptr[g, c + 1]) for c in top]
        elif sel_name == "pages":
            ex_lo = max(s0, n_slots - self.window)
            parts.append(np.arange(ex_lo, n_slots))
            n_pages = -(-(ex_lo - s0) // self.page_size)
            if n_pages:
                mn = self._decode(self._pmin[g, :n_pages]) if self.storage == "bfloat16" else \
                    self._pmin[g, :n_pages].astype(np.float32)
                mx = self._decode(self._pmax[g, :n_pages]) if self.storage == "bfloat16" else \
                    self._pmax[g, :n_pages].astype(np.float32)
                bound = np.maximum(q * mn, q * mx).sum(axis=1)
                last = np.minimum(s0 + (np.arange(n_pages) + 1) * self.page_size, ex_lo) - 1
                bound[pos[last] < lo] = -np.inf
                for b in np.argsort(-bound, kind="stable")[:self.n_probe]:
                    if bound[b] > -np.inf:
                        parts.append(np.arange(s0 + b * self.page_size,
                                               min(s0 + (b + 1) * self.page_size, ex_lo)))
        elif sel_name == "window":
            parts.append(np.arange(max(s0, n_slots - self.window), n_slots))
        elif sel_name == "topk":
            kd = self._decode(self._K[g, :n_slots])
            sc = np.where(visible, kd @ q, -np.inf)
            parts = [np.argsort(-sc, kind="stable")[:k]]
        else:
            parts.append(np.arange(s0, n_slots))
        sel = np.unique(np.concatenate(parts).astype(np.int64))
        return sel[visible[sel]]

    # ---------------------------------------------------------------------------------------- attend
    def attend(self, queries: object, k: int = 64, *, return_lse: bool = False, selector: str | None = None
               ) -> Any:
        """Attention of the newest T_q positions' queries over the cache.

        Query t sits at position ``n - T_q + t`` (n = positions appended so far): causal among the
        queries and over the cache.  Call ``append`` with the step's own key and value first.

        Parameters
        ----------
        queries : float array or torch CPU tensor, shape (H, T_q, E), or (H, E) for one token
        k : int, default 64
            Keys per query of the ``"topk"`` selector (the other selectors use ``n_probe``).
        return_lse : bool, default False
            Also return the log-sum-exp of each row's scaled scores (``-inf`` for a row with no key).
        selector : {None, "dense", "topk", "window"}, optional
            Override the cache's selector for this call (these three work on any cache): ``"dense"`` is
            the exact step over every key, ``"topk"`` exact top-k attention.

        Returns
        -------
        out : float32 (H, T_q, Ev) (or (H, Ev)); a torch tensor when ``queries`` is one
        lse : float32 (H, T_q) (or (H,)), with ``return_lse=True``

        Raises
        ------
        ValueError
            Wrong shape, NaN/Inf queries, or scores overflowing float32.
        """
        t0 = time.perf_counter()
        torch_in = _is_torch(queries)
        q = _to_numpy(queries, "queries")
        _check_float(q, "queries")
        squeeze = q.ndim == 2
        if squeeze:
            q = q[:, None, :]
        H, E = self.num_heads, self.head_dim
        if q.ndim != 3 or q.shape[0] != H or q.shape[2] != E or q.shape[1] < 1:
            raise ValueError(f"queries must have shape (num_heads={H}, T_q >= 1, head_dim={E}) or "
                             f"(num_heads, head_dim); got {q.shape}.")
        if not np.isfinite(q).all():
            raise ValueError("queries contains NaN or Inf; clean the input.")
        k = check_positive_int(k, "k")
        if selector not in (None, self.selector, "dense", "topk", "window"):
            raise ValueError(f"selector must be None, 'dense', 'topk' or 'window' (the cache's own is "
                             f"{self.selector!r}); got {selector!r}.")
        q = np.ascontiguousarray(q, dtype=np.float32)
        T = q.shape[1]
        qpos = np.arange(self._n - T, self._n, dtype=np.int64)
        out, lse, nread, nest = self._run(q, qpos, k, selector or self.selector)
        if np.isposinf(lse).any():
            raise ValueError(overflow_message(np.float32, self.scale))
        self._stats["attends"] += 1
        self._stats["keys_read_per_query"] = float(nread.mean())
        self._stats["keys_read_max"] = int(nread.max())
        self._stats["clusters_estimated_per_query"] = float(nest.mean())
        if squeeze:
            out, lse = out[:, 0], lse[:, 0]
        if torch_in:
            import torch

            out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        self._stats["attend_seconds"] += time.perf_counter() - t0
        return (out, lse) if return_lse else out

    def _run(self, q: np.ndarray, qpos: np.ndarray, k: int, sel: str
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        from .kernels import decode as kd

        H, T = q.shape[0], q.shape[1]
        out = np.empty((H, T, self.value_dim), np.float32)
        lse = np.empty((H, T), np.float32)
        nread = np.empty(H * T, np.int64)
        nest = np.zeros(H * T, np.int64)
        n_est = self.estimate if sel == "cluster" else 0
        s0 = min(self.sinks, self._slots)
        n_slots = self._slots
        hi = _INT32_MAX
        n_probe = self.n_probe
        mode = kd.MODE_NONE
        ex_lo = s0
        if sel == "cluster":
            mode, ex_lo, hi = kd.MODE_CLUSTER, self._open_end, _INT32_MAX
        elif sel == "pages":
            ex_lo = max(s0, n_slots - self.window)
            mode = kd.MODE_PAGES
            hi = int(self._pos[0, ex_lo]) if ex_lo < n_slots else _INT32_MAX
        elif sel == "window":
            ex_lo = max(s0, n_slots - self.window)
        elif sel == "topk":
            mode, n_probe = kd.MODE_TOPK, k
        if sel == "cluster":
            work = (n_slots - ex_lo + s0 + self.n_probe * self.cluster_size) * H * T
        elif sel == "pages":
            work = (self.window + s0 + self.n_probe * self.page_size + self._n_pages() // 8) * H * T
        elif sel == "window":
            work = (self.window + s0) * H * T
        else:
            work = n_slots * H * T
        parallel = self.parallel if self.parallel is not None else work >= PARALLEL_MIN_KEYS
        if self.storage == "bfloat16":
            fn = kd.decode_parallel_bf16 if parallel else kd.decode_serial_bf16
        else:
            fn = kd.decode_parallel if parallel else kd.decode_serial
        rep = self.num_heads // self.num_kv_heads
        t1 = time.perf_counter()
        K, V, pmin, pmax = self._K, self._V, self._pmin, self._pmax
        if self.storage == "float16":  # the kernel reads float16 as uint16 bit patterns
            K, V, pmin, pmax = (a.view(np.uint16) for a in (K, V, pmin, pmax))
        fn(q, qpos, rep, K, V, self._pos, s0, ex_lo, n_slots, self._lo_pos(), hi, mode,
           n_probe, self._cent, self._cptr, self._n_cent, pmin, pmax, self.page_size,
           np.float32(self.scale), n_est, self._cvmean, self._cminpos, self._cmaxpos, out, lse, nread, nest)
        self._stats["kernel_seconds"] += time.perf_counter() - t1
        return out, lse, nread, nest

