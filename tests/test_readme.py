"""The Python examples of README.md and of every page in docs/ run: every ```python block of a file, in
order, in one namespace per file (``__name__ == "__main__"``, as when the blocks are saved as a script).

The README path can be overridden with the environment variable ``SPARSEATTN_README`` (e.g. to check a
section before it is pasted into README.md).  Blocks run in a temporary working directory, so an example
that writes files leaves nothing in the repository.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = Path(os.environ.get("SPARSEATTN_README", ROOT / "README.md"))
DOCS = sorted((ROOT / "docs").glob("*.md"))

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


def _run_file(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)  # Dask's nanny (the distributed example) sets OMP/BLAS thread variables here
    try:
        run_blocks(python_blocks(path.read_text(encoding="utf-8")), {"__name__": "__main__"}, path.name)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    assert README.is_file(), f"README not found at {README}"
    assert python_blocks(README.read_text(encoding="utf-8")), \
        f"{README} has no ```python block: the library quick start is missing"
    _run_file(README, tmp_path, monkeypatch)


def test_docs_pages_exist_and_are_linked_from_the_readme():
    assert DOCS, "docs/ has no pages"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in DOCS:
        assert f"docs/{page.name}" in text, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    _run_file(page, tmp_path, monkeypatch)
