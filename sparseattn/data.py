"""Data for sparseattn: loaders of the shipped real-attention fixtures and seeded synthetic generators.

Real traces (``data/`` next to the package, or ``$SPARSEATTN_DATA``; see ``data/README.md``):

* ``load("window")`` -- Q/K/V of all-MiniLM-L6-v2 inside two 512-token windows of the King James Bible,
  all 6 layers x 12 heads, float16 (window, layer, head, 512, 32).
* ``load("store")`` -- an Unlimiformer-style store of 16,384 keys/values (layer 3, heads 0-3) and 2,048
  queries from a far-away part of the text, float16 (head, n, 32).

Each file's sha256 is checked against ``data/manifest.json`` before use.  Your own arrays (an ``.npz``, a
folder of ``.npy`` files, or ``"q.npy,k.npy,v.npy"``) load into the same :class:`Trace` with
:func:`load_user` (or :func:`load` given the path), without a manifest.

Synthetic generators (float32, any ``n`` up to ~1M, reproducible from ``seed``): :func:`gaussian`,
:func:`clustered`, :func:`correlated`, and :func:`synthetic` which parses specs such as
``"synthetic:n=65536,d=64,kind=clustered"``.  Each returns ``(q, k, v)``.

Examples
--------
>>> from sparseattn import data
>>> q, k, v = data.synthetic("synthetic:n=1000,d=32,kind=gaussian,norm_profile=minilm,seed=1")
>>> q.shape, k.dtype
((1000, 32), dtype('float32'))
"""

from __future__ import annotations

import hashlib
import inspect
import json
import numbers
import os
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .inputs import check_positive_int

__all__ = [
    "FIXTURES",
    "SYNTHETIC_KINDS",
    "PASSKEY_BACKGROUNDS",
    "Passkey",
    "Trace",
    "clustered",
    "correlated",
    "data_dir",
    "gaussian",
    "is_user_data",
    "load",
    "load_user",
    "manifest",
    "norm_profile",
    "passkey",
    "synthetic",
    "synthetic_sizes",
]

FIXTURES = ("window", "store")
ENV_VAR = "SPARSEATTN_DATA"
MANIFEST = "manifest.json"
_REGENERATE = ("python -c \"from sparseattn.traces import generate_traces as g; "
               "g('data', 'window', n_windows=2, seed=0); "
               "g('data', 'store', n_keys=16384, n_queries=2048, layer=3, heads=[0, 1, 2, 3], seed=0)\"")
_PROFILE_HEAD_DIM = 32

# Row-norm quantiles (levels 0, 0.01, ..., 1) of Q and K of all-MiniLM-L6-v2 layer 3 head 0, measured on
# the shipped ``window`` fixture (data/manifest.json["norm_profiles"], key "L3H0"); embedded here so that
# ``gaussian(norm_profile="minilm")`` works without the data directory.
_MINILM_L3H0_Q = (
    5.4846, 6.629, 6.9481, 7.0557, 7.1617, 7.2351, 7.2784, 7.3387, 7.3887, 7.438, 7.4769, 7.5119, 7.546,
    7.5718, 7.6093, 7.6531, 7.6881, 7.7148, 7.7371, 7.7537, 7.7841, 7.8172, 7.8522, 7.8689, 7.8862,
    7.8987, 7.928, 7.9555, 7.9845, 8.0014, 8.0184, 8.0387, 8.0575, 8.0715, 8.0923, 8.1172, 8.1413,
    8.1597, 8.1841, 8.2027, 8.2234, 8.2355, 8.2484, 8.2676, 8.2869, 8.3024, 8.312, 8.333, 8.3575,
    8.3845, 8.401, 8.4118, 8.4228, 8.4345, 8.4524, 8.4787, 8.4933, 8.5064, 8.52, 8.5353, 8.548, 8.5683,
    8.597, 8.6091, 8.6268, 8.638, 8.6513, 8.6701, 8.6937, 8.7213, 8.7376, 8.7576, 8.7835, 8.7981,
    8.8113, 8.8224, 8.8405, 8.8597, 8.8783, 8.9107, 8.932, 8.9561, 8.9719, 9.0109, 9.0276, 9.0639,
    9.0873, 9.1088, 9.1393, 9.166, 9.2043, 9.2499, 9.287, 9.3096, 9.3688, 9.412, 9.4687, 9.534, 9.7148,
    9.8335, 10.2
)
_MINILM_L3H0_K = (
    5.7722, 7.0712, 7.4862, 7.8067, 8.0776, 8.2379, 8.398, 8.5101, 8.6332, 8.7501, 8.8345, 8.8974,
    8.9838, 9.0571, 9.1121, 9.1599, 9.2302, 9.3016, 9.3747, 9.4021, 9.4547, 9.5098, 9.5719, 9.6468,
    9.6814, 9.7308, 9.775, 9.8211, 9.8733, 9.9184, 9.9533, 9.9909, 10.046, 10.108, 10.142, 10.168,
    10.227, 10.268, 10.317, 10.348, 10.419, 10.451, 10.489, 10.509, 10.554, 10.581, 10.636, 10.663,
    10.693, 10.733, 10.782, 10.818, 10.885, 10.908, 10.95, 10.984, 11.02, 11.034, 11.076, 11.124,
    11.163, 11.202, 11.268, 11.294, 11.377, 11.425, 11.467, 11.504, 11.534, 11.579, 11.599, 11.649,
    11.684, 11.744, 11.801, 11.836, 11.868, 11.933, 11.952, 11.995, 12.054, 12.114, 12.165, 12.275,
    12.308, 12.346, 12.376, 12.464, 12.567, 12.664, 12.758, 12.839, 12.939, 13.005, 13.102, 13.229,
    13.369, 13.476, 13.651, 14.113, 14.945
)


# --------------------------------------------------------------------------------------------------------
# locating and verifying the fixtures
# --------------------------------------------------------------------------------------------------------
def _candidate_dirs(explicit: str | os.PathLike[str] | None) -> list[tuple[str, Path]]:
    if explicit is not None:
        return [("data_dir argument", Path(explicit))]
    out: list[tuple[str, Path]] = []
    env = os.environ.get(ENV_VAR)
    if env:
        out.append((f"${ENV_VAR}", Path(env)))
    here = Path(__file__).resolve().parent
    out.append(("repository checkout", here.parent / "data"))
    out.append(("installed package", here / "_data"))
    out.append(("installed data-files", Path(sys.prefix) / "share" / "sparseattn" / "data"))
    return out


def _find_data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    cands = _candidate_dirs(path)
    for _, d in cands:
        if (d / MANIFEST).is_file():
            return d
    tried = "; ".join(f"{label}: {d}" for label, d in cands)
    raise FileNotFoundError(
        f"no sparseattn data directory with {MANIFEST} found (tried {tried}). The fixtures live in the "
        f"repository's data/ directory; use a checkout (pip install -e .) or set {ENV_VAR} to a directory "
        f"holding manifest.json, window.npz and store.npz.")


