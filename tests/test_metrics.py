"""Tests of sparseattn.metrics against hand-worked numbers and an independent float64 brute force.

The brute force below builds the full (L, S) score matrix and loops over rows with plain numpy: it shares
no code with the blockwise implementation (no online softmax, no running top-k, no CSR products).
Tolerances: float64 throughout, so 1e-12 absolute (or relative) unless a comment says otherwise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseattn import metrics
from sparseattn.metrics import AccuracyReport, compare, mass_recall, output_relative_error, topk_recall
from sparseattn.pattern import SparsePattern

TOL = 1e-12


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


# ------------------------------------------------------------------------------------- the oracle
def brute_force(q, k, v, pattern, *, scale=None, is_causal=False, query_positions=None, key_positions=None,
                topk=1, eps=1e-6):
    """Per-row metrics from the full float64 score matrix, one row at a time."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    L, S = q.shape[0], k.shape[0]
    scale = 1.0 / math.sqrt(q.shape[1]) if scale is None else scale
    raw = q @ k.T
    qpos = np.arange(L) if query_positions is None else np.asarray(query_positions)
    kpos = np.arange(S) if key_positions is None else np.asarray(key_positions)
    allowed = kpos[None, :] <= qpos[:, None] if is_causal else np.ones((L, S), dtype=bool)
    sel = pattern.to_mask() & allowed
    out = {name: np.zeros(L) for name in ("rel", "mass", "recall", "kl", "lse_d", "lse_s")}
    o_dense = np.zeros((L, v.shape[1]))
    o_sparse = np.zeros((L, v.shape[1]))
    for i in range(L):
        A = np.flatnonzero(allowed[i])
        P = np.flatnonzero(sel[i])
        if A.size == 0:
            out["lse_d"][i] = out["lse_s"][i] = -np.inf
            out["mass"][i] = out["recall"][i] = 1.0
            continue
        s = scale * raw[i]
        mx = s[A].max()
        w = np.exp(s[A] - mx)
        out["lse_d"][i] = mx + np.log(w.sum())
        p = np.zeros(S)
        p[A] = w / w.sum()
        o_dense[i] = p @ v
        out["mass"][i] = p[P].sum()
        if P.size:
            ms = s[P].max()
            ws = np.exp(s[P] - ms)
            out["lse_s"][i] = ms + np.log(ws.sum())
            qdist = ws / ws.sum()
            o_sparse[i] = qdist @ v[P]
            out["kl"][i] = float(np.sum(qdist * np.log(qdist / p[P])))  # KL(sparse || dense), directly
        else:
            out["lse_s"][i] = -np.inf
            out["kl"][i] = np.inf
        ranked = np.sort(raw[i, A])[::-1]
        t = ranked[topk - 1] if A.size >= topk else -np.inf
        thr = t - eps * abs(t) - eps if np.isfinite(t) else -np.inf
        hits = int(np.sum(raw[i, P] >= thr))
        out["recall"][i] = min(hits / min(topk, A.size), 1.0)
        dn = np.linalg.norm(o_sparse[i] - o_dense[i])
        rn = np.linalg.norm(o_dense[i])
        out["rel"][i] = dn / rn if rn > 0 else dn
    out["o_dense"], out["o_sparse"] = o_dense, o_sparse
    out["overall"] = np.linalg.norm(o_sparse - o_dense) / np.linalg.norm(o_dense)
    out["max_abs"] = np.abs(o_sparse - o_dense).max()
    return out


def assert_matches(rep: AccuracyReport, ref: dict) -> None:
    np.testing.assert_allclose(rep.rel_error, ref["rel"], rtol=1e-10, atol=TOL)
    np.testing.assert_allclose(rep.mass_recall, ref["mass"], rtol=1e-10, atol=TOL)
    np.testing.assert_array_equal(rep.recall, ref["recall"])
    np.testing.assert_allclose(rep.kl, ref["kl"], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(rep.lse_dense, ref["lse_d"], rtol=1e-12, atol=TOL)
    np.testing.assert_allclose(rep.lse_sparse, ref["lse_s"], rtol=1e-12, atol=TOL)
    np.testing.assert_allclose(rep.rel_error_overall, ref["overall"], rtol=1e-10, atol=TOL)
    np.testing.assert_allclose(rep.max_abs_error, ref["max_abs"], rtol=1e-10, atol=TOL)


def random_qkv(rng, L, S, E=8, Ev=5, spread=2.0):
    return (spread * rng.standard_normal((L, E)), rng.standard_normal((S, E)), rng.standard_normal((S, Ev)))


def random_pattern(rng, L, S, density=0.3, empty_rows=()):
    mask = rng.random((L, S)) < density
    mask[list(empty_rows)] = False
    return SparsePattern.from_mask(mask)


# ------------------------------------------------------------------------------- hand-worked 2 x 3
# q = [[1,0],[0,1]], k = [[1,0],[0,1],[1,1]]: raw scores row0 [1,0,1], row1 [0,1,1].
# scale = ln 2: exp(logits) row0 [2,1,2], row1 [1,2,2], both sum 5 -> lse_dense = ln 5,
# probabilities row0 [.4,.2,.4], row1 [.2,.4,.4].  v = [[10,0],[0,10],[5,5]]:
# dense row0 = .4*[10,0] + .2*[0,10] + .4*[5,5] = [6,4]; row1 = [4,6].
# Pattern: row0 -> {0}, row1 -> {1, 2}.
# sparse row0 = [10,0] (lse ln 2); row1 = .5*[0,10] + .5*[5,5] = [2.5,7.5] (lse ln 4).
# errors: row0 |[4,-4]| / |[6,4]| = sqrt(32/52); row1 |[-1.5,1.5]| / sqrt(52) = sqrt(4.5/52);
# overall sqrt((32 + 4.5) / 104); max abs 4.
# mass .4 and .8; KL(sparse||dense) = -ln .4 = ln 2.5 and -ln .8 = ln 1.25 (= lse error).
# recall, default k = round(1.5) = 2: row0 2nd-largest raw score 1, selected {0} -> 1 hit / 2 = .5;
# row1 selected {1, 2} both score 1 -> 2 / 2 = 1.
Q2 = np.array([[1.0, 0.0], [0.0, 1.0]])
K2 = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
V2 = np.array([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]])
P2 = SparsePattern.from_rows([[0], [1, 2]], n_keys=3)
LN2 = math.log(2.0)


