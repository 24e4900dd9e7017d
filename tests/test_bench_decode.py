"""benchmarks/bench_decode.py: its flags refuse bad values, and a tiny run spreads its steps as documented
(``--stride`` tokens appended before each step, every timed call timed once per step, accuracy recomputed
against exact attention)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_decode.py")
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)


@pytest.mark.parametrize("flag", ["--steps", "--stride"])
@pytest.mark.parametrize("bad", ["0", "-3", "x", "1.5"])
def test_bad_counts_are_refused_naming_the_flag(flag: str, bad: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bd.main([flag, bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {flag} must be " in err


def test_tiny_run_spreads_steps_over_stride_tokens(tmp_path) -> None:
    steps, stride, n = 3, 5, 512
    out = tmp_path / "decode-tiny.json"
    assert bd.main(["--lengths", str(n), "--kinds", "clustered", "--steps", str(steps), "--stride", str(stride),
                    "--no-real", "--no-gqa", "--no-storage", "--no-cap", "--no-estimate", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["steps"] == steps and data["meta"]["stride"] == stride
    main, pages = data["results"]
    assert main["case"] == "clustered" and main["n"] == n and pages["case"] == "clustered/pages"
    sel = main["selectors"]
    assert set(sel) == {"cluster", "topk-64", "window", "dense (ours)", "torch sdpa"}
    for r in sel.values():  # every timed call once per step
        assert r["steps"] == steps and len(r["step_ms"]) == steps and all(t > 0 for t in r["step_ms"])
    # exact top-64 reads 64 keys and recalls all of the exact top-64 (the harness recomputes it)
    assert sel["topk-64"]["keys_read"] == 64 and sel["topk-64"]["recall64"] == 1.0
    # at this size the window holds the cache's newest 64 keys + 4 sinks
    assert sel["window"]["keys_read"] == 68
    # read fraction over the mean cache length of the steps: n + stride * (steps + 1) / 2
    mean_len = n + stride * (steps + 1) / 2
    assert np.isclose(sel["window"]["read_fraction"], 68 / mean_len)
    for lab in ("cluster", "topk-64", "window"):
        assert np.isfinite(sel[lab]["rel_err"]) and 0 < sel[lab]["mass"] <= 1 + 1e-6
    md = out.with_suffix(".md").read_text()
    assert f"{steps} steps with {stride} tokens appended before each" in md
