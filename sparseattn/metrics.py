"""Accuracy of sparse attention against dense attention, computed blockwise so it scales to long sequences.

Everything here is plain float64 numpy (plus one ``scipy.sparse`` product), deliberately independent of the
Numba kernels: a benchmark harness recomputes quality with code that shares nothing with the code it
measures.

Memory stays bounded whatever the sequence length: queries are processed ``block`` rows at a time and,
inside a query block, keys ``key_block`` at a time with an online (rescaled) softmax, so the largest
temporary is a ``block x key_block`` float64 tile (512 x 8192 = 32 MiB by default).  At
n = 262,144, d = 64 that is the only way to run: one 512-row block of full scores would already take 1 GiB.
The float64 reference is compute-bound (two GEMMs and an ``exp`` per (query, key) pair): for long
sequences evaluate a sample of query rows with ``rows=`` (e.g. 4096 sorted random rows), which costs
``len(rows) * S`` instead of ``L * S``.

Definitions, for query row i with dense logits ``s_ij = scale * q_i . k_j`` over its *allowed* keys
A_i (all keys, or ``key_positions[j] <= query_positions[i]`` when causal) and selected keys
P_i (the pattern's row, restricted to A_i when causal):

* dense probabilities ``p_ij = exp(s_ij - lse_dense_i)``, ``lse_dense_i = log sum_{j in A_i} exp(s_ij)``;
* sparse attention is the softmax over P_i only, ``lse_sparse_i = log sum_{j in P_i} exp(s_ij)``;
* ``mass_recall_i = sum_{j in P_i} p_ij = exp(lse_sparse_i - lse_dense_i)``;
* ``lse_error_i = lse_dense_i - lse_sparse_i >= 0``;
* ``kl_i = KL(sparse_i || dense_i) = -log(mass_recall_i)``, see :class:`AccuracyReport` for why this
  direction.

Leading (batch, head) dimensions: every public function takes ``query (..., L, E)``, ``key (..., S, E)``
and ``value (..., S, Ev)`` whose leading dimensions broadcast like numpy's (``enable_gqa=True``: fewer
K/V heads than query heads, as in :func:`sparseattn.sparse_attention`).  Each flattened (batch, head)
group is evaluated on its own, one group's float64 copies at a time, with one shared pattern, one
pattern per group, or the patterns and output of a :class:`sparseattn.SparseAttentionResult`.  Per-row
results then have shape ``(..., L)``; :class:`AccuracyReport` also gives each head's report and summary
(:meth:`AccuracyReport.head`, :meth:`AccuracyReport.per_head`) besides the aggregate over all heads.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .inputs import as_float_array, check_bool, check_positive_int, check_scale, flat3, group_maps, positions
from .kernels.topk import ORDER_NONE, block_topk
from .pattern import SparsePattern

if TYPE_CHECKING:
    from .attention.sparse import SparseAttentionResult

__all__ = ["AccuracyReport", "compare", "mass_error_profile", "mass_recall", "output_relative_error", "topk_recall"]

# Pairs (query, key) whose feature vectors are gathered at once when scoring the selected keys:
# bounds the gather temporaries to about 2**21 float64 values (16 MiB) whatever the row lengths.
_GATHER_ELEMS = 2 ** 21


# --------------------------------------------------------------------------------------- the report
@dataclass(frozen=True, eq=False)
class AccuracyReport:
    """Sparse-vs-dense accuracy, per query row and overall.

    Per-row arrays all have shape ``lead + (L,)`` and dtype float64 unless noted: (L,) for 2-D inputs,
    (B, H, L) for inputs with leading dims (B, H).  The scalar fields aggregate over every head;
    :meth:`head` gives one head's own report and :meth:`per_head` each head's summary.

    Attributes
    ----------
    rel_error : (L,) float64
        ``||o_sparse_i - o_dense_i|| / ||o_dense_i||``; where the dense row is exactly zero (no allowed
        key, or zero values) the denominator is replaced by 1, i.e. the absolute error is reported.
    mass_recall : (L,) float64
        Dense softmax mass on the selected keys, in [0, 1].  1 for rows with no allowed key.
    recall : (L,) float64
        Tie-aware recall@k of the selected keys against the exact top-k raw scores ``q . k``, in [0, 1].
        1 for rows with no allowed key.
    kl : (L,) float64
        ``KL(sparse || dense) = -log(mass_recall)`` where the sparse distribution is the dense one
        renormalised over the selected keys.  ``+inf`` exactly when the row selects no key but has allowed
        keys (selected mass 0); 0 for rows with no allowed key.  The other direction,
        ``KL(dense || sparse)``, is ``+inf`` whenever *any* allowed key is left out (the sparse distribution
        has no support there), so it carries no information about a sparse pattern.  Mathematically
        equal to ``lse_error``; the two are kept under both names because readers look for both.
    lse_error : (L,) float64
        ``lse_dense - lse_sparse``, >= 0 (rounding noise below 0 is clipped).  ``+inf`` for missed rows,
        0 for rows with no allowed key.
    lse_dense, lse_sparse : (L,) float64
        Log-sum-exp of the scaled scores over the allowed / the selected keys; ``-inf`` for no key.
    n_selected : (L,) int64
        Selected keys per row (after dropping non-causal ones when ``is_causal``).
    n_allowed : (L,) int64
        Keys the dense attention may use per row (S, or the causal count).
    rel_error_overall : float
        Frobenius ``||O_sparse - O_dense||_F / ||O_dense||_F`` (denominator 1 if the dense output is 0).
    max_abs_error : float
        ``max |O_sparse - O_dense|`` over all entries (0 for an empty output).
    k : int
        The k of ``recall``.
    empty_rows : int
        Rows with no selected key (after the causal filter).
    missed_rows : int
        Rows with allowed keys but no selected key (their ``kl`` and ``lse_error`` are ``+inf``).
    dropped_noncausal : int
        Selected (query, key) pairs removed because the key lies after the query (``is_causal`` only);
        non-zero means the selector leaks future keys.
    rows : (L,) or (R,) int64
        The query rows the per-row arrays describe (``arange(L)`` unless ``rows=`` was given); the same
        rows in every head.
    lead : tuple of int
        The broadcast leading (batch, head) shape; ``()`` for 2-D inputs.
    heads : tuple of AccuracyReport
        One 2-D report per flattened (batch, head) group in C order (their arrays are views of this
        report's); empty when ``lead == ()``.
    """

    rel_error: np.ndarray
    mass_recall: np.ndarray
    recall: np.ndarray
    kl: np.ndarray
    lse_error: np.ndarray
    lse_dense: np.ndarray
    lse_sparse: np.ndarray
    n_selected: np.ndarray
    n_allowed: np.ndarray
    rel_error_overall: float
    max_abs_error: float
    k: int
    empty_rows: int
    missed_rows: int
    dropped_noncausal: int
    rows: np.ndarray
    lead: tuple[int, ...] = ()
    heads: tuple[AccuracyReport, ...] = ()

    @property
    def n_rows(self) -> int:
        """Number of evaluated query rows per head (L, or R with ``rows=``)."""
        return int(self.rel_error.shape[-1])

    @property
    def n_heads(self) -> int:
        """Number of (batch, head) groups: ``prod(lead)``, 1 for 2-D inputs."""
        return int(np.prod(self.lead, dtype=np.int64))

    def head(self, *index: int) -> AccuracyReport:
        """The 2-D report of one (batch, head) group, e.g. ``rep.head(b, h)``; ``rep.head()`` for 2-D inputs.

        Its per-row arrays have shape (L,) (views of this report's) and its scalar fields are that head's own:
        ``rel_error_overall`` is the Frobenius error of that head's output.
        """
        if len(index) != len(self.lead):
            raise ValueError(f"head() needs one index per leading dimension {self.lead}; got {index}.")
        if not self.lead:
            return self
        for i, (ix, n) in enumerate(zip(index, self.lead, strict=True)):
            if isinstance(ix, bool) or not isinstance(ix, numbers.Integral) or not -n <= int(ix) < n:
                raise IndexError(f"head index {ix!r} at position {i} is out of range for leading dims {self.lead}.")
        flat = int(np.ravel_multi_index(tuple(int(ix) % n for ix, n in zip(index, self.lead, strict=True)),
                                        self.lead))
        return self.heads[flat]

    def per_head(self) -> dict[str, np.ndarray]:
        """Each head's :meth:`summary`, as float64 arrays of shape ``lead`` (shape () for 2-D inputs)."""
        if not self.lead:
            return {name: np.asarray(value, dtype=np.float64) for name, value in self.summary().items()}
        summaries = [h.summary() for h in self.heads]
        return {name: np.array([s[name] for s in summaries], dtype=np.float64).reshape(self.lead)
                for name in summaries[0]}

    def summary(self) -> dict[str, float]:
        """Scalar summary for JSON and tables; every value is a finite float.

        With leading dims this is the aggregate over every head: means, medians and extremes over all
        (head, row) pairs, ``rel_error_overall`` over all heads' outputs, counts summed over heads
        (``n_rows`` stays per head).  Means and maxima of ``kl`` and ``lse_error`` are taken over the rows
        where they are finite (``missed_rows`` counts the others), so one missed row does not turn the
        whole column into inf.  With no rows, errors are reported as 0 and recalls as 1.
        """
        finite_kl = self.kl[np.isfinite(self.kl)]
        finite_lse = self.lse_error[np.isfinite(self.lse_error)]
        return {
            "n_rows": float(self.n_rows),
            "n_heads": float(self.n_heads),
            "k": float(self.k),
            "mean_selected": _mean(self.n_selected.astype(np.float64), 0.0),
            "rel_error_overall": float(self.rel_error_overall),
            "rel_error_mean": _mean(self.rel_error, 0.0),
            "rel_error_median": float(np.median(self.rel_error)) if self.rel_error.size else 0.0,
            "rel_error_max": _max(self.rel_error, 0.0),
            "max_abs_error": float(self.max_abs_error),
            "mass_recall_mean": _mean(self.mass_recall, 1.0),
            "mass_recall_min": float(self.mass_recall.min()) if self.mass_recall.size else 1.0,
            "recall_mean": _mean(self.recall, 1.0),
            "recall_min": float(self.recall.min()) if self.recall.size else 1.0,
            "kl_mean": _mean(finite_kl, 0.0),
            "kl_max": _max(finite_kl, 0.0),
            "lse_error_mean": _mean(finite_lse, 0.0),
            "lse_error_max": _max(finite_lse, 0.0),
            "empty_rows": float(self.empty_rows),
            "missed_rows": float(self.missed_rows),
            "dropped_noncausal": float(self.dropped_noncausal),
        }


def _mean(x: np.ndarray, default: float) -> float:
    return float(x.mean()) if x.size else default


def _max(x: np.ndarray, default: float) -> float:
    return float(x.max()) if x.size else default


# ----------------------------------------------------------------------------------------- validation
def _f64(x: np.ndarray) -> np.ndarray:
    """C-contiguous float64 (a view when it already is)."""
    return np.ascontiguousarray(x, dtype=np.float64)


@dataclass(frozen=True)
class _Groups:
    """Validated query/key(/value) as (G, n, f) stacks in their input dtype, with the group maps.

    Group g of the broadcast leading shape ``lead`` reads ``q3[q_map[g]]``, ``k3[kv_map[g]]`` and
    ``v3[kv_map[g]]`` (:func:`sparseattn.inputs.group_maps`).
    """

    q3: np.ndarray
    k3: np.ndarray
    v3: np.ndarray | None
    lead: tuple[int, ...]
    q_map: np.ndarray
    kv_map: np.ndarray

    @property
    def G(self) -> int:
        return int(self.q_map.shape[0])

    @property
    def L(self) -> int:
        return int(self.q3.shape[1])

    @property
    def S(self) -> int:
        return int(self.k3.shape[1])

    @property
    def E(self) -> int:
        return int(self.q3.shape[2])

    def operands(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]]:
        """``(g, q, k, v)`` of each group as float64 2-D arrays, one group's conversion copies at a time."""
        kv_done, kk, vv = -1, None, None
        for g in range(self.G):
            kv = int(self.kv_map[g])
            if kv != kv_done:
                kk = vv = None  # free the previous group's copies before converting the next
                kk = _f64(self.k3[kv])
                vv = _f64(self.v3[kv]) if self.v3 is not None else None
                kv_done = kv
            yield g, _f64(self.q3[int(self.q_map[g])]), kk, vv


def _groups(query: object, key: object, value: object, enable_gqa: object) -> _Groups:
    """Validate query (..., L, E), key (..., S, E) and value (..., S, Ev) or None; broadcast leading dims."""
    q = as_float_array(query, "query", min_ndim=2)
    kk = as_float_array(key, "key", min_ndim=2)
    if q.shape[-1] != kk.shape[-1]:
        raise ValueError(f"query and key must have the same feature size E; got query {q.shape} and "
                         f"key {kk.shape}.")
    v = None
    if value is not None:
        v = as_float_array(value, "value", min_ndim=2)
        if v.shape[-2] != kk.shape[-2]:
            raise ValueError(f"value must have one row per key: key has shape {kk.shape}, value has shape "
                             f"{v.shape}.")
        if v.shape[:-2] != kk.shape[:-2]:
            raise ValueError(f"key and value must have the same leading dims; got key {kk.shape} and value "
                             f"{v.shape}.")
    lead, q_map, kv_map = group_maps(q.shape[:-2], kk.shape[:-2], enable_gqa=check_bool(enable_gqa, "enable_gqa"))
    if q_map.shape[0] == 0:
        raise ValueError(f"the leading dims of query {q.shape[:-2]} and key {kk.shape[:-2]} broadcast to {lead}, "
                         f"which holds no (batch, head) group; pass at least one.")
    return _Groups(flat3(q), flat3(kk), None if v is None else flat3(v), lead, q_map, kv_map)


def _check_pattern(pattern: object, L: int, S: int, name: str = "pattern") -> SparsePattern:
    if not isinstance(pattern, SparsePattern):
        raise TypeError(f"{name} must be a SparsePattern, a sequence of them (one per (batch, head) group) or "
                        f"a SparseAttentionResult; got {type(pattern).__name__}. Build one with "
                        f"SparsePattern.from_padded or a selector.")
    if pattern.shape != (L, S):
        raise ValueError(f"{name} shape must be (n_queries, n_keys) = ({L}, {S}) to match query and key; "
                         f"got {pattern.shape}.")
    return pattern


def _group_patterns(pattern: object, G: int, L: int, S: int) -> tuple[list[SparsePattern], np.ndarray | None]:
    """One pattern shared by every group or one per group, and the output a result carries (else None).

    A :class:`sparseattn.SparseAttentionResult` gives its ``patterns`` and ``output``; a result of a
    selector that attends by itself holds no pattern, which is refused with the way to score it.
    """
    from .attention.sparse import SparseAttentionResult  # lazy: metrics stays importable on its own

    output = None
    if isinstance(pattern, SparseAttentionResult):
        if not pattern.patterns:
            spec = pattern.selector
            raise ValueError(
                f"pattern: this SparseAttentionResult (selector {spec!r}) holds no pattern because the "
                f"selector attends by itself, so the keys it read are not recorded. Route each head's "
                f"queries again to score them: sel = sparseattn.get_selector({spec!r}).build(key_h); "
                f"pattern_h = sel.query(query_h, k, is_causal=...) gives the keys attend() reads; pass the "
                f"list of patterns (one per (batch, head) group) and sparse_output=result.output.")
        output = pattern.output
        pats = list(pattern.patterns)
        if len(pats) not in (1, G):
            raise ValueError(f"pattern: the SparseAttentionResult holds {len(pats)} patterns; expected 1 or one "
                             f"per (batch, head) group = {G}. Pass query, key and value with the leading dims "
                             f"the result was computed with.")
    elif isinstance(pattern, (list, tuple)):
        pats = list(pattern)
        if len(pats) != G:
            raise ValueError(f"pattern sequence has {len(pats)} entries; expected one per (batch, head) group = "
                             f"{G}, or pass a single SparsePattern shared by every group.")
    else:
        pats = [pattern]
    for i, p in enumerate(pats):
        _check_pattern(p, L, S, "pattern" if len(pats) == 1 else f"pattern[{i}]")
    return pats, output


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number >= 0; got {eps!r} ({type(eps).__name__}).")
    e = float(eps)
    if not np.isfinite(e) or e < 0:
        raise ValueError(f"eps must be finite and >= 0; got {eps!r}. Use 0 for exact score comparison.")
    return e


def _check_rows(rows: object, L: int) -> np.ndarray | None:
    """``rows`` as an int64 array of query indices in [0, L), or None for every row."""
    if rows is None:
        return None
    r = np.asarray(rows)
    if r.dtype.kind not in "iu":
        raise TypeError(f"rows must be an integer array of query indices; got dtype {r.dtype}.")
    if r.ndim != 1:
        raise ValueError(f"rows must be 1-D; got shape {r.shape}.")
    if r.size and (r.min() < 0 or r.max() >= L):
        raise ValueError(f"rows must lie in [0, L={L}); got values from {int(r.min())} to {int(r.max())}. "
                         f"Negative indices are not wrapped.")
    return r.astype(np.int64)


def _default_k(patterns: list[SparsePattern]) -> int:
    """Mean selected keys per row over the patterns, rounded half up, at least 1."""
    n_rows = sum(p.n_queries for p in patterns)
    mean = sum(p.nnz for p in patterns) / n_rows if n_rows else 0.0
    return max(1, int(np.floor(mean + 0.5)))


def _run(groups: _Groups, patterns: list[SparsePattern], *, query_positions: object, key_positions: object,
         rows: object, sparse_output: np.ndarray | None = None, **scan: object) -> tuple[list[dict], np.ndarray]:
    """:func:`_scan` of every group over its pattern (restricted to ``rows``); (per-group results, rows).

    Positions are resolved on the full sequence first, so a sampled row keeps its original position.
    ``sparse_output`` is the validated ``lead + (L, Ev)`` output or None.
    """
    L, S = groups.L, groups.S
    qpos = positions(query_positions, L, "query_positions")
    kpos = positions(key_positions, S, "key_positions")
    r = _check_rows(rows, L)
    if r is not None:
        qpos = qpos[r]
        patterns = [p.select_rows(r) for p in patterns]
    out3 = flat3(sparse_output) if sparse_output is not None else None
    results = []
    for g, q, kk, v in groups.operands():
        if r is not None:
            q = np.ascontiguousarray(q[r])
        out = None
        if out3 is not None:
            out = _f64(out3[g] if r is None else out3[g][r])
        results.append(_scan(q, kk, v, patterns[g if len(patterns) > 1 else 0], qpos=qpos, kpos=kpos,
                             sparse_output=out, **scan))
    return results, (np.arange(L, dtype=np.int64) if r is None else r)


def _stack(results: list[dict], name: str, lead: tuple[int, ...]) -> np.ndarray:
    """Per-group (R,) arrays as one ``lead + (R,)`` array."""
    return np.stack([res[name] for res in results]).reshape(lead + results[0][name].shape)


def _per_row(results: list[dict], name: str, lead: tuple[int, ...]) -> np.ndarray:
    return results[0][name] if not lead else _stack(results, name, lead)


def _report(results: list[dict], lead: tuple[int, ...], k: int, rows: np.ndarray) -> AccuracyReport:
    """The AccuracyReport of all groups (aggregate scalars) with one 2-D report per group when ``lead``."""
    arrays = {name: _per_row(results, name, lead) for name in
              ("rel_error", "mass_recall", "recall", "lse_error", "lse_dense", "lse_sparse", "n_selected",
               "n_allowed")}
    arrays["kl"] = arrays["lse_error"].copy()

    def make(arr: dict[str, np.ndarray], res: list[dict], lead_: tuple[int, ...],
             heads: tuple[AccuracyReport, ...]) -> AccuracyReport:
        n_sel, n_allowed = arr["n_selected"], arr["n_allowed"]
        diff = np.sqrt(sum(x["diff_sq"] for x in res))
        ref = np.sqrt(sum(x["ref_sq"] for x in res))
        return AccuracyReport(
            **arr, rel_error_overall=float(_guarded_ratio(np.array([diff]), np.array([ref]))[0]),
            max_abs_error=float(max(x["max_abs"] for x in res)), k=int(k), empty_rows=int((n_sel == 0).sum()),
            missed_rows=int(((n_sel == 0) & (n_allowed > 0)).sum()),
            dropped_noncausal=int(sum(x["dropped"] for x in res)), rows=rows, lead=lead_, heads=heads)

    heads: tuple[AccuracyReport, ...] = ()
    if lead:
        G = len(results)
        flat = {name: a.reshape((G, a.shape[-1])) for name, a in arrays.items()}  # views: a is contiguous
        heads = tuple(make({name: a[g] for name, a in flat.items()}, [results[g]], (), ()) for g in range(G))
    return make(arrays, results, lead, heads)


# --------------------------------------------------------------------------------------- public API
def output_relative_error(approx: object, reference: object, *, per_row: bool = False,
                          per_head: bool = False) -> float | np.ndarray:
    """Relative error ``||approx - reference|| / ||reference||`` in float64.

    Parameters
    ----------
    approx, reference : float arrays, shape (..., L, Ev)
        The approximate (sparse) and the reference (dense) outputs, same shape; leading dims are
        (batch, head) groups.
    per_row : bool, default False
        True: a ``(..., L)`` float64 array of row-wise ratios.
    per_head : bool, default False
        True: a ``(...)`` float64 array of one Frobenius ratio per (batch, head) group (shape () for
        2-D inputs).  Neither flag: one Frobenius ratio over the whole array, a float.

    Returns
    -------
    float or float64 array
        Where the reference norm is exactly zero the denominator is replaced by 1, so the absolute error
        is reported (0 when both are zero) instead of NaN or inf.

    Examples
    --------
    >>> output_relative_error(np.array([[3.0, 4.0]]), np.array([[0.0, 8.0]]))
    0.625
    """
    if check_bool(per_row, "per_row") and check_bool(per_head, "per_head"):
        raise ValueError("per_row and per_head are exclusive; pass at most one of them.")
    a = as_float_array(approx, "approx", min_ndim=2)
    b = as_float_array(reference, "reference", min_ndim=2)
    if a.shape != b.shape:
        raise ValueError(f"approx and reference must have the same shape; got {a.shape} and {b.shape}.")
    a3, b3 = flat3(a), flat3(b)
    G, L = a3.shape[0], a3.shape[1]
    d_rows = np.empty((G, L))
    r_rows = np.empty((G, L))
    for g in range(G):  # one group's float64 copies at a time
        ref = _f64(b3[g])
        d_rows[g] = np.linalg.norm(_f64(a3[g]) - ref, axis=1)
        r_rows[g] = np.linalg.norm(ref, axis=1)
    if per_row:
        return _guarded_ratio(d_rows, r_rows).reshape(a.shape[:-1])
    d_sq, r_sq = (x * x for x in (d_rows, r_rows))
    if per_head:
        return _guarded_ratio(np.sqrt(d_sq.sum(axis=1)), np.sqrt(r_sq.sum(axis=1))).reshape(a.shape[:-2])
    return float(_guarded_ratio(np.array([np.sqrt(d_sq.sum())]), np.array([np.sqrt(r_sq.sum())]))[0])


def mass_error_profile(approx: object, reference: object, mass_kept: object, *,
                       bins: object = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)) -> dict[str, np.ndarray]:
    """Row-level view of output error against the softmax mass kept, to choose a mass budget (``top_p``).

    Rows of every (batch, head) group are pooled, binned by their mass kept, and each bin reports its row
    count and the median / 90th percentile of the rows' relative output error
    ``||approx_i - reference_i|| / ||reference_i||`` (as :func:`output_relative_error` with
    ``per_row=True``).

    Parameters
    ----------
    approx, reference : float arrays, shape (..., L, Ev)
        Approximate and reference (dense) outputs, same shape.
    mass_kept : float array, shape (..., L)
        Each row's softmax mass on the keys read exactly, in [0, 1] (e.g. ``exp(lse - lse_dense)`` or
        :func:`mass_recall` with ``per_row=True``); values within 1e-6 above 1 (rounding) count as 1.
    bins : increasing sequence of floats in [0, 1], length >= 2, default (0, .5, .8, .9, .95, .99, 1)
        Bin edges: bin b holds ``edges[b] <= mass < edges[b + 1]``, the last bin also ``mass ==
        edges[-1]`` (numpy ``histogram`` convention).  Rows outside ``[edges[0], edges[-1]]`` are not
        counted.

    Returns
    -------
    dict of float64 / int64 arrays, one entry per bin (n_bins = len(bins) - 1):
        ``"lo"``, ``"hi"`` (n_bins,) float64 bin edges; ``"rows"`` (n_bins,) int64 row counts;
        ``"median_err"``, ``"p90_err"`` (n_bins,) float64 (NaN for an empty bin); ``"mean_mass"``
        (n_bins,) float64 mean mass of the bin's rows (NaN when empty).

    Raises
    ------
    ValueError
        Shapes that do not match, mass outside [0, 1] or not finite, bad bin edges.

    Examples
    --------
    >>> prof = mass_error_profile(np.array([[1.0, 0.0], [0.0, 1.1]]), np.ones((2, 2)) * [[1, 0], [0, 1]],
    ...                           np.array([0.97, 0.85]), bins=[0.0, 0.9, 1.0])
    >>> prof["rows"].tolist(), np.round(prof["median_err"], 3).tolist()
    ([1, 1], [0.1, 0.0])
    """
    err = output_relative_error(approx, reference, per_row=True)
    m = as_float_array(mass_kept, "mass_kept", min_ndim=1, check_finite=False)  # checked below
    if m.shape != err.shape:
        raise ValueError(f"mass_kept must have shape {err.shape} (the outputs' shape without the last axis, "
                         f"one mass per row); got {m.shape}.")
    m = _f64(m).reshape(-1)
    if not np.all(np.isfinite(m)) or m.size and (m.min() < 0 or m.max() > 1 + 1e-6):
        raise ValueError("mass_kept must hold finite values in [0, 1] (the fraction of the softmax mass kept).")
    m = np.minimum(m, 1.0)
    try:
        edges = np.asarray(bins, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"bins must be a sequence of floats; got {bins!r}.") from None
    if edges.ndim != 1 or edges.size < 2 or not np.all(np.isfinite(edges)) or np.any(np.diff(edges) <= 0) \
            or edges[0] < 0 or edges[-1] > 1:
        raise ValueError(f"bins must be >= 2 strictly increasing edges in [0, 1]; got {bins!r}.")
    e = err.reshape(-1)
    nb = edges.size - 1
    idx = np.searchsorted(edges, m, side="right") - 1
    idx[m == edges[-1]] = nb - 1
    inside = (idx >= 0) & (idx < nb)
    out = {"lo": edges[:-1].copy(), "hi": edges[1:].copy(), "rows": np.zeros(nb, dtype=np.int64),
           "median_err": np.full(nb, np.nan), "p90_err": np.full(nb, np.nan), "mean_mass": np.full(nb, np.nan)}
    for b in range(nb):
        sel = inside & (idx == b)
        n = int(sel.sum())
        out["rows"][b] = n
        if n:
            out["median_err"][b] = float(np.median(e[sel]))
            out["p90_err"][b] = float(np.percentile(e[sel], 90))
            out["mean_mass"][b] = float(m[sel].mean())
    return out


