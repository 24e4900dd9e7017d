"""The decode workload of :class:`sparseattn.KVCache`, measured: latency, append cost, index memory, accuracy.

:func:`run_decode` fills one cache per selector with the same keys (the prompt as one ``append``, then
``steps`` decode steps of one appended token and one query per head) and measures, per selector:

* per-step latency of ``attend`` (p50 / p99 over the steps; all caches step side by side, so machine load
  hits them alike), and our dense step (``selector="dense"``, the same Numba kernel over every key);
* torch's ``scaled_dot_product_attention`` on a ``(1, H, 1, E)`` query over the same keys and values
  (float32), timed in this run and again in a fresh process that imports numpy and torch only, with the
  user's environment (as :func:`sparseattn.tools.bench.fresh_sdpa_seconds` does for ``compare``), the two
  compared by :func:`sparseattn.tools.bench.fairness_flag`; the *faster* of the two (by p50) is the baseline of
  every speed-up (as in ``compare``).  Why not always the fresh one: a decode step is well under a
  millisecond, and a fresh process runs torch with the user's OpenMP settings, where on a busy machine
  the wake-ups of torch's thread pool can dominate (more than 10x slower at 4 heads x 2,000 keys, 2
  threads, load average 7 on 2 cores), while this process sets passive OpenMP waits (:mod:`sparseattn._numba_setup`); the faster time never flatters us;
* append cost per token (prompt and steps, amortised: the k-means of every segment included) and index
  bytes over key/value bytes at the end;
* accuracy of every step against exact attention over the whole cache (float64, from the keys and values
  as given, before storage rounding): output relative error ``||o - o*|| / ||o*||``, softmax mass of the
  keys read (``exp(lse - lse*)``), and recall@k (share of the exact top-k keys the step read).

Results are a plain dict (:func:`run_decode`); :func:`render_text`, :func:`render_markdown`,
:func:`render_html` and :func:`write_decode` render it (``sparseattn decode`` on the command line).

Reusable pieces: :func:`open_source` / :meth:`KeySource.workload` (keys, values and step queries from a
trace or a synthetic spec), :func:`exact_step` (the float64 reference of one step), :func:`step_accuracy`,
:func:`step_recall`, :func:`latency_summary`, :func:`fresh_sdpa_steps`.
"""

from __future__ import annotations

import html
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _numba_setup
from .. import data as data_mod
from ..threads import get_num_threads, single_threaded_blas

__all__ = ["DEFAULT_SELECTORS", "DTYPES", "DecodeWorkload", "KeySource", "check_selectors", "exact_step",
           "fresh_sdpa_steps", "latency_summary", "open_source", "render_html", "render_markdown", "render_text",
           "run_decode", "split_selectors", "step_accuracy", "step_recall", "write_decode"]

SCHEMA = "sparseattn.decode/1"
#: Cache selectors measured by default (``dense`` is always measured, as the exact baseline).
DEFAULT_SELECTORS = ("sketch", "cluster", "pages", "window", "topk")
#: Storage dtypes of the cache.
DTYPES = ("float32", "float16", "bfloat16")
#: Heads taken from a trace by default (evenly spaced when it has more); synthetic data: 4.
DEFAULT_HEADS = 8
SYNTHETIC_HEADS = 4
_REF_CHUNK = 65536  # keys per float64 block of the exact reference (bounds its temporary memory)
_WIDE_MAX = 2**30  # bytes of float64 copies of the keys and values the reference may hold


# ------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class DecodeWorkload:
    """Keys, values and step queries of one decode run.

    k (H, length + steps, E), v (H, length + steps, Ev), q (H, steps, E): float32, C-contiguous; keys in
    position order.  Step ``s`` appends key ``length + s`` and attends ``q[:, s]``.
    """

    data: str
    description: str
    k: np.ndarray
    v: np.ndarray
    q: np.ndarray
    length: int
    scale: float
    queries: str  # how the step queries were chosen

    @property
    def heads(self) -> int:
        return int(self.k.shape[0])

    @property
    def steps(self) -> int:
        return int(self.q.shape[1])


