"""The oracle tail-floor estimator of benchmarks/bench_tail_floor.py against hand-checkable facts on tiny data."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_tail_floor.py")
_spec = importlib.util.spec_from_file_location("bench_tail_floor", _PATH)
btf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(btf)

S, E = 40, 4


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(3, E)), rng.normal(size=(S, E)), rng.normal(size=(S, E)), 1.3


def _brute(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, kp: int):
    """Independent float64 reference: true output, exact top-k' sums and the tail sums by full sort."""
    s = k @ q * scale
    w = np.exp(s - s.max())
    order = np.argsort(-s)
    sel, tail = order[:kp], order[kp:]
    return (w @ v) / w.sum(), w[sel] @ v[sel], w[sel].sum(), w[tail] @ v[tail], w[tail].sum(), w, tail


@pytest.mark.parametrize("proposal", btf.PROPOSALS)
def test_everything_exact_is_exact(proposal: str) -> None:
    q, k, v, scale = _data()
    err = btf.oracle_errors(q, k, v, scale, S, S, proposal, np.random.default_rng(0), 3)
    assert err.shape == (3, 3)
    assert np.all(err < 1e-12)
    # a budget above S with split S: still nothing to sample, still exact
    err = btf.oracle_errors(q, k, v, scale, S + 8, S, proposal, np.random.default_rng(0), 2)
    assert np.all(err < 1e-12)


def test_plain_top_b_matches_brute_force() -> None:
    q, k, v, scale = _data(1)
    for b in (1, 5, 17):
        err = btf.oracle_errors(q, k, v, scale, b, b, "weights", np.random.default_rng(0), 2)
        for i in range(q.shape[0]):
            o, n_sel, d_sel, *_ = _brute(q[i], k, v, scale, b)
            want = np.linalg.norm(n_sel / d_sel - o) / np.linalg.norm(o)
            np.testing.assert_allclose(err[i], want, rtol=1e-10)


@pytest.mark.parametrize("kp,m", [(0, 7), (5, 3), (20, 20)])
def test_weights_proposal_denominator_is_exact(kp: int, m: int) -> None:
    q, k, v, scale = _data(2)
    s = k @ q[0] * scale
    _, est = btf.query_estimates(s, v, [(kp + m, kp, "weights")], np.random.default_rng(3), 5)
    o, n_sel, d_sel, n_tail, d_tail, *_ = _brute(q[0], k, v, scale, kp)
    e = est[(kp + m, kp, "weights")]
    np.testing.assert_allclose(e["d_hat"], d_tail, rtol=1e-12)
    np.testing.assert_allclose(e["d_tail"], d_tail, rtol=1e-12)
    np.testing.assert_allclose(e["n_tail"], n_tail, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(e["n_sel"], n_sel, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(e["d_sel"], d_sel, rtol=1e-12)
    # with p ~ w the estimate is the exact part plus the mean of the sampled values, scaled by the tail mass
    assert e["out"].shape == (5, E)
    assert not np.allclose(e["n_hat"], n_tail)  # the numerator is a random estimate, not the true sum


@pytest.mark.parametrize("proposal", btf.PROPOSALS)
def test_numerator_and_denominator_unbiased(proposal: str) -> None:
    q, k, v, scale = _data(4)
    kp, m, draws = 6, 4, 20000
    s = k @ q[1] * scale
    _, est = btf.query_estimates(s, v, [(kp + m, kp, proposal)], np.random.default_rng(5), draws)
    _, _, _, n_tail, d_tail, *_ = _brute(q[1], k, v, scale, kp)
    e = est[(kp + m, kp, proposal)]
    # mean over draws within 5 standard errors (estimated from the draws) of the true tail sums
    se_n = e["n_hat"].std(axis=0) / np.sqrt(draws)
    assert np.all(np.abs(e["n_hat"].mean(axis=0) - n_tail) <= 5 * se_n + 1e-12)
    se_d = e["d_hat"].std() / np.sqrt(draws)
    assert abs(e["d_hat"].mean() - d_tail) <= 5 * se_d + 1e-12 * d_tail
    assert se_n.max() < 0.05 * np.abs(n_tail).max()  # the tolerance is tight enough to catch a bias


def test_samples_come_from_the_tail_only() -> None:
    """With a proposal over the tail only, each drawn key is outside the exact top-k': a value set to a huge
    number on the top-k' keys must not reach N_hat."""
    q, k, v, scale = _data(6)
    kp = 10
    s = k @ q[0] * scale
    top = np.argsort(-s)[:kp]
    v2 = v.copy()
    v2[top] = 1e6
    for prop in btf.PROPOSALS:
        _, est = btf.query_estimates(s, v2, [(kp + 8, kp, prop)], np.random.default_rng(7), 50)
        assert np.abs(est[(kp + 8, kp, prop)]["n_hat"]).max() < 1e3


def test_one_hot_attention_top1_is_exact() -> None:
    rng = np.random.default_rng(8)
    k = rng.normal(size=(S, E))
    k[:, 0] = 0.0
    k[7] = np.eye(E)[0]
    v = rng.normal(size=(S, E))
    q = 60.0 * np.eye(E)[[0]]  # score 60 for key 7, 0 for every other: tail mass 39 exp(-60) ~ 3e-25
    err = btf.oracle_errors(q, k, v, 1.0, 1, 1, "weights", np.random.default_rng(0), 2)
    assert np.all(err < 1e-12)
    err_all = btf.oracle_errors(q, k, v, 1.0, 4, 0, "weights", np.random.default_rng(0), 4)
    assert np.all(err_all < 1e-12)  # every sample lands on key 7 (probability 1 - 3e-25)


def test_optimal_beats_weights_on_average() -> None:
    """The variance-optimal proposal gives a smaller mean squared error than p ~ w on the same query."""
    q, k, v, scale = _data(9)
    errs = {p: btf.oracle_errors(q, k, v, scale, 8, 2, p, np.random.default_rng(10), 3000) for p in btf.ORACLES}
    assert (errs["optimal"] ** 2).mean() < (errs["weights"] ** 2).mean()


@pytest.mark.parametrize("args,match", [((0, 0, "weights", 1), "budget"), ((4, 5, "weights", 1), "split"),
                                        ((4, 2, "bogus", 1), "proposal"), ((4, 2, "weights", 0), "draws")])
def test_bad_arguments(args, match) -> None:
    q, k, v, scale = _data()
    b, kp, prop, draws = args
    with pytest.raises(ValueError, match=match):
        btf.oracle_errors(q, k, v, scale, b, kp, prop, np.random.default_rng(0), draws)


def test_splits() -> None:
    assert btf.splits(64) == [0, 16, 32, 48, 64]
    assert btf.splits(2) == [0, 1, 2]
