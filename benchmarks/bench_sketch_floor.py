"""The default decode step (``sketch``) next to the memory floor of the bytes it must read, and torch SDPA.

Run:  python benchmarks/bench_sketch_floor.py [--workload passkey-gaussian|gaussian] [--lengths 131072,1048576]
          [--heads 8] [--steps 12] [--settings default,sketch-lean] [--flush-mb 1024]
          [--out benchmarks/results/sketch-floor]

Setup: H heads, E = 64, float32.  ``passkey-gaussian`` (the default): ``sparseattn.data.passkey`` over a
norm-matched Gaussian background, one query per head and step with 4 planted keys anywhere in the cache
(the generator's default depths) that hold at least half of its softmax mass (the decode-recall goal's workload); ``gaussian``: norm-matched Gaussian
keys and values (``sparseattn.data.gaussian``, one call per head) and random queries (diffuse attention:
exact top-64 attention itself is far from dense there).  Keys and values are appended 8,192 tokens at a
time to ``KVCache(H, 64)`` (the default, ``sketch``) and, with ``sketch-lean`` listed, ``KVCache(H, 64,
selector="sketch:candidates=1024,shortlist=0.01")``.  Each of ``--steps`` steps times, each right after
both cores wrote a ``--flush-mb`` buffer (nothing of the cache is left in any cache level, as in a
generation loop where the model's other layers ran in between), in an order rotated every step:

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
it can show.  Medians over the steps.

Accuracy of the timed steps, in the same run (after the timing, so the exact scans cannot slow it): the
output error ``||o - o*|| / ||o*||`` of each timed step's output against float64 dense attention over the
same keys and values, next to that of exact top-64 attention (float64), and ``KVCache.audit``'s recall@64
(the share of the exact top-64 keys the step reads) and softmax mass read; means over steps and heads.
Writes ``--out``.json and .md.
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
from sparseattn.data import gaussian, passkey
from sparseattn.tools.args import OneLineParser, int_arg
from sparseattn.tools.bench import cpu_name

HERE = Path(__file__).resolve().parent
SETTINGS = {"default": {}, "sketch-lean": {"selector": "sketch:candidates=1024,shortlist=0.01"}}
LEVELS = ("step", "read scan", "read rows", "launch", "sdpa")
WORKLOADS = ("passkey-gaussian", "gaussian")
PLANTED = 4  # planted keys per query of passkey-gaussian


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


def dense64(K: np.ndarray, V: np.ndarray, qs: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Float64 oracle: dense attention and exact top-64 attention outputs (steps, H, E) of queries ``qs``
    (steps, H, E) over keys / values (H, n, E) float32, one head at a time (float64 copies of one head's
    keys and values: 1 GB at n = 1,048,576)."""
    out = np.empty(qs.shape, np.float64)
    top = np.empty(qs.shape, np.float64)
    for h in range(K.shape[0]):
        Kh, Vh = K[h].astype(np.float64), V[h].astype(np.float64)
        S = Kh @ qs[:, h].astype(np.float64).T * scale  # (n, steps)
        for t in range(qs.shape[0]):
            w = np.exp(S[:, t] - S[:, t].max())
            out[t, h] = w @ Vh / w.sum()
            i = np.argpartition(-S[:, t], 64)[:64]
            wt = np.exp(S[i, t] - S[i, t].max())
            top[t, h] = wt @ Vh[i] / wt.sum()
    return out, top


def rel_err(o: np.ndarray, ref: np.ndarray) -> float:
    """Mean over rows of ``||o - ref|| / ||ref||`` (last axis)."""
    return float(np.mean(np.linalg.norm(o - ref, axis=-1) / np.linalg.norm(ref, axis=-1)))