def _guarded_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return num / np.where(den > 0, den, 1.0)


def topk_recall(pattern: SparsePattern | Sequence[SparsePattern] | SparseAttentionResult, query: object,
                key: object, k: int, *, is_causal: bool = False, query_positions: object = None,
                key_positions: object = None, eps: float = 1e-6, rows: object = None, block: int = 512,
                key_block: int = 8192, enable_gqa: bool = False) -> np.ndarray:
    """Tie-aware recall@k of a pattern against the exact top-k raw scores ``q . k``.

    A selected (allowed) key j of row i is a hit when ``q_i . k_j >= t_i - eps*|t_i| - eps`` with ``t_i``
    the k-th largest allowed score of row i, so any of several keys tied at the k-th place counts, and
    ``eps`` absorbs the rounding difference between the blocked GEMM and the per-pair dot product.
    Recall is ``hits / min(k, n_allowed_i)`` capped at 1 (1 when the row has no allowed key).

    Parameters
    ----------
    pattern : SparsePattern (L, S), sequence of them, or SparseAttentionResult
        One pattern shared by every (batch, head) group, one per group (flattened leading dims, C order),
        or the patterns of a :func:`sparseattn.sparse_attention_result`.
    query : float array, shape (..., L, E)
    key : float array, shape (..., S, E)
        Leading dims broadcast against the query's (see ``enable_gqa``).
    k : int >= 1
        Any size: ``k >= S`` counts every allowed key as a top-k key (no (L, k) buffer is made).
    is_causal : bool
        Only keys with ``key_positions[j] <= query_positions[i]`` are allowed (default positions arange);
        selected keys that are not allowed never count as hits.
    eps : float >= 0
        Tie tolerance, relative and absolute.
    rows : int array, shape (R,), optional
        Evaluate only these query rows of every group (see :func:`compare`).
    block, key_block : int >= 1
        Query rows and key rows per score tile (memory ``block * key_block`` float64).
    enable_gqa : bool
        Fewer key heads than query heads (query head h reads key head ``h // (Hq // Hk)``).

    Returns
    -------
    float64 array of shape ``lead + (L,)`` (or ``lead + (R,)``), values in [0, 1].
    """
    k = check_positive_int(k, "k")
    groups = _groups(query, key, None, enable_gqa)
    pats, _ = _group_patterns(pattern, groups.G, groups.L, groups.S)
    results, _ = _run(groups, pats, query_positions=query_positions, key_positions=key_positions, rows=rows,
                      scale=1.0, is_causal=is_causal, k=k, eps=_check_eps(eps),
                      block=check_positive_int(block, "block"),
                      key_block=check_positive_int(key_block, "key_block"), need_lse=False)
    return _per_row(results, "recall", groups.lead)


