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

Index selectors (a spec string such as ``"faiss-hnsw:M=16"``: any selector of
:mod:`sparseattn.selectors` that declares ``supports_add``): one selector object per kv head, built on
the keys of the first append (once it has enough keys for the backend; until then every key is
attended exactly) and grown with ``add()`` on every later append, never rebuilt per call.  Each query
attends the sinks and the newest ``window`` keys exactly plus the selector's top-``k`` (``attend(k=...)``)
among the other keys it may see (causal, not evicted): candidates are fetched with a margin, filtered by
position and re-ranked exactly, and the search is widened when the filter leaves fewer than ``k``.  Evicted
keys stay in the backend index (FAISS graphs cannot delete) but are filtered out; the index is rebuilt
from the live keys once the evicted ones outnumber them (amortised, at most once per ``max_keys``
evictions).  An IVF index keeps the lists it was trained on at its first build (``nlist=None``: about
``4 sqrt(S)`` for the S keys of the first append), so append the prompt first or set ``nlist``.

Estimation zone (``selector="cluster"``, ``estimate=N``): the ``N`` clusters ranked right after the
``n_probe`` routed ones are not read but *estimated* from statistics kept per cluster when it is made
(key count ``n_c``, member mean key ``μ_c`` = its routing vector, member mean value ``v̄_c``): the cluster
enters the online softmax as one pseudo-key of score ``scale·q·μ_c + log n_c`` and value ``v̄_c``, i.e.
``n_c·exp(scale·q·μ_c)`` stands for ``Σ_j exp(scale·q·k_j)``.  By Jensen's inequality this is at most
the true sum (exp of the mean under-estimates the mean of exp), so the estimate is biased low, least for
tight clusters.  Clusters holding a key the row may not see (a later position, or an evicted one) are
never estimated.  Clusters beyond ``n_probe + N`` are ignored, as before.

Mass-driven budget (``selector="cluster"``, ``top_p=p``): instead of a fixed ``n_probe``, each query
reads clusters in order of estimated mass ``n_c·exp(scale·q·μ_c)`` (the statistics of the estimation
zone) until the estimated mass read - the exact part's true mass plus the estimates of the clusters
read - reaches ``p`` of the estimated total (exact part + every cluster), with at least ``top_p_min_keys``
routed keys, and stops before a cluster that would take the routed keys past ``top_p_max_keys`` (the
semantics of ``routed_attention(top_p=...)``, :func:`sparseattn.attention.routed.mass_routes`).  A peaky
query reads few clusters, a flat one many; ``stats["keys_read_per_query"]`` reports it.  ``estimate=N``
then estimates the ``N`` clusters after the last one read.

Memory cap (``max_keys``): at most ``max_keys`` keys stay attendable; the ``sinks`` first positions and
the newest ``window`` ones are always kept.  ``policy="streaming"`` (StreamingLLM) evicts the oldest
other keys; ``policy="h2o"`` (Heavy-Hitter Oracle, Zhang et al. 2023) keeps, besides sinks and window,
the keys with the largest *accumulated attention weight*: per kv head, every ``attend`` adds to each key
read the softmax weight it got from each query row (all query heads of the group, all tokens).  With a
sparse selector only the keys actually read get weight (an unread or merely estimated key gets none),
so the statistics follow the selector's view of attention, not the exact one.  Keys never attended
weigh 0, and ties evict the oldest first (a prompt appended before any ``attend`` is capped like
streaming).  Both policies share one eviction mechanism: an evicted key's slot gets the position
``EVICTED`` (after every query), so the kernel's causal mask hides it from every selector at once, a
cluster holding it is no longer estimated (and routed clusters never read it), and its storage is freed
by a compaction once ``segment`` keys have been evicted since the last one (clusters that lost members
get their statistics recomputed from the survivors and may be estimated again).  Slots held stay below
``max_keys + segment`` per kv head for streaming; under h2o different kv heads evict different
positions, so each clustered segment keeps as many slots as its fullest head needs (the others pad with
evicted slots, never read as keys).  Index selectors keep their evicted keys in the backend index until
the rebuild described above.
"""

from __future__ import annotations

import functools
import numbers
import threading
import time
from typing import Any

import numpy as np

from .attention.tail import as_tail
from .inputs import check_bool, check_positive_int, check_scale, overflow_message
from .kernels.cache_ops import least_weight_slot, mark_evicted_clusters, slots_of_positions
from .kernels.decode import EVICTED
from .threads import executor, get_num_threads, single_threaded_blas

__all__ = ["KVCache"]

_SELECTORS = ("cluster", "pages", "window", "topk", "dense")
_POLICIES = ("streaming", "h2o")
_BF16_NAMES = ("bfloat16", "bf16")
_INT32_MAX = 2**31 - 1
_MAX_SEGMENT = 1 << 24  # keys clustered at once per segment (one k-means)
# Work per call (keys scored, plus routing vectors weighted by their bytes against a key's key + value)
# below which the kernel runs on one thread.  Measured on 2 cores, 8 heads, E = 64, median of 40 steps:
# 8,192 keys per step (1,024 per head, all exact) 0.22 ms serial against 0.26 ms parallel with warm
# caches; about 17,000 (16,384 cached keys, cluster selector) 1.30 against 0.80 ms; about 25,000 of a
# 131,072-key step 2.30 against 1.46 ms with cold caches.  The cost of going parallel: on a busy shared
# machine a descheduled worker costs up to a scheduler time slice (~10-20 ms per step at load average 9
# on 2 cores); ``KVCache(parallel=False)`` opts out.
PARALLEL_MIN_KEYS = 12288
# kernel inputs of a step that lists no rows / records nothing (the kernel never writes them)
_NO_ROWS = np.full((1, 1), -1, np.int64)
_NO_REC = np.zeros((0, 1, 3), np.int64)
_NO_REC_N = np.zeros(0, np.int64)
# what to change when scores overflow (the kernels compute in float32 whatever the inputs)
_OVERFLOW_FIX = "the cache computes in float32: scale the keys or queries down, or pass a smaller scale"


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
        if t.dtype not in (torch.float16, torch.float32, torch.float64):
            raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64; got {t.dtype}. "
                            f"Convert with {name}.float().")
        return t.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:  # e.g. ml_dtypes bfloat16 seen as void
        raise TypeError(f"{name}: unsupported dtype {arr.dtype}; pass float16/32/64.")
    return arr


_F32 = np.dtype(np.float32)


def _check_float(arr: np.ndarray, name: str) -> None:
    if arr.dtype.kind != "f" or arr.dtype.type not in (np.float16, np.float32, np.float64):
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {arr.dtype}. "
                        f"Convert with {name}.astype(np.float32).")


def routing_codes(means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Routing vectors (m, E) float -> (int8 codes (m, E), scales (m,) float32) with ``vector ~= codes *
    scale``: each vector is divided by its largest magnitude over 127 and rounded, so any finite float32
    key mean (1e-40 .. 3e38) keeps 1/254 of its largest element's magnitude as absolute precision
    (half a code step) instead of under- or overflowing; one byte per element halves the routing scan's
    reads against float16."""
    m = np.asarray(means, dtype=np.float64)
    big = np.abs(m).max(axis=1) if m.size else np.zeros(m.shape[0])
    sc = np.where(big > 0, big / 127.0, 1.0)
    codes = np.clip(np.rint(m / sc[:, None]), -127, 127).astype(np.int8)
    sc32 = sc.astype(np.float32)
    tiny = sc32 == 0  # a largest element below ~1.8e-43: the scale underflows float32; keep the direction
    if tiny.any():
        sc32[tiny] = np.float32(1e-45)
    return codes, sc32


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
                         n_threads=1)
    return index.labels(np.ascontiguousarray(keys, dtype=np.float32))


# ---------------------------------------------------------------------------------------------- cache
def _index_selector_names() -> list[str]:
    """Names of the library selectors that can grow with ``add()`` (``supports_add``), besides the cache's own."""
    from .selectors import selector_classes

    return sorted(n for n, c in selector_classes().items() if c.supports_add and n not in _SELECTORS)