def make_data(workload: str, n: int, heads: int, steps: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """Keys, values (H, n, 64) float32, the steps' queries (steps, H, 64) float32, the scale and the
    number of planted keys per query (0: none)."""
    if workload == "gaussian":
        K = np.empty((heads, n, 64), np.float32)
        V = np.empty((heads, n, 64), np.float32)
        for h in range(heads):
            _, K[h], V[h] = gaussian(n, 64, n_queries=1, seed=h)
        rng = np.random.default_rng(1)
        qs = (rng.standard_normal((steps, heads, 64)) * (np.sqrt(64) ** -0.5 * 4)).astype(np.float32)
        return K, V, qs, 64 ** -0.5, 0
    w = passkey(n, 64, heads=heads, n_planted=PLANTED, n_queries=steps, background="gaussian", seed=0)
    return w.keys, w.values, np.ascontiguousarray(w.queries.transpose(1, 0, 2)), float(w.scale), PLANTED


def run_length(workload: str, n: int, heads: int, steps: int, settings: list[str], flush_mb: int) -> dict:
    import torch

    t0 = time.perf_counter()
    K, V, qs, scale, planted = make_data(workload, n, heads, steps)
    print(f"{workload} n={n} H={heads}: data {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    kt, vt = torch.from_numpy(K)[None], torch.from_numpy(V)[None]
    buf = np.zeros(flush_mb << 17, np.uint64)
    t0 = time.perf_counter()
    ref, ref_top = dense64(K, V, qs, scale)
    print(f"  float64 oracle {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    res: dict = {"workload": workload, "n": n, "heads": heads, "planted": planted, "scale": scale,
                 "top64_rel_err": rel_err(ref_top, ref), "settings": {}}
    for name in settings:
        cache = KVCache(heads, 64, scale=scale, **SETTINGS[name])
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
        outs = np.empty((steps, heads, 64), np.float64)
        cache.attend(qs[0] * np.float32(0.5))  # warm-ups (JIT)
        read_scan(cw, fac, cache.store.pos, lo, hi, out)
        read_rows(Kw, Vw, np.zeros((heads, 1, 3), np.int64)[:, :, :2], np.zeros(heads, np.int64), out)  # its layout
        launch(out)
        for s in range(steps):
            q = qs[s]
            rec = cache.debug_step(q[:, None], qpos)[4:]  # the slot ranges this step reads (not timed)
            floor_rows.append(sum(int((rec[0][h, :rec[1][h], 1] - rec[0][h, :rec[1][h], 0]).sum())
                                  for h in range(heads)) / heads)
            for i in range(len(LEVELS)):
                lv = LEVELS[(i + s) % len(LEVELS)]
                flush(buf, s)
                if lv == "step":
                    k0 = cache.stats["kernel_seconds"]
                    a0 = time.perf_counter()
                    o = cache.attend(q)
                    times[lv].append(time.perf_counter() - a0)
                    outs[s] = o
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
                        torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q)[None, :, None], kt, vt,
                                                                         scale=scale)
                times[lv].append(time.perf_counter() - a0)
        audits = [cache.audit(qs[t], k=64) for t in range(steps)]  # after the timing: exact scans
        # the planted keys are each query's exact top-PLANTED (the generator's margin): their recall
        found = [cache.audit(qs[t], k=planted)["recall"] for t in range(steps)] if planted else []
        med = {lv: 1e3 * float(np.median(v)) for lv, v in times.items()}
        med["kernel"] = 1e3 * float(np.median(kern))
        med["floor"] = med["read scan"] + med["read rows"]
        st = cache.stats
        r = {"ms": med, "x_sdpa_step": med["sdpa"] / med["step"], "x_sdpa_floor": med["sdpa"] / med["floor"],
             "keys_read": float(np.mean(reads)), "floor_rows": float(np.mean(floor_rows)), "scan_mb": float((hi - lo).sum() * 16 / 2**20),
             "rows_mb": float(np.mean(reads) * heads * 512 / 2**20),
             "index_over_kv": st["index_nbytes"] / st["kv_nbytes"], "append_us_per_token": 1e6 * t_app / n,
             "rel_err": rel_err(outs, ref), "recall64": float(np.mean([a["recall"] for a in audits])),
             "recall64_min": float(np.min([a["recall"] for a in audits])),
             "mass": float(np.mean([a["mass"] for a in audits])),
             "planted_recall": float(np.mean(found)) if found else None,  # None: no planted keys (valid JSON)
             "planted_recall_min": float(np.min(found)) if found else None}
        res["settings"][name] = r
        print(f"  {name}: step {med['step']:.2f} ms (kernel {med['kernel']:.2f}) | read scan {med['read scan']:.2f} "
              f"+ read rows {med['read rows']:.2f} = floor {med['floor']:.2f} ms | launch {med['launch']:.3f} | sdpa "
              f"{med['sdpa']:.2f} ms | x SDPA step {r['x_sdpa_step']:.1f} floor {r['x_sdpa_floor']:.1f} | recall@64 "
              f"{r['recall64']:.3f} mass {r['mass']:.3f} err {r['rel_err']:.3f} (top-64 {res['top64_rel_err']:.3f})",
              file=sys.stderr, flush=True)
        del cache
    return res


def write_md(path: Path, res: dict) -> None:
    L = ["# Sketch decode step against its memory floor", "",
         f"Command: `{res['command']}`; {res['machine']}; load average at start {res['load']}.", "",
         "Accuracy of the timed steps (same run): planted recall (the share of each query's planted keys the "
         "step reads; passkey workloads) and recall@64 (mean, min) and the softmax mass read, from "
         "`KVCache.audit`; `err` the output error against float64 dense attention, `top-64 err` that of exact "
         "top-64 attention (float64) on the same queries.", "",
         "| workload | keys/head (heads) | setting | planted recall (min) | recall@64 (min) | mass | err "
         "| top-64 err | keys read | step ms | kernel ms | read scan ms (MB) | read rows ms (MB) | floor ms "
         "| sdpa ms | x SDPA step | x SDPA floor |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in res["cases"]:
        for name, r in case["settings"].items():
            m = r["ms"]
            pr = (f"{r['planted_recall']:.3f} ({r['planted_recall_min']:.2f})" if case["planted"] else "-")
            L.append(f"| {case['workload']} | {case['n']:,} ({case['heads']}) | {name} | {pr} | "
                     f"{r['recall64']:.3f} ({r['recall64_min']:.2f}) | "
                     f"{r['mass']:.3f} | {r['rel_err']:.3f} | {case['top64_rel_err']:.3f} | "
                     f"{r['keys_read']:,.0f} | {m['step']:.2f} | "
                     f"{m['kernel']:.2f} | {m['read scan']:.2f} ({r['scan_mb']:.0f}) | {m['read rows']:.2f} "
                     f"({r['rows_mb']:.0f}) | {m['floor']:.2f} | {m['sdpa']:.2f} | {r['x_sdpa_step']:.1f} | "
                     f"{r['x_sdpa_floor']:.1f} |")
    path.write_text("\n".join(L) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default=WORKLOADS[0])
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
           "machine": f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores", "load": os.getloadavg()[0], "cases": []}
    for n in lengths:
        res["cases"].append(run_length(a.workload, n, a.heads, a.steps, settings, a.flush_mb))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    write_md(out.with_suffix(".md"), res)
    print(f"wrote {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
