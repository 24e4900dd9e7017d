"""``sparseattn decode``: the KVCache decode workload per selector, on small data, checked against a float64
oracle computed here (exact attention over the cache, the window selector's keys worked out by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sparseattn.tools import decode_report
from sparseattn.tools.cli import main

H, S, E, STEPS = 2, 600, 16, 4
ROW_FIELDS = {"selector", "p50_ms", "p99_ms", "mean_ms", "step_ms", "prefill_s", "append_us_per_token", "kv_bytes",
              "index_bytes", "index_over_kv", "keys_read", "read_fraction", "rel_err", "rel_err_max", "mass",
              "mass_min", "recall", "recall_min", "per_step", "speedup_vs_dense", "speedup_vs_sdpa"}


def oracle(k: np.ndarray, v: np.ndarray, q: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax(scale q k^T) v of one query (E,) over keys (m, E): output (Ev,) and the weights (m,)."""
    s = (k.astype(np.float64) @ q.astype(np.float64)) * scale
    w = np.exp(s - s.max())
    w /= w.sum()
    return w @ v.astype(np.float64), w


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
    """Self-attention arrays q, k, v (H, S, E) in an .npz: query i sits at position i."""
    r = np.random.default_rng(7)
    q = (2.0 * r.standard_normal((H, S, E))).astype(np.float32)
    k = (2.0 * r.standard_normal((H, S, E))).astype(np.float32)
    v = r.standard_normal((H, S, E)).astype(np.float32)
    path = tmp_path_factory.mktemp("own") / "qkv.npz"
    np.savez(path, q=q, k=k, v=v)
    return path, q, k, v


@pytest.fixture(scope="module")
def own_result(own_data, tmp_path_factory):
    path, *_ = own_data
    out = tmp_path_factory.mktemp("out")
    rc = main(["decode", "--data", str(path), "--steps", str(STEPS), "--selectors", "window,topk", "--k", str(S),
               "--format", "json", "--out", str(out), "--quiet", "--no-sdpa", "--threads", "1"])
    assert rc == 0
    return json.loads((out / "decode.json").read_text())


def test_exact_selectors_match_a_float64_oracle(own_data, own_result):
    _, q, k, v = own_data
    res = {r["selector"]: r for r in own_result["results"]}
    assert list(res) == ["dense", "window", "topk"]
    length = S - STEPS
    assert own_result["workload"]["length"] == length and own_result["workload"]["queries"].startswith("the data's")
    # the cache's own outputs against the oracle: dense and top-k with k >= every key are exact attention
    from sparseattn import KVCache

    for sel in ("dense", "topk"):
        cache = KVCache(H, E, selector=sel)
        cache.append(k[:, :length], v[:, :length])
        for s in range(STEPS):
            m = length + s + 1
            cache.append(k[:, m - 1:m], v[:, m - 1:m])
            out = cache.attend(q[:, m - 1][:, None], k=S)[:, 0]
            for h in range(H):
                ref, _ = oracle(k[h, :m], v[h, :m], q[h, m - 1], 1 / np.sqrt(E))
                assert np.linalg.norm(out[h] - ref) / np.linalg.norm(ref) < 1e-5
    for sel in ("dense", "topk"):
        r = res[sel]
        assert r["rel_err_max"] < 1e-5, (sel, r["rel_err_max"])
        assert r["mass_min"] > 1 - 1e-5 and r["recall_min"] == 1.0
        assert r["keys_read"] == pytest.approx(length + (STEPS + 1) / 2)  # every key of each step (k = S)


