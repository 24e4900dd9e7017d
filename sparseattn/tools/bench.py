"""The measurement harness: workloads, timed runs of selectors and dense baselines, quality recomputed.

Results are data first (plain dicts, JSON-serialisable); tables and plots are made from them in
:mod:`sparseattn.tools.report`.  Rules the harness follows:

* the JIT is warmed up before anything is timed; times are ``perf_counter`` medians over repeats;
* build, select and kernel are timed separately; dense baselines (ours, and torch SDPA when installed,
  called with 4-D tensors) run before any Numba kernel of the run, torch imported and warmed first;
* the SDPA baseline is timed where nothing of ours can slow it: in a fresh process that imports numpy and
  torch only, with the user's environment (:func:`fresh_sdpa_seconds`), and speed-ups are against that
  time.  The in-process SDPA time is kept beside it, and ``result["fairness"]`` (:func:`check_fairness`)
  flags a run whose in-process time differs from the fresh one by more than ``FAIRNESS_TOLERANCE``: a
  sign that our runtime changed torch's speed (with Numba's OpenMP layer loaded before torch, SDPA at
  16,384 keys ran 2-3x off its own speed, slower or faster depending on the machine's load);
* every quality figure is recomputed by :mod:`sparseattn.metrics` from the returned pattern, in float64,
  independently of the kernel (never a selector's own report);
* peak memory: numpy allocations tracked by ``tracemalloc`` in one extra, untimed run of the first group
  (never during the timed runs: it slows allocation-heavy selectors), plus the process RSS peak.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _numba_setup, metrics
from .. import data as data_mod
from ..attention.dense import scaled_dot_product_attention
from ..attention.sparse import sparse_attention
from ..pattern import SparsePattern
from ..selectors import get_selector, spec_string
from ..threads import get_num_threads
from . import sdpa_timing


@dataclass
class Workload:
    """Attention inputs for a benchmark: G independent (batch, head) groups.

    q (G, L, E), k (G, S, E), v (G, S, Ev), float32; ``scale`` the model's softmax scale.
    """

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    description: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> dict[str, int]:
        return {"groups": int(self.q.shape[0]), "L": int(self.q.shape[1]), "S": int(self.k.shape[1]),
                "E": int(self.q.shape[2]), "Ev": int(self.v.shape[2])}


def load_workload(spec: str, *, max_groups: int | None = None) -> Workload:
    """A workload from a spec.

    * ``"window"``: real MiniLM self-attention inside 512-token windows (shipped fixture), every
      (window, layer, head) a group; ``max_groups`` picks evenly spaced ones.
    * ``"store"``: real MiniLM queries against a 16,384-key store (shipped fixture), 4 heads.
    * ``"NAME@DIR"``: trace ``NAME`` of the data directory ``DIR`` (its ``manifest.json``), e.g. a
      larger store written by ``sparseattn trace store --n-keys 65536 --out DIR --name store65k``.
    * ``"synthetic:n=65536,d=64,kind=gaussian|clustered|correlated,..."``: one seeded group
      (see :func:`sparseattn.data.synthetic`).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"data must be 'window', 'store' or 'synthetic:n=...,d=...'; got {spec!r}.")
    if spec.startswith("synthetic"):
        q, k, v = data_mod.synthetic(spec)
        return Workload(spec, q[None], k[None], v[None], 1.0 / float(np.sqrt(q.shape[1])),
                        f"synthetic {spec.partition(':')[2]}", {"spec": spec})
    name, _, where = spec.partition("@")
    if where or spec in ("window", "store"):
        try:
            trace = data_mod.load(name, dtype=np.float32, data_dir=os.path.expanduser(where) if where else None)
        except FileNotFoundError as exc:
            raise ValueError(f"data {spec!r}: {exc}") from exc
        E = trace.q.shape[-1]
        q = trace.q.reshape(-1, trace.q.shape[-2], E)
        k = trace.k.reshape(-1, trace.k.shape[-2], E)
        v = trace.v.reshape(-1, trace.v.shape[-2], trace.v.shape[-1])
        if max_groups is not None and max_groups < q.shape[0]:
            pick = np.unique(np.linspace(0, q.shape[0] - 1, max_groups).round().astype(int))
            q, k, v = q[pick], k[pick], v[pick]
        if trace.meta.get("kind", name) == "window":
            desc = "MiniLM-L6 self-attention in 512-token KJV windows"
        else:
            desc = (f"MiniLM-L6 layer-{trace.meta.get('layer', 3)} queries vs a {k.shape[1]:,}-key KJV store"
                    + (f" ({name} from {where})" if where else ""))
        return Workload(spec, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                        trace.scale, desc, {"sha256": trace.meta.get("sha256")})
    raise ValueError(f"unknown data {spec!r}: use 'window', 'store', 'NAME@DIR' (a trace made by `sparseattn "
                     f"trace`) or 'synthetic:n=65536,d=64,kind=gaussian'.")


