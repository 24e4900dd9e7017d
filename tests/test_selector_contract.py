"""The selector contract, checked for every registered selector the way a user of the API meets it.

Registration (unique names), parameters (``get_params`` / ``set_params``, build- vs query-time),
declared capabilities (``supports_add``, ``attends``), ``not_supported_reasons`` and the module layout
(no import cycle; the registry imports no selector).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn.selectors as selectors_pkg
from sparseattn.pattern import SparsePattern
from sparseattn.selectors import (
    Param,
    Selector,
    available_selectors,
    get_selector,
    register,
    selector_classes,
    spec_string,
)
from sparseattn.selectors.base import first_allowed
from sparseattn.selectors.lsh import LSHSelector
from sparseattn.selectors.window import SinksSelector, WindowSelector

AVAILABLE = [name for name, reason in available_selectors().items() if reason is None]

#: A valid, non-default value for every parameter of every selector (the round trip must keep them).
NON_DEFAULT: dict[str, dict[str, object]] = {
    "angular-lsh": {"n_buckets": 8, "n_hashes": 1, "n_rounds": 3, "chunk_size": 4, "order": "position",
                    "rerank": False, "seed": 3, "center": False},
    "cluster": {"n_clusters": 4, "n_probe": 2, "mode": "block", "train_sample": 40, "n_iter": 3, "seed": 2,
                "center": False, "spherical": False, "assign": "l2", "n_threads": 1, "exact_prefix": False,
                "split": 1.5},
    "faiss-flat": {"center": False},
    "faiss-hnsw": {"M": 8, "ef_construction": 20, "ef_search": 16, "center": False, "hnsw_min_block": 64},
    "faiss-ivf": {"nlist": 4, "nprobe": 2, "center": False},
    "faiss-ivfpq": {"nlist": 4, "nprobe": 2, "m": 2, "nbits": 4, "k_factor": 2, "center": False},
    "kdtree": {"eps": 0.5, "leafsize": 4, "pca_dim": 2, "candidates": 9, "center": False, "workers": 2},
    "lsh": {"family": "simhash", "n_bits": 6, "hashes_per_table": 1, "n_tables": 4, "n_probes": 1,
            "n_candidates": 16, "seed": 5, "center": False},
    "pages": {"page_size": 8, "pages": 3, "block": 17},
    "random": {"n_random": 3, "seed": 7},
    "sinks": {"positions": "0;3"},
    "topk": {"block": 7},
    "window": {"width": 5, "dilation": 2},
}

NAMES = list(selector_classes())


def _keys(n: int = 64, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


# ------------------------------------------------------------------------------------------- registry
def test_duplicate_name_raises_naming_both_classes():
    before = selector_classes()
    with pytest.raises(ValueError, match=r"selector name 'window' is already registered by "
                                         r"sparseattn\.selectors\.window\.WindowSelector; cannot register "
                                         r"[\w.]*test_selector_contract\.[\w.<>]*Impostor under the "
                                         r"same name"):
        @register
        class Impostor(WindowSelector):
            name = "window"
    assert selector_classes() == before and before["window"] is WindowSelector


def test_register_needs_a_spec_safe_name():
    class Nameless(WindowSelector):
        name = ""

    class Plus(WindowSelector):
        name = "a+b"

    with pytest.raises(ValueError, match=r"Nameless needs a non-empty class attribute `name`"):
        register(Nameless)
    with pytest.raises(ValueError, match=r"selector name 'a\+b' .* must not contain"):
        register(Plus)


def test_re_registering_the_same_class_is_allowed():
    assert register(WindowSelector) is WindowSelector
    assert selector_classes()["window"] is WindowSelector


def test_every_selector_is_registered_and_listed():
    assert set(NON_DEFAULT) == set(NAMES), "add non-default sample values for the new selector"
    assert NAMES == sorted(NAMES)
    assert "union" not in NAMES  # the combinator has no spec name of its own


# ----------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("name", NAMES)
def test_set_params_unknown_name_lists_valid_ones(name):
    cls = selector_classes()[name]
    valid = ", ".join(sorted(cls.params_spec))
    sel = cls()
    with pytest.raises(ValueError, match=rf"^unknown parameter\(s\) \['nonexistent'\] for selector '{name}'; "
                                         rf"valid: {valid}\.$"):
        sel.set_params(nonexistent=1)


def test_set_params_bad_value_names_the_parameter_and_leaves_the_selector_unchanged():
    sel = get_selector("window:width=4")
    with pytest.raises(ValueError, match=r"^window: parameter width must be > 0; got -1\.$"):
        sel.set_params(width=-1)
    with pytest.raises(TypeError, match=r"^window: parameter dilation must be an integer; got 1\.5\.$"):
        sel.set_params(width=3, dilation=1.5)
    assert sel.get_params() == {"width": 4, "dilation": 1}
    # cross-parameter rules of __init__ apply too, and nothing is half-applied
    lsh = LSHSelector()
    with pytest.raises(ValueError, match=r"lsh: n_bits must be <= 12 for family='crosspolytope'"):
        lsh.set_params(n_bits=20)
    assert lsh.get_params() == LSHSelector().get_params()


@pytest.mark.parametrize("name", NAMES)
def test_get_params_round_trips_through_spec_strings(name):
    cls = selector_classes()[name]
    for params in ({}, NON_DEFAULT[name]):
        sel = cls(**params)
        got = sel.get_params()
        assert set(got) == set(cls.params_spec)
        assert {k: got[k] for k in params} == params
        if name in AVAILABLE:
            again = get_selector(spec_string(sel))
            assert type(again) is cls and again.get_params() == got and repr(again) == repr(sel)
        # set_params on a default selector reaches the same state
        assert cls().set_params(**params).get_params() == got


@pytest.mark.parametrize("name", NAMES)
def test_get_params_is_a_copy_and_params_matches(name):
    sel = selector_classes()[name]()
    got = sel.get_params()
    got[next(iter(got))] = "changed"
    assert sel.get_params() != got and sel.params == sel.get_params()


@settings(max_examples=40, deadline=None)
@given(width=st.one_of(st.none(), st.integers(1, 10**6)), dilation=st.integers(1, 10**6),
       n_random=st.one_of(st.none(), st.integers(1, 10**6)), seed=st.integers(-(2**62), 2**62),
       g=st.integers(1, 1000))
def test_round_trip_hypothesis(width, dilation, n_random, seed, g):
    for sel in (get_selector("window", width=width, dilation=dilation),
                get_selector("random", n_random=n_random, seed=seed), get_selector("sinks", g=g),
                get_selector("window", width=width).set_params(dilation=dilation)):
        assert get_selector(spec_string(sel)).get_params() == sel.get_params()


def test_param_when_is_validated():
    with pytest.raises(ValueError, match=r"Param.when must be 'build' or 'query'; got 'sometimes'"):
        Param(int, 1, "x", when="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_query_params_are_the_query_time_ones(name):
    cls = selector_classes()[name]
    assert cls.query_params == tuple(p for p, s in cls.params_spec.items() if s.when == "query")


def test_query_time_parameter_takes_effect_on_the_next_query():
    keys = _keys(20)
    sel = WindowSelector(width=3).build(keys)
    assert sel.query(keys, is_causal=True).row(10).tolist() == [8, 9, 10]
    assert sel.set_params(width=2) is sel
    assert sel.keys_ is not None
    assert sel.query(keys, is_causal=True).row(10).tolist() == [9, 10]
    assert sel.set_params(dilation=2).query(keys, is_causal=True).row(10).tolist() == [8, 10]


@pytest.mark.parametrize("name,change", [
    ("kdtree", {"leafsize": 3}), ("faiss-flat", {"center": False}), ("cluster", {"n_clusters": 3}),
])
def test_build_time_parameter_needs_build_again(name, change):
    if name not in AVAILABLE:
        pytest.skip(f"{name} unavailable here")
    keys = _keys(64)
    sel = get_selector(name).build(keys)
    want = get_selector(name, **change).build(keys).query(keys[:5], 4)
    pname = next(iter(change))
    sel.set_params(**change)
    with pytest.raises(RuntimeError, match=rf"^selector '{name}': build-time parameter\(s\) {pname} changed by "
                                           r"set_params\(\) after build\(\); call build\(keys\) again before "
                                           r"query\(\)\.$"):
        sel.query(keys[:5], 4)
    assert sel.build(keys).query(keys[:5], 4) == want


def test_setting_the_current_value_keeps_the_build():
    keys = _keys(64)
    sel = get_selector("kdtree:leafsize=8").build(keys)
    sel.set_params(leafsize=8, eps=0.0)
    assert sel.query(keys[:3], 4).nnz_per_row.tolist() == [4, 4, 4]


@pytest.mark.parametrize("name", NAMES)
def test_build_time_change_drops_the_built_state(name):
    """Without querying (cheap for every selector): the next query asks for build() again."""
    cls = selector_classes()[name]
    build_params = [p for p, s in cls.params_spec.items() if s.when == "build"]
    if not build_params or name not in AVAILABLE:
        pytest.skip(f"{name}: no build-time parameter, or unavailable here")
    sel = cls()
    sel.keys_ = np.zeros((4, 2), np.float32)  # stands in for a build
    pname = next(p for p in build_params if p in NON_DEFAULT[name])
    sel.set_params(**{pname: NON_DEFAULT[name][pname]})
    assert sel.keys_ is None and sel.get_params()[pname] == NON_DEFAULT[name][pname]
    with pytest.raises(RuntimeError, match=rf"build-time parameter\(s\) {pname} changed by set_params\(\)"):
        sel.query(np.zeros((1, 2), np.float32))


def test_unbuilt_selector_can_change_build_time_parameters():
    sel = get_selector("lsh").set_params(seed=3, n_tables=4)
    assert sel.get_params()["seed"] == 3
    with pytest.raises(RuntimeError, match=r"^selector 'lsh' is not built: call build\(keys\) before query"):
        sel.query(_keys(2))


def test_sinks_g_and_positions_replace_each_other():
    sel = SinksSelector()
    assert sel.set_params(positions=[3, 0]).get_params() == {"g": None, "positions": "0;3"}
    assert sel.set_params(g=2).get_params() == {"g": 2, "positions": None}
    with pytest.raises(ValueError, match=r"sinks: give either g or positions, not both"):
        sel.set_params(g=1, positions="4")


def test_union_has_no_parameters_of_its_own():
    sel = get_selector("window:width=2+sinks:g=1")
    assert sel.get_params() == {"window": {"width": 2, "dilation": 1}, "sinks": {"g": 1, "positions": None}}
    assert sel.set_params() is sel
    with pytest.raises(ValueError, match=r"union: no parameters of its own; got \['width'\]\. Set them on a "
                                         r"child instead, e.g\. union\.children\[0\]\.set_params"):
        sel.set_params(width=3)
    sel.children[0].set_params(width=3)
    assert spec_string(sel) == "window:width=3,dilation=1+sinks:g=1"


def test_instances_pass_through_get_selector():
    sel = WindowSelector()
    assert get_selector(sel) is sel
    with pytest.raises(ValueError, match=r"use selector\.set_params"):
        get_selector(sel, width=2)


# --------------------------------------------------------------------------------------- capabilities
@pytest.mark.parametrize("name", NAMES)
def test_supports_add_is_true_exactly_where_add_is_implemented(name):
    cls = selector_classes()[name]
    assert cls.supports_add == (cls.add is not Selector.add)
    if cls.supports_add or name not in AVAILABLE:
        return
    sel = cls().build(_keys(64))
    with pytest.raises(NotImplementedError, match=rf"^selector '{name}' cannot add keys in place "
                                                  r"\(supports_add is False\); call build\(\) with all"):
        sel.add(_keys(2))


def test_supports_add_must_match_add():
    with pytest.raises(TypeError, match=r"supports_add=True but add\(\) is not overridden"):
        class Claims(WindowSelector):
            supports_add = True
    with pytest.raises(TypeError, match=r"supports_add=False but add\(\) is overridden"):
        class Hides(WindowSelector):
            def add(self, new_keys, *, check_finite=True):
                return self


@pytest.mark.parametrize("name", [n for n in NAMES if selector_classes()[n].attend is Selector.attend])
def test_attend_is_declared_and_refused_by_pattern_selectors(name):
    cls = selector_classes()[name]
    sel = cls()
    assert sel.attends is False
    if name not in AVAILABLE:
        return
    keys = _keys(300)
    sel.build(keys)
    with pytest.raises(NotImplementedError, match=rf"^selector '{name}' does not compute attention itself "
                                                  r"\(attends is False\); use query\(\) to get a pattern and "
                                                  r"pass it to sparse_attention\.$"):
        sel.attend(keys[:3], keys)


def test_attend_signature_is_the_agreed_one():
    sig = inspect.signature(Selector.attend)
    assert list(sig.parameters) == ["self", "queries", "values", "scale", "is_causal", "query_positions",
                                    "key_positions", "check_finite"]
    assert all(sig.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(sig.parameters)[3:])
    assert Selector.attends is False


_REASON_KEYWORDS = ("n_keys", "dim", "is_causal", "bias")


@pytest.mark.parametrize("name", NAMES)
def test_not_supported_reasons_accepts_every_keyword(name):
    sel = selector_classes()[name]()
    params = inspect.signature(sel.not_supported_reasons).parameters
    for kw in _REASON_KEYWORDS:
        assert kw in params and params[kw].kind is inspect.Parameter.KEYWORD_ONLY, kw
    reasons = sel.not_supported_reasons(n_keys=1000, dim=8, is_causal=True, bias=True)
    assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)


def test_build_reports_not_supported_reasons():
    with pytest.raises(ValueError, match=r"selector 'kdtree' cannot run here: pca_dim=8 must be < E=8"):
        get_selector("kdtree:pca_dim=8").build(_keys(16, 8))


def test_union_passes_every_keyword_to_children():
    sel = get_selector("window+kdtree:pca_dim=8")
    assert sel.not_supported_reasons(n_keys=10, dim=8, is_causal=True, bias=False) == [
        "pca_dim=8 must be < E=8 (the key dimension); use pca_dim=None to search the full space"]


# -------------------------------------------------------------------------------------- module layout
_PKG_DIR = pathlib.Path(selectors_pkg.__file__).parent
_PREFIX = "sparseattn.selectors"


def _selector_imports(path: pathlib.Path) -> set[str]:
    """Modules of sparseattn.selectors imported anywhere in a file (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in block.body for n in ast.walk(stmt)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never executed
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = f"{_PREFIX}.{node.module}" if node.module else _PREFIX
                names = [base] if node.module else [f"{_PREFIX}.{a.name}" for a in node.names]
            elif node.level == 0 and node.module and node.module.startswith(_PREFIX):
                names = [node.module]
            else:
                names = []
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(_PREFIX + "."))
    return found