def test_window_accuracy_matches_the_oracle_worked_by_hand(own_data, own_result):
    """KVCache's window selector reads sinks (positions 0-3) and the newest 64 keys: its error, mass and
    recall@S per step, recomputed here from the float64 oracle, are what the report says."""
    _, q, k, v = own_data
    length = S - STEPS
    win = next(r for r in own_result["results"] if r["selector"] == "window")
    for s in range(STEPS):
        m = length + s + 1
        errs, masses, recalls = [], [], []
        for h in range(H):
            ref, w = oracle(k[h, :m], v[h, :m], q[h, m - 1], 1 / np.sqrt(E))
            keep = np.r_[0:4, m - 64:m]
            sub, _ = oracle(k[h, keep], v[h, keep], q[h, m - 1], 1 / np.sqrt(E))
            errs.append(np.linalg.norm(sub - ref) / np.linalg.norm(ref))
            masses.append(w[keep].sum())
            recalls.append(len(keep) / min(S, m))  # the exact top-S of m <= S keys is every key
        assert win["per_step"]["rel_err"][s] == pytest.approx(np.mean(errs), rel=1e-4)
        assert win["per_step"]["mass"][s] == pytest.approx(np.mean(masses), rel=1e-4)
        assert win["per_step"]["recall"][s] == pytest.approx(np.mean(recalls), rel=1e-12)
    assert win["keys_read"] == 68.0
    assert win["rel_err"] > 1e-2  # the window drops most of the softmax mass of these keys


def test_results_dict_has_the_fields(own_result):
    assert own_result["schema"] == "sparseattn.decode/1"
    assert {"data", "workload", "k", "dtype", "machine", "sdpa", "fairness", "results", "created"} <= set(own_result)
    assert own_result["sdpa"] is None and own_result["fairness"]["reason"] == "SDPA not timed (sdpa=False, --no-sdpa)"
    for r in own_result["results"]:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert len(r["step_ms"]) == STEPS and len(r["per_step"]["mass"]) == STEPS
        assert r["p99_ms"] >= r["p50_ms"] > 0 and r["kv_bytes"] == H * S * 2 * E * 4
        assert r["speedup_vs_sdpa"] is None
    dense = own_result["results"][0]
    assert dense["speedup_vs_dense"] == 1.0


