"""The fuzz loop of benchmarks/fuzz.py, a few thousand cases, plus checks that the fuzz can find bugs.

The full run (100,000 cases) is ``python benchmarks/fuzz.py``; CI runs this subset.  Failures print the
fuzz report with the ``--seed S --case I`` pair that reproduces each one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

N_CASES = 6000  # ~1.1-2.5 ms a case on the 2-core CI machine: 7-15 s
SEED = 20240611
MAX_N = 24


def _load_fuzz():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("sparseattn_fuzz", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()


@pytest.fixture(scope="module")
def summary():
    return fuzz.run(N_CASES, SEED, MAX_N)


def test_fuzz_has_no_failures(summary):
    assert summary.cases == N_CASES
    assert summary.n_failures == 0, "\n" + fuzz.report(summary)


def test_fuzz_covers_every_kind(summary):
    for kind in fuzz.KINDS:
        assert summary.status[(kind, "ok")] >= 0.05 * N_CASES, fuzz.report(summary)
    # unsupported: only the documented "cannot run here" refusals (e.g. IVF-PQ with fewer keys than codes)
    assert summary.status[("selector", "unsupported")] <= 0.1 * summary.by_kind["selector"]


def test_fuzz_hits_no_known_bug(summary):
    assert not summary.known, "\n" + fuzz.report(summary)


def test_cases_are_reproducible():
    for case in (0, 7, 123, 999):
        assert fuzz.run_case(SEED, case, MAX_N) == fuzz.run_case(SEED, case, MAX_N)


def test_cli_prints_counts(capsys):
    assert fuzz.main(["--cases", "40", "--seed", "3", "--max-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "cases: 40 in" in out and "failures: 0 (crashes: 0" in out
    for kind in fuzz.KINDS:
        assert f"  {kind}" in out


# ------------------------------------------------------------------------------- the fuzz has teeth
def test_fuzz_detects_a_wrong_sparse_output(monkeypatch):
    real = fuzz.sa.sparse_attention

    def off_by_a_bit(*args, **kwargs):
        res = real(*args, **kwargs)
        if isinstance(res, tuple):
            out, lse = res
            return out + np.asarray(1e-2, out.dtype) * (out != 0), lse
        return res

    monkeypatch.setattr(fuzz.sa, "sparse_attention", off_by_a_bit)
    s = fuzz.run(150, SEED, 12)
    assert s.status[("full", "fail")] > 0 and s.status[("pattern", "fail")] > 0
    assert any("sparse: output error" in f[4] for f in s.failures)


def test_fuzz_detects_nan_and_nonzero_empty_rows(monkeypatch):
    real = fuzz.sa.scaled_dot_product_attention

    def poisoned(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        out = out.copy()
        out[..., :1, :] = np.nan if out.shape[-2] % 2 else 1.0
        return out, lse

    monkeypatch.setattr(fuzz.sa, "scaled_dot_product_attention", poisoned)
    s = fuzz.run(150, SEED, 12)
    messages = " ".join(f[4] for f in s.failures)
    assert "dense: " in messages and "NaN/Inf output values" in messages


def test_fuzz_detects_a_missing_error(monkeypatch):
    monkeypatch.setattr(fuzz.sa, "scaled_dot_product_attention", lambda *a, **k: None)
    s = fuzz.run(200, SEED, 12)
    assert any("invalid input accepted" in f[4] for f in s.failures)
