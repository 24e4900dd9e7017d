"""The build steps of :class:`~sparseattn.index.cluster.ClusterIndex` as functions over plain arrays:
k-means training (k-means++ starts, Lloyd rounds of BLAS products and compiled passes), key assignment,
splitting of oversized clusters, chunked row work and the per-cluster covariance factors.  The index object holds the state; these hold none.

Threads: the k-means rounds and the assignment products run on ``n_threads`` workers of
:func:`sparseattn.threads.run_jobs`, BLAS pinned to one thread each (:func:`sparseattn.threads.worker_threads`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..kernels import cluster as ck
from ..threads import run_jobs, worker_threads

__all__ = ["BLOCK_BUDGET", "LLOYD_ELEMS", "LLOYD_ROWS", "SEED_MAX", "SEED_ROWS", "SEED_WORK", "assign_keys",
           "cov_factors", "lloyd", "lloyd_rounds", "row_chunks", "split_every", "split_large", "train_kmeans"]

# Elements (not bytes) of the per-block buffers: queries are processed in blocks so the score chunks and
# the top-k candidate lists stay near 2**24 elements (64 MiB in float32).
BLOCK_BUDGET = 1 << 24
SEED_MAX = 2**31 - 1  # seeds of the k-means of split clusters wrap around below this


def train_kmeans(centred: np.ndarray, C: int, n_train: int, *, seed: int, n_iter: int,
                 spherical: bool, n_threads: int = 1) -> np.ndarray:
    """(C, E) centroids of a k-means over ``n_train`` rows of ``centred`` (S, E) sampled with ``seed`` (all
    rows when ``n_train >= S``); spherical = unit-norm centroids (float32), cosine assignment; else float64
    (the keys' scale may lie outside float32's range).  ``n_iter`` Lloyd rounds (:func:`lloyd`) on
    ``n_threads`` workers; the result does not depend on the thread count."""
    S, E = centred.shape
    rng = np.random.default_rng(seed)
    sample = centred if n_train >= S else centred[np.sort(rng.choice(S, n_train, replace=False))]
    # Lloyd runs in float32: keys of very small (or large) magnitude are scaled by a power of two to an
    # RMS norm near 1 first (their squared norms would underflow to 0 at 1e-30, and spherical centroids
    # become NaN), and Lloyd centroids scaled back (spherical ones are unit vectors either way).
    sq = np.einsum("ij,ij->i", sample, sample, dtype=np.float64)
    if not np.isfinite(sq).all():
        raise ValueError("keys must be finite to be clustered; NaN or Inf found (or squared norms beyond float64: "
                         "rescale the keys). Check the keys before building the index.")
    # The scale as an exponent e (RMS norm ~ 2**e), from the keys divided by a power of two near their
    # largest magnitude (squared norms of keys near 1e-300 underflow to 0 even in float64), applied with
    # ldexp: exact, and no 2**e that float32 cannot hold (2**128 became inf, 2**-150 zero).
    big = float(np.abs(sample).max()) if sample.size else 0.0
    e = 0
    if big > 0:
        eb = int(np.frexp(big)[1])
        unit = np.ldexp(sample, -eb)
        e = eb + round(0.5 * np.log2(np.mean(np.einsum("ij,ij->i", unit, unit, dtype=np.float64))))
    sample = np.ascontiguousarray(np.ldexp(sample, -e), dtype=np.float32)
    if C == 1:
        cent = sample.mean(axis=0, keepdims=True)
        if spherical:
            cent /= max(float(np.linalg.norm(cent)), 1e-30)
            return cent
        return np.ldexp(cent.astype(np.float64), e)
    with worker_threads(n_threads) as n:
        cent = lloyd(sample, C, n_iter, rng, spherical, n)
    return cent if spherical else np.ldexp(cent.astype(np.float64), e)


LLOYD_ROWS = 2048  # most rows per job of a Lloyd round (a split fixed by C, not by the thread count)
LLOYD_ELEMS = 1 << 19  # most score elements per job (2 MiB of float32: the scores stay in L2)
SEED_ROWS = 8  # k-means++ draws its starting centroids from up to SEED_ROWS * C rows of the sample,
SEED_WORK = 1 << 27  # fewer (down to 2 C) where that would cost more than SEED_WORK multiply-adds (rows C E)


def lloyd(x: np.ndarray, C: int, n_iter: int, rng: np.random.Generator, spherical: bool, n_threads: int
          ) -> np.ndarray:
    """(C, E) float32 centroids of ``n_iter`` Lloyd rounds over x (n, E) float32, n >= C >= 1.

    Start: k-means++ (:func:`~sparseattn.kernels.cluster.kmeanspp_seeds`) over ``min(n, 8 C)`` rows drawn
    by ``rng`` (fewer from C = 513 at E = 64, 2 C from C = 1,024: seeding costs rows x C x E, serially),
    unit-normalised first when ``spherical`` so that the draw follows cosine distances.  A round
    assigns each row to the centroid of largest ``x . c`` (spherical: the cosine, centroids being unit
    vectors) or the nearest one (``x . c - |c|^2 / 2``), first one on ties, then moves each centroid to
    its members' mean (float64 sums; normalised when spherical).  A centroid left without members moves
    to one of the rows served worst (smallest best score), a different row for each, as scikit-learn
    relocates empty clusters.  Rows go to the workers in chunks fixed by C (at most ``LLOYD_ROWS`` rows
    and ``LLOYD_ELEMS`` scores); each cluster's members are summed in row order
    (:func:`~sparseattn.kernels.cluster.member_sums`): the same centroids on any thread count, in
    O(n + C E) memory.  Only serial kernels: the k-means may itself run on a worker thread.  Call inside
    :func:`~sparseattn.threads.worker_threads` (BLAS pinned to one thread per worker).

    Why not FAISS's ``Kmeans``: single-threaded here (its OpenMP regions spin when the other core is
    busy), 102-180 ms for the 16,384 x 64 sample and 256 centroids of a 65,536-key build against 39-41 ms
    for this k-means on two workers, at the same objective.  Why k-means++ rather than FAISS's random
    rows: on clustered keys whose groups number about C, random starts put two centroids in one group
    and leave others merged (routing recall@64 0.942-0.972 over six seeds at 65,536 keys against
    0.980-0.995); on MiniLM keys both starts give the same recall within the seeds' spread.
    """
    n, E = x.shape
    m = min(n, max(2 * C, min(SEED_ROWS * C, SEED_WORK // max(C * E, 1))))
    sub = x[np.sort(rng.choice(n, m, replace=False))]
    z = sub.copy()
    if spherical:
        _normalise(z)
    ids = np.empty(C, dtype=np.int64)
    ck.kmeanspp_seeds(z, rng.random(C), ids)
    return lloyd_rounds(x, np.array(sub[ids], dtype=np.float32), n_iter, spherical, n_threads)


def lloyd_rounds(x: np.ndarray, cent: np.ndarray, n_iter: int, spherical: bool, n_threads: int) -> np.ndarray:
    """(C, E) float32 centroids after ``n_iter`` rounds of :func:`lloyd` over x (n, E) float32 from the
    starting centroids cent (C, E) float32 (normalised in place when ``spherical``)."""
    n, E = x.shape
    C = cent.shape[0]
    if spherical:
        _normalise(cent)
    rows = max(1, min(LLOYD_ROWS, LLOYD_ELEMS // C))
    chunks = [(a, min(n, a + rows)) for a in range(0, n, rows)]
    labels = np.empty(n, dtype=np.int32)
    best = np.empty(n, dtype=np.float32)
    total = np.empty((C, E), dtype=np.float64)
    count = np.empty(C, dtype=np.int64)
    for _ in range(n_iter):
        half = (np.zeros(C) if spherical else 0.5 * np.einsum("ij,ij->i", cent, cent, dtype=np.float64)
                ).astype(np.float32)

        def work(t: int, cent: np.ndarray = cent, half: np.ndarray = half) -> None:
            a, b = chunks[t]
            ck.assign_chunk(x[a:b], cent, half, np.empty((b - a) * C, dtype=np.float32), labels[a:b], best[a:b])

        run_jobs(work, range(len(chunks)), n_threads)
        ck.member_sums(x, labels, C, total, count)  # serial: this may run on a worker thread already
        live = count > 0
        new = np.empty((C, E), dtype=np.float64)
        new[live] = total[live] / count[live, None]
        empty = np.flatnonzero(~live)
        if empty.size:  # relocate to the worst-served rows, one each
            new[empty] = x[np.argsort(best, kind="stable")[:empty.size]]
        cent = np.ascontiguousarray(new, dtype=np.float32)
        if spherical:
            _normalise(cent)
    return cent


def _normalise(cent: np.ndarray) -> None:
    """Scale each row of cent (C, E) float32 to unit norm in place (a zero row stays zero)."""
    norm = np.sqrt(np.einsum("ij,ij->i", cent, cent, dtype=np.float64))
    cent /= np.maximum(norm, 1e-30).astype(np.float32)[:, None]


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
    C = centroids.shape[0]
    top = float(np.abs(centroids).max()) if centroids.size else 0.0
    kbig = float(np.abs(centred).max()) if centred.size else 0.0
    if any(x > 0 and not 2.0 ** -30 <= x <= 2.0 ** 30 for x in (top, kbig)):
        # keys or centroids of tiny or huge magnitude (float32 keys near 1e-30 had every product underflow
        # to 0, near 1e38 overflow: every key in cluster 0) are multiplied by powers of two (ldexp: exact,
        # in their dtype) that change no argmax: "ip" scales keys and centroids each to a largest entry
        # near 1 (k.c scaled by a positive factor); "l2" scales both by one factor (k.c - |c|^2 / 2 scaled
        # by 2**-2e), no larger than keeps the largest key finite
        ek, ec = (int(np.frexp(x)[1]) if x > 0 else 0 for x in (kbig, top))
        if rule != "l2":
            centred, centroids = np.ldexp(centred, -ek), np.ldexp(centroids, -ec)
        else:
            e = max(ec, ek - np.finfo(centred.dtype).maxexp + 2)
            centred, centroids = np.ldexp(centred, -e), np.ldexp(centroids, -e)
    half = np.zeros(C) if rule != "l2" else 0.5 * (centroids.astype(np.float64) ** 2).sum(axis=1)
    half = half.astype(centred.dtype)
    assignment = np.empty(S, dtype=np.int32)
    cent = centroids.astype(centred.dtype, copy=False)

    def work(a: int, b: int) -> None:
        ck.assign_chunk(centred[a:b], cent, half, np.empty((b - a) * C, dtype=centred.dtype), assignment[a:b],
                        np.empty(b - a, dtype=centred.dtype))

    row_chunks(S, C, work, n_threads)
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
        out[rows] = nxt + assign_keys(members, sub, "l2", 1)  # nearest part
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

    Why not :func:`split_large` on every cluster: it runs one k-means per cluster (with FAISS's k-means
    then, about 0.4 ms each, 100 ms for 256 clusters at S = 65,536); one compiled loop over all clusters
    takes a few ms.
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
