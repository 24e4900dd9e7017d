"""16-bit KV storage against float32 in a decode step, next to the memory floor of the rows the step reads.

Run:  python benchmarks/bench_storage_floor.py [--n 131072] [--steps 64] [--stride 64] [--flush-mb 128]

Setup (the storage case of ``bench_decode.py``): H = 8 heads, E = 64, clustered synthetic keys (the same
generator and seeds), three ``KVCache(selector="cluster")`` caches holding the same n keys in float32,
float16 and bfloat16 storage.  Each of ``--steps`` steps appends ``--stride`` tokens to every cache, one at a
time, then measures one query per head on each cache (the caches in an order rotated each step), five
ways, each once *cold* (right after both cores wrote a ``--flush-mb`` buffer, four times the 32 MB
last-level cache by default: nothing of this cache is left in any cache level, as in a generation loop
where the other layers' work ran in between) and once *warm* (the same call again at once):

* ``step``: ``cache.attend(q)``, what ``bench_decode.py`` times;
* ``kernel``: the decode kernel alone (``stats["kernel_seconds"]`` of that call);
* ``read``: a kernel that reads exactly what the step reads (its head's routing vectors, and the key rows,
  value rows and positions of the slot ranges its decode kernel recorded) as uint64 words with one
  integer add each (the least arithmetic that reads every byte), in parallel over the same rows (heads),
  and nothing else: what the step's bytes cost on this machine, in the step's access pattern;
* ``read+prefetch``: the same with a software prefetch of the ranges two ahead;
* ``launch``: an empty parallel call (thread wake-up and launch, the same for every storage).

The harness checks that ``read`` touched exactly the keys the step counts as read.

Why: reading half the bytes (float16) does not take half the time when the rows are gathered in short
ranges: each range of a routed cluster starts with a DRAM latency, whatever its length.  ``read``'s
float16 / float32 ratio (the faster of ``read`` and ``read+prefetch`` for each storage) is a floor for the
step's ratio: the step reads the same bytes and on top does the same arithmetic (scores, softmax, the
routing scan, Python) in both storages, float16 adding a conversion.

Writes benchmarks/results/storage-floor.json and storage-floor.md (``--out`` for another name).
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

from sparseattn.kernels.intrinsics import prefetch_l2
from sparseattn.tools.args import OneLineParser, int_arg, positive_int
from sparseattn.tools.bench import decode_inputs, log

HERE = Path(__file__).resolve().parent

MAX_FLUSH_MB = 16384


STORAGES = (("float32", np.float32), ("float16", np.float16), ("bfloat16", "bfloat16"))
LEVELS = ("step", "kernel", "read", "read+prefetch", "launch")


@njit(parallel=True)
def read(K, V, pos, cent, cscale, n_cent, rep, T, rec, n_rec, dist, out):
    """Per row r = (h, t), the bytes the decode step reads for it from kv head g = h // rep: every routing
    vector of the head (``cent[g, :n_cent[g]]`` and its scale) and the key rows, value rows and positions
    of the ranges ``rec[r, :n_rec[r]]``.  ``K``, ``V`` and ``cent`` are viewed as uint64 words and summed
    with integer adds (one vector add per 32 bytes: the least arithmetic that reads every byte, whatever
    the storage); with ``dist > 0`` the key and value rows of the range ``dist`` ahead are prefetched.
    Returns the key rows read."""
    n_read = 0
    for r in prange(rec.shape[0]):
        g = (r // T) // rep
        Kg = K[g]
        Vg = V[g]
        pg = pos[g]
        kb = Kg.shape[1] * 8
        vb = Vg.shape[1] * 8
        acc = np.zeros(max(Kg.shape[1], Vg.shape[1], cent.shape[2]), np.uint64)
        extra = 0.0
        for c in range(n_cent[g]):
            cv = cent[g, c]
            for e in range(cv.shape[0]):
                acc[e] += cv[e]
            extra += cscale[g, c]
        rows = 0
        for i in range(n_rec[r]):
            if dist > 0 and i + dist < n_rec[r]:
                for j in range(rec[r, i + dist, 0], rec[r, i + dist, 1]):
                    for off in range(0, kb, 64):
                        prefetch_l2(Kg, j, off)
                    for off in range(0, vb, 64):
                        prefetch_l2(Vg, j, off)
            p_sum = 0
            for j in range(rec[r, i, 0], rec[r, i, 1]):
                kj = Kg[j]
                vj = Vg[j]
                for e in range(kj.shape[0]):
                    acc[e] += kj[e]
                for e in range(vj.shape[0]):
                    acc[e] += vj[e]
                p_sum += pg[j]
            extra += p_sum
            rows += rec[r, i, 1] - rec[r, i, 0]
        out[r] = np.float32(acc.sum() & np.uint64(0xFFFF)) + np.float32(extra)
        n_read += rows
    return n_read


def _words(a: np.ndarray) -> np.ndarray:
    """C-contiguous ``a`` (..., m), m * itemsize a multiple of 8 bytes, viewed as uint64 words (no copy)."""
    return a.view(np.uint64)


@njit(parallel=True)
def launch(out):
    """An empty parallel loop over the rows: thread wake-up and launch."""
    for r in prange(out.shape[0]):
        out[r] = 0.0


@njit(parallel=True)
def flush_caches(buf):
    """Write every byte of ``buf`` from all threads (evicts the step's data from every cache level)."""
    for i in prange(buf.shape[0]):
        buf[i] += 1


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=positive_int, default=131072, help="cached keys per head before the steps")
    ap.add_argument("--steps", type=positive_int, default=64, help="measured steps")
    ap.add_argument("--stride", type=positive_int, default=64, help="tokens appended before each step")
    ap.add_argument("--flush-mb", type=int_arg(1, MAX_FLUSH_MB, " (MB)"), default=128,
                    help=f"MB written by both cores before each cold measurement (> the last-level cache; at "
                         f"most {MAX_FLUSH_MB})")
    ap.add_argument("--out", default=str(HERE / "results" / "storage-floor.json"),
                    help="the JSON file to write (the report goes next to it, .md)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.out.strip() or out.is_dir():
        ap.error(f"--out {args.out!r}: give a file path such as results/storage-floor.json")
    try:
        from sparseattn.tools.cli import check_out_dir

        check_out_dir(str(out.parent), "--out's folder")
    except ValueError as exc:
        ap.error(str(exc))

    import numba

    import sparseattn as sa
    from sparseattn.cache import KVCache

    n, steps, stride = args.n, args.steps, args.stride
    H, E = 8, 64
    meta = {"python": sys.version.split()[0], "numpy": np.__version__, "numba": numba.__version__,
            "sparseattn": sa.__version__, "cpu": platform.processor(), "cores": os.cpu_count(),
            "numba_threads": numba.get_num_threads(), "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "n": n, "steps": steps, "stride": stride,
            "flush_mb": args.flush_mb, "heads": H, "dim": E}
    log(f"n={n}: generating")
    K, V, Q = decode_inputs("clustered", n + steps * stride, H, 1, steps, E)
    caches = {}
    for name, dtype in STORAGES:
        c = KVCache(H, E, selector="cluster", dtype=dtype)
        c.append(K[:, :n], V[:, :n])
        c.reserve(steps * stride)
        caches[name] = c
    buf = np.zeros(args.flush_mb << 20, np.uint8)
    scratch = np.empty(H, np.float32)

    def arrays(c):
        """The cache's keys, values and routing vectors as uint64 words (views, no copy)."""
        return _words(c.store.K), _words(c.store.V), _words(np.ascontiguousarray(c.debug_view()["routing_codes"]))

    def routing(c, cent):
        """Positions, routing codes, routing scales and cluster counts the read kernel takes."""
        view = c.debug_view()
        return c.store.pos, cent, np.ascontiguousarray(view["routing_scales"]), view["n_clusters"]

    def measure(level: str, c, q, rec, n_rec) -> tuple[float, float]:
        """Seconds of one call of ``level`` (and for ``step`` its kernel's seconds, else 0)."""
        k, v, cent = arrays(c)
        args = routing(c, cent)
        k0 = c.stats["kernel_seconds"]
        t0 = time.perf_counter()
        if level == "step":
            c.attend(q)
        elif level == "read":
            read(k, v, *args, 1, 1, rec, n_rec, 0, scratch)
        elif level == "read+prefetch":
            read(k, v, *args, 1, 1, rec, n_rec, 2, scratch)
        else:
            launch(scratch)
        dt = time.perf_counter() - t0
        return dt, (c.stats["kernel_seconds"] - k0 if level == "step" else 0.0)

    # compile and warm up every call
    for c in caches.values():
        q = np.ascontiguousarray(Q[:, 0])[:, None]
        _, _, _, _, rec, n_rec = c.debug_step(q, np.array([len(c) - 1]), 64, "cluster", record=True)
        for level in LEVELS:
            if level != "kernel":
                measure(level, c, q, rec, n_rec)
    flush_caches(buf)
    times = {(s, lv, m): [] for s in caches for lv in LEVELS for m in ("cold", "warm")}
    read_keys = {s: [] for s in caches}
    names = list(caches)
    for step in range(steps):
        for j in range(n + step * stride, n + (step + 1) * stride):
            for c in caches.values():
                c.append(K[:, j:j + 1], V[:, j:j + 1])
        q = np.ascontiguousarray(Q[:, step])[:, None]
        r = step % len(names)
        for s in names[r:] + names[:r]:
            c = caches[s]
            _, _, nread, _, rec, n_rec = c.debug_step(q, np.array([len(c) - 1]), 64, "cluster", record=True)
            k, v, cent = arrays(c)
            touched = read(k, v, *routing(c, cent), 1, 1, rec, n_rec, 0, scratch)
            if touched != int(nread.sum()):
                raise AssertionError(f"{s}: the read kernel touched {touched} rows, the step read {nread.sum()}")
            read_keys[s].append(touched / H)
            for level in ("step", "read", "read+prefetch", "launch"):
                for mode in ("cold", "warm"):
                    if mode == "cold":
                        flush_caches(buf)
                    dt, kernel = measure(level, c, q, rec, n_rec)
                    times[(s, level, mode)].append(dt)
                    if level == "step":
                        times[(s, "kernel", mode)].append(kernel)
        if step % 16 == 15 or step == steps - 1:
            f32 = np.median(times[("float32", "step", "cold")]) * 1e3
            f16 = np.median(times[("float16", "step", "cold")]) * 1e3
            log(f"  step {step + 1}/{steps}: cold step float32 {f32:.3f} ms, float16 {f16:.3f} ms "
                f"({f16 / f32:.2f})")
    meta["loadavg_end"] = os.getloadavg()
    res: dict = {"keys_read_per_head": {s: float(np.mean(v)) for s, v in read_keys.items()}, "levels": {}}
    for level in LEVELS:
        row = {}
        for mode in ("cold", "warm"):
            p50 = {s: 1e3 * float(np.median(times[(s, level, mode)])) for s in names}
            row[mode] = {"p50_ms": p50, "f16_over_f32": _ratio(p50["float16"], p50["float32"]),
                         "bf16_over_f32": _ratio(p50["bfloat16"], p50["float32"]),
                         "ms": {s: [round(1e3 * x, 4) for x in times[(s, level, mode)]] for s in names}}
        res["levels"][level] = row
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    write_report(out, meta, res)
    for level in LEVELS:
        c = res["levels"][level]["cold"]
        log(f"  {level:>14} cold: " + ", ".join(f"{s} {c['p50_ms'][s]:.3f}" for s in names)
            + f" ms; float16/float32 {c['f16_over_f32']:.2f}, bfloat16/float32 {c['bf16_over_f32']:.2f}")
    return 0


def write_report(path: Path, meta: dict, res: dict) -> None:
    lv = res["levels"]
    best = {s: min(lv["read"]["cold"]["p50_ms"][s], lv["read+prefetch"]["cold"]["p50_ms"][s])
            for s in ("float32", "float16")}
    floor = best["float16"] / best["float32"]
    step = lv["step"]["cold"]["f16_over_f32"]
    kr = res["keys_read_per_head"]
    lines = ["# 16-bit KV storage against float32: decode step and memory floor", "",
             f"Run {meta['started']} on {meta['cores']} cores (load average {meta['loadavg_start'][0]:.1f} at "
             f"start, {meta.get('loadavg_end', (0,))[0]:.1f} at end), numba threads {meta['numba_threads']}.  "
             f"`KVCache(selector=\"cluster\")`, {meta['n']:,} clustered synthetic keys per head, H = "
             f"{meta['heads']}, E = {meta['dim']}; {meta['steps']} steps with {meta['stride']} tokens appended "
             f"before each; keys read per head per step {kr['float32']:,.0f} (float32), {kr['float16']:,.0f} "
             f"(float16), {kr['bfloat16']:,.0f} (bfloat16).  Medians; *cold* = after both cores wrote "
             f"{meta['flush_mb']} MB, *warm* = the same call again at once.  `read` reads exactly what the step "
             f"reads (routing vectors, key and value rows, positions) as uint64 words, one integer add each: the "
             f"bytes' own "
             f"cost in the step's access pattern; `launch` is an empty parallel call.",
             "",
             "| level | cold float32 ms | cold float16 ms | cold bfloat16 ms | cold f16/f32 | cold bf16/f32 | "
             "warm float32 ms | warm float16 ms | warm f16/f32 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level, row in lv.items():
        c, w = row["cold"], row["warm"]
        lines.append(f"| {level} | {c['p50_ms']['float32']:.3f} | {c['p50_ms']['float16']:.3f} | "
                     f"{c['p50_ms']['bfloat16']:.3f} | {c['f16_over_f32']:.2f} | {c['bf16_over_f32']:.2f} | "
                     f"{w['p50_ms']['float32']:.3f} | {w['p50_ms']['float16']:.3f} | {w['f16_over_f32']:.2f} |")
    lines += ["", f"Cold, reading the step's bytes alone in float16 takes {floor:.2f}x the float32 time ("
              f"{best['float16']:.3f} against {best['float32']:.3f} ms, the faster of `read` and "
              f"`read+prefetch` for each); the whole step takes {step:.2f}x.  The step reads these "
              f"bytes and on top does the same arithmetic in both storages (float16 adds a conversion), so its "
              f"ratio cannot be lower than the reads' {floor:.2f}x."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