def mass_recall(pattern: SparsePattern | Sequence[SparsePattern] | SparseAttentionResult, query: object,
                key: object, *, scale: float | None = None, is_causal: bool = False, query_positions: object = None,
                key_positions: object = None, rows: object = None, block: int = 512, key_block: int = 8192,
                enable_gqa: bool = False) -> np.ndarray:
    """Dense softmax probability mass on each row's selected keys.

    Parameters
    ----------
    pattern : SparsePattern (L, S), sequence of them, or SparseAttentionResult
        As in :func:`topk_recall`.
    query : float array, shape (..., L, E)
    key : float array, shape (..., S, E)
    scale : float or None
        Score scale; None means ``1 / sqrt(E)``.
    is_causal : bool
        Dense attention over keys with ``key_positions[j] <= query_positions[i]`` only; selected keys
        outside that set have probability 0.
    rows : int array, shape (R,), optional
        Evaluate only these query rows of every group (see :func:`compare`).
    block, key_block : int >= 1
        Query rows and key rows per score tile.
    enable_gqa : bool
        Fewer key heads than query heads.

    Returns
    -------
    float64 array of shape ``lead + (L,)`` (or ``lead + (R,)``) in [0, 1]; 1 for rows with no allowed key,
    0 for rows that select none.
    """
    groups = _groups(query, key, None, enable_gqa)
    pats, _ = _group_patterns(pattern, groups.G, groups.L, groups.S)
    results, _ = _run(groups, pats, query_positions=query_positions, key_positions=key_positions, rows=rows,
                      scale=check_scale(scale, groups.E), is_causal=is_causal, k=None, eps=0.0,
                      block=check_positive_int(block, "block"),
                      key_block=check_positive_int(key_block, "key_block"), need_lse=True)
    return _per_row(results, "mass_recall", groups.lead)


