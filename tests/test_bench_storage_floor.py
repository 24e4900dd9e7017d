"""benchmarks/bench_storage_floor.py: its flags refuse bad values, and a tiny run measures every level for
every storage, its read kernel touches exactly the key rows the decode step reads (checked by the harness
against the step's own count), and the report's floor is computed from the measured medians."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_storage_floor.py")
_spec = importlib.util.spec_from_file_location("bench_storage_floor", _PATH)
bsf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsf)


@pytest.mark.parametrize("flag", ["--n", "--steps", "--stride", "--flush-mb"])
@pytest.mark.parametrize("bad", ["0", "-3", "x", "1.5"])
def test_bad_counts_are_refused_naming_the_flag(flag: str, bad: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bsf.main([flag, bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {flag} must be " in err


def test_read_kernel_reads_the_recorded_ranges_and_routing_vectors() -> None:
    # hand-built: 2 kv heads, 5 slots of 2 words; row 0 (head 0) reads slots [1, 3), row 1 (head 1) [0, 1)
    K = np.arange(2 * 5 * 2, dtype=np.uint64).reshape(2, 5, 2)
    V = 100 + np.arange(2 * 5 * 2, dtype=np.uint64).reshape(2, 5, 2)
    pos = np.arange(10, dtype=np.int32).reshape(2, 5)
    cent = np.ones((2, 3, 1), np.uint64)
    cscale = np.full((2, 3), 0.5, np.float32)
    n_cent = np.array([3, 1])
    rec = np.array([[[1, 3, 0]], [[0, 1, 0]]], np.int64)
    n_rec = np.array([1, 1])
    out = np.empty(2, np.float32)
    for dist in (0, 2):
        assert bsf.read(K, V, pos, cent, cscale, n_cent, 1, 1, rec, n_rec, dist, out) == 3
        # row 0: K words 2..5 + V words 102..105 + 3 routing words = 14 + 414 + 3 = 431; positions 1 + 2,
        # scales 1.5
        assert out[0] == np.float32(431 & 0xFFFF) + np.float32(3 + 1.5)
        # row 1: K words 10, 11 + V 110, 111 + 1 routing word = 243; position 5, scale 0.5
        assert out[1] == np.float32(243) + np.float32(5 + 0.5)


def test_tiny_run_measures_every_level_and_storage(tmp_path) -> None:
    out = tmp_path / "storage-floor-tiny.json"
    assert bsf.main(["--n", "4096", "--steps", "3", "--stride", "4", "--flush-mb", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    meta, res = data["meta"], data["results"]
    assert meta["n"] == 4096 and meta["steps"] == 3 and meta["stride"] == 4
    assert set(res["levels"]) == set(bsf.LEVELS)
    for row in res["levels"].values():
        for mode in ("cold", "warm"):
            for s in ("float32", "float16", "bfloat16"):
                ms = row[mode]["ms"][s]
                assert len(ms) == 3 and all(t >= 0 for t in ms)
                assert row[mode]["p50_ms"][s] == pytest.approx(float(np.median(ms)), rel=1e-3, abs=1e-4)
            assert row[mode]["f16_over_f32"] == pytest.approx(
                row[mode]["p50_ms"]["float16"] / row[mode]["p50_ms"]["float32"])
    for s in ("float32", "float16", "bfloat16"):
        assert 0 < res["keys_read_per_head"][s] <= 4096 + 3 * 4
        assert res["levels"]["kernel"]["cold"]["p50_ms"][s] <= res["levels"]["step"]["cold"]["p50_ms"][s]
    lv = res["levels"]
    floor = min(lv["read"]["cold"]["p50_ms"]["float16"], lv["read+prefetch"]["cold"]["p50_ms"]["float16"]) / min(
        lv["read"]["cold"]["p50_ms"]["float32"], lv["read+prefetch"]["cold"]["p50_ms"]["float32"])
    md = out.with_suffix(".md").read_text()
    assert f"takes {floor:.2f}x the float32 time" in md


@pytest.mark.parametrize("argv, needle", [
    (["--flush-mb", "99999999"], "--flush-mb must be from 1 to 16384 (MB); got 99999999"),
    (["--out", ""], "--out ''"),
    (["--out", "."], "give a file path"),
    (["--out", "/proc/sparseattn-x/r.json"], "cannot create"),
])
def test_bad_out_and_flush_refused_before_any_work(argv: list[str], needle: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bsf.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
