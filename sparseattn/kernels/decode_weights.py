"""Heavy-hitter statistics of the decode cache (the ``"h2o"`` memory cap): each read key's softmax weight
added to a per-slot total, replaying the ranges the decode kernel (:mod:`sparseattn.kernels.decode`)
recorded."""

from __future__ import annotations

import numpy as np
from numba import prange

from .intrinsics import exp_shifted_f32
from .options import FASTMATH, serial_and_parallel
from .storage import widen_bf16, widen_f16

__all__ = ["accumulate_parallel", "accumulate_parallel_bf16", "accumulate_serial", "accumulate_serial_bf16"]

CHUNK = 128  # as the decode kernel: keys scored per exp call
BF16 = False  # compile-time constant: True in the bfloat16 variants below


def _accumulate_rows(q, qpos, rep, K, pos, rec, n_rec, lse, scale, weights):
    """Add each key's softmax weight to ``weights[g, slot]`` (float64), replaying the ranges the decode
    kernel recorded: for row r = (h, t), every slot j of ``rec[r, :n_rec[r]]`` visible to the row (same
    masks as the kernel) gets ``exp(scale * q[h, t] . K[g, j] - lse[h, t])`` (float32 scores and exp, in
    chunks of ``CHUNK`` as in the kernel).  Parallel over kv heads (each head's totals are written by one
    thread); rows with a non-finite lse add nothing."""
    T = q.shape[1]
    E = q.shape[2]
    H = q.shape[0]
    for g in prange(weights.shape[0]):
        Kg = K[g]
        pg = pos[g]
        wg = weights[g]
        sc = np.empty(CHUNK, dtype=np.float32)
        for h in range(g * rep, min((g + 1) * rep, H)):
            for t in range(T):
                r = h * T + t
                m = lse[h, t]
                if not (m > -np.inf and m < np.inf):
                    continue
                qi = q[h, t]
                qp = qpos[t]
                for i in range(n_rec[r]):
                    b = rec[r, i, 1]
                    lim = rec[r, i, 2]
                    start = rec[r, i, 0]
                    while start < b:
                        stop = min(start + CHUNK, b)
                        n = stop - start
                        for j in range(start, stop):
                            kj = Kg[j]
                            s = np.float32(0.0)
                            for e in range(E):
                                s += qi[e] * (widen_bf16(kj[e]) if BF16 else widen_f16(kj[e]))
                            p = pg[j]
                            sc[j - start] = -np.inf if (p > qp or p >= lim) else s * scale
                        exp_shifted_f32(sc, n, m, sc)
                        for u in range(n):
                            wg[start + u] += sc[u]
                        start = stop


accumulate_serial, accumulate_parallel = serial_and_parallel(_accumulate_rows, fastmath=FASTMATH)
accumulate_serial_bf16, accumulate_parallel_bf16 = serial_and_parallel(
    _accumulate_rows, constants={"BF16": True}, suffix="_bf16", fastmath=FASTMATH)


