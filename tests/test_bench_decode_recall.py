"""benchmarks/bench_decode_recall.py: flags refused with one line naming them (exit 2), its float64 oracle
against torch SDPA, and a tiny run whose exact settings measure what they must (recall 1, the oracle's error)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_decode_recall.py")
_spec = importlib.util.spec_from_file_location("bench_decode_recall", _PATH)
bdr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bdr)


@pytest.mark.parametrize("argv, flag", [
    (["--lengths", "0"], "--lengths"),
    (["--lengths", "x"], "--lengths"),
    (["--lengths", "100"], "--lengths"),
    (["--heads", "-1"], "--heads"),
    (["--heads-1m", "0"], "--heads-1m"),
    (["--queries", "1.5"], "--queries"),
    (["--n-planted", "17"], "--n-planted"),
    (["--hnsw-max", ""], "--hnsw-max"),
    (["--seed", "-2"], "--seed"),
    (["--workloads", "passkey-bogus"], "--workloads"),
    (["--settings", "default,fast"], "--settings"),
    (["--out", "results.txt"], "--out"),
    (["--out", "/nonexistent-dir/x.json"], "--out"),
    (["--bogus"], "--bogus"),
])
def test_bad_flags_are_refused_in_one_line(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bdr.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1


def test_oracle_matches_torch_sdpa_in_float64(rng: np.random.Generator) -> None:
    H, n, d = 3, 300, 16
    K = rng.standard_normal((H, n, d)).astype(np.float32)
    V = rng.standard_normal((H, n, d)).astype(np.float32)
    q = rng.standard_normal((H, d)).astype(np.float32)
    o = bdr.oracle(K, V, q, 0.25)
    t = lambda a: torch.from_numpy(a.astype(np.float64))[None]  # noqa: E731
    ref = torch.nn.functional.scaled_dot_product_attention(t(q)[:, :, None], t(K), t(V), scale=0.25)
    np.testing.assert_allclose(o["out"], ref[0, :, 0].numpy(), rtol=1e-10, atol=1e-12)
    s = np.einsum("hnd,hd->hn", K.astype(np.float64), q.astype(np.float64)) * 0.25
    np.testing.assert_allclose(o["lse"], np.log(np.exp(s).sum(1)), rtol=1e-12)
    for h in range(H):  # the top-64 in descending order, and attention over exactly them
        np.testing.assert_array_equal(o["top"][h], np.argsort(-s[h], kind="stable")[:64])
        w = np.exp(s[h, o["top"][h]] - s[h].max())
        np.testing.assert_allclose(o["top_out"][h], w @ V[h, o["top"][h]].astype(np.float64) / w.sum(), rtol=1e-10)


def test_tiny_run_measures_exact_settings_exactly(tmp_path) -> None:
    out = tmp_path / "recall.json"
    assert bdr.main(["--lengths", "512", "--heads", "2", "--queries", "2", "--workloads", "passkey-clustered",
                     "--settings", "default,topk", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (case,) = res["cases"]
    assert case["n"] == 512 and case["heads"] == 2 and case["n_planted"] == 4 and case["planted_mass"] >= 0.5
    dflt, topk = case["settings"]["default"], case["settings"]["topk"]
    # 512 keys sit in the default cache's exact tail: it reads every key, i.e. dense attention
    assert dflt["planted_recall"] == 1.0 and dflt["recall64"] == 1.0 and dflt["keys_read"] == 512
    assert dflt["rel_err"] < 1e-4 and abs(dflt["mass"] - 1.0) < 1e-4
    # exact top-64: all of the top-64, the oracle's top-64 error (float32 vs float64)
    assert topk["recall64"] == 1.0 and topk["planted_recall"] == 1.0 and topk["keys_read"] == 64
    assert abs(topk["rel_err"] - case["top64_rel_err"]) < 1e-4 and abs(topk["err_over_top64"] - 1.0) < 1e-3
    for r in (dflt, topk):
        assert r["p50_ms"] > 0 and r["sdpa_p50_ms"] > 0 and r["x_sdpa"] > 0
    md = out.with_suffix(".md").read_text()
    assert "passkey-clustered, n = 512" in md and "Timing is indicative" in md


def test_gqa_run_measures_the_full_cache_exactly(tmp_path) -> None:
    # 2 kv heads, 3 query heads each: 512 keys sit in the exact tail, so every query head's step is dense
    # attention over its kv head, which the oracle (head h -> kv head h // 3) must agree with
    out = tmp_path / "gqa.json"
    assert bdr.main(["--lengths", "512", "--heads", "2", "--gqa", "3", "--queries", "2", "--workloads",
                     "passkey-gaussian", "--settings", "default", "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["heads"] == 6 and case["kv_heads"] == 2
    r = case["settings"]["default"]
    assert r["planted_recall"] == 1.0 and r["recall64"] == 1.0 and r["rel_err"] < 1e-4
    assert "6 query / 2 kv heads (GQA)" in out.with_suffix(".md").read_text()
