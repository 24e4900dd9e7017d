"""The measurement harness: workloads, timed runs of selectors and dense baselines, quality recomputed.

Results are data first (plain dicts, JSON-serialisable); tables and plots are made from them in
:mod:`sparseattn.report`.  Rules the harness follows:

* the JIT is warmed up before anything is timed; times are ``perf_counter`` medians over repeats;
* build, select and kernel are timed separately; dense baselines (ours, and torch SDPA when installed,
  called with 4-D tensors) run in the same process, so ratios are side by side;
* every quality figure is recomputed by :mod:`sparseattn.metrics` from the returned pattern, in float64,
  independently of the kernel (never a selector's own report);
* peak memory: numpy allocations tracked by ``tracemalloc`` in one extra, untimed run of the first group
  (never during the timed runs: it slows allocation-heavy selectors), plus the process RSS peak.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import data as data_mod
from . import metrics
from .attention.dense import scaled_dot_product_attention
from .attention.sparse import sparse_attention
from .pattern import SparsePattern
from .selectors import get_selector, spec_string
from .threads import get_num_threads


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
            trace = data_mod.load(name, dtype=np.float32, data_dir=where or None)
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


def machine_info() -> dict[str, Any]:
    """CPU, threads and library versions, stored with every result."""
    import numba

    info: dict[str, Any] = {"platform": platform.platform(), "cpu": _cpu_name(), "cores": os.cpu_count(),
                            "threads": get_num_threads(), "python": platform.python_version(),
                            "numpy": np.__version__, "numba": numba.__version__}
    for mod in ("faiss", "datasketch", "scipy", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages: record absence, never fail the run
            info[mod] = None
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    from .kernels import fused
    from .kernels.bias import no_bias_args

    for dt in (np.float32, np.float64):
        w = np.ones((1, 64, 8), dt)
        p = SparsePattern.window(64, 64, 4)
        m = np.zeros(1, np.int64)
        for kern in (fused.fused_serial, fused.fused_parallel):
            kern(w, w, w, m, m, p.indptr, p.indices, True, dt(1.0), 4, 16, *no_bias_args(1), 1,
                 np.empty((1, 64, 8), dt), np.empty((1, 64), dt), dt == np.float32)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def time_dense(wl: Workload, *, is_causal: bool, repeats: int = 3) -> dict[str, float | None]:
    """Seconds for our blocked dense attention and torch SDPA over all groups (medians)."""
    res: dict[str, float | None] = {}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scaled_dot_product_attention(wl.q, wl.k, wl.v, is_causal=is_causal, scale=wl.scale, check_finite=False)
        times.append(time.perf_counter() - t0)
    res["dense_s"] = _median(times)
    try:
        import torch
    except ImportError:
        res["sdpa_s"] = None
        return res
    torch.set_num_threads(get_num_threads())
    tq, tk, tv = (torch.from_numpy(x)[None] for x in (wl.q, wl.k, wl.v))  # (1, G, n, d): never 2-D
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=is_causal, scale=wl.scale)
            times.append(time.perf_counter() - t0)
    res["sdpa_s"] = _median(times)
    return res


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


def compare(data: str = "window", selectors: Sequence[str] | None = None, *, k: int = 64,
            is_causal: bool = False, repeats: int = 3, max_groups: int | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every selector and the dense baselines on one workload; return the results as a dict."""
    wl = load_workload(data, max_groups=max_groups)
    selectors = list(selectors) if selectors else default_selectors(wl)
    say = progress or (lambda msg: None)
    warm_up()
    say("dense baselines")
    dense = time_dense(wl, is_causal=is_causal, repeats=repeats)
    rows = []
    for spec in selectors:
        say(spec)
        try:
            row = run_selector(wl, spec, k=k, is_causal=is_causal, repeats=repeats)
        except (ImportError, ValueError) as exc:
            row = {"selector": spec, "error": str(exc)}
        if "total_s" in row:
            row["speedup_vs_dense"] = dense["dense_s"] / row["total_s"] if row["total_s"] else None
            row["speedup_vs_sdpa"] = (dense["sdpa_s"] / row["total_s"]) if dense.get("sdpa_s") else None
        rows.append(row)
    return {"schema": "sparseattn.compare/1", "data": data, "workload": {"description": wl.description,
            **wl.shape, **wl.meta}, "k": k, "is_causal": is_causal, "repeats": repeats,
            "machine": machine_info(), "dense": dense, "results": rows,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def default_selectors(wl: Workload | None = None) -> list[str]:
    """A representative set: the exact oracle, structural, hashing, tree, FAISS and cluster routing."""
    from .selectors import available_selectors

    avail = {name for name, reason in available_selectors().items() if reason is None}
    wanted = ["topk", "window", "window:width=48+sinks:g=4+random:n_random=12", "angular-lsh", "lsh:n_candidates=256",
              "kdtree", "faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-ivfpq", "cluster", "cluster:mode=block"]
    out = []
    for spec in wanted:
        names = [part.partition(":")[0] for part in spec.split("+")]
        if all(n in avail for n in names):
            out.append(spec)
    return out