def test_hand_computed_2x3():
    rep = compare(Q2, K2, V2, P2, scale=LN2)
    np.testing.assert_allclose(rep.rel_error, [math.sqrt(32 / 52), math.sqrt(4.5 / 52)], rtol=1e-13)
    np.testing.assert_allclose(rep.rel_error_overall, math.sqrt(36.5 / 104), rtol=1e-13)
    np.testing.assert_allclose(rep.max_abs_error, 4.0, rtol=1e-13)
    np.testing.assert_allclose(rep.mass_recall, [0.4, 0.8], rtol=1e-13)
    np.testing.assert_allclose(rep.kl, [math.log(2.5), math.log(1.25)], rtol=1e-13)
    np.testing.assert_allclose(rep.lse_error, [math.log(2.5), math.log(1.25)], rtol=1e-13)
    np.testing.assert_allclose(rep.lse_dense, [math.log(5.0)] * 2, rtol=1e-13)
    np.testing.assert_allclose(rep.lse_sparse, [math.log(2.0), math.log(4.0)], rtol=1e-13)
    assert rep.k == 2
    np.testing.assert_array_equal(rep.recall, [0.5, 1.0])
    assert rep.n_selected.tolist() == [1, 2] and rep.n_allowed.tolist() == [3, 3]
    assert (rep.empty_rows, rep.missed_rows, rep.dropped_noncausal) == (0, 0, 0)
    # k = 1: both rows select a key tied at the top -> recall 1 each (row1's 2 hits capped at 1).
    np.testing.assert_array_equal(compare(Q2, K2, V2, P2, scale=LN2, k=1).recall, [1.0, 1.0])
    # The separate helpers give the same numbers.
    np.testing.assert_allclose(mass_recall(P2, Q2, K2, scale=LN2), [0.4, 0.8], rtol=1e-13)
    np.testing.assert_array_equal(topk_recall(P2, Q2, K2, 2), [0.5, 1.0])


def test_hand_computed_2x3_causal():
    # Causal, top-left: row0 may use key 0 only, row1 keys 0, 1.  Pattern row1 {1, 2}: key 2 is dropped.
    # row0: dense = sparse = v0 -> error 0, mass 1.  row1 logits [0, ln2] -> probs [1/3, 2/3],
    # dense = [10/3, 20/3]; sparse = v1 = [0, 10]; error |[-10/3, 10/3]| / |[10/3, 20/3]| = sqrt(2/5);
    # mass 2/3, KL = ln 1.5; recall k=1: row1 top raw score 1 (key 1) selected -> 1.
    rep = compare(Q2, K2, V2, P2, scale=LN2, is_causal=True, k=1)
    np.testing.assert_allclose(rep.rel_error, [0.0, math.sqrt(2 / 5)], rtol=1e-13, atol=TOL)
    np.testing.assert_allclose(rep.mass_recall, [1.0, 2 / 3], rtol=1e-13)
    np.testing.assert_allclose(rep.kl, [0.0, math.log(1.5)], rtol=1e-13, atol=TOL)
    np.testing.assert_array_equal(rep.recall, [1.0, 1.0])
    assert rep.n_allowed.tolist() == [1, 2] and rep.n_selected.tolist() == [1, 1]
    assert rep.dropped_noncausal == 1


@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_and_negative_scale(rng, is_causal):
    # scale = 0: uniform attention over the allowed keys, so mass = n_selected / n_allowed exactly.
    q, kk, v = random_qkv(rng, 12, 12)
    pat = random_pattern(rng, 12, 12, density=0.4)
    rep = compare(q, kk, v, pat, scale=0.0, is_causal=is_causal, k=2, key_block=5)
    np.testing.assert_allclose(rep.mass_recall, rep.n_selected / rep.n_allowed, rtol=1e-13)
    assert_matches(rep, brute_force(q, kk, v, pat, scale=0.0, is_causal=is_causal, topk=2))
    # A negative scale is legal (attention then favours small q.k); still exact against the oracle.
    rep = compare(q, kk, v, pat, scale=-0.7, is_causal=is_causal, k=2, key_block=5)
    assert_matches(rep, brute_force(q, kk, v, pat, scale=-0.7, is_causal=is_causal, topk=2))


def test_output_relative_error_hand_values():
    # |[3,4] - [0,8]| = |[3,-4]| = 5, |[0,8]| = 8.
    assert output_relative_error(np.array([[3.0, 4.0]]), np.array([[0.0, 8.0]])) == pytest.approx(0.625)
    a = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    b = np.array([[0.0, 8.0], [0.0, 0.0], [0.0, 0.0]])
    # Zero reference rows fall back to the absolute error (1 and 0), never NaN.
    np.testing.assert_allclose(output_relative_error(a, b, per_row=True), [0.625, 1.0, 0.0], rtol=1e-15)
    assert output_relative_error(np.zeros((2, 2)), np.zeros((2, 2))) == 0.0


# ----------------------------------------------------------------------------------------- ties
def test_duplicate_keys_tie_either_counts():
    # Keys 0 and 3 are identical: tied for the top score of every query; choosing either is a hit.
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0]])
    queries = np.array([[2.0, 0.5], [3.0, -1.0]])
    for chosen in (0, 3):
        pat = SparsePattern.from_rows([[chosen], [chosen]], n_keys=4)
        np.testing.assert_array_equal(topk_recall(pat, queries, keys, 1, eps=0.0), [1.0, 1.0])
    # k = 2 with both duplicates selected: 2 hits out of min(2, 4).
    pat = SparsePattern.from_rows([[0, 3], [0, 3]], n_keys=4)
    np.testing.assert_array_equal(topk_recall(pat, queries, keys, 2), [1.0, 1.0])
    # Selecting a non-tied key instead is a miss.
    pat = SparsePattern.from_rows([[2], [2]], n_keys=4)
    np.testing.assert_array_equal(topk_recall(pat, queries, keys, 1), [0.0, 0.0])