@dataclass
class KeySource:
    """Where the keys come from: a trace (arrays loaded) or a synthetic spec (generated per head).

    ``groups``: independent (batch, head) groups of a trace, None for synthetic data (any number of
    heads, one seeded generator call each); ``n_keys``: keys per group.
    """

    data: str
    description: str
    n_keys: int
    head_dim: int
    value_dim: int
    scale: float
    groups: int | None
    q: np.ndarray | None = None  # (G, L, E) float32
    k: np.ndarray | None = None  # (G, S, E), position order
    v: np.ndarray | None = None  # (G, S, Ev)
    q_pos: np.ndarray | None = None  # (L,) int64 positions of the queries, if the data gives them
    k_pos: np.ndarray | None = None  # (S,) sorted int64 positions of the keys, if the data gives them

    def default_heads(self) -> int:
        return SYNTHETIC_HEADS if self.groups is None else min(self.groups, DEFAULT_HEADS)

    def workload(self, heads: int, length: int, steps: int) -> DecodeWorkload:
        """Keys ``0 .. length + steps - 1`` of ``heads`` heads and the queries of the ``steps`` steps.

        Queries: the trace's query at each step's position when the data says where its queries sit
        (``q_pos``, or as many queries as keys: query i at position i); otherwise ``steps`` evenly spaced
        queries of the data (synthetic queries have no position).
        """
        for name, value, low in (("heads", heads, 1), ("length", length, 1), ("steps", steps, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}.")
        if self.groups is not None and heads > self.groups:
            raise ValueError(f"heads={heads} exceeds the {self.groups} heads (groups) of {self.data}; use heads "
                             f"<= {self.groups}.")
        total = length + steps
        if total > self.n_keys:
            raise ValueError(f"length + steps = {length:,} + {steps} exceeds the {self.n_keys:,} keys of "
                             f"{self.data}; use length <= {self.n_keys - steps:,}.")
        if self.groups is None:
            return self._synthetic(heads, length, steps)
        assert self.q is not None and self.k is not None and self.v is not None
        pick = np.unique(np.linspace(0, self.groups - 1, heads).round().astype(np.int64))
        k = np.ascontiguousarray(self.k[pick, :total], dtype=np.float32)
        v = np.ascontiguousarray(self.v[pick, :total], dtype=np.float32)
        L = self.q.shape[1]
        rows, how = None, f"{steps} evenly spaced of the data's {L:,} queries"
        if self.q_pos is not None:
            kp = self.k_pos[length:total] if self.k_pos is not None else np.arange(length, total)
            where = {int(p): i for i, p in enumerate(self.q_pos)}
            if all(int(p) in where for p in kp):
                rows, how = np.array([where[int(p)] for p in kp]), "the data's queries at the step positions"
        elif L == self.n_keys:
            rows, how = np.arange(length, total), "the data's queries at the step positions"
        if rows is None:
            rows = np.linspace(0, L - 1, steps).round().astype(np.int64)
        q = np.ascontiguousarray(self.q[pick][:, rows], dtype=np.float32)
        return DecodeWorkload(self.data, self.description, k, v, q, length, self.scale, how)

    def _synthetic(self, heads: int, length: int, steps: int) -> DecodeWorkload:
        total = length + steps
        E, Ev = self.head_dim, self.value_dim
        k = np.empty((heads, total, E), np.float32)
        v = np.empty((heads, total, Ev), np.float32)
        q = np.empty((heads, steps, E), np.float32)
        for h in range(heads):  # one generator call per head: seed, seed + 1, ...
            qh, kh, vh = data_mod.synthetic(synthetic_head_spec(self.data, h, n_queries=steps))
            k[h], v[h] = kh[:total], vh[:total]
            q[h] = qh[np.linspace(0, qh.shape[0] - 1, steps).round().astype(np.int64)]
        return DecodeWorkload(self.data, self.description, k, v, q, length, self.scale,
                              "the generator's queries (seed + head)")


def synthetic_head_spec(spec: str, head: int, *, n: int | None = None, n_queries: int | None = None) -> str:
    """The :func:`sparseattn.data.synthetic` spec of head ``head``: ``seed`` raised by ``head``; ``n`` and
    ``n_queries`` replaced when given (``n_queries`` only when the spec has none)."""
    body = spec.partition(":")[2] if spec.startswith("synthetic:") else spec
    keyed = {it.partition("=")[0].strip(): it.partition("=")[2].strip()
             for it in body.split(",") if it.strip()}
    seed = data_mod.parse_spec_value(keyed.pop("seed", "0"))
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        seed = int(seed) + head
    elif head:
        raise ValueError(f"seed must be an integer; got {seed!r} in {spec!r}.")
    if n is not None:
        keyed["n"] = str(n)
    if n_queries is not None and "n_queries" not in keyed:
        keyed["n_queries"] = str(n_queries)
    return "synthetic:" + ",".join(f"{a}={b}" for a, b in keyed.items()) + f",seed={seed}"


def open_source(data: str) -> KeySource:
    """A :class:`KeySource` from the values ``sparseattn compare --data`` accepts.

    ``"store"``, ``"window"``, ``"NAME@DIR"`` (traces: every (batch, head) pair is one group),
    ``"synthetic:n=...,d=...,..."`` (generated per head on :meth:`KeySource.workload`), or your arrays (an
    ``.npz``, a folder of ``.npy`` files, ``"q.npy,k.npy,v.npy"``; :func:`sparseattn.data.load_user`), whose
    optional ``k_pos`` orders the keys and ``q_pos`` places the queries.

    Raises ``ValueError``/``TypeError``/``FileNotFoundError`` for an unknown or malformed spec.
    """
    from . import bench

    if not isinstance(data, str) or not data.strip():
        raise ValueError(f"data must be 'store', 'window', NAME@DIR, 'synthetic:n=...,d=...' or a file; got "
                         f"{data!r}.")
    if data.startswith("synthetic"):
        nq, n, d, dv = data_mod.synthetic_sizes(data)
        data_mod.synthetic(synthetic_head_spec(data, 0, n=min(n, 64), n_queries=1))  # checks every parameter
        kind = dict(it.strip().partition("=")[::2] for it in data.partition(":")[2].split(",")
                    if "=" in it).get("kind", "gaussian")
        return KeySource(data, f"synthetic {kind.strip()} keys", n, d, dv, 1.0 / float(np.sqrt(d)), None)
    if data_mod.is_user_data(data):
        trace = data_mod.load_user(data, dtype=np.float32)
        E, Ev = trace.q.shape[-1], trace.v.shape[-1]
        q = trace.q.reshape(-1, trace.q.shape[-2], E)
        k = trace.k.reshape(-1, trace.k.shape[-2], E)
        v = trace.v.reshape(-1, trace.v.shape[-2], Ev)
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"{data}: q has {q.shape[0]} (batch, head) groups and k has {k.shape[0]}; give "
                             f"the same leading axes.")
        k_pos = trace.positions.get("k_pos")
        q_pos = trace.positions.get("q_pos")
        if k_pos is not None:
            order = np.argsort(k_pos, kind="stable")  # keys are appended in position order
            k, v, k_pos = k[:, order], v[:, order], k_pos[order]
            if np.any(np.diff(k_pos) == 0):
                raise ValueError(f"{data}: k_pos repeats a position; give each key its own position.")
        return KeySource(data, trace.meta["description"], k.shape[1], E, Ev, trace.scale, q.shape[0], q, k, v,
                         q_pos, k_pos)
    wl = bench.load_workload(data)
    return KeySource(data, wl.description, wl.k.shape[1], wl.k.shape[2], wl.v.shape[2], wl.scale, wl.q.shape[0],
                     wl.q, wl.k, wl.v)


