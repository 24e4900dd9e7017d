"""Where cluster block mode spends its time: a per-stage profile next to SDPA, accuracy and the GEMM floor.

Run:  python benchmarks/bench_block_profile.py [--sizes 16384,65536,262144] [--repeats 3] [--out PATH]

For each size (synthetic clustered keys, d = 64, L = S queries) and causal / not, one
:func:`sparseattn.tools.bench.compare` run of ``cluster:mode=block`` (causal: also
``cluster:mode=block,strict_causal=False``, the global index masked to the visible keys, in the same run,
and the speed of the strict one relative to it) gives the end-to-end time (median over
``--repeats``), torch SDPA in the same run (the faster of in-process and a fresh process) and the accuracy
recomputed in float64 (recall@64, softmax mass, output error); then one extra run under ``cProfile`` splits
the time into stages by the functions that do them:

* ``build`` (the cluster index, or the strictly causal one with its bands), of which ``kmeans`` (the
  centroids' training) and ``assign`` (every key to a centroid) as seen on the calling thread;
* ``route`` (every query's clusters), ``gather`` (pairs grouped by cluster, queries gathered),
  ``kernels`` (the per-cluster GEMM + exp + GEMM workers, wall time), ``merge`` (log-sum-exp of each
  query's partials, and of the segments' results), ``exact`` (rows or exact tails read exactly),
  ``other`` (the rest: validation, cover, refinement, Python).

The stage seconds are the profiled run's (cProfile adds a little to the Python parts); ``share`` is of
that run's total.  ``gemm_floor_s`` is the two products of the keys read (``4 L k E`` flops for k keys
per query) at this machine's float32 GEMM peak, measured in the run (2048^3 on every core): no routed
kernel can go below it.  Results: ``results/block-profile.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import numpy as np

from sparseattn.threads import get_num_threads
from sparseattn.tools import bench
from sparseattn.tools.args import OneLineParser, positive_int

SPEC = "cluster:mode=block"
LOOSE = "cluster:mode=block,strict_causal=False"  # causal rows: also the not strictly causal global index
# stage -> (file suffix, function names) whose cumulative time is the stage
STAGES = {
    "build": (("index/cluster.py", "build"), ("index/causal.py", "build")),
    "kmeans": (("index/kmeans.py", "train_kmeans"),),
    "assign": (("index/kmeans.py", "assign_keys"),),
    "route": (("index/cluster.py", "route_rows"),),
    "gather": (("kernels/cluster.py", "gather_pairs"), ("kernels/cluster.py", "group_pairs")),
    "kernels": (("threads.py", "run_jobs"),),
    "merge": (("kernels/merge.py", "merge_partials"), ("kernels/merge.py", "_merge_partials"),
              ("attention/merge.py", "merge_pair")),
    "exact": (("attention/routed.py", "_attend_prefix"),),
}
TOP = ("build", "route", "gather", "kernels", "merge", "exact")  # disjoint: "other" is the rest


def gemm_peak() -> float:
    """float32 GEMM flops per second on every core (median of 5 products 2048^3)."""
    a = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)
    a @ a
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        ts.append(time.perf_counter() - t0)
    return 2 * 2048**3 / float(np.median(ts))


def stage_seconds(prof: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds per stage from a profile.  ``build`` is the index build (the global or the
    strictly causal one); ``kernels`` only the workers of the attention blocks (``run_jobs`` called by
    ``_attend_block``); ``kmeans`` and ``assign`` are parts of ``build``."""
    st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out = dict.fromkeys(STAGES, 0.0)

    def in_stage(path: str, name: str, fns: tuple) -> bool:
        path = path.replace(os.sep, "/")
        return any(name == fn and path.endswith(suffix) for suffix, fn in fns)

    for (path, _, name), (_, _, _, ct, callers) in st.items():
        for stage, fns in STAGES.items():
            if not in_stage(path, name, fns):
                continue
            if stage == "kernels":
                ct = sum(c[3] for (_, _, cn), c in callers.items() if cn == "_attend_block")
            elif any(in_stage(cp, cn, fns) for cp, _, cn in callers):
                # called from within the same stage (the causal index's bands): count the outer call only
                ct = sum(c[3] for (cp, _, cn), c in callers.items() if not in_stage(cp, cn, fns))
            out[stage] += ct
    return out


