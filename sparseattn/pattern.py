"""SparsePattern: the one sparse format every selector produces and every kernel consumes.

A pattern says, for each of ``L`` queries, which of ``n_keys`` keys it attends to, in CSR form:

* ``indptr``  int64, shape (L + 1,): row i's keys are ``indices[indptr[i]:indptr[i + 1]]``;
* ``indices`` int32, shape (nnz,): key ids in ``[0, n_keys)``, sorted ascending and unique per row;
* ``n_keys``  the number of keys the ids refer to.

Sentinels (FAISS's -1, cKDTree's ``n``) are dropped when a pattern is built and never reach a kernel.
An empty row is legal: attention over no key yields zeros and a log-sum-exp of ``-inf``.

A pattern is immutable: ``indptr`` and ``indices`` are read-only arrays (``flags.writeable`` False), so the
invariants checked once at construction still hold when a kernel reads them, and no per-call re-check is
needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .inputs import check_positive_int, positions
from .kernels import pattern_ops

_CSR_ERRORS = {
    1: "indptr[0] must be 0; got {value}",
    2: "indptr must be non-decreasing; indptr[{row_plus}] = {value} is smaller than indptr[{row}]",
    3: "indptr[-1] must equal len(indices); got indptr[-1] = {value}",
    4: "row {row} has key id {value}, outside [0, n_keys)",
    5: "row {row} has duplicate key id {value}",
    6: "row {row} is not sorted ascending (at key id {value})",
}


@dataclass(frozen=True, eq=False)
class SparsePattern:
    """Which keys each query attends to, as canonical CSR.

    Parameters
    ----------
    indptr : array of int, shape (L + 1,)
        Row pointers; converted to int64.
    indices : array of int, shape (nnz,)
        Key ids, sorted and unique within each row; converted to int32.
    n_keys : int
        Number of keys (S) the ids index into.
    validate : bool, default True
        Check the invariants (raises ``ValueError`` naming the offending row and value); a caller's
        writable array is copied, never frozen under it.  ``False`` is for internal constructors only:
        they hand over freshly built canonical arrays, which are frozen in place without a copy or a
        check (a kernel trusts them: an invalid id would be an out-of-bounds read).

    Examples
    --------
    >>> p = SparsePattern.from_padded(np.array([[2, -1, 0], [1, 1, -1]]), n_keys=3)
    >>> p.indptr.tolist(), p.indices.tolist()
    ([0, 2, 3], [0, 2, 1])
    """

    indptr: np.ndarray
    indices: np.ndarray
    n_keys: int

    def __init__(self, indptr: object, indices: object, n_keys: int, *, validate: bool = True) -> None:
        n_keys = check_positive_int(n_keys, "n_keys", minimum=0)
        indptr_arr = np.asarray(indptr)
        indices_arr = np.asarray(indices)
        for name, arr in (("indptr", indptr_arr), ("indices", indices_arr)):
            if arr.dtype.kind not in "iu":
                raise TypeError(f"{name} must be an integer array; got dtype {arr.dtype}.")
            if arr.ndim != 1:
                raise ValueError(f"{name} must be 1-D; got shape {arr.shape}.")
        if indptr_arr.shape[0] < 1:
            raise ValueError("indptr must have length L + 1 >= 1; got an empty array.")
        if indices_arr.size and (indices_arr.max() > np.iinfo(np.int32).max or indices_arr.min() < -(2**31)):
            raise ValueError("indices must fit in int32 (key ids below 2**31).")
        object.__setattr__(self, "indptr", _read_only(indptr_arr, np.int64, owned=not validate))
        object.__setattr__(self, "indices", _read_only(indices_arr, np.int32, owned=not validate))
        object.__setattr__(self, "n_keys", n_keys)
        if validate:
            self.validate()

    # ----------------------------------------------------------------------------------- invariants
    def validate(self) -> SparsePattern:
        """Raise ``ValueError`` describing the first violated invariant; return self when valid."""
        code, row, value = pattern_ops.check_csr(self.indptr, self.indices, self.n_keys)
        if code:
            msg = _CSR_ERRORS[int(code)].format(row=int(row), row_plus=int(row) + 1, value=int(value))
            raise ValueError(f"invalid SparsePattern: {msg} (n_queries={self.n_queries}, "
                             f"n_keys={self.n_keys}). Build patterns with SparsePattern.from_padded or "
                             f"from_mask to get the canonical form.")
        return self

    # ------------------------------------------------------------------------------------ properties
    @property
    def n_queries(self) -> int:
        """Number of rows (queries) L."""
        return int(self.indptr.shape[0] - 1)

    @property
    def shape(self) -> tuple[int, int]:
        """(L, n_keys), like the dense mask it stands for."""
        return (self.n_queries, self.n_keys)

    @property
    def nnz(self) -> int:
        """Total number of selected (query, key) pairs."""
        return int(self.indptr[-1])

    @property
    def nnz_per_row(self) -> np.ndarray:
        """int64 array of shape (L,): keys selected per query."""
        return np.diff(self.indptr)

    def row(self, i: int) -> np.ndarray:
        """Key ids (int32, sorted) selected by query ``i``."""
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def stats(self) -> dict[str, float]:
        """Summary: n_queries, n_keys, nnz, min/mean/max keys per row, density, empty_rows."""
        per_row = self.nnz_per_row
        L = self.n_queries
        return {
            "n_queries": L,
            "n_keys": self.n_keys,
            "nnz": self.nnz,
            "min_per_row": int(per_row.min()) if L else 0,
            "mean_per_row": float(per_row.mean()) if L else 0.0,
            "max_per_row": int(per_row.max()) if L else 0,
            "density": self.nnz / (L * self.n_keys) if L and self.n_keys else 0.0,
            "empty_rows": int((per_row == 0).sum()),
        }

    def __repr__(self) -> str:
        s = self.stats()
        return (f"SparsePattern(n_queries={s['n_queries']}, n_keys={s['n_keys']}, nnz={s['nnz']}, "
                f"per_row={s['min_per_row']}..{s['max_per_row']}, empty_rows={s['empty_rows']})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparsePattern):
            return NotImplemented
        return (self.n_keys == other.n_keys and np.array_equal(self.indptr, other.indptr)
                and np.array_equal(self.indices, other.indices))

    __hash__ = None  # type: ignore[assignment]  # equality compares whole arrays: not hashable

    # ---------------------------------------------------------------------------------- conversions
    def to_mask(self) -> np.ndarray:
        """Dense boolean mask of shape (L, n_keys), True where selected. For small patterns only."""
        mask = np.zeros(self.shape, dtype=bool)
        rows = np.repeat(np.arange(self.n_queries), self.nnz_per_row)
        mask[rows, self.indices] = True
        return mask

    def to_padded(self, k: int | None = None) -> np.ndarray:
        """(L, k) int64 id matrix padded with -1 (k defaults to the longest row); truncates longer rows."""
        per_row = self.nnz_per_row
        width = int(per_row.max()) if k is None and self.n_queries else (k or 0)
        out = np.full((self.n_queries, width), -1, dtype=np.int64)
        if width == 0:
            return out
        rows = np.repeat(np.arange(self.n_queries), per_row)
        cols = np.arange(self.nnz) - np.repeat(self.indptr[:-1], per_row)
        keep = cols < width
        out[rows[keep], cols[keep]] = self.indices[keep]
        return out

    # --------------------------------------------------------------------------------- constructors
    @classmethod
    def from_padded(cls, ids: object, n_keys: int) -> SparsePattern:
        """From an (L, k) integer id matrix; -1 means "no key" (FAISS convention).

        Duplicates within a row are merged, rows are sorted.  Ids < -1 or >= n_keys raise ``ValueError``.
        """
        n_keys = check_positive_int(n_keys, "n_keys", minimum=0)
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ids must be an integer array; got dtype {arr.dtype}.")
        if arr.ndim != 2:
            raise ValueError(f"ids must be 2-D (n_queries, k); got shape {arr.shape}.")
        indptr, indices, bad_row, bad_value = pattern_ops.from_padded(
            np.ascontiguousarray(arr, dtype=np.int64), n_keys)
        if bad_row >= 0:
            raise ValueError(f"ids[{int(bad_row)}] contains {int(bad_value)}: ids must be -1 (no key) "
                             f"or in [0, n_keys={n_keys}).")
        return cls(indptr, indices, n_keys, validate=False)

    @classmethod
    def from_rows(cls, rows: Iterable[Iterable[int]], n_keys: int) -> SparsePattern:
        """From a list of per-query key-id lists (sorted and deduplicated here)."""
        n_keys = check_positive_int(n_keys, "n_keys", minimum=0)
        rows = [_integer_ids(list(r), f"rows[{i}]") for i, r in enumerate(rows)]
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        indptr[1:] = np.cumsum([len(r) for r in rows])
        indices = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= n_keys):
            raise ValueError(f"rows contain key ids outside [0, n_keys={n_keys}).")
        ptr, idx = pattern_ops.canonicalize_rows(indptr, indices.astype(np.int32))
        return cls(ptr, idx, n_keys, validate=False)

    @classmethod
    def from_mask(cls, mask: object) -> SparsePattern:
        """From a boolean (L, S) mask, True = may attend (PyTorch SDPA convention)."""
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean array (True = may attend); got dtype {m.dtype}.")
        if m.ndim != 2:
            raise ValueError(f"mask must be 2-D (L, S); got shape {m.shape}.")
        indptr = np.zeros(m.shape[0] + 1, dtype=np.int64)
        np.cumsum(m.sum(axis=1), out=indptr[1:])
        indices = np.nonzero(m)[1].astype(np.int32)
        return cls(indptr, indices, m.shape[1], validate=False)

    @classmethod
    def full(cls, n_queries: int, n_keys: int, *, is_causal: bool = False) -> SparsePattern:
        """Every query attends every key (causal: key j <= query i, top-left aligned like SDPA)."""
        n_queries = check_positive_int(n_queries, "n_queries", minimum=0)
        n_keys = check_positive_int(n_keys, "n_keys", minimum=0)
        reach = n_keys + n_queries  # row i's window must still cover key 0 when i > n_keys
        if is_causal:
            return cls.band(n_queries, n_keys, before=reach, after=0)
        return cls.band(n_queries, n_keys, before=reach, after=reach)

    @classmethod
    def band(cls, n_queries: int, n_keys: int, *, before: int, after: int = 0, dilation: int = 1,
             offset: int = 0) -> SparsePattern:
        """Query i selects keys ``c + t*dilation`` for t in [-before, after], where ``c = i + offset``.

        ``before`` / ``after`` count keys (steps of ``dilation``) on each side; ids outside
        ``[0, n_keys)`` are clipped away, so the first rows of a causal window are shorter.
        """
        n_queries = check_positive_int(n_queries, "n_queries", minimum=0)
        n_keys = check_positive_int(n_keys, "n_keys", minimum=0)
        before = check_positive_int(before, "before", minimum=0)
        after = check_positive_int(after, "after", minimum=0)
        dilation = check_positive_int(dilation, "dilation", minimum=1)
        if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool):
            raise TypeError(f"offset must be an integer; got {offset!r}.")
        # Clip the reach so that `before * dilation` cannot overflow or loop over absurd ranges.
        reach = n_keys + abs(int(offset)) + n_queries
        before = min(before, reach)
        after = min(after, reach)
        centers = np.arange(n_queries, dtype=np.int64) + int(offset)
        indptr, indices = pattern_ops.band(n_queries, n_keys, centers, before, after, dilation)
        return cls(indptr, indices, n_keys, validate=False)

    @classmethod
    def window(cls, n_queries: int, n_keys: int, width: int, *, is_causal: bool = False,
               dilation: int = 1) -> SparsePattern:
        """Sliding window of ``width`` keys per query.

        Causal: the ``width`` keys ending at the query's own position (``i - width + 1 .. i``).
        Bidirectional: ``width // 2`` before and ``width - 1 - width // 2`` after, centred on ``i``.
        """
        width = check_positive_int(width, "width", minimum=1)
        if is_causal:
            return cls.band(n_queries, n_keys, before=width - 1, after=0, dilation=dilation)
        before = width // 2
        return cls.band(n_queries, n_keys, before=before, after=width - 1 - before, dilation=dilation)

    # ------------------------------------------------------------------------------------ algebra
    def union(self, *others: SparsePattern) -> SparsePattern:
        """Row-wise union with other patterns of the same shape (duplicates removed)."""
        ptr, idx = self.indptr, self.indices
        for other in others:
            if not isinstance(other, SparsePattern):
                raise TypeError(f"union expects SparsePattern objects; got {type(other).__name__}.")
            if other.shape != self.shape:
                raise ValueError(f"union needs patterns of the same shape; got {self.shape} and {other.shape}.")
            ptr, idx = pattern_ops.union2(ptr, idx, other.indptr, other.indices)
        return SparsePattern(ptr, idx, self.n_keys, validate=False)

    def __or__(self, other: SparsePattern) -> SparsePattern:
        return self.union(other)

    def causal(self, query_positions: object = None, key_positions: object = None) -> SparsePattern:
        """Drop keys that lie after their query: keep j when ``key_positions[j] <= query_positions[i]``.

        Default positions are ``arange``, i.e. SDPA's top-left alignment (query i sees keys 0..i).
        For a decoder with a KV cache of S keys and L new queries, pass
        ``query_positions=np.arange(S - L, S)`` (bottom-right alignment).
        """
        qpos = positions(query_positions, self.n_queries, "query_positions")
        kpos = positions(key_positions, self.n_keys, "key_positions")
        ptr, idx = pattern_ops.filter_by_position(self.indptr, self.indices, qpos, kpos)
        return SparsePattern(ptr, idx, self.n_keys, validate=False)

    def select_rows(self, rows: object) -> SparsePattern:
        """A pattern made of the given rows (e.g. a query block), in the given order."""
        rows = _integer_ids(rows, "rows")
        if rows.size and (rows.min() < 0 or rows.max() >= self.n_queries):
            raise ValueError(f"rows must lie in [0, {self.n_queries}).")
        per_row = self.nnz_per_row[rows]
        indptr = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(per_row, out=indptr[1:])
        # Position p of the new rows maps to old position p + (old row start - new row start).
        take = np.arange(indptr[-1], dtype=np.int64) + np.repeat(self.indptr[rows] - indptr[:-1], per_row)
        return SparsePattern(indptr, self.indices[take], self.n_keys, validate=False)


def _read_only(arr: np.ndarray, dtype: type, *, owned: bool) -> np.ndarray:
    """``arr`` as a C-contiguous read-only array of ``dtype``.

    ``owned``: the caller hands the array over (internal constructors), so it is frozen in place.
    Otherwise an array that still shares memory with the caller's writable one is copied first.
    """
    out = np.ascontiguousarray(arr, dtype=dtype)
    if out.flags.writeable and not owned and np.may_share_memory(out, arr):
        out = out.copy()
    out.flags.writeable = False
    return out


def _integer_ids(values: object, name: str) -> np.ndarray:
    """``values`` as a 1-D int64 array; floats (even integral ones), bools and other kinds raise TypeError.

    Why strict: a float id such as 2.7 would otherwise be truncated silently to key 2.
    """
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integer ids; got dtype {a.dtype} (e.g. {a.reshape(-1)[0]!r}). "
                        f"Convert explicitly, e.g. np.asarray(ids, dtype=np.int64), after checking the values.")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D; got shape {a.shape}.")
    return a.astype(np.int64, copy=False)


def stack_patterns(patterns: list[SparsePattern]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate G patterns with equal shapes into one (G*L + 1,) indptr and an indices array.

    Used by the batched kernels: row ``g*L + i`` of the result is row i of pattern g.
    """
    if not patterns:
        raise ValueError("patterns must not be empty.")
    shape = patterns[0].shape
    for g, p in enumerate(patterns):
        if not isinstance(p, SparsePattern):
            raise TypeError(f"patterns[{g}] must be a SparsePattern; got {type(p).__name__}.")
        if p.shape != shape:
            raise ValueError(f"patterns[{g}] has shape {p.shape}; expected {shape} like patterns[0].")
    offsets = np.cumsum([0] + [p.nnz for p in patterns[:-1]])
    indptr = np.concatenate([patterns[0].indptr[:1]]
                            + [p.indptr[1:] + off for p, off in zip(patterns, offsets, strict=True)])
    indices = np.concatenate([p.indices for p in patterns])
    # Read-only like a pattern's own arrays: the kernels then see one array type (one compilation).
    return _read_only(indptr, np.int64, owned=True), _read_only(indices, np.int32, owned=True)