def data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding the fixtures and ``manifest.json``.

    Searched in order: ``path`` (if given), ``$SPARSEATTN_DATA``, ``data/`` next to the ``sparseattn``
    package (a repository checkout or editable install), ``sparseattn/_data``, and
    ``<sys.prefix>/share/sparseattn/data`` (where a wheel's ``data-files`` land).

    Parameters
    ----------
    path : path-like, optional
        Explicit directory; when given, no other place is searched.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    FileNotFoundError
        If no candidate holds a ``manifest.json``.
    """
    return _find_data_dir(path)


def manifest(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The parsed ``manifest.json`` of :func:`data_dir` (files, sha256, shapes, metadata, norm profiles).

    Raises ``ValueError`` naming the file when it is not valid JSON or not a manifest (an object whose
    ``files`` maps each name to an object with ``file`` and ``sha256``).
    """
    return _read_manifest(_find_data_dir(path) / MANIFEST)


def _read_manifest(path: Path) -> dict[str, Any]:
    fix = "regenerate it with `sparseattn trace` or restore it from the repository's data/ directory"
    try:
        man = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                         f"{fix}.") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; {fix}.") from None
    if not isinstance(man, dict) or not isinstance(man.get("files", {}), dict):
        raise ValueError(f"{path} is not a sparseattn manifest (expected a JSON object with a 'files' object, "
                         f"got {type(man).__name__}); {fix}.")
    for name, entry in man.get("files", {}).items():
        missing = [key for key in ("file", "sha256") if not isinstance(entry, dict) or key not in entry]
        if missing:
            raise ValueError(f"{path}: entry {name!r} lacks {' and '.join(repr(m) for m in missing)}; {fix}.")
    return man


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]


@dataclass(frozen=True)
class Trace:
    """Real Q/K/V loaded from a fixture.

    Attributes
    ----------
    name : str
        Fixture name (``"window"`` or ``"store"``).
    q, k, v : numpy.ndarray
        float16 as stored (or the requested dtype).  ``window``: (window, layer, head, 512, 32) with the
        selected axes dropped; ``store``: q (head, n_queries, 32), k/v (head, n_keys, 32), head axis dropped
        when one head is selected.  Attention uses ``scale = 1/sqrt(32)`` and no mask.
    meta : dict
        Provenance (model, package versions, layer/heads, token ranges, text source and sha256, ...) plus
        ``selection``: the layer/head/window chosen.
    token_ids : dict of str to numpy.ndarray
        int32 WordPiece ids: ``input_ids`` (window, 512) for ``window``; ``key_ids`` (n_keys,) and
        ``query_ids`` (n_queries,) for ``store`` (selected like the arrays).
    path : pathlib.Path
        The ``.npz`` file (or folder / first ``.npy`` file of your own arrays).
    positions : dict of str to numpy.ndarray
        Your own arrays only: optional int64 ``q_pos`` (L,) and ``k_pos`` (S,) token positions.
    """

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    meta: dict[str, Any]
    token_ids: dict[str, np.ndarray] = field(default_factory=dict)
    path: Path | None = None
    positions: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """Softmax scale ``1/sqrt(head_dim)`` used by the model."""
        return float(self.meta.get("scale", 1.0 / np.sqrt(self.q.shape[-1])))


def _check_index(value: object, name: str, allowed: list[int], what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None; got {value!r} ({type(value).__name__}).")
    if int(value) not in allowed:
        raise ValueError(f"{name}={int(value)} is not in this {what}; available: {allowed}.")
    return int(value)


def _resolve_dtype(dtype: object) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(f"dtype must be None, float16, float32 or float64; got {dtype!r}.") from exc
    if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be None, float16, float32 or float64; got {dt}. "
                        f"Hint: dtype=np.float32 for computation.")
    return dt


