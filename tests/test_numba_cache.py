"""Numba's on-disk cache: where it goes, that it is used, and that edits invalidate it.

* (a) a read-only install (the package's ``kernels/__pycache__`` cannot be written) falls back to a
  writable per-user directory, or to the temp directory when that is not writable either;
* (b) a user-set ``NUMBA_CACHE_DIR`` wins;
* (c) a second process loads the fused kernels from the cache without compiling, the parallel variant
  has its own cache entry holding parallel code (and really starts Numba's thread pool), and nothing is
  rewritten;
* (d) editing a kernel's source invalidates its cache entry (Numba 0.68 stamps an entry with a sha256 of
  the source file defining the function), and so does editing a helper in *another* kernel module
  (sparseattn keys its cache directory on a digest of every kernels/*.py).

Every compilation happens in a subprocess with its own fresh cache directory (or a temporary copy of the
package), so the repository's cache and files are never touched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sparseattn
from sparseattn import _numba_setup

PKG_DIR = Path(sparseattn.__file__).resolve().parent
TIMEOUT = 300


# ------------------------------------------------------------------------------------------- helpers
def _env(**extra: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _run(code: str, env: dict[str, str], *, prefix: tuple[str, ...] = (), cwd: Path | None = None) -> dict:
    res = subprocess.run([*prefix, sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert res.returncode == 0, f"subprocess failed:\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _copy_package(dst_root: Path) -> Path:
    """A copy of the sparseattn package (no caches) under ``dst_root``; returns the package directory."""
    dst = dst_root / "sparseattn"
    shutil.copytree(PKG_DIR, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _cache_files(cache_dir: Path) -> dict[str, tuple[int, int]]:
    """Relative path -> (mtime_ns, size) of every Numba cache file under ``cache_dir``."""
    out = {}
    for p in cache_dir.rglob("*"):
        if p.suffix in (".nbi", ".nbc"):
            st = p.stat()
            out[str(p.relative_to(cache_dir))] = (st.st_mtime_ns, st.st_size)
    return out


def _drop_dac_prefix() -> tuple[str, ...] | None:
    """A command prefix under which permission bits bind (root ignores them), or None if unavailable."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search")
    with tempfile.TemporaryDirectory() as tmp:
        ro = Path(tmp) / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            res = subprocess.run([*prefix, sys.executable, "-c", f"open({str(ro / 'x')!r}, 'w')"],
                                 capture_output=True, text=True, timeout=60)
        finally:
            ro.chmod(0o755)
    return prefix if res.returncode != 0 and "Permission denied" in res.stderr else None


