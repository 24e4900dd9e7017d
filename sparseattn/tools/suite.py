"""The benchmark suite behind ``sparseattn bench``: grids of workloads x selectors x k x causal.

This module runs suites and makes their table and plots from the JSON; the command-line handler is in
:mod:`sparseattn.tools.cli`, result rendering of single comparisons in :mod:`sparseattn.tools.report`.

Each case (one workload, k and causal flag; every selector of the grid plus the dense baselines) runs in
its own subprocess so that its peak RSS is its own and a crash cannot take the sweep down; results are
appended to ``suite.json`` as they arrive (an interrupted sweep keeps what it measured).  Plots are made
from the JSON only (:func:`plot_suite`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# Shapes: d = 64 is the common LLM head size; norm-matched Gaussian keys follow a real MiniLM head's row
# norms (as peaky as real attention); clustered keys are the favourable case for every index.
_FAST = ["topk", "window", "window:width=48+sinks:g=4+random:n_random=12", "angular-lsh", "faiss-hnsw",
         "faiss-ivf", "cluster", "cluster:mode=block", "cluster:mode=block,split=2"]
_ALL = _FAST + ["lsh", "kdtree", "faiss-flat", "faiss-ivfpq"]
# At n = 262,144 the exact oracle (the harness computes the exact top-k for its quality figures anyway)
# and HNSW (slower than SDPA from n = 65,536 on: build + per-query graph walks) would take most of the
# sweep's hour; they are measured up to 65,536.
_LARGE = [s for s in _FAST if s not in ("topk", "faiss-hnsw")]

SUITES: dict[str, dict[str, Any]] = {
    "quick": {
        "repeats": 2,
        "cases": (
            [{"data": "window", "k": 64, "causal": False, "selectors": _FAST + ["faiss-flat", "kdtree"],
              "max_groups": 24},
             {"data": "store", "k": 64, "causal": False, "selectors": _FAST + ["faiss-flat"]}]
            + [{"data": f"synthetic:n={n},d=64,kind={kind},seed=0" + (",norm_profile=minilm" if kind == "gaussian" else ""),
                "k": 64, "causal": False, "selectors": _FAST}
               for n in (4096, 16384) for kind in ("gaussian", "clustered")]
            + [{"data": "store", "k": kk, "causal": False, "selectors": ["topk", "faiss-ivf", "cluster"], "tag": "k-sweep"}
               for kk in (16, 256)]
        ),
    },
    "full": {
        "repeats": 3,
        "cases": (
            [{"data": "window", "k": kk, "causal": c, "selectors": _ALL, "max_groups": 36}
             for kk in (16, 64, 256) for c in (False, True)]
            + [{"data": "store", "k": kk, "causal": False, "selectors": _ALL, "tag": "k-sweep"}
               for kk in (16, 64, 256, 1024)]
            + [{"data": f"synthetic:n={n},d=64,kind={kind},seed=0" + (",norm_profile=minilm" if kind == "gaussian" else ""),
                "k": 64, "causal": c, "repeats": 1 if n > 65536 else 3,
                "selectors": _ALL if n <= 16384 else (_FAST if n <= 65536 else _LARGE)}
               for n in (1024, 4096, 16384, 65536, 262144) for kind in ("gaussian", "clustered")
               for c in (False, True)]
        ),
    },
}


def run_case(case: dict[str, Any], repeats: int, threads: int | None) -> dict[str, Any]:
    """Run one case in this process (used by the subprocess entry point)."""
    from ..threads import get_num_threads
    from ..threads import threads as threads_ctx
    from . import bench

    with threads_ctx(get_num_threads() if threads is None else threads):
        res = bench.compare(case["data"], case["selectors"], k=case["k"], is_causal=case["causal"],
                            repeats=case.get("repeats", repeats), max_groups=case.get("max_groups"))
    res["tag"] = case.get("tag")
    return res


# The per-case subprocess imports sparseattn from the folder this copy was loaded from, whatever the
# working directory holds (a clone's ``sparseattn/`` folder in cwd would otherwise shadow it as a
# namespace package): the bootstrap puts this copy's parent folder first on sys.path and drops cwd.
_CASE_BOOTSTRAP = ("import os, sys; sys.path[:] = [{root!r}] + [p for p in sys.path if p and "
                   "os.path.abspath(p) != os.getcwd()]; from sparseattn.tools.suite import _main; sys.exit(_main())")


def case_command(case: dict[str, Any], repeats: int, threads: int | None = None) -> list[str]:
    """The command line that runs one suite case in a fresh interpreter (immune to the working directory)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above sparseattn/
    cmd = [sys.executable, "-c", _CASE_BOOTSTRAP.format(root=root), "--case", json.dumps(case),
           "--repeats", str(repeats)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return cmd


def _print_progress(total: int) -> Callable[[str], None]:
    state = {"i": 0}

    def say(msg: str) -> None:
        state["i"] += 1
        print(f"[{state['i']}/{total}] {msg}", file=sys.stderr, flush=True)

    return say


def failed_cases(json_path: str) -> list[dict[str, Any]]:
    """The cases of a suite JSON that failed (each with ``case`` and ``error``, the last stderr lines)."""
    with open(json_path) as f:
        return [c for c in json.load(f)["cases"] if "error" in c]


def run_suite(name: str, out_dir: str, *, threads: int | None = None, repeats: int | None = None,
              progress: Callable[[str], None] | None = None) -> str:
    """Run a named suite case by case in subprocesses; returns the JSON path.

    ``repeats``/``threads``: None for the suite's repeats / all cores, else an int >= 1.  ``progress`` is
    called with a one-line label before each case (default: ``[i/n] label`` on stderr).  Failed cases are
    kept in the JSON with their error (see :func:`failed_cases`); the table and plots are made from the
    cases that ran, and not at all when every case failed.
    """
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; available: {', '.join(SUITES)}.")
    for arg, val in (("repeats", repeats), ("threads", threads)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{arg} must be None or an int >= 1; got {val!r}.")
    suite = SUITES[name]
    reps = suite["repeats"] if repeats is None else repeats
    cases = suite["cases"]
    say = progress or _print_progress(len(cases))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"suite-{name}.json")
    results: list[dict[str, Any]] = []
    for case in cases:
        say(f"{case['data']} k={case['k']} causal={case['causal']}")
        t0 = time.perf_counter()
        proc = subprocess.run(case_command(case, reps, threads), capture_output=True, text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no message"]
            results.append({"case": case, "error": lines[-5:]})
            print(f"    failed: {lines[-1]}", file=sys.stderr, flush=True)
        else:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res["case"] = case
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
        with open(path, "w") as f:
            json.dump({"schema": "sparseattn.suite/1", "suite": name, "cases": results}, f, indent=1)
    if all("error" in r for r in results):
        return path  # nothing ran: no empty plots or table
    plot_suite(path, out_dir)
    ks = [c["k"] for c in cases]
    if ks:
        table_k = 64 if 64 in ks else max(set(ks), key=ks.count)  # the README's k, else the suite's usual one
        with open(os.path.join(out_dir, f"suite-{name}.md"), "w") as f:
            f.write(summary_table(path, k=table_k))
    return path


_TABLE_HEAD = ("| workload | n | causal | SDPA s | fastest with recall@{k} ≥ {r} | x SDPA | recall@{k} | mass | "
               "most mass while faster than SDPA | x SDPA | recall@{k} | mass |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def summary_table(json_path: str, *, k: int = 64, min_recall: float = 0.9) -> str:
    """Markdown table of a suite JSON: per workload at ``k``, the fastest selector whose mean recall@k is at
    least ``min_recall`` and the selector keeping the most softmax mass among those faster than torch SDPA
    end to end ("—": none qualifies, or SDPA was not measured).  Made from the JSON only."""
    from .report import selector_label

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int (the suite's k column); got {k!r}.")
    if not 0.0 <= float(min_recall) <= 1.0:
        raise ValueError(f"min_recall must be in [0, 1]; got {min_recall!r}.")
    with open(json_path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "cases" not in doc:
        raise ValueError(f"json_path={json_path!r} is not a suite JSON (no 'cases'); pass a suite-*.json file.")
    lines = [_TABLE_HEAD.format(k=k, r=min_recall)]
    for case in doc["cases"]:
        if "error" in case or case["k"] != k:
            continue
        rows = [r for r in case["results"] if "error" not in r]
        good = [r for r in rows if r["quality"]["recall_mean"] >= min_recall]
        fastest = min(good, key=lambda r: r["total_s"]) if good else None
        faster = [r for r in rows if (r.get("speedup_vs_sdpa") or 0) > 1]
        most_mass = max(faster, key=lambda r: r["quality"]["mass_recall_mean"]) if faster else None
        sdpa = case["dense"].get("sdpa_s")
        cells = [*_workload_label(case), "yes" if case["is_causal"] else "no", f"{sdpa:.3g}" if sdpa else "—"]
        for r in (fastest, most_mass):
            if r is None:
                cells += ["—"] * 4
                continue
            name = selector_label(r["selector"])
            speed = f"{r['speedup_vs_sdpa']:.3g}x" if r.get("speedup_vs_sdpa") else "—"
            cells += [f"`{name}`", speed, f"{r['quality']['recall_mean']:.3f}", f"{r['quality']['mass_recall_mean']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |\n")
    return "".join(lines)


def _workload_label(case: dict[str, Any]) -> tuple[str, str]:
    data = case["data"]
    if not data.startswith("synthetic:"):
        return f"real: {data.partition('@')[0]}", f"{case['workload']['S']:,}"
    params = dict(kv.split("=", 1) for kv in data[len("synthetic:"):].split(","))
    return params.get("kind", "gaussian"), f"{int(params['n']):,}"


def plot_suite(json_path: str, out_dir: str) -> list[str]:
    """time vs n (log-log, dense included), mass recall vs speed-up (Pareto), recall vs k; from JSON."""
    from .report import pareto_axes, pyplot, save_figure, selector_labels, selector_styles

    plt = pyplot()
    if plt is None:
        return []
    with open(json_path) as f:
        cases = [c for c in json.load(f)["cases"] if "results" in c]
    paths = []
    # one short label and one (colour, marker) per selector spec, the same in every plot
    specs = sorted({r["selector"] for c in cases for r in c["results"] if "total_s" in r})
    labels, styles = selector_labels(specs), selector_styles(specs)
    # 1. time vs n on synthetic data (non-causal), one line per selector + dense baselines.
    synth = [c for c in cases if c["data"].startswith("synthetic") and not c["is_causal"]]
    for kind in ("gaussian", "clustered"):
        sub = sorted((c for c in synth if f"kind={kind}" in c["data"]), key=lambda c: c["workload"]["S"])
        if len(sub) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 5))
        ns = [c["workload"]["S"] for c in sub]
        ax.plot(ns, [c["dense"]["dense_s"] for c in sub], "k-", lw=2, label="dense (ours)")
        if all(c["dense"].get("sdpa_s") for c in sub):
            ax.plot(ns, [c["dense"]["sdpa_s"] for c in sub], "k--", lw=2, label="torch SDPA")
        names = sorted({r["selector"] for c in sub for r in c["results"] if "total_s" in r})
        for name in names:
            pts = [(c["workload"]["S"], r["total_s"]) for c in sub for r in c["results"]
                   if r.get("selector") == name and "total_s" in r]
            if pts:
                color, marker = styles[name]
                ax.plot(*zip(*pts, strict=True), "-", marker=marker, color=color, ms=4, label=labels[name])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("n (keys = queries)")
        ax.set_ylabel("seconds, build + select + kernel (median)")
        ax.set_title(f"time vs n, synthetic {kind}, d=64, k=64")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3, which="both")
        paths.append(save_figure(fig, out_dir, f"time_vs_n_{kind}.png"))
    # 2. Pareto: mass recall vs speed-up, every case.
    fig, ax = plt.subplots(figsize=(7, 5))
    for name in specs:  # colour and marker by selector; every case of the suite is one point
        pts = [((r.get("speedup_vs_sdpa") or r.get("speedup_vs_dense")), r["quality"]["mass_recall_mean"])
               for c in cases for r in c["results"] if r.get("selector") == name and "total_s" in r]
        if pts:
            color, marker = styles[name]
            ax.scatter(*zip(*pts, strict=True), s=16, color=color, marker=marker, alpha=0.8, label=labels[name])
    pareto_axes(ax, "speed-up over exact attention, end to end", "softmax mass recall")
    ax.set_title("mass recall vs speed-up, all suite cases")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(save_figure(fig, out_dir, "pareto.png"))
    # 3. recall vs k on the store.
    ks = sorted((c for c in cases if c["data"] == "store" and not c["is_causal"]), key=lambda c: c["k"])
    if len({c["k"] for c in ks}) > 1:
        fig, ax = plt.subplots(figsize=(7, 5))
        names = sorted({r["selector"] for c in ks for r in c["results"] if "total_s" in r})
        for name in names:
            pts = [(c["k"], r["quality"]["recall_mean"], r["quality"]["mass_recall_mean"]) for c in ks
                   for r in c["results"] if r.get("selector") == name and "total_s" in r]
            if len(pts) > 1:
                x, rec, mass = zip(*pts, strict=True)
                color, marker = styles[name]
                ax.plot(x, rec, "-", marker=marker, color=color, ms=4, label=f"{labels[name]} recall@k")
                ax.plot(x, mass, ":", marker=marker, color=color, ms=4, mfc="none", label=f"{labels[name]} mass")
        ax.set_xscale("log")
        ax.set_xlabel("k")
        ax.set_ylabel("recall@k / softmax mass recall")
        ax.set_title("store (16,384 real keys): recall vs k")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3)
        paths.append(save_figure(fig, out_dir, "recall_vs_k.png"))
    return paths


def _main() -> int:
    """Subprocess entry point of :func:`run_suite`: run one case, print its result as one JSON line."""
    ap = argparse.ArgumentParser(description="run one suite case (internal; used by `sparseattn bench`)")
    ap.add_argument("--case", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    from .bench import json_default
    res = run_case(json.loads(a.case), a.repeats, a.threads)
    print(json.dumps(res, default=json_default))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