def compare(query: object, key: object, value: object,
            pattern: SparsePattern | Sequence[SparsePattern] | SparseAttentionResult, *,
            scale: float | None = None, is_causal: bool = False, query_positions: object = None,
            key_positions: object = None, sparse_output: object = None, k: int | None = None, eps: float = 1e-6,
            rows: object = None, block: int = 512, key_block: int = 8192, enable_gqa: bool = False,
            ) -> AccuracyReport:
    """Measure sparse attention over ``pattern`` against exact dense attention, in float64.

    Parameters
    ----------
    query : float array, shape (..., L, E)
    key : float array, shape (..., S, E)
    value : float array, shape (..., S, Ev)
        Leading (batch, head) dims broadcast like numpy's (key and value share theirs); each flattened
        group is evaluated on its own.
    pattern : SparsePattern (L, S), sequence of them, or SparseAttentionResult
        The selected keys: one pattern shared by every group, one per group (flattened leading dims, C
        order), or a :func:`sparseattn.sparse_attention_result` (its patterns, and its output as
        ``sparse_output``).  With ``is_causal`` non-causal keys are dropped first (and counted in
        ``dropped_noncausal``), as a causal sparse kernel would.  A result of a selector that attends
        by itself (``cluster:mode=block``) holds no pattern and is refused with the way to route again.
        A result with a tail estimate (``tail=``) is scored on its selected keys (mass, recall, KL); its
        output error is that of the tail-corrected output.
    scale : float or None
        Score scale; None means ``1 / sqrt(E)``.
    is_causal : bool
        Dense attention over ``key_positions[j] <= query_positions[i]`` only (default positions arange:
        SDPA's top-left alignment; pass ``query_positions=np.arange(S - L, S)`` for a KV cache).
    query_positions, key_positions : int arrays, shapes (L,) and (S,), optional
        Used when ``is_causal``; shared by every group.
    sparse_output : float array, shape (..., L, Ev), optional
        The output to judge (e.g. from the Numba kernel), with the broadcast leading dims.  None:
        computed here in float64 from the pattern, independently of the kernels (or taken from a
        SparseAttentionResult).  The softmax-mass, KL and lse fields always come from this module's own
        float64 computation.
    k : int >= 1, optional
        The k of recall@k; default the patterns' mean row size rounded (at least 1).  Any size: ``k >= S``
        counts every allowed key as a top-k key and allocates nothing of size k.
    eps : float >= 0
        Tie tolerance of recall@k (see :func:`topk_recall`).
    rows : int array, shape (R,), optional
        Evaluate only these query rows (with their original positions) in every group; every per-row
        array of the report then ends in (R,) in this order, and the overall numbers cover these rows
        only.  Sorted rows let causal blocks skip key tiles that no query of the block can see.
    block : int >= 1
        Query rows per block (default 512; fewer when ``block * k`` exceeds ``block * key_block``).
    key_block : int >= 1
        Keys per score tile inside a block (default 8192); memory ``block * key_block`` float64.
    enable_gqa : bool
        Fewer K/V heads than query heads (query head h reads K/V head ``h // (Hq // Hkv)``).

    Returns
    -------
    AccuracyReport
        Per-row fields of shape ``lead + (L,)`` (or ``lead + (R,)``); aggregate scalars; per head
        :meth:`AccuracyReport.head` and :meth:`AccuracyReport.per_head`.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, kk, v = rng.standard_normal((3, 8, 4))
    >>> rep = compare(q, kk, v, SparsePattern.full(8, 8))
    >>> bool(rep.rel_error_overall < 1e-12), rep.summary()["recall_mean"]
    (True, 1.0)
    >>> q2, k2, v2 = rng.standard_normal((3, 2, 4, 8, 4))  # (batch 2, heads 4, L 8, E 4)
    >>> rep = compare(q2, k2, v2, SparsePattern.window(8, 8, 3))
    >>> rep.mass_recall.shape, rep.per_head()["mass_recall_mean"].shape
    ((2, 4, 8), (2, 4))
    """
    groups = _groups(query, key, value, enable_gqa)
    pats, result_out = _group_patterns(pattern, groups.G, groups.L, groups.S)
    if result_out is not None:
        if sparse_output is not None:
            raise ValueError("sparse_output: pattern is a SparseAttentionResult, whose output is judged; pass "
                             "its patterns (result.patterns) instead to judge another output.")
        sparse_output = result_out
    out = None
    if sparse_output is not None:
        out = as_float_array(sparse_output, "sparse_output", min_ndim=2)
        expected = groups.lead + (groups.L, groups.v3.shape[-1])
        if out.shape != expected:
            raise ValueError(f"sparse_output must have shape {'(..., L, Ev)' if groups.lead else '(L, Ev)'} = "
                             f"{expected}; got {out.shape}.")
    # k is a property of the selector: taken from the whole patterns, also when only some rows are scored.
    k = _default_k(pats) if k is None else check_positive_int(k, "k")
    results, rows_arr = _run(groups, pats, query_positions=query_positions, key_positions=key_positions,
                             rows=rows, sparse_output=out, scale=check_scale(scale, groups.E),
                             is_causal=is_causal, k=k, eps=_check_eps(eps), block=check_positive_int(block, "block"),
                             key_block=check_positive_int(key_block, "key_block"), need_lse=True)
    return _report(results, groups.lead, k, rows_arr)