def load(name: str, *, layer: int | None = None, head: int | None = None, window: int | None = None,
         dtype: object = None, data_dir: str | os.PathLike[str] | None = None, verify: bool = True) -> Trace:
    """Load a shipped real-attention fixture, checking its sha256 against the manifest.

    Parameters
    ----------
    name : {"window", "store"} or path
        Fixture name (any name listed in ``manifest.json`` works), or your own arrays (an ``.npz``, a folder
        of ``.npy`` files, ``"q.npy,k.npy,v.npy"``; see :func:`load_user`, relative to ``data_dir`` if
        given), loaded without a manifest; the selection arguments then do not apply.
    layer : int, optional
        ``window``: select one layer (0-5), dropping the layer axis.  ``store``: must equal the stored
        layer (3) if given.
    head : int, optional
        Select one head (absolute head index 0-11; for ``store`` one of the stored heads), dropping the
        head axis.
    window : int, optional
        ``window`` only: select one window, dropping the window axis.
    dtype : {None, numpy.float16, numpy.float32, numpy.float64}, optional
        None keeps float16 as stored.
    data_dir : path-like, optional
        Directory with ``manifest.json`` (default: see :func:`sparseattn.data.data_dir`).
    verify : bool, default True
        Check the file's sha256 against the manifest (cached per file size and mtime).

    Returns
    -------
    Trace

    Raises
    ------
    ValueError
        Unknown name (the message lists the available ones), out-of-range selection, or sha256 mismatch.
    FileNotFoundError
        Missing data directory or file.

    Examples
    --------
    >>> from sparseattn import data
    >>> t = data.load("window", layer=3, head=0, window=0, dtype="float32")
    >>> t.q.shape, t.q.dtype
    ((512, 32), dtype('float32'))
    >>> data.load("store", head=2).k.shape
    (16384, 32)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str such as 'window' or 'store'; got {type(name).__name__}.")
    dt = _resolve_dtype(dtype)
    if is_user_data(name, data_dir):
        return load_user(name, dtype=dt, base_dir=data_dir)
    d = _find_data_dir(data_dir)
    man = _read_manifest(d / MANIFEST)
    files = man.get("files", {})
    if name not in files:
        raise ValueError(f"unknown fixture {name!r}; available: {sorted(files)}. "
                         f"For synthetic data use sparseattn.data.synthetic('synthetic:n=...,d=...,kind=...').")
    entry = files[name]
    path = _fixture_path(d, entry, verify)
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta").reshape(-1)[0])) if "meta" in arrays else dict(entry.get("meta", {}))
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    ids = arrays
    selection: dict[str, int | None] = {"layer": layer, "head": head, "window": window}
    q, k, v, ids = _select(name, meta, q, k, v, ids, layer, head, window)
    if dt is not None:
        q, k, v = (np.ascontiguousarray(a, dtype=dt) for a in (q, k, v))
    else:
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    meta = dict(meta, selection=selection, sha256=entry["sha256"])
    return Trace(name=name, q=q, k=k, v=v, meta=meta, token_ids=ids, path=path)


def _fixture_path(d: Path, entry: dict[str, Any], verify: bool) -> Path:
    """The fixture file of a manifest ``entry`` in ``d``, its sha256 checked when ``verify``."""
    path = d / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"fixture file {path} listed in {d / MANIFEST} is missing. "
                                f"Regenerate with: {_REGENERATE}")
    if verify:
        got = _sha256(path)
        if got != entry["sha256"]:
            raise ValueError(f"sha256 mismatch for {path}: manifest expects {entry['sha256']}, file has {got}. "
                             f"The file is corrupt or was regenerated without updating {MANIFEST}; "
                             f"regenerate with: {_REGENERATE} (or pass verify=False).")
    return path


def _select(name: str, meta: dict[str, Any], q: np.ndarray, k: np.ndarray, v: np.ndarray, ids: dict[str, Any],
            layer: int | None, head: int | None, window: int | None) -> tuple[Any, ...]:
    """(q, k, v, token ids) of a fixture narrowed to the ``layer`` / ``head`` / ``window`` asked for (that
    axis dropped); ValueError naming a selection the fixture does not have."""
    kind = meta.get("kind", name)
    if kind == "window":
        layers = list(meta.get("layers", range(q.shape[1])))
        heads = list(meta.get("heads", range(q.shape[2])))
        idx: list[Any] = [slice(None)] * 5
        if window is not None:
            idx[0] = _check_index(window, "window", list(range(q.shape[0])), "fixture's windows")
            ids = {key: a[idx[0]] for key, a in ids.items()}
        if layer is not None:
            idx[1] = layers.index(_check_index(layer, "layer", layers, "fixture's layers"))
        if head is not None:
            idx[2] = heads.index(_check_index(head, "head", heads, "fixture's heads"))
        q, k, v = (a[tuple(idx)] for a in (q, k, v))
    elif kind == "store":
        if window is not None:
            raise ValueError(f"window= applies to the 'window' fixture only; the {name!r} store has no windows. "
                             f"Drop window=.")
        if layer is not None:
            _check_index(layer, "layer", [int(meta["layer"])], "store (one layer)")
        if head is not None:
            heads = [int(h) for h in meta["heads"]]
            i = heads.index(_check_index(head, "head", heads, "store's heads"))
            q, k, v = q[i], k[i], v[i]
    return q, k, v, ids


# --------------------------------------------------------------------------------------------------------
# your own arrays (no manifest, no sha256)
# --------------------------------------------------------------------------------------------------------
_USER_ROLES = {"q": ("q", "query"), "k": ("k", "key"), "v": ("v", "value"),
               "q_pos": ("q_pos", "query_positions"), "k_pos": ("k_pos", "key_positions"), "scale": ("scale",)}
_USER_SHAPES = {"q": "(L, E)", "k": "(S, E)", "v": "(S, Ev)"}
_NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
#: How to write your own arrays; shown by ``sparseattn compare --help`` and in error messages.
USER_DATA_HELP = ("an .npz file (numpy.savez(FILE, q=q, k=k, v=v)), a folder holding q.npy, k.npy, v.npy, or "
                  "three .npy files 'q.npy,k.npy,v.npy'; q (L, E), k (S, E), v (S, Ev), each optionally with "
                  "leading (H,) or (B, H) axes; names query/key/value also work; optional int q_pos (L,), "
                  "k_pos (S,) and a scalar scale (default 1/sqrt(E))")


def _user_path(text: str, base_dir: str | os.PathLike[str] | None) -> Path:
    p = Path(text).expanduser()
    return p if p.is_absolute() or base_dir is None else Path(base_dir) / p


def is_user_data(spec: object, base_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when ``spec`` names your own arrays rather than a manifest entry or a synthetic spec.

    That is: a path ending in ``.npz`` or ``.npy``, a comma list of paths, an existing folder holding
    ``q.npy`` (or ``query.npy``), or any other existing file.  The shipped names ``window`` and ``store``
    and ``synthetic:...`` specs never are.  Relative paths are taken from ``base_dir`` (default: cwd).
    """
    if not isinstance(spec, str) or not spec.strip() or spec in FIXTURES or spec.startswith("synthetic"):
        return False
    if "," in spec or spec.lower().endswith((".npz", ".npy")):
        return True
    p = _user_path(spec, base_dir)
    if p.is_dir():
        return any((p / f"{alias}.npy").is_file() for alias in _USER_ROLES["q"])
    return p.is_file()


def _file_head(path: Path, if_missing: str, if_folder: str) -> bytes:
    """The first 6 bytes of a file (enough for the .npy / .npz magic), with one-line errors: a missing
    path -> FileNotFoundError "{path} does not exist; {if_missing}.", a folder -> ValueError
    "{path} {if_folder}."."""
    try:
        with open(path, "rb") as f:
            return f.read(6)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist; {if_missing}.") from None
    except IsADirectoryError:
        raise ValueError(f"{path} {if_folder}.") from None


