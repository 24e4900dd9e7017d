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