def _graph() -> dict[str, set[str]]:
    return {f"{_PREFIX}.{p.stem}": _selector_imports(p) - {_PREFIX} for p in _PKG_DIR.glob("*.py")
            if p.stem != "__init__"}


def test_selector_modules_form_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path + [node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = 2

    for mod in sorted(graph):
        visit(mod, [])


def test_protocol_modules_do_not_import_selectors():
    graph = _graph()
    assert graph[f"{_PREFIX}.params"] == set()
    assert graph[f"{_PREFIX}.registry"] == set()  # registration never imports a member back
    closure, todo = set(), [f"{_PREFIX}.base"]
    while todo:
        for nxt in graph[todo.pop()] - closure:
            closure.add(nxt)
            todo.append(nxt)
    assert closure == {f"{_PREFIX}.params", f"{_PREFIX}.registry"}


def test_importing_base_loads_no_selector_module_beneath_it():
    """``python -X importtime``: nothing base.py imports (directly or not) is a selector module."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import sparseattn.selectors.base"],
                         capture_output=True, text=True, check=True).stderr.splitlines()
    rows = []
    for line in out:
        if not line.startswith("import time:") or "|" not in line or "imported package" in line:
            continue
        name_field = line.rsplit("|", 1)[1]
        depth = (len(name_field) - len(name_field.lstrip(" "))) // 2
        rows.append((depth, name_field.strip()))
    where = [i for i, (_, n) in enumerate(rows) if n == f"{_PREFIX}.base"]
    assert where, "sparseattn.selectors.base was not imported"
    i = where[0]
    depth = rows[i][0]
    below = []
    j = i - 1
    while j >= 0 and rows[j][0] > depth:  # importtime lists a module's imports just before it, indented
        below.append(rows[j][1])
        j -= 1
    selector_modules = {f"{_PREFIX}.{p.stem}" for p in _PKG_DIR.glob("*.py")} - {
        f"{_PREFIX}.base", f"{_PREFIX}.params", f"{_PREFIX}.registry", f"{_PREFIX}.__init__"}
    assert not set(below) & selector_modules, below


def test_fill_small_rows_is_public():
    from sparseattn.selectors import fill_small_rows

    p = SparsePattern.from_rows([[1], [1], [2]], 3)
    qpos = np.arange(3, dtype=np.int64)
    got = fill_small_rows(p, 2, True, qpos, qpos)
    assert [got.row(i).tolist() for i in range(3)] == [[0, 1], [0, 1], [2]]


# ------------------------------------------------------------------------------------ clone, E = 0
@pytest.mark.parametrize("name", NAMES)
def test_clone_is_an_unbuilt_selector_with_the_same_parameters(name):
    sel = selector_classes()[name](**NON_DEFAULT[name])
    if name in AVAILABLE and not sel.not_supported_reasons(n_keys=64, dim=8):
        sel.build(_keys())
    twin = sel.clone()
    assert type(twin) is type(sel) and twin is not sel
    assert twin.get_params() == sel.get_params()
    assert twin.keys_ is None
    assert spec_string(twin) == spec_string(sel)


def test_clone_of_a_union_clones_every_part():
    sel = get_selector("window:width=2+sinks:positions=0;3+topk:block=5").build(_keys())
    twin = sel.clone()
    assert spec_string(twin) == spec_string(sel)
    assert all(a is not b and a.keys_ is not None and b.keys_ is None
               for a, b in zip(sel.children, twin.children, strict=True))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(0, 6), S=st.integers(0, 9), k=st.integers(1, 10), causal=st.booleans(),
       seed=st.integers(0, 2**16), sorted_keys=st.booleans())
def test_first_allowed_is_the_smallest_allowed_ids(L, S, k, causal, seed, sorted_keys):
    """Brute-force oracle: per row, the k smallest ids among keys with position <= the query's."""
    r = np.random.default_rng(seed)
    kpos = r.integers(0, 8, S)
    kpos = np.sort(kpos) if sorted_keys else kpos
    qpos = r.integers(-1, 9, L)
    p = first_allowed(L, S, k, causal, qpos.astype(np.int64), kpos.astype(np.int64))
    assert p.shape == (L, S)
    for i in range(L):
        allowed = [j for j in range(S) if not causal or kpos[j] <= qpos[i]]
        assert p.row(i).tolist() == allowed[:k]
