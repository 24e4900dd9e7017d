"""FAISS selectors: exact (flat), graph (HNSW), inverted-file (IVF) and product-quantised (IVF-PQ) search.

Every selector here searches maximum inner product (``faiss.METRIC_INNER_PRODUCT``) over the *centred*
keys ``k_j - mean`` (param ``center``, default True: subtracting the mean key shifts each query's scores
by the constant ``q . mean``, so the top-k and the softmax are unchanged, while inner-product indexes get
much better conditioned).  The candidates FAISS returns are re-ranked exactly in the input dtype by
:class:`~sparseattn.selectors.base.IndexSelector`, so the scores, the ordering and the final top-k never
carry float32 or PQ error - only *which* keys were found can (and float32 rounding can swap keys whose
scores nearly tie at the k-th place).

FAISS works in float32: float64 keys and queries are converted for the search only (a float32 copy of the
centred keys is kept); the re-rank stays float64.  Any finite float64 magnitude works: keys (or a query row)
whose largest ``|value|`` lies outside ``[2**-40, 2**40]`` are first scaled by a power of two (exact, one
factor for all keys, one per query row, so no ranking changes; see
:class:`~sparseattn.selectors.base.IndexSelector`), so nothing overflows or flushes to zero in float32.
Keys without features (E = 0: every score is 0) build no index; each query gets the ``k`` allowed keys of
smallest id (the base class's rule).  FAISS ids are int64 with -1 for "no result"; those are
dropped at the base-class boundary.

Causal search (``is_causal=True``) uses the base class's prefix-exact scheme: the allowed prefix
``[0, c)`` is split into an exact tail and aligned dyadic blocks, each with its own index (built lazily,
cached).  Causal selection is strictly causal: each block is centred and scaled by its own keys and
indexed with rules that depend on the block's size only, so a query's keys are a function of the keys
at positions <= its own (changing later keys changes no earlier row).  Backend-specific rules for the
block indexes:

* ``faiss-flat``: every block is searched exhaustively (``faiss.knn`` over the block's centred keys),
  so causal results are exact too.
* ``faiss-hnsw``: blocks with fewer than ``hnsw_min_block`` (default 262,144) keys are searched exactly;
  larger blocks get their own HNSW graph with the same parameters.  Measured (n = 65,536, E = 64, k = 64,
  8,192 queries, 1 thread): an exact BLAS scan of 65,536 keys costs 0.13 ms per query against 0.23 ms
  for an HNSW search (ef 128), and each block graph costs ~0.14 ms per key to build, so graphs only pay
  for very large blocks.  With ``hnsw_min_block = 8192`` causal search took 15 s cold / 4.2 s warm at
  recall 0.96, with exact blocks 2.0 s at recall 1.0.  The full graph serves non-causal queries.
* ``faiss-ivf`` / ``faiss-ivfpq``: a block of ``s`` keys gets ``auto_nlist(s)`` lists (at most
  ``nlist``; never a function of S, which would make earlier rows depend on later keys) and is searched
  exactly instead when that is fewer than ``min_block_lists`` (32) lists (``s`` < 1,248), or, for IVF-PQ, when it has fewer than ``39 * 2**nbits`` keys to train
  the codebooks on.  An IVF index cannot be trained on fewer points than lists, and for such small blocks
  an exhaustive scan costs about as much as ``nprobe`` lists plus the coarse quantizer anyway.

Threads: FAISS uses its own OpenMP pool, sized by :func:`set_faiss_threads` (returns the previous value)
and read by :func:`get_faiss_threads`.  On a machine whose other cores are busy, fewer threads are often
faster; setting ``OMP_WAIT_POLICY=PASSIVE`` before the process starts also helps.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ..inputs import as_float_array, check_positive_int
from ..kernels.topk import rerank_topk
from .base import IndexSelector
from .params import Param, positive
from .registry import register

__all__ = [
    "FaissFlatSelector", "FaissHNSWSelector", "FaissIVFFlatSelector", "FaissIVFPQSelector",
    "auto_nlist", "get_faiss_threads", "set_faiss_threads",
]

#: Training points per k-means centroid kept when sub-sampling training data (FAISS's own default cap).
_TRAIN_POINTS_PER_CENTROID = 256
#: Seed of the training sub-sample (fixed: a build is reproducible given the keys and thread count 1).
_TRAIN_SEED = 0


def _faiss() -> Any:
    """Import FAISS lazily, with an install hint."""
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - exercised only without faiss
        raise ImportError("FAISS is not installed: `pip install faiss-cpu` (or conda install -c pytorch "
                          "faiss-cpu) to use the faiss-* selectors.") from exc
    return faiss


# --------------------------------------------------------------------------------------------- threads
def get_faiss_threads() -> int:
    """The number of OpenMP threads FAISS will use (``faiss.omp_get_max_threads()``)."""
    return int(_faiss().omp_get_max_threads())


def set_faiss_threads(n: int) -> int:
    """Set FAISS's OpenMP thread count; return the previous count (to restore it later).

    Parameters
    ----------
    n : int >= 1
        Threads for FAISS index builds and searches (process-wide: FAISS has one OpenMP pool).

    Examples
    --------
    >>> previous = set_faiss_threads(1)
    >>> get_faiss_threads()
    1
    >>> _ = set_faiss_threads(previous)
    """
    n = check_positive_int(n, "n")
    faiss = _faiss()
    previous = int(faiss.omp_get_max_threads())
    faiss.omp_set_num_threads(n)
    return previous


# ------------------------------------------------------------------------------------------- helpers
def auto_nlist(n: int) -> int:
    """Default number of IVF lists for ``n`` keys: ``round(4 * sqrt(n))``, at most ``n // 39``, at least 1.

    The cap keeps >= 39 training points per list (below that FAISS's k-means warns and the lists get
    poorly placed); e.g. n = 16,384 -> 420 lists (39 keys each), n = 65,536 -> 1,024 lists (64 keys each),
    n = 1,000 -> 25 lists.
    """
    return max(1, min(int(round(4.0 * math.sqrt(n))), n // 39))


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _train_sample(x: np.ndarray, n_max: int) -> np.ndarray:
    """At most ``n_max`` rows of ``x`` (a fixed-seed uniform sample without replacement), float32."""
    if x.shape[0] <= n_max:
        return _f32(x)
    rows = np.sort(np.random.default_rng(_TRAIN_SEED).choice(x.shape[0], size=n_max, replace=False))
    return _f32(x[rows])


def _divisors(d: int) -> list[int]:
    return [m for m in range(1, d + 1) if d % m == 0]


class _IndexWithVectors(NamedTuple):
    """A FAISS index of a causal block with the block's centred float32 keys (PQ indexes drop them)."""

    index: Any
    vectors: np.ndarray


