"""The memory-cap kernels of KVCache against numpy brute force on random slot layouts."""

from __future__ import annotations

import numpy as np
import pytest

from sparseattn.kernels.cache_ops import least_weight_slot, mark_evicted_clusters, slots_of_positions
from sparseattn.kernels.decode import EVICTED


def _layout(seed: int, hk: int = 3, n: int = 200):
    rng = np.random.default_rng(seed)
    pos = np.stack([rng.permutation(n) for _ in range(hk)]).astype(np.int32)
    dead = rng.random((hk, n)) < 0.2
    pos[dead] = EVICTED
    return rng, pos


@pytest.mark.parametrize("seed", range(6))
def test_slots_of_positions_matches_brute_force(seed: int) -> None:
    rng, pos = _layout(seed)
    lo = int(rng.integers(0, 150))
    hi = lo + int(rng.integers(1, 40))
    start = int(rng.integers(0, 50))
    out = np.full((3, hi - lo), -7, np.int64)
    got = slots_of_positions(pos, start, pos.shape[1], lo, hi, out)
    counts = []
    for g in range(3):
        want = start + np.flatnonzero((pos[g, start:] >= lo) & (pos[g, start:] < hi))
        counts.append(want.size)
        np.testing.assert_array_equal(out[g, :want.size], want[:hi - lo])
    assert got == min(counts)


@pytest.mark.parametrize("seed", range(6))
def test_mark_evicted_clusters_matches_searchsorted(seed: int) -> None:
    rng, pos = _layout(seed)
    n = pos.shape[1]
    n_cent = np.array([5, 7, 1], np.int64)
    cptr = np.zeros((3, 9), np.int64)
    for g in range(3):
        cuts = np.sort(rng.choice(np.arange(1, n - 20), n_cent[g] - 1, replace=False))
        cptr[g, 1:n_cent[g]] = cuts
        cptr[g, n_cent[g]] = n - 20  # the last 20 slots: no cluster (the tail)
    kill = np.stack([rng.choice(n, 6, replace=False) for _ in range(3)]).astype(np.int64)
    cmax = np.zeros((3, 8), np.int32)
    p2 = pos.copy()
    mark_evicted_clusters(p2, kill, cptr, n_cent, cmax, EVICTED)
    want_pos = pos.copy()
    want_cmax = np.zeros_like(cmax)
    for g in range(3):
        want_pos[g, kill[g]] = EVICTED
        inside = kill[g][kill[g] < cptr[g, n_cent[g]]]
        want_cmax[g, np.searchsorted(cptr[g, :n_cent[g] + 1], inside, side="right") - 1] = EVICTED
    np.testing.assert_array_equal(p2, want_pos)
    np.testing.assert_array_equal(cmax, want_cmax)


@pytest.mark.parametrize("seed", range(6))
def test_least_weight_slot_matches_brute_force(seed: int) -> None:
    rng, pos = _layout(seed)
    w = rng.integers(0, 5, pos.shape).astype(np.float64)  # many ties: the smallest position wins
    out = np.empty(3, np.int64)
    least_weight_slot(pos, w, pos.shape[1], 4, 180, EVICTED, out)
    for g in range(3):
        ok = (pos[g] >= 4) & (pos[g] < 180) & (pos[g] != EVICTED)
        cand = np.flatnonzero(ok)
        best = cand[np.lexsort((pos[g, cand], w[g, cand]))[0]]
        assert out[g] == best
    none = np.full_like(pos, EVICTED)
    least_weight_slot(none, w, pos.shape[1], 0, 10**6, EVICTED, out)
    assert (out == -1).all()