def test_tie_tolerance_eps():
    # Raw scores 1, 1 - 1e-9, 0.5 (E = 1, q = 1): key 1 is within eps = 1e-6 of the top score.
    keys = np.array([[1.0], [1.0 - 1e-9], [0.5]])
    q = np.array([[1.0]])
    pat = SparsePattern.from_rows([[1]], n_keys=3)
    assert topk_recall(pat, q, keys, 1)[0] == 1.0
    assert topk_recall(pat, q, keys, 1, eps=0.0)[0] == 0.0
    # Far below the threshold: a miss whatever the (small) eps.
    pat = SparsePattern.from_rows([[2]], n_keys=3)
    assert topk_recall(pat, q, keys, 1, eps=1e-3)[0] == 0.0


def test_recall_k_larger_than_row(rng):
    # k > S: denominator min(k, S); selecting everything gives 1, half of the keys 0.5.
    q, kk, _ = random_qkv(rng, 3, 6)
    full = SparsePattern.full(3, 6)
    np.testing.assert_array_equal(topk_recall(full, q, kk, 50), [1.0, 1.0, 1.0])
    half = SparsePattern.from_rows([[0, 1, 2]] * 3, n_keys=6)
    np.testing.assert_array_equal(topk_recall(half, q, kk, 50), [0.5, 0.5, 0.5])


# ------------------------------------------------------------------------------- against the oracle
def test_full_pattern_is_exact(rng):
    q, kk, v = random_qkv(rng, 40, 55)
    rep = compare(q, kk, v, SparsePattern.full(40, 55), k=7, block=16, key_block=20)
    assert rep.rel_error.max() < 1e-13 and rep.rel_error_overall < 1e-13 and rep.max_abs_error < 1e-13
    np.testing.assert_allclose(rep.mass_recall, 1.0, atol=1e-13)
    np.testing.assert_array_equal(rep.recall, 1.0)
    assert rep.kl.max() < 1e-13 and rep.lse_error.min() >= 0.0
    s = rep.summary()
    assert s["recall_mean"] == 1.0 and s["missed_rows"] == 0.0 and s["mean_selected"] == 55.0


def test_full_causal_pattern_is_exact(rng):
    q, kk, v = random_qkv(rng, 30, 30)
    rep = compare(q, kk, v, SparsePattern.full(30, 30, is_causal=True), is_causal=True, k=4, key_block=7)
    assert rep.rel_error_overall < 1e-13
    np.testing.assert_allclose(rep.mass_recall, 1.0, atol=1e-13)
    np.testing.assert_array_equal(rep.recall, 1.0)
    np.testing.assert_array_equal(rep.n_allowed, np.arange(1, 31))


@pytest.mark.parametrize("is_causal", [False, True])
def test_window_pattern_matches_brute_force(rng, is_causal):
    L = S = 64
    q, kk, v = random_qkv(rng, L, S)
    pat = SparsePattern.window(L, S, 9, is_causal=is_causal)
    rep = compare(q, kk, v, pat, is_causal=is_causal, k=5, block=13, key_block=17)
    ref = brute_force(q, kk, v, pat, is_causal=is_causal, topk=5)
    assert_matches(rep, ref)
    assert rep.dropped_noncausal == 0 and rep.empty_rows == 0
    # Observed on this seed: mean mass ~0.4-0.5 for a 9-key window of 64 random keys; loosely bounded.
    assert 0.1 < rep.mass_recall.mean() < 0.95


def test_random_pattern_causal_with_leaks(rng):
    # A pattern that selects future keys: they are dropped (and counted) before anything is measured.
    L = S = 40
    q, kk, v = random_qkv(rng, L, S)
    pat = random_pattern(rng, L, S, density=0.3)
    rep = compare(q, kk, v, pat, is_causal=True, k=3, block=9, key_block=11)
    ref = brute_force(q, kk, v, pat, is_causal=True, topk=3)
    assert_matches(rep, ref)
    upper = np.triu(pat.to_mask(), k=1).sum()
    assert rep.dropped_noncausal == upper > 0


def test_causal_kv_cache_positions(rng):
    # 8 new queries at positions 24..31 over a cache of 32 keys (bottom-right alignment).
    L, S = 8, 32
    q, kk, v = random_qkv(rng, L, S)
    qpos = np.arange(S - L, S)
    pat = random_pattern(rng, L, S, density=0.25)
    rep = compare(q, kk, v, pat, is_causal=True, query_positions=qpos, k=4, key_block=5)
    ref = brute_force(q, kk, v, pat, is_causal=True, query_positions=qpos, topk=4)
    assert_matches(rep, ref)
    np.testing.assert_array_equal(rep.n_allowed, qpos + 1)


def test_sparse_output_given(rng):
    q, kk, v = random_qkv(rng, 20, 30)
    pat = random_pattern(rng, 20, 30)
    ref = brute_force(q, kk, v, pat, topk=3)
    own = compare(q, kk, v, pat, k=3)
    given_out = compare(q, kk, v, pat, k=3, sparse_output=ref["o_sparse"].astype(np.float32))
    # float32 rounding of the given output: relative 6e-8 per entry, so 1e-6 on the errors.
    np.testing.assert_allclose(given_out.rel_error, own.rel_error, rtol=1e-5, atol=1e-6)
    # A wrong output is judged as given: the dense output itself has error exactly 0.
    exact = compare(q, kk, v, pat, k=3, sparse_output=ref["o_dense"])
    assert exact.rel_error.max() < 1e-13
    # The mass / KL fields still describe the pattern, not the given output.
    np.testing.assert_allclose(exact.mass_recall, ref["mass"], rtol=1e-10)


