"""benchmarks/bench_sketch_floor.py: flags refused with one line naming them (exit 2), its read kernels sum
exactly the bytes they claim on hand-built arrays, and a tiny run reports a floor that is the sum of its
two reads, with the read-rows kernel reading as many key rows as the step counts."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_sketch_floor.py")
_spec = importlib.util.spec_from_file_location("bench_sketch_floor", _PATH)
bsf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsf)


@pytest.mark.parametrize("argv, flag", [(["--heads", "0"], "--heads"), (["--steps", "x"], "--steps"),
                                        (["--flush-mb", "0"], "--flush-mb"), (["--lengths", "100"], "--lengths"),
                                        (["--lengths", "a,b"], "--lengths"), (["--settings", "fast"], "--settings"),
                                        (["--settings", ""], "--settings"),
                                        (["--workload", "needle"], "--workload")])
def test_bad_flags_are_refused_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bsf.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


def test_read_kernels_sum_exactly_their_bytes() -> None:
    codes = np.arange(2 * 6 * 1, dtype=np.uint64).reshape(2, 6, 1)
    fac = np.full((2, 6), 3, np.uint32)
    pos = np.arange(12, dtype=np.int32).reshape(2, 6)
    out = np.zeros(2, np.uint64)
    bsf.read_scan(codes, fac, pos, np.array([1, 0]), np.array([4, 2]), out)
    # head 0, slots 1..3: codes 1 + 2 + 3, factors 3 x 3, positions 1 + 2 + 3; head 1, slots 0..1: codes 6 + 7,
    # factors 2 x 3, positions 6 + 7
    assert out.tolist() == [6 + 9 + 6, 13 + 6 + 13]
    K = np.arange(2 * 5 * 2, dtype=np.uint64).reshape(2, 5, 2)
    V = 100 + K
    rec = np.array([[[1, 3], [4, 5]], [[0, 1], [0, 0]]], np.int64)
    bsf.read_rows(K, V, rec, np.array([2, 1]), out)
    want0 = sum(int(K[0, j].sum() + V[0, j].sum()) for j in (1, 2, 4))
    want1 = int(K[1, 0].sum() + V[1, 0].sum())
    assert out.tolist() == [want0, want1]


def test_dense64_matches_a_hand_computed_softmax() -> None:
    rng = np.random.default_rng(3)
    K = rng.standard_normal((2, 100, 64)).astype(np.float32)
    V = rng.standard_normal((2, 100, 64)).astype(np.float32)
    qs = rng.standard_normal((3, 2, 64)).astype(np.float32)
    out, top = bsf.dense64(K, V, qs, 0.125)
    for t in range(3):
        for h in range(2):
            s = [float(np.dot(K[h, j].astype(np.float64), qs[t, h].astype(np.float64))) * 0.125 for j in range(100)]
            w = np.exp(np.array(s) - max(s))
            np.testing.assert_allclose(out[t, h], (w / w.sum()) @ V[h].astype(np.float64), rtol=1e-12, atol=1e-12)
            best = np.argsort(s)[-64:]
            wt = w[best] / w[best].sum()
            np.testing.assert_allclose(top[t, h], wt @ V[h, best].astype(np.float64), rtol=1e-12, atol=1e-12)
    assert bsf.rel_err(np.array([[3.0, 4.0]]), np.array([[0.0, 5.0]])) == pytest.approx(np.sqrt(10) / 5)


def test_tiny_run_reports_floor_as_the_sum_of_its_reads(tmp_path) -> None:
    out = tmp_path / "floor"
    assert bsf.main(["--lengths", "16384", "--heads", "2", "--steps", "2", "--flush-mb", "8",
                     "--settings", "default", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    r = res["cases"][0]["settings"]["default"]
    m = r["ms"]
    assert m["floor"] == pytest.approx(m["read scan"] + m["read rows"])
    assert r["x_sdpa_floor"] == pytest.approx(m["sdpa"] / m["floor"])
    assert 1024 <= r["keys_read"] < 16384 and 0 < r["index_over_kv"] < 0.1
    assert r["floor_rows"] == r["keys_read"]  # read rows touches exactly the key rows the step reads
    # the accuracy of the timed steps (passkey-gaussian, the default workload): at 16,384 keys the default
    # estimates every key from its 4-bit code and reads the best 1,024 exactly, so it finds the planted keys
    # and the exact top-64 and errs less than exact top-64 attention
    case = res["cases"][0]
    assert case["workload"] == "passkey-gaussian" and case["planted"] == 4
    assert r["planted_recall_min"] == 1.0 and 0.95 <= r["recall64_min"] <= r["recall64"] <= 1.0
    assert 0.5 < r["mass"] <= 1.0 and 0.0 <= r["rel_err"] < case["top64_rel_err"]
    assert "| passkey-gaussian | 16,384 (2) | default | 1.000 (1.00) |" in out.with_suffix(".md").read_text()


def test_gaussian_workload_reports_no_planted_recall(tmp_path) -> None:
    out = tmp_path / "floor"
    assert bsf.main(["--workload", "gaussian", "--lengths", "16384", "--heads", "1", "--steps", "2",
                     "--flush-mb", "8", "--settings", "default", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    case = res["cases"][0]
    assert case["planted"] == 0 and case["scale"] == 0.125
    r = case["settings"]["default"]
    assert r["planted_recall"] is None and 0.0 <= r["recall64"] <= 1.0 and r["rel_err"] >= 0.0
    assert "NaN" not in out.with_suffix(".json").read_text()
    assert "| gaussian | 16,384 (1) | default | - |" in out.with_suffix(".md").read_text()
