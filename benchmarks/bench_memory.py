"""Peak memory of each selector end to end (build + query + sparse attention kernel) at n = 262,144.

Run:  python benchmarks/bench_memory.py [--n 262144] [--d 64] [--k 64] [--threads 1] [--only window cluster]

Shapes: n = 262,144 keys and queries, d = 64 (the head size of most current LLMs), k = 64 keys per query:
the size of the memory goal "every non-dense selector stays under 2 GiB".  A dense score
matrix at this size would be 256 GiB (float32); one 512-row block of full scores is 512 MiB.  Keys are
``sparseattn.data.synthetic("synthetic:n=262144,d=64,kind=clustered,seed=0")`` (q, k, v: 64 MiB each).

Method: every selector runs in its own subprocess, so one selector's peak (or its allocator's retained
pages) never shows up in another's.  The child

1. imports sparseattn and warms up the JIT with the same selector on 4,096 keys (compilation memory is a
   one-off, not a function of n, and is excluded);
2. generates the data, then records its baseline: ``ru_maxrss`` and the current
   RSS; it also resets the kernel's RSS high-water mark (``/proc/self/clear_refs``, Linux) so the
   high-water after the run is the peak *of the run*;
3. with ``tracemalloc`` on, builds the selector on all n keys, queries it and runs
   ``sparse_attention`` over the pattern (``cluster:mode=block``: ``attend``, exact attention over the
   routed clusters without a pattern), timing each step with ``perf_counter``.

Reported per selector: seconds (build + query + kernel); *peak RSS*: the child's absolute
``ru_maxrss`` (interpreter, libraries, data and the run: what the 2 GiB goal is checked against);
*delta RSS*: ``ru_maxrss`` minus the baseline after data generation, and the high-water delta
after the reset (more precise when data generation itself peaked higher); *tracemalloc*: the peak of
allocations made through Python's and numpy's allocators - numpy arrays created from Python.  FAISS's C++
allocations and arrays allocated inside Numba kernels (NRT) are not traced; RSS counts everything.

Subsets (the exact and tree searches cost O(n) per query; all n queries would take hours on 2 shared
cores): ``topk`` and ``faiss-flat`` run 8,192 queries, ``kdtree`` 1,024 (about 20 ms per query at this
size).  Their build covers all n keys; query memory then scales with the subset (the (L, k) outputs) and
with the per-block scores, which do not depend on L.  Every other selector runs all 262,144 queries.

Results go to benchmarks/results/memory.json; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GOAL_MIB = 2048.0

# (spec, queries or None for all): see the module docstring for the subsets.
CASES: list[tuple[str, int | None]] = [
    ("window", None),
    ("topk", 8192),
    ("angular-lsh", None),
    ("kdtree", 1024),
    ("faiss-flat", 8192),
    ("faiss-hnsw", None),
    ("faiss-ivf", None),
    ("faiss-ivfpq", None),
    ("cluster", None),
    ("cluster:mode=block", None),
]


# ------------------------------------------------------------------------------------------- child
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss_kib() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def _run_selector(spec, q, k, v, kk, sa):
    """build + query + kernel; returns (output, pattern or None, seconds per step)."""
    from sparseattn.selectors import get_selector

    t0 = time.perf_counter()
    sel = get_selector(spec).build(k, check_finite=False)
    t1 = time.perf_counter()
    if sel.attends:  # the selector computes attention itself: no pattern
        out, _ = sel.attend(q, v, check_finite=False)
        t2 = t3 = time.perf_counter()
        pattern = None
    else:
        pattern = sel.query(q, kk, check_finite=False)
        t2 = time.perf_counter()
        out = sa.sparse_attention(q, k, v, pattern, check_finite=False)
        t3 = time.perf_counter()
    return out, pattern, {"build_s": t1 - t0, "query_s": t2 - t1, "kernel_s": t3 - t2}


def child(case: dict) -> dict:
    import gc
    import tracemalloc

    import numpy as np

    import sparseattn as sa

    spec, d, kk, threads = case["spec"], case["d"], case["k"], case["threads"]
    res: dict = {"selector": spec}
    with sa.threads(threads):
        # 1. JIT warm-up on small data with the same selector (compilation is not a function of n).
        qw, kw, vw = sa.data.synthetic(f"synthetic:n=4096,d={d},kind=clustered,seed=1")
        _run_selector(spec, qw[:1024], kw, vw, kk, sa)
        del qw, kw, vw
        # 2. data and baseline
        q, k, v = sa.data.synthetic(case["data"])
        nq = q.shape[0] if case["queries"] is None else min(case["queries"], q.shape[0])
        q_run = np.ascontiguousarray(q[:nq])
        gc.collect()
        res["baseline_ru_maxrss_mib"] = _ru_maxrss_kib() / 1024
        rss_at_reset = _status_kib("VmRSS")
        reset_ok = _reset_hwm()
        res["baseline_rss_mib"] = rss_at_reset / 1024 if rss_at_reset is not None else None
        res["data_mib"] = (q.nbytes + k.nbytes + v.nbytes) / 2**20
        # 3. the measured run
        tracemalloc.start()
        try:
            out, pattern, times = _run_selector(spec, q_run, k, v, kk, sa)
            _, traced_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        peak_kib = _ru_maxrss_kib()
        hwm = _status_kib("VmHWM")
    res.update(times)
    res["total_s"] = sum(times.values())
    res["queries"] = int(nq)
    res["keys_per_query"] = float(pattern.nnz / max(nq, 1)) if pattern is not None else None
    res["output_ok"] = bool(np.isfinite(out).all())
    res["peak_rss_mib"] = peak_kib / 1024
    res["rss_delta_mib"] = (peak_kib / 1024) - res["baseline_ru_maxrss_mib"]
    res["hwm_delta_mib"] = ((hwm - rss_at_reset) / 1024 if (reset_ok and hwm is not None
                                                              and rss_at_reset is not None) else None)
    res["rss_after_mib"] = (_status_kib("VmRSS") or 0) / 1024
    res["traced_peak_mib"] = traced_peak / 2**20
    res["under_2gib"] = res["peak_rss_mib"] < GOAL_MIB
    return res


# ------------------------------------------------------------------------------------------ driver
def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ("selector", "queries", "seconds", "peak RSS MiB", "delta RSS MiB", "HWM delta MiB",
            "tracemalloc MiB", "< 2 GiB")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["selector"], "-", "-", "-", "-", "-", "-", "error: " + r["error"][-60:]))
            continue
        lines.append((r["selector"], str(r["queries"]), _fmt(r["total_s"]), _fmt(r["peak_rss_mib"], ".0f"),
                      _fmt(r["rss_delta_mib"], ".0f"), _fmt(r["hwm_delta_mib"], ".0f"),
                      _fmt(r["traced_peak_mib"], ".0f"), "yes" if r["under_2gib"] else "NO"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = []
    for j, row in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> None:
    from sparseattn.tools.args import OneLineParser, choice_arg, float_arg, positive_int

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive_int, default=262144)
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--k", type=positive_int, default=64, help="keys per query (<= --n)")
    ap.add_argument("--threads", type=positive_int, default=1, help="Numba/FAISS/BLAS threads in each child")
    ap.add_argument("--only", nargs="+", type=choice_arg([spec for spec, _ in CASES]), default=None,
                    help="run only these selector specs (of the cases listed above)")
    ap.add_argument("--timeout", type=float_arg(0.0, strict=True), default=1800.0,
                    help="seconds per selector subprocess")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.k > args.n:
        ap.error(f"--k {args.k} exceeds --n {args.n}; use --k <= --n")
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return

    from sparseattn.tools.bench import machine_info

    data = f"synthetic:n={args.n},d={args.d},kind=clustered,seed=0"
    cases = [c for c in CASES if args.only is None or c[0] in args.only]
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows = []
    t_all = time.perf_counter()
    for spec, queries in cases:
        case = {"spec": spec, "data": data, "n": args.n, "d": args.d, "k": args.k, "threads": args.threads,
                "queries": queries}
        print(f"[bench_memory] {spec} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)],
                                  env=env, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                row = {"selector": spec, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            row = {"selector": spec, "error": f"timeout after {args.timeout:.0f} s"}
        row["wall_s"] = time.perf_counter() - t0
        row["subset"] = queries is not None
        print(f"[bench_memory] {spec}: {json.dumps({k: v for k, v in row.items() if k != 'selector'})}",
              file=sys.stderr, flush=True)
        rows.append(row)

    ok = [r for r in rows if "error" not in r]
    result = {
        "schema": "sparseattn.memory/1",
        "data": data, "n": args.n, "d": args.d, "k": args.k, "threads": args.threads,
        "goal": "every non-dense selector under 2 GiB peak RSS at n = 262,144",
        "goal_met": bool(ok) and len(ok) == len(rows) and all(r["under_2gib"] for r in ok),
        "notes": {
            "subsets": "topk and faiss-flat: 8,192 queries; kdtree: 1,024 queries (build over all n keys)",
            "peak_rss_mib": "absolute ru_maxrss of the child (interpreter + libraries + data + run)",
            "rss_delta_mib": "ru_maxrss after the run minus ru_maxrss after data generation",
            "hwm_delta_mib": "VmHWM after the run minus VmRSS when the high-water mark was reset "
                             "(after data generation)",
            "traced_peak_mib": "tracemalloc peak: Python/numpy allocations only (not FAISS C++, not Numba NRT)",
        },
        "machine": machine_info(),  # "threads" there: what the driver sees; children use --threads
        "total_wall_s": time.perf_counter() - t_all,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"n = {args.n}, d = {args.d}, k = {args.k}, {args.threads} thread(s), {data}")
    print(table(rows))
    print(f"goal (every selector < 2 GiB peak RSS): {'met' if result['goal_met'] else 'NOT met'}; "
          f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