#: Appended to every FAISS selector's guarantee.
_RANGE_NOTE = (" Any finite float64 magnitude is searched: keys and each query are scaled by powers of two "
               "into float32's range first (no ranking change); E = 0: the k allowed keys of smallest id.")

_CENTER = Param(bool, True, "subtract the mean key before indexing (exact for softmax; better recall)")


class _FaissSelector(IndexSelector):
    """Shared FAISS plumbing: float32 conversion, search parameters, exact small blocks, ``add``."""

    supports_add: ClassVar[bool] = True
    metric = "inner_product (faiss.METRIC_INNER_PRODUCT)"
    requires = ("faiss", "install it with `pip install faiss-cpu`")

    # ---------------------------------------------------------------------------------- build
    def _build(self, keys: np.ndarray) -> None:
        super()._build(keys)
        # float32 centred keys for exact block scans (a view when the keys already are float32).
        self._c32 = _f32(self.centered_)

    def _block_index(self, level: int, t: int) -> Any:
        key = (level, t)
        if key not in self._blocks:
            size = self.causal_block << level
            # centred and scaled by the block's own keys (a function of them only: strictly causal)
            block = _f32(self._block_space(t * size, (t + 1) * size))
            self._blocks[key] = block if self._block_is_exact(size) else self._make_block_index(block)
        return self._blocks[key]

    def _make_block_index(self, keys: np.ndarray) -> Any:
        """The index of one causal dyadic block (default: the same kind as the full index)."""
        return self._make_index(keys)

    def _block_is_exact(self, size: int) -> bool:
        """Whether a causal dyadic block of ``size`` keys is scanned exhaustively rather than indexed."""
        return True

    # --------------------------------------------------------------------------------- search
    def _search_params(self, k: int) -> Any:
        return None

    def _search(self, index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        faiss = _faiss()
        q32 = _f32(queries)
        if isinstance(index, np.ndarray):  # an exact block: a float32 view of the centred keys
            scores, ids = faiss.knn(q32, index, min(k, index.shape[0]), metric=faiss.METRIC_INNER_PRODUCT)
        else:
            kk = min(k, int(index.ntotal))
            scores, ids = index.search(q32, kk, params=self._search_params(kk))
        return scores, np.asarray(ids, dtype=np.int64)

    # ------------------------------------------------------------------------------ mutation
    def add(self, new_keys: np.ndarray, *, check_finite: bool = True) -> _FaissSelector:
        """Append keys; their ids continue after the existing ones (``S, S + 1, ...``).

        Parameters
        ----------
        new_keys : float array, shape (N, E)
            Converted to the dtype of the built keys.

        Raises
        ------
        ValueError
            ``new_keys`` of the wrong width, or (after a build on scaled keys, see the module notes) so much
            larger than the built keys that they leave the float32 range of the index: rebuild with all keys.
            An IVF selector first built on zero keys is trained on the first keys added, which must then
            number at least ``nlist`` (the message says so).

        Notes
        -----
        * On a selector built on zero keys, the first ``add`` builds the index on the added keys (and
          centres on their mean), exactly as ``build(new_keys)`` would.
        * The centring mean stays the one computed by :meth:`build` (the new keys are shifted by it):
          still exact for the softmax, but if the new keys drift, rebuild to re-centre.
        * IVF coarse quantizers (and PQ codebooks) are not retrained: the new keys go into the lists
          trained on the original keys.
        * Causal search stays correct: cached dyadic block indexes cover only whole, aligned ranges of
          keys that ``add`` leaves unchanged, so they remain valid; blocks that the new keys complete are
          built lazily at the next causal query.
        """
        self._require_built("add")
        nk = as_float_array(new_keys, "new_keys", min_ndim=2, check_finite=check_finite)
        if nk.ndim != 2:
            raise ValueError(f"new_keys must be 2-D (N, E); got shape {nk.shape}.")
        if nk.shape[1] != self.keys_.shape[1]:
            raise ValueError(f"new_keys have E={nk.shape[1]} features but the built keys have "
                             f"{self.keys_.shape[1]}.")
        if nk.shape[0] == 0:
            return self
        nk = np.ascontiguousarray(nk, dtype=self.keys_.dtype)
        if self.index_ is None:  # built on zero keys: index the added ones as build() would
            reasons = self.not_supported_reasons(n_keys=nk.shape[0], dim=nk.shape[1])
            if reasons:
                raise ValueError(f"selector {self.name!r} was built on zero keys, so add() trains it on "
                                 f"new_keys, which cannot run here: {'; '.join(reasons)}")
            return self.build(nk, check_finite=False)
        centered = self._to_index_space(nk)
        if float(np.abs(centered).max(initial=0.0)) > float(np.finfo(np.float32).max):
            raise ValueError(f"new_keys reach magnitude {float(np.abs(nk).max()):.3g}, beyond the float32 range "
                             f"of this index (built on keys scaled by 2**-{self.key_exp_}); call build() with all "
                             f"the keys instead of add().")
        self.index_.add(_f32(centered))
        self.keys_ = np.concatenate([self.keys_, nk])
        self.centered_ = np.concatenate([self.centered_, centered]) if self._params["center"] or self.key_exp_ \
            else self.keys_
        self._c32 = _f32(self.centered_)
        return self


# ---------------------------------------------------------------------------------------------- flat
@register
class FaissFlatSelector(_FaissSelector):
    """Exhaustive inner-product search with ``faiss.IndexFlatIP`` (BLAS), then an exact re-rank.

    Parameters
    ----------
    center : bool, default True
        Index ``keys - mean`` (does not change the result beyond float32 rounding).
    """

    name = "faiss-flat"
    guarantee = ("exact maximum-inner-product top-k (causal: over each query's allowed prefix): FAISS "
                 "scores every key in float32 and the k winners are re-scored exactly, so a selection "
                 "can differ from the exact one only between keys whose scores tie within float32 "
                 "rounding at the k-th place." + _RANGE_NOTE)
    params_spec = {"center": _CENTER}

    def _make_index(self, keys: np.ndarray) -> Any:
        faiss = _faiss()
        index = faiss.IndexFlatIP(keys.shape[1])
        index.add(_f32(keys))
        return index


# ---------------------------------------------------------------------------------------------- hnsw
@register
class FaissHNSWSelector(_FaissSelector):
    """Graph search with ``faiss.IndexHNSWFlat(E, M, METRIC_INNER_PRODUCT)``, then an exact re-rank.

    Parameters
    ----------
    M : int, default 32
        Graph degree (memory ~ ``2*M`` int32 links per key at level 0).
    ef_construction : int, default 80
        Candidate list length while building (quality vs build time).
    ef_search : int, default 128
        Candidate list length while searching (``max(ef_search, k)`` is used). Changeable with
        :meth:`set_params`.
    center : bool, default True
    hnsw_min_block : int, default 262144
        Causal search only: dyadic blocks with fewer keys are scanned exactly instead of getting their
        own graph (a graph pays off only for very large blocks, see the module notes; exact blocks also
        keep early queries exact).

    Notes
    -----
    Inner-product HNSW has no recall guarantee; on isotropic Gaussian keys it is low (see the tests for
    measured values), on clustered or real keys high.  Multi-threaded builds are not bit-reproducible.
    """

    name = "faiss-hnsw"
    guarantee = ("approximate: the keys returned are the exact top-k, by exactly computed inner product, "
                 "of the candidates an HNSW graph walk (ef = max(ef_search, k)) finds; no recall bound. "
                 "Causal: never a future key; a query whose allowed prefix holds fewer than hnsw_min_block "
                 "keys gets the exact top-k of that prefix (up to float32 near-ties)." + _RANGE_NOTE)
    params_spec = {
        "M": Param(int, 32, "HNSW graph degree", lambda v: None if v >= 2 else "must be >= 2"),
        "ef_construction": Param(int, 80, "build-time candidate list length", positive),
        "ef_search": Param(int, 128, "search-time candidate list length (max(ef_search, k) is used)",
                           positive, when="query"),
        "center": _CENTER,
        "hnsw_min_block": Param(int, 262144, "causal: blocks smaller than this are scanned exactly",
                                positive),
    }
    def _make_index(self, keys: np.ndarray) -> Any:
        faiss = _faiss()
        index = faiss.IndexHNSWFlat(keys.shape[1], self._params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self._params["ef_construction"]
        index.add(_f32(keys))
        return index

    def _block_is_exact(self, size: int) -> bool:
        return size < self._params["hnsw_min_block"]

    def _search_params(self, k: int) -> Any:
        return _faiss().SearchParametersHNSW(efSearch=max(self._params["ef_search"], k))


# ----------------------------------------------------------------------------------------------- ivf
def _nlist_check(v: Any) -> str | None:
    return None if v is None or v >= 1 else "must be >= 1 (or None for about 4*sqrt(S))"


# Parameters shared by the inverted-file selectors (first in their params_spec).
_IVF_PARAMS = {
    "nlist": Param(int, None, "inverted lists (None: about 4*sqrt(S), >= 39 keys per list)", _nlist_check),
    "nprobe": Param(int, 8, "lists scanned per query", positive, when="query"),
}


class _IVFBase(_FaissSelector):
    #: Fewest inverted lists a causal dyadic block must get to be indexed by IVF (else: exact scan).
    min_block_lists: ClassVar[int] = 32

    def _nlist_for(self, n: int) -> int:
        nlist = self._params["nlist"]
        return auto_nlist(n) if nlist is None else nlist

    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False, bias: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(n_keys=n_keys, dim=dim, is_causal=is_causal, bias=bias)
        nlist = self._params["nlist"]
        if n_keys is not None and nlist is not None and nlist > n_keys:
            reasons.append(f"nlist={nlist} exceeds the number of keys S={n_keys}: an IVF index needs at "
                           f"least one training key per list. Use nlist <= {n_keys}, or nlist=None "
                           f"(about 4*sqrt(S): {auto_nlist(n_keys)} here).")
        return reasons

    def _build(self, keys: np.ndarray) -> None:
        self._nlist = self._nlist_for(keys.shape[0])
        super()._build(keys)

    def _block_nlist(self, size: int) -> int:
        """Lists of a causal block of ``size`` keys: :func:`auto_nlist` of the block, capped by ``nlist``.

        A function of the block size only (never of S), so a block index depends on its keys alone.
        """
        nlist = self._params["nlist"]
        return auto_nlist(size) if nlist is None else min(nlist, auto_nlist(size))

    def _block_is_exact(self, size: int) -> bool:
        return self._block_nlist(size) < self.min_block_lists

    def _make_index(self, keys: np.ndarray) -> Any:
        return self._make_ivf(keys, self._nlist)

    def _make_block_index(self, keys: np.ndarray) -> Any:
        return self._make_ivf(keys, self._block_nlist(keys.shape[0]))

    def _make_ivf(self, keys: np.ndarray, nlist: int) -> Any:
        index = self._new_ivf(keys.shape[1], nlist)
        index.train(_train_sample(keys, self._train_points(nlist)))
        index.add(_f32(keys))
        return index

    def _train_points(self, nlist: int) -> int:
        return _TRAIN_POINTS_PER_CENTROID * nlist

    def _new_ivf(self, d: int, nlist: int) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def _search_params(self, k: int) -> Any:
        return _faiss().SearchParametersIVF(nprobe=self._params["nprobe"])


@register
class FaissIVFFlatSelector(_IVFBase):
    """Inverted-file search with ``faiss.IndexIVFFlat`` (k-means lists, ``IndexFlatIP`` quantizer).

    Parameters
    ----------
    nlist : int or None, default None
        Number of lists; None picks :func:`auto_nlist` (``round(4*sqrt(S))``, capped at ``S // 39``).
        Must not exceed S.
    nprobe : int, default 8
        Lists scanned per query (changeable with :meth:`set_params`).
    center : bool, default True

    Notes
    -----
    Training uses at most ``256 * nlist`` keys (a fixed-seed sample of the centred keys).  Scores inside
    the scanned lists are exact float32, so the only error is keys in lists that were not probed.
    """

    name = "faiss-ivf"
    guarantee = ("approximate: the exact top-k, by exactly computed inner product, of the keys in the "
                 "nprobe inverted lists whose centroids score highest for the query; no recall bound. "
                 "Causal: strictly causal (a row depends only on the keys at positions <= its own); a query "
                 "whose allowed prefix holds fewer than 2,048 keys (or any query if nlist < 32) gets the exact "
                 "top-k of that prefix (up to float32 near-ties)."
                 + _RANGE_NOTE)
    params_spec = {
        **_IVF_PARAMS,
        "center": _CENTER,
    }

    def _new_ivf(self, d: int, nlist: int) -> Any:
        faiss = _faiss()
        quantizer = faiss.IndexFlatIP(d)
        return faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)  # keeps quantizer alive


@register
class FaissIVFPQSelector(_IVFBase):
    """Inverted-file search over product-quantised codes (``faiss.IndexIVFPQ``), then an exact re-rank.

    Parameters
    ----------
    nlist : int or None, default None
        As for ``faiss-ivf``.
    nprobe : int, default 8
        Lists scanned per query (changeable with :meth:`set_params`).
    m : int, default 8
        PQ sub-quantizers; must divide the key dimension E (each key is stored in ``m * nbits`` bits).
    nbits : int, default 8
        Bits per sub-quantizer code (1..16); training needs at least ``2**nbits`` keys.
    k_factor : int, default 4
        PQ scores are approximate, so ``k_factor * k`` candidates are fetched and re-ranked exactly
        (changeable with :meth:`set_params`).
    center : bool, default True
    """

    name = "faiss-ivfpq"
    guarantee = ("approximate: the exact top-k, by exactly computed inner product, of the k_factor*k keys "
                 "with the best PQ-approximated scores among the nprobe best-scoring inverted lists; no "
                 "recall bound. Causal: strictly causal (a row depends only on the keys at positions <= its "
                 "own); a query whose allowed prefix holds fewer than max(2048, 39 * 2**nbits) keys gets the "
                 "exact top-k of that prefix (up to float32 near-ties)." + _RANGE_NOTE)
    params_spec = {
        **_IVF_PARAMS,
        "m": Param(int, 8, "PQ sub-quantizers (must divide E)", positive),
        "nbits": Param(int, 8, "bits per PQ code",
                       lambda v: None if 1 <= v <= 16 else "must lie in [1, 16]"),
        "k_factor": Param(int, 4, "candidates fetched per wanted key, re-ranked exactly", positive,
                          when="query"),
        "center": _CENTER,
    }
    def not_supported_reasons(self, *, n_keys: int | None = None, dim: int | None = None,
                              is_causal: bool = False, bias: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(n_keys=n_keys, dim=dim, is_causal=is_causal, bias=bias)
        m, nbits = self._params["m"], self._params["nbits"]
        if dim is not None and dim % m != 0:
            reasons.append(f"m={m} PQ sub-quantizers must divide the key dimension E={dim}; "
                           f"valid m for E={dim}: {', '.join(map(str, _divisors(dim)))}.")
        if n_keys is not None and n_keys < (1 << nbits):
            reasons.append(f"nbits={nbits} needs at least 2**nbits = {1 << nbits} keys to train the PQ "
                           f"codebooks; got S={n_keys}. Lower nbits, or use faiss-ivf / faiss-flat.")
        return reasons

    def _block_is_exact(self, size: int) -> bool:
        return super()._block_is_exact(size) or size < 39 * (1 << self._params["nbits"])

    def _train_points(self, nlist: int) -> int:
        return _TRAIN_POINTS_PER_CENTROID * max(nlist, 1 << self._params["nbits"])

    def _new_ivf(self, d: int, nlist: int) -> Any:
        faiss = _faiss()
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFPQ(quantizer, d, nlist, self._params["m"], self._params["nbits"],
                                 faiss.METRIC_INNER_PRODUCT)
        # FAISS prints one "please provide at least 39*2**nbits training points" line per sub-quantizer
        # when S is small; the shortfall is documented (and softened by the exact re-rank) instead.
        index.pq.cp.min_points_per_centroid = 1
        return index

    def _make_block_index(self, keys: np.ndarray) -> Any:
        # keep the block's centred float32 keys (a view) next to its index, for the re-rank
        return _IndexWithVectors(super()._make_block_index(keys), keys)

    def _search(self, index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """PQ scores are approximate: fetch ``k_factor * k`` candidates, keep the best ``k`` exactly.

        The pre-selection re-scores in float32 against the index's centred keys (the block's own keys
        for a causal block), so callers still get at most ``k`` ids per row; the base class then
        re-ranks those exactly in the input dtype.
        """
        if isinstance(index, np.ndarray):
            return super()._search(index, queries, k)
        if isinstance(index, _IndexWithVectors):
            index, vectors = index.index, index.vectors
        else:
            vectors = self._c32  # the full index
        q32 = _f32(queries)
        kk = min(k * self._params["k_factor"], int(index.ntotal))
        _, cand = index.search(q32, kk, params=self._search_params(kk))
        # one FAISS search returns distinct ids per row: no per-row de-duplication needed
        return rerank_topk(q32, vectors, np.asarray(cand, dtype=np.int64), min(k, kk), True)