# ------------------------------------------------------------------------------------- the scan
def _scan(q: np.ndarray, kk: np.ndarray, v: np.ndarray | None, pattern: SparsePattern, *, scale: float,
          is_causal: bool, qpos: np.ndarray, kpos: np.ndarray, sparse_output: np.ndarray | None,
          k: int | None, eps: float, block: int, key_block: int, need_lse: bool) -> dict:
    """One pass over query blocks computing what the caller needs (validated float64 inputs).

    ``v`` given: dense output and output errors.  ``k`` given: recall.  ``need_lse``: lse / mass / KL.

    Recall keeps a running (rows, k) buffer of the largest scores only while ``k < S``: with ``k >= S``
    every allowed key is among the top k, so the threshold is ``-inf`` and no buffer is made (any k, even
    10**9, costs nothing).  Query blocks shrink so that buffer stays within ``block * key_block`` values.
    """
    L, S = q.shape[0], kk.shape[0]
    k_top = k if k is not None and k < S else None
    if k_top is not None:
        block = min(block, max(1, (block * key_block) // k_top))
    if is_causal:
        n_allowed = np.searchsorted(np.sort(kpos), qpos, side="right").astype(np.int64)
    else:
        n_allowed = np.full(L, S, dtype=np.int64)
    need_out = v is not None
    res: dict = {
        "n_allowed": n_allowed,
        "n_selected": np.zeros(L, dtype=np.int64),
        "lse_dense": np.full(L, -np.inf), "lse_sparse": np.full(L, -np.inf),
        "mass_recall": np.ones(L), "lse_error": np.zeros(L), "recall": np.ones(L),
        "rel_error": np.zeros(L), "diff_sq": 0.0, "ref_sq": 0.0, "max_abs": 0.0, "dropped": 0,
    }
    # Key tiles with their position range, so causal tiles that are fully hidden or fully visible for a
    # query block skip the mask (about half of the tiles are skipped outright with top-left alignment).
    tiles = [(c0, min(c0 + key_block, S)) for c0 in range(0, S, key_block)]
    tile_min = [int(kpos[a:b].min()) for a, b in tiles]
    tile_max = [int(kpos[a:b].max()) for a, b in tiles]

    for r0 in range(0, L, block):
        r1 = min(r0 + block, L)
        nb = r1 - r0
        qb = q[r0:r1]
        qpb = qpos[r0:r1]
        m = np.full(nb, -np.inf)
        lsum = np.zeros(nb)
        acc = np.zeros((nb, v.shape[1])) if need_out else None
        top = np.full((nb, k_top), -np.inf) if k_top is not None else None
        qmin, qmax = (int(qpb.min()), int(qpb.max())) if nb else (0, 0)
        for (a, b), kmin, kmax in zip(tiles, tile_min, tile_max, strict=True):
            mask = g = None  # drop the previous tile before the next is allocated (one tile alive)
            if top is None and not (need_lse or need_out):
                break  # recall with k >= S needs no dense scores
            if is_causal:
                if kmin > qmax:
                    continue  # every key of the tile is after every query of the block
                if kmax > qmin:
                    mask = kpos[None, a:b] > qpb[:, None]
            g = qb @ kk[a:b].T  # raw scores q.k, (nb, b - a)
            if mask is not None:
                np.copyto(g, -np.inf, where=mask)
            if top is not None:
                top = _merge_topk(top, g, k_top)
            if not (need_lse or need_out):
                continue
            with np.errstate(invalid="ignore"):
                g *= scale
            if mask is not None and scale <= 0:
                np.copyto(g, -np.inf, where=mask)  # 0 * -inf is NaN and a negative scale flips -inf
            m_new = np.maximum(m, g.max(axis=1))
            m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # rows with nothing allowed yet
            alpha = np.exp(m - m_safe)
            g -= m_safe[:, None]
            np.exp(g, out=g)
            lsum = lsum * alpha + g.sum(axis=1)
            if need_out:
                acc *= alpha[:, None]
                acc += g @ v[a:b]
            m = m_new
        mask = g = None  # the last tile is no longer needed: free it before the sparse-side pass
        has = lsum > 0
        lse_d = np.full(nb, -np.inf)
        lse_d[has] = m[has] + np.log(lsum[has])

        _sparse_block(res, q, kk, v, pattern, r0, r1, qpos, kpos, is_causal, scale, lse_d, top, k, eps,
                      need_lse, sparse_output)

        if need_lse:
            res["lse_dense"][r0:r1] = lse_d
        if need_out:
            o_dense = np.zeros_like(acc)
            o_dense[has] = acc[has] / lsum[has, None]
            o_sparse = sparse_output[r0:r1] if sparse_output is not None else res.pop("_o_sparse")
            diff = o_sparse - o_dense
            dn = np.linalg.norm(diff, axis=1)
            rn = np.linalg.norm(o_dense, axis=1)
            res["rel_error"][r0:r1] = _guarded_ratio(dn, rn)
            res["diff_sq"] += float(np.dot(dn, dn))
            res["ref_sq"] += float(np.dot(rn, rn))
            if diff.size:
                res["max_abs"] = max(res["max_abs"], float(np.abs(diff).max()))
    return res


def _merge_topk(top: np.ndarray, g: np.ndarray, k: int) -> np.ndarray:
    """The k largest values per row of ``top`` (nb, k) together with tile ``g`` (nb, c), unsorted.

    ``top`` is updated in place (and returned) by the shared top-k core in accumulate mode; NaN and
    ``-inf`` scores are never counted, missing entries stay ``-inf``.  Only the values are used, so every
    entry gets id 0 (ties need no order: equal values are interchangeable).
    """
    nb, c = g.shape
    top_i = np.where(top > -np.inf, 0, -1).astype(np.int64)
    zeros = np.zeros(max(nb, c), dtype=np.int64)
    block_topk(np.ascontiguousarray(g, dtype=top.dtype), k, False, zeros[:nb], zeros[:c], zeros[:c], top,
               top_i, ORDER_NONE, True)
    return top


def _sparse_block(res: dict, q: np.ndarray, kk: np.ndarray, v: np.ndarray | None, pattern: SparsePattern,
                  r0: int, r1: int, qpos: np.ndarray, kpos: np.ndarray, is_causal: bool, scale: float,
                  lse_d: np.ndarray, top: np.ndarray | None, k: int | None, eps: float, need_lse: bool,
                  sparse_output: np.ndarray | None) -> None:
    """Sparse-side quantities of rows [r0, r1): scores of the selected keys, lse, mass, recall, output."""
    nb = r1 - r0
    lo, hi = int(pattern.indptr[r0]), int(pattern.indptr[r1])
    idx = pattern.indices[lo:hi].astype(np.int64)
    row = np.repeat(np.arange(nb), np.diff(pattern.indptr[r0:r1 + 1]))
    if is_causal and idx.size:
        keep = kpos[idx] <= qpos[r0 + row]
        res["dropped"] += int(idx.size - np.count_nonzero(keep))
        idx, row = idx[keep], row[keep]
    n_sel = np.bincount(row, minlength=nb).astype(np.int64)
    res["n_selected"][r0:r1] = n_sel
    n_allowed = res["n_allowed"][r0:r1]

    # Raw scores of the selected pairs, gathered in bounded chunks.
    raw = np.empty(idx.size)
    step = max(1, _GATHER_ELEMS // max(1, q.shape[1]))
    for p0 in range(0, idx.size, step):
        p1 = min(p0 + step, idx.size)
        raw[p0:p1] = np.einsum("ij,ij->i", q[r0 + row[p0:p1]], kk[idx[p0:p1]])

    if k is not None:
        if top is not None:
            kth = top.min(axis=1)
            with np.errstate(invalid="ignore"):
                thr = np.where(np.isfinite(kth), kth - eps * np.abs(kth) - eps, -np.inf)
        else:  # k >= S: every allowed key is a top-k key
            thr = np.full(nb, -np.inf)
        hits = np.bincount(row, weights=(raw >= thr[row]).astype(np.float64), minlength=nb)
        den = np.minimum(k, n_allowed)
        res["recall"][r0:r1] = np.where(den > 0, np.minimum(hits / np.maximum(den, 1), 1.0), 1.0)

    need_out = v is not None and sparse_output is None
    if not (need_lse or need_out):
        return
    s = raw * scale
    nonempty = n_sel > 0
    indptr_b = np.zeros(nb + 1, dtype=np.int64)
    np.cumsum(n_sel, out=indptr_b[1:])
    m = np.full(nb, -np.inf)
    if idx.size:
        # reduceat over the starts of non-empty rows only: empty rows add no elements in between.
        m[nonempty] = np.maximum.reduceat(s, indptr_b[:-1][nonempty])
    e = np.exp(s - m[row]) if idx.size else s
    lsum = np.bincount(row, weights=e, minlength=nb)
    lse_s = np.full(nb, -np.inf)
    lse_s[nonempty] = m[nonempty] + np.log(lsum[nonempty])
    if need_lse:
        res["lse_sparse"][r0:r1] = lse_s
        has_dense = np.isfinite(lse_d)
        err = np.zeros(nb)  # rows with no allowed key: nothing to lose
        with np.errstate(invalid="ignore"):
            err[has_dense] = np.maximum(lse_d[has_dense] - lse_s[has_dense], 0.0)  # inf when missed
        res["lse_error"][r0:r1] = err
        res["mass_recall"][r0:r1] = np.exp(-err)
    if need_out:
        w = e / lsum[row] if idx.size else e
        import scipy.sparse as sp  # lazy: keeps `import sparseattn` fast

        probs = sp.csr_matrix((w, idx, indptr_b), shape=(nb, kk.shape[0]))
        res["_o_sparse"] = np.asarray(probs @ v)
