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
