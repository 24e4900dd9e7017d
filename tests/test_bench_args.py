"""Benchmark scripts refuse nonsense flags with one line naming the flag and exit status 2, before any work;
the shared argparse checks of sparseattn.tools.args on their own."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparseattn.tools.args import (
    OneLineParser,
    choice_list_arg,
    float_arg,
    int_arg,
    int_list_arg,
    positive_int,
)

ROOT = Path(__file__).resolve().parents[1]

# (script, argv, the flag the one line must name)
BAD_FLAGS = [
    ("bench_core.py", ["--n", "0"], "--n"),
    ("bench_core.py", ["--n", "-5"], "--n"),
    ("bench_core.py", ["--threads", "0"], "--threads"),
    ("bench_core.py", ["--k", "0"], "--k"),
    ("bench_core.py", ["--repeats", "0"], "--repeats"),
    ("bench_core.py", ["--n", "8", "--k", "9"], "--k"),
    ("bench_decode.py", ["--lengths", ""], "--lengths"),
    ("bench_decode.py", ["--lengths", "0"], "--lengths"),
    ("bench_decode.py", ["--lengths", "abc"], "--lengths"),
    ("bench_decode.py", ["--kinds", "weird"], "--kinds"),
    ("bench_memory.py", ["--only", "nope"], "--only"),
    ("fuzz.py", ["--case", "-1"], "--case"),
    ("bench_tail.py", ["--queries", "0"], "--queries"),
    ("bench_tail.py", ["--repeats", "0"], "--repeats"),
    ("bench_tail_floor.py", ["--budgets", "64,x"], "--budgets"),
    ("bench_estimate.py", ["--quality-rows", "0"], "--quality-rows"),
    ("bench_cache_tail.py", ["--steps", "5000"], "--steps"),
    ("bench_causal_cluster.py", ["--rows", "0"], "--rows"),
    ("bench_cluster_goals.py", ["--repeats", "0"], "--repeats"),
    ("bench_fidelity.py", ["--selectors", "nope"], "--selectors"),
    ("bench_side_by_side.py", ["--base", "HEAD", "--rounds", "0"], "--rounds"),
    ("bench_storage_floor.py", ["--stride", "0"], "--stride"),
]


def _run(script: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


def test_every_bad_flag_is_one_line_naming_the_flag_exit_2():
    with ThreadPoolExecutor(4) as pool:
        procs = list(pool.map(lambda case: _run(case[0], case[1]), BAD_FLAGS))
    wrong = []
    for (script, argv, flag), proc in zip(BAD_FLAGS, procs, strict=True):
        lines = proc.stderr.splitlines()
        ok = (proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{script}: error: {flag} ")
              and proc.stdout == "")
        if not ok:
            wrong.append(f"{script} {' '.join(argv)!r}: exit {proc.returncode}, stderr {proc.stderr[-300:]!r}")
    assert wrong == []


def _parse(type_: object, text: str) -> object:
    ap = OneLineParser(prog="t")
    ap.add_argument("--x", type=type_)
    return ap.parse_args(["--x", text]).x


def test_shared_checks_accept_good_values():
    assert _parse(positive_int, "3") == 3 and _parse(positive_int, "65_536") == 65536
    assert _parse(int_arg(0, 17), "17") == 17
    assert _parse(int_arg(1, lambda: 4, " (the CPUs here)"), "4") == 4
    assert _parse(int_list_arg(1), "16384, 65536") == [16384, 65536]
    assert _parse(choice_list_arg(["a", "b"]), "b,a,b") == ["b", "a"]
    assert _parse(float_arg(0.0), "0") == 0.0 and _parse(float_arg(0.0, strict=True), "0.5") == 0.5


@pytest.mark.parametrize("type_, text, message", [
    (positive_int, "0", "t: error: --x must be >= 1; got 0 (see `t --help`)\n"),
    (positive_int, "1.5", "t: error: --x must be an integer >= 1; got '1.5' (see `t --help`)\n"),
    (int_arg(1, lambda: 4, " (the CPUs here)"), "5", "t: error: --x must be from 1 to 4 (the CPUs here); got 5 "
                                                     "(see `t --help`)\n"),
    (int_list_arg(1, "64,128"), "", "t: error: --x must be a comma list of integers >= 1 such as 64,128; got '' "
                                    "(see `t --help`)\n"),
    (int_list_arg(1, "64,128"), "64,,128", "t: error: --x must be a comma list of integers >= 1 such as 64,128; "
                                           "got '64,,128' (see `t --help`)\n"),
    (choice_list_arg(["a", "b"]), "a,c", "t: error: --x must be a comma list of a, b; got 'c' (see `t --help`)\n"),
    (float_arg(0.0, strict=True), "0", "t: error: --x must be a finite number > 0; got '0' (see `t --help`)\n"),
    (float_arg(0.0), "nan", "t: error: --x must be a finite number >= 0; got 'nan' (see `t --help`)\n"),
])
def test_shared_checks_refuse_with_one_line(type_, text, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(type_, text)
    assert exc.value.code == 2 and capsys.readouterr().err == message


def test_argument_type_error_is_what_the_checks_raise():
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1; got 0"):
        positive_int("0")
