"""The command line's failure paths: every user error exits 2 with one line naming the option, before any
work; unexpected errors exit 1 with one line; Ctrl-C exits 130; bench exits non-zero when a case fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparseattn.tools import bench, cli, suite
from sparseattn.tools.cli import main

SMALL = ["--data", "synthetic:n=256,d=16,seed=0", "--repeats", "1", "--quiet"]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse usage errors leave through parser.exit
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(capsys, argv: list[str], *needles: str) -> str:
    rc, out, err = run(capsys, argv)
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"sparseattn {argv[0]}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in err and not out
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a kernel warm-up, a dense baseline or a selector run starts."""
    calls = []
    for name in ("warm_up", "time_dense", "run_selector"):
        monkeypatch.setattr(bench, name, lambda *a, _n=name, **k: calls.append(_n) or pytest.fail(f"{_n} ran"))
    return calls


@pytest.fixture
def files(tmp_path, rng):
    q = rng.standard_normal((32, 8)).astype(np.float32)
    np.savez(tmp_path / "good.npz", q=q, k=q, v=q)
    raw = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(raw[: len(raw) // 2])
    np.savez(tmp_path / "noq.npz", k=q, v=q)
    (tmp_path / "text.npz").write_text("hello world\n")
    (tmp_path / "afile").write_text("x")
    for name, text in (("nosha", '{"files": {"t": {"file": "t.npz"}}}'), ("list", "[1, 2]"),
                       ("badjson", "{bad json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
    return tmp_path


def test_out_that_is_not_a_folder(capsys, files, no_work):
    for out in (str(files / "afile"), "/dev/null"):
        assert_user_error(capsys, ["compare", *SMALL, "--out", out], f"--out {out}: exists and is not a folder")
    sub = str(files / "afile" / "sub")
    assert_user_error(capsys, ["compare", *SMALL, "--out", sub], f"--out {sub}:", "afile is a file, not a folder")
    assert_user_error(capsys, ["bench", "--out", "/dev/null"], "--out /dev/null: exists and is not a folder")
    assert_user_error(capsys, ["trace", "window", "--out", sub], "is a file, not a folder")


@pytest.mark.parametrize("name, needles", [
    ("trunc.npz", ["--data:", "trunc.npz is a damaged or unreadable .npz archive (BadZipFile"]),
    ("noq.npz", ["--data:", "has no array 'q' (or 'query'); found ['k', 'v']", "q (L, E)"]),
    ("text.npz", ["--data:", "text.npz is not an .npz archive", "numpy.savez(FILE, q=q, k=k, v=v)"]),
    ("missing.npz", ["--data:", "missing.npz does not exist"]),
    ("t@nosha", ["--data t@nosha:", "entry 't' lacks 'sha256'"]),
    ("t@list", ["--data t@list:", "manifest.json is not a sparseattn manifest", "got list"]),
    ("t@badjson", ["--data t@badjson:", "badjson/manifest.json is not valid JSON", "line 1, column 2"]),
    ("nonsense", ["--data: unknown data 'nonsense': no such file or fixture", "FILE.npz"]),
])
def test_bad_data(capsys, files, no_work, monkeypatch, name, needles):
    monkeypatch.chdir(files)
    assert_user_error(capsys, ["compare", "--data", name, "--selectors", "window", "--out", "r"], *needles)
    assert not (files / "r").exists()


@pytest.mark.parametrize("argv, needles", [
    (["compare", "--repeats", "0"], ["--repeats must be >= 1; got 0"]),
    (["compare", "--max-groups", "0"], ["--max-groups must be >= 1; got 0"]),
    (["compare", "--max-groups", "-3"], ["--max-groups must be >= 1; got -3"]),
    (["compare", "--k", "1e20"], ["--k must be an integer >= 1; got '1e20'"]),
    (["compare", "--k", "0"], ["--k must be >= 1; got 0"]),
    (["compare", "--threads", "0"], ["--threads must be from 1 to", "(the CPUs here); got 0"]),
    (["compare", "--threads", "999"], ["--threads must be from 1 to", "got 999"]),
    (["bench", "--threads", "0"], ["--threads must be from 1 to", "(the CPUs here); got 0"]),
    (["bench", "--threads", "999"], ["--threads must be from 1 to", "got 999"]),
    (["bench", "--repeats", "0"], ["--repeats must be >= 1; got 0"]),
    (["explain", "--scale", "abc"], ["--scale must be a number such as 0.5, or 'default'", "'abc'"]),
    (["explain", "--scale", "nan"], ["--scale must be a finite number"]),
    (["explain", "--decimals", "-1"], ["--decimals must be from 0 to 17; got -1"]),
    (["explain", "--query", "9"], ["--query must be between 1 and 3; got 9"]),
    (["compare", "--format", "pdf"], ["--format: unknown ['pdf']"]),
])
def test_bad_values_are_one_line_usage_errors(capsys, no_work, argv, needles):
    assert_user_error(capsys, argv, *needles, "sparseattn")


def test_unknown_option_is_one_line(capsys):
    rc, _, err = run(capsys, ["compare", "--bogus"])
    assert rc == 2 and err == "sparseattn: error: unrecognized arguments: --bogus (see `sparseattn --help`)\n"


@pytest.mark.parametrize("spec, needles", [
    ("windw", ["--selectors 'windw': unknown selector 'windw'; available:"]),
    ("window:width=4,width=8", ["--selectors 'window:width=4,width=8': parameter 'width' of 'window' is given twice"]),
    ("window:widht=4", ["--selectors 'window:widht=4':", "widht"]),
    ("window:width=-1", ["--selectors 'window:width=-1':", "width must be > 0"]),
    ("window:width=abc", ["--selectors 'window:width=abc':", "width must be an integer"]),
    ("faiss-hnsw:ef_search=100000000000", ["ef_search=100000000000 is too large; use at most 2,147,483,647"]),
    ("faiss-hnsw:M=100000000000", ["M=100000000000 is too large"]),
    ("faiss-hnsw:M=1e11", ["--selectors 'faiss-hnsw:M=1e11':", "M must be an integer"]),
    ("window+topk:block=99999999999", ["'window+topk:block=99999999999': topk: parameter block=99999999999 is too"]),
])
def test_bad_selector_specs_fail_before_any_work(capsys, tmp_path, no_work, spec, needles):
    out = tmp_path / "r"
    assert_user_error(capsys, ["compare", *SMALL, "--selectors", "window", spec, "--out", str(out)], *needles)
    assert not out.exists()  # no partial report


def test_unavailable_selector_fails_before_any_work(capsys, tmp_path, no_work, monkeypatch):
    from sparseattn.selectors import selector_classes

    monkeypatch.setattr(selector_classes()["kdtree"], "unavailable_reason",
                        classmethod(lambda cls: "scipy is missing; pip install scipy"))
    assert_user_error(capsys, ["compare", *SMALL, "--selectors", "kdtree", "--out", str(tmp_path / "r")],
                      "--selectors 'kdtree': selector 'kdtree' is unavailable: scipy is missing; pip install scipy")


def test_k_and_sizes_checked_against_the_data(capsys, no_work):
    assert_user_error(capsys, ["compare", *SMALL, "--k", "1000000000"],
                      "--k 1000000000 exceeds the 256 keys per group of --data synthetic:n=256,d=16,seed=0; use "
                      "--k <= 256")
    assert_user_error(capsys, ["compare", "--data", "window", "--k", "513", "--selectors", "window"],
                      "--k 513 exceeds the 512 keys per group of --data window")
    assert_user_error(capsys, ["compare", "--data", "synthetic:n=100000000000,d=16", "--selectors", "window"],
                      "MemoryError: --data synthetic:n=100000000000,d=16 needs about", "GiB are available; lower n")
    assert_user_error(capsys, ["compare", "--data", "synthetic:n=0,d=16"], "--data synthetic:n=0,d=16: n must be >= 1")


def test_safety_net_one_line_exit_1_and_debug_reraises(capsys, monkeypatch):
    import sparseattn.selectors as selectors_pkg  # `sparseattn selectors` lists selector_classes()

    def boom():
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(selectors_pkg, "selector_classes", boom)
    rc, _, err = run(capsys, ["selectors"])
    assert rc == 1 and err == ("sparseattn selectors: error: RuntimeError: something broke (set SPARSEATTN_DEBUG=1 "
                               "for the traceback)\n")
    monkeypatch.setattr(selectors_pkg, "selector_classes", lambda: (_ for _ in ()).throw(MemoryError("too big")))
    rc, _, err = run(capsys, ["selectors"])
    assert rc == 2 and err == "sparseattn selectors: error: MemoryError: too big\n"
    monkeypatch.setattr(selectors_pkg, "selector_classes", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    rc, _, err = run(capsys, ["selectors"])
    assert rc == 130 and err == "sparseattn selectors: interrupted\n"
    monkeypatch.setattr(selectors_pkg, "selector_classes", boom)
    monkeypatch.setenv("SPARSEATTN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something"):
        main(["selectors"])


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C handled by default, even when this pytest started with SIGINT ignored
    (``nohup ... &``), so the child's Python installs its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    env = dict(os.environ, SPARSEATTN_DEBUG="0", SPARSEATTN_PROGRESS="lines")  # a line marks the start
    cmd = [sys.executable, "-m", "sparseattn.tools.cli", "compare", "--data", "synthetic:n=4096,d=32,seed=0",
           "--selectors", "topk", "--repeats", "200", "--format", "json", "--out", str(tmp_path / "r")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            preexec_fn=_default_sigint)
    seen = []
    for line in proc.stderr:  # wait until the timed work has started
        seen.append(line)
        if line.startswith("[1/2]"):
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=300)
    err = "".join(seen) + rest
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "sparseattn compare: interrupted"
    assert "Traceback" not in err
    assert not (tmp_path / "r").exists()


def _tiny_suite(monkeypatch, *cases):
    monkeypatch.setitem(suite.SUITES, "tiny", {"repeats": 1, "cases": list(cases)})


OK_CASE = {"data": "synthetic:n=128,d=16,kind=gaussian,seed=0", "k": 8, "causal": False, "selectors": ["window:width=4"]}
BAD_CASE = {"data": "synthetic:n=64,d=16,kind=nope", "k": 8, "causal": False, "selectors": ["window"]}


def test_bench_every_case_failed_exits_1_and_writes_no_table_or_plots(capsys, tmp_path, monkeypatch):
    _tiny_suite(monkeypatch, BAD_CASE)
    rc, out, err = run(capsys, ["bench", "--suite", "tiny", "--out", str(tmp_path), "--quiet", "--threads", "1"])
    assert rc == 1
    assert "sparseattn bench: error: every case failed (first: synthetic:n=64,d=16,kind=nope:" in err
    assert "no table or plots written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite-tiny.json"]
    assert "nope" in " ".join(json.loads((tmp_path / "suite-tiny.json").read_text())["cases"][0]["error"])


def test_bench_case_subprocess_ignores_a_sparseattn_folder_in_cwd(capsys, tmp_path, monkeypatch):
    """A clone's ``sparseattn/`` folder in cwd must not shadow the package in the per-case subprocess."""
    (tmp_path / "sparseattn" / "data").mkdir(parents=True)  # a clone: imported as a namespace package
    monkeypatch.chdir(tmp_path)
    _tiny_suite(monkeypatch, OK_CASE, BAD_CASE)
    rc, _, err = run(capsys, ["bench", "--suite", "tiny", "--out", "res", "--quiet", "--threads", "1"])
    doc = json.loads(Path("res/suite-tiny.json").read_text())
    assert "error" not in doc["cases"][0], doc["cases"][0]
    assert doc["cases"][0]["results"][0]["name"] == "window"
    assert rc == 1 and "1 of 2 cases failed" in err  # the bad case still makes the run fail
    assert Path("res/suite-tiny.md").read_text().count("| gaussian | 128 |") == 1
    cmd = suite.case_command(OK_CASE, 1)
    assert "-m" not in cmd and str(Path(suite.__file__).parents[2]) in cmd[2]


# ----------------------------------------------------------------------------------------------- decode
DECODE = ["decode", "--data", "synthetic:n=256,d=16,seed=0", "--no-sdpa", "--quiet"]


@pytest.fixture
def no_decode_work(monkeypatch):
    """Fails the test if decode generates its workload or starts measuring."""
    from sparseattn.tools import decode_report

    monkeypatch.setattr(decode_report, "run_decode", lambda *a, **k: pytest.fail("run_decode ran"))
    monkeypatch.setattr(decode_report.KeySource, "workload", lambda *a, **k: pytest.fail("workload made"))


@pytest.mark.parametrize("extra, needles", [
    (["--length", "0"], ["--length must be >= 1; got 0"]),
    (["--length", "x"], ["--length must be an integer >= 1; got 'x'"]),
    (["--length", "253"], ["--length 253 + --steps 64 exceeds the 256 keys per head of --data synthetic:n=256",
                           "use --length <= 192"]),
    (["--heads", "0"], ["--heads must be >= 1; got 0"]),
    (["--steps", "0"], ["--steps must be >= 1; got 0"]),
    (["--steps", "256"], ["--steps 256 leaves no prompt", "use --steps <= 255"]),
    (["--k", "0"], ["--k must be >= 1; got 0"]),
    (["--k", "257"], ["--k 257 exceeds the 256 keys the cache holds at the last step", "use --k <= 256"]),
    (["--dtype", "float64"], ["--dtype must be one of float32, float16, bfloat16; got 'float64'"]),
    (["--selectors", "cluster,nope"], ["--selectors: cache selector 'nope' refused", "'cluster'", "'pages'"]),
    (["--selectors", ","], ["--selectors: give at least one cache selector"]),
    (["--threads", "0"], ["--threads must be from 1 to", "(the CPUs here); got 0"]),
    (["--threads", "999"], ["--threads must be from 1 to", "got 999"]),
    (["--format", "pdf"], ["--format: unknown ['pdf']"]),
    (["--out", "/dev/null", "--format", "json"], ["--out /dev/null: exists and is not a folder"]),
])
def test_decode_bad_values_exit_2_before_any_work(capsys, no_decode_work, extra, needles):
    assert_user_error(capsys, DECODE + extra, *needles)


@pytest.mark.parametrize("data, needles", [
    ("nonsense", ["--data: unknown data 'nonsense': no such file or fixture", "FILE.npz"]),
    ("synthetic:n=0,d=16", ["--data synthetic:n=0,d=16: n must be >= 1"]),
    ("synthetic:n=64,d=16,kind=nope", ["--data synthetic:n=64,d=16,kind=nope:", "unknown synthetic kind 'nope'"]),
    ("synthetic:n=64,d=16,bogus=1", ["--data synthetic:n=64,d=16,bogus=1:", "unknown parameter(s) ['bogus']"]),
    ("synthetic:n=100000000000,d=16", ["MemoryError: --data synthetic:n=100000000000,d=16 needs about"]),
    ("missing.npz", ["--data:", "missing.npz does not exist"]),
    ("text.npz", ["--data:", "text.npz is not an .npz archive"]),
])
def test_decode_bad_data(capsys, files, no_decode_work, monkeypatch, data, needles):
    monkeypatch.chdir(files)
    assert_user_error(capsys, ["decode", "--data", data, "--no-sdpa", "--out", "r"], *needles)
    assert not (files / "r").exists()


def test_decode_heads_checked_against_the_data(capsys, no_decode_work):
    assert_user_error(capsys, ["decode", "--data", "store", "--heads", "5", "--quiet"],
                      "--heads 5 exceeds the 4 heads (groups) of --data store; use --heads <= 4")


def test_decode_ctrl_c_exits_130_with_one_line(capsys, monkeypatch, tmp_path):
    from sparseattn.tools import decode_report

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(decode_report, "run_decode", interrupt)
    rc, out, err = run(capsys, DECODE + ["--steps", "2", "--out", str(tmp_path / "r"), "--format", "json"])
    assert rc == 130 and err == "sparseattn decode: interrupted\n" and not out
    assert not (tmp_path / "r").exists()


def test_out_that_cannot_be_created_or_is_empty(capsys, tmp_path, no_work):
    assert_user_error(capsys, ["compare", *SMALL, "--out", ""], "--out: empty path")
    assert_user_error(capsys, ["decode", "--out", "  "], "--out: empty path")
    # /proc takes no new folders even for root: the probe's mkdir fails, and names --out
    assert_user_error(capsys, ["decode", "--out", "/proc/sparseattn-x/y"], "--out /proc/sparseattn-x/y: cannot create")
    # a creatable folder passes the check and is not left behind by it
    out = tmp_path / "a" / "b"
    cli.check_out_dir(str(out))
    assert not (tmp_path / "a").exists()


def test_decode_data_beyond_float32_and_float16_name_the_flag(capsys, tmp_path, no_work):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((64, 8))
    np.savez(tmp_path / "f64.npz", q=q, k=q * 1e200, v=q)
    assert_user_error(capsys, ["decode", "--data", str(tmp_path / "f64.npz"), "--steps", "2", "--format", "table"],
                      "--data", "array 'k' holds values beyond float32's range", "4.")
    np.savez(tmp_path / "f16.npz", q=q.astype(np.float32), k=(q * 1e5).astype(np.float32), v=q.astype(np.float32))
    assert_user_error(capsys, ["decode", "--data", str(tmp_path / "f16.npz"), "--steps", "2", "--dtype", "float16",
                               "--format", "table"], "--dtype float16:", "beyond float16's range",
                      "use --dtype float32 or --dtype bfloat16")
    assert_user_error(capsys, ["decode", "--data", "synthetic:n=4096,d=16,seed=-1", "--format", "table"],
                      "--data synthetic:n=4096,d=16,seed=-1:", "seed must be >= 0")


def test_out_name_longer_than_the_file_system_allows_names_out(capsys):
    from sparseattn.tools.cli import main as cli_main

    assert cli_main(["bench", "--out", "x" * 300, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sparseattn bench: error: --out xxx") and "File name too long" in err


def test_compare_overflow_names_data_and_says_compare_computes_in_float32(capsys, tmp_path):
    """float64 data whose scores fit float64 but not float32: the error names --data and the float32
    computation, not "pass float64 inputs" (they already are)."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "huge64.npz", q=rng.standard_normal((64, 16)) * 1e30, k=rng.standard_normal((128, 16)) * 1e30,
             v=rng.standard_normal((128, 16)))
    line = assert_user_error(capsys, ["compare", "--data", str(tmp_path / "huge64.npz"), "--selectors", "topk",
                                      "--quiet"], f"--data {tmp_path / 'huge64.npz'}: attention scores overflow float32",
                             "compare computes in float32 whatever the file's dtype",
                             "smaller keys and queries in the data file, or a smaller 'scale' array in it")
    assert "pass float64 inputs" not in line


def test_decode_data_with_one_key_per_head_says_so(capsys, tmp_path, no_decode_work):
    q = np.ones((2, 1, 8), np.float32)
    np.savez(tmp_path / "k1.npz", q=q, k=q, v=q)
    for steps in ("1", "2"):  # no --steps fits: the message says what the data lacks, not "--steps <= 0"
        line = assert_user_error(capsys, ["decode", "--data", str(tmp_path / "k1.npz"), "--steps", steps],
                                 "has 1 key(s) per head; decode needs at least 2", "pass data with more keys")
        assert "--steps <=" not in line


@pytest.mark.parametrize("argv, needles", [
    (["--name", "../../etc/x"], ["--name must be a file stem", "got '../../etc/x'"]),
    (["--name", "a/b"], ["--name must be a file stem", "got 'a/b'"]),
    (["--name", ".hidden"], ["--name must be a file stem", "not starting with '.'"]),
    (["--name", ""], ["--name must be a file stem", "got ''"]),
    (["--name", "x.npz"], ["--name must be a file stem", "nor ending in .npz / .npy", "got 'x.npz'"]),
])
def test_trace_name_is_a_stem_refused_before_any_work(capsys, tmp_path, monkeypatch, argv, needles):
    from sparseattn.tools import traces

    monkeypatch.setattr(traces, "generate_traces", lambda *a, **k: pytest.fail("trace generation ran"))
    assert_user_error(capsys, ["trace", "window", "--out", str(tmp_path), *argv], *needles)
    assert not any(tmp_path.iterdir())


def test_trace_store_layer_checked_before_the_model_loads(capsys, tmp_path, monkeypatch):
    from sparseattn.tools import traces

    monkeypatch.setattr(traces, "generate_traces", lambda *a, **k: pytest.fail("trace generation ran"))
    assert_user_error(capsys, ["trace", "store", "--out", str(tmp_path), "--layer", "6"],
                      "trace store: --layer 6 is not a layer of all-MiniLM-L6-v2; use 0 to 5")
