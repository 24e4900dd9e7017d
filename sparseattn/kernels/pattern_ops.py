"""Numba kernels that build and transform CSR sparse patterns.

Plain functions over arrays (no closures), so ``cache=True`` works.  Every function returns freshly
allocated ``indptr`` (int64, length L+1) and ``indices`` (int32), with each row's indices sorted
ascending and unique: the canonical form that :class:`sparseattn.SparsePattern` guarantees.

Each transform is compiled twice from one Python function, serial and parallel: small patterns (the common
case in tests, per-head windows, first calls) take the serial variant, which compiles in a fraction of
the time and avoids waking a thread pool for microseconds of work.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ._options import serial_and_parallel


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


def _canonicalize_rows_impl(indptr, indices):
    """Sort each row and drop duplicates; returns a new (indptr, indices)."""
    n_rows = indptr.shape[0] - 1
    counts = np.zeros(n_rows, dtype=np.int64)
    work = indices.copy()
    for i in prange(n_rows):
        a = indptr[i]
        b = indptr[i + 1]
        if b > a:
            row = np.sort(work[a:b])
            work[a:b] = row
            c = 1
            for p in range(1, b - a):
                if row[p] != row[p - 1]:
                    c += 1
            counts[i] = c
    new_ptr = indptr_from_counts(counts)
    out = np.empty(new_ptr[n_rows], dtype=np.int32)
    for i in prange(n_rows):
        a = indptr[i]
        b = indptr[i + 1]
        w = new_ptr[i]
        for p in range(a, b):
            if p == a or work[p] != work[p - 1]:
                out[w] = work[p]
                w += 1
    return new_ptr, out


def _from_padded_impl(ids, n_keys):
    """CSR from an (L, k) id matrix where negative ids mean "no key" (the FAISS -1 convention).

    Returns (indptr, indices, bad_row, bad_value); bad_row >= 0 reports an id >= n_keys or < -1.
    """
    n_rows, k = ids.shape
    counts = np.zeros(n_rows, dtype=np.int64)
    is_bad = np.zeros(n_rows, dtype=np.bool_)
    bad = np.zeros(n_rows, dtype=np.int64)
    sorted_rows = np.empty((n_rows, k), dtype=np.int64)
    for i in prange(n_rows):
        row = np.sort(ids[i].astype(np.int64))
        sorted_rows[i] = row
        c = 0
        for p in range(k):
            j = row[p]
            if j < -1 or j >= n_keys:
                is_bad[i] = True
                bad[i] = j
            if j >= 0 and (p == 0 or row[p - 1] != j):
                c += 1
        counts[i] = c
    for i in range(n_rows):
        if is_bad[i]:
            return np.zeros(1, np.int64), np.zeros(0, np.int32), i, bad[i]
    indptr = indptr_from_counts(counts)
    indices = np.empty(indptr[n_rows], dtype=np.int32)
    for i in prange(n_rows):
        w = indptr[i]
        row = sorted_rows[i]
        for p in range(k):
            j = row[p]
            if j >= 0 and (p == 0 or row[p - 1] != j):
                indices[w] = j
                w += 1
    return indptr, indices, -1, 0


def _band_impl(n_rows, n_keys, centers, before, after, dilation):
    """Row i selects keys centers[i] + t*dilation for t in [-before, after], clipped to [0, n_keys)."""
    counts = np.zeros(n_rows, dtype=np.int64)
    for i in prange(n_rows):
        c = 0
        for t in range(-before, after + 1):
            j = centers[i] + t * dilation
            if 0 <= j < n_keys:
                c += 1
        counts[i] = c
    indptr = indptr_from_counts(counts)
    indices = np.empty(indptr[n_rows], dtype=np.int32)
    for i in prange(n_rows):
        w = indptr[i]
        for t in range(-before, after + 1):
            j = centers[i] + t * dilation
            if 0 <= j < n_keys:
                indices[w] = j
                w += 1
    return indptr, indices


def _union2_impl(ptr_a, idx_a, ptr_b, idx_b):
    """Row-wise sorted merge of two canonical CSR patterns with the same number of rows."""
    n_rows = ptr_a.shape[0] - 1
    counts = np.zeros(n_rows, dtype=np.int64)
    for i in prange(n_rows):
        p = ptr_a[i]
        q = ptr_b[i]
        pe = ptr_a[i + 1]
        qe = ptr_b[i + 1]
        c = 0
        while p < pe or q < qe:
            if q >= qe or (p < pe and idx_a[p] < idx_b[q]):
                p += 1
            elif p >= pe or idx_b[q] < idx_a[p]:
                q += 1
            else:
                p += 1
                q += 1
            c += 1
        counts[i] = c
    indptr = indptr_from_counts(counts)
    indices = np.empty(indptr[n_rows], dtype=np.int32)
    for i in prange(n_rows):
        p = ptr_a[i]
        q = ptr_b[i]
        pe = ptr_a[i + 1]
        qe = ptr_b[i + 1]
        w = indptr[i]
        while p < pe or q < qe:
            if q >= qe or (p < pe and idx_a[p] < idx_b[q]):
                indices[w] = idx_a[p]
                p += 1
            elif p >= pe or idx_b[q] < idx_a[p]:
                indices[w] = idx_b[q]
                q += 1
            else:
                indices[w] = idx_a[p]
                p += 1
                q += 1
            w += 1
    return indptr, indices


def _filter_by_position_impl(indptr, indices, query_positions, key_positions):
    """Keep key j in row i only when key_positions[j] <= query_positions[i] (causal filtering)."""
    n_rows = indptr.shape[0] - 1
    counts = np.zeros(n_rows, dtype=np.int64)
    for i in prange(n_rows):
        c = 0
        qp = query_positions[i]
        for p in range(indptr[i], indptr[i + 1]):
            if key_positions[indices[p]] <= qp:
                c += 1
        counts[i] = c
    new_ptr = indptr_from_counts(counts)
    out = np.empty(new_ptr[n_rows], dtype=np.int32)
    for i in prange(n_rows):
        w = new_ptr[i]
        qp = query_positions[i]
        for p in range(indptr[i], indptr[i + 1]):
            if key_positions[indices[p]] <= qp:
                out[w] = indices[p]
                w += 1
    return new_ptr, out


PARALLEL_MIN_WORK = 1 << 16  # elements touched below which the serial variant is faster


def _variants(impl):
    return serial_and_parallel(impl)


_VARIANTS = {
    "canonicalize_rows": _variants(_canonicalize_rows_impl),
    "from_padded": _variants(_from_padded_impl),
    "band": _variants(_band_impl),
    "union2": _variants(_union2_impl),
    "filter_by_position": _variants(_filter_by_position_impl),
}


def _pick(name: str, work: int):
    serial, parallel = _VARIANTS[name]
    return parallel if work > PARALLEL_MIN_WORK and numba.get_num_threads() > 1 else serial


def canonicalize_rows(indptr, indices):
    """Sort each row and drop duplicates; returns a new (indptr, indices)."""
    return _pick("canonicalize_rows", indices.shape[0])(indptr, indices)


def from_padded(ids, n_keys):
    """CSR from an (L, k) id matrix with -1 = no key; returns (indptr, indices, bad_row, bad_value)."""
    return _pick("from_padded", ids.size)(ids, n_keys)


def band(n_rows, n_keys, centers, before, after, dilation):
    """Row i selects keys centers[i] + t*dilation for t in [-before, after], clipped to [0, n_keys)."""
    work = n_rows * min(before + after + 1, n_keys + 1)
    return _pick("band", work)(n_rows, n_keys, centers, before, after, dilation)


def union2(ptr_a, idx_a, ptr_b, idx_b):
    """Row-wise sorted merge of two canonical CSR patterns with the same number of rows."""
    return _pick("union2", idx_a.shape[0] + idx_b.shape[0])(ptr_a, idx_a, ptr_b, idx_b)


def filter_by_position(indptr, indices, query_positions, key_positions):
    """Keep key j in row i only when key_positions[j] <= query_positions[i] (causal filtering)."""
    return _pick("filter_by_position", indices.shape[0])(indptr, indices, query_positions, key_positions)