def test_in_process_synthetic_with_clustering_and_progress(tmp_path, capsys, monkeypatch):
    """4,400 keys: the cluster selector clusters a segment (64 clusters, 32 probed) and reads fewer keys;
    with SPARSEATTN_PROGRESS=lines, one ``[i/n]`` progress line per step goes to stderr."""
    monkeypatch.setenv("SPARSEATTN_PROGRESS", "lines")
    rc = main(["decode", "--data", "synthetic:n=4400,d=16,kind=clustered,seed=1", "--heads", "2", "--steps", "3",
               "--selectors", "cluster,pages", "--dtype", "float16", "--format", "table,md", "--out",
               str(tmp_path / "r"), "--no-sdpa", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "[2/4] step 1/3" in err and "[4/4] step 3/3" in err
    lines = out.splitlines()
    assert lines[0].startswith("sparseattn decode: synthetic clustered keys — 2 head(s), E=16, cache 4,397 keys + "
                               "3 steps, float16 storage")
    assert [ln.split()[0] for ln in lines[3:6]] == ["dense", "cluster", "pages"]
    assert (tmp_path / "r" / "decode.md").read_text().startswith("# sparseattn decode:")
    wl = decode_report.open_source("synthetic:n=4400,d=16,kind=clustered,seed=1").workload(2, 4397, 3)
    res = decode_report.run_decode(wl, ["cluster"], k=64, sdpa=False)
    cl = res["results"][1]
    assert cl["keys_read"] < 3000 and cl["index_bytes"] > res["results"][0]["index_bytes"]
    assert 0 < cl["mass_min"] <= cl["mass"] <= 1 and 0 <= cl["recall_min"] <= cl["recall"] <= 1
    assert res["results"][0]["rel_err_max"] < 2e-3  # dense over float16-rounded keys: rounding only


def test_subprocess(tmp_path):
    env = dict(os.environ, SPARSEATTN_DEBUG="0")
    cmd = [sys.executable, "-m", "sparseattn.tools.cli", "decode", "--data", "synthetic:n=300,d=8,seed=2", "--heads", "2",
           "--steps", "3", "--selectors", "window", "--format", "table,json", "--out", str(tmp_path), "--quiet",
           "--no-sdpa"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout.splitlines()[3].startswith("dense (ours, exact)")
    assert proc.stdout.splitlines()[-1] == f"wrote {tmp_path / 'decode.json'}"
    res = json.loads((tmp_path / "decode.json").read_text())
    assert [r["selector"] for r in res["results"]] == ["dense", "window"]


def test_sdpa_baseline_in_run_and_in_a_fresh_process(tmp_path, capsys):
    pytest.importorskip("torch")
    rc = main(["decode", "--data", "synthetic:n=300,d=8,seed=2", "--heads", "2", "--steps", "3", "--selectors",
               "window", "--format", "table,json", "--out", str(tmp_path), "--quiet", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", err
    assert "torch SDPA (exact)" in out and "SDPA baseline check:" in out
    res = json.loads((tmp_path / "decode.json").read_text())
    sd = res["sdpa"]
    assert sd["rel_err_max"] < 1e-5 and len(sd["step_ms"]) == 3  # torch's float32 output vs the float64 reference
    assert sd["in_run"]["p50_ms"] > 0 and sd["fresh"]["p50_ms"] > 0
    assert sd["p50_ms"] == min(sd["in_run"]["p50_ms"], sd["fresh"]["p50_ms"])  # the faster is the baseline
    assert res["fairness"]["baseline"] in ("fresh", "in_run") and res["fairness"]["ratio"] > 0
    for r in res["results"]:
        assert r["speedup_vs_sdpa"] == pytest.approx(sd["p50_ms"] / r["p50_ms"])


def test_own_arrays_with_positions_are_appended_in_position_order(tmp_path):
    """k_pos orders the keys; q_pos places each step's query: a shuffled file gives the in-order workload."""
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((2, 50, 4)).astype(np.float32) for _ in range(3))
    perm = r.permutation(50)
    np.savez(tmp_path / "shuffled.npz", q=q[:, perm], k=k[:, perm], v=v[:, perm], q_pos=perm + 100, k_pos=perm + 100)
    wl = decode_report.open_source(str(tmp_path / "shuffled.npz")).workload(2, 45, 5)
    assert wl.queries == "the data's queries at the step positions"
    np.testing.assert_array_equal(wl.k, k)
    np.testing.assert_array_equal(wl.v, v)
    np.testing.assert_array_equal(wl.q, q[:, 45:])
    np.savez(tmp_path / "cross.npz", q=q[:, :7], k=k, v=v)  # 7 queries, no positions: evenly spaced ones
    wl = decode_report.open_source(str(tmp_path / "cross.npz")).workload(1, 47, 3)
    assert wl.queries == "3 evenly spaced of the data's 7 queries"
    np.testing.assert_array_equal(wl.q[0], q[0, [0, 3, 6]])


def test_data_whose_scores_overflow_names_the_data_and_what_to_change(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "big.npz"
    np.savez(path, q=(rng.standard_normal((2, 300, 16)) * 1e20).astype(np.float32),
             k=(rng.standard_normal((2, 300, 16)) * 1e20).astype(np.float32),
             v=rng.standard_normal((2, 300, 16)).astype(np.float32))
    assert main(["decode", "--data", str(path), "--steps", "4", "--format", "table", "--quiet", "--no-sdpa",
                 "--selectors", "window"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"sparseattn decode: error: --data {path}: attention scores "
                                                   f"overflow float32")
    assert "a smaller 'scale' array in it" in err


def test_bad_scale_array_shows_its_value(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "s.npz"
    np.savez(path, q=rng.standard_normal((2, 300, 16)).astype(np.float32),
             k=rng.standard_normal((2, 300, 16)).astype(np.float32),
             v=rng.standard_normal((2, 300, 16)).astype(np.float32), scale=np.array(-1.0))
    assert main(["decode", "--data", str(path), "--steps", "4", "--format", "table", "--quiet", "--no-sdpa"]) == 2
    assert "array 'scale' must hold one finite number > 0; got shape (), dtype float64, value -1.0." in \
        capsys.readouterr().err
