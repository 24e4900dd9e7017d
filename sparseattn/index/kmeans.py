"""The build steps of :class:`~sparseattn.index.cluster.ClusterIndex` as functions over plain arrays:
k-means training (FAISS), key assignment, splitting of oversized clusters, chunked row work and the
per-cluster covariance factors.  The index object holds the state; these hold none.

Threads: the assignment products run on ``n_threads`` workers of :func:`sparseattn.threads.run_jobs`,
BLAS pinned to one thread each by the caller (:func:`sparseattn.threads.worker_threads`).  The k-means
runs single-threaded: FAISS's OpenMP pool is set to 1 thread for it and restored afterwards (0.023 s
against 0.40 s on two threads with the other core busy, 16k keys).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..kernels import cluster as ck
from ..threads import run_jobs, worker_threads

__all__ = ["BLOCK_BUDGET", "SEED_MAX", "assign_keys", "cov_factors", "row_chunks", "split_every", "split_large", "train_kmeans"]

# Elements (not bytes) of the per-block buffers: queries are processed in blocks so the score chunks and
# the top-k candidate lists stay near 2**24 elements (64 MiB in float32).
BLOCK_BUDGET = 1 << 24
SEED_MAX = 2**31 - 1  # FAISS's k-means takes its seed as a C int


def train_kmeans(centred: np.ndarray, C: int, n_train: int, *, seed: int, n_iter: int,
                 spherical: bool) -> np.ndarray:
    """(C, E) centroids of a k-means over ``n_train`` rows of ``centred`` (S, E) sampled with ``seed`` (all
    rows when ``n_train >= S``); spherical = unit-norm centroids (float32), cosine assignment; else float64
    (the keys' scale may lie outside float32's range)."""
    import faiss

    S, E = centred.shape
    rng = np.random.default_rng(seed)
    sample = centred if n_train >= S else centred[np.sort(rng.choice(S, n_train, replace=False))]
    # FAISS trains in float32: keys of very small (or large) magnitude are scaled by a power of two to an
    # RMS norm near 1 first (their squared norms underflowed to 0 at 1e-30, and spherical centroids
    # became NaN), and Lloyd centroids scaled back (spherical ones are unit vectors either way).
    sq = np.einsum("ij,ij->i", sample, sample, dtype=np.float64)
    if not np.isfinite(sq).all():  # FAISS would raise from inside its C++ (or train on garbage)
        raise ValueError("keys must be finite to be clustered; NaN or Inf found (or squared norms beyond float64: "
                         "rescale the keys). Check the keys before building the index.")
    rms = float(np.sqrt(np.mean(sq))) if sample.size else 0.0
    scale = 2.0 ** round(np.log2(rms)) if rms > 0 and np.isfinite(rms) else 1.0
    sample = np.ascontiguousarray(sample / scale, dtype=np.float32)
    if C == 1:
        cent = sample.mean(axis=0, keepdims=True)
        if spherical:
            cent /= max(float(np.linalg.norm(cent)), 1e-30)
            return cent
        return cent * scale
    with _faiss_training(faiss), worker_threads(1):
        km = faiss.Kmeans(E, C, niter=n_iter, seed=seed, spherical=spherical, verbose=False,
                          max_points_per_centroid=1 << 30, min_points_per_centroid=1)
        km.train(sample)
    cent = np.asarray(km.centroids, dtype=np.float32).reshape(C, E)
    return cent if spherical else cent.astype(np.float64) * scale


_training_lock = threading.Lock()
_training_count = 0
_training_saved = 0


@contextmanager
def _faiss_training(faiss: Any) -> Iterator[None]:
    """FAISS's settings for a k-means on this thread.

    * One OpenMP thread, whatever n_threads: with the other core busy, FAISS's k-means took 0.40 s on 2
      threads against 0.023 s on 1 (16k x 64 sample, 128 centroids): its many short parallel regions spin
      at barriers.  Set before pinning BLAS: FAISS's OpenBLAS follows the OpenMP setting.  OpenMP's thread
      count is a setting of the calling thread, so each k-means sets (and restores) its own: when only the
      first of several concurrent ones set it, the others ran on every core and their centroids depended on
      the threads' summation order (k-means from four Python threads at once differed from sequential
      ones in 1-2 of 8 builds).
    * BLAS for the assignment step at every size: with FAISS's default threshold (128,000) smaller
      training sets went through its SIMD loop, 3x slower (2,048 x 32 points, 128 centroids, 10
      iterations, one thread: 12.3 ms against 4.1 ms; the same time from 4,096 points up).  This one is
      process-wide: set by the first of concurrent k-means and restored when the last ends (a per-call save
      and restore let two overlapping ones leave the first one's setting behind for good).
    """
    global _training_count, _training_saved
    with _training_lock:
        if _training_count == 0:
            _training_saved = faiss.cvar.distance_compute_blas_threshold
            faiss.cvar.distance_compute_blas_threshold = 20
        _training_count += 1
    omp = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(omp)
        with _training_lock:
            _training_count -= 1
            if _training_count == 0:
                faiss.cvar.distance_compute_blas_threshold = _training_saved


def row_chunks(n_rows: int, n_cols: int, work: Callable[[int, int], None], n_threads: int) -> None:
    """``work(a, b)`` over row chunks of about 2**24 score elements (rows x ``n_cols``), on the workers.

    Why not one big product: BLAS is pinned to one thread, so the (rows x C) scoring GEMM and its
    serial argmax / top-p kernel run chunk-parallel on the workers (at S = 262,144, C ~ 900 this
    halves the 0.27 s of one product); chunks also bound the score buffer.
    """
    block = max(1, BLOCK_BUDGET // (4 * n_cols))
    n_chunks = -(-n_rows // block)
    per = max(1, -(-n_rows // max(n_chunks, 2 * n_threads)))
    per = min(per, block)
    chunks = [(a, min(n_rows, a + per)) for a in range(0, n_rows, per)]
    run_jobs(lambda t: work(*chunks[t]), range(len(chunks)), n_threads)


def assign_keys(centred: np.ndarray, centroids: np.ndarray, rule: str, n_threads: int) -> np.ndarray:
    """Cluster of each (centred) key (S, E): argmax of k.c (``rule="ip"``) or the nearest centroid
    (``"l2"``) among ``centroids`` (C, E); (S,) int32.  Call inside ``worker_threads``."""
    S = centred.shape[0]
    bias = None
    if rule == "l2":
        bias = (-0.5 * (centroids.astype(np.float64) ** 2).sum(axis=1)).astype(centred.dtype)
    assignment = np.empty(S, dtype=np.int32)
    cent = centroids.astype(centred.dtype, copy=False)

    def work(a: int, b: int) -> None:
        sc = centred[a:b] @ cent.T
        if bias is not None:
            sc += bias
        assignment[a:b] = ck.row_argmax_serial(sc)

    row_chunks(S, cent.shape[0], work, n_threads)
    return assignment


def split_large(centred: np.ndarray, assignment: np.ndarray, centroids: np.ndarray, cap: float,
                target: float, kmeans: Callable[[np.ndarray, int, int, int], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split every cluster of more than ``cap`` keys into ``ceil(size / target)`` parts.

    Why: inner-product assignment favours centroids of large norm (the hull of the centroid set),
    so a few clusters collect many keys (at S = 65,536 on clustered keys the largest held 9x the
    mean), and a query's attention cost is the size of its routed clusters.  A member k-means
    (Euclidean) splits such a cluster into compact parts; members go to their nearest part (a
    global inner-product re-assignment would pull them back into one part).

    ``kmeans(rows, parts, n_train, seed_offset)`` trains the parts.  Returns (assignment (S,) int32,
    centroids (C', E) with the parts replacing the split clusters, parent (C',) int64: the cluster each
    final cluster came from), or the inputs (parent = identity) when nothing is larger than ``cap``.
    """
    sizes = np.bincount(assignment, minlength=centroids.shape[0])
    big = np.flatnonzero(sizes > cap)
    if big.size == 0:
        return assignment, centroids, np.arange(centroids.shape[0], dtype=np.int64)
    keep = np.setdiff1d(np.arange(sizes.size), big)
    new_id = np.full(sizes.size, -1, dtype=np.int64)
    new_id[keep] = np.arange(keep.size)
    out = new_id[assignment].astype(np.int32)
    cents, parents = [centroids[keep]], [keep]
    nxt = keep.size
    # One stable sort gives every cluster's member rows (ascending), instead of an O(S) scan per
    # split cluster (hundreds of them at S = 262,144).
    order = np.argsort(assignment, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)))
    for c in big:
        rows = order[starts[c]:starts[c + 1]]
        members = centred[rows]
        parts = int(min(np.ceil(sizes[c] / target), rows.size))
        sub = kmeans(members, parts, min(rows.size, 64 * parts), 1 + int(c)).astype(centred.dtype)
        half_sq = 0.5 * (sub.astype(np.float64) ** 2).sum(axis=1)
        out[rows] = nxt + ck.row_argmax(members @ sub.T - half_sq.astype(centred.dtype))  # nearest part
        cents.append(sub)
        parents.append(np.full(parts, c, dtype=np.int64))
        nxt += parts
    return out, np.ascontiguousarray(np.concatenate(cents)), np.concatenate(parents)