def _parse_selector(selector: object) -> Any:
    """None for a built-in selector name, else an unbuilt template of the index selector ``selector`` names."""
    if isinstance(selector, str) and selector in _SELECTORS:
        return None
    accepted = _index_selector_names()
    usage = (f"selector must be one of {_SELECTORS} or the spec string of an index selector that supports "
             f"add() ({', '.join(accepted)}; e.g. 'faiss-hnsw:M=16')")
    if not isinstance(selector, str) or not selector.strip():
        raise ValueError(f"{usage}; got {selector!r}.")
    from .selectors import get_selector, selector_classes
    from .selectors.registry import parse_spec

    parts = parse_spec(selector)
    names = [n for n, _ in parts]
    if len(parts) != 1 or names[0] not in accepted:
        classes = selector_classes()
        bad = [n for n in names if n in classes and not classes[n].supports_add]
        why = (f" ({', '.join(repr(n) for n in bad)} cannot grow with add(): supports_add is False)" if bad
               else " (a union of selectors cannot grow with add())" if len(parts) > 1 else "")
        raise ValueError(f"{usage}; got {selector!r}{why}.")
    return get_selector(selector)


def _locked(method: Any) -> Any:
    """Run ``method`` holding the cache's lock (calls on one cache from several threads take turns)."""
    @functools.wraps(method)
    def run(self: KVCache, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


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
    selector : str, default "cluster"
        How each step picks keys beyond the exact sinks + window (see the module docstring): one of
        ``"cluster"``, ``"pages"``, ``"window"``, ``"topk"``, ``"dense"``, or the spec string of an index
        selector that supports ``add()`` (``"faiss-flat"``, ``"faiss-hnsw:M=16"``, ``"faiss-ivf"``,
        ``"faiss-ivfpq"``), whose per-query budget is ``attend(k=...)``.
    dtype : numpy.float32, numpy.float16 or "bfloat16", default float32
        Storage of keys and values (bfloat16 is held as uint16 bit patterns); scores and sums are
        float32 in every case.  Appended inputs are rounded to it.
    sinks : int, default 4
        The first ``sinks`` positions are always attended exactly (and never evicted).
    window : int, default 64
        The newest ``window`` positions are always attended exactly (and never evicted).
    max_keys : int, optional
        Memory cap in keys: at most ``max_keys`` keys stay attendable (``policy`` says which).  Must be
        >= ``sinks + window``.
    policy : {"streaming", "h2o"}, default "streaming"
        Which keys the cap keeps besides sinks and window: the newest (``"streaming"``) or those with
        the largest accumulated attention weight (``"h2o"``); see the module docstring.
    segment : int, default 4096
        Keys clustered together once the tail holds ``segment + window`` keys (multiple of
        ``page_size``; 4,096-16,384 recommended).  The exact tail averages ``segment / 2 + window`` keys.
    open_step : int, optional
        Granularity of the open segment (default ``segment // 2``): once the tail holds ``open_step +
        window`` keys beyond it, the open segment (the newest, not yet full segment) is re-clustered with
        them, so the exact tail stays below ``open_step + window`` keys; a full segment is closed and
        never clustered again.  ``open_step = segment`` turns the open segment off.  Each re-clustering
        runs a k-means over the whole open segment, so a small ``open_step`` multiplies the append cost
        (up to ``segment / open_step`` k-means runs per segment instead of about two).
    n_probe : int, optional
        Clusters (``"cluster"``, default 32) or pages (``"pages"``, default 128) attended per query.
    estimate : int, default 0
        ``"cluster"`` only: clusters per query estimated from their statistics after the routed ones
        (see the module docstring); 0 = off.
    top_p : float in (0, 1], optional
        ``"cluster"`` only: mass-driven budget instead of ``n_probe`` (see the module docstring); 1.0
        reads every cluster with a visible key (within ``top_p_max_keys``).
    top_p_min_keys : int, default 0
        ``top_p`` only: floor of routed keys read per query (the walk goes on past ``top_p`` until it is
        reached).  Sinks and the exact tail are read on top.
    top_p_max_keys : int, optional
        ``top_p`` only: cap of routed keys read per query (default ``4 * n_probe * cluster_size``, four
        times the fixed budget); the walk stops before a cluster that would pass it.
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

    Threads: one cache may be used from several threads; ``append``, ``reserve``, ``attend``,
    ``selected_slots`` and ``positions`` hold the cache's lock, so calls on one cache take turns (each
    kernel call is parallel inside).  For concurrent sequences use one cache per sequence.

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
                 estimate: int = 0, top_p: float | None = None, top_p_min_keys: int = 0,
                 top_p_max_keys: int | None = None, cluster_size: int = 64,
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
        self._index_template = _parse_selector(selector)
        self.selector = selector
        self.storage, self._sdtype = _resolve_storage(dtype)
        big = _INT32_MAX - 1  # counts of keys or positions: int32
        self.sinks = check_positive_int(sinks, "sinks", minimum=0, maximum=big)
        self.window = check_positive_int(window, "window", minimum=0, maximum=big)
        self.page_size = check_positive_int(page_size, "page_size", maximum=_MAX_SEGMENT)
        self.segment = check_positive_int(segment, "segment", minimum=self.page_size, maximum=_MAX_SEGMENT)
        if self.segment % self.page_size:
            raise ValueError(f"segment ({self.segment}) must be a multiple of page_size ({self.page_size}).")
        self.cluster_size = check_positive_int(cluster_size, "cluster_size", maximum=_MAX_SEGMENT)
        self.open_step = self.segment // 2 if open_step is None else check_positive_int(open_step, "open_step")
        if self.open_step > self.segment:
            raise ValueError(f"open_step ({self.open_step}) must be <= segment ({self.segment}).")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}; got {policy!r}.")
        self.policy = policy
        self.max_keys = None if max_keys is None else check_positive_int(max_keys, "max_keys", maximum=big)
        if self.max_keys is not None and self.max_keys < self.sinks + max(self.window, 1):
            raise ValueError(f"max_keys ({self.max_keys}) must be >= sinks + window "
                             f"({self.sinks} + {self.window}); raise max_keys or lower window.")
        self.estimate = check_positive_int(estimate, "estimate", minimum=0, maximum=big)
        if self.estimate and selector != "cluster":
            raise ValueError(f"estimate applies to selector='cluster' only; got selector={selector!r} with "
                             f"estimate={self.estimate}. Pass estimate=0.")
        default_probe = {"cluster": 32, "pages": 128}.get(selector, 0) if isinstance(selector, str) else 0
        self.n_probe = default_probe if n_probe is None else check_positive_int(n_probe, "n_probe", maximum=big)
        self.top_p = None
        if top_p is not None:
            if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < float(top_p) <= 1:
                raise ValueError(f"top_p must be a float in (0, 1] (or None: fixed n_probe); got {top_p!r}.")
            if selector != "cluster":
                raise ValueError(f"top_p applies to selector='cluster' only (it ranks clusters by estimated "
                                 f"mass); got selector={selector!r}. Pass top_p=None or selector='cluster'.")
            self.top_p = float(top_p)
        self.top_p_min_keys = check_positive_int(top_p_min_keys, "top_p_min_keys", minimum=0, maximum=big)
        self.top_p_max_keys = (min(4 * max(self.n_probe, 1) * self.cluster_size, big) if top_p_max_keys is None
                               else check_positive_int(top_p_max_keys, "top_p_max_keys", minimum=0, maximum=big))
        if self.top_p_min_keys > self.top_p_max_keys:
            raise ValueError(f"top_p_min_keys ({self.top_p_min_keys}) must be <= top_p_max_keys "
                             f"({self.top_p_max_keys}) (the floor and the cap of routed keys per query).")
        self.scale = check_scale(scale, self.head_dim)
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0; got {scale!r}.")
        self.seed = check_positive_int(seed, "seed", minimum=0, maximum=_INT32_MAX)
        self.parallel = None if parallel is None else check_bool(parallel, "parallel")
        hk, E, Ev = self.num_kv_heads, self.head_dim, self.value_dim
        self._lock = threading.RLock()  # append / reserve / attend / selected_slots / positions take turns
        self._n = 0  # positions appended so far (the next key's position)
        self._n_live = 0  # keys attendable (per kv head; every head holds as many)
        self._slots = 0  # slots in use (live + evicted, not yet compacted)
        self._pad = 0  # evicted slots left after the last compaction
        self._lo_done = 0  # streaming: positions below this (sinks apart) are evicted
        self._evict_from = 0  # streaming + cluster: no slot before this holds a key still to evict
        self._cap = 0
        self._K = np.zeros((hk, 0, E), self._sdtype)
        self._V = np.zeros((hk, 0, Ev), self._sdtype)
        self._pos = np.zeros((hk, 0), np.int32)
        self._weight = np.zeros((hk, 0), np.float64)  # h2o: accumulated attention weight per slot
        self._ids = np.zeros((hk, 0), np.int64)  # index selectors: id of each slot in the head's index
        self._seg_end = 0  # cluster: end of the closed segments
        self._open_end = 0  # cluster: first tail slot; [seg_end, open_end) is the open segment
        self._closed_cent = np.zeros(hk, np.int64)  # routing vectors of the closed segments, per kv head
        self._segments: list[tuple[int, np.ndarray]] = []  # (first slot, first centroid per kv head)
        self._cent = np.zeros((hk, 0, E), np.int8)  # routing vectors / their scale, int8 codes
        self._cscale = np.zeros((hk, 0), np.float32)  # routing vector c = _cent[c] * _cscale[c]
        self._cptr = np.zeros((hk, 1), np.int64)
        self._n_cent = np.zeros(hk, np.int64)
        self._ccount = np.zeros((hk, 0), np.int64)  # per cluster: live members (estimation zone, top_p)
        self._cvmean = np.zeros((hk, 0, Ev), np.float32)  # per cluster: mean value (estimation zone)
        self._cminpos = np.zeros((hk, 0), np.int32)  # per cluster: smallest and largest key position
        self._cmaxpos = np.zeros((hk, 0), np.int32)
        self._pmin = np.zeros((hk, 0, E), self._sdtype)
        self._pmax = np.zeros((hk, 0, E), self._sdtype)
        self._pminpos = np.zeros((hk, 0), np.int32)  # per page: smallest live position (EVICTED: none)
        self._index: list[Any] = [None] * hk  # index selectors: one per kv head (None: not built yet)
        self._index_slot: list[np.ndarray] = [np.zeros(0, np.int64)] * hk  # id -> slot (-1: evicted)
        self._index_dead = 0  # ids of evicted keys still in each head's index
        self._last_read: tuple[np.ndarray, np.ndarray] | None = None  # keys read, clusters estimated per row
        self._stats: dict[str, Any] = {
            "appends": 0, "append_seconds": 0.0, "cluster_seconds": 0.0, "segments_clustered": 0,
            "attends": 0, "attend_seconds": 0.0, "kernel_seconds": 0.0, "keys_read_per_query": 0.0,
            "keys_read_max": 0, "keys_read_min": 0, "evicted_keys": 0, "clusters_estimated_per_query": 0.0,
            "compactions": 0, "index_rebuilds": 0,
        }

    # ------------------------------------------------------------------------------------- metadata
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)  # a lock does not pickle; each copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """Keys attendable now: every appended key, or ``max_keys`` under the cap."""
        return self._n_live

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
        """Bytes of everything beyond the keys and values: positions, routing vectors and cluster
        statistics, page bounds, h2o weights, index-selector slot maps (not the FAISS index itself)."""
        hk = self.num_kv_heads
        total = self._slots * hk * 4  # int32 position per slot
        if self.selector == "cluster":
            total += int(self._n_cent.sum()) * (self.head_dim + 4 + 8 + 8 + 8 + 4 * self.value_dim)
        if self.selector == "pages":
            total += self._n_pages() * hk * (2 * self.head_dim * self._sdtype.itemsize + 4)
        if self.policy == "h2o" and self.max_keys is not None:
            total += self._slots * hk * 8
        if self._index_template is not None:
            total += self._slots * hk * 8 + sum(int(s.size) for s in self._index_slot) * 8
        return total

    @property
    def nbytes(self) -> int:
        """Bytes held for the slots in use: keys, values and index (``kv_nbytes + index_nbytes``)."""
        return self.kv_nbytes + self.index_nbytes

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and timings: appends, seconds in append / clustering / attend (and in the kernel),
        keys read per query of the last attend (mean, min and max), segments, clusters, evicted keys,
        compactions, bytes."""
        out = dict(self._stats)
        if self._last_read is not None:
            nread, nest = self._last_read
            out.update(keys_read_per_query=float(nread.mean()), keys_read_max=int(nread.max()),
                       keys_read_min=int(nread.min()), clusters_estimated_per_query=float(nest.mean()))
        out.update(segments=len(self._segments), open_segment_keys=self._open_end - self._seg_end,
                   clusters_per_head=float(self._n_cent.mean()),
                   tail_keys=self._slots - self._tail_start(), len=len(self), kv_nbytes=self.kv_nbytes,
                   index_nbytes=self.index_nbytes, slots=self._slots,
                   append_us_per_token=(1e6 * self._stats["append_seconds"] / self._n) if self._n else 0.0)
        return out

    @_locked
    def positions(self, kv_head: int = 0) -> np.ndarray:
        """Sorted positions (int64) of the keys kv head ``kv_head`` can attend to now."""
        p = self._pos[kv_head, :self._slots].astype(np.int64)
        return np.sort(p[p != EVICTED])

    def heavy_hitter_weights(self, kv_head: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``policy="h2o"``: (positions int64, accumulated attention weights float64) of the attendable keys
        of kv head ``kv_head``, sorted by position."""
        if self.policy != "h2o":
            raise ValueError(f"heavy_hitter_weights needs policy='h2o'; this cache has policy={self.policy!r}.")
        p = self._pos[kv_head, :self._slots].astype(np.int64)
        w = self._weight[kv_head, :self._slots] if self._weight.shape[1] else np.zeros(self._slots)
        live = p != EVICTED
        order = np.argsort(p[live], kind="stable")
        return p[live][order], w[live][order]

    # ------------------------------------------------------------------------------------- internals
    def _lo_pos(self) -> int:
        """Streaming: the first non-sink position still attended (everything before it, sinks apart, is
        evicted); 0 without a cap or below it."""
        if self.max_keys is None or self._n <= self.max_keys:
            return 0
        return self._n - (self.max_keys - self.sinks)

    def _tail_start(self) -> int:
        return self._open_end if self.selector == "cluster" else min(self.sinks, self._slots)

    def _n_pages(self) -> int:
        span = max(self._slots - self.sinks, 0)
        return (span + self.page_size - 1) // self.page_size

    def _slot_arrays(self) -> list[str]:
        """Names of the per-slot arrays (moved together whenever slots move)."""
        names = ["_K", "_V", "_pos"]
        if self.policy == "h2o":
            names.append("_weight")
        if self._index_template is not None:
            names.append("_ids")
        return names

    @_locked
    def reserve(self, n_tokens: int) -> None:
        """Allocate storage for ``n_tokens`` more tokens now (per kv head), so that appending them never
        reallocates.  Storage otherwise grows by half its size when full, and that one append copies the
        whole cache (a stall proportional to the cache size); a generation loop that knows its length
        reserves it once after the prompt.  Under ``max_keys`` at most the capped storage is allocated.

        Parameters
        ----------
        n_tokens : int >= 0
        """
        n_tokens = check_positive_int(n_tokens, "n_tokens", minimum=0)
        if self._n + n_tokens >= _INT32_MAX:
            raise ValueError(f"n_tokens={n_tokens}: the cache holds positions as int32, so fewer than "
                             f"{_INT32_MAX - self._n} more tokens fit; reserve fewer.")
        try:
            self._reserve(n_tokens, exact=True)
        except MemoryError as exc:
            raise MemoryError(f"n_tokens={n_tokens}: storage for {self._slots + n_tokens} tokens does not fit in "
                              f"memory; reserve fewer.") from exc

    def _reserve(self, extra: int, *, exact: bool = False) -> None:
        need = self._slots + extra
        if need <= self._cap:
            return
        new_cap = need if exact else max(need + self.segment, int(self._cap * 1.5))  # headroom: prompt, steps
        if self.max_keys is not None:  # a capped cache never holds more than `limit` slots
            limit = self.max_keys + 2 * self.segment + self.window + self.sinks
            new_cap = min(new_cap, limit) if exact else max(need, min(new_cap, limit))
            if new_cap <= self._cap:
                return
        new_cap = -(-new_cap // self.page_size) * self.page_size
        for name in self._slot_arrays():
            old = getattr(self, name)
            arr = np.zeros((old.shape[0], new_cap) + old.shape[2:], old.dtype)
            arr[:, :self._slots] = old[:, :self._slots]
            setattr(self, name, arr)
        if self.selector == "pages":
            n_pages = -(-new_cap // self.page_size) + 1
            for name in ("_pmin", "_pmax", "_pminpos"):
                old = getattr(self, name)
                arr = np.zeros((old.shape[0], n_pages) + old.shape[2:], old.dtype)
                arr[:, :old.shape[1]] = old
                setattr(self, name, arr)
        self._cap = new_cap

    def _encode(self, x: np.ndarray, name: str) -> np.ndarray:
        """Round validated float input to the storage dtype (float16 overflow -> ValueError)."""
        if self.storage == "bfloat16":
            with np.errstate(over="ignore"):  # float64 beyond float32's range: inf bits, refused below
                bits = _bf16_bits(x)
            if (bits & 0x7F80 == 0x7F80).any():
                raise ValueError(f"{name} has values beyond bfloat16's range (|x| > 3.39e38 after rounding); "
                                 f"use dtype=np.float32 storage.")
            return bits
        if x.dtype == self._sdtype:
            return x
        if self.storage == "float16":  # |x| >= 65520 rounds to inf; below, the cast is exact or rounds
            if x.size and float(np.abs(x).max()) >= 65520.0:
                raise ValueError(f"{name} has values beyond float16's range (|x| > 65504); use dtype=np.float32 "
                                 f"or 'bfloat16' storage.")
            return x.astype(np.float16)
        with np.errstate(over="ignore"):
            out = x.astype(np.float32)
        if not np.isfinite(out).all():
            raise ValueError(f"{name} has values beyond float32's range (|x| > 3.4e38); scale them down before "
                             f"appending (the cache stores float32 at most).")
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
    @_locked
    def append(self, keys: object, values: object) -> None:
        """Append T new tokens (positions ``len .. len + T - 1``) for every kv head.

        Parameters
        ----------
        keys : float array or torch CPU tensor, shape (H_kv, T, E), T >= 1
        values : float array or torch CPU tensor, shape (H_kv, T, Ev)
            Rounded to the storage dtype.  A long prompt is one append; full segments are clustered
            (and index selectors grown) during the call; under ``max_keys`` keys are evicted as it goes.

        Raises
        ------
        ValueError
            Wrong shapes (naming the argument and the expected shape), T = 0, NaN or Inf, float16 overflow.
        TypeError
            Non-float dtypes.
        """
        t0 = time.perf_counter()
        hk = self.num_kv_heads
        if (type(keys) is np.ndarray and type(values) is np.ndarray and keys.dtype == _F32
                and values.dtype == _F32 and keys.shape == (hk, 1, self.head_dim)
                and values.shape == (hk, 1, self.value_dim) and self._n + 1 < _INT32_MAX
                and self._append_token(keys, values)):
            self._stats["appends"] += 1
            self._stats["append_seconds"] += time.perf_counter() - t0
            return
        k, v = self._validate_kv(keys, values)
        ks = self._encode(k, "keys")
        vs = self._encode(v, "values")
        T = ks.shape[1]
        if self._n + T >= _INT32_MAX:
            raise ValueError(f"the cache holds positions as int32: fewer than {_INT32_MAX} tokens in total.")
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
            self._commit(a, b)
            done += step
        self._stats["appends"] += 1
        self._stats["append_seconds"] += time.perf_counter() - t0

    def _append_token(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """One float32 token (H_kv, 1, E) / (H_kv, 1, Ev): checked and rounded straight into its slot by
        one Numba call per array (the decode loop's append).  False, with nothing appended, when a value
        is not finite or beyond the storage range (the general path then raises the error)."""
        from .kernels import decode as kd

        store = {"float32": kd.store_token_f32, "float16": kd.store_token_f16,
                 "bfloat16": kd.store_token_bf16}[self.storage]
        self._reserve(1)
        a = self._slots
        K, V = self._K, self._V
        if self.storage == "float16":
            K, V = K.view(np.uint16), V.view(np.uint16)
        if store(keys, K[:, a]) or store(values, V[:, a]):
            return False  # slot a is past the end: the partial write is never read
        self._commit(a, a + 1)
        return True

    def _commit(self, a: int, b: int) -> None:
        """Slots [a, b) (just written at the end) become the next positions: indexes, caps follow."""
        if b == a + 1:
            self._pos[:, a] = self._n
        else:
            self._pos[:, a:b] = np.arange(self._n, self._n + (b - a), dtype=np.int32)
        if self.policy == "h2o":
            self._weight[:, a:b] = 0.0
        self._slots = b
        self._n += b - a
        self._n_live += b - a
        if self.selector == "pages":
            self._update_pages(a, b)
        if self.selector == "cluster":
            self._cluster_full_segments()
        if self._index_template is not None:
            self._index_append(a, b)
        self._enforce_cap()

    def _update_pages(self, a: int, b: int) -> None:
        """Recompute the min/max and smallest position of the pages holding slots [a, b) (pages start
        at slot ``sinks``)."""
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
            self._pminpos[:, p0:p0 + full] = self._pos[:, start:start + full * P].reshape(
                self.num_kv_heads, full, P).min(axis=2)
        if p0 + full < p1:  # the last, partial page
            blk = self._K[:, start + full * P:b]
            f = self._decode(blk) if self.storage == "bfloat16" else blk
            lo, hi = f.min(axis=1), f.max(axis=1)
            if self.storage == "bfloat16":
                lo, hi = _bf16_bits(lo), _bf16_bits(hi)
            self._pmin[:, p0 + full] = lo
            self._pmax[:, p0 + full] = hi
            self._pminpos[:, p0 + full] = self._pos[:, start + full * P:b].min(axis=1)

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

    def _permute(self, g: int, a: int, b: int, order: np.ndarray) -> None:
        """Reorder slots [a, b) of kv head ``g`` (every per-slot array) by ``order``."""
        for name in self._slot_arrays():
            arr = getattr(self, name)
            arr[g, a:b] = arr[g, a:b][order]

    def _cluster_one(self, a: int, b: int, *, closed: bool) -> None:
        """Cluster slots [a, b) of every kv head, reorder them by cluster, add their routing vectors
        (replacing those of the open segment, which [a, b) always contains).

        Only live keys are clustered; a head's evicted slots in [a, b) (not yet compacted) go to the end
        of its last cluster's range, where the position mask hides them.  Each head's k-means, reordering
        and statistics run on a worker thread (FAISS and numpy's copies and reductions release the GIL).
        """
        hk = self.num_kv_heads
        firsts = self._closed_cent.copy()
        self._n_cent[:] = self._closed_cent  # the open segment's routing vectors are recomputed
        self._evict_from = min(self._evict_from, a)  # slots [a, b) are reordered below

        def head(g: int) -> tuple[Any, ...]:
            pos = self._pos[g, a:b]
            # position order, evicted slots last (stable): the clusters depend on the keys only
            by_pos = np.argsort(pos, kind="stable") if b - a > 1 and np.any(np.diff(pos) < 0) else None
            nl = int(np.count_nonzero(pos != EVICTED))
            live = a + (by_pos[:nl] if by_pos is not None else np.arange(nl))
            if nl == 0:
                if by_pos is not None:
                    self._permute(g, a, b, by_pos)
                return (0,)
            x = self._decode(self._K[g, live])
            n_c = max(1, nl // self.cluster_size)
            labels = cluster_segment(x, n_c, seed=self.seed)
            order = np.argsort(labels, kind="stable")
            rest = np.arange(nl, b - a)
            final = np.concatenate([order, rest]) if by_pos is None else by_pos[np.concatenate([order, rest])]
            self._permute(g, a, b, final)  # one reordering: position order, then cluster order
            counts = np.bincount(labels, minlength=n_c)
            kept = counts > 0
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[kept]
            sums = np.add.reduceat(x[order], starts, axis=0, dtype=np.float64)
            means = (sums / counts[kept, None]).astype(np.float32)
            vsum = np.add.reduceat(self._decode(self._V[g, a:a + nl]), starts, axis=0, dtype=np.float64)
            seg_pos = self._pos[g, a:a + nl]
            return (nl, counts[kept], means, (vsum / counts[kept, None]).astype(np.float32),
                    np.minimum.reduceat(seg_pos, starts), np.maximum.reduceat(seg_pos, starts))

        n_threads = min(get_num_threads(), hk)
        with single_threaded_blas():  # parallel over heads, not inside BLAS (oversubscription: ~10x slower)
            if n_threads > 1:  # one head per worker, each k-means single-threaded
                results = list(executor(n_threads).map(head, range(hk)))
            else:
                results = [head(g) for g in range(hk)]
        for g in range(hk):
            res = results[g]
            nc = int(self._n_cent[g])
            if res[0] == 0:  # every key of this head evicted: one empty cluster holds the slots
                self._grow_centroids(nc + 1)
                self._cent[g, nc] = 0
                self._cscale[g, nc] = 1.0
                self._cvmean[g, nc] = 0.0
                self._ccount[g, nc] = 0
                self._cminpos[g, nc] = self._cmaxpos[g, nc] = EVICTED
                self._cptr[g, nc], self._cptr[g, nc + 1] = a, b
                self._n_cent[g] = nc + 1
                continue
            _, counts, means, vmean, pmin, pmax = res
            m = means.shape[0]
            self._grow_centroids(nc + m)
            self._cvmean[g, nc:nc + m] = vmean
            self._ccount[g, nc:nc + m] = counts
            self._cminpos[g, nc:nc + m] = pmin
            self._cmaxpos[g, nc:nc + m] = pmax
            self._cent[g, nc:nc + m], self._cscale[g, nc:nc + m] = routing_codes(means)
            self._cptr[g, nc + 1:nc + 1 + m] = a + np.cumsum(counts)
            self._cptr[g, nc] = a
            self._cptr[g, nc + m] = b  # evicted slots, if any, close the last cluster's range
            self._n_cent[g] = nc + m
        if closed:
            self._segments.append((a, firsts))
            self._closed_cent = self._n_cent.copy()

    def _routing(self, g: int, nc: int) -> np.ndarray:
        """Routing vectors ``[0, nc)`` of kv head g, (nc, E) float32."""
        return self._cent[g, :nc].astype(np.float32) * self._cscale[g, :nc, None]

    def _grow_centroids(self, need: int) -> None:
        if need <= self._cent.shape[1]:
            return
        hk = self.num_kv_heads
        cap = max(need, 2 * self._cent.shape[1], 64)

        def grown(old: np.ndarray, width: int) -> np.ndarray:
            arr = np.zeros((hk, cap + width) + old.shape[2:], old.dtype)
            arr[:, :old.shape[1]] = old
            return arr

        self._cent = grown(self._cent, 0)
        self._cscale = grown(self._cscale, 0)
        self._cptr = grown(self._cptr, 1)
        self._cvmean = grown(self._cvmean, 0)
        self._ccount = grown(self._ccount, 0)
        self._cminpos = grown(self._cminpos, 0)
        self._cmaxpos = grown(self._cmaxpos, 0)

    # ------------------------------------------------------------------------------------- eviction
    def _enforce_cap(self) -> None:
        """Evict down to ``max_keys`` (``policy`` picks the keys), then compact once ``segment`` keys
        have been evicted since the last compaction."""
        if self.max_keys is None or self._n_live <= self.max_keys:
            return
        e = self._n_live - self.max_keys
        if self.policy == "streaming":
            kill = self._streaming_victims(e)
        else:
            kill = self._h2o_victims(e)
        self._mark_evicted(kill)
        self._n_live -= e
        self._stats["evicted_keys"] = self._n - self._n_live
        if self._slots - self._n_live - self._pad >= self.segment:
            self._compact()

    def _streaming_victims(self, e: int) -> np.ndarray:
        """(H_kv, e) slots of the positions ``[lo_done, lo_done + e)``: the oldest non-sink keys."""
        hk = self.num_kv_heads
        lo0 = max(self._lo_done, self.sinks)
        lo1 = lo0 + e
        self._lo_done = lo1
        s0 = min(self.sinks, self._slots)
        if self.selector != "cluster":  # position order, the evicted ones first: the next e slots
            first = s0 + (self._slots - self._n_live)
            return np.broadcast_to(np.arange(first, first + e, dtype=np.int64), (hk, e)).copy()
        # clustered regions hold their keys in cluster order: scan every slot (compiled; a head's scan
        # stops at its e-th victim)
        out = np.empty((hk, e), np.int64)
        got = slots_of_positions(self._pos, max(s0, self._evict_from), self._slots, lo0, lo1, out)
        if got < e and self._evict_from > s0:  # not expected: the whole scan, before giving fewer
            got = slots_of_positions(self._pos, s0, self._slots, lo0, lo1, out)
        if got < e:
            raise RuntimeError(f"sparseattn internal error: {got} of the {e} positions to evict were found; "
                               f"please report it with the cache's parameters.")
        if got:  # later victims are newer: they sit in this region or after it
            starts = [a for a, _ in self._segments] + [self._seg_end, self._open_end]
            first = int(out[:, :got].min())
            self._evict_from = max(a for a in starts + [s0] if a <= first)
        return out[:, :got]

    def _h2o_victims(self, e: int) -> np.ndarray:
        """(H_kv, e) slots of the e keys of least accumulated weight per kv head, outside the sinks and the
        newest ``window`` positions (ties: the oldest position first)."""
        hk, n = self.num_kv_heads, self._slots
        out = np.empty((hk, e), np.int64)
        newest = self._n - self.window
        if e == 1:  # a decode step: one compiled scan per kv head
            least_weight_slot(self._pos, self._weight, n, self.sinks, newest, EVICTED, out[:, 0])
            if (out[:, 0] >= 0).all():
                return out
        for g in range(hk):
            p = self._pos[g, :n]
            w = np.where((p >= self.sinks) & (p < newest) & (p != EVICTED), self._weight[g, :n], np.inf)
            idx = np.argpartition(w, e - 1)[:e]
            thr = w[idx].max()
            less = np.flatnonzero(w < thr)
            tied = np.flatnonzero(w == thr)
            need = e - less.size
            if need < tied.size:
                tied = tied[np.argpartition(p[tied], need - 1)[:need]]
            out[g] = np.concatenate([less, tied])
        return out

    def _mark_evicted(self, kill: np.ndarray) -> None:
        """Evict slots ``kill[g]`` of every kv head g: position := EVICTED (every selector's mask then hides
        them), clusters holding one are no longer estimated, pages and index maps updated."""
        hk = self.num_kv_heads
        s0 = min(self.sinks, self._slots)
        kill = np.ascontiguousarray(kill, dtype=np.int64)
        if self.selector == "cluster":
            mark_evicted_clusters(self._pos, kill, self._cptr, self._n_cent, self._cmaxpos, EVICTED)
        else:
            for g in range(hk):
                self._pos[g, kill[g]] = EVICTED
        for g in range(hk):
            kg = kill[g]
            if self.selector == "pages":
                for b in np.unique((kg[kg >= s0] - s0) // self.page_size):
                    first = s0 + int(b) * self.page_size
                    self._pminpos[g, b] = self._pos[g, first:min(first + self.page_size, self._slots)].min()
            if self._index_template is not None and self._index[g] is not None:
                ids = self._ids[g, kg]
                self._index_slot[g][ids[ids >= 0]] = -1
        if self._index_template is not None and self._index[0] is not None:
            self._index_dead += kill.shape[1]

    def _compact(self) -> None:
        """Free the evicted slots: every region (sinks, each closed segment, the open segment, the tail;
        or everything after the sinks) keeps its live keys in order; clusters that lost members get their
        statistics recomputed from the survivors, emptied clusters and segments are dropped.  A region
        keeps as many slots as its fullest kv head needs (the others pad with evicted slots)."""
        hk = self.num_kv_heads
        n = self._slots
        s0 = min(self.sinks, n)
        live = self._pos[:, :n] != EVICTED
        arrays = {name: getattr(self, name) for name in self._slot_arrays()}
        new = {name: np.zeros_like(arr) for name, arr in arrays.items()}
        new["_pos"][:] = EVICTED
        for name, arr in arrays.items():
            new[name][:, :s0] = arr[:, :s0]
        w = s0  # next free slot of the new layout
        if self.selector != "cluster":
            nl = live[:, s0:].sum(axis=1)
            R = int(nl.max())
            for g in range(hk):
                dead = np.flatnonzero(~live[g, s0:])[:R - int(nl[g])]
                src = s0 + np.sort(np.concatenate([dead, np.flatnonzero(live[g, s0:])]))
                for name, arr in arrays.items():
                    new[name][g, w:w + R] = arr[g, src]
            w += R
        else:
            bounds = [a for a, _ in self._segments] + [self._seg_end, self._open_end, n]
            n_regions = len(bounds) - 1  # closed segments, open segment, tail
            cent_lists: list[list[tuple[Any, ...]]] = [[] for _ in range(hk)]
            seg_list: list[tuple[int, np.ndarray]] = []
            seg_end = open_end = w
            closed_cent = np.zeros(hk, np.int64)
            for ri in range(n_regions):
                a, b = bounds[ri], bounds[ri + 1]
                is_tail = ri == n_regions - 1
                nl = live[:, a:b].sum(axis=1)
                R = int(nl.max()) if b > a else 0
                if ri < n_regions - 2 and R > 0:  # a closed segment
                    seg_list.append((w, np.array([len(c) for c in cent_lists], np.int64)))
                for g in range(hk):
                    if is_tail:
                        dead = np.flatnonzero(~live[g, a:b])[:R - int(nl[g])]
                        src = a + np.sort(np.concatenate([dead, np.flatnonzero(live[g, a:b])]))
                    else:
                        src = self._compact_clusters(g, a, b, ri, w, R, live[g], cent_lists[g])
                    for name, arr in arrays.items():
                        new[name][g, w:w + R] = arr[g, src]
                w += R
                if ri < n_regions - 2:  # a closed segment ends
                    seg_end = open_end = w
                    closed_cent = np.array([len(c) for c in cent_lists], np.int64)
                elif ri == n_regions - 2:  # the open segment ends: the tail starts here
                    open_end = w
            self._segments = seg_list
            self._seg_end, self._open_end = seg_end, open_end
            self._closed_cent = closed_cent
            n_c = np.array([len(c) for c in cent_lists], np.int64)
            self._n_cent = n_c
            for g in range(hk):
                for c, (lo, hi, cen, vm, cnt, pmn, pmx) in enumerate(cent_lists[g]):
                    self._cptr[g, c], self._cptr[g, c + 1] = lo, hi
                    self._cent[g, c], self._cscale[g, c] = cen
                    self._cvmean[g, c] = vm
                    self._ccount[g, c] = cnt
                    self._cminpos[g, c], self._cmaxpos[g, c] = pmn, pmx
        for name in arrays:
            setattr(self, name, new[name])
        self._slots = w
        self._pad = w - self._n_live
        self._evict_from = 0  # slots moved
        self._stats["compactions"] += 1
        if self.selector == "pages":
            self._update_pages(s0, w)
        if self._index_template is not None:
            self._index_remap()

    def _compact_clusters(self, g: int, a: int, b: int, ri: int, w: int, R: int, live: np.ndarray,
                          out: list[tuple[Any, ...]]) -> np.ndarray:
        """Compaction of the clustered region [a, b) (segment or open segment ``ri``) of kv head g into R
        slots from ``w``: returns the source slots (live keys cluster by cluster, then padding) and appends
        (first, stop, routing vector, mean value, count, min pos, max pos) of each surviving cluster."""
        bounds = [f[g] for _, f in self._segments] + [self._closed_cent[g], self._n_cent[g]]
        c_lo, c_hi = int(bounds[ri]), int(bounds[ri + 1])
        parts = []
        at = w
        for c in range(c_lo, c_hi):
            lo, hi = int(self._cptr[g, c]), int(self._cptr[g, c + 1])
            keep = lo + np.flatnonzero(live[lo:hi])
            if keep.size == 0:
                continue
            parts.append(keep)
            if keep.size == hi - lo or self._ccount[g, c] == keep.size and self._cmaxpos[g, c] != EVICTED:
                stats = ((self._cent[g, c].copy(), self._cscale[g, c]), self._cvmean[g, c].copy(), int(keep.size),
                         int(self._cminpos[g, c]), int(self._cmaxpos[g, c]))
            else:  # lost members: statistics of the survivors
                kk = self._decode(self._K[g, keep]).astype(np.float64)
                vv = self._decode(self._V[g, keep]).astype(np.float64)
                pp = self._pos[g, keep]
                codes, sc = routing_codes(kk.mean(axis=0)[None])
                stats = ((codes[0], sc[0]), vv.mean(axis=0).astype(np.float32), int(keep.size), int(pp.min()), int(pp.max()))
            out.append((at, at + keep.size) + stats)
            at += keep.size
        src = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        pad = R - src.size
        if pad > 0:
            dead = a + np.flatnonzero(~live[a:b])[:pad]
            src = np.concatenate([src, dead])
            if out and out[-1][0] >= w:  # the padding closes the region's last cluster
                lo, _, *rest = out[-1]
                out[-1] = (lo, w + R, *rest)
            else:  # no live key of this head here: one empty cluster holds the padding
                out.append((w, w + R, (np.zeros(self.head_dim, np.uint16), 1.0), np.zeros(self.value_dim, np.float32),
                            0, EVICTED, EVICTED))
        return src

    # ------------------------------------------------------------------------------- index selectors
    def _index_append(self, a: int, b: int) -> None:
        """Grow each kv head's index selector with the keys of slots [a, b) (sinks excluded): ``add()``
        once built; the first build happens as soon as the backend accepts the keys held."""
        s0 = min(self.sinks, self._slots)
        a = max(a, s0)
        if a >= b:
            return
        if self._index[0] is None:
            self._ids[:, a:b] = -1
            self._index_build()  # once the backend accepts the live keys held; until then attend reads
            return               # every key exactly
        for g in range(self.num_kv_heads):
            sel = self._index[g]
            start = sel.keys_.shape[0]
            sel.add(self._decode(self._K[g, a:b]), check_finite=False)
            ids = np.arange(start, start + (b - a), dtype=np.int64)
            self._ids[g, a:b] = ids
            slot_map = self._index_slot[g]
            if slot_map.size < start + (b - a):
                grown = np.full(max(2 * slot_map.size, start + (b - a), 64), -1, np.int64)
                grown[:slot_map.size] = slot_map
                self._index_slot[g] = slot_map = grown
            slot_map[start:start + (b - a)] = np.arange(a, b)

    def _index_build(self) -> None:
        """(Re)build every kv head's index selector from its live non-sink keys; when the backend cannot
        train on that many (e.g. PQ or IVF under a small ``max_keys``), drop the index instead: attend then
        reads every key exactly until a later append brings enough keys."""
        s0 = min(self.sinks, self._slots)
        n_keys = self._n_live - s0  # live non-sink keys per kv head (sinks are never evicted)
        if self._index_template.not_supported_reasons(n_keys=n_keys, dim=self.head_dim):
            self._index = [None] * self.num_kv_heads
            self._ids[:, :self._slots] = -1
            self._index_dead = 0
            return
        for g in range(self.num_kv_heads):
            slots = s0 + np.flatnonzero(self._pos[g, s0:self._slots] != EVICTED)
            sel = self._index_template.clone()
            with single_threaded_blas():
                sel.build(self._decode(self._K[g, slots]), check_finite=False)
            self._index[g] = sel
            self._ids[g, :self._slots] = -1
            self._ids[g, slots] = np.arange(slots.size)
            slot_map = np.full(max(64, 2 * slots.size), -1, np.int64)
            slot_map[:slots.size] = slots
            self._index_slot[g] = slot_map
        self._index_dead = 0

    def _index_remap(self) -> None:
        """After slots moved: id -> slot maps from the per-slot ids; rebuild once evicted ids outnumber live ones."""
        if self._index[0] is None:
            return
        if self._index_dead > max(self._n_live, self.segment):
            self._index_build()
            self._stats["index_rebuilds"] += 1
            return
        for g in range(self.num_kv_heads):
            ids = self._ids[g, :self._slots]
            ok = (ids >= 0) & (self._pos[g, :self._slots] != EVICTED)
            self._index_slot[g][:] = -1
            self._index_slot[g][ids[ok]] = np.flatnonzero(ok)

    def _index_select(self, q: np.ndarray, qpos: np.ndarray, k: int, hi: int) -> np.ndarray:
        """(H * T, W) int64 slots each row reads from its index selector (-1 padded, ascending): per row the
        ``k`` best keys by ``q . k`` among those the index returns that the row may see and that are not in
        the exact part (sinks, positions >= ``hi``).  The search is widened until a row has ``k`` such keys
        or the index has no more to give."""
        H, T, E = q.shape
        rep = H // self.num_kv_heads
        out = np.full((H * T, k), -1, np.int64)
        for g in range(self.num_kv_heads):
            sel = self._index[g]
            S = sel.keys_.shape[0]
            if S == 0:
                continue
            qs = q[g * rep:(g + 1) * rep].reshape(rep * T, E)
            tpos = np.tile(qpos, rep)
            kq = min(S, k + self.window + T + 16 + 2 * self._index_dead * k // max(S, 1))
            while True:
                ids = sel.query(qs, kq, check_finite=False).to_padded(kq)
                slots = np.where(ids >= 0, self._index_slot[g][np.maximum(ids, 0)], -1)
                p = np.where(slots >= 0, self._pos[g, np.maximum(slots, 0)].astype(np.int64), EVICTED)
                ok = (slots >= 0) & (p >= self.sinks) & (p < hi) & (p <= tpos[:, None])
                short = ok.sum(axis=1) < k
                if kq >= S or not short.any() or (ids[short] >= 0).all(axis=1).sum() == 0:
                    break
                kq = min(S, 2 * kq)
            kd = self._decode(self._K[g, np.maximum(slots, 0)])  # (rows, kq, E)
            sc = np.where(ok, np.einsum("rke,re->rk", kd, qs), -np.inf)
            kk = min(k, sc.shape[1])
            top = np.argpartition(-sc, kk - 1, axis=1)[:, :kk] if kk < sc.shape[1] else \
                np.broadcast_to(np.arange(sc.shape[1]), sc.shape)
            chosen = np.take_along_axis(slots, top, axis=1)
            chosen = np.where(np.take_along_axis(ok, top, axis=1), chosen, -1)
            chosen = np.sort(np.where(chosen < 0, np.iinfo(np.int64).max, chosen), axis=1)
            chosen[chosen == np.iinfo(np.int64).max] = -1
            rows = (np.arange(g * rep, (g + 1) * rep)[:, None] * T + np.arange(T)[None, :]).reshape(-1)
            out[rows, :kk] = chosen
        return out

    # ---------------------------------------------------------------------------------------- attend
    def _check_override(self, selector: str | None) -> None:
        """The ``selector`` argument of ``attend`` / ``selected_slots``: None, the cache's own, or one that
        works on any cache."""
        if selector not in (None, self.selector, "dense", "topk", "window"):
            raise ValueError(f"selector must be None, 'dense', 'topk' or 'window' (the cache's own is "
                             f"{self.selector!r}); got {selector!r}.")

    @_locked
    def selected_slots(self, query: object, head: int, k: int = 64, *, selector: str | None = None
                       ) -> np.ndarray:
        """Storage slots the step of one query token of head ``head`` reads (for measuring recall).

        ``query`` is (E,) at the newest position; the result is sorted int64 slot ids of kv head
        ``head // (H // H_kv)``, with the same selection as :meth:`attend` (``cluster``: routed clusters by
        a stable sort, so ties at the last routed score may differ from the kernel's heap; ``top_p``: the
        walk recomputed in float64).  ``selector`` overrides the cache's as in :meth:`attend`.
        """
        self._check_override(selector)
        head = check_positive_int(head, "head", minimum=0, maximum=self.num_heads - 1)
        k = check_positive_int(k, "k")
        sel_name = selector or self.selector
        q = _to_numpy(query, "query")
        if q.size != self.head_dim:
            raise ValueError(f"query must hold head_dim={self.head_dim} values (shape (E,)); got shape {q.shape}.")
        if not np.isfinite(q).all():
            raise ValueError("query contains NaN or Inf; clean the input.")
        q = np.asarray(q, np.float32).reshape(self.head_dim)
        g = head // (self.num_heads // self.num_kv_heads)
        n_slots, s0 = self._slots, min(self.sinks, self._slots)
        pos = self._pos[g, :n_slots].astype(np.int64)
        visible = pos != EVICTED
        parts = [np.arange(s0)]
        if sel_name == "cluster":
            parts.append(np.arange(self._open_end, n_slots))
            nc = int(self._n_cent[g])
            if nc and self.top_p is not None:
                parts += self._mass_walk(q, g, np.concatenate(parts).astype(np.int64))
            elif nc:
                sc = self._routing(g, nc) @ q
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
                bound[self._pminpos[g, :n_pages] == EVICTED] = -np.inf
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
        elif sel_name == "dense" or self._index[0] is None:
            parts.append(np.arange(s0, n_slots))
        else:  # an index selector
            ex_lo = max(s0, n_slots - self.window)
            parts.append(np.arange(ex_lo, n_slots))
            hi = int(self._pos[0, ex_lo]) if ex_lo < n_slots else _INT32_MAX
            rep = self.num_heads // self.num_kv_heads
            qq = np.zeros((self.num_heads, 1, self.head_dim), np.float32)
            qq[g * rep] = q
            row = self._index_select(qq, np.array([self._n - 1]), k, hi)[g * rep]
            parts.append(row[row >= 0])
        sel = np.unique(np.concatenate(parts).astype(np.int64))
        return sel[visible[sel]]

    def _mass_walk(self, q: np.ndarray, g: int, exact: np.ndarray) -> list[np.ndarray]:
        """``top_p`` routing of one query at the newest position (float64 replay of the kernel's walk):
        the slot ranges of the clusters read."""
        nc = int(self._n_cent[g])
        qp = self._n - 1
        pos = self._pos[g, exact]
        exact = exact[pos <= qp]
        s_ex = self._decode(self._K[g, exact]).astype(np.float64) @ q.astype(np.float64) * self.scale
        cnt = self._ccount[g, :nc]
        qc = self._routing(g, nc).astype(np.float64) @ q.astype(np.float64)
        with np.errstate(divide="ignore"):
            la = np.where((cnt > 0) & (self._cminpos[g, :nc] <= qp), qc * self.scale + np.log(cnt), -np.inf)
        m = max(float(s_ex.max()) if s_ex.size else -np.inf, float(la.max()))
        cum = float(np.exp(s_ex - m).sum()) if s_ex.size else 0.0
        goal = self.top_p * (cum + float(np.exp(la - m).sum()))
        out, nk = [], 0
        for c in np.argsort(-la, kind="stable"):
            if la[c] == -np.inf or (self.top_p < 1.0 and cum >= goal and nk >= self.top_p_min_keys):
                break
            size = int(self._cptr[g, c + 1] - self._cptr[g, c])
            if nk + size > self.top_p_max_keys:
                break
            nk += size
            cum += float(np.exp(la[c] - m))
            out.append(np.arange(self._cptr[g, c], self._cptr[g, c + 1]))
        return out

    @_locked
    def attend(self, queries: object, k: int = 64, *, return_lse: bool = False, selector: str | None = None,
               tail: object = None) -> Any:
        """Attention of the newest T_q positions' queries over the cache.

        Query t sits at position ``n - T_q + t`` (n = positions appended so far): causal among the
        queries and over the cache.  Call ``append`` with the step's own key and value first.  With
        ``policy="h2o"`` the softmax weight of every key read is added to its accumulated weight.

        Parameters
        ----------
        queries : float array or torch CPU tensor, shape (H, T_q, E), or (H, E) for one token
        k : int, default 64
            Keys per query of the ``"topk"`` selector and of index selectors (the others use ``n_probe``
            or ``top_p``).
        return_lse : bool, default False
            Also return the log-sum-exp of each row's scaled scores (``-inf`` for a row with no key).
        selector : {None, "dense", "topk", "window"}, optional
            Override the cache's selector for this call (these three work on any cache): ``"dense"`` is
            the exact step over every key, ``"topk"`` exact top-k attention.
        tail : int or sparseattn.Tail, optional
            Estimate what the keys the step did not read contribute from a seeded uniform sample of them
            (``Tail(samples, seed, shrink)``, the estimator of :mod:`sparseattn.attention.tail`; an int is
            ``Tail(samples)``), merged with the step's exact part by log-sum-exp.  The sampled keys count
            in ``stats["keys_read_per_query"]``.

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
        q_in, q_in_dtype = q, q.dtype
        k = check_positive_int(k, "k")
        self._check_override(selector)
        check_bool(return_lse, "return_lse")
        with np.errstate(over="ignore"):  # beyond float32's range: refused just below
            q = np.ascontiguousarray(q, dtype=np.float32)
        if q.dtype != q_in_dtype and not np.isfinite(q).all():
            raise ValueError(f"queries exceed float32's range (largest magnitude {np.abs(q_in).max():.3g}); "
                             f"{_OVERFLOW_FIX}.")
        T = q.shape[1]
        qpos = np.arange(self._n - T, self._n, dtype=np.int64)
        tail = as_tail(tail)
        if tail is not None and (selector or self.selector) == "cluster" and self.estimate > 0:
            raise ValueError(f"tail= and estimate={self.estimate} both estimate the keys a step does not read; "
                             f"use one: a cache with estimate=0, or tail=None.")
        out, lse, nread, nest, rec, n_rec = self._run(q, qpos, k, selector or self.selector,
                                                      record=tail is not None)
        if lse.max() == np.inf:
            raise ValueError(overflow_message(np.float32, self.scale, _OVERFLOW_FIX))
        if tail is not None:
            from .attention.cache_tail import cache_tail

            out, lse, n_tail = cache_tail(self, q, qpos, out, lse, rec, n_rec, nread, tail)
            nread = nread + n_tail
            self._stats["tail_samples_per_query"] = float(n_tail.mean())
        self._stats["attends"] += 1
        self._last_read = (nread, nest)  # summarised by ``stats`` (not per step: a decode step is short)
        if squeeze:
            out, lse = out[:, 0], lse[:, 0]
        if torch_in:
            import torch

            out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        self._stats["attend_seconds"] += time.perf_counter() - t0
        return (out, lse) if return_lse else out

    def _run(self, q: np.ndarray, qpos: np.ndarray, k: int, sel: str, *, record: bool = False
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One kernel call: out (H, T, Ev), lse (H, T), keys read and clusters estimated per row (R = H*T),
        and with ``record`` (or the h2o policy) the slot ranges each row scored: ``rec[r, :n_rec[r]]`` of
        (first, stop, lim) - slot j of a range was read iff ``pos[g, j] <= qpos[t]`` and ``pos[g, j] < lim``."""
        from .kernels import decode as kd

        H, T = q.shape[0], q.shape[1]
        R = H * T
        out = np.empty((H, T, self.value_dim), np.float32)
        lse = np.empty((H, T), np.float32)
        nread = np.empty(R, np.int64)
        nest = np.empty(R, np.int64)  # written for every row
        # probes, estimated clusters and k: no more than there are (the kernel sizes its per-row heaps by them)
        n_cmax = int(self._n_cent.max(initial=0))
        n_est = min(self.estimate, n_cmax) if sel == "cluster" else 0
        s0 = min(self.sinks, self._slots)
        n_slots = self._slots
        hi = _INT32_MAX
        n_pages = self._n_pages()
        n_probe = min(self.n_probe, n_cmax if sel == "cluster" else n_pages)
        k = min(k, max(n_slots, 1))
        mode = kd.MODE_NONE
        ex_lo = s0
        rows_sel = _NO_ROWS
        n_ranges = 2  # ranges a row may score (recorded for h2o)
        if sel == "cluster":
            mode, ex_lo = kd.MODE_CLUSTER, self._open_end
            n_ranges = 2 + n_probe
            if self.top_p is not None:
                mode, n_ranges = kd.MODE_MASS, 2 + n_cmax
        elif sel == "pages":
            ex_lo = max(s0, n_slots - self.window)
            mode, n_ranges = kd.MODE_PAGES, 2 + n_probe
            hi = int(self._pos[0, ex_lo]) if ex_lo < n_slots else _INT32_MAX
        elif sel == "window":
            ex_lo = max(s0, n_slots - self.window)
        elif sel == "topk":
            mode, n_probe, n_ranges = kd.MODE_TOPK, k, k
        elif sel != "dense" and self._index[0] is not None:  # an index selector (dense until it is built)
            ex_lo = max(s0, n_slots - self.window)
            hi = int(self._pos[0, ex_lo]) if ex_lo < n_slots else _INT32_MAX
            rows_sel = self._index_select(q, qpos, k, hi)
            mode, n_ranges = kd.MODE_LIST, 2 + rows_sel.shape[1]
        if sel == "cluster":
            budget = self.top_p_max_keys if self.top_p is not None else self.n_probe * self.cluster_size
            # the routing scan: one int8 vector of E bytes per cluster, counted in keys' bytes
            key_bytes = (self.head_dim + self.value_dim) * self._sdtype.itemsize
            route = n_cmax * self.head_dim // max(key_bytes, 1)
            work = (n_slots - ex_lo + s0 + budget + route) * R
        elif sel == "pages":
            work = (self.window + s0 + self.n_probe * self.page_size + n_pages // 8) * R
        elif sel == "window":
            work = (self.window + s0) * R
        elif mode == kd.MODE_LIST:
            work = (self.window + s0 + 4 * k) * R
        else:
            work = n_slots * R
        parallel = self.parallel if self.parallel is not None else work >= PARALLEL_MIN_KEYS
        if self.storage == "bfloat16":
            fn = kd.decode_parallel_bf16 if parallel else kd.decode_serial_bf16
        else:
            fn = kd.decode_parallel if parallel else kd.decode_serial
        h2o = self.policy == "h2o"
        if h2o or record:
            rec = np.zeros((R, max(n_ranges, 1), 3), np.int64)
            n_rec = np.zeros(R, np.int64)
        else:  # nothing recorded: the kernel reads neither
            rec, n_rec = _NO_REC, _NO_REC_N
        rep = self.num_heads // self.num_kv_heads
        t1 = time.perf_counter()
        K, V, pmin, pmax = self._K, self._V, self._pmin, self._pmax
        if self.storage == "float16":  # the kernel reads float16 as uint16 bit patterns
            K, V, pmin, pmax = (a.view(np.uint16) for a in (K, V, pmin, pmax))
        fn(q, qpos, rep, K, V, self._pos, s0, ex_lo, n_slots, hi, mode,
           n_probe, self._cent, self._cscale, self._cptr, self._n_cent, self._ccount, pmin, pmax, self._pminpos,
           self.page_size, np.float32(self.scale), n_est, self._cvmean, self._cminpos, self._cmaxpos,
           float(self.top_p if self.top_p is not None else 1.0), self.top_p_min_keys, self.top_p_max_keys,
           rows_sel, rec, n_rec, out, lse, nread, nest)
        if h2o and n_slots:
            if self.storage == "bfloat16":
                acc = kd.accumulate_parallel_bf16 if parallel else kd.accumulate_serial_bf16
            else:
                acc = kd.accumulate_parallel if parallel else kd.accumulate_serial
            acc(q, qpos, rep, K, self._pos, rec, n_rec, lse, np.float32(self.scale), self._weight)
        self._stats["kernel_seconds"] += time.perf_counter() - t1
        return out, lse, nread, nest, rec, n_rec
