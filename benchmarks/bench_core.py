"""Core benchmark: dense reference and sparse kernels against torch SDPA and plain numpy, side by side.

Run:  python benchmarks/bench_core.py [--n 16384 65536] [--repeats 3] [--threads 2]

Shapes: d = 64 is the head size of most current LLMs (and 2x MiniLM's 32); k = 64 keys per query is the
budget the issues set.  Every ratio below comes from timings taken in this one run (the machine is shared
and noisy): medians over ``--repeats``.  Results go to benchmarks/results/core.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import sparseattn as sa
from sparseattn.tools.args import OneLineParser, int_arg, positive_int


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def numpy_blocked(q, k, v, block=1024):
    """The plain approach: one block of full score rows at a time (n x block scores), numpy ops."""
    out = np.empty((q.shape[0], v.shape[1]), dtype=q.dtype)
    scale = 1.0 / np.sqrt(q.shape[1])
    for s0 in range(0, q.shape[0], block):
        s = (q[s0:s0 + block] @ k.T) * scale
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out[s0:s0 + block] = (s @ v) / s.sum(axis=1, keepdims=True)
    return out


_FLOOR_MODULE = """
import numpy as np
from numba import njit


@njit(cache=True)
def f(n):
    a = np.zeros(n, dtype=np.int64)
    for i in range(n):
        a[i] = i
    return a
"""


def cold_warm_first_call() -> dict[str, float]:
    """Seconds of the first sparse_attention call in a fresh process: empty cache, then warm cache.

    Side by side, the same for a trivial ``@njit(cache=True)`` function (Numba's own floor: importing
    numpy + numba and the first dispatch, which initialises Numba's CPU target and imports scipy.linalg
    for BLAS).  Each figure is the median of three fresh processes (three fresh caches for "cold").
    """
    ours = ("import time, numpy as np; t=time.perf_counter(); import sparseattn as sa; "
            "q=np.ones((64,64),np.float32); p=sa.SparsePattern.window(64,64,8); "
            "sa.sparse_attention(q,q,q,p); print(time.perf_counter()-t)")
    floor = ("import time, sys; t=time.perf_counter(); sys.path.insert(0, sys.argv[1]); import floor_mod; "
             "floor_mod.f(3); print(time.perf_counter()-t)")
    runs: dict[str, list[float]] = {}
    for _ in range(3):
        with tempfile.TemporaryDirectory() as cache:
            with open(os.path.join(cache, "floor_mod.py"), "w") as fh:
                fh.write(_FLOOR_MODULE)
            env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "numba"))
            for name, code in (("", ours), ("numba_floor_", floor)):
                for state in ("cold_cache_s", "warm_cache_s"):
                    res = subprocess.run([sys.executable, "-c", code, cache], env=env, capture_output=True,
                                         text=True, check=True)
                    runs.setdefault(name + state, []).append(float(res.stdout.strip().splitlines()[-1]))
    return {key: statistics.median(v) for key, v in runs.items()}


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive_int, nargs="+", default=[16384, 65536], help="keys (= queries) per case")
    ap.add_argument("--d", type=positive_int, default=64)
    ap.add_argument("--k", type=positive_int, default=64, help="keys per query of the sparse patterns (<= every --n)")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--threads", type=int_arg(1, lambda: sa.get_num_threads(), " (the threads Numba has)"),
                    default=None, help="default: all cores Numba sees")
    ap.add_argument("--skip-numpy", action="store_true", help="skip the slow plain-numpy baseline")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "core.json"))
    args = ap.parse_args()
    if args.k > min(args.n):
        ap.error(f"--k {args.k} exceeds --n {min(args.n)} (keys per query cannot exceed the keys); lower --k")
    threads = args.threads or sa.get_num_threads()
    try:
        import torch
        torch.set_num_threads(threads)
    except ImportError:
        torch = None
    rows = []
    with sa.threads(threads):
        # Warm up the JIT so compile time never lands in a timing.
        w = np.ones((8, args.d), np.float32)
        sa.sparse_attention(w, w, w, sa.SparsePattern.window(8, 8, 4))
        for n in args.n:
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((n, args.d), dtype=np.float32) for _ in range(3))
            row = {"n": n, "d": args.d, "k": args.k, "threads": threads}
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(x)[None, None] for x in (q, k, v))  # 4-D: 2-D allocates n x n
                row["torch_sdpa_s"] = median_time(
                    lambda tq=tq, tk=tk, tv=tv: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv),
                    args.repeats)
            row["dense_s"] = median_time(lambda q=q, k=k, v=v: sa.scaled_dot_product_attention(q, k, v),
                                         args.repeats)
            if not args.skip_numpy:
                row["numpy_blocked_s"] = median_time(lambda q=q, k=k, v=v: numpy_blocked(q, k, v), 1)
            rand = sa.SparsePattern.from_padded(rng.integers(0, n, (n, args.k)), n)
            win = sa.SparsePattern.window(n, n, args.k, is_causal=True)
            for name, pat in (("random", rand), ("window", win)):
                t = median_time(lambda pat=pat, q=q, k=k, v=v: sa.sparse_attention(q, k, v, pat, check_finite=False),
                                max(args.repeats, 5))
                row[f"sparse_{name}_s"] = t
                row[f"sparse_{name}_GBps"] = pat.nnz * (args.d + args.d) * 4 / t / 1e9
            rows.append(row)
            base = row.get("torch_sdpa_s")
            msg = [f"n={n:>6}"]
            for key in ("torch_sdpa_s", "dense_s", "numpy_blocked_s", "sparse_random_s", "sparse_window_s"):
                if key in row:
                    ratio = f" ({row[key] / base:.2f}x SDPA)" if base and key != "torch_sdpa_s" else ""
                    msg.append(f"{key}={row[key]:.3f}{ratio}")
            if base:
                msg.append(f"speed-up vs SDPA: random {base / row['sparse_random_s']:.0f}x, "
                           f"window {base / row['sparse_window_s']:.0f}x")
            msg.append(f"gathered GB/s: random {row['sparse_random_GBps']:.1f}, window {row['sparse_window_GBps']:.1f}")
            print("  ".join(msg), flush=True)
    jit = cold_warm_first_call()
    print(f"first call incl. import + JIT: cold cache {jit['cold_cache_s']:.2f} s, warm cache {jit['warm_cache_s']:.2f} s"
          f" (Numba floor, a trivial cached function: cold {jit['numba_floor_cold_cache_s']:.2f} s, warm "
          f"{jit['numba_floor_warm_cache_s']:.2f} s)")
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version(), "numpy": np.__version__,
                          "torch": getattr(torch, "__version__", None)},
              "rows": rows, "jit": jit}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
