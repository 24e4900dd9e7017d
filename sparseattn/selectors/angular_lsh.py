"""``angular-lsh``: Reformer-style angular LSH with sorted buckets and chunks, all in Numba.

Kitaev, Kaiser & Levskaya, "Reformer: The Efficient Transformer" (ICLR 2020), Sect. 2: a random rotation
``R`` (E x n_buckets/2) hashes a vector to ``argmax([xR, -xR])`` (cross-polytope / angular LSH); the
positions are sorted by bucket (then by position) and cut into chunks of ``chunk_size``; each chunk
attends to itself and the previous chunk; ``n_rounds`` independent rotations are unioned.

Here queries and keys are distinct (Q != K in general).  Per round:

1. Build: the keys are centred (exact for softmax) and bucketed.  Cross-polytope buckets are
   scale-invariant, so normalising the keys (as the shared-QK Reformer does) would change nothing and is
   not offered.  ``n_hashes > 1`` concatenates hashes into the bucket id (``n_buckets**n_hashes``
   buckets), first hash most significant: the sorted order groups keys by their first hash, then by the
   next, so a window that spills over its bucket spills into keys that still share the first hash (the
   LSH-forest idea).  The keys are sorted by bucket, then inside a bucket by ``order``:

   * ``order="norm"`` (default, a MIPS-aware change to the Reformer): largest centred-key norm first.
     Inside a bucket the angles to the query are alike, and ``q.k = |q| |k| cos``, so the largest keys
     are the likeliest top-k.  The query is placed at the start of its bucket (its *slot*) and gathers
     the ``2 * chunk_size`` keys from there on (into the following buckets when its own is smaller).
   * ``order="position"`` (the Reformer's chunks): by key id.  The query's slot is inside its bucket,
     after the keys whose id is below its causal prefix length ``c`` (the number of keys with position
     <= the query's; default positions give ``c = i + 1``): for shared-QK self-attention (Q = K) exactly
     the Reformer's order with the query at its own position.  The query gathers the chunk
     (``chunk_size`` keys, chunks aligned at multiples of ``chunk_size``) holding its slot and the
     previous chunk, which may include keys of neighbouring buckets as in the Reformer.
   * ``chunk_size = 0`` (bucket variant, either order): every key of the query's bucket (rows can get
     large on clustered keys).

2. Causal (strictly causal: row i depends only on the keys at positions <= its own).  Sorting all keys
   together would let later keys move earlier ones in and out of a query's window (and shift the mean),
   so causal queries use dyadic blocks, as :class:`~sparseattn.selectors.base.IndexSelector` does.
   With the keys ranked by position, query i may see ranks ``[0, c)``; that prefix is cut into an exact
   tail ``[B*floor(c/B), c)`` (``B = causal_block`` = 1024) and aligned blocks ``[t*2^l*B, (t+1)*2^l*B)``
   of the binary decomposition of ``floor(c/B)``.  Each block is centred on its own mean, bucketed and
   sorted exactly as above (built lazily, cached), and the query takes its windows in every block (it
   sits after the whole block: ``order="position"`` places it at the end of its bucket).  The tail
   contributes its exact top-k (``rerank=False``: every tail key).  So prefixes shorter than ``B`` are
   answered exactly, and a longer prefix gets ``<= log2(c/B)`` blocks' windows (more candidates than the
   non-causal search).  The rotations depend on the seed and E only.
3. ``rerank=True``: the exact top-k (by inner product) of the union over rounds; ``rerank=False``: the
   whole union (rows of variable size, at most ``2 * chunk_size * n_rounds``; ``k`` is ignored).

Measured (shared 2-vCPU machine, 1 Numba thread, defaults; d = 64, k = 64, every key also a query;
recall@64 against the exact top-64 on 2,048 sampled queries; ``sparseattn.data.gaussian`` /
``clustered`` with seed 0):

=========  ==========  ========  =========  ==========================  =====================
S          data        build     query      recall (order="norm")       (order="position",
                                 (all S)                                n_hashes=4: Reformer)
=========  ==========  ========  =========  ==========================  =====================
4,096      gaussian    0.01 s    0.10 s     0.51                        0.49
4,096      clustered   0.01 s    0.08 s     0.92                        0.81
16,384     gaussian    0.05 s    0.58 s     0.33                        0.26
16,384     clustered   0.05 s    0.37 s     0.90                        0.68
65,536     gaussian    0.25 s    2.8 s      0.21                        0.13
65,536     clustered   0.21 s    2.2 s      0.80                        0.37
=========  ==========  ========  =========  ==========================  =====================

Causal (same settings, the strictly causal block scheme of item 2): recall 0.84 / 0.62 on Gaussian and
0.97 / 0.96 on clustered keys at S = 4k / 16k (all S queries in 2.4 s / 14 s on Gaussian keys, measured
with the machine at load ~12; hashing all keys together, which let later keys change earlier rows,
reached 0.46 / 0.28 and 0.80 / 0.74 at slightly lower cost than non-causal).  With 2 threads the 65k queries took 2.0 s / 1.1 s.  The
numpy brute-force top-64 takes ~1.2 s per 2,048 queries at S = 65,536 (~40 s for all).  Isotropic
Gaussian keys are the hard case for every hash; the literal single-hash Reformer
(``order="position", n_hashes=1, n_buckets=256, n_rounds=8``) reached 0.06 / 0.11 at 65k.

Cost: build one (S, E) x (E, n_rounds * n_hashes * n_buckets/2) product and ``n_rounds`` sorts; query
the same product for the queries, ``3 * n_rounds`` binary searches and ``<= 2 * chunk_size * n_rounds``
gathered dot products per query, parallel over blocks of queries.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..index.segments import dyadic_cover, scatter_rows
from ..kernels import lsh as lk
from ..kernels.topk import ORDER_NONE, block_topk, rerank_topk
from ..pattern import SparsePattern
from .base import Selector
from .params import Param, non_negative, positive
from .registry import register

_ORDERS = ("position", "norm")


def _order_check(v: Any) -> str | None:
    return None if v in _ORDERS else "must be one of " + ", ".join(repr(o) for o in _ORDERS)


def _even(v: Any) -> str | None:
    return None if v >= 2 and v % 2 == 0 else "must be an even integer >= 2 (argmax over [xR, -xR])"


@register
class AngularLSHSelector(Selector):
    """Reformer-style angular LSH: sorted buckets, windows in the sorted key order, union over rounds.

    Parameters
    ----------
    n_buckets : int, default 16
        Buckets per hash (even): ``argmax`` over ``[xR, -xR]`` with ``R`` of ``n_buckets / 2`` random
        Gaussian directions.
    n_hashes : int, default 2
        Hashes concatenated into one round's bucket id (``n_buckets ** n_hashes`` buckets).  With
        ``order="position"`` and 1 hash (the Reformer's setting), ``n_buckets`` must be about
        ``S / chunk_size``: a bucket much larger than the window is seen as an arbitrary positional slice.
    n_rounds : int, default 16
        Independent hashing rounds whose candidates are unioned.
    chunk_size : int, default 32
        Window size unit: ``2 * chunk_size`` keys per round (``order="norm"``: from the bucket start;
        ``"position"``: the chunk holding the query's slot and the previous chunk).  0: the whole bucket.
    order : {"norm", "position"}, default "norm"
        Order of the keys inside a bucket (see the module docstring); "position" is the Reformer's.
    rerank : bool, default True
        Return the exact top-k of the candidates; False: all candidates (``k`` ignored).
    seed : int, default 0
        Seed of the random rotations.
    center : bool, default True
        Subtract the mean key before hashing.

    Attributes (after ``build``)
    ----------------------------
    mean_ : (E,) mean key (zeros when ``center=False``)
    rotations_ : (E, n_rounds * n_hashes * n_buckets / 2) array in the keys' dtype
    sorted_ids_ : (n_rounds, S) int64, key ids sorted by (bucket, then -norm or id) per round
    sorted_buckets_ : (n_rounds, S) int64, their buckets

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> keys = rng.standard_normal((1000, 16)).astype(np.float32)
    >>> sel = AngularLSHSelector(n_buckets=16, chunk_size=32).build(keys)
    >>> p = sel.query(keys[:5], k=8)
    >>> p.nnz_per_row.tolist()
    [8, 8, 8, 8, 8]
    >>> cand = AngularLSHSelector(rerank=False, n_rounds=2, chunk_size=32).build(keys).query(keys[:5])
    >>> cand.stats()["max_per_row"] <= 2 * 2 * 32
    True
    """

    name = "angular-lsh"
    metric = "inner_product"
    #: Causal search: size of the exact tail and of the smallest dyadic block (see ``_causal_query``).
    causal_block: ClassVar[int] = 1024
    guarantee = ("approximate: candidates are, per round, 2*chunk_size consecutive keys (chunk_size=0: the "
                 "query's bucket) of the key order sorted by cross-polytope bucket of the centred keys (inside "
                 "a bucket by decreasing norm, or by id for order=position), placed by the query's bucket, "
                 "unioned over n_rounds; rerank=True returns the exact top-k of the candidates by exactly "
                 "computed inner product, rerank=False all of them; no recall bound. Causal: strictly causal "
                 "(row i depends only on the keys at positions <= its own): the allowed prefix is an exact "
                 "tail of < causal_block keys (its top-k; rerank=False: all of it) plus aligned dyadic blocks, "
                 "each centred, hashed and sorted on its own keys, searched by the same windows.")
    params_spec = {
        "n_buckets": Param(int, 16, "buckets per hash (even): argmax over [xR, -xR], R with n_buckets/2 "
                                    "directions", _even),
        "n_hashes": Param(int, 2, "hashes concatenated into a round's bucket (n_buckets**n_hashes)", positive),
        "n_rounds": Param(int, 16, "independent hashing rounds (candidates unioned)", positive),
        "chunk_size": Param(int, 32, "window unit: 2*chunk_size keys per round; 0 = whole bucket", non_negative,
                            when="query"),
        "order": Param(str, "norm", "order inside a bucket: 'norm' (largest centred-key norm first, window "
                                    "from the bucket start) or 'position' (Reformer: by id, query at its "
                                    "position, chunk + previous chunk)", _order_check),
        "rerank": Param(bool, True, "exact top-k of the candidates (False: keep all candidates)", when="query"),
        "seed": Param(int, 0, "seed of the random rotations", non_negative),
        "center": Param(bool, True, "subtract the mean key before hashing"),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        nb, nh = self._params["n_buckets"], self._params["n_hashes"]
        if nh * np.log2(nb) > 62:
            raise ValueError(f"angular-lsh: n_buckets**n_hashes must stay below 2**62 (bucket ids are int64); "
                             f"got n_buckets={nb}, n_hashes={nh}. Use fewer hashes or buckets.")

    # ------------------------------------------------------------------------------------- hashing
    def rotations(self, dim: int, dtype: Any = np.float32) -> np.ndarray:
        """Random directions ``R``, shape (dim, n_rounds * n_hashes * n_buckets / 2), drawn from ``seed``."""
        p = self._params
        rng = np.random.default_rng(p["seed"])
        R = rng.standard_normal((int(dim), p["n_rounds"] * p["n_hashes"] * (p["n_buckets"] // 2)))
        return np.ascontiguousarray(R, dtype=dtype)

    def buckets(self, vectors: np.ndarray) -> np.ndarray:
        """Bucket of each row in each round: (n_rounds, n) int64 (rows used as given, not centred)."""
        x = np.ascontiguousarray(vectors)
        if x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float32)
        R = self.rotations_ if (self.keys_ is not None and self.rotations_.shape[0] == x.shape[1]
                                and self.rotations_.dtype == x.dtype) else self.rotations(x.shape[1], x.dtype)
        p = self._params
        return lk.crosspolytope_buckets(x @ R, p["n_rounds"], p["n_hashes"], p["n_buckets"] // 2)

    # ----------------------------------------------------------------------------------------- work
    def _build(self, keys: np.ndarray) -> None:
        self.rotations_ = self.rotations(keys.shape[1], keys.dtype)
        self.mean_, self.sorted_ids_, self.sorted_buckets_ = self._sorted_keys(keys)
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._block_order: np.ndarray | None = None  # key order the cached causal blocks were built in

    def _sorted_keys(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean (E,), sorted ids (n_rounds, n) int64, their buckets (n_rounds, n) int64) of (n, E) keys.

        The keys are centred by their own mean (``center``), bucketed, and sorted by bucket, then by
        decreasing centred norm (``order="norm"``) or by id, ties by id.
        """
        center = self._params["center"]
        mean = keys.mean(axis=0, dtype=np.float64).astype(keys.dtype) if center and keys.shape[0] \
            else np.zeros(keys.shape[1], keys.dtype)
        centred = np.ascontiguousarray(keys - mean) if center else keys
        kb = self.buckets(centred)
        if self._params["order"] == "norm":  # by bucket, then largest norm first, then id
            minus_norm = -np.sqrt(np.einsum("ij,ij->i", centred, centred, dtype=np.float64))
            order = np.stack([np.lexsort((minus_norm, b)) for b in kb]) if kb.shape[1] else \
                np.zeros(kb.shape, dtype=np.int64)
        else:
            order = np.argsort(kb, axis=1, kind="stable")  # by bucket, ties by id
        sorted_ids = np.ascontiguousarray(order, dtype=np.int64)
        return mean, sorted_ids, np.ascontiguousarray(np.take_along_axis(kb, order, axis=1))

    def _query(self, q: np.ndarray, k: int, is_causal: bool, qpos: np.ndarray,
               kpos: np.ndarray) -> SparsePattern:
        S = self.keys_.shape[0]
        L = q.shape[0]
        if S == 0 or L == 0:
            return SparsePattern(np.zeros(L + 1, dtype=np.int64), np.zeros(0, dtype=np.int32), S,
                                 validate=False)
        if is_causal:
            return self._causal_query(q, k, qpos, kpos)
        qb = self.buckets(q)
        sorted_kpos = kpos if np.all(kpos[1:] >= kpos[:-1]) else np.sort(kpos)
        prefix = np.searchsorted(sorted_kpos, qpos, side="right").astype(np.int64)
        if self._params["rerank"]:
            return SparsePattern.from_padded(self._window_ids(q, qb, self.keys_, self.sorted_ids_,
                                                              self.sorted_buckets_, prefix, k), S)
        indptr, indices = self._window_csr(qb, self.sorted_ids_, self.sorted_buckets_, prefix)
        return SparsePattern(indptr, indices, S, validate=False)

    # ---------------------------------------------------------------------------------- windows
    def _window_args(self, qb: np.ndarray, sorted_ids: np.ndarray, sorted_buckets: np.ndarray,
                     prefix: np.ndarray) -> tuple[Any, ...]:
        """Kernel arguments of the windows of queries with buckets ``qb`` (R, L) in one sorted key order."""
        forward = self._params["order"] == "norm"
        slots, lo, hi = lk.query_slots(qb, sorted_buckets, sorted_ids,
                                       np.zeros_like(prefix) if forward else prefix)
        if forward:
            slots = lo  # the query sits before its bucket's largest-norm key
        none = np.zeros(0, dtype=np.int64)
        return (slots, lo, hi, sorted_ids, self._params["chunk_size"], forward, False, none, none)

    def _window_ids(self, q: np.ndarray, qb: np.ndarray, keys: np.ndarray, sorted_ids: np.ndarray,
                    sorted_buckets: np.ndarray, prefix: np.ndarray, k: int) -> np.ndarray:
        """(L, k) int64 ids (local to ``keys``, -1 padded): the exact top-k of each query's windows."""
        return lk.window_topk(q, keys, *self._window_args(qb, sorted_ids, sorted_buckets, prefix), k)

    def _window_csr(self, qb: np.ndarray, sorted_ids: np.ndarray, sorted_buckets: np.ndarray,
                    prefix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indptr (L + 1,) int64, indices int32): every candidate of each query's windows (local ids)."""
        args = self._window_args(qb, sorted_ids, sorted_buckets, prefix)
        counts = lk.window_counts(*args)
        indptr = np.zeros(qb.shape[1] + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return indptr, lk.window_fill(*args, indptr)

    # ----------------------------------------------------------------------------------- causal
    def _causal_block(self, level: int, t: int, order: np.ndarray | None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, sorted ids, sorted buckets) of causal block ``t`` at ``level`` (keys ranked by position).

        Built from the block's keys alone (own mean, own sort), lazily, cached until the key order changes.
        """
        if (order is None) != (self._block_order is None) or (
                order is not None and not np.array_equal(order, self._block_order)):
            self._blocks = {}
            self._block_order = order
        key = (level, t)
        if key not in self._blocks:
            size = self.causal_block << level
            rows = slice(t * size, (t + 1) * size)
            keys = self.keys_[rows] if order is None else np.ascontiguousarray(self.keys_[order[rows]])
            _, sorted_ids, sorted_buckets = self._sorted_keys(keys)
            self._blocks[key] = (keys, sorted_ids, sorted_buckets)
        return self._blocks[key]

    def _causal_query(self, q: np.ndarray, k: int, qpos: np.ndarray, kpos: np.ndarray) -> SparsePattern:
        """Strictly causal search: exact tail plus aligned dyadic blocks, each hashed on its own keys.

        With the keys ranked by position (``order``), query i may see ranks ``[0, c_i)``.  That prefix is
        cut into an exact tail ``[B*floor(c/B), c)`` (its top-k by inner product) and aligned dyadic blocks
        ``[t*2^l*B, (t+1)*2^l*B)``, each centred, bucketed and sorted on its own keys; the query takes its
        windows in every block.  No structure involves a key outside the query's prefix, so row i is a
        function of the keys at positions <= its own.
        """
        S, L = self.keys_.shape[0], q.shape[0]
        sorted_order = bool(np.all(kpos[1:] >= kpos[:-1]))
        order = None if sorted_order else np.argsort(kpos, kind="stable").astype(np.int64)
        rank_ids = np.arange(S, dtype=np.int64) if order is None else order  # global id of each rank
        prefix = np.searchsorted(kpos if order is None else kpos[order], qpos, side="right").astype(np.int64)
        B = self.causal_block
        n_full = prefix // B
        rerank = self._params["rerank"]
        qb = self.buckets(q)
        # Exact tail: its top-k (rerank=False: every key of it, all being candidates).
        tail = np.full((L, min(k, B) if rerank else min(B, S)), -1, dtype=np.int64)
        for b in np.unique(n_full):
            rows = np.nonzero(n_full == b)[0]
            lo, hi = int(b) * B, min(int(b) * B + B, S)
            if hi <= lo:
                continue
            if not rerank:
                cols = np.arange(hi - lo)
                tail[rows, :hi - lo] = np.where(cols[None, :] < (prefix[rows] - lo)[:, None],
                                                rank_ids[lo:hi][None, :], -1)
                continue
            ranks = np.arange(lo, hi, dtype=np.int64)
            s = q[rows] @ self.keys_[rank_ids[lo:hi]].T
            kk = min(k, hi - lo)
            top_s = np.empty((rows.size, kk), dtype=s.dtype)
            top_i = np.empty((rows.size, kk), dtype=np.int64)
            block_topk(s, kk, True, prefix[rows] - 1, ranks, rank_ids[lo:hi], top_s, top_i, ORDER_NONE, False)
            tail[rows, :kk] = top_i
        pieces = [tail]
        for level, blocks in dyadic_cover(n_full * B, B):
            size = B << level
            found: list[tuple[np.ndarray, np.ndarray]] = []
            for t, rows in blocks:
                keys, sorted_ids, sorted_buckets = self._causal_block(level, t, order)
                # the whole block precedes the query: it sits after every key of its bucket
                at_end = np.full(rows.size, keys.shape[0], dtype=np.int64)
                qb_rows = np.ascontiguousarray(qb[:, rows])
                if rerank:
                    local = self._window_ids(np.ascontiguousarray(q[rows]), qb_rows, keys, sorted_ids,
                                             sorted_buckets, at_end, k)
                else:
                    ptr, idx = self._window_csr(qb_rows, sorted_ids, sorted_buckets, at_end)
                    local = SparsePattern(ptr, idx, keys.shape[0], validate=False).to_padded() \
                        if idx.size else np.full((rows.size, 0), -1, dtype=np.int64)
                local = np.asarray(local, dtype=np.int64)
                base = t * size
                found.append((rows, np.where(local >= 0, rank_ids[np.maximum(local, 0) + base], -1)))
            pieces.append(scatter_rows(found, L))
        cand = np.concatenate(pieces, axis=1)
        if rerank:
            _, ids = rerank_topk(q, self.keys_, cand, k, True)
            return SparsePattern.from_padded(ids, S)
        return SparsePattern.from_padded(cand, S)