def test_float32_inputs(rng):
    q, kk, v = (a.astype(np.float32) for a in random_qkv(rng, 16, 24))
    pat = random_pattern(rng, 16, 24)
    rep = compare(q, kk, v, pat, k=3)
    assert_matches(rep, brute_force(q, kk, v, pat, topk=3))


# ------------------------------------------------------------------------------------- blocking
def test_blocked_equals_unblocked(rng):
    # key_block 1 merges the running top-k one key at a time, 10**6 selects from one tile.
    L, S = 37, 83
    q, kk, v = random_qkv(rng, L, S)
    pat = random_pattern(rng, L, S, density=0.1, empty_rows=(3, 30))
    for causal in (False, True):
        one = compare(q, kk, v, pat, is_causal=causal, k=6, block=1, key_block=1)
        mid = compare(q, kk, v, pat, is_causal=causal, k=6, block=10, key_block=9)
        big = compare(q, kk, v, pat, is_causal=causal, k=6, block=10**6, key_block=10**6)
        ref = brute_force(q, kk, v, pat, is_causal=causal, topk=6)
        for rep in (one, mid, big):
            assert_matches(rep, ref)
        np.testing.assert_allclose(one.rel_error, big.rel_error, rtol=1e-10, atol=TOL)


def test_gather_chunks(rng, monkeypatch):
    # Tiny gather budget: the selected-pair scores are computed a few pairs at a time.
    monkeypatch.setattr(metrics, "_GATHER_ELEMS", 3 * 8)
    q, kk, v = random_qkv(rng, 12, 20)
    pat = random_pattern(rng, 12, 20, density=0.4)
    assert_matches(compare(q, kk, v, pat, k=2, block=5), brute_force(q, kk, v, pat, topk=2))


@pytest.mark.parametrize("is_causal", [False, True])
def test_rows_subset_matches_full(rng, is_causal):
    # Evaluating a sample of rows gives exactly the full report's rows, with their original positions.
    L, S = 30, 41
    q, kk, v = random_qkv(rng, L, S)
    pat = random_pattern(rng, L, S, density=0.2, empty_rows=(7,))
    full = compare(q, kk, v, pat, is_causal=is_causal, block=8, key_block=10)
    rows = np.array([29, 3, 7, 7, 15])
    sub = compare(q, kk, v, pat, is_causal=is_causal, rows=rows, block=2, key_block=10)
    assert sub.k == full.k  # k from the whole pattern, not the sample
    np.testing.assert_array_equal(sub.rows, rows)
    for f in ("rel_error", "mass_recall", "recall", "kl", "lse_dense", "n_selected", "n_allowed"):
        np.testing.assert_allclose(getattr(sub, f), getattr(full, f)[rows], rtol=1e-12, atol=TOL, err_msg=f)
    ref = brute_force(q[rows], kk, v, pat.select_rows(rows), is_causal=is_causal, query_positions=rows,
                      topk=full.k)
    np.testing.assert_allclose(sub.rel_error_overall, ref["overall"], rtol=1e-10)
    given_out = compare(q, kk, v, pat, is_causal=is_causal, rows=rows,
                        sparse_output=brute_force(q, kk, v, pat, is_causal=is_causal)["o_sparse"])
    np.testing.assert_allclose(given_out.rel_error, sub.rel_error, rtol=1e-10, atol=TOL)
    np.testing.assert_allclose(mass_recall(pat, q, kk, is_causal=is_causal, rows=rows), sub.mass_recall,
                               rtol=1e-12)
    np.testing.assert_array_equal(topk_recall(pat, q, kk, full.k, is_causal=is_causal, rows=rows), sub.recall)
    assert sub.summary()["n_rows"] == 5.0


# ------------------------------------------------------------------------------------ empty rows
def test_empty_rows(rng):
    q, kk, v = random_qkv(rng, 10, 15)
    pat = random_pattern(rng, 10, 15, density=0.4, empty_rows=(0, 4, 9))
    rep = compare(q, kk, v, pat, k=3)
    assert_matches(rep, brute_force(q, kk, v, pat, topk=3))
    assert rep.empty_rows == rep.missed_rows == 3
    for i in (0, 4, 9):
        assert rep.mass_recall[i] == 0.0 and rep.recall[i] == 0.0
        assert rep.kl[i] == np.inf and rep.lse_error[i] == np.inf and rep.lse_sparse[i] == -np.inf
        assert rep.rel_error[i] == pytest.approx(1.0)  # zero output vs non-zero dense: relative error 1
    for f in ("rel_error", "mass_recall", "recall", "kl", "lse_error"):
        assert not np.isnan(getattr(rep, f)).any()
    s = rep.summary()
    assert all(math.isfinite(x) for x in s.values())
    finite = np.isfinite(rep.kl)
    assert s["kl_mean"] == pytest.approx(rep.kl[finite].mean()) and s["missed_rows"] == 3.0


def test_rows_without_allowed_keys(rng):
    # Keys at positions 5..9, queries at 0..9, causal: queries 0..4 see no key at all.
    q, kk, v = random_qkv(rng, 10, 5)
    kpos = np.arange(5, 10)
    pat = SparsePattern.full(10, 5)
    rep = compare(q, kk, v, pat, is_causal=True, key_positions=kpos, k=2)
    assert_matches(rep, brute_force(q, kk, v, pat, is_causal=True, key_positions=kpos, topk=2))
    assert rep.n_allowed.tolist() == [0] * 5 + [1, 2, 3, 4, 5]
    assert rep.empty_rows == 5 and rep.missed_rows == 0
    np.testing.assert_array_equal(rep.rel_error[:5], 0.0)
    np.testing.assert_array_equal(rep.mass_recall[:5], 1.0)
    np.testing.assert_array_equal(rep.kl[:5], 0.0)
    np.testing.assert_array_equal(rep.lse_dense[:5], -np.inf)
    assert all(math.isfinite(x) for x in rep.summary().values())


