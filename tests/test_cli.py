"""The command line: explain prints the worked example; errors are reported, not raised."""

from __future__ import annotations

import pytest

from sparseattn.tools.cli import main


def test_explain_prints_the_worked_numbers(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "[2. 4. 4.]" in out
    assert "0.063379 0.468311 0.468311" in out
    assert "1.936621 6.683105 1.595068" in out
    for step in range(1, 9):
        assert f"Step {step}" in out


def test_explain_default_scale_and_single_query(capsys):
    assert main(["explain", "--scale", "default", "--query", "2"]) == 0
    out = capsys.readouterr().out
    assert "1.99911  7.814124 0.273472" in out or "1.99911 7.814124 0.273472" in out
    assert "--- query 1 ---" not in out


def test_explain_rejects_bad_query(capsys):
    assert main(["explain", "--query", "9"]) == 2
    assert "--query must be between 1 and 3" in capsys.readouterr().err


def test_help_lists_every_command(capsys):
    import pytest

    import sparseattn.tools.cli as cli

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("explain", "selectors", "compare", "bench", "trace"):
        assert cmd in out
        assert f"``{cmd}``" in cli.__doc__
    assert "demo" not in cli.__doc__ and "demo" not in out
    assert "``" not in out and ":mod:" not in out and ":class:" not in out  # plain text, not reST
    assert "* compare: selectors against exact attention" in out  # one bullet per line


def test_plain_text_of_rest_markup():
    from sparseattn.tools.cli import plain_text

    assert plain_text("``sparseattn`` runs :func:`~sparseattn.tools.bench.compare` via :mod:`sparseattn.tools`,\n"
                      ":class:`sparseattn.KVCache`") == "sparseattn runs compare via sparseattn.tools,\nsparseattn.KVCache"


def test_selectors_command(capsys):
    assert main(["selectors"]) == 0
    assert "topk" in capsys.readouterr().out


def test_compare_rejects_bad_format(capsys):
    assert main(["compare", "--format", "pdf"]) == 2
    assert "--format: unknown ['pdf']" in capsys.readouterr().err


def test_no_import_cycle_between_report_suite_and_cli():
    # report renders, suite runs suites, cli holds the argparse handlers: no import goes both ways.
    import ast
    import pathlib

    import sparseattn.tools

    root = pathlib.Path(sparseattn.tools.__file__).parent
    graph = {}
    for name in ("bench", "report", "suite", "cli"):
        tree = ast.parse((root / f"{name}.py").read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[name] = deps & {"bench", "report", "suite", "cli"}
    assert "cli" not in graph["report"] | graph["suite"] | graph["bench"]
    assert "suite" not in graph["report"]  # suite may use report's plot helpers; never the reverse
    assert not graph["bench"]


def test_the_library_never_imports_its_tools():
    # sparseattn/tools/ builds on the library; apart from the documented sparseattn.traces path, no module
    # outside tools/ imports from it (relative or absolute), so the library runs without the tools.
    import ast
    import pathlib

    import sparseattn

    pkg = pathlib.Path(sparseattn.__file__).parent
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.parts[0] == "tools" or rel == pathlib.Path("traces.py"):
            continue
        package = ["sparseattn", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                names = [".".join([*base, *(node.module.split(".") if node.module else []), a.name])
                         for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            offenders += [f"{rel}: {n}" for n in names if n.startswith("sparseattn.tools")]
    assert offenders == []


def test_version(capsys):
    import sparseattn

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"sparseattn {sparseattn.__version__}\n"


def test_compare_help_documents_own_data(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("FILE.npz", "q.npy,k.npy,v.npy", "query/key/value", "(B, H)", "q_pos", "--quiet"):
        assert text in out, text


@pytest.fixture
def no_fresh_sdpa(monkeypatch):
    """Skip compare's fresh-process SDPA re-timing (a subprocess per run; not what these tests check)."""
    from sparseattn.tools import bench

    def skip(*args, **kwargs):
        raise RuntimeError("skipped in tests")

    monkeypatch.setattr(bench, "fresh_sdpa_seconds", skip)


def _compare_json(capsys, tmp_path, data, name, *extra):
    import json

    out = tmp_path / name
    rc = main(["compare", "--data", data, "--selectors", "topk", "window:width=4", "--k", "4", "--repeats", "1",
               "--format", "json", "--out", str(out), "--quiet", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads((out / "compare.json").read_text())


def test_compare_own_npz_2d_3d_4d_matches_the_manifest_format(capsys, tmp_path, monkeypatch, no_fresh_sdpa):
    """User arrays give the same workload and the same (deterministic) quality as the identical arrays written
    in the shipped format (npz + manifest with sha256), for (L, E), (H, L, E) and (B, H, L, E)."""
    import json

    import numpy as np

    from sparseattn.tools import traces

    rng = np.random.default_rng(7)
    monkeypatch.chdir(tmp_path)
    for lead in [(), (2,), (2, 2)]:
        arrays = {"q": rng.standard_normal((*lead, 24, 8)).astype(np.float32),
                  "k": rng.standard_normal((*lead, 40, 8)).astype(np.float32),
                  "v": rng.standard_normal((*lead, 40, 6)).astype(np.float32)}
        tag = f"d{len(lead) + 2}"
        np.savez(tmp_path / f"{tag}.npz", **arrays)
        ref_dir = tmp_path / f"ref{tag}"
        ref_dir.mkdir()
        digest = traces.write_npz(ref_dir / "t.npz", arrays)
        (ref_dir / "manifest.json").write_text(json.dumps({"files": {"t": {"file": "t.npz", "sha256": digest}}}))
        mine = _compare_json(capsys, tmp_path, f"{tag}.npz", f"out{tag}", "--causal")
        ref = _compare_json(capsys, tmp_path, f"t@{ref_dir}", f"ref{tag}-out", "--causal")
        assert mine["data"] == f"{tag}.npz" and mine["workload"]["description"] == f"your arrays from {tag}.npz"
        groups = int(np.prod(lead)) if lead else 1
        shape = {key: mine["workload"][key] for key in ("groups", "L", "S", "E", "Ev")}
        assert shape == {"groups": groups, "L": 24, "S": 40, "E": 8, "Ev": 6}
        assert shape == {key: ref["workload"][key] for key in shape}
        for a, b in zip(mine["results"], ref["results"], strict=True):
            assert a["selector"] == b["selector"] and a["quality"] == b["quality"]
        topk = mine["results"][0]["quality"]
        assert topk["recall_mean"] == 1.0  # the exact oracle on causal rows (fewer than k keys early on)


def test_compare_table_only_writes_no_folder_and_notes_the_warm_up(capsys, tmp_path, monkeypatch, no_fresh_sdpa):
    import re

    import sparseattn.tools.cli as cli

    monkeypatch.delenv(cli.PROGRESS_ENV, raising=False)
    monkeypatch.setattr(cli, "kernel_cache_cold", lambda: True)  # as on a first run
    out = tmp_path / "never"
    argv = ["compare", "--data", "synthetic:n=64,d=8,seed=0", "--selectors", "window:width=4", "--k", "4",
            "--repeats", "1", "--format", "table", "--out", str(out)]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0 and not out.exists()
    assert "window" in captured.out
    err = captured.err.splitlines()
    assert err[0].startswith("note: Numba compiles the kernels on the first run")
    assert re.fullmatch(r"compare: 2 steps in \d+\.\d s", err[1])  # stderr is not a TTY: one summary line
    assert re.fullmatch(r"note: kernel warm-up took \d+\.\d s \(\d+\.\d s compiling, the rest loading from the "
                        r"cache\)", err[2])
    assert len(err) == 3
    # A warm cache: no first-run note (the warm-up note only if this run compiled for over a second).
    monkeypatch.setattr(cli, "kernel_cache_cold", lambda: False)
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert not any("first run" in line for line in err)
    assert [line for line in err if not line.startswith("note: kernel warm-up took")] == [err[0]]
    assert re.fullmatch(r"compare: 2 steps in \d+\.\d s", err[0])


def test_kernel_cache_cold_looks_for_compiled_kernels(monkeypatch, tmp_path):
    from sparseattn import _numba_setup
    from sparseattn.tools.cli import kernel_cache_cold

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert kernel_cache_cold()  # nothing there yet
    where = tmp_path / f"sparseattn-{_numba_setup.kernels_digest()}" / "kernels_x"
    where.mkdir(parents=True)
    (where / "fused.fused_serial-10.py311.nbc").write_bytes(b"")
    assert kernel_cache_cold()  # data without an index is not a cached kernel
    (where / "fused.fused_serial-10.py311.nbi").write_bytes(b"")
    assert not kernel_cache_cold()


def test_progress_steps_modes(capsys, monkeypatch):
    import importlib.util
    import io
    import re
    import sys

    from sparseattn.tools.cli import progress_steps

    with progress_steps(2, "t", quiet=True) as say:
        say("a")
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("SPARSEATTN_PROGRESS", raising=False)
    with progress_steps(2, "t") as say:  # stderr is not a terminal (a log): one summary line at the end
        say("a")
        say("b")
    assert re.fullmatch(r"t: 2 steps in \d+\.\d s\n", capsys.readouterr().err)
    monkeypatch.setenv("SPARSEATTN_PROGRESS", "lines")  # asked for: one line per step
    with progress_steps(2, "t") as say:
        say("a")
        say("b")
    assert capsys.readouterr().err == "[1/2] a\n[2/2] b\n"
    monkeypatch.delenv("SPARSEATTN_PROGRESS")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress_steps(2, "work") as say:
        say("first")
        say("second")
    text = tty.getvalue()
    if importlib.util.find_spec("rich") is not None:  # rich is in the 'bench' extra
        assert "work: done" in text and "2/2" in text and "eta" in text and "[1/2]" not in text
    else:
        assert text == "[1/2] first\n[2/2] second\n"
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # rich missing: the line printer, even on a TTY
    tty2 = Tty()
    monkeypatch.setattr(sys, "stderr", tty2)
    with progress_steps(1, "work") as say:
        say("only")
    assert tty2.getvalue() == "[1/1] only\n"


def test_trace_reports_each_generation_step(capsys, tmp_path, monkeypatch):
    import re

    from sparseattn.tools import traces

    def fake(out_dir, kind, *, progress, **kwargs):
        for i in range(traces.GENERATE_STEPS):
            progress(f"step {i}")
        return tmp_path / f"{kind}.npz"

    monkeypatch.setattr(traces, "generate_traces", fake)
    monkeypatch.setenv("SPARSEATTN_PROGRESS", "lines")
    assert main(["trace", "store", "--out", str(tmp_path), "--heads", "0,1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[{i + 1}/{traces.GENERATE_STEPS}] step {i}" for i in range(traces.GENERATE_STEPS)]
    monkeypatch.delenv("SPARSEATTN_PROGRESS")
    assert main(["trace", "store", "--out", str(tmp_path), "--heads", "0,1"]) == 0
    assert re.fullmatch(rf"trace store: {traces.GENERATE_STEPS} steps in \d+\.\d s\n", capsys.readouterr().err)
    assert main(["trace", "store", "--out", str(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["trace", "store", "--out", str(tmp_path), "--heads", "0,x"]) == 2
    assert "--heads must be a comma list of integers such as 0,1; got '0,x'" in capsys.readouterr().err


def test_compare_defaults_to_the_real_store_with_the_estimation_zone_and_top_p():
    from sparseattn.tools import bench
    from sparseattn.tools.cli import build_parser

    args = build_parser().parse_args(["compare"])
    assert args.data == "store" and args.selectors is None and args.quality_rows == 512
    specs = bench.default_selectors()
    assert "cluster:mode=block,estimate=-1" in specs and "cluster:mode=block,top_p=0.9" in specs
    assert {"topk", "cluster:mode=block"} <= set(specs)
    wl = bench.load_workload(args.data, max_groups=args.max_groups)
    assert wl.shape["S"] == 16384 and wl.shape["L"] == 2048 and wl.shape["groups"] == 4


def test_compare_on_the_store_estimate_lowers_the_error_and_the_plots_match_the_table(tmp_path, capsys,
                                                                                    no_fresh_sdpa):
    import json

    from report_checks import assert_plots_match_the_table

    rc = main(["compare", "--selectors", "cluster:mode=block", "cluster:mode=block,estimate=-1", "--repeats", "1",
               "--max-groups", "1", "--quality-rows", "128", "--format", "json", "--out", str(tmp_path), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "compare.json").read_text())
    assert res["data"] == "store" and res["workload"]["S"] == 16384
    block, est = (r["quality"]["rel_error_overall"] for r in res["results"])
    assert est < 0.5 * block  # the estimation zone, on real keys: the reason it is in the default set
    assert_plots_match_the_table(res)