# ------------------------------------------------------------------------------------------ measures
def exact_step(k: np.ndarray, v: np.ndarray, q: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention of one query per head over every key, in float64.

    k (H, m, E), v (H, m, Ev), q (H, E), any float dtype.  Returns out (H, Ev) float64 and lse (H,) float64
    (log-sum-exp of the scaled scores).  Keys are scored in blocks of 65,536 (bounded temporary memory).
    """
    H, m = k.shape[0], k.shape[1]
    q64 = np.asarray(q, np.float64)
    out = np.empty((H, v.shape[2]))
    lse = np.empty(H)
    for h in range(H):
        s = np.empty(m)
        for a in range(0, m, _REF_CHUNK):
            s[a:a + _REF_CHUNK] = (k[h, a:a + _REF_CHUNK].astype(np.float64, copy=False) @ q64[h]) * scale
        mx = s.max()
        w = np.exp(s - mx)
        tot = w.sum()
        acc = np.zeros(v.shape[2])
        for a in range(0, m, _REF_CHUNK):
            acc += w[a:a + _REF_CHUNK] @ v[h, a:a + _REF_CHUNK].astype(np.float64, copy=False)
        out[h] = acc / tot
        lse[h] = mx + np.log(tot)
    return out, lse


def step_accuracy(out: np.ndarray, lse: np.ndarray | None, ref_out: np.ndarray, ref_lse: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """Per head: output relative error ``||o - o*|| / ||o*||`` and softmax mass ``min(1, exp(lse - lse*))``.

    out/ref_out (H, Ev), lse/ref_lse (H,); mass is None without ``lse``.
    """
    o = np.asarray(out, np.float64)
    den = np.maximum(np.linalg.norm(ref_out, axis=1), np.finfo(np.float64).tiny)
    err = np.linalg.norm(o - ref_out, axis=1) / den
    mass = None if lse is None else np.exp(np.minimum(np.asarray(lse, np.float64) - ref_lse, 0.0))
    return err, mass


def step_recall(cache: Any, q: np.ndarray, k: int) -> np.ndarray:
    """Per head: share of the exact top-``k`` keys of the cache (by score, every visible key) that the
    cache's step reads, from :meth:`KVCache.selected_slots` (both sets in the cache's own slot ids).

    q (H, E) float32, the queries of the step just attended; returns (H,) float64.  A ``"topk"`` cache
    reads exactly that set (recall 1 by construction, ties aside), and a step that read every visible key
    contains it: the callers of :func:`run_decode` skip the call for those (it sorts every key's score).
    """
    rec = np.empty(q.shape[0])
    for h in range(q.shape[0]):
        sel = cache.selected_slots(q[h], h, k)
        top = cache.selected_slots(q[h], h, k, selector="topk")
        rec[h] = np.isin(top, sel).mean() if top.size else 1.0
    return rec


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """``{"p50_ms", "p99_ms", "mean_ms"}`` of per-step times in seconds."""
    a = np.asarray(seconds, np.float64) * 1e3
    return {"p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


# Runs in a fresh interpreter that imports numpy and torch only (never sparseattn or Numba): the decode
# steps of run_decode's in-run SDPA loop, the same shapes, slices, queries and thread count.
_FRESH_SDPA_STEPS = r"""
import json, sys, time
import numpy as np
import torch
path, length, scale, n_threads = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(n_threads)
with np.load(path) as f:
    tk, tv, q = (torch.from_numpy(np.ascontiguousarray(f[n]))[None] for n in ("k", "v", "q"))
sdpa = torch.nn.functional.scaled_dot_product_attention
times = []
with torch.no_grad():
    sdpa(q[:, :, :1], tk[:, :, :length], tv[:, :, :length], scale=scale)
    for s in range(q.shape[2]):
        m = length + s + 1
        t0 = time.perf_counter()
        sdpa(q[:, :, s:s + 1], tk[:, :, :m], tv[:, :, :m], scale=scale)
        times.append(time.perf_counter() - t0)
print(json.dumps({"seconds": times, "threads": torch.get_num_threads()}))
"""


def fresh_sdpa_steps(wl: DecodeWorkload, *, timeout: float | None = None) -> list[float]:
    """Seconds of each decode step of torch SDPA on ``wl``, timed in a fresh Python process without Numba.

    Same loop as the in-run timing of :func:`run_decode` (one warm-up call, then step ``s`` attends
    ``q[:, s]`` over keys ``0 .. length + s``), thread count :func:`sparseattn.threads.get_num_threads`,
    the user's environment (:func:`sparseattn._numba_setup.user_environ`).  Raises ``RuntimeError`` with
    the child's last error line when it fails (e.g. torch missing for ``sys.executable``).
    """
    with tempfile.TemporaryDirectory(prefix="sparseattn-decode-") as tmp:
        path = os.path.join(tmp, "kvq.npz")
        np.savez(path, k=wl.k, v=wl.v, q=wl.q)
        cmd = [sys.executable, "-c", _FRESH_SDPA_STEPS, path, str(wl.length), repr(float(wl.scale)),
               str(get_num_threads())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_numba_setup.user_environ())
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"fresh-process SDPA timing failed (exit {proc.returncode}): {last}")
    return [float(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]]


# --------------------------------------------------------------------------------------------- run
def split_selectors(text: str) -> list[str]:
    """Cache selectors of a comma list; a piece ``key=value`` with no ``:`` before its ``=`` continues the
    previous spec (``"cluster,faiss-hnsw:M=16,ef_search=64"`` -> ``["cluster", "faiss-hnsw:M=16,ef_search=64"]``)."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if out and ":" in out[-1] and "=" in piece and ":" not in piece.partition("=")[0]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def check_selectors(selectors: Sequence[str]) -> list[str]:
    """Validate cache selectors (by constructing a tiny :class:`KVCache` with each); deduplicated,
    ``dense`` dropped (always measured).  The error names the bad one and what the cache accepts."""
    from ..cache import KVCache

    out: list[str] = []
    for name in selectors:
        name = name.strip()
        try:
            KVCache(1, 8, selector=name)
        except (ValueError, TypeError, ImportError) as exc:
            raise type(exc)(f"cache selector {name!r} refused: {exc}") from None
        if name != "dense" and name not in out:
            out.append(name)
    return out


def run_decode(wl: DecodeWorkload, selectors: Sequence[str] = DEFAULT_SELECTORS, *, k: int = 64,
               dtype: str = "float32", sdpa: bool = True, fairness: bool = True,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the decode workload ``wl`` on one :class:`KVCache` per selector; return the results as a dict.

    Parameters
    ----------
    wl : DecodeWorkload
        Keys, values, step queries (:meth:`KeySource.workload`).
    selectors : cache selector names (``"cluster"``, ``"pages"``, ``"window"``, ``"topk"``, ...); ``dense``
        is always measured as the exact baseline.
    k : int
        Keys per query of the ``topk`` selector, and the k of recall@k.
    dtype : {"float32", "float16", "bfloat16"}
        Storage of every cache (accumulation is float32).
    sdpa : bool
        Time torch SDPA (when torch is installed); ``fairness`` re-times it in a fresh process.
    progress : callable, optional
        Called with a short message before the prefill, each step and the fresh-process timing
        (``2 + steps`` calls with SDPA, ``1 + steps`` without).

    Returns
    -------
    dict with ``schema``, ``data``, ``workload`` (description, heads, length, steps, E, Ev, scale, queries),
    ``k``, ``dtype``, ``machine``, ``sdpa`` (None without torch), ``fairness`` and ``results``: one dict per
    selector, ``dense`` first: ``selector``, ``p50_ms``, ``p99_ms``, ``mean_ms``, ``step_ms`` (per step),
    ``prefill_s``, ``append_us_per_token``, ``kv_bytes``, ``index_bytes``, ``index_over_kv``, ``keys_read``
    (mean per query), ``read_fraction``, ``rel_err`` / ``rel_err_max``, ``mass`` / ``mass_min``,
    ``recall`` / ``recall_min`` (means and worst over steps and heads), ``per_step`` (lists of the
    per-step means), ``speedup_vs_dense`` and ``speedup_vs_sdpa``.
    """
    from . import bench

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}.")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1; got {k!r}.")
    names = ["dense", *check_selectors(selectors)]
    say = progress or (lambda msg: None)
    torch = importlib.import_module("torch") if sdpa and bench.prepare_torch() else None  # before any Numba kernel
    H, n, steps, E = wl.heads, wl.length, wl.steps, wl.k.shape[2]
    storage: object = {"float32": np.float32, "float16": np.float16}.get(dtype, dtype)
    say("prefill")
    caches, prefill = _fill_caches(names, wl, storage, k)
    times: dict[str, list[float]] = {name: [] for name in names}
    acc: dict[str, dict[str, list[np.ndarray]]] = {name: {"err": [], "mass": [], "recall": []} for name in names}
    reads: dict[str, list[float]] = {name: [] for name in names}
    sdpa_times, sdpa_err = [], []  # SDPA seconds and per-head errors per step
    for name in names:  # warm-up: JIT (or the kernel cache) and first-touch of the caches
        caches[name].attend(wl.q[:, :1], k=k)
    if torch is not None:
        tq, tk, tv = _sdpa_inputs(torch, wl)
    # the float64 reference reads float64 copies made once, up to _WIDE_MAX bytes (else the float32
    # arrays, widened block by block in exact_step)
    wide = 8 * (wl.k.size + wl.v.size) <= _WIDE_MAX
    k64, v64 = (wl.k.astype(np.float64), wl.v.astype(np.float64)) if wide else (wl.k, wl.v)
    for s in range(steps):
        say(f"step {s + 1}/{steps}")
        m = n + s + 1
        for c in caches.values():
            c.append(wl.k[:, m - 1:m], wl.v[:, m - 1:m])
        q = np.ascontiguousarray(wl.q[:, s])
        outs: dict[str, Any] = {}
        reads_all: dict[str, bool] = {}
        r = s % len(names)  # timed calls back to back, in an order rotated each step (none always runs
        for name in names[r:] + names[:r]:  # first, right after the single-threaded reference)
            c = caches[name]
            t0 = time.perf_counter()
            outs[name] = c.attend(q[:, None], k=k, return_lse=True)
            times[name].append(time.perf_counter() - t0)
            st = c.stats
            reads[name].append(float(st["keys_read_per_query"]))
            reads_all[name] = st["keys_read_per_query"] >= m
        if torch is not None:
            with torch.no_grad():
                t0 = time.perf_counter()
                o = torch.nn.functional.scaled_dot_product_attention(tq[:, :, s:s + 1], tk[:, :, :m], tv[:, :, :m],
                                                                     scale=wl.scale)
                sdpa_times.append(time.perf_counter() - t0)
        # accuracy, untimed; a few small products each: BLAS threads would only wait for each other
        with single_threaded_blas():
            ref_out, ref_lse = exact_step(k64[:, :m], v64[:, :m], q, wl.scale)
            if torch is not None:
                sdpa_err.append(step_accuracy(o[0, :, 0].numpy(), None, ref_out, ref_lse)[0])
            for name in names:
                _score(acc[name], outs[name], name == "topk" or reads_all[name], caches[name], q, k, ref_out,
                       ref_lse)
    results = [_summary(name, caches[name], times[name], acc[name], reads[name], n, steps) for name in names]
    for row in results:
        row["prefill_s"] = prefill[row["selector"]]
    sdpa_rec, fair = _sdpa_record(wl, torch is not None, sdpa, fairness, sdpa_times, sdpa_err, say)
    for r in results:
        r["speedup_vs_dense"] = results[0]["p50_ms"] / r["p50_ms"] if r["p50_ms"] else None
        r["speedup_vs_sdpa"] = sdpa_rec["p50_ms"] / r["p50_ms"] if sdpa_rec and r["p50_ms"] else None
    return {"schema": SCHEMA, "data": wl.data,
            "workload": {"description": wl.description, "heads": H, "length": n, "steps": steps, "E": int(E),
                         "Ev": int(wl.v.shape[2]), "scale": float(wl.scale), "queries": wl.queries},
            "k": int(k), "dtype": dtype, "machine": bench.machine_info(), "sdpa": sdpa_rec, "fairness": fair,
            "results": results, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _score(a: dict[str, list[np.ndarray]], res: tuple[np.ndarray, np.ndarray], exact: bool, cache: Any,
           q: np.ndarray, k: int, ref_out: np.ndarray, ref_lse: np.ndarray) -> None:
    """Append one step's per-head output error, softmax mass and recall@k (1 when ``exact``: the exact
    top-k itself, or a step that read every key) of a cache's result ``res = (out, lse)`` to ``a``."""
    out, lse = res
    err, mass = step_accuracy(out[:, 0], lse[:, 0], ref_out, ref_lse)
    a["err"].append(err)
    a["mass"].append(mass)
    a["recall"].append(np.ones(out.shape[0]) if exact else step_recall(cache, q, k))


def _sdpa_inputs(torch: Any, wl: DecodeWorkload) -> tuple[Any, Any, Any]:
    """The workload as torch tensors (1, H, T, E) (queries, keys, values), after one untimed SDPA step."""
    tk, tv = torch.from_numpy(wl.k)[None], torch.from_numpy(wl.v)[None]
    tq = torch.from_numpy(wl.q)[None]  # (1, H, steps, E)
    n = wl.length
    with torch.no_grad():
        torch.nn.functional.scaled_dot_product_attention(tq[:, :, :1], tk[:, :, :n], tv[:, :, :n], scale=wl.scale)
    return tq, tk, tv


def _fill_caches(names: list[str], wl: DecodeWorkload, storage: object, k: int
                 ) -> tuple[dict[str, Any], dict[str, float]]:
    """One :class:`KVCache` per selector filled with the workload's prompt (after an untimed warm-up on a
    tiny cache that compiles or loads the k-means and step kernels): (caches, prefill seconds)."""
    from ..cache import KVCache, Layout, Retention

    H, n, E = wl.heads, wl.length, wl.k.shape[2]
    rng = np.random.default_rng(0)
    for name in names:  # untimed warm-up on a tiny cache: compiles (or loads) the k-means and step kernels
        try:
            tiny = KVCache(1, E, value_dim=wl.v.shape[2], selector=name, dtype=storage,
                           retention=Retention(sinks=4, window=8),
                           layout=Layout(segment=64, cluster_size=16, page_size=16))
            tiny.append(rng.standard_normal((1, 200, E)), rng.standard_normal((1, 200, wl.v.shape[2])))
            tiny.attend(rng.standard_normal((1, 1, E)).astype(np.float32), k=k)
        except (ValueError, TypeError):  # a selector that rejects the tiny layout: warmed by the real prefill
            pass
    caches: dict[str, Any] = {}
    prefill: dict[str, float] = {}
    for name in names:
        c = KVCache(H, E, value_dim=wl.v.shape[2], selector=name, dtype=storage, scale=wl.scale)
        t0 = time.perf_counter()
        c.append(wl.k[:, :n], wl.v[:, :n])
        prefill[name] = time.perf_counter() - t0
        caches[name] = c
    return caches, prefill


def _summary(name: str, c: Any, times: list[float], a: dict[str, list[np.ndarray]], reads: list[float], n: int,
             steps: int) -> dict[str, Any]:
    """The result row of one selector (see :func:`run_decode`): latency, memory, keys read, accuracy."""
    st = c.stats
    err, mass, rec = (np.stack(a[key]) for key in ("err", "mass", "recall"))  # (steps, H)
    return {"selector": name, **latency_summary(times), "step_ms": [round(1e3 * t, 4) for t in times],
            "prefill_s": None, "append_us_per_token": float(st["append_us_per_token"]),
            "kv_bytes": int(c.kv_nbytes), "index_bytes": int(c.index_nbytes),
            "index_over_kv": c.index_nbytes / c.kv_nbytes if c.kv_nbytes else None,
            "keys_read": float(np.mean(reads)), "read_fraction": float(np.mean(reads)) / (n + steps),
            "rel_err": float(err.mean()), "rel_err_max": float(err.max()),
            "mass": float(mass.mean()), "mass_min": float(mass.min()),
            "recall": float(rec.mean()), "recall_min": float(rec.min()),
            "per_step": {"rel_err": err.mean(axis=1).tolist(), "mass": mass.mean(axis=1).tolist(),
                         "recall": rec.mean(axis=1).tolist()}}


def _sdpa_record(wl: DecodeWorkload, timed: bool, sdpa: bool, fairness: bool, sdpa_times: list[float],
                 sdpa_err: list[np.ndarray], say: Callable[[str], None]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the SDPA baseline's record or None, the fairness check) of a :func:`run_decode` run: the in-run
    timings, re-timed in a fresh process when ``fairness``; the faster of the two is the baseline."""
    from . import bench

    sdpa_rec: dict[str, Any] | None = None
    fair: dict[str, Any]
    status = _numba_setup.threading_status()
    extra = {"threading_layer": status["layer"], "tbb_preloaded": status["tbb_preloaded"],
             "tbb_preload": status["preload"]}
    if not timed:
        why = "SDPA not timed (sdpa=False, --no-sdpa)" if not sdpa else "torch is not installed: no SDPA baseline"
        fair = {**bench.fairness_flag(None, None), **extra, "reason": why, "baseline": None}
    else:
        in_run = latency_summary(sdpa_times)
        err = np.stack(sdpa_err)
        sdpa_rec = {"in_run": in_run, "fresh": None, "dtype": "float32",
                    "rel_err": float(err.mean()), "rel_err_max": float(err.max()),
                    "step_ms": [round(1e3 * t, 4) for t in sdpa_times]}
        reason = None
        if fairness:
            say("torch SDPA in a fresh process")
            try:
                sdpa_rec["fresh"] = latency_summary(fresh_sdpa_steps(wl))
            except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
                reason = str(exc)
        fresh_p50 = sdpa_rec["fresh"]["p50_ms"] if sdpa_rec["fresh"] else None
        fair = {**bench.fairness_flag(in_run["p50_ms"] / 1e3, None if fresh_p50 is None else fresh_p50 / 1e3),
                **extra}
        if reason is None and fresh_p50 is None:
            reason = "not checked (fairness=False)"
        if reason is None:
            reason = (f"in-process SDPA p50 {in_run['p50_ms']:.3g} ms vs {fresh_p50:.3g} ms in a fresh process: "
                      f"{fair['ratio']:.2f}x, tolerance {fair['tolerance']:.0%}; Numba threading layer "
                      f"{extra['threading_layer']}")
            if not fair["ok"]:
                reason += "; the two runs of torch differ by more than the tolerance"
        # the baseline is the faster of the two timings: a speed-up is never measured against a slowed torch
        # (a fresh process runs torch with the user's OpenMP settings; on a busy machine its thread pool's
        # wake-ups can dominate a sub-millisecond step, while this process sets passive OpenMP waits)
        use_fresh = sdpa_rec["fresh"] is not None and sdpa_rec["fresh"]["p50_ms"] <= in_run["p50_ms"]
        base = sdpa_rec["fresh"] if use_fresh else in_run
        fair["reason"] = reason + (f"; baseline: the faster, {'fresh process' if use_fresh else 'in this run'}"
                                   if sdpa_rec["fresh"] else "")
        fair["baseline"] = "fresh" if use_fresh else "in_run"
        sdpa_rec.update(p50_ms=base["p50_ms"], p99_ms=base["p99_ms"], mean_ms=base["mean_ms"],
                        baseline=fair["baseline"])
    return sdpa_rec, fair


# -------------------------------------------------------------------------------------------- render
COLUMNS = ("selector", "p50 ms", "p99 ms", "x SDPA", "x dense", "keys/q", "append us/tok", "index/KV",
           "out err", "mass", "recall@k")


def _label(name: str, k: int) -> str:
    from .report import selector_label

    return f"topk k={k}" if name == "topk" else selector_label(name)


def _sci(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.1e}")


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of a decode result: torch SDPA (when timed), our dense step, the selectors."""
    from .report import format_value

    k = result["k"]
    header = [c if c != "recall@k" else f"recall@{k}" for c in COLUMNS]
    rows: list[list[str]] = []
    sd = result.get("sdpa")
    if sd:
        dense_p50 = result["results"][0]["p50_ms"]
        mean_keys = result["workload"]["length"] + (result["workload"]["steps"] + 1) / 2  # every key, each step
        rows.append(["torch SDPA (exact)", format_value(sd["p50_ms"]), format_value(sd["p99_ms"]), "1.00",
                     format_value(dense_p50 / sd["p50_ms"]), format_value(mean_keys), "-", "-", _sci(sd["rel_err"]), "1", "1"])
    for r in result["results"]:
        label = "dense (ours, exact)" if r["selector"] == "dense" else _label(r["selector"], k)
        rows.append([label, format_value(r["p50_ms"]), format_value(r["p99_ms"]), format_value(r["speedup_vs_sdpa"]),
                     format_value(r["speedup_vs_dense"]), format_value(r["keys_read"]), format_value(r["append_us_per_token"]),
                     f"{r['index_over_kv']:.1%}" if r["index_over_kv"] is not None else "-",
                     _sci(r["rel_err"]), f"{r['mass']:.4f}", f"{r['recall']:.3f}"])
    return header, rows


def _title(result: dict[str, Any]) -> str:
    from .report import title_line

    w = result["workload"]
    return title_line("decode", result, [f"{w['heads']} head(s)", f"E={w['E']}",
                                         f"cache {w['length']:,} keys + {w['steps']} steps",
                                         f"{result['dtype']} storage", f"k={result['k']}"])


def _footnote(result: dict[str, Any]) -> str:
    w, k = result["workload"], result["k"]
    sdpa = ("x SDPA: speed-up (p50) over torch SDPA on a (1, H, 1, E) float32 query over the same keys, timed in "
            "this run and in a fresh process, the faster p50 taken (see the check line); " if result.get("sdpa")
            else "")
    return (f"One decode step = append one token per head, then attend one query per head ({w['queries']}); "
            f"p50/p99 over the {w['steps']} steps (the selectors timed back to back in an order rotated each "
            f"step). {sdpa}x dense: speed-up over our exact dense step, same run. "
            "keys/q: keys read per query (mean). append us/tok: the cache's append time per token, prompt and "
            "steps (clustering included). index/KV: index bytes over key/value bytes. out err: relative error "
            f"of the output, mass: softmax mass of the keys read, recall@{k}: share of the exact top-{k} keys "
            "read; means over steps and heads, against float64 attention over the keys as given (errors include "
            "storage rounding: see the dense row); topk reads the exact top-k by construction (recall 1).")


def render_text(result: dict[str, Any]) -> str:
    """A decode result (:func:`run_decode`) as a fixed-width terminal table with its notes."""
    from .report import fairness_line

    header, rows = table_rows(result)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    out = [_title(result), line(header), line(["-" * w for w in widths]), *(line(r) for r in rows),
           _footnote(result)]
    fair = fairness_line(result)
    if fair:
        out.append(fair)
    return "\n".join(out)


def render_markdown(result: dict[str, Any]) -> str:
    """A decode result as a Markdown page: title, table, notes, SDPA check, machine."""
    from .report import fairness_line, machine_line

    header, rows = table_rows(result)
    lines = [f"# {_title(result)}", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    lines += ["", _footnote(result), ""]
    fair = fairness_line(result)
    if fair:
        lines += [fair, ""]
    lines += [f"Data: `{result['data']}`. Machine: {machine_line(result)}", ""]
    return "\n".join(lines)


def render_html(result: dict[str, Any]) -> str:
    """A decode result as a standalone HTML page (same content as :func:`render_markdown`)."""
    from .report import HTML_CSS, fairness_line, machine_line

    header, rows = table_rows(result)
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    fair = fairness_line(result)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>sparseattn decode</title>"
            f"<style>{HTML_CSS}</style></head><body><h2>{html.escape(_title(result))}</h2>"
            f"<table><tr>{th}</tr>{body}</table><p>{html.escape(_footnote(result))}</p>"
            + (f"<p>{html.escape(fair)}</p>" if fair else "")
            + f"<p>Data: {html.escape(result['data'])}. Machine: {html.escape(machine_line(result))}</p>"
            "</body></html>\n")


def write_decode(result: dict[str, Any], out_dir: str, formats: Sequence[str]) -> list[str]:
    """Write ``decode.json`` / ``decode.md`` / ``decode.html`` (those of ``formats``) into ``out_dir``."""
    from .bench import json_default

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for fmt, render in (("json", None), ("md", render_markdown), ("html", render_html)):
        if fmt not in formats:
            continue
        path = os.path.join(out_dir, f"decode.{fmt}")
        with open(path, "w") as f:
            if render is None:
                json.dump(result, f, indent=2, default=json_default)
            else:
                f.write(render(result))
        written.append(path)
    return written