def split_every(centred: np.ndarray, assignment: np.ndarray, n_coarse: int, target: float, n_iter: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split every cluster of ``assignment`` into parts of about ``target`` keys: the second level of a
    two-level build (``ClusterIndex(coarse=...)``).

    centred (S, E) keys, assignment (S,) int in [0, n_coarse), target > 0.  Cluster c of m keys gets
    ``ceil(m / target)`` parts (at most m), found by a Lloyd k-means of its members (``n_iter`` rounds,
    all clusters at once: :func:`~sparseattn.kernels.cluster.split_members`).  Returns (assignment (S,)
    int32 of the parts, centroids (P, E) in centred's dtype: the part means, parent (P,) int64: the
    cluster each part came from); parts without members are dropped.

    Why not :func:`split_large` on every cluster: it runs one FAISS k-means per cluster (about 0.4 ms each
    here, 100 ms for 256 clusters at S = 65,536); one compiled loop over all clusters takes a few ms.
    """
    S, E = centred.shape
    sizes = np.bincount(assignment, minlength=n_coarse).astype(np.int64)
    order = np.argsort(assignment, kind="stable").astype(np.int64)
    kptr = np.zeros(n_coarse + 1, dtype=np.int64)
    np.cumsum(sizes, out=kptr[1:])
    kp = np.empty((S, E), dtype=centred.dtype)
    ck.gather_rows(np.ascontiguousarray(centred), order, kp)
    parts = np.clip(np.ceil(sizes / float(target)), 1, np.maximum(sizes, 1)).astype(np.int64)
    pptr = np.zeros(n_coarse + 1, dtype=np.int64)
    np.cumsum(parts, out=pptr[1:])
    labels = np.empty(S, dtype=np.int64)
    cent = np.empty((int(pptr[-1]), E), dtype=np.float64)
    ck.split_members(kp, kptr, parts, pptr, int(n_iter), labels, cent)
    keep = np.bincount(labels, minlength=cent.shape[0]) > 0
    new_id = np.cumsum(keep) - 1
    out = np.empty(S, dtype=np.int32)
    out[order] = new_id[labels]
    parent = np.repeat(np.arange(n_coarse, dtype=np.int64), parts)[keep]
    return out, np.ascontiguousarray(cent[keep], dtype=centred.dtype), parent


def cov_factors(kp: np.ndarray, kptr: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Low-rank-plus-isotropic factors of each cluster's key covariance.

    kp (S, E) keys in cluster order, kptr (C + 1,) int64 cluster offsets.  With ``Sigma_c`` the
    covariance of cluster c's keys and ``lam_1 >= ... >= lam_E`` its eigenvalues (eigenvectors
    ``u_k``), returns ``W`` (C * r, E) float64, rows ``c * r + k = sqrt(lam_k - rho_c) u_k``
    (k < r = min(rank, E)), and ``rho`` (C,) float64, the mean of the other eigenvalues, so that
    ``q^T Sigma_c q ~= sum_k (W[c r + k] . q)^2 + rho_c |q|^2`` (exact when r = E).  Empty or one-key
    clusters: zeros.
    """
    E = kp.shape[1]
    r = int(min(rank, E))
    C = kptr.shape[0] - 1
    cov = np.zeros((C, E, E), dtype=np.float64)
    for c in range(C):
        a, b = int(kptr[c]), int(kptr[c + 1])
        if b - a > 1:
            x = kp[a:b].astype(np.float64)
            x -= x.mean(axis=0)
            cov[c] = x.T @ x / (b - a)
    lam, vec = np.linalg.eigh(cov)  # ascending
    lam = np.maximum(lam, 0.0)
    top, rest = lam[:, E - r:], lam[:, :E - r]
    rho = rest.mean(axis=1) if r < E else np.zeros(C)
    W = vec[:, :, E - r:] * np.sqrt(np.maximum(top - rho[:, None], 0.0))[:, None, :]  # (C, E, r)
    return np.ascontiguousarray(W.transpose(0, 2, 1).reshape(C * r, E)), rho