def test_degenerate_sizes():
    # No keys at all, and no queries: vacuous but finite reports.
    rep = compare(np.ones((3, 2)), np.zeros((0, 2)), np.zeros((0, 4)), SparsePattern.full(3, 0))
    assert rep.k == 1 and rep.recall.tolist() == [1.0] * 3 and rep.rel_error.tolist() == [0.0] * 3
    assert all(math.isfinite(x) for x in rep.summary().values())
    rep = compare(np.ones((0, 2)), np.ones((4, 2)), np.ones((4, 1)), SparsePattern.full(0, 4))
    assert rep.n_rows == 0 and rep.summary()["recall_mean"] == 1.0


def test_all_zero_values_gives_zero_error(rng):
    q, kk, _ = random_qkv(rng, 6, 9)
    pat = random_pattern(rng, 6, 9, density=0.5)
    rep = compare(q, kk, np.zeros((9, 3)), pat, k=2)
    assert rep.rel_error_overall == 0.0 and rep.max_abs_error == 0.0


# ------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs():
    q, kk, v, pat = Q2, K2, V2, P2
    with pytest.raises(ValueError, match="same feature size E"):
        compare(q, np.ones((3, 4)), v, pat)
    with pytest.raises(ValueError, match="value must have one row per key"):
        compare(q, kk, np.ones((4, 2)), pat)
    with pytest.raises(ValueError, match=r"pattern shape must be .*\(2, 3\).*got \(2, 4\)"):
        compare(q, kk, v, SparsePattern.full(2, 4))
    with pytest.raises(ValueError, match=r"pattern shape must be .*got \(3, 3\)"):
        topk_recall(SparsePattern.full(3, 3), q, kk, 1)
    with pytest.raises(TypeError, match="pattern must be a SparsePattern, a sequence of them .*; got ndarray"):
        compare(q, kk, v, np.ones((2, 3), dtype=bool))
    with pytest.raises(ValueError, match="k must be >= 1; got 0"):
        compare(q, kk, v, pat, k=0)
    with pytest.raises(ValueError, match="k must be >= 1; got -2"):
        topk_recall(pat, q, kk, -2)
    with pytest.raises(TypeError, match="k must be an integer"):
        compare(q, kk, v, pat, k=2.0)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        compare(q, kk, v, pat, eps=-1e-3)
    with pytest.raises(TypeError, match="eps must be a real number"):
        compare(q, kk, v, pat, eps="1e-6")
    with pytest.raises(ValueError, match="block must be >= 1; got 0"):
        compare(q, kk, v, pat, block=0)
    with pytest.raises(ValueError, match="key_block must be >= 1; got 0"):
        mass_recall(pat, q, kk, key_block=0)
    with pytest.raises(ValueError, match=r"sparse_output must have shape \(\.\.\., L, Ev\) = \(1, 2, 2\); got \(2, 2\)"):
        compare(q[None], kk, v, pat, sparse_output=np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"leading dimensions of query \(2,\) and key \(3,\) do not broadcast"):
        compare(np.stack([q, q]), np.stack([kk] * 3), np.stack([v] * 3), pat)
    with pytest.raises(ValueError, match="key and value must have the same leading dims"):
        compare(q, np.stack([kk, kk]), v, pat)
    with pytest.raises(ValueError, match="pattern sequence has 1 entries; expected one per .* group = 2"):
        compare(np.stack([q, q]), kk, v, [pat])
    with pytest.raises(ValueError, match=r"pattern\[1\] shape must be .*got \(2, 4\)"):
        mass_recall([pat, SparsePattern.full(2, 4)], np.stack([q, q]), kk)
    with pytest.raises(ValueError, match="holds no .*group"):
        compare(np.ones((0, 2, 2)), kk, v, pat)
    with pytest.raises(ValueError, match="per_row and per_head are exclusive"):
        output_relative_error(np.ones((2, 2)), np.ones((2, 2)), per_row=True, per_head=True)
    with pytest.raises(ValueError, match="key must have at least 2 dimensions"):
        compare(q, kk[0], v, pat)
    with pytest.raises(TypeError, match="value must have dtype float16, float32 or float64; got int64"):
        compare(q, kk, np.ones((3, 2), dtype=np.int64), pat)
    with pytest.raises(ValueError, match="query contains NaN or Inf"):
        compare(np.array([[np.nan, 0.0], [0.0, 1.0]]), kk, v, pat)
    with pytest.raises(ValueError, match=r"sparse_output must have shape \(L, Ev\) = \(2, 2\); got \(2, 3\)"):
        compare(q, kk, v, pat, sparse_output=np.ones((2, 3)))
    with pytest.raises(ValueError, match="sparse_output contains NaN or Inf"):
        compare(q, kk, v, pat, sparse_output=np.full((2, 2), np.nan))
    with pytest.raises(ValueError, match=r"query_positions must have shape \(2,\)"):
        compare(q, kk, v, pat, is_causal=True, query_positions=np.arange(3))
    with pytest.raises(ValueError, match=r"rows must lie in \[0, L=2\); got values from -1 to 0"):
        compare(q, kk, v, pat, rows=np.array([0, -1]))
    with pytest.raises(TypeError, match="rows must be an integer array"):
        mass_recall(pat, q, kk, rows=np.array([0.0]))
    with pytest.raises(ValueError, match=r"rows must be 1-D; got shape \(1, 1\)"):
        topk_recall(pat, q, kk, 1, rows=np.array([[0]]))
    with pytest.raises(TypeError, match="scale must be a real number or None"):
        mass_recall(pat, q, kk, scale="big")
    with pytest.raises(ValueError, match="approx and reference must have the same shape"):
        output_relative_error(np.ones((2, 2)), np.ones((2, 3)))


