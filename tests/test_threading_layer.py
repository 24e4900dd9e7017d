"""Numba's threading layer: TBB, from the environment's own tbb wheel, whatever the interpreter's loader finds.

Why it matters: a virtual environment's ``<prefix>/lib`` (where the ``tbb`` wheel puts ``libtbb.so.12``)
is not on the loader's search path; Numba then fell back to its OpenMP layer without a word, torch
imported afterwards ran on the system ``libgomp`` instead of its own, and the SDPA baseline moved 2-3x.  ``import sparseattn``
preloads the wheel's library (:func:`sparseattn._numba_setup.preload_tbb`).

Each check runs in a fresh subprocess: Numba picks its layer once per process, at the first parallel
region, and the test process may already have started one.  The checks assert *which* library Numba uses
(the one under ``sys.prefix``, read from ``/proc/self/maps``), so they fail without the preload even on an
interpreter whose own ``lib`` directory happens to hold another ``libtbb.so.12``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest

from sparseattn import _numba_setup

try:
    HAS_TBB_WHEEL = bool(version("tbb"))
except PackageNotFoundError:
    HAS_TBB_WHEEL = False

# The tbb dependency is declared for x86_64 only (pyproject.toml); the preload reads /proc/self/maps.
needs_tbb = pytest.mark.skipif(not (HAS_TBB_WHEEL and sys.platform.startswith("linux")),
                               reason="the tbb wheel is a dependency on x86_64 Linux only")

# A parallel region of our own (one prange), after `import sparseattn` unless IMPORT_FIRST is False.
_SCRIPT = r"""
import json, sys
import numpy as np
import numba
if IMPORT_FIRST:
    import sparseattn
from numba import njit, prange

@njit(parallel=True)
def total(x):
    s = 0.0
    for i in prange(x.shape[0]):
        s += x[i]
    return s

assert total(np.ones(1000)) == 1000.0
if not IMPORT_FIRST:
    import sparseattn
from sparseattn import _numba_setup
st = _numba_setup.threading_status()
st["numba_layer"] = numba.threading_layer()
st["tbb_libs"] = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libtbb.so" in l})
st["omppool"] = sorted({l.split()[-1] for l in open("/proc/self/maps") if "omppool" in l})
st["candidates"] = _numba_setup.tbb_candidates()
print(json.dumps(st))
"""


def _run(*, import_first: bool = True, **env_overrides: str) -> dict:
    env = dict(os.environ)
    for name in ("NUMBA_THREADING_LAYER", _numba_setup.PRELOAD_ENV):
        env.pop(name, None)
    env.update(env_overrides)
    code = f"IMPORT_FIRST = {import_first}\n" + _SCRIPT
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"subprocess failed:\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_tbb
def test_numba_runs_on_the_environments_tbb_after_import():
    st = _run()
    # The intended layer, and the library from this environment's tbb wheel, loaded once.
    assert st["numba_layer"] == "tbb" and st["layer"] == "tbb"
    assert st["candidates"], "the tbb wheel is installed but no libtbb.so.12 under sys.prefix/lib"
    assert st["preload"] == "preloaded" and st["tbb_preloaded"] == st["candidates"][0]
    loaded = [os.path.realpath(p) for p in st["tbb_libs"] if "libtbb.so.12" in p]
    assert loaded == [os.path.realpath(st["tbb_preloaded"])]
    assert st["omppool"] == []  # Numba's OpenMP layer (which brings the system libgomp) never loaded


@needs_tbb
def test_numba_started_before_import_is_reported_not_changed():
    # Numba's choice is final once a parallel region ran; sparseattn must say so, not load a second TBB.
    st = _run(import_first=False)
    assert st["tbb_preloaded"] is None
    assert "already" in st["preload"]
    assert st["layer"] == st["numba_layer"]
    assert len([p for p in st["tbb_libs"] if "libtbb.so.12" in p]) <= 1


def test_a_users_layer_choice_is_respected():
    st = _run(NUMBA_THREADING_LAYER="workqueue")
    assert st["numba_layer"] == "workqueue" and st["layer"] == "workqueue"
    assert st["tbb_preloaded"] is None and "NUMBA_THREADING_LAYER=workqueue" in st["preload"]


def test_preload_can_be_turned_off_and_says_so():
    st = _run(**{_numba_setup.PRELOAD_ENV: "0"})
    assert st["tbb_preloaded"] is None and st["preload"] == f"{_numba_setup.PRELOAD_ENV}=0"
    assert st["layer"] == st["numba_layer"] in ("tbb", "omp", "workqueue")


def test_user_environ_drops_only_what_sparseattn_set():
    env = _numba_setup.user_environ()
    for name in _numba_setup._set_by_us:
        assert name not in env
    for name, value in os.environ.items():
        if name not in _numba_setup._set_by_us:
            assert env[name] == value