def _open_npz(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Lazy loaders of the arrays of an .npz, with one-line errors for files that are not one."""
    fix = "save your arrays with numpy.savez(FILE, q=q, k=k, v=v)"
    head = _file_head(path, "give an .npz file, a folder with q.npy, k.npy, v.npy, or 'q.npy,k.npy,v.npy'",
                      f"is a folder without q.npy (or query.npy); put q.npy, k.npy, v.npy in it or {fix}")
    if head.startswith(_NPY_MAGIC):
        raise ValueError(f"{path} is a single .npy array; give three files 'q.npy,k.npy,v.npy' or {fix}.")
    if not head.startswith(_NPZ_MAGIC):
        raise ValueError(f"{path} is not an .npz archive (it starts with {head!r}); {fix}.")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {name: z[name] for name in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path} is a damaged or unreadable .npz archive ({type(exc).__name__}: {exc}); "
                         f"write it again ({fix}).") from None
    return {name: (lambda a=a: a) for name, a in data.items()}


def _open_npy(path: Path) -> np.ndarray:
    fix = "save each array with numpy.save(FILE, array)"
    head = _file_head(path, "give three existing .npy files 'q.npy,k.npy,v.npy'",
                      "is a folder; give three .npy files 'q.npy,k.npy,v.npy'")
    if not head.startswith(_NPY_MAGIC):
        raise ValueError(f"{path} is not an .npy file (it starts with {head!r}); {fix}.")
    try:
        return np.load(path, allow_pickle=False)
    except (EOFError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is a damaged or unreadable .npy file ({type(exc).__name__}: {exc}); "
                         f"write it again ({fix}).") from None


def _pick(arrays: dict[str, Callable[[], np.ndarray]], role: str, where: str, required: bool
          ) -> np.ndarray | None:
    names = [a for a in _USER_ROLES[role] if a in arrays]
    if len(names) > 1:
        raise ValueError(f"{where} holds both {names[0]!r} and {names[1]!r}; keep one of them.")
    if not names:
        if required:
            raise ValueError(f"{where} has no array {role!r} (or {_USER_ROLES[role][1]!r}); found "
                             f"{sorted(arrays) or 'none'}. Expected q {_USER_SHAPES['q']}, k {_USER_SHAPES['k']}, "
                             f"v {_USER_SHAPES['v']}, each optionally with leading (H,) or (B, H) axes.")
        return None
    return arrays[names[0]]()


def _check_user_arrays(arrs: dict[str, np.ndarray], where: str) -> None:
    for role in ("q", "k", "v"):
        a = arrs[role]
        if a.dtype.kind not in "fiu":
            raise ValueError(f"{where}: array {role!r} has dtype {a.dtype}; expected real numbers "
                             f"(float16, float32 or float64).")
        if a.ndim not in (2, 3, 4):
            raise ValueError(f"{where}: array {role!r} has shape {a.shape}; expected {_USER_SHAPES[role]}, "
                             f"(H, {_USER_SHAPES[role][1:]} or (B, H, {_USER_SHAPES[role][1:]}.")
        if 0 in a.shape:
            raise ValueError(f"{where}: array {role!r} has shape {a.shape}, which is empty; expected "
                             f"{_USER_SHAPES[role]} with every size >= 1.")
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    for role, a in (("k", k), ("v", v)):
        if a.shape[:-2] != q.shape[:-2]:
            raise ValueError(f"{where}: array {role!r} has shape {a.shape} but 'q' has {q.shape}; the leading "
                             f"(H,) or (B, H) axes of q, k and v must be equal.")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{where}: array 'k' has shape {k.shape} but 'q' has {q.shape}; q and k need the "
                         f"same last dimension E (v may differ).")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"{where}: array 'v' has shape {v.shape} but 'k' has {k.shape}; k and v need the "
                         f"same number of keys S (second-to-last axis).")
    for role in ("q", "k", "v"):
        a = arrs[role]
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise ValueError(f"{where}: array {role!r} holds NaN or inf (first at index {bad}); replace "
                             f"non-finite values before comparing.")
    for role, n, axis in (("q_pos", q.shape[-2], "L"), ("k_pos", k.shape[-2], "S")):
        p = arrs.get(role)
        if p is None:
            continue
        if p.dtype.kind not in "iu" or p.shape != (n,):
            raise ValueError(f"{where}: array {role!r} has shape {p.shape} and dtype {p.dtype}; expected "
                             f"integers of shape ({axis},) = ({n},).")
    s = arrs.get("scale")
    if s is not None and (s.size != 1 or s.dtype.kind not in "fiu" or not np.isfinite(s).all()
                          or float(s.reshape(-1)[0]) <= 0):
        shown = f", value {float(s.reshape(-1)[0])!r}" if s.size == 1 and s.dtype.kind in "fiu" else ""
        raise ValueError(f"{where}: array 'scale' must hold one finite number > 0; got shape {s.shape}, "
                         f"dtype {s.dtype}{shown}.")


def load_user(spec: str, *, dtype: object = None, base_dir: str | os.PathLike[str] | None = None) -> Trace:
    """Load your own Q/K/V (no manifest, no sha256) into a :class:`Trace`, like :func:`load` does a fixture.

    Parameters
    ----------
    spec : str
        An ``.npz`` file, a folder holding ``q.npy``, ``k.npy``, ``v.npy``, or three ``.npy`` paths joined by
        commas (``"q.npy,k.npy,v.npy"``).  Arrays ``q`` (L, E), ``k`` (S, E), ``v`` (S, Ev), each optionally
        with the same leading (H,) or (B, H) axes; ``query``/``key``/``value`` are accepted as names.
        Optional: int ``q_pos`` (L,), ``k_pos`` (S,) token positions, and a scalar ``scale`` (default
        ``1/sqrt(E)``).  Other arrays are ignored.
    dtype : {None, numpy.float16, numpy.float32, numpy.float64}, optional
        None keeps the stored floating dtype (integers become float32).
    base_dir : path-like, optional
        Folder relative paths are taken from (default: the working directory).

    Returns
    -------
    Trace
        ``meta["kind"] == "user"``, ``meta["sha256"] is None``; ``positions`` holds ``q_pos``/``k_pos``.

    Raises
    ------
    ValueError
        A file that is not an .npz/.npy, a damaged archive, a missing array, or a shape, dtype or value that
        does not fit; the message names the file, the array and the expected shape.
    FileNotFoundError
        A path that does not exist.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"spec must be a path such as 'mine.npz'; got {spec!r}.")
    dt = _resolve_dtype(dtype)
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) > 1:
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"{spec!r}: a comma list must name exactly three .npy files, q,k,v (e.g. "
                             f"'q.npy,k.npy,v.npy'); got {len([p for p in parts if p])}.")
        paths = [_user_path(p, base_dir) for p in parts]
        arrays: dict[str, Callable[[], np.ndarray]] = {
            role: (lambda p=p: _open_npy(p)) for role, p in zip(("q", "k", "v"), paths, strict=True)}
        where, path = f"'{spec}'", paths[0]
    else:
        path = _user_path(parts[0], base_dir)
        if path.is_dir():
            arrays = {f.stem: (lambda f=f: _open_npy(f)) for f in sorted(path.glob("*.npy"))}
            where = f"folder {path}"
        else:
            arrays = _open_npz(path)
            where = str(path)
    arrs = {role: _pick(arrays, role, where, role in ("q", "k", "v")) for role in _USER_ROLES}
    arrs = {role: a for role, a in arrs.items() if a is not None}
    _check_user_arrays(arrs, where)  # type: ignore[arg-type]
    target = {role: dt or (arrs[role].dtype if arrs[role].dtype.kind == "f" else np.dtype(np.float32))
              for role in ("q", "k", "v")}
    for r in ("q", "k", "v"):
        to = np.dtype(target[r])
        if arrs[r].dtype.kind == "f" and np.finfo(arrs[r].dtype).max > np.finfo(to).max:
            big = float(np.abs(arrs[r]).max(initial=0.0))
            if big > float(np.finfo(to).max):
                raise ValueError(f"{where}: array {r!r} holds values beyond {to.name}'s range (largest magnitude "
                                 f"{big:.3g}), the dtype it is computed in; scale the data down.")
    q, k, v = (np.ascontiguousarray(arrs[r], dtype=target[r]) for r in ("q", "k", "v"))
    layout = {"q": _USER_SHAPES["q"], "k": _USER_SHAPES["k"], "v": _USER_SHAPES["v"]}
    if q.ndim > 2:
        lead = "(H, " if q.ndim == 3 else "(B, H, "
        layout = {r: lead + s[1:] for r, s in layout.items()}
    meta: dict[str, Any] = {"kind": "user", "source": spec, "layout": layout, "sha256": None,
                            "description": f"your arrays from {spec}"}
    if "scale" in arrs:
        meta["scale"] = float(arrs["scale"].reshape(-1)[0])
    positions = {r: np.asarray(arrs[r], dtype=np.int64) for r in ("q_pos", "k_pos") if r in arrs}
    name = path.stem if len(parts) == 1 else "user"
    return Trace(name=name, q=q, k=k, v=v, meta=meta, path=path, positions=positions)


# --------------------------------------------------------------------------------------------------------
# synthetic generators
# --------------------------------------------------------------------------------------------------------
_LEVELS = np.linspace(0.0, 1.0, 101)


