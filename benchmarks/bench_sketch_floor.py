"""The default decode step (``sketch``) next to the memory floor of the bytes it must read, and torch SDPA.

Run:  python benchmarks/bench_sketch_floor.py [--lengths 131072,1048576] [--heads 8] [--steps 12]
          [--settings default,sketch-lean] [--flush-mb 1024] [--out benchmarks/results/sketch-floor]

Setup: H heads, E = 64, float32, norm-matched Gaussian keys and values (``sparseattn.data.gaussian``, one
call per head), appended 8,192 tokens at a time to ``KVCache(H, 64)`` (the default,
``sketch``) and, with ``sketch-lean`` listed, ``KVCache(H, 64, selector="sketch:candidates=1024,
shortlist=0.01")``.  Each of ``--steps`` steps draws one query per head and times, each right after both
cores wrote a ``--flush-mb`` buffer (nothing of the cache is left in any cache level, as in a generation
loop where the model's other layers ran in between), in an order rotated every step:

* ``step``: ``cache.attend(q)``; ``kernel``: the exact reads and softmax of that call
  (``stats["kernel_seconds"]``), so ``step - kernel`` is the scan, the re-ranking and Python;
* ``read scan``: a kernel that reads what the scan must stream for every row, the sign codes, factors and
  positions of every routed key of its head (16 bytes a key at E = 64), as uint64 words with one add each,
  in parallel over the rows: the least time any full scan of these codes takes here;
* ``read rows``: the same for the key and value rows the step reads exactly (the slot ranges its kernel
  recorded through ``debug_step``: sinks, window, the not-yet-clustered tail and the candidates);
* ``launch``: an empty parallel call;
* ``sdpa``: torch's ``scaled_dot_product_attention`` on (1, H, 1, 64) / (1, H, n, 64) float32 tensors
  over the same keys and values (torch's own threads, 2 here).

``floor`` = ``read scan + read rows``: a step of this design (every routed key's code scanned, the
candidates read exactly) cannot take less on this machine; ``x SDPA`` of the floor is the largest speed-up
it can show.  Medians over the steps.  Writes ``--out``.json and .md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

import sparseattn  # noqa: F401  (before torch: idle OpenMP threads sleep instead of spinning)
from sparseattn.cache import KVCache
from sparseattn.data import gaussian
from sparseattn.tools.args import OneLineParser, int_arg

HERE = Path(__file__).resolve().parent
SETTINGS = {"default": {}, "sketch-lean": {"selector": "sketch:candidates=1024,shortlist=0.01"}}
LEVELS = ("step", "read scan", "read rows", "launch", "sdpa")


@njit(parallel=True)
def read_scan(codes, fac, pos, lo, hi, out):
    """Row h: sum of the uint64 code words, factor bits and positions of slots [lo[h], hi[h]) of head h
    (three contiguous streams, each summed by a loop that vectorises: memory-bound, not compute-bound)."""
    for h in prange(out.shape[0]):
        c = codes[h, lo[h]:hi[h]].ravel()
        f = fac[h, lo[h]:hi[h]]
        p = pos[h, lo[h]:hi[h]]
        a = np.uint64(0)
        for j in range(c.shape[0]):
            a += c[j]
        b = np.uint64(0)
        for j in range(f.shape[0]):
            b += np.uint64(f[j])
        d = np.int64(0)
        for j in range(p.shape[0]):
            d += p[j]
        out[h] = a + b + np.uint64(d)


@njit(parallel=True)
def read_rows(K, V, rec, n_rec, out):
    """Row h: sum of the uint64 words of the key and value rows of the slot ranges ``rec[h, :n_rec[h]]``."""
    for h in prange(out.shape[0]):
        acc = np.zeros(K.shape[2], np.uint64)
        for i in range(n_rec[h]):
            for j in range(rec[h, i, 0], rec[h, i, 1]):
                for e in range(K.shape[2]):
                    acc[e] += K[h, j, e] + V[h, j, e]
        out[h] = acc.sum()


@njit(parallel=True)
def launch(out):
    for h in prange(out.shape[0]):
        out[h] = 0


@njit(parallel=True)
def flush(buf, step):
    for i in prange(buf.shape[0]):
        buf[i] = step + i


def run_length(n: int, heads: int, steps: int, settings: list[str], flush_mb: int) -> dict:
    import torch

    t0 = time.perf_counter()
    K = np.empty((heads, n, 64), np.float32)
    V = np.empty((heads, n, 64), np.float32)
    for h in range(heads):
        _, K[h], V[h] = gaussian(n, 64, n_queries=1, seed=h)
    print(f"n={n} H={heads}: data {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    kt, vt = torch.from_numpy(K)[None], torch.from_numpy(V)[None]
    buf = np.zeros(flush_mb << 17, np.uint64)
    rng = np.random.default_rng(1)
    res: dict = {"n": n, "heads": heads, "settings": {}}
    for name in settings:
        cache = KVCache(heads, 64, **SETTINGS[name])
        t0 = time.perf_counter()
        for a in range(0, n, 8192):
            cache.append(K[:, a:a + 8192], V[:, a:a + 8192])
        t_app = time.perf_counter() - t0
        view = cache.debug_view()
        cw = cache.store.sketch_codes.view(np.uint64)
        fac = cache.store.sketch_fac.view(np.uint32)
        lo = view["cluster_ptr"][:, 0].astype(np.int64)
        hi = view["cluster_ptr"][np.arange(heads), view["n_clusters"]].astype(np.int64)
        Kw, Vw = view["raw_keys"].view(np.uint64), view["raw_values"].view(np.uint64)
        out = np.zeros(heads, np.uint64)
        qpos = np.array([cache.positions_appended - 1], np.int64)
        times: dict[str, list[float]] = {lv: [] for lv in LEVELS}
        kern, reads, floor_rows = [], [], []
        q0 = rng.standard_normal((heads, 64)).astype(np.float32)
        cache.attend(q0)  # warm-up (JIT)
        for s in range(steps):
            q = rng.standard_normal((heads, 64)).astype(np.float32) * np.float32(np.sqrt(64) ** -0.5 * 4)
            rec = cache.debug_step(q[:, None], qpos)[4:]  # the slot ranges this step reads (not timed)
            floor_rows.append(sum(int((rec[0][h, :rec[1][h], 1] - rec[0][h, :rec[1][h], 0]).sum())
                                  for h in range(heads)) / heads)
            for i in range(len(LEVELS)):
                lv = LEVELS[(i + s) % len(LEVELS)]
                flush(buf, s)
                if lv == "step":
                    k0 = cache.stats["kernel_seconds"]
                    a0 = time.perf_counter()
                    cache.attend(q)
                    times[lv].append(time.perf_counter() - a0)
                    kern.append(cache.stats["kernel_seconds"] - k0)
                    reads.append(cache.stats["keys_read_per_query"])
                    continue
                a0 = time.perf_counter()
                if lv == "read scan":
                    read_scan(cw, fac, cache.store.pos, lo, hi, out)
                elif lv == "read rows":
                    read_rows(Kw, Vw, rec[0][:, :, :2], rec[1], out)
                elif lv == "launch":
                    launch(out)
                else:
                    with torch.no_grad():
                        torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q)[None, :, None], kt, vt)
                times[lv].append(time.perf_counter() - a0)
        med = {lv: 1e3 * float(np.median(v)) for lv, v in times.items()}
        med["kernel"] = 1e3 * float(np.median(kern))
        med["floor"] = med["read scan"] + med["read rows"]
        st = cache.stats
        r = {"ms": med, "x_sdpa_step": med["sdpa"] / med["step"], "x_sdpa_floor": med["sdpa"] / med["floor"],
             "keys_read": float(np.mean(reads)), "floor_rows": float(np.mean(floor_rows)), "scan_mb": float((hi - lo).sum() * 16 / 2**20),
             "rows_mb": float(np.mean(reads) * heads * 512 / 2**20),
             "index_over_kv": st["index_nbytes"] / st["kv_nbytes"], "append_us_per_token": 1e6 * t_app / n}
        res["settings"][name] = r
        print(f"  {name}: step {med['step']:.2f} ms (kernel {med['kernel']:.2f}) | read scan {med['read scan']:.2f} "
              f"+ read rows {med['read rows']:.2f} = floor {med['floor']:.2f} ms | launch {med['launch']:.3f} | sdpa "
              f"{med['sdpa']:.2f} ms | x SDPA step {r['x_sdpa_step']:.1f} floor {r['x_sdpa_floor']:.1f}",
              file=sys.stderr, flush=True)
        del cache
    return res


def write_md(path: Path, res: dict) -> None:
    L = ["# Sketch decode step against its memory floor", "",
         f"Command: `{res['command']}`; {res['machine']}; load average at start {res['load']}.", "",
         "| keys/head (heads) | setting | keys read | step ms | kernel ms | read scan ms (MB) | read rows ms (MB) "
         "| floor ms | sdpa ms | x SDPA step | x SDPA floor |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in res["cases"]:
        for name, r in case["settings"].items():
            m = r["ms"]
            L.append(f"| {case['n']:,} ({case['heads']}) | {name} | {r['keys_read']:,.0f} | {m['step']:.2f} | "
                     f"{m['kernel']:.2f} | {m['read scan']:.2f} ({r['scan_mb']:.0f}) | {m['read rows']:.2f} "
                     f"({r['rows_mb']:.0f}) | {m['floor']:.2f} | {m['sdpa']:.2f} | {r['x_sdpa_step']:.1f} | "
                     f"{r['x_sdpa_floor']:.1f} |")
    path.write_text("\n".join(L) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--heads", type=int_arg(1, 64), default=8)
    ap.add_argument("--steps", type=int_arg(1), default=12)
    ap.add_argument("--settings", default="default,sketch-lean")
    ap.add_argument("--flush-mb", type=int_arg(1, 16384), default=1024)
    ap.add_argument("--out", default=str(HERE / "results" / "sketch-floor"))
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths must be comma-separated integers; got {a.lengths!r}")
    if not lengths or min(lengths) < 16384:
        ap.error(f"--lengths must each be >= 16384 (a few segments to scan); got {a.lengths!r}")
    settings = a.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not settings:
        ap.error(f"--settings: unknown {bad}; choose from {','.join(SETTINGS)}")
    res = {"command": "python benchmarks/bench_sketch_floor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load": os.getloadavg()[0], "cases": []}
    for n in lengths:
        res["cases"].append(run_length(n, a.heads, a.steps, settings, a.flush_mb))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    write_md(out.with_suffix(".md"), res)
    print(f"wrote {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