def profile_case(data: str, causal: bool, spec: str = SPEC) -> dict[str, float]:
    """Stage seconds of one profiled ``sparse_attention(q, k, v, spec)`` call (after a warm-up call)."""
    import sparseattn as sa

    wl = bench.load_workload(data)
    q, k, v = wl.q[0], wl.k[0], wl.v[0]
    sa.sparse_attention(q, k, v, spec, is_causal=causal, scale=wl.scale)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    sa.sparse_attention(q, k, v, spec, is_causal=causal, scale=wl.scale)
    prof.disable()
    total = time.perf_counter() - t0
    stages = stage_seconds(prof)
    stages["other"] = max(total - sum(stages[n] for n in TOP), 0.0)
    stages["total"] = total
    return stages


def write_md(result: dict, path: str) -> None:
    names = ["build", "kmeans", "assign", "route", "gather", "kernels", "merge", "exact", "other"]
    lines = [f"Command: `{result['command']}` ({result['created']}; load average {result['load']}; "
             f"GEMM peak {result['gemm_gflops']:.0f} GFLOP/s float32 on {result['threads']} threads).", "",
             "| keys | causal | index | SDPA s | block s | x SDPA | recall@64 | mass | out err | keys/q | GEMM floor s "
             "(x SDPA) | " + " | ".join(names) + " |",
             "|" + "---|" * (11 + len(names))]
    # kmeans and assign are parts of build: shares of the total like the others
    for r in result["rows"]:
        st = r["stages"]
        tot = st["total"]
        shares = " | ".join(f"{st[n] * 1e3:.0f} ms ({st[n] / tot:.0%})" for n in names)
        index = "strict" if r["causal"] and r["spec"] == SPEC else ("global" if r["causal"] else "")
        lines.append(f"| {r['n']:,} | {r['causal']} | {index} | {r['sdpa_s']:.3f} | {r['total_s']:.3f} | {r['x_sdpa']:.1f} | "
                     f"{r['recall']:.3f} | {r['mass']:.3f} | {r['out_err']:.3f} | {r['keys_per_query']:.0f} | "
                     f"{r['gemm_floor_s']:.3f} ({r['floor_x_sdpa']:.0f}) | {shares} |")
    for r in result["rows"]:
        if r["causal"] and r["spec"] == LOOSE:
            strict = next(x for x in result["rows"] if x["n"] == r["n"] and x["causal"] and x["spec"] == SPEC)
            lines += ["", f"{r['n']:,} keys, causal: the strictly causal index (`{SPEC}`) runs at "
                      f"{r['total_s'] / strict['total_s']:.2f}x the speed of the global index masked to the "
                      f"visible keys (`{LOOSE}`), recall@64 {strict['recall']:.3f} against {r['recall']:.3f}."]
    lines += ["", "Stage times are from one extra cProfile'd call (its total: "
              + ", ".join(f"{r['n']:,}{' causal' if r['causal'] else ''} {r['stages']['total']:.3f} s"
                          for r in result["rows"]) + ")."]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16384,65536,262144")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "block-profile"))
    args = ap.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers; got {args.sizes!r}")
    if any(s < 1024 for s in sizes):
        ap.error("--sizes must be >= 1024 each")
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    load = os.getloadavg()[0]
    peak = gemm_peak()
    rows = []
    for n in sizes:
        data = f"synthetic:n={n},d=64,kind=clustered,seed=0"
        for c in causal:
            specs = [SPEC, LOOSE] if c else [SPEC]
            res = bench.compare(data, specs, is_causal=c, repeats=args.repeats, progress=bench.log)
            sdpa = res["dense"]["sdpa_s"]
            for spec, row in zip(specs, res["results"], strict=True):
                q = row["quality"]
                kq = row["keys_per_query"]
                floor = 4 * n * kq * 64 / peak
                rows.append({"n": n, "causal": c, "spec": spec, "sdpa_s": sdpa, "total_s": row["total_s"],
                             "x_sdpa": sdpa / row["total_s"], "recall": q["recall_mean"],
                             "mass": q["mass_recall_mean"], "out_err": q["rel_error_overall"],
                             "keys_per_query": kq, "gemm_floor_s": floor, "floor_x_sdpa": sdpa / floor,
                             "stages": profile_case(data, c, spec), "fairness": res["fairness"]})
                bench.log(f"{n} causal={c} {spec}: {row['total_s']:.3f} s, {sdpa / row['total_s']:.1f}x SDPA")
    default_out = os.path.join(os.path.dirname(__file__), "results", "block-profile")
    result = {"command": "python benchmarks/bench_block_profile.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k != "out" or os.path.abspath(v) != os.path.abspath(default_out)),
              "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": round(load, 2),
              "gemm_gflops": peak / 1e9, "threads": get_num_threads(), "machine": bench.machine_info(),
              "rows": rows}
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=bench.json_default)
    write_md(result, args.out + ".md")
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
