"""The README's Python examples run: every ```python block, in order, in one namespace.

The README path can be overridden with the environment variable ``SPARSEATTN_README`` (e.g. to check a
section before it is pasted into README.md).  Blocks run in a temporary working directory, so an example
that writes files leaves nothing in the repository.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

README = Path(os.environ.get("SPARSEATTN_README", Path(__file__).resolve().parents[1] / "README.md"))

_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first code line number, code)`` of every block fenced exactly as ```python, in order."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def run_blocks(blocks: list[tuple[int, str]], namespace: dict, source: str) -> None:
    """Execute the blocks in order in ``namespace``; a block that raises fails naming its line."""
    for line, code in blocks:
        try:
            exec(compile(code, f"{source}:{line}", "exec"), namespace)  # noqa: S102 - the README's own examples
        except Exception as exc:  # noqa: BLE001 - any error of an example is a README defect
            raise AssertionError(f"{source}: the python block starting at line {line} raised "
                                 f"{type(exc).__name__}: {exc}") from exc


def test_python_blocks_are_found_in_order_and_other_fences_are_not():
    text = ("# t\n\n```python\nx = 1\n```\n\n```bash\nexit 1\n```\n\n```pycon\n>>> 1\n```\n"
            "text\n```python\ny = x + 1\nprint(y)\n```\n")
    blocks = python_blocks(text)
    assert blocks == [(4, "x = 1\n"), (16, "y = x + 1\nprint(y)\n")]
    ns: dict = {}
    run_blocks(blocks, ns, "t.md")
    assert ns["y"] == 2  # one namespace: the second block sees the first block's x


def test_a_raising_block_fails_with_its_line():
    blocks = python_blocks("intro\n```python\nok = 1\n```\n```python\n1 / 0\n```\n")
    with pytest.raises(AssertionError, match=r"t.md: the python block starting at line 6 raised ZeroDivisionError"):
        run_blocks(blocks, {}, "t.md")


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    assert README.is_file(), f"README not found at {README}"
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, f"{README} has no ```python block: the library quick start is missing"
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)  # Dask's nanny (the distributed example) sets OMP/BLAS thread variables here
    try:
        run_blocks(blocks, {"__name__": "__readme__"}, README.name)
    finally:
        os.environ.clear()
        os.environ.update(saved)
