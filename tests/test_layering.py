"""Layering: selectors/ and index/ sit below attention/ and tools/ and never import them.

attention/ builds on indexes and selectors (it takes an index and values; an index knows only keys), and
tools/ builds on everything; an import the other way round would make the lower layers depend on the
upper ones.  Every import is found by parsing the source: module level, inside functions, relative or
absolute, and ``importlib.import_module`` / ``__import__`` calls with a literal name.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import sparseattn

PKG = pathlib.Path(sparseattn.__file__).parent
LOWER = ("selectors", "index")
UPPER = ("sparseattn.attention", "sparseattn.tools")


def imported_modules(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything the source of a module of ``package`` imports."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            found += [(node.lineno, ".".join([*module, a.name])) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = ast.unparse(node.func)
            if func in ("importlib.import_module", "import_module", "__import__"):
                name = node.args[0].value
                if name.startswith(".") and len(node.args) > 1:  # relative to a literal package
                    anchor = node.args[1].value if isinstance(node.args[1], ast.Constant) else ""
                    name = f"{anchor}{name}"
                found.append((node.lineno, name))
    return sorted(found)


def module_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """imported_modules of a file under sparseattn/."""
    return imported_modules(path.read_text(), ["sparseattn", *path.relative_to(PKG).parts[:-1]])


def _upper(name: str) -> bool:
    return any(name == u or name.startswith(u + ".") for u in UPPER)


def lower_modules() -> list[pathlib.Path]:
    return sorted(p for layer in LOWER for p in (PKG / layer).rglob("*.py"))


def test_lower_layers_are_present():
    names = {str(p.relative_to(PKG)) for p in lower_modules()}
    assert {"selectors/cluster.py", "selectors/base.py", "index/cluster.py", "index/routing.py"} <= names


@pytest.mark.parametrize("path", lower_modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_selectors_and_index_never_import_attention_or_tools(path):
    offenders = [f"{path.relative_to(PKG)}:{line}: {name}" for line, name in module_imports(path)
                 if _upper(name)]
    assert offenders == []


def test_the_parser_sees_every_import_form():
    # the check above would pass vacuously if the parser missed a form: each form is caught here
    src = ("from ..attention.routed import routed_attention\n"
           "def f():\n"
           "    from ..tools import bench\n"
           "    import sparseattn.attention.sparse\n"
           "    import importlib\n"
           "    importlib.import_module('sparseattn.attention.cluster')\n"
           "from ..index import routing\n")
    names = [n for _, n in imported_modules(src, ["sparseattn", "selectors"])]
    assert [n for n in names if _upper(n)] == [
        "sparseattn.attention.routed.routed_attention", "sparseattn.tools.bench",
        "sparseattn.attention.sparse", "sparseattn.attention.cluster"]
    assert "sparseattn.index.routing" in names