def norm_profile(spec: str = "minilm", *, data_dir: str | os.PathLike[str] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-norm quantiles of a real MiniLM head, for :func:`gaussian` and :func:`correlated`.

    Parameters
    ----------
    spec : str, default "minilm"
        ``"minilm"``: layer 3 head 0 (embedded, needs no data directory); ``"minilm:L{layer}H{head}"``
        (e.g. ``"minilm:L5H7"``): any of the 72 heads, read from ``manifest.json``.

    Returns
    -------
    levels, q_quantiles, k_quantiles : numpy.ndarray
        float64, shape (101,): quantile levels 0..1 and the Q / K row-norm quantiles (head_dim 32).
    """
    if not isinstance(spec, str):
        raise TypeError(f"norm_profile must be None, 'minilm', 'minilm:L<layer>H<head>' or a (q_quantiles, "
                        f"k_quantiles) pair; got {type(spec).__name__}.")
    if spec == "minilm":
        return _LEVELS.copy(), np.array(_MINILM_L3H0_Q), np.array(_MINILM_L3H0_K)
    if spec.startswith("minilm:"):
        key = spec.split(":", 1)[1]
        prof = manifest(data_dir).get("norm_profiles", {})
        if key not in prof.get("q", {}):
            raise ValueError(f"unknown norm profile {spec!r}; available: 'minilm' or 'minilm:L<l>H<h>' with "
                             f"{sorted(prof.get('q', {}))[:3]}... ({len(prof.get('q', {}))} heads).")
        return (np.asarray(prof["levels"], dtype=np.float64), np.asarray(prof["q"][key], dtype=np.float64),
                np.asarray(prof["k"][key], dtype=np.float64))
    raise ValueError(f"unknown norm profile {spec!r}; expected 'minilm' or 'minilm:L<layer>H<head>' "
                     f"(e.g. 'minilm:L3H0').")


def _rng(seed: object) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (numbers.Integral, np.random.SeedSequence)):
        raise TypeError(f"seed must be an int; got {seed!r} ({type(seed).__name__}). "
                        f"Hint: pass seed=0 for a reproducible draw.")
    if isinstance(seed, numbers.Integral) and int(seed) < 0:
        raise ValueError(f"seed must be >= 0; got {int(seed)}. Hint: pass seed=0 for a reproducible draw.")
    return np.random.default_rng(seed)  # type: ignore[arg-type]


def _sizes(n: object, d: object, n_queries: object, dv: object) -> tuple[int, int, int, int]:
    n_ = check_positive_int(n, "n")
    d_ = check_positive_int(d, "d")
    nq = n_ if n_queries is None else check_positive_int(n_queries, "n_queries")
    dv_ = d_ if dv is None else check_positive_int(dv, "dv")
    return n_, d_, nq, dv_


def _resolve_profile(norm_profile_: object) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    if norm_profile_ is None:
        return None
    if isinstance(norm_profile_, str):
        return norm_profile(norm_profile_)
    if isinstance(norm_profile_, tuple) and len(norm_profile_) == 2:
        qq, kq = (np.asarray(x, dtype=np.float64) for x in norm_profile_)
        for nm, arr in (("q", qq), ("k", kq)):
            if arr.ndim != 1 or arr.size < 2 or not np.all(np.diff(arr) >= 0) or not np.all(arr >= 0):
                raise ValueError(f"norm_profile {nm} quantiles must be a non-decreasing 1-D array of >= 2 "
                                 f"non-negative values (evenly spaced levels 0..1); got shape {arr.shape}.")
        return np.linspace(0, 1, qq.size), qq, kq  # type: ignore[return-value]
    raise TypeError(f"norm_profile must be None, 'minilm', 'minilm:L<layer>H<head>' or a (q_quantiles, "
                    f"k_quantiles) pair; got {norm_profile_!r}.")


def _sample_norms(rng: np.random.Generator, n: int, levels: np.ndarray, quantiles: np.ndarray,
                  d: int) -> np.ndarray:
    # inverse-CDF sampling with linear interpolation between the stored quantiles; rescaled by
    # sqrt(d/32) so the spread of scaled logits q.k/sqrt(d) between random directions matches head_dim 32
    if quantiles.size != levels.size:
        levels = np.linspace(0.0, 1.0, quantiles.size)
    u = rng.random(n)
    return (np.interp(u, levels, quantiles) * np.sqrt(d / _PROFILE_HEAD_DIM)).astype(np.float32)


def _directions_with_norms(rng: np.random.Generator, n: int, d: int, norms: np.ndarray | None) -> np.ndarray:
    x = rng.standard_normal((n, d), dtype=np.float32)
    if norms is None:
        return x
    nrm = np.linalg.norm(x, axis=1, keepdims=True)
    np.maximum(nrm, np.float32(1e-30), out=nrm)
    x /= nrm
    x *= norms[:, None]
    return x


def gaussian(n: int, d: int, *, n_queries: int | None = None, dv: int | None = None,
             norm_profile: object = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Isotropic Gaussian queries/keys/values, optionally with per-row norms of a real MiniLM head.

    Parameters
    ----------
    n : int
        Number of keys (and queries unless ``n_queries``).
    d : int
        Query/key dimension.
    n_queries : int, optional
        Number of queries; default ``n``.
    dv : int, optional
        Value dimension; default ``d``.
    norm_profile : {None, "minilm", "minilm:L<l>H<h>"} or (q_quantiles, k_quantiles), optional
        None: standard normal rows (norm ~ sqrt(d)).  Otherwise Q and K rows get uniformly random
        directions and norms drawn from the real head's row-norm distribution, times ``sqrt(d/32)`` so
        that ``q.k/sqrt(d)`` has the head's spread for any ``d`` (exactly the real norms at ``d = 32``).
        Gaussian Q/K so matched are about as peaky as real attention inside a window.
    seed : int, default 0

    Returns
    -------
    q : numpy.ndarray, float32, shape (n_queries, d)
    k : numpy.ndarray, float32, shape (n, d)
    v : numpy.ndarray, float32, shape (n, dv), standard normal, independent of q and k.
    """
    n_, d_, nq, dv_ = _sizes(n, d, n_queries, dv)
    prof = _resolve_profile(norm_profile)
    rng = _rng(seed)
    qn = kn = None
    if prof is not None:
        levels, qq, kq = prof
        qn = _sample_norms(rng, nq, levels, qq, d_)
        kn = _sample_norms(rng, n_, levels, kq, d_)
    q = _directions_with_norms(rng, nq, d_, qn)
    k = _directions_with_norms(rng, n_, d_, kn)
    v = rng.standard_normal((n_, dv_), dtype=np.float32)
    return q, k, v


def _check_real(value: object, name: str, *, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number; got {value!r}.")
    x = float(value)
    if x < low or (high is not None and x > high):
        rng_txt = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {rng_txt}; got {x}.")
    return x


def clustered(n: int, d: int, n_clusters: int = 256, spread: float = 0.1, *, intrinsic_dim: int = 8,
              n_queries: int | None = None, dv: int | None = None, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys and queries from a mixture of clusters whose centres span a low-dimensional subspace.

    Centres: ``n_clusters`` standard-normal points in an ``intrinsic_dim``-dimensional random subspace,
    scaled so their norm is about ``sqrt(d)``.  Each key (and, independently, each query) is a uniformly
    chosen centre plus isotropic noise of standard deviation ``spread`` per coordinate (so a fraction about
    ``1/(1+spread**2)`` of the variance lies in the subspace).  Nearest-neighbour indexes do well here.

    Parameters
    ----------
    n, d : int
        Keys and dimension.
    n_clusters : int, default 256
    spread : float, default 0.1
        Per-coordinate noise relative to the centres' per-coordinate scale (1).
    intrinsic_dim : int, default 8
        Dimension of the centres' subspace (capped at ``d``).
    n_queries, dv : int, optional
        Default ``n`` and ``d``.
    seed : int, default 0

    Returns
    -------
    q : float32 (n_queries, d); k : float32 (n, d); v : float32 (n, dv) standard normal.
    """
    n_, d_, nq, dv_ = _sizes(n, d, n_queries, dv)
    c = check_positive_int(n_clusters, "n_clusters")
    r = min(check_positive_int(intrinsic_dim, "intrinsic_dim"), d_)
    s = _check_real(spread, "spread", low=0.0)
    rng = _rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((d_, r)))  # (d, r) orthonormal columns
    centres = (rng.standard_normal((c, r)) @ basis.T * np.sqrt(d_ / r)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        x = rng.standard_normal((m, d_), dtype=np.float32)
        x *= np.float32(s)
        x += centres[rng.integers(0, c, size=m)]
        return x

    k = draw(n_)
    q = draw(nq)
    v = rng.standard_normal((n_, dv_), dtype=np.float32)
    return q, k, v


def correlated(n: int, d: int, *, rho: float = 0.9, n_queries: int | None = None, dv: int | None = None,
               norm_profile: object = "minilm", seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian Q/K (real-head norms by default) with values that are a noisy linear function of the keys.

    ``v = rho * z(k) @ W + sqrt(1 - rho**2) * noise`` with ``z(k)`` the keys scaled to unit RMS entries and
    ``W`` a random (d, dv) Gaussian matrix over ``sqrt(d)``; entries of ``v`` have about unit variance.
    The values of the keys a query scores low on no longer average out to noise: the dropped tail carries
    a coherent contribution (along ``W^T q``), so the *absolute* error of top-k truncation grows with
    ``rho`` (measured, n = 8192, d = 32, k = 64, minilm norms: median ``|o - o_topk| / (sqrt(dv) rms(v))``
    0.085 at rho = 0, 0.116 at rho = 0.9).  The output itself grows faster, so the error *relative to*
    ``|o|`` falls (0.57 -> 0.26).  Real MiniLM values behave like this: on the shipped ``window`` fixture
    the exact top-64 holds 0.71 of the mass with median relative output error 0.23, below the median
    ``(1-m)/m`` = 0.39 that independent values would give.

    Parameters
    ----------
    n, d : int
    rho : float, default 0.9
        Correlation strength in [0, 1] (0: independent values as in :func:`gaussian`).
    n_queries, dv : int, optional
    norm_profile : default "minilm"
        As in :func:`gaussian`.
    seed : int, default 0

    Returns
    -------
    q : float32 (n_queries, d); k : float32 (n, d); v : float32 (n, dv).
    """
    rho_ = _check_real(rho, "rho", low=0.0, high=1.0)
    n_, d_, nq, dv_ = _sizes(n, d, n_queries, dv)
    q, k, _ = gaussian(n_, d_, n_queries=nq, dv=1, norm_profile=norm_profile, seed=seed)
    _rng(seed)  # validate
    rng = np.random.default_rng([int(seed), 1])  # a stream independent of gaussian()'s
    w = (rng.standard_normal((d_, dv_)) / np.sqrt(d_)).astype(np.float32)
    rms = np.float32(np.sqrt(np.mean(np.square(k, dtype=np.float64))) or 1.0)
    v = (k @ w) * np.float32(rho_ / rms)
    v += np.float32(np.sqrt(1.0 - rho_ * rho_)) * rng.standard_normal((n_, dv_), dtype=np.float32)
    return q, k, v


SYNTHETIC_KINDS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]] = {
    "gaussian": gaussian,
    "clustered": clustered,
    "correlated": correlated,
}


def parse_spec_value(text: str) -> Any:
    """One value of a ``key=value`` spec string as Python: none/null, true/false, an int (``65_536``, and
    ``1e6`` when integral), a float, else the text.

    >>> parse_spec_value("65_536"), parse_spec_value("1e3"), parse_spec_value("0.5"), parse_spec_value("x")
    (65536, 1000, 0.5, 'x')
    """
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text.replace("_", ""))
    except ValueError:
        pass
    try:
        x = float(text)
    except ValueError:
        return text
    return int(x) if x.is_integer() and ("e" in low) and abs(x) < 2**53 else x