def _make_read_only(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode
        p.chmod((mode & ~0o222) | (0o555 if p.is_dir() else 0o444))


def _make_writable(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


# The fused kernels called directly (no SparsePattern constructor, no numba.get_num_threads(): both
# would compile other kernels or start Numba's thread pool and blur what this script observes).
_FUSED_SCRIPT = r"""
import json, os
import numba
import numpy as np
import sparseattn as sa
from sparseattn.kernels import fused
from sparseattn.kernels.bias import no_bias_args

def layer():
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run in this process
        return None

L, S, E, W = 256, 256, 16, 32
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, n, E), dtype=np.float32) for n in (L, S, S))
indptr = np.arange(0, L * W + 1, W, dtype=np.int64)
indices = np.sort((np.arange(L)[:, None] * 7 + np.arange(W)[None, :] * 5) % S, axis=1).astype(np.int32).ravel()
m = np.zeros(1, np.int64)

def call(kern):
    out = np.empty((1, L, E), np.float32)
    lse = np.empty((1, L), np.float32)
    kern(q, k, v, m, m, indptr, indices, True, np.float32(0.25), W, 16, *no_bias_args(1), 1, out, lse, True)
    return out, lse

res = {"file": sa.__file__, "env_cache_dir": os.environ.get("NUMBA_CACHE_DIR"),
       "config_cache_dir": numba.config.CACHE_DIR, "layer_at_start": layer()}
kernels = {"serial": fused.fused_serial}
if RUN_PARALLEL:
    kernels["parallel"] = fused.fused_parallel
outs = {}
for name, kern in kernels.items():
    outs[name] = call(kern)
    res["layer_after_" + name] = layer()
    res[name] = {"hits": kern.stats.cache_hits.total(), "misses": kern.stats.cache_misses.total(),
                 "cache_path": kern.stats.cache_path}
o, lse = outs["serial"]
res["out_head"] = o[0, :4, 0].tolist()
res["lse_head"] = lse[0, :4].tolist()
if RUN_PARALLEL:
    res["serial_equals_parallel"] = bool(np.array_equal(o, outs["parallel"][0])
                                         and np.array_equal(lse, outs["parallel"][1]))
print(json.dumps(res))
"""


def _fused_script(parallel: bool) -> str:
    return f"RUN_PARALLEL = {parallel!r}\n" + _FUSED_SCRIPT


# ------------------------------------------------------------------------- (a) read-only fallback
@pytest.fixture
def clean_cache_env(monkeypatch):
    """NUMBA_CACHE_DIR unset for the test and restored (or removed again) afterwards."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", "placeholder")  # records the original state for undo
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    return monkeypatch


def _refuse_package_pycache(monkeypatch) -> Path:
    """Make the write probe in the package's kernels/__pycache__ fail, as in a read-only install."""
    pycache = (Path(_numba_setup.__file__).resolve().parent / "kernels" / "__pycache__")
    real = tempfile.NamedTemporaryFile

    def refuse(*args, **kwargs):
        target = kwargs.get("dir")
        if target is not None and Path(target).resolve().is_relative_to(pycache):
            raise PermissionError(13, "Permission denied", str(target))
        return real(*args, **kwargs)

    monkeypatch.setattr(_numba_setup.tempfile, "NamedTemporaryFile", refuse)
    return pycache


def test_read_only_package_falls_back_to_the_user_cache_dir(clean_cache_env, tmp_path):
    mp = clean_cache_env
    mp.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _refuse_package_pycache(mp)
    chosen = Path(_numba_setup.cache_dir())
    assert chosen == tmp_path / "xdg" / "sparseattn" / f"numba-{_numba_setup.kernels_digest()}"
    assert chosen.is_dir()
    assert "NUMBA_CACHE_DIR" not in os.environ  # nobody else's cache is redirected
    (chosen / "probe").write_text("ok")  # writable


def test_unwritable_user_cache_falls_back_to_the_temp_dir(clean_cache_env, tmp_path):
    mp = clean_cache_env
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    mp.setenv("XDG_CACHE_HOME", str(blocker / "xdg"))  # makedirs fails: a path component is a file
    mp.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    _refuse_package_pycache(mp)
    chosen = Path(_numba_setup.cache_dir())
    assert chosen == tmp_path / "tmp" / "sparseattn-numba-cache" / _numba_setup.kernels_digest()
    assert chosen.is_dir()


def test_writable_package_caches_inside_the_package(clean_cache_env, tmp_path):
    mp = clean_cache_env
    mp.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    probe = PKG_DIR / "kernels" / "__pycache__"
    if not os.access(probe if probe.exists() else probe.parent, os.W_OK):
        pytest.skip("the installed package is read-only here")
    chosen = Path(_numba_setup.cache_dir())
    assert chosen == PKG_DIR / "kernels" / "__pycache__" / f"numba-{_numba_setup.kernels_digest()}"
    assert "NUMBA_CACHE_DIR" not in os.environ
    assert not (tmp_path / "xdg").exists()


def _read_only_install_run(tmp_path: Path, numba_first: bool) -> tuple[dict, Path, list[Path]]:
    """Import and run a read-only copy of the package (permission bits enforced even for root).

    Returns the subprocess's report, the XDG cache home it was given, and what it wrote into the package.
    """
    prefix = _drop_dac_prefix()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only for this process")
    site = tmp_path / "site"
    pkg = _copy_package(site)
    (pkg / "kernels" / "__pycache__").mkdir()
    xdg = tmp_path / "xdg"
    imports = "import numba, sparseattn as sa" if numba_first else "import sparseattn as sa, numba"
    code = (f"import json, os\nimport numpy as np\n{imports}\n"
            "from sparseattn import _numba_setup\n"
            "from sparseattn.kernels import fused\n"
            "q = np.ones((64, 8), np.float32)\n"
            "out = sa.sparse_attention(q, q, q, sa.SparsePattern.window(64, 64, 8))\n"
            "print(json.dumps({'file': sa.__file__, 'env': os.environ.get('NUMBA_CACHE_DIR'), "
            "'digest': _numba_setup.kernels_digest(), "
            "'config': numba.config.CACHE_DIR, 'used': fused.fused_serial_nobias.stats.cache_path, "
            "'misses': fused.fused_serial_nobias.stats.cache_misses.total(), 'ok': bool(np.allclose(out, 1.0))}))")
    _make_read_only(site)
    try:
        res = _run(code, _env(PYTHONPATH=str(site), XDG_CACHE_HOME=str(xdg), NUMBA_CACHE_DIR=None),
                   prefix=prefix, cwd=tmp_path)
        written = list((pkg / "kernels" / "__pycache__").iterdir())
    finally:
        _make_writable(site)
    assert Path(res["file"]).resolve().is_relative_to(site.resolve()), res["file"]
    assert res["ok"] and res["misses"] == 1
    return res, xdg, written


@pytest.mark.parametrize("numba_first", [False, True], ids=["sparseattn-first", "numba-first"])
def test_read_only_install_compiles_and_caches_in_a_writable_place(tmp_path, numba_first):
    """Whatever the import order, a read-only install runs, writes nothing into the package, and its
    kernels are cached under the user's cache home (not recompiled in every process)."""
    res, xdg, written = _read_only_install_run(tmp_path, numba_first)
    assert written == []
    assert res["env"] is None and res["config"] == ""  # nothing process-wide was redirected
    used = Path(res["used"])
    assert used.resolve().is_relative_to(xdg.resolve()), used
    files = _cache_files(used)
    assert any("_fused_rows_nobias_serial" in f and f.endswith(".nbi") for f in files), files
    # The copy's own digest (the repository's kernels may differ from the copy while others edit them).
    assert used.parent == xdg / "sparseattn" / f"numba-{res['digest']}"


# ------------------------------------------------------------------------------ (b) the user's choice
def test_user_numba_cache_dir_wins(monkeypatch, tmp_path):
    mine = str(tmp_path / "mine")
    monkeypatch.setenv("NUMBA_CACHE_DIR", mine)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _refuse_package_pycache(monkeypatch)  # even when the package is read-only
    assert _numba_setup.cache_dir() == os.path.join(mine, f"sparseattn-{_numba_setup.kernels_digest()}")
    assert not (tmp_path / "xdg").exists()


# -------------------------------------------------------------------- (c) cold, then warm, process
def test_second_process_loads_both_fused_variants_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    env = _env(NUMBA_CACHE_DIR=str(cache))
    script = _fused_script(parallel=True)

    cold = _run(script, env, cwd=tmp_path)
    # (b) in a real process: the user's directory is the one Numba uses and writes.
    assert cold["env_cache_dir"] == cold["config_cache_dir"] == str(cache)
    assert Path(cold["file"]).resolve().parent == PKG_DIR
    for name in ("serial", "parallel"):
        assert cold[name]["misses"] == 1 and cold[name]["hits"] == 0, cold
        assert Path(cold[name]["cache_path"]).resolve().is_relative_to(cache.resolve())
    assert cold["serial_equals_parallel"]  # one Python function, bit-identical variants

    files = _cache_files(cache)
    serial_files = {f for f in files if "_fused_rows_serial" in f}
    parallel_files = {f for f in files if "_fused_rows_parallel" in f}
    # Distinct cache entries (index and data) per variant: Numba does not key the cache by `parallel`.
    for group in (serial_files, parallel_files):
        assert any(f.endswith(".nbi") for f in group) and any(f.endswith(".nbc") for f in group), files
    assert not serial_files & parallel_files

    def blob(group):
        return b"".join((cache / f).read_bytes() for f in group if f.endswith(".nbc"))

    # The parallel entry holds parfor gufunc code (and the scheduler call); the serial entry none.
    assert b"parfor" in blob(parallel_files) and b"do_scheduling" in blob(parallel_files)
    assert b"parfor" not in blob(serial_files)

    warm = _run(script, env, cwd=tmp_path)
    for name in ("serial", "parallel"):
        assert warm[name]["hits"] == 1 and warm[name]["misses"] == 0, warm  # loaded, not compiled
    # The serial kernel starts no thread pool; the parallel one (loaded from cache) does.
    assert warm["layer_at_start"] is None and warm["layer_after_serial"] is None, warm
    assert warm["layer_after_parallel"] is not None, warm
    assert warm["serial_equals_parallel"]
    assert warm["out_head"] == cold["out_head"] and warm["lse_head"] == cold["lse_head"]
    # Nothing edited -> nothing recompiled or rewritten.
    assert _cache_files(cache) == files


# -------------------------------------------------------------------------------- (d) stale caches
def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found exactly once in {path}"
    path.write_text(text.replace(old, new))


@pytest.fixture
def package_copy(tmp_path):
    site = tmp_path / "site"
    pkg = _copy_package(site)
    env = _env(PYTHONPATH=str(site), NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    return pkg, env


def test_editing_a_kernel_source_invalidates_its_cache(package_copy, tmp_path):
    pkg, env = package_copy
    script = _fused_script(parallel=False)
    first = _run(script, env, cwd=tmp_path)
    assert Path(first["file"]).resolve().parent == pkg.resolve()
    assert first["serial"]["misses"] == 1
    again = _run(script, env, cwd=tmp_path)
    assert again["serial"]["hits"] == 1 and again["out_head"] == first["out_head"]

    # Change a constant in the kernel: every output row doubles (same file size, new contents).
    _edit(pkg / "kernels" / "fused.py", "inv = 1.0 / total", "inv = 2.0 / total")
    edited = _run(script, env, cwd=tmp_path)
    assert edited["serial"]["misses"] == 1 and edited["serial"]["hits"] == 0, edited  # recompiled
    for new, old in zip(edited["out_head"], first["out_head"], strict=True):
        assert new == pytest.approx(2.0 * old, rel=1e-6)
    assert edited["lse_head"] == first["lse_head"]

    reloaded = _run(script, env, cwd=tmp_path)  # the new entry is cached in turn
    assert reloaded["serial"]["hits"] == 1 and reloaded["out_head"] == edited["out_head"]


def test_editing_an_inlined_helper_in_another_module_invalidates_the_kernel(package_copy, tmp_path):
    pkg, env = package_copy
    script = _fused_script(parallel=False)
    first = _run(script, env, cwd=tmp_path)
    assert first["serial"]["misses"] == 1
    # exp(x) -> 2 exp(x) in the float32 exp helper: outputs unchanged (softmax normalises), lse + log 2.
    # (in pow2_f32, inlined into exp_shifted_f32, inlined into the kernel: two levels of inlining)
    _edit(pkg / "kernels" / "intrinsics.py", "return p * int32_bits_as_float32(",
          "return np.float32(2.0) * p * int32_bits_as_float32(")
    edited = _run(script, env, cwd=tmp_path)
    for new, old in zip(edited["lse_head"], first["lse_head"], strict=True):
        assert new == pytest.approx(old + math.log(2.0), abs=1e-5)
