"""The command line: explain prints the worked example; errors are reported, not raised."""

from __future__ import annotations

from sparseattn.cli import main


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

    import sparseattn.cli as cli

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("explain", "selectors", "compare", "bench", "trace"):
        assert cmd in out
        assert f"``{cmd}``" in cli.__doc__
    assert "demo" not in cli.__doc__ and "demo" not in out


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

    import sparseattn

    root = pathlib.Path(sparseattn.__file__).parent
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