def synthetic(spec: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate synthetic ``(q, k, v)`` from a spec string.

    Parameters
    ----------
    spec : str
        ``"synthetic:key=value,..."`` (the ``synthetic:`` prefix is optional) with required ``n`` and ``d``,
        ``kind`` in {"gaussian", "clustered", "correlated"} (default "gaussian"), and any keyword of that
        generator: ``seed``, ``n_queries``, ``dv``, ``norm_profile`` (gaussian, correlated),
        ``n_clusters``, ``spread``, ``intrinsic_dim`` (clustered), ``rho`` (correlated).  Integers may be
        written ``65536``, ``65_536`` or ``1e6``; e.g. ``"synthetic:n=65536,d=64,kind=clustered"``.

    Returns
    -------
    q, k, v : numpy.ndarray
        float32, shapes (n_queries, d), (n, d), (n, dv).
    """
    fn, params = _parse_synthetic(spec)
    return fn(**params)


def synthetic_sizes(spec: str) -> tuple[int, int, int, int]:
    """``(n_queries, n, d, dv)`` of a :func:`synthetic` spec, checked without generating anything.

    Raises the same ``ValueError``/``TypeError`` as :func:`synthetic` for a malformed spec or a size that
    is not a positive integer, so callers can check memory before generating.
    """
    _, params = _parse_synthetic(spec)
    n, d, nq, dv = _sizes(params.get("n"), params.get("d"), params.get("n_queries"), params.get("dv"))
    return nq, n, d, dv


def _parse_synthetic(spec: str) -> tuple[Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]], dict[str, Any]]:
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str like 'synthetic:n=65536,d=64,kind=clustered'; got "
                        f"{type(spec).__name__}.")
    body = spec.strip()
    if body.startswith("synthetic:"):
        body = body[len("synthetic:"):]
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        if "=" not in item:
            raise ValueError(f"malformed item {item!r} in spec {spec!r}; expected key=value pairs, e.g. "
                             f"'synthetic:n=65536,d=64,kind=clustered'.")
        key, val = (s.strip() for s in item.split("=", 1))
        if key in params:
            raise ValueError(f"duplicate key {key!r} in spec {spec!r}.")
        params[key] = parse_spec_value(val)
    kind = params.pop("kind", "gaussian")
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r} in spec {spec!r}; available: {sorted(SYNTHETIC_KINDS)}.")
    missing = [k for k in ("n", "d") if k not in params]
    if missing:
        raise ValueError(f"spec {spec!r} lacks {missing}; e.g. 'synthetic:n=65536,d=64,kind={kind}'.")
    fn = SYNTHETIC_KINDS[kind]
    allowed = [p for p in inspect.signature(fn).parameters]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for kind={kind!r} in spec {spec!r}; allowed: {allowed}.")
    return fn, params


# --------------------------------------------------------------------------------------------------------
# passkey / needle workloads for decode recall
# --------------------------------------------------------------------------------------------------------
PASSKEY_BACKGROUNDS = ("clustered", "gaussian")


@dataclass(frozen=True)
class Passkey:
    """A decode workload with planted keys that carry a known share of each query's softmax mass.

    Attributes
    ----------
    keys : numpy.ndarray, float32, shape (H, n, d)
        Background keys with the planted ones written in place.
    values : numpy.ndarray, float32, shape (H, n, dv)
        Standard-normal values (independent of the keys).
    queries : numpy.ndarray, float32, shape (H, n_queries, d)
        One decode query per row; query ``(h, t)`` sees every key of head ``h``.
    positions : numpy.ndarray, int64, shape (H, n_queries, n_planted)
        Positions of the keys planted for query ``(h, t)``, sorted per row, distinct within a head.
    mass : numpy.ndarray, float64, shape (H, n_queries)
        Softmax mass the planted keys of query ``(h, t)`` hold among all ``n`` keys of its head, computed in
        float64 from the float32 arrays returned.
    scale : float
        Score scale used (``q.k * scale`` are the logits).
    margin : float
        Logit margin of every planted key over the largest logit of any other key for its query.
    """

    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    positions: np.ndarray
    mass: np.ndarray
    scale: float
    margin: float


_QUERY_POOL = 8  # candidate queries drawn per query kept


def _spread_queries(pool: np.ndarray, nq: int) -> np.ndarray:
    """``nq`` rows of ``pool`` chosen greedily so that the largest cosine between two kept rows is small
    (a key planted for one query then scores well below its own query's logit on the others)."""
    u = pool.astype(np.float64)
    u /= np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-30)
    keep = [0]
    worst = u @ u[0]
    for _ in range(1, nq):
        worst[keep] = np.inf
        j = int(np.argmin(worst))
        keep.append(j)
        worst = np.maximum(worst, u @ u[j])
    return np.ascontiguousarray(pool[keep])


def _passkey_background(background: object, n: int, d: int, heads: int, nq: int, dv: int,
                        seeds: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(background, str):
        if background not in PASSKEY_BACKGROUNDS:
            raise ValueError(f"background must be one of {PASSKEY_BACKGROUNDS} or a float array of keys "
                             f"(n, d) or (heads, n, d); got {background!r}.")
        K = np.empty((heads, n, d), np.float32)
        V = np.empty((heads, n, dv), np.float32)
        Q = np.empty((heads, nq, d), np.float32)
        for h in range(heads):
            pool = _QUERY_POOL * nq
            if background == "clustered":
                q, k, v = clustered(n, d, n_queries=pool, dv=dv, seed=seeds[h])
            else:
                q, k, v = gaussian(n, d, n_queries=pool, dv=dv, norm_profile="minilm", seed=seeds[h])
            K[h], V[h], Q[h] = k, v, _spread_queries(q, nq)
            del q, k, v
        return K, V, Q
    if isinstance(background, (list, tuple)) or not hasattr(background, "shape"):
        raise TypeError(f"background must be one of {PASSKEY_BACKGROUNDS} or a numpy array of keys; got "
                        f"{type(background).__name__}.")
    arr = np.asarray(background)
    if arr.dtype.kind != "f":
        raise TypeError(f"background keys must be a float array; got dtype {arr.dtype}.")
    if arr.ndim == 2:
        arr = np.broadcast_to(arr, (heads, *arr.shape))
    if arr.shape != (heads, n, d):
        raise ValueError(f"background keys must have shape (n, d) = ({n}, {d}) or (heads, n, d) = "
                         f"({heads}, {n}, {d}); got {tuple(np.shape(background))}. Pass n and d of the array "
                         f"(e.g. n=k.shape[-2], d=k.shape[-1]).")
    if not np.isfinite(arr).all():
        raise ValueError("background keys contain NaN or Inf; clean the array.")
    K = np.array(arr, dtype=np.float32, order="C")
    V = np.empty((heads, n, dv), np.float32)
    Q = np.empty((heads, nq, d), np.float32)
    for h in range(heads):
        rng = np.random.default_rng(seeds[h])
        V[h] = rng.standard_normal((n, dv), dtype=np.float32)
        # queries: random directions with the keys' median norm (out of the keys' distribution, as real
        # decode queries are)
        u = rng.standard_normal((_QUERY_POOL * nq, d))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        Q[h] = _spread_queries((u * float(np.median(np.linalg.norm(K[h], axis=1)))).astype(np.float32), nq)
    return K, V, Q

def _passkey_args(n: Any, d: Any, heads: Any, n_planted: Any, depth: Any, mass: Any, margin: Any, n_queries: Any,
                  dv: Any, scale: Any) -> tuple[Any, ...]:
    """:func:`passkey`'s arguments checked: (n, d, heads, n_planted, n_queries, dv, mass, margin, scale, and
    the band [a, b) of positions the planted keys go to); TypeError / ValueError naming the argument."""
    n_ = check_positive_int(n, "n")
    d_ = check_positive_int(d, "d")
    H = check_positive_int(heads, "heads")
    npl = check_positive_int(n_planted, "n_planted")
    nq = check_positive_int(n_queries, "n_queries")
    dv_ = d_ if dv is None else check_positive_int(dv, "dv")
    frac = _check_real(mass, "mass", low=0.0, high=1.0)
    if not 0.0 < frac < 1.0:
        raise ValueError(f"mass must be in (0, 1) (the planted keys' minimum softmax share); got {frac}.")
    gap = _check_real(margin, "margin", low=0.0)
    if scale is None:
        sc = 1.0 / np.sqrt(d_)
    else:
        sc = _check_real(scale, "scale", low=0.0)
        if sc <= 0:
            raise ValueError(f"scale must be > 0 (or None: 1/sqrt(d)); got {sc}.")
    if not isinstance(depth, (tuple, list)) or len(depth) != 2:
        raise TypeError(f"depth must be a pair (low, high) of fractions in [0, 1]; got {depth!r}.")
    lo = _check_real(depth[0], "depth[0]", low=0.0, high=1.0)
    hi = _check_real(depth[1], "depth[1]", low=0.0, high=1.0)
    if lo > hi:
        raise ValueError(f"depth must be (low, high) with low <= high; got {tuple(depth)}.")
    need = nq * npl
    a = min(int(lo * n_), n_ - need) if need <= n_ else 0
    b = max(int(np.ceil(hi * n_)), a + need)
    if need > n_ or b > n_:
        raise ValueError(f"n_queries * n_planted = {nq} * {npl} = {need} planted keys do not fit in the "
                         f"depth band {tuple(depth)} of n={n_} keys; lower n_planted or n_queries, or "
                         f"widen depth.")
    return n_, d_, H, npl, nq, dv_, frac, gap, sc, a, b



def _plant(Kh: np.ndarray, Qh: np.ndarray, p: np.ndarray, sc: float, frac: float, gap: float, h: int) -> np.ndarray:
    """Plant one head's keys in place: Kh (n, d) float32 background keys, Qh (nq, d) queries, p (nq, npl)
    sorted positions per query; every planted key of query t gets the same logit, raised until the planted
    keys hold >= ``frac`` of t's softmax and lead every other key by ``gap`` (see :func:`passkey`).
    Returns the planted mass per query (nq,) float64."""
    n_ = Kh.shape[0]
    npl = p.shape[1]
    q64 = Qh.astype(np.float64)
    qn = np.linalg.norm(q64, axis=1)
    if not (qn > 0).all():
        raise ValueError(f"a query of head {h} is zero; planted keys need a direction to point at.")
    qhat = q64 / qn[:, None]
    planted = np.zeros(n_, bool)
    planted[p.ravel()] = True
    base = Kh[p].astype(np.float64)  # (nq, npl, d): keep the orthogonal part
    base -= np.einsum("tpd,td->tp", base, qhat)[:, :, None] * qhat[:, None, :]
    bg = Kh[~planted].astype(np.float64) @ q64.T * sc  # (n - need, nq) background logits
    m = bg.max(axis=0)
    z = np.exp(bg - m).sum(axis=0)  # background sum relative to its max
    del bg
    # logit L with npl*e^L >= frac/(1-frac) * Z_bg and L >= max_bg + margin
    L = np.maximum(m + np.log(frac / (1 - frac) * z / npl), m + gap)
    for _ in range(50):
        Kh[p] = (base + (L / (sc * qn))[:, None, None] * qhat[:, None, :]).astype(np.float32)
        lg = Kh.astype(np.float64) @ q64.T * sc  # (n, nq)
        mx = lg.max(axis=0)
        w = np.exp(lg - mx)
        tot = w.sum(axis=0)
        own = np.take_along_axis(w, p.T, axis=0).sum(axis=0)  # (nq,)
        got = own / tot
        rest = lg.copy()
        np.put_along_axis(rest, p.T, -np.inf, axis=0)  # every key but the query's own planted ones
        short = gap - (np.take_along_axis(lg, p.T, axis=0).min(axis=0) - rest.max(axis=0))
        del rest
        ok = (got >= frac) & (short <= gap * 1e-6)
        del lg, w
        if ok.all():
            break
        # raise the failing queries' logits by the mass deficit or the missing gap (at least a little)
        deficit = np.maximum(np.log(frac / (1 - frac) * (tot - own) / np.maximum(own, 1e-300)), short)
        L = np.where(ok, L, L + np.maximum(deficit, 0.05))
    else:  # pragma: no cover - the logits grow geometrically; 50 rounds always suffice in float32 range
        raise RuntimeError(f"passkey: could not reach mass {frac} for head {h}; lower mass or n_planted.")
    return got


def passkey(n: int, d: int, *, heads: int = 8, n_planted: int = 4, depth: tuple[float, float] = (0.0, 1.0),
            mass: float = 0.5, margin: float = 2.0, background: object = "clustered", n_queries: int = 16,
            dv: int | None = None, scale: float | None = None, seed: int = 0) -> Passkey:
    """Passkey (needle) decode workload: per query a few planted keys far back that hold most of its mass.

    For every head ``h`` and decode query ``t`` the generator picks ``n_planted`` distinct positions in the
    ``depth`` band of the cache and replaces the background key there by one that points at the query: the
    background key's component orthogonal to the query is kept (so the planted key stays inside its
    cluster in every other direction, and a cluster's mean does not reveal it) and its component along the
    query is set so that every planted key has the same logit ``L = scale * q.k``, with ``L`` at least
    ``margin`` above the query's logit of every other key (the other queries' planted keys included: the
    planted keys are the query's exact top-``n_planted``) and large enough that the planted keys
    together hold at least ``mass`` of the query's softmax over all ``n`` keys (float64).  The planted keys
    of the other queries count as background; the logits are raised until every query meets both
    conditions.  The queries are picked from a larger draw so that no two point the same way (their
    largest cosine is kept small), else a key planted for one would be a planted key of another.

    Parameters
    ----------
    n, d : int
        Keys per head and head dimension.
    heads : int, default 8
        Heads H (each with its own background, queries and planted keys).
    n_planted : int, default 4
        Planted keys per query (1-16 in the benchmarks); ``n_queries * n_planted <= `` the band's length.
    depth : (float, float), default (0.0, 1.0)
        Band of positions, as fractions of ``n`` (``0`` the oldest key, ``1`` the newest), where the planted
        keys go; ``depth=(0.1, 0.1)`` plants them all at position ``int(0.1 n)`` onwards.
    mass : float in (0, 1), default 0.5
        Minimum softmax mass the planted keys of a query hold together.
    margin : float >= 0, default 2.0
        Minimum logit gap between every planted key and the best other key (background or planted for
        another query) of its query.
    background : {"clustered", "gaussian"} or float array (n, d) or (heads, n, d), default "clustered"
        ``"clustered"``: :func:`clustered` keys and queries; ``"gaussian"``: :func:`gaussian` with the
        MiniLM norm profile (norm-matched); an array: your own keys (for example real MiniLM keys,
        ``load("store", head=0, dtype="float32").k``), with random-direction queries of the keys' median
        norm.
    n_queries : int, default 16
        Decode queries per head.
    dv : int, optional
        Value dimension (default ``d``).
    scale : float, optional
        Logit scale (default ``1/sqrt(d)``).
    seed : int, default 0

    Returns
    -------
    Passkey
        ``keys`` float32 (H, n, d), ``values`` float32 (H, n, dv), ``queries`` float32 (H, n_queries, d),
        ``positions`` int64 (H, n_queries, n_planted), ``mass`` float64 (H, n_queries), ``scale``,
        ``margin``.

    Examples
    --------
    >>> from sparseattn import data
    >>> w = data.passkey(4096, 32, heads=2, n_planted=2, n_queries=3, seed=0)
    >>> w.keys.shape, w.queries.shape, w.positions.shape, bool((w.mass >= 0.5).all())
    ((2, 4096, 32), (2, 3, 32), (2, 3, 2), True)
    """
    n_, d_, H, npl, nq, dv_, frac, gap, sc, a, b = _passkey_args(n, d, heads, n_planted, depth, mass, margin,
                                                                 n_queries, dv, scale)
    need = nq * npl
    ss = np.random.SeedSequence(_rng(seed).integers(0, 2**63))
    seeds = [int(x) for x in ss.generate_state(2 * H, dtype=np.uint64)]
    K, V, Q = _passkey_background(background, n_, d_, H, nq, dv_, seeds[:H])
    pos = np.empty((H, nq, npl), np.int64)
    got = np.empty((H, nq), np.float64)
    for h in range(H):
        rng = np.random.default_rng(seeds[H + h])
        p = (a + rng.choice(b - a, size=need, replace=False)).reshape(nq, npl)
        p.sort(axis=1)
        pos[h] = p
        got[h] = _plant(K[h], Q[h], p, sc, frac, gap, h)
    return Passkey(keys=K, values=V, queries=Q, positions=pos, mass=got, scale=float(sc), margin=gap)
