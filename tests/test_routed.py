"""routed_attention on a ClusterIndex, and the thread helpers it runs on (sparseattn.threads)."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from helpers import dense64

from sparseattn.attention.routed import routed_attention
from sparseattn.index import ClusterIndex
from sparseattn.threads import executor, run_jobs, worker_threads


def _data(seed: int = 5, S: int = 700, L: int = 120, dtype=np.float32):
    rng = np.random.default_rng(seed)
    cent = rng.standard_normal((16, 8)) * 1.5
    k = cent[rng.integers(0, 16, S)] + 0.2 * rng.standard_normal((S, 8))
    q = cent[rng.integers(0, 16, L)] + 0.2 * rng.standard_normal((L, 8))
    v = rng.standard_normal((S, 5))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)




@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_every_cluster_probed_is_exact_attention(dtype, tol, is_causal):
    q, k, v = _data(dtype=dtype, L=700)
    index = ClusterIndex(n_clusters=8, n_probe=8).build(k)
    out, lse = routed_attention(index, q, v, scale=0.5, is_causal=is_causal)
    mask = np.tril(np.ones((700, 700), dtype=bool)) if is_causal else None
    ref, ref_lse = dense64(q, k, v, 0.5, mask)
    assert out.dtype == dtype and lse.dtype == dtype and out.shape == (700, 5)
    np.testing.assert_allclose(out, ref, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)


def test_threads_stats_and_errors():
    q, k, v = _data()
    index = ClusterIndex(n_clusters=10, n_probe=3).build(k)
    a = routed_attention(index, q, v, is_causal=True, n_threads=1)
    b = routed_attention(index, q, v, is_causal=True, n_threads=2)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    stats: dict = {}
    routed_attention(index, q, v, scale=40.0, exact_prefix=False, stats=stats)
    assert stats["refined_pairs"] > 0  # scale 40: the Cauchy-Schwarz shifts overshoot, pairs are refined
    out, lse = routed_attention(index, q[:0], v)
    assert out.shape == (0, 5) and lse.shape == (0,)
    with pytest.raises(ValueError, match=r"values must have shape \(S=700, Ev\)"):
        routed_attention(index, q, v[:10])
    with pytest.raises(ValueError, match=r"queries must have shape \(L, E=8\)"):
        routed_attention(index, q[:, :4], v)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        routed_attention(index, q, v, is_causal=1)
    with pytest.raises(RuntimeError, match="not built"):
        routed_attention(ClusterIndex(), q, v)


def test_thread_helpers():
    assert executor(2) is executor(2) and executor(2) is not executor(3)
    before = numba.get_num_threads()
    with worker_threads(1) as n:
        assert n == 1 and numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
    with worker_threads(10_000) as n:
        assert n == numba.config.NUMBA_NUM_THREADS
    seen: list[int] = []
    lock = threading.Lock()

    def work(j: int) -> None:
        with lock:
            seen.append(j)

    for n in (1, 2):
        seen.clear()
        run_jobs(work, range(9), n)
        assert sorted(seen) == list(range(9))

    def boom(j: int) -> None:
        if j == 3:
            raise KeyError(j)

    with pytest.raises(KeyError):
        run_jobs(boom, range(6), 2)