# ------------------------------------------------------------------------------- property tests
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(1, 12), S=st.integers(1, 12), density=st.floats(0.0, 1.0), k=st.integers(1, 6),
       causal=st.booleans(), seed=st.integers(0, 2**31 - 1), block=st.integers(1, 5),
       key_block=st.integers(1, 5))
def test_properties(L, S, density, k, causal, seed, block, key_block):
    rng = np.random.default_rng(seed)
    q, kk, v = random_qkv(rng, L, S, E=3, Ev=2)
    pat = random_pattern(rng, L, S, density=density)
    rep = compare(q, kk, v, pat, is_causal=causal, k=k, block=block, key_block=key_block)
    for f in ("rel_error", "mass_recall", "recall", "kl", "lse_error"):
        assert not np.isnan(getattr(rep, f)).any(), f
    assert ((rep.mass_recall >= 0) & (rep.mass_recall <= 1)).all()
    assert ((rep.recall >= 0) & (rep.recall <= 1)).all()
    assert (rep.kl >= 0).all() and (rep.lse_error >= 0).all()
    np.testing.assert_allclose(rep.mass_recall, np.exp(-rep.kl), rtol=1e-12, atol=1e-300)
    assert all(math.isfinite(x) for x in rep.summary().values())
    # Adding keys never loses softmax mass.
    bigger = pat | random_pattern(rng, L, S, density=0.3)
    more = mass_recall(bigger, q, kk, is_causal=causal)
    assert (more >= rep.mass_recall - 1e-12).all()
    # Block sizes do not matter.
    ref = compare(q, kk, v, pat, is_causal=causal, k=k, block=10**6, key_block=10**6)
    np.testing.assert_allclose(rep.rel_error, ref.rel_error, rtol=1e-10, atol=TOL)
    np.testing.assert_array_equal(rep.recall, ref.recall)


# ------------------------------------------------------------------------- leading (batch, head) dims
def _loop_reports(q, kk, v, pats, **kw):
    """The 2-D call on every (batch, head) group in turn (the oracle of the batched call)."""
    lead = np.broadcast_shapes(q.shape[:-2], kk.shape[:-2])
    qb = np.broadcast_to(q, lead + q.shape[-2:])
    kb = np.broadcast_to(kk, lead + kk.shape[-2:])
    vb = np.broadcast_to(v, lead + v.shape[-2:])
    out = {}
    for i, idx in enumerate(np.ndindex(*lead)):
        pat = pats[i] if isinstance(pats, list) else pats
        sub = kw.get("sparse_output")
        kw_i = dict(kw, sparse_output=None if sub is None else sub[idx])
        out[idx] = compare(qb[idx], kb[idx], vb[idx], pat, **kw_i)
    return lead, out


@pytest.mark.parametrize("is_causal", [False, True])
def test_batched_compare_equals_per_head_loop_and_brute_force(rng, is_causal):
    B, H, L, S = 2, 3, 9, 11
    q = rng.standard_normal((B, H, L, 4)) * 2
    kk = rng.standard_normal((1, H, S, 4))  # keys broadcast over the batch
    v = rng.standard_normal((1, H, S, 3))
    pats = [random_pattern(rng, L, S, density=0.4, empty_rows=(2,)) for _ in range(B * H)]
    rep = compare(q, kk, v, pats, is_causal=is_causal, k=3)
    assert rep.lead == (B, H) and rep.n_heads == 6 and rep.n_rows == L and len(rep.heads) == 6
    assert rep.mass_recall.shape == rep.recall.shape == rep.n_selected.shape == (B, H, L)
    lead, loop = _loop_reports(q, kk, v, pats, is_causal=is_causal, k=3)
    diff_sq = ref_sq = 0.0
    for i, idx in enumerate(np.ndindex(*lead)):
        ref = brute_force(q[idx], kk[0, idx[1]], v[0, idx[1]], pats[i], is_causal=is_causal, topk=3)
        assert_matches(rep.head(*idx), ref)
        for f in ("rel_error", "mass_recall", "recall", "kl", "lse_dense", "lse_sparse", "n_selected"):
            np.testing.assert_array_equal(getattr(rep, f)[idx], getattr(loop[idx], f), err_msg=f)
        assert rep.head(*idx).summary() == loop[idx].summary()
        diff_sq += float(np.sum((ref["o_sparse"] - ref["o_dense"]) ** 2))
        ref_sq += float(np.sum(ref["o_dense"] ** 2))
    # aggregate: Frobenius over every head's output, means over all (head, row) pairs, counts summed
    np.testing.assert_allclose(rep.rel_error_overall, math.sqrt(diff_sq / ref_sq), rtol=1e-10)
    summ = rep.summary()
    assert summ["n_heads"] == 6 and summ["n_rows"] == L
    np.testing.assert_allclose(summ["mass_recall_mean"], np.mean([r.mass_recall for r in loop.values()]),
                               rtol=1e-12)
    assert rep.empty_rows == sum(r.empty_rows for r in loop.values()) >= 6
    assert rep.dropped_noncausal == sum(r.dropped_noncausal for r in loop.values())
    per = rep.per_head()
    assert per["mass_recall_mean"].shape == (B, H)
    assert per["rel_error_overall"][1, 2] == loop[(1, 2)].summary()["rel_error_overall"]
    with pytest.raises(IndexError, match="out of range"):
        rep.head(2, 0)
    with pytest.raises(ValueError, match="one index per leading dimension"):
        rep.head(0)


