"""Oracle and data helpers shared by the selector tests (imported as ``from helpers import ...``).

The oracle is ``sparseattn.topk.exact_topk`` (blocked brute force); scores are recomputed here in float64.
"""

from __future__ import annotations

import numpy as np

from sparseattn.pattern import SparsePattern
from sparseattn.topk import exact_topk


def gaussian_qk(rng, L, S, E, dtype=np.float32, mean=0.0):
    """Standard normal queries (L, E) and keys (S, E), the keys shifted by a common ``mean``."""
    q = rng.standard_normal((L, E)).astype(dtype)
    k = (rng.standard_normal((S, E)) + mean).astype(dtype)
    return q, k


def random_causal_problem(seed, L, S, decode, gaps=True, E=3):
    """float32 q (L, E), k (S, E) and positions for property tests.

    Query positions are the last L of S (``decode``) or random in [-2, S + 2); key positions are sorted
    random with repeats and gaps (``gaps``) or ``arange(S)``.
    """
    r = np.random.default_rng(seed)
    q = r.standard_normal((L, E)).astype(np.float32)
    k = r.standard_normal((S, E)).astype(np.float32)
    qpos = np.arange(S - L, S) if decode else r.integers(-2, S + 2, L)
    kpos = np.sort(r.integers(0, S + 2, S)) if gaps else np.arange(S)
    return q, k, qpos, kpos


def recall(p, q, k, kk, **kw):
    """Fraction of the exact top-kk (exact_topk with the same keywords) that the pattern p selects."""
    ref = SparsePattern.from_padded(exact_topk(q, k, kk, **kw)[1], k.shape[0])
    return (p.to_mask() & ref.to_mask()).sum() / ref.nnz


def assert_exact_topk(p, q, k, kk, rtol=1e-5, **kw):
    """Tie-aware: per row, the sorted selected scores equal the exact top-k scores."""
    _, ids = exact_topk(q, k, kk, **kw)
    s = q.astype(np.float64) @ k.astype(np.float64).T
    want_n = (ids >= 0).sum(axis=1)
    np.testing.assert_array_equal(p.nnz_per_row, want_n)
    for i in range(q.shape[0]):
        got = np.sort(s[i, p.row(i)])[::-1]
        want = np.sort(s[i, ids[i, :want_n[i]]])[::-1]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=f"row {i}")


def no_leak(p, qpos, kpos):
    """True when no selected key sits after its query (causal)."""
    return not (p.to_mask() & (kpos[None, :] > qpos[:, None])).any()


def dense64(q, k, v, scale, mask=None):
    """Float64 softmax attention oracle: (L, Ev) output and (L,) lse; ``mask`` (L, S) bool, True = may attend."""
    s = q.astype(np.float64) @ k.astype(np.float64).T * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    z = w.sum(axis=1)
    return (w @ v.astype(np.float64)) / z[:, None], m[:, 0] + np.log(z)


def lsh_bucket_oracle(sel, x):
    """numpy re-implementation of the ``angular-lsh`` selector ``sel``'s concatenated cross-polytope buckets
    of the rows of x: (n_rounds, n) int64."""
    p = sel.params
    half, nh, R = p["n_buckets"] // 2, p["n_hashes"], p["n_rounds"]
    proj = (x @ sel.rotations(x.shape[1], x.dtype)).reshape(x.shape[0], R, nh, half)
    v = np.concatenate([proj, -proj], -1).argmax(-1)  # (n, R, nh)
    weights = p["n_buckets"] ** np.arange(nh - 1, -1, -1, dtype=np.int64)
    return (v * weights).sum(-1).T


def lsh_window_oracle(sel, q, keys, is_causal, qpos, kpos):
    """Pure-Python candidates of the ``angular-lsh`` selector ``sel``: per round sort the keys, place the
    query, take its window; a SparsePattern (L, S)."""
    p = sel.params
    C = p["chunk_size"]
    S = keys.shape[0]
    centred = keys - keys.mean(axis=0, dtype=np.float64).astype(keys.dtype) if p["center"] else keys
    kb, qb = lsh_bucket_oracle(sel, centred), lsh_bucket_oracle(sel, q)
    norms = np.linalg.norm(centred.astype(np.float64), axis=1)
    prefix = np.searchsorted(np.sort(kpos), qpos, side="right")
    rows = []
    for i in range(q.shape[0]):
        found = set()
        for r in range(p["n_rounds"]):
            # Python's sort is stable: by bucket, then -norm (order="norm") or id.
            second = -norms if p["order"] == "norm" else np.zeros(S)
            order = np.array(sorted(range(S), key=lambda j, r=r, second=second: (kb[r, j], second[j])))
            sb = kb[r][order]
            lo, hi = np.searchsorted(sb, qb[r, i], "left"), np.searchsorted(sb, qb[r, i], "right")
            if C == 0:
                a, b = lo, hi
            elif p["order"] == "norm":  # 2C keys from the bucket start, shifted back at the end
                a = min(lo, max(S - 2 * C, 0))
                b = min(a + 2 * C, S)
            else:  # Reformer: the chunk holding the slot and the previous one
                slot = lo + int((order[lo:hi] < prefix[i]).sum())
                c = min(slot, S - 1) // C
                a, b = max((c - 1) * C, 0), min((c + 1) * C, S)
            found.update(int(j) for j in order[a:b] if not is_causal or kpos[j] <= qpos[i])
        rows.append(sorted(found))
    return SparsePattern.from_rows(rows, S)