def iter_workloads(specs: Iterable[str]) -> Iterator[tuple[int, str, Workload]]:
    """``(index in specs, spec, workload)`` of each loadable spec (:func:`load_workload`); a spec that
    does not load (e.g. a trace directory missing on this machine) is skipped with one printed line
    saying why."""
    for i, spec in enumerate(specs):
        try:
            yield i, spec, load_workload(spec)
        except ValueError as exc:
            print(f"skip {spec}: {exc}", flush=True)


def decode_inputs(kind: str, n_total: int, hkv: int, rep: int, steps: int, e: int = 64
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic decode inputs with grouped-query heads, one :func:`sparseattn.data.synthetic` call per
    kv head (seed = the kv head's index; ``gaussian`` keys follow MiniLM's norm profile).

    Parameters
    ----------
    kind : str
        ``"gaussian"``, ``"clustered"`` or ``"correlated"``.
    n_total : int
        Keys per kv head.
    hkv, rep : int
        kv heads, and query heads per kv head.
    steps : int
        Queries per query head.
    e : int
        Head size.

    Returns
    -------
    K, V : numpy.ndarray
        float32, shape (hkv, n_total, e).
    Q : numpy.ndarray
        float32, shape (hkv * rep, steps, e); query head ``g * rep + r`` belongs to kv head ``g``.
    """
    K = np.empty((hkv, n_total, e), np.float32)
    V = np.empty((hkv, n_total, e), np.float32)
    Q = np.empty((hkv * rep, steps, e), np.float32)
    extra = ",norm_profile=minilm" if kind == "gaussian" else ""
    for g in range(hkv):
        q, k, v = data_mod.synthetic(f"synthetic:n={n_total},d={e},kind={kind},seed={g},"
                                     f"n_queries={steps * rep}{extra}")
        K[g], V[g] = k, v
        Q[g * rep:(g + 1) * rep] = q.reshape(rep, steps, e)
        del q, k, v
    return K, V, Q


def log(*parts: object) -> None:
    """Print ``HH:MM:SS part ...`` on stdout at once (progress lines of the benchmark scripts)."""
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def machine_info() -> dict[str, Any]:
    """CPU, threads and library versions, stored with every result."""
    import numba

    info: dict[str, Any] = {"platform": platform.platform(), "cpu": cpu_name(), "cores": os.cpu_count(),
                            "threads": get_num_threads(), "python": platform.python_version(),
                            "numpy": np.__version__, "numba": numba.__version__}
    for mod in ("faiss", "datasketch", "scipy", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages: record absence, never fail the run
            info[mod] = None
    return info


def cpu_name() -> str:
    """The CPU's model name and, in brackets, LLVM's name of its microarchitecture (the code Numba emits
    for it: a virtual machine's model name is often generic, e.g. "Intel(R) Xeon(R) Processor")."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import llvmlite.binding as llvm

        return f"{name} ({llvm.get_host_cpu_name()})"
    except Exception:  # noqa: BLE001 - the name is informative only
        return name


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def json_default(o: Any) -> Any:
    """``default=`` hook for :func:`json.dump` of results: numpy scalars and arrays as Python values."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def warm_up() -> None:
    """Compile the shared kernels the harness times: both fused variants, float32 and float64."""
    from ..kernels import fused
    from ..kernels.bias import no_bias_args

    for dt in (np.float32, np.float64):
        w = np.ones((1, 64, 8), dt)
        w.flags.writeable = False  # sparse_attention hands the kernel read-only q, k, v: the same variant
        p = SparsePattern.window(64, 64, 4)
        m = np.zeros(1, np.int64)
        for kern in (fused.fused_serial, fused.fused_parallel):
            kern(w, w, w, m, m, p.indptr, p.indices, True, dt(1.0), 4, 16, *no_bias_args(1), 1,
                 np.empty((1, 64, 8), dt), np.empty((1, 64), dt), dt == np.float32)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _torch() -> Any:
    """torch, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def prepare_torch() -> bool:
    """Import torch, set its thread count and run one tiny SDPA, before any Numba parallel region runs.

    Returns False when torch is not installed.  Why first: a library loaded before torch (Numba's OpenMP
    layer, when TBB is missing, brings the system ``libgomp.so.1``, which torch then uses instead of its
    own) changes torch's speed; imported and warmed first, torch keeps its own runtime.  :func:`compare` calls this before anything else; :func:`check_fairness` verifies it worked.
    """
    torch = _torch()
    if torch is None:
        return False
    torch.set_num_threads(get_num_threads())
    sdpa_timing.warm_up(torch)
    return True


def _sdpa_seconds(torch: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, is_causal: bool, scale: float,
                  repeats: int) -> float:
    """Median seconds of torch SDPA over (G, L, E) / (G, S, E) / (G, S, Ev) arrays, called 4-D (1, G, n, d)."""
    tq, tk, tv = (torch.from_numpy(x)[None] for x in (q, k, v))  # (1, G, n, d): never 2-D
    return _median(sdpa_timing.sdpa_times(torch, tq, tk, tv, is_causal=is_causal, scale=scale, repeats=repeats))


def time_dense(wl: Workload, *, is_causal: bool, repeats: int = 3) -> dict[str, float | None]:
    """Seconds for our blocked dense attention and torch SDPA over all groups (medians).

    ``sdpa_s`` is None when torch is not installed.  Call :func:`prepare_torch` before any Numba parallel
    region of the process (as :func:`compare` does) so the SDPA time is torch's own.
    """
    res: dict[str, float | None] = {}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scaled_dot_product_attention(wl.q, wl.k, wl.v, is_causal=is_causal, scale=wl.scale, check_finite=False)
        times.append(time.perf_counter() - t0)
    res["dense_s"] = _median(times)
    torch = _torch()
    if torch is None:
        res["sdpa_s"] = None
        return res
    torch.set_num_threads(get_num_threads())
    res["sdpa_s"] = _sdpa_seconds(torch, wl.q, wl.k, wl.v, is_causal=is_causal, scale=wl.scale, repeats=repeats)
    return res


FAIRNESS_TOLERANCE = 0.25  # in-run SDPA may differ from a fresh process's by at most this fraction

# The script fresh_sdpa_seconds runs in a fresh interpreter: the text of sdpa_timing, which imports numpy and
# torch only (never sparseattn or Numba) and times SDPA exactly as time_dense does.
FRESH_SDPA_SCRIPT = Path(sdpa_timing.__file__).read_text()


def fresh_sdpa_seconds(wl: Workload, *, is_causal: bool, repeats: int = 3, timeout: float | None = None) -> float:
    """Median seconds of torch SDPA on ``wl``'s inputs, timed in a fresh Python process without Numba.

    Same inputs (float32, 4-D), thread count (:func:`sparseattn.threads.get_num_threads`), warm-up and
    repeats as :func:`time_dense`; the environment is the user's (without what sparseattn set itself, such
    as ``OMP_WAIT_POLICY``), so the child times SDPA as the user's own torch code would run it.  Raises
    ``RuntimeError`` (with the child's last error line) when the child fails, e.g. torch is not installed
    for ``sys.executable``.
    """
    with tempfile.TemporaryDirectory(prefix="sparseattn-fair-") as tmp:
        path = os.path.join(tmp, "qkv.npz")
        np.savez(path, q=wl.q, k=wl.k, v=wl.v)
        cmd = [sys.executable, "-c", FRESH_SDPA_SCRIPT, path, "1" if is_causal else "0", repr(float(wl.scale)),
               str(int(repeats)), str(get_num_threads())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_numba_setup.user_environ())
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"fresh-process SDPA timing failed (exit {proc.returncode}): {last}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["sdpa_s"])


def fairness_flag(in_run_s: float | None, fresh_s: float | None,
                  tolerance: float = FAIRNESS_TOLERANCE) -> dict[str, Any]:
    """Compare the in-run SDPA time with a fresh process's: ``{"in_run_s", "fresh_s", "ratio", "ok", "tolerance"}``.

    ``ratio = in_run_s / fresh_s``; ``ok`` is True when ``|ratio - 1| <= tolerance`` (the baseline ran at
    torch's own speed, so speed-ups against it are not inflated), False otherwise, and None when either
    time is missing (nothing to compare).
    """
    if not 0 < tolerance:
        raise ValueError(f"tolerance must be > 0 (a fraction such as 0.25); got {tolerance!r}.")
    out: dict[str, Any] = {"in_run_s": in_run_s, "fresh_s": fresh_s, "ratio": None, "ok": None,
                           "tolerance": tolerance}
    if in_run_s is None or fresh_s is None or not fresh_s > 0:
        return out
    ratio = float(in_run_s) / float(fresh_s)
    out.update(ratio=ratio, ok=bool(abs(ratio - 1.0) <= tolerance))
    return out


def check_fairness(wl: Workload, dense: dict[str, float | None], *, is_causal: bool,
                   repeats: int = 3) -> dict[str, Any]:
    """The fairness record of a run: :func:`fairness_flag` of ``dense["sdpa_s"]`` against
    :func:`fresh_sdpa_seconds`, plus Numba's threading layer and TBB preload (:mod:`sparseattn._numba_setup`).

    ``ok`` is None, with ``reason``, when there is no SDPA time (torch not installed) or the fresh process
    failed; it is False when the two timings differ by more than the tolerance: something loaded in this
    process changes torch's speed, or the machine is busy (:func:`compare` measures speed-ups against the
    faster of the two, and :func:`fairness_advice` says what to do).
    ``threading_layer`` is Numba's layer at the time of the call (None before any parallel kernel ran).
    """
    status = _numba_setup.threading_status()
    extra = {"threading_layer": status["layer"], "tbb_preloaded": status["tbb_preloaded"],
             "tbb_preload": status["preload"]}
    in_run = dense.get("sdpa_s")
    if in_run is None:
        return {**fairness_flag(None, None), **extra, "reason": "torch is not installed: no SDPA baseline"}
    try:
        fresh = fresh_sdpa_seconds(wl, is_causal=is_causal, repeats=repeats)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
        return {**fairness_flag(in_run, None), **extra, "reason": str(exc)}
    flag = fairness_flag(in_run, fresh)
    reason = (f"in-process SDPA {in_run:.3g} s vs {fresh:.3g} s in a fresh process: {flag['ratio']:.2f}x, "
              f"tolerance {flag['tolerance']:.0%}; Numba threading layer {extra['threading_layer']}")
    if not flag["ok"]:
        reason += ("; something in this process changes torch's speed, or the machine is busy (speed-ups use "
                   "the faster time)")
    return {**flag, **extra, "reason": reason}


def fairness_advice(fair: dict[str, Any] | None, what: str = "SDPA") -> str | None:
    """What to do when the two SDPA timings of a run disagree (``fair["ok"] is False``), else None.

    Parameters
    ----------
    fair : dict or None
        A fairness record (:func:`check_fairness`, or the ``fairness`` of a decode result) with ``ratio``
        (in-process time / fresh-process time) and ``ok``.
    what : str
        The baseline's name in the message.

    Returns
    -------
    str or None
        One line: which timing was slower, that the faster one is the baseline, the load average against
        the core count, and how to get a steadier baseline.
    """
    if not fair or fair.get("ok") is not False or not fair.get("ratio"):
        return None
    ratio = float(fair["ratio"])
    slower = "this process" if ratio > 1 else "the fresh process"
    try:
        load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count() or 1} cores"
    except OSError:  # pragma: no cover - no load average on this platform
        load = f"{os.cpu_count() or 1} cores"
    return (f"advice: the two {what} timings differ {max(ratio, 1 / ratio):.1f}x ({slower} was slower; {load}); "
            f"x {what} uses the faster. For a steadier baseline rerun on an idle machine, or with --threads 1.")


def _quality_rows(L: int, max_rows: int) -> np.ndarray | None:
    if L <= max_rows:
        return None
    return np.unique(np.linspace(0, L - 1, max_rows).round().astype(np.int64))


def run_selector(wl: Workload, spec: str, *, k: int, is_causal: bool, repeats: int = 3,
                 max_quality_rows: int = 2048, max_quality_groups: int = 16) -> dict[str, Any]:
    """Time one selector on every group of a workload and measure its quality.

    Returns a dict: selector, params, build/select/kernel/total seconds (sums over groups, medians over
    repeats), nnz per query, quality (means over groups of :class:`metrics.AccuracyReport` summaries,
    computed on up to ``max_quality_rows`` evenly spaced rows of up to ``max_quality_groups`` groups),
    peak memory.
    """
    template = get_selector(spec)
    spec_str = spec_string(template)
    attends = template.attends  # declared capability: the selector computes attention itself
    G, L = wl.q.shape[0], wl.q.shape[1]
    per_rep: list[dict[str, float]] = []
    selectors: list[Any] = []
    patterns: list[SparsePattern | None] = []
    outputs: list[np.ndarray] = []

    def one(g: int) -> tuple[Any, SparsePattern | None, np.ndarray, tuple[float, float, float]]:
        sel = get_selector(spec_str)
        t0 = time.perf_counter()
        sel.build(wl.k[g], check_finite=False)
        t1 = time.perf_counter()
        if attends:  # the selector attends itself (exact attention over routed blocks): no pattern
            out, _ = sel.attend(wl.q[g], wl.v[g], scale=wl.scale, is_causal=is_causal, check_finite=False)
            t2 = t3 = time.perf_counter()
            pat = None
        else:
            pat = sel.query(wl.q[g], k, is_causal=is_causal, check_finite=False)
            t2 = time.perf_counter()
            out = sparse_attention(wl.q[g], wl.k[g], wl.v[g], pat, scale=wl.scale, check_finite=False)
            t3 = time.perf_counter()
        return sel, pat, out, (t1 - t0, t2 - t1, t3 - t2)

    one(0)  # untimed warm-up: compiles this selector's own kernels (JIT time is not measured)
    for rep in range(repeats):
        tot = {"build": 0.0, "select": 0.0, "kernel": 0.0}
        for g in range(G):
            sel, pat, out, (tb, ts, tk) = one(g)
            tot["build"] += tb
            tot["select"] += ts
            tot["kernel"] += tk
            if rep == 0:
                selectors.append(sel)
                patterns.append(pat)
                outputs.append(out)
        per_rep.append(tot)
    # Peak traced memory from one extra, untimed run of group 0: tracemalloc hooks every allocation
    # and would slow allocation-heavy selectors down if left on during the timed runs.
    tracemalloc.start()
    try:
        one(0)
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    timing = {f"{key}_s": _median([r[key] for r in per_rep]) for key in ("build", "select", "kernel")}
    timing["total_s"] = _median([sum(r.values()) for r in per_rep])
    # Quality: recomputed in float64 by metrics from the selected keys of sampled rows (never a
    # selector's own report); output error is that of the actual output (kernel or attend).
    rows = _quality_rows(L, max_quality_rows)
    rows = np.arange(L) if rows is None else rows
    qual_groups = np.unique(np.linspace(0, G - 1, min(G, max_quality_groups)).round().astype(int))
    summaries = []
    selected = []
    for g in qual_groups:
        if patterns[g] is not None:
            pat_rows = patterns[g].select_rows(rows)
        else:  # block mode: the routed keys of the sampled rows, exactly what attend used
            pat_rows = selectors[g].query(wl.q[g][rows], k, is_causal=is_causal, query_positions=rows,
                                          check_finite=False)
        selected.append(pat_rows.nnz / max(len(rows), 1))
        rep = metrics.compare(wl.q[g][rows], wl.k[g], wl.v[g], pat_rows, scale=wl.scale, is_causal=is_causal,
                              query_positions=rows, k=k, sparse_output=outputs[g][rows])
        summaries.append(rep.summary())
    quality = {key: float(np.mean([s[key] for s in summaries])) for key in summaries[0]}
    empty = [int((p.nnz_per_row == 0).sum()) for p in patterns if p is not None]
    return {
        "selector": spec_str, "name": template.name, "params": template.params,
        "metric": template.metric, "guarantee": template.guarantee,
        **timing,
        "keys_per_query": float(np.mean(selected)),
        "empty_rows": int(sum(empty)) if empty else int(quality.get("empty_rows", 0)),
        "quality": quality,
        "quality_rows": int(len(rows)),
        "quality_groups": len(qual_groups),
        "traced_peak_mb": traced_peak / 2**20,
        "rss_peak_mb": _rss_peak_mb(),
    }


#: The selectors ``sparseattn compare`` measures by default: the exact top-k oracle, a structural union,
#: two FAISS indexes, cluster routing (top-k and block mode), the estimation zone (unread clusters
#: estimated from their statistics) and routing by estimated mass (``top_p``).  Others: ``--selectors``.
DEFAULT_SELECTORS = ("topk", "window:width=48+sinks:g=4+random:n_random=12", "faiss-hnsw", "faiss-ivf", "cluster",
                     "cluster:mode=block", "cluster:mode=block,estimate=-1", "cluster:mode=block,top_p=0.9")
#: The data ``sparseattn compare`` runs on by default: the shipped store (4 heads x 2,048 real MiniLM
#: queries against 16,384 real keys), long enough that reading fewer keys pays.
DEFAULT_DATA = "store"
#: Query rows per group whose quality (recall, mass, output error) is computed in float64 by default.
DEFAULT_QUALITY_ROWS = 512


def compare(data: str = DEFAULT_DATA, selectors: Sequence[str] | None = None, *, k: int = 64,
            is_causal: bool = False, repeats: int = 3, max_groups: int | None = None,
            progress: Callable[[str], None] | None = None, fairness: bool = True,
            quality_rows: int = DEFAULT_QUALITY_ROWS) -> dict[str, Any]:
    """Run every selector and the dense baselines on one workload; return the results as a dict.

    The dense baselines are timed first, after :func:`prepare_torch` and before any Numba kernel of the
    run.  ``result["fairness"]`` is :func:`check_fairness`: SDPA timed again in a fresh process.  The
    faster of the two times becomes ``result["dense"]["sdpa_s"]``, the baseline of every
    ``speedup_vs_sdpa`` (``fairness["baseline"]`` says which: ``"fresh_s"`` or ``"in_run_s"``); the
    in-process time is ``result["dense"]["sdpa_in_run_s"]``.  With ``fairness=False`` (or when the fresh
    process fails) nothing is re-timed, ``sdpa_s`` is the in-process time and ``fairness["ok"]`` is None.
    Quality is computed in float64 on ``quality_rows`` evenly spaced query rows of each group (all rows
    when a group has fewer).  Defaults: :data:`DEFAULT_DATA`, :func:`default_selectors`.
    """
    wl = load_workload(data, max_groups=max_groups)
    selectors = list(selectors) if selectors else default_selectors(wl)
    say = progress or (lambda msg: None)
    say("dense baselines")
    prepare_torch()
    dense = time_dense(wl, is_causal=is_causal, repeats=repeats)
    dense["sdpa_in_run_s"] = dense["sdpa_s"]
    warm_up()  # our first parallel kernels: after the in-process baselines, before the fresh check
    if fairness:
        fair = check_fairness(wl, dense, is_causal=is_causal, repeats=repeats)
    else:
        fair = {**fairness_flag(dense["sdpa_s"], None), "reason": "not checked (fairness=False)"}
    # The baseline is the faster of the two timings: a speed-up is never measured against a slowed torch,
    # whether our process slowed it (a fresh process has nothing of ours) or a busy machine slowed the fresh
    # process (its torch runs with the user's OpenMP settings, whose spinning threads suffer most from load).
    use_fresh = fair["fresh_s"] is not None and (dense["sdpa_s"] is None or fair["fresh_s"] <= dense["sdpa_s"])
    if use_fresh:
        dense["sdpa_s"] = fair["fresh_s"]
    fair["baseline"] = "fresh_s" if use_fresh else "in_run_s"
    rows = []
    for spec in selectors:
        say(spec)
        try:
            row = run_selector(wl, spec, k=k, is_causal=is_causal, repeats=repeats, max_quality_rows=quality_rows)
        except (ImportError, ValueError) as exc:
            row = {"selector": spec, "error": str(exc)}
        if "total_s" in row:
            row["speedup_vs_dense"] = dense["dense_s"] / row["total_s"] if row["total_s"] else None
            row["speedup_vs_sdpa"] = (dense["sdpa_s"] / row["total_s"]) if dense.get("sdpa_s") else None
        rows.append(row)
    return {"schema": "sparseattn.compare/1", "data": data, "workload": {"description": wl.description,
            **wl.shape, **wl.meta}, "k": k, "is_causal": is_causal, "repeats": repeats,
            "machine": machine_info(), "dense": dense, "fairness": fair, "results": rows,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def default_selectors(wl: Workload | None = None) -> list[str]:
    """:data:`DEFAULT_SELECTORS` whose backends are installed here (FAISS is optional on some platforms)."""
    from ..selectors import available_selectors

    avail = {name for name, reason in available_selectors().items() if reason is None}
    out = []
    for spec in DEFAULT_SELECTORS:
        names = [part.partition(":")[0] for part in spec.split("+")]
        if all(n in avail for n in names):
            out.append(spec)
    return out
