"""Numba kernels that build and transform CSR sparse patterns.

Plain functions over arrays (no closures), so ``cache=True`` works.  Every function returns freshly
allocated ``indptr`` (int64, length L+1) and ``indices`` (int32), with each row's indices sorted
ascending and unique: the canonical form that :class:`sparseattn.SparsePattern` guarantees.

Each transform is compiled twice from one Python function, serial and parallel: small patterns (the common
case in tests, per-head windows, first calls) take the serial variant, which compiles in a fraction of
the time and avoids waking a thread pool for microseconds of work.  Most transforms are a row emitter
(the keys of one row) that :func:`two_pass_csr` runs twice, counting and then writing.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from .options import serial_and_parallel


@njit(cache=True)
def indptr_from_counts(counts):
    """CSR row pointers (int64, length n + 1) from per-row counts: the shared count-then-fill step."""
    n = counts.shape[0]
    indptr = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        indptr[i + 1] = indptr[i] + counts[i]
    return indptr


@njit(cache=True)
def check_csr(indptr, indices, n_keys):
    """Return (code, row, value) of the first violation, or (0, -1, 0) for a valid canonical CSR.

    Codes: 1 indptr[0] != 0, 2 indptr decreasing, 3 indptr[-1] != len(indices), 4 index out of range,
    5 duplicate index in a row, 6 row not sorted.
    """
    n_rows = indptr.shape[0] - 1
    if indptr[0] != 0:
        return 1, 0, indptr[0]
    for i in range(n_rows):
        if indptr[i + 1] < indptr[i]:
            return 2, i, indptr[i + 1]
    if indptr[n_rows] != indices.shape[0]:
        return 3, n_rows, indptr[n_rows]
    for i in range(n_rows):
        prev = -1
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            if j < 0 or j >= n_keys:
                return 4, i, j
            if j == prev:
                return 5, i, j
            if j < prev:
                return 6, i, j
            prev = j
    return 0, -1, 0


@njit(cache=True)
def csr_alloc(counts):
    """``indptr`` from per-row counts (:func:`indptr_from_counts`) and an unfilled int32 ``indices``."""
    indptr = indptr_from_counts(counts)
    return indptr, np.empty(indptr[counts.shape[0]], dtype=np.int32)


@njit(cache=True, inline="always")
def emit(out, w, write, j):
    """One key of a row emitter: store j at out[w] when ``write``; return the next position."""
    if write:
        out[w] = j
    return w + 1


_ROW = None  # the row emitter of a two_pass_csr pair, bound per pair through ``constants``


def _two_pass_impl(n_rows, args):
    """Canonical CSR from the row emitter ``_ROW(i, args, out, w, write) -> end``.

    The emitter walks row i's keys and returns ``w`` plus their count; with ``write`` it stores them at
    ``out[w:end]`` sorted ascending and unique.  One pass counts (an emitter may prepare its row there, e.g.
    sort it in place), the other writes: both run the same row code, so they cannot disagree.
    """
    nowhere = np.empty(0, dtype=np.int32)
    counts = np.empty(n_rows, dtype=np.int64)
    for i in prange(n_rows):
        counts[i] = _ROW(i, args, nowhere, 0, False)
    indptr, indices = csr_alloc(counts)
    for i in prange(n_rows):
        _ROW(i, args, indices, indptr[i], True)
    return indptr, indices


def two_pass_csr(row, name):
    """(serial, parallel) kernels ``(n_rows, args) -> (indptr, indices)`` over the row emitter ``row``."""
    return serial_and_parallel(_two_pass_impl, constants={"_ROW": row}, suffix="_" + name)


@njit(cache=True, inline="always")
def _emit_distinct(src, a, b, out, w, write):
    """Emit the distinct values of the ascending src[a:b]."""
    for p in range(a, b):
        if p == a or src[p] != src[p - 1]:
            w = emit(out, w, write, src[p])
    return w


@njit(cache=True, inline="always")
def _canonical_row(i, args, out, w, write):
    """Row i of ``work`` sorted (in place, by the counting pass) without repeats."""
    indptr, work = args
    a = indptr[i]
    b = indptr[i + 1]
    if not write:
        work[a:b].sort()
    return _emit_distinct(work, a, b, out, w, write)


def _from_padded_impl(ids, n_keys):
    """CSR from an (L, k) id matrix where negative ids mean "no key" (the FAISS -1 convention).

    Returns (indptr, indices, bad_row, bad_value); bad_row >= 0 reports an id >= n_keys or < -1.
    """
    n_rows, k = ids.shape
    counts = np.zeros(n_rows, dtype=np.int64)
    start = np.zeros(n_rows, dtype=np.int64)
    is_bad = np.zeros(n_rows, dtype=np.bool_)
    bad = np.zeros(n_rows, dtype=np.int64)
    sorted_rows = np.empty((n_rows, k), dtype=np.int64)
    nowhere = np.empty(0, dtype=np.int32)
    for i in prange(n_rows):
        row = np.sort(ids[i].astype(np.int64))
        sorted_rows[i] = row
        for p in range(k):
            if row[p] < -1 or row[p] >= n_keys:
                is_bad[i] = True
                bad[i] = row[p]
        start[i] = np.searchsorted(row, 0)  # the "no key" ids sort first
        counts[i] = _emit_distinct(row, start[i], k, nowhere, 0, False)
    for i in range(n_rows):
        if is_bad[i]:
            return np.zeros(1, np.int64), np.zeros(0, np.int32), i, bad[i]
    indptr, indices = csr_alloc(counts)
    for i in prange(n_rows):
        _emit_distinct(sorted_rows[i], start[i], k, indices, indptr[i], True)
    return indptr, indices, -1, 0


@njit(cache=True, inline="always")
def _band_row(i, args, out, w, write):
    """Keys centers[i] + t*dilation for t in [-before, after], clipped to [0, n_keys)."""
    n_keys, centers, before, after, dilation = args
    for t in range(-before, after + 1):
        j = centers[i] + t * dilation
        if 0 <= j < n_keys:
            w = emit(out, w, write, j)
    return w


@njit(cache=True, inline="always")
def _union2_row(i, args, out, w, write):
    """Sorted merge of row i of two canonical CSR patterns."""
    ptr_a, idx_a, ptr_b, idx_b = args
    p = ptr_a[i]
    q = ptr_b[i]
    pe = ptr_a[i + 1]
    qe = ptr_b[i + 1]
    while p < pe or q < qe:
        if q >= qe or (p < pe and idx_a[p] < idx_b[q]):
            w = emit(out, w, write, idx_a[p])
            p += 1
        elif p >= pe or idx_b[q] < idx_a[p]:
            w = emit(out, w, write, idx_b[q])
            q += 1
        else:
            w = emit(out, w, write, idx_a[p])
            p += 1
            q += 1
    return w


@njit(cache=True, inline="always")
def _filter_by_position_row(i, args, out, w, write):
    """Keys j of row i with key_positions[j] <= query_positions[i]."""
    indptr, indices, query_positions, key_positions = args
    qp = query_positions[i]
    for p in range(indptr[i], indptr[i + 1]):
        if key_positions[indices[p]] <= qp:
            w = emit(out, w, write, indices[p])
    return w


PARALLEL_MIN_WORK = 1 << 16  # elements touched below which the serial variant is faster


_VARIANTS = {
    "canonicalize_rows": two_pass_csr(_canonical_row, "canonicalize_rows"),
    "from_padded": serial_and_parallel(_from_padded_impl),
    "band": two_pass_csr(_band_row, "band"),
    "union2": two_pass_csr(_union2_row, "union2"),
    "filter_by_position": two_pass_csr(_filter_by_position_row, "filter_by_position"),
}


def _pick(name: str, work: int):
    serial, parallel = _VARIANTS[name]
    return parallel if work > PARALLEL_MIN_WORK and numba.get_num_threads() > 1 else serial


def canonicalize_rows(indptr, indices):
    """Sort each row and drop duplicates; returns a new (indptr, indices)."""
    return _pick("canonicalize_rows", indices.shape[0])(indptr.shape[0] - 1, (indptr, indices.copy()))


def from_padded(ids, n_keys):
    """CSR from an (L, k) id matrix with -1 = no key; returns (indptr, indices, bad_row, bad_value)."""
    return _pick("from_padded", ids.size)(ids, n_keys)


def band(n_rows, n_keys, centers, before, after, dilation):
    """Row i selects keys centers[i] + t*dilation for t in [-before, after], clipped to [0, n_keys)."""
    work = n_rows * min(before + after + 1, n_keys + 1)
    return _pick("band", work)(n_rows, (n_keys, centers, before, after, dilation))


def union2(ptr_a, idx_a, ptr_b, idx_b):
    """Row-wise sorted merge of two canonical CSR patterns with the same number of rows."""
    return _pick("union2", idx_a.shape[0] + idx_b.shape[0])(ptr_a.shape[0] - 1, (ptr_a, idx_a, ptr_b, idx_b))


def filter_by_position(indptr, indices, query_positions, key_positions):
    """Keep key j in row i only when key_positions[j] <= query_positions[i] (causal filtering)."""
    args = (indptr, indices, query_positions, key_positions)
    return _pick("filter_by_position", indices.shape[0])(indptr.shape[0] - 1, args)
