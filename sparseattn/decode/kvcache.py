"""The decode cache's façade, :class:`KVCache`: validation, the lock, counters, and the calls that drive
the parts (store, routing strategy, eviction policy, step plan, kernel) of :mod:`sparseattn.decode`."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import numpy as np

from ..attention.tail import as_tail
from ..inputs import check_bool, check_positive_int, overflow_message
from ..kernels.decode import step_summary
from . import checks as ck
from .config import CacheConfig
from .eviction import enforce_cap, make_policy
from .options import Budget, Layout, Retention, resolve_options
from .plan import StepResult, run_strategy
from .report import CacheReport
from .routing import Routing, routing_class, routing_classes
from .store import EVICTED, INT32_MAX, SlotStore, is_torch

__all__ = ["KVCache"]

_F32 = np.dtype(np.float32)


def _locked(method: Any) -> Any:
    """Run ``method`` holding the cache's lock (calls on one cache from several threads take turns)."""
    @functools.wraps(method)
    def run(self: KVCache, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class KVCache(CacheReport):
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
    selector : str, default "sketch"
        How each step picks keys beyond the exact sinks + window (see the module docstring): one of
        ``"sketch"`` (the default: the sign plane of every clustered key's 4-bit residual code is
        scanned, the best 3 % are re-ranked by the whole code, and the best ``max(1024, 1/128 of the
        clustered keys)`` of those are read exactly; ``"sketch:candidates=N"`` or ``"sketch:fraction=F"``
        set that budget, ``"sketch:shortlist=S"`` the re-ranked share), ``"cluster"`` (whole clusters ranked by their mean
        key: faster, but it misses keys that point at the query from clusters that do not, more so as
        the cache grows; the only one with ``estimate`` and ``top_p``), ``"pages"``, ``"window"``,
        ``"topk"``, ``"dense"``, or the spec string of an index selector that supports ``add()``
        (``"faiss-flat"``, ``"faiss-hnsw:M=16"``, ``"faiss-ivf"``, ``"faiss-ivfpq"``), whose per-query
        budget is ``attend(k=...)``.
    dtype : numpy.float32, numpy.float16 or "bfloat16", default float32
        Storage of keys and values (bfloat16 is held as uint16 bit patterns); scores and sums are
        float32 in every case.  Appended inputs are rounded to it.
    retention : Retention, optional
        ``Retention(sinks=4, window=64, max_keys=None, policy="streaming")``: the positions always read
        exactly and the memory cap with its eviction policy.
    layout : Layout, optional
        ``Layout(segment=4096, open_step=None, cluster_size=64, page_size=16, seed=0)``: how keys are
        clustered in segments (and paged for ``"pages"``).
    budget : Budget, optional
        ``Budget(n_probe=None, estimate=0, top_p=None, top_p_min_keys=0, top_p_max_keys=None)``: clusters
        or pages read per query, the estimation zone and the mass-driven budget (``"cluster"`` /
        ``"pages"``).
    scale : float, optional
        Score scale, > 0 (default ``1 / sqrt(E)``).
    parallel : bool, optional
        Run the step's rows (heads x tokens; with grouped-query attention, groups of query heads that share
        a kv head) on Numba's threads (``True``) or on one thread (``False``);
        default: parallel when the step scores at least ``PARALLEL_MIN_KEYS`` keys in total.
    **legacy
        The flat keywords of the three groups (``sinks=``, ``segment=``, ``n_probe=``, ...): deprecated,
        accepted for one release with a ``DeprecationWarning``.

    Every option is also an attribute of the cache (``cache.segment``, ``cache.n_probe``, ...).

    Threads: one cache may be used from several threads; ``append``, ``reserve``, ``attend``,
    ``selected_slots`` and ``positions`` hold the cache's lock, so calls on one cache take turns (each
    kernel call is parallel inside).  For concurrent sequences use one cache per sequence.

    Examples
    --------
    >>> import numpy as np
    >>> from sparseattn import KVCache, Layout
    >>> rng = np.random.default_rng(0)
    >>> cache = KVCache(num_heads=4, head_dim=16, layout=Layout(segment=256, cluster_size=16))
    >>> cache.append(rng.standard_normal((4, 1000, 16)), rng.standard_normal((4, 1000, 16)))
    >>> out = cache.attend(rng.standard_normal((4, 1, 16)).astype(np.float32))
    >>> len(cache), out.shape, out.dtype
    (1000, (4, 1, 16), dtype('float32'))
    """

    def __init__(self, num_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
                 value_dim: int | None = None, selector: str = "sketch", dtype: object = np.float32,
                 retention: Retention | None = None, layout: Layout | None = None, budget: Budget | None = None,
                 scale: float | None = None, parallel: bool | None = None, **legacy: Any) -> None:
        opts = resolve_options({"retention": retention, "layout": layout, "budget": budget}, legacy)
        cfg = CacheConfig(num_heads, head_dim, num_kv_heads=num_kv_heads, value_dim=value_dim, selector=selector,
                          routing_cls=routing_class(selector), dtype=dtype, scale=scale, parallel=parallel, **opts)
        self.__dict__.update(cfg.public())
        self._cfg = cfg
        self._store = SlotStore(cfg.num_kv_heads, cfg.head_dim, cfg.value_dim, dtype, sinks=cfg.sinks,
                                window=cfg.window, segment=cfg.segment, page_size=cfg.page_size,
                                max_keys=cfg.max_keys)
        self.storage = self._store.storage
        self._routing: Routing = routing_class(selector)(cfg, self._store)
        self._policy = make_policy(cfg.policy, self._store, self._routing, sinks=cfg.sinks, window=cfg.window)
        self._lock = threading.RLock()  # append / reserve / attend / selected_slots / positions take turns
        # keys read, clusters estimated, top_p walk capped, per row of the last attend
        self._last_read: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._stats: dict[str, Any] = {
            "appends": 0, "append_seconds": 0.0, "attends": 0, "attend_seconds": 0.0, "kernel_seconds": 0.0,
            "evicted_keys": 0, "compactions": 0, "queries": 0, "keys_read": 0, "clusters_estimated": 0,
            "top_p_capped": 0,
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
        return self._store.n_live

    def __repr__(self) -> str:
        return (f"KVCache(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim="
                f"{self.head_dim}, value_dim={self.value_dim}, selector={self.selector!r}, dtype="
                f"{self.storage}, len={len(self)}, segments={self.stats['segments']})")

    @property
    def store(self) -> SlotStore:
        """The slot store (keys, values, positions per kv head): read it, never write it."""
        return self._store

    @property
    def positions_appended(self) -> int:
        """Positions appended so far (the position the next key will get)."""
        return self._store.n

    @_locked
    def positions(self, kv_head: int = 0) -> np.ndarray:
        """Sorted positions (int64) of the keys kv head ``kv_head`` (0 <= kv_head < H_kv) can attend to now."""
        return self._store.live_positions(ck.check_kv_head(self._cfg, kv_head))

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
        if self._store.n + n_tokens >= INT32_MAX:
            raise ValueError(f"n_tokens={n_tokens}: the cache holds positions as int32, so fewer than "
                             f"{INT32_MAX - self._store.n} more tokens fit; reserve fewer.")
        try:
            self._reserve(n_tokens, exact=True)
        except MemoryError as exc:
            raise MemoryError(f"n_tokens={n_tokens}: storage for {self._store.slots + n_tokens} tokens does not "
                              f"fit in memory; reserve fewer.") from exc

    def _reserve(self, extra: int, *, exact: bool = False) -> None:
        cap = self._store.reserve(extra, exact=exact)
        if cap is not None:
            self._routing.grown(cap)

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
        st = self._store
        hk = self.num_kv_heads
        if (type(keys) is np.ndarray and type(values) is np.ndarray and keys.dtype == _F32
                and values.dtype == _F32 and keys.shape == (hk, 1, self.head_dim)
                and values.shape == (hk, 1, self.value_dim) and st.n + 1 < INT32_MAX
                and self._append_token(keys, values)):
            self._stats["appends"] += 1
            self._stats["append_seconds"] += time.perf_counter() - t0
            return
        k, v = ck.check_kv(self._cfg, keys, values)
        ks = st.encode(k, "keys")
        vs = st.encode(v, "values")
        T = ks.shape[1]
        if st.n + T >= INT32_MAX:
            raise ValueError(f"the cache holds positions as int32: fewer than {INT32_MAX} tokens in total.")
        done = 0
        while done < T:
            # bounded pieces: under a memory cap, storage is freed between pieces
            step = T - done if self.max_keys is None else min(T - done, self.segment)
            self._reserve(step)
            a, b = st.slots, st.slots + step
            st.K[:, a:b] = ks[:, done:done + step]
            st.V[:, a:b] = vs[:, done:done + step]
            self._commit(a, b)
            done += step
        self._stats["appends"] += 1
        self._stats["append_seconds"] += time.perf_counter() - t0

    def _append_token(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """One float32 token (H_kv, 1, E) / (H_kv, 1, Ev): checked and rounded straight into its slot by
        one Numba call per array (the decode loop's append).  False, with nothing appended, when a value
        is not finite or beyond the storage range (the general path then raises the error)."""
        self._reserve(1)
        a = self._store.slots
        if not self._store.write_token(keys, values):
            return False
        self._commit(a, a + 1)
        return True

    def _commit(self, a: int, b: int) -> None:
        """Slots [a, b) (just written at the end) become the next positions: indexes, caps follow."""
        self._store.commit(a, b)
        self._policy.committed(a, b)
        self._routing.committed(a, b)
        enforce_cap(self._store, self._routing, self._policy, self.max_keys, self.segment, self._stats)

    # ---------------------------------------------------------------------------------------- attend
    def _strategy(self, selector: str | None) -> Routing:
        """The cache's strategy, or a per-call override that works on any cache (ValueError otherwise)."""
        if selector is None or selector == self.selector:
            return self._routing
        own = routing_classes()
        if isinstance(selector, str) and selector in own and own[selector].any_cache:
            return own[selector](self._cfg, self._store)
        raise ValueError(f"selector must be None, 'dense', 'topk' or 'window' (the cache's own is "
                         f"{self.selector!r}); got {selector!r}.")

    @_locked
    def selected_slots(self, query: object, head: int, k: int | None = 64, *, selector: str | None = None
                       ) -> np.ndarray:
        """Storage slots the step of one query token of head ``head`` reads (for measuring recall).

        ``query`` is (E,) at the newest position; the result is sorted int64 slot ids of kv head
        ``head // (H // H_kv)``, with the same selection as :meth:`attend` (``cluster``: routed clusters by
        a stable sort, so ties at the last routed score may differ from the kernel's heap; ``top_p``: the
        walk recomputed in float64).  ``selector`` overrides the cache's as in :meth:`attend`.
        """
        strategy = self._strategy(selector)
        head = check_positive_int(head, "head", minimum=0, maximum=self.num_heads - 1)
        k = ck.check_budget(k)
        q = ck.check_query(self._cfg, query)
        g = head // (self.num_heads // self.num_kv_heads)
        st = self._store
        visible = st.pos[g, :st.slots] != EVICTED
        sel = np.unique(np.concatenate(strategy.selected(q, g, k)).astype(np.int64))
        return sel[visible[sel]]

    @_locked
    def attend(self, queries: object, k: int | None = None, *, return_lse: bool = False, selector: str | None = None,
               tail: object = None) -> Any:
        """Attention of the newest T_q positions' queries over the cache.

        Query t sits at position ``n - T_q + t`` (n = positions appended so far): causal among the
        queries and over the cache.  Call ``append`` with the step's own key and value first.  With
        ``policy="h2o"`` the softmax weight of every key read is added to its accumulated weight.

        Parameters
        ----------
        queries : float array or torch CPU tensor, shape (H, T_q, E), or (H, E) for one token
        k : int, default 64
            Keys per query of the ``"topk"`` selector and of index selectors; the others read ``n_probe``
            clusters or pages (or ``top_p`` of the mass) and do not use it.  Keys are not passed here:
            append them (with their values) first; an array here is refused.
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
            Wrong shape, NaN/Inf queries, more query tokens than positions appended, a torch tensor that
            requires grad, scores or the output overflowing float32.
        TypeError
            ``k`` not an int (e.g. the key array passed as ``k``).
        """
        t0 = time.perf_counter()
        torch_in = is_torch(queries)
        q, squeeze = ck.check_queries(self._cfg, queries)
        strategy = self._strategy(selector)
        k = ck.check_budget(k)
        check_bool(return_lse, "return_lse")
        T = q.shape[1]
        ck.check_query_tokens(T, self._store.n)
        qpos = np.arange(self._store.n - T, self._store.n, dtype=np.int64)
        tail = as_tail(tail)
        if tail is not None and "estimate" in strategy.supports and self.estimate > 0:
            raise ValueError(f"tail= and estimate={self.estimate} both estimate the keys a step does not read; "
                             f"use one: a cache with estimate=0, or tail=None.")
        res = self._run(q, qpos, k, strategy, record=tail is not None)
        out, lse, nread = res.out, res.lse, res.nread
        status, n_keys, n_est, big = step_summary(out, lse, nread, res.nest)  # one pass: checks and counts
        if status == 1:
            raise ValueError(overflow_message(np.float32, self.scale, ck.OVERFLOW_FIX))
        if status == 2:
            ck.check_output(out)
        if big >= ck.RESOLUTION_LIMIT:
            ck.warn_resolution(float(big))
        if tail is not None:
            from ..attention.cache_tail import cache_tail

            out, lse, n_tail = cache_tail(self, q, qpos, out, lse, res.rec, res.n_rec, nread, tail)
            nread = nread + n_tail
            n_keys += int(n_tail.sum())
            self._stats["tail_samples_per_query"] = float(n_tail.mean())
        self._stats["attends"] += 1
        self._stats["queries"] += nread.size
        self._stats["keys_read"] += int(n_keys)
        self._stats["clusters_estimated"] += int(n_est)
        self._stats["top_p_capped"] += int(res.ncap.sum())
        self._last_read = (nread, res.nest, res.ncap)  # summarised by ``stats`` (a decode step is short)
        if squeeze:
            out, lse = out[:, 0], lse[:, 0]
        if torch_in:
            import torch

            out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        self._stats["attend_seconds"] += time.perf_counter() - t0
        return (out, lse) if return_lse else out

    def _run(self, q: np.ndarray, qpos: np.ndarray, k: int, strategy: Routing, *, record: bool = False
             ) -> StepResult:
        """One kernel call of ``strategy``'s plan (with ``record`` or h2o, the slot ranges each row read)."""
        res = run_strategy(self._store, strategy, q, qpos, k, scale=self.scale, parallel=self.parallel,
                           record=record, weights=self._policy.weights)
        self._stats["kernel_seconds"] += res.seconds
        return res
