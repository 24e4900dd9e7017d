"""Tail estimate of a :class:`sparseattn.KVCache` decode step: the keys the step did not read, from a sample.

The estimator is the one of :mod:`sparseattn.attention.tail`, applied to the cache's slot layout.  For row
``r = h * T + t`` (query head h, token t at position ``qpos[t]``, kv head ``g = h // rep``) the *visible*
keys are the slots ``j < n_slots`` of kv head g with ``pos[g, j] <= qpos[t]`` (evicted slots carry the
position ``EVICTED`` and are never visible); the step's kernel read the set ``P`` of them (its recorded
slot ranges), leaving the unread set ``U`` with ``u = |U| = visible - read``.  A uniform sample of
``m' = min(m, u)`` keys of ``U`` without replacement gives the Horvitz-Thompson estimates

    N̂_U = (u / m') Σ_{j∈sample} exp(s_j) v_j,        D̂_U = (u / m') Σ_{j∈sample} exp(s_j)

(``s_j = scale * q·k_j``), unbiased for ``N_U = Σ_{j∈U} exp(s_j) v_j`` and ``D_U = Σ_{j∈U} exp(s_j)``.  The
output ``(N_P + N̂_U) / (D_P + D̂_U)`` is a ratio estimator: consistent, with a bias of order ``1/m'``, and
exact when ``m' = u`` (the whole rest is read with weight 1).  The returned lse ``log(D_P + D̂_U)`` is
unbiased in ``exp``.  With ``shrink = c > 0`` the tail's weight is multiplied by ``ESS / (ESS + c)``
(``ESS`` of the sampled weights ``exp(s_j)``, :func:`sparseattn.attention.tail.shrink_log_weights`) on
rows that sample part of their tail (``m' < u``; a row reading its whole tail stays exact): biased towards
a zero tail, lower error where a few sampled keys dominate.

The sampled part is attended on its own (normalised output and lse, in float64), its lse shifted by
``log(u / m')`` (and the shrink factor), and merged with the step's exact part by the one log-sum-exp merge
(the kernel of :func:`sparseattn.attention.merge.merge_pair`).

Sampling: each row has its own SplitMix64 stream seeded by ``(tail.seed, h, qpos[t])`` only, so the draw
does not depend on thread count, on which other heads or tokens share the call, or on call batching.  When
``U`` is a large part of the slots (``4u >= n_slots`` and ``2m' <= u``) slots are drawn uniformly from
``[0, n_slots)`` and rejected when not visible, read or already drawn (a large cache reading a few per cent
of its keys: a few draws per sample, no pass over the cache); otherwise ``U`` is enumerated and ``m'`` of
its members drawn by Floyd's algorithm.  Both give every ``m'``-subset of ``U`` the same probability.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import prange

from ..inputs import overflow_message
from ..kernels.options import serial_and_parallel
from ..kernels.sample import GOLDEN, floyd_sample, mix64, uniform_below
from ..pattern import SparsePattern
from .merge import merge_parts
from .tail import Tail, as_tail, shrink_log_weights

__all__ = ["cache_tail"]

#: Slots scanned (rows that enumerate their unread set x slots) from which the sampling kernel runs in
#: parallel; a decode step (rejection sampling, a few hundred draws per row) stays serial.
PARALLEL_MIN_SCAN = 1 << 22


def _sample_rows(pos, n_slots, qpos, rep, rec, n_rec, u, m_rows, enum, seed, idx, found):
    """Draw each row's sample of its unread visible slots.

    pos (H_kv, cap) int32 slot positions; n_slots: slots in use; qpos (T,) int64; rep: query heads per kv
    head; rec (R, n_ranges, 3) int64 and n_rec (R,) int64: the ranges each row scored (slot j of
    ``[first, stop)`` was read iff ``pos <= qpos[t]`` and ``pos < lim``); u (R,) int64 unread visible keys;
    m_rows (R,) int64 samples per row (``min(m, u)``); enum (R,) bool: enumerate the unread set (else
    rejection sampling over ``[0, n_slots)``); seed int64.  Writes idx (R, m) int64: row r's sampled
    slots, ascending, in ``idx[r, :m_rows[r]]``, and found (R,) int64: the unread visible keys an
    enumerating row counted (``u[r]`` unless the recorded ranges disagree with the keys read; -1 for rows
    that drew by rejection, -2 for one whose draws ran out: its unread set is smaller than ``u[r]``).
    """
    R = m_rows.shape[0]
    T = qpos.shape[0]
    for r in prange(R):
        mi = m_rows[r]
        if mi == 0:
            continue
        h = r // T
        t = r - h * T
        g = h // rep
        qp = qpos[t]
        pg = pos[g]
        state = mix64(mix64(np.uint64(seed) * GOLDEN + np.uint64(h)) ^ (np.uint64(qp) * GOLDEN))
        picks = idx[r]
        if enum[r]:
            read = np.zeros(n_slots, dtype=np.bool_)
            for i in range(n_rec[r]):
                lim = rec[r, i, 2]
                for j in range(rec[r, i, 0], rec[r, i, 1]):
                    if pg[j] <= qp and pg[j] < lim:
                        read[j] = True
            members = np.empty(u[r], dtype=np.int64)
            n = 0
            for j in range(n_slots):
                if pg[j] <= qp and not read[j]:
                    if n < members.shape[0]:
                        members[n] = j
                    n += 1
            found[r] = n
            if n != members.shape[0]:
                continue  # inconsistent with the keys read: the caller raises
            if mi >= n:
                for c in range(n):
                    picks[c] = members[c]
                continue
            ranks = np.empty(mi, dtype=np.int64)
            state = floyd_sample(state, n, mi, ranks)
            ranks.sort()
            for c in range(mi):
                picks[c] = members[ranks[c]]
        else:
            k = 0
            budget = 64 * (mi + 16) + 4 * n_slots  # draws; far beyond what 4u >= n_slots, 2m' <= u need
            while k < mi:
                budget -= 1
                if budget < 0:
                    found[r] = -2  # the unread set is smaller than u says: refused by the caller
                    break
                state, j = uniform_below(state, n_slots)
                p = pg[j]
                if p > qp:
                    continue  # not visible (later or evicted)
                hit = False
                for i in range(n_rec[r]):
                    if rec[r, i, 0] <= j < rec[r, i, 1] and p < rec[r, i, 2]:
                        hit = True
                        break
                if hit:
                    continue
                for c in range(k):
                    if picks[c] == j:
                        hit = True
                        break
                if not hit:
                    picks[k] = j
                    k += 1
            picks[:mi].sort()


_sample_serial, _sample_parallel = serial_and_parallel(_sample_rows)


def _draw(cache: Any, qpos: np.ndarray, rec: np.ndarray, n_rec: np.ndarray, u: np.ndarray, m_rows: np.ndarray,
          seed: int, rep: int) -> np.ndarray:
    """(R, max m') int64: each row's sampled unread visible slots (:func:`_sample_rows`), checked against
    the keys read."""
    store = cache.store
    n_slots = int(store.slots)
    R = m_rows.shape[0]
    m = int(m_rows.max())  # scratch sized by the samples drawn, not by the request (which may exceed the keys)
    enum = ~((4 * u >= n_slots) & (2 * m_rows <= u))
    idx = np.full((R, m), -1, dtype=np.int64)
    found = np.full(R, -1, dtype=np.int64)
    scan = int(np.count_nonzero(enum & (m_rows > 0))) * n_slots
    par = cache.parallel if cache.parallel is not None else scan >= PARALLEL_MIN_SCAN
    (_sample_parallel if par else _sample_serial)(
        store.pos, n_slots, np.ascontiguousarray(qpos, dtype=np.int64), rep, rec,
        np.ascontiguousarray(n_rec, dtype=np.int64), u, m_rows, enum, seed, idx, found)
    bad = np.flatnonzero(((found >= 0) & (found != u)) | (found == -2))
    if bad.size:
        r = int(bad[0])
        have = "fewer" if found[r] == -2 else str(int(found[r]))
        raise RuntimeError(f"cache_tail: row {r} has {have} unread visible keys by its recorded slot ranges "
                           f"but {int(u[r])} by the keys read (nread); the step's rec/n_rec and nread "
                           f"disagree (a KVCache bug, please report).")
    return idx


def cache_tail(cache: Any, q: np.ndarray, qpos: np.ndarray, out: np.ndarray, lse: np.ndarray,
               rec: np.ndarray, n_rec: np.ndarray, nread: np.ndarray, tail: Tail | int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add the sampled tail estimate of the keys a :class:`~sparseattn.KVCache` step did not read.

    Parameters
    ----------
    cache : KVCache
        The cache the step ran on (its state unchanged since); read through its public surface
        (``cache.store``: slot positions, keys and values; ``scale``, ``parallel``, head counts).
    q : (H, T, E) float32, C-contiguous
        The step's queries; row ``r = h * T + t``.
    qpos : (T,) int64
        Position of each query token.
    out : (H, T, Ev) float32; lse : (H, T) float32
        The step's exact part: output and natural log-sum-exp of the scaled scores of the keys it read
        (``-inf``: it read none).
    rec : (R, n_ranges, 3) int64; n_rec : (R,) int64
        Slot ranges ``(first, stop, lim)`` each row scored (``R = H * T``); slot j of a range was read iff
        ``pos[g, j] <= qpos[t]`` and ``pos[g, j] < lim``.
    nread : (R,) int64
        Keys each row read.
    tail : Tail or int
        Samples per row ``m``, seed and shrink (an int is ``Tail(samples)``).

    Returns
    -------
    out : (H, T, Ev) float32
        ``(N_P + N̂_U) / (D_P + D̂_U)`` per row (the module docstring); rows with ``u = 0`` unchanged.
    lse : (H, T) float32
        ``log(D_P + D̂_U)`` (the tail term times the shrink factor when ``shrink > 0`` and ``m' < u``).
    n_tail : (R,) int64
        Keys sampled per row, ``m' = min(m, u)``.

    Raises
    ------
    TypeError, ValueError
        ``tail`` not a valid :class:`~sparseattn.attention.tail.Tail` / positive int; mismatched shapes;
        a sampled score overflowing float32.
    """
    tail = as_tail(tail)
    if tail is None:
        raise TypeError("tail must be an int (samples per query) or sparseattn.Tail(samples, seed); got None.")
    H, T, E = q.shape
    R = H * T
    Ev = out.shape[-1]
    if out.shape != (H, T, Ev) or lse.shape != (H, T) or qpos.shape != (T,) or nread.shape != (R,) \
            or n_rec.shape != (R,) or rec.ndim != 3 or rec.shape[0] != R:
        raise ValueError(f"cache_tail: inconsistent shapes q {q.shape}, qpos {qpos.shape}, out {out.shape}, "
                         f"lse {lse.shape}, rec {rec.shape}, n_rec {n_rec.shape}, nread {nread.shape}; pass "
                         f"the step's arrays from KVCache.debug_step(..., record=True).")
    store = cache.store
    rep = cache.num_heads // cache.num_kv_heads
    h_of = np.arange(R, dtype=np.int64) // T
    t_of = np.arange(R, dtype=np.int64) % T
    g_of = h_of // rep
    u = np.maximum(store.visible_counts(qpos)[g_of, t_of] - np.asarray(nread, dtype=np.int64), 0)
    m = int(tail.samples)
    m_rows = np.minimum(u, m).astype(np.int64)
    n_tail = m_rows.copy()
    if not m_rows.any():
        return out, lse, n_tail
    idx = _draw(cache, qpos, rec, n_rec, u, m_rows, int(tail.seed), rep)
    m = idx.shape[1]
    # score the sampled keys, all rows at once: flat list of (row, slot)
    live = np.arange(m)[None, :] < m_rows[:, None]
    rows = np.repeat(np.arange(R), m_rows)
    slots = idx[live]
    kd = store.decode(store.K[g_of[rows], slots]).astype(np.float64)  # (total, E)
    vd = store.decode(store.V[g_of[rows], slots]).astype(np.float64)  # (total, Ev)
    q2 = q.reshape(R, E)
    s = np.einsum("ne,ne->n", kd, q2[rows].astype(np.float64)) * float(cache.scale)
    has = m_rows > 0
    counts = m_rows[has]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    mx = np.maximum.reduceat(s, starts)
    w = np.exp(s - np.repeat(mx, counts))
    den = np.add.reduceat(w, starts)
    num = np.add.reduceat(w[:, None] * vd, starts, axis=0)
    out_u = np.zeros((R, Ev), dtype=np.float64)
    lse_u = np.full(R, -np.inf, dtype=np.float64)
    out_u[has] = num / den[:, None]
    lse_u[has] = mx + np.log(den) + np.log(u[has] / counts)
    if tail.shrink > 0:
        indptr = np.concatenate(([0], np.cumsum(m_rows))).astype(np.int64)
        sampled = SparsePattern(indptr, np.arange(rows.size, dtype=np.int32), rows.size, validate=False)
        zero = np.zeros(1, dtype=np.int64)
        shrunk = shrink_log_weights(q2[None], kd[None], zero, zero, float(cache.scale), [sampled],
                                    float(tail.shrink))[0]
        lse_u += np.where(u > m_rows, shrunk, 0.0)  # a row that read its whole tail stays exact
    # the one log-sum-exp merge (merge_pair's kernel, without its input validation: arrays are ours)
    o64, l64 = merge_parts((out.reshape(R, Ev), out_u), np.stack([lse.reshape(R), lse_u]), np.dtype(np.float64))
    new_out = o64.astype(np.float32)
    new_lse = l64.astype(np.float32)
    if np.isposinf(new_lse).any() or not np.isfinite(new_out).all():
        raise ValueError(overflow_message(np.float32, cache.scale))
    keep = ~has  # rows without a tail: exactly the step's result
    new_out[keep] = out.reshape(R, Ev)[keep]
    new_lse[keep] = lse.reshape(R)[keep]
    return new_out.reshape(H, T, Ev), new_lse.reshape(H, T), n_tail
