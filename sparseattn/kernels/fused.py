"""Fused sparse attention kernel: scores -> stable softmax -> weighted sum of values, one row at a time.

Rows of all (batch, head) groups are flattened to ``G * L`` and split into chunks over ``prange``; each
chunk owns its scratch buffers.  Per row:

1. scores of the selected keys (``q . k * scale`` plus an optional bias b(i, j)) and their maximum, while
   prefetching the key rows a few pairs ahead and the value rows for step 3;
2. ``exp(score - max)`` over the row in one vectorisable loop (float32: a polynomial exp; float64:
   ``np.exp`` for full precision);
3. the weighted sum of the value rows, one division.

Two passes over the row's keys instead of an online rescale per key: cheaper for the short rows sparse
attention has (a single online pass measured slower).  The parallel and serial variants are compiled from
the same Python function; each row is computed by one thread in a fixed order, so both give bit-identical
results.

Special rows (the caller applies :func:`sparseattn.inputs.check_lse` to ``lse``):

* no key, or only ``-inf`` scores (masked): zeros and ``lse = -inf``;
* some score ``+inf`` (finite inputs overflowed the dtype): NaN output and ``lse = +inf``;
* some score NaN (``inf - inf`` inside an overflowing dot product, or NaN inputs): NaN output and
  ``lse = NaN``.  NaN scores need an explicit scan: ``s > m`` is false for NaN, so the running maximum
  skips them, and the float32 polynomial exp maps NaN to 0; unscanned, such a row would come out as an
  empty row (zeros) or as an average that silently ignores the overflowed keys.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .bias import bias_value
from .intrinsics import exp_shifted_f32, prefetch_row
from .options import FASTMATH, serial_and_parallel

PREFETCH_DISTANCE = 4  # pairs ahead: measured best of 2/4/8 on random patterns at n = 65,536
HAS_BIAS = True  # compile-time constant: the no-bias variants below prune the bias code entirely


def _fused_rows(q, k, v, q_map, kv_map, indptr, indices, shared, scale, max_nnz, chunk,
                bias_kind, bias_params, bias_ints, qpos, kpos, bias_dense, bias_map, n_bias_heads,
                out, lse, fast_exp):
    G = q_map.shape[0]
    L = q.shape[1]
    E = q.shape[2]
    Ev = v.shape[2]
    n_rows = G * L
    n_chunks = (n_rows + chunk - 1) // chunk
    nnz_total = indices.shape[0]
    for c in prange(n_chunks):
        width = max(max_nnz, 1)
        scratch = np.empty(width, dtype=out.dtype)
        acc = np.zeros(max(Ev, 1), dtype=out.dtype)
        zero = np.zeros(1, dtype=out.dtype)
        r_end = min((c + 1) * chunk, n_rows)
        for r in range(c * chunk, r_end):
            g = r // L
            i = r - g * L
            pr = i if shared else r
            a = indptr[pr]
            b = indptr[pr + 1]
            qi = q[q_map[g], i]
            kg = k[kv_map[g]]
            vg = v[kv_map[g]]
            h = g % n_bias_heads
            m = -np.inf
            for p in range(a, b):
                if p + PREFETCH_DISTANCE < nnz_total:
                    prefetch_row(kg, indices[p + PREFETCH_DISTANCE])
                j = indices[p]
                prefetch_row(vg, j)
                kj = kg[j]
                s = zero[0]
                for e in range(E):
                    s += qi[e] * kj[e]
                s = s * scale
                if HAS_BIAS and bias_kind != 0:
                    s += bias_value(bias_kind, g, h, i, j, qpos, kpos, bias_params, bias_ints,
                                    bias_dense, bias_map)
                scratch[p - a] = s
                if s > m:
                    m = s
            n = b - a
            # NaN scores: the running maximum skips them, and so does the float32 exp (NaN -> 0); np.exp
            # propagates them into the sum, so with a finite maximum float64 needs no scan.  The scan
            # is a vectorised pass over the row's n scores, off the gather-bound score loop.
            has_nan = False
            if fast_exp or m == -np.inf:
                for t in range(n):
                    has_nan |= scratch[t] != scratch[t]
            if m == np.inf or has_nan:  # overflow (or NaN input): flagged, the caller raises
                for e in range(Ev):
                    out[g, i, e] = np.nan
                lse[g, i] = np.inf if m == np.inf else np.nan
                continue
            if n > 0 and m == -np.inf:
                # Every score is -inf.  A -inf bias forbids a pair (an empty row), but a product q.k that
                # overflowed to -inf hides which key dominates: recheck the raw products (a rare path).
                for p in range(a, b):
                    kj = kg[indices[p]]
                    s = zero[0]
                    for e in range(E):
                        s += qi[e] * kj[e]
                    if s * scale == -np.inf:
                        m = np.inf
                if m == np.inf:  # overflow: flagged, the caller raises
                    for e in range(Ev):
                        out[g, i, e] = np.nan
                    lse[g, i] = np.inf
                    continue
            if n == 0 or m == -np.inf:
                for e in range(Ev):
                    out[g, i, e] = 0.0
                lse[g, i] = -np.inf
                continue
            if fast_exp:
                exp_shifted_f32(scratch, n, m, scratch)
            else:
                for t in range(n):
                    scratch[t] = np.exp(scratch[t] - m)
            for e in range(Ev):
                acc[e] = 0.0
            total = zero[0]
            for p in range(a, b):
                w = scratch[p - a]
                total += w
                vj = vg[indices[p]]
                for e in range(Ev):
                    acc[e] += w * vj[e]
            inv = 1.0 / total
            for e in range(Ev):
                out[g, i, e] = acc[e] * inv
            lse[g, i] = m + np.log(total)


fused_serial, fused_parallel = serial_and_parallel(_fused_rows, fastmath=FASTMATH)
# Without a bias (the common case) the kernel is smaller: faster to compile (first call) and to run.
fused_serial_nobias, fused_parallel_nobias = serial_and_parallel(
    _fused_rows, fastmath=FASTMATH, constants={"HAS_BIAS": False}, suffix="_nobias")