def test_batched_shared_pattern_rows_and_sparse_output(rng):
    H, L, S = 4, 12, 12
    q, kk, v = (rng.standard_normal((H, n, 5)) for n in (L, S, S))
    pat = SparsePattern.window(L, S, 4, is_causal=True)
    out = rng.standard_normal((H, L, 5))  # an arbitrary output to judge
    rows = np.array([1, 5, 11])
    rep = compare(q, kk, v, pat, sparse_output=out, rows=rows, is_causal=True)
    assert rep.rel_error.shape == (H, 3)
    for h in range(H):
        one = compare(q[h], kk[h], v[h], pat, sparse_output=out[h], rows=rows, is_causal=True)
        np.testing.assert_array_equal(rep.rel_error[h], one.rel_error)
        np.testing.assert_array_equal(rep.head(h).mass_recall, one.mass_recall)
        # the judged output is the given one: its error against the float64 dense output, by hand
        dense = brute_force(q[h], kk[h], v[h], SparsePattern.full(L, S), is_causal=True)["o_dense"]
        np.testing.assert_allclose(one.rel_error, np.linalg.norm(out[h][rows] - dense[rows], axis=1)
                                   / np.linalg.norm(dense[rows], axis=1), rtol=1e-10)


def test_batched_gqa_and_the_other_functions(rng):
    Hq, Hk, L, S = 4, 2, 7, 10
    q = rng.standard_normal((Hq, L, 3))
    kk = rng.standard_normal((Hk, S, 3))
    v = rng.standard_normal((Hk, S, 2))
    pats = [random_pattern(rng, L, S, density=0.5) for _ in range(Hq)]
    rep = compare(q, kk, v, pats, enable_gqa=True, k=2)
    rec = topk_recall(pats, q, kk, 2, enable_gqa=True)
    mass = mass_recall(pats, q, kk, enable_gqa=True)
    for h in range(Hq):
        ref = brute_force(q[h], kk[h // 2], v[h // 2], pats[h], topk=2)  # query head h reads K/V head h // 2
        assert_matches(rep.head(h), ref)
        np.testing.assert_array_equal(rec[h], ref["recall"])
        np.testing.assert_allclose(mass[h], ref["mass"], rtol=1e-10, atol=TOL)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        compare(q, kk, v, pats)


def test_output_relative_error_batched(rng):
    a, b = rng.standard_normal((2, 2, 3, 5, 4))
    b[1, 2] = 0.0  # a head whose reference is zero: absolute error
    rows = output_relative_error(a, b, per_row=True)
    heads = output_relative_error(a, b, per_head=True)
    assert rows.shape == (2, 3, 5) and heads.shape == (2, 3)
    for idx in np.ndindex(2, 3):
        d, r = np.linalg.norm(a[idx] - b[idx]), np.linalg.norm(b[idx])
        np.testing.assert_allclose(heads[idx], d / r if r > 0 else d, rtol=1e-12)
        np.testing.assert_allclose(rows[idx], output_relative_error(a[idx], b[idx], per_row=True), rtol=1e-12)
    np.testing.assert_allclose(output_relative_error(a, b), np.linalg.norm(a - b) / np.linalg.norm(b), rtol=1e-12)
    assert output_relative_error(a[0, 0], b[0, 0], per_head=True).shape == ()


@settings(max_examples=15, deadline=None)
@given(lead_q=st.lists(st.integers(1, 3), min_size=0, max_size=2), share_k=st.booleans(),
       L=st.integers(1, 6), S=st.integers(1, 6), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_batched_equals_loop_property(lead_q, share_k, L, S, causal, seed):
    rng = np.random.default_rng(seed)
    lead_q = tuple(lead_q)
    lead_k = tuple(1 for _ in lead_q) if share_k else lead_q
    q = rng.standard_normal(lead_q + (L, 3))
    kk = rng.standard_normal(lead_k + (S, 3))
    v = rng.standard_normal(lead_k + (S, 2))
    G = int(np.prod(lead_q, dtype=int))
    pats = [random_pattern(rng, L, S, density=0.5) for _ in range(G)]
    rep = compare(q, kk, v, pats if lead_q else pats[0], is_causal=causal, k=2)
    lead, loop = _loop_reports(q, kk, v, pats, is_causal=causal, k=2)
    assert rep.lead == lead
    for idx in np.ndindex(*lead):
        np.testing.assert_array_equal(rep.rel_error[idx], loop[idx].rel_error)
        np.testing.assert_array_equal(rep.lse_sparse[idx], loop[idx].lse_sparse)
        np.testing.assert_array_equal(rep.recall[idx], loop[idx].recall)


# --------------------------------------------------------------------------------------- huge k
@pytest.mark.parametrize("is_causal", [False, True])
def test_huge_k_is_clamped_not_allocated(rng, is_causal):
    import tracemalloc

    q, kk, v = random_qkv(rng, 20, 30)
    pat = random_pattern(rng, 20, 30, density=0.3)
    tracemalloc.start()
    try:
        rep = compare(q, kk, v, pat, k=10**9, is_causal=is_causal)
        rec = topk_recall(pat, q, kk, 10**12, is_causal=is_causal)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # nothing of size k (10**9 float64 would be 8 GB)
    assert rep.k == 10**9
    ref = brute_force(q, kk, v, pat, is_causal=is_causal, topk=10**9)
    assert_matches(rep, ref)
    np.testing.assert_array_equal(rec, ref["recall"])
    # k >= S: recall is the share of allowed keys selected, by hand
    allowed = np.minimum(np.arange(20) + 1, 30) if is_causal else np.full(20, 30)
    np.testing.assert_allclose(rep.recall, (pat.causal() if is_causal else pat).nnz_per_row / allowed, rtol=1e-12)


def test_large_k_below_s_shrinks_the_query_block(rng):
    q, kk, v = random_qkv(rng, 40, 50)
    pat = random_pattern(rng, 40, 50, density=0.5)
    # k = 49 < S with a 2-key tile: the block of 16 rows shrinks to (16 * 2) // 49 -> 1 row
    rep = compare(q, kk, v, pat, k=49, block=16, key_block=2)
    assert_matches(rep, brute_force(q, kk, v, pat, topk=49))


# ------------------------------------------------------------------------- SparseAttentionResult
def test_compare_scores_a_sparse_attention_result(rng):
    import sparseattn as sa

    H, L, S = 3, 40, 40
    q, kk, v = (rng.standard_normal((H, L, 8)) for _ in range(3))
    res = sa.sparse_attention_result(q, kk, v, "topk", k=6, is_causal=True)
    assert len(res.patterns) == H
    rep = compare(q, kk, v, res, is_causal=True, k=6)
    for h in range(H):
        ref = brute_force(q[h], kk[h], v[h], res.patterns[h], is_causal=True, topk=6)
        # the kernel's float64 output judged against the float64 dense reference
        np.testing.assert_allclose(rep.head(h).rel_error, ref["rel"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(rep.head(h).mass_recall, ref["mass"], rtol=1e-10, atol=TOL)
    assert np.all(rep.recall == 1.0)  # the exact top-k selector finds the exact top-k
    shared = sa.sparse_attention_result(q, kk, v, SparsePattern.window(L, S, 5))
    assert len(shared.patterns) == 1
    rep2 = compare(q, kk, v, shared)
    assert rep2.lead == (H,) and rep2.rel_error_overall > 0
    with pytest.raises(ValueError, match="sparse_output: pattern is a SparseAttentionResult"):
        compare(q, kk, v, shared, sparse_output=shared.output)


def test_block_mode_result_is_refused_with_the_way_to_score_it(rng):
    import sparseattn as sa

    H, L = 2, 256
    q, kk, v = (rng.standard_normal((H, L, 16)) for _ in range(3))
    spec = "cluster:mode=block,n_clusters=8,n_probe=2"
    res = sa.sparse_attention_result(q, kk, v, spec, k=16)
    assert res.patterns == []  # the selector attends by itself
    with pytest.raises(ValueError, match=r"holds no pattern .*sel.query\(query_h, k"):
        compare(q, kk, v, res)
    # The recipe: route each head's queries again; the routed keys are exactly the keys attend() read,
    # so metrics' own float64 sparse attention over them reproduces the result's output.
    pats = [sa.get_selector(spec).build(kk[h]).query(q[h], 16) for h in range(H)]
    rep = compare(q, kk, v, pats, sparse_output=res.output)
    own = compare(q, kk, v, pats)  # float64 sparse output computed by metrics from the patterns
    for h in range(H):
        dense = brute_force(q[h], kk[h], v[h], pats[h])
        np.testing.assert_allclose(res.output[h], dense["o_sparse"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(rep.rel_error, own.rel_error, rtol=1e-8, atol=1e-12)
    assert (rep.n_selected > 16).all()  # block mode reads whole clusters, more than k keys per query


def test_mass_error_profile_hand_worked():
    """Reference rows (1, 0): a row's relative error is its distance to (1, 0).  Errors 0, .1, .2, .3, .4 at
    masses .99, .95, .92, .6, .3; bins [0, .5), [.5, .9), [.9, 1]: 1, 1 and 3 rows; the last bin's
    median is .1 and its p90 (linear interpolation between .1 and .2 at 0.8) .18."""
    from sparseattn.metrics import mass_error_profile

    ref = np.tile([1.0, 0.0], (5, 1))
    approx = np.array([[1.0, 0.0], [1.1, 0.0], [1.0, 0.2], [0.7, 0.0], [1.0, 0.4]])
    mass = np.array([0.99, 0.95, 0.92, 0.6, 0.3])
    prof = mass_error_profile(approx, ref, mass, bins=[0.0, 0.5, 0.9, 1.0])
    np.testing.assert_array_equal(prof["rows"], [1, 1, 3])
    assert prof["rows"].dtype == np.int64
    np.testing.assert_allclose(prof["median_err"], [0.4, 0.3, 0.1], atol=1e-12)
    np.testing.assert_allclose(prof["p90_err"], [0.4, 0.3, 0.18], atol=1e-12)
    np.testing.assert_allclose(prof["mean_mass"], [0.3, 0.6, (0.99 + 0.95 + 0.92) / 3], atol=1e-12)
    np.testing.assert_array_equal(prof["lo"], [0.0, 0.5, 0.9])
    np.testing.assert_array_equal(prof["hi"], [0.5, 0.9, 1.0])
    # (batch, head) leading dims pool every row; mass exactly 1 falls in the last bin; empty bins are NaN
    approx2 = np.stack([approx[:3], approx[:3]])[None]  # (1, 2, 3, 2)
    ref2 = np.stack([ref[:3], ref[:3]])[None]
    m2 = np.array([[[1.0, 0.95, 0.95], [1.0, 0.95, 0.95]]])
    prof2 = mass_error_profile(approx2, ref2, m2, bins=[0.0, 0.5, 1.0])
    np.testing.assert_array_equal(prof2["rows"], [0, 6])
    assert np.isnan(prof2["median_err"][0]) and np.isnan(prof2["p90_err"][0])
    np.testing.assert_allclose(prof2["median_err"][1], 0.1, atol=1e-12)


def test_mass_error_profile_argument_errors():
    from sparseattn.metrics import mass_error_profile

    o = np.ones((4, 2))
    with pytest.raises(ValueError, match=r"mass_kept must have shape \(4,\)"):
        mass_error_profile(o, o, np.ones(3))
    with pytest.raises(ValueError, match=r"mass_kept must hold finite values in \[0, 1\]"):
        mass_error_profile(o, o, np.array([0.5, 1.2, 0.1, 0.2]))
    with pytest.raises(ValueError, match=r"mass_kept must hold finite values in \[0, 1\]"):
        mass_error_profile(o, o, np.array([0.5, np.nan, 0.1, 0.2]))
    with pytest.raises(ValueError, match="bins must be >= 2 strictly increasing edges"):
        mass_error_profile(o, o, np.full(4, 0.5), bins=[0.0, 0.9, 0.5])
    with pytest.raises(ValueError, match="bins must be >= 2 strictly increasing edges"):
        mass_error_profile(o, o, np.full(4, 0.5), bins=[0.5])
