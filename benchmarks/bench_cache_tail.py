"""KVCache tail estimate (``attend(tail=...)``) on the real store65k trace: error, mass, keys read, latency.

Run:  python benchmarks/bench_cache_tail.py [--steps 32] [--segment 4096] [--seed 0]
                                            [--out benchmarks/results/cache-tail.json]

Setup (the real-store phase of bench_decode.py): the store65k trace (2 heads, E = 32, MiniLM keys/values/
queries), keys appended in text order to one ``KVCache(selector="cluster", segment=4096)`` (2 heads, 2 kv
heads): the first n = nk - steps keys as one prompt ``append``, then each of ``--steps`` decode steps
appends one key and attends one held-out query per head (``--seed`` picks them from the trace's queries).
Every configuration runs on the same cache in the same step, back to back:

* ``topk`` k=64 (exact top-64; reads every key to choose), topk k=32 + tail 32, topk k=16 + tail 48;
* ``cluster`` (the cache's selector, defaults), cluster + tail 64, cluster + tail 256;
* ``window`` (sinks + recent window), window + tail 64;

each tail configuration with ``shrink=0`` (unbiased) and ``shrink=64``.  Per configuration: the mean over
heads and steps of the output relative error ``||o - o*|| / ||o*||`` against float64 exact attention over
every key of the cache; ``mass`` = mean ``exp(lse - lse*)`` (without a tail: the softmax mass of the keys
read; with one: the estimated over the true denominator, 1 = the true one, may exceed 1); keys read per
query (``stats["keys_read_per_query"]``, samples included); step latency p50/p99 (ms).

Writes ``benchmarks/results/cache-tail.json`` and ``cache-tail.md`` (``--out`` chooses the path).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from sparseattn.tools.args import OneLineParser, int_arg, nonnegative_int

HERE = Path(__file__).resolve().parent
TRACE_DIR = Path(os.path.expanduser("~/.cache/sparseattn/traces"))


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def configs() -> list[tuple[str, dict]]:
    """(label, attend kwargs) of every configuration."""
    import sparseattn as sa

    out: list[tuple[str, dict]] = [("topk k=64", {"selector": "topk", "k": 64})]
    tails = {"topk": [("topk k=32", {"selector": "topk", "k": 32}, 32),
                      ("topk k=16", {"selector": "topk", "k": 16}, 48)],
             "cluster": [("cluster", {}, 64), ("cluster", {}, 256)],
             "window": [("window", {"selector": "window"}, 64)]}
    for base in ("topk", "cluster", "window"):
        if base == "cluster":
            out.append(("cluster", {}))
        if base == "window":
            out.append(("window", {"selector": "window"}))
        for label, akw, m in tails[base]:
            for shrink in (0, 64):
                out.append((f"{label} + tail {m} shrink {shrink}", {**akw, "tail": sa.Tail(m, shrink=shrink)}))
    return out


def exact(cache, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 exact attention of q (H, E) over every key in ``cache``: out (H, Ev), lse (H,)."""
    H = q.shape[0]
    rep = H // cache.num_kv_heads
    view = cache.debug_view()
    out = np.empty((H, cache.value_dim))
    lse = np.empty(H)
    for h in range(H):
        g = h // rep
        s = view["keys"][g].astype(np.float64) @ q[h].astype(np.float64) * cache.scale
        m = s.max()
        w = np.exp(s - m)
        out[h] = w @ view["values"][g].astype(np.float64) / w.sum()
        lse[h] = m + np.log(w.sum())
    return out, lse


def run(steps: int, segment: int, seed: int) -> dict:
    import sparseattn as sa
    from sparseattn.cache import KVCache, Layout
    from sparseattn.threads import single_threaded_blas

    t = sa.data.load("store65k", data_dir=str(TRACE_DIR), dtype=np.float32)
    nk = t.k.shape[1]
    n = nk - steps
    rng = np.random.default_rng(seed)
    qi = rng.choice(t.q.shape[1], steps, replace=False)
    K, V = np.ascontiguousarray(t.k), np.ascontiguousarray(t.v)
    Q = np.ascontiguousarray(t.q[:, qi])
    H, E = Q.shape[0], K.shape[2]
    cache = KVCache(H, E, num_kv_heads=K.shape[0], selector="cluster", layout=Layout(segment=segment))
    t0 = time.perf_counter()
    cache.append(K[:, :n], V[:, :n])
    cache.reserve(steps)
    log(f"prefill n={n}: {time.perf_counter() - t0:.1f} s")
    specs = configs()
    for _, akw in specs:  # warm-up (JIT)
        cache.attend(Q[:, :1], **akw)
    acc = {label: {"rel_err": [], "mass": [], "read": [], "ms": []} for label, _ in specs}
    for s in range(steps):
        cache.append(K[:, n + s:n + s + 1], V[:, n + s:n + s + 1])
        q = np.ascontiguousarray(Q[:, s])
        outs = {}
        for label, akw in specs:
            t0 = time.perf_counter()
            o, lse = cache.attend(q[:, None], return_lse=True, **akw)
            acc[label]["ms"].append(1e3 * (time.perf_counter() - t0))
            outs[label] = (o[:, 0].astype(np.float64), lse[:, 0].astype(np.float64),
                           cache.stats["keys_read_per_query"])
        with single_threaded_blas():
            ref, ref_lse = exact(cache, q)
        for label, (o, lse, read) in outs.items():
            a = acc[label]
            a["rel_err"].append(float(np.mean(np.linalg.norm(o - ref, axis=1) / np.linalg.norm(ref, axis=1))))
            a["mass"].append(float(np.mean(np.exp(lse - ref_lse))))
            a["read"].append(float(read))
    rows = {}
    for label, a in acc.items():
        rows[label] = {"rel_err": float(np.mean(a["rel_err"])), "rel_err_p99": float(np.percentile(a["rel_err"], 99)),
                       "mass": float(np.mean(a["mass"])), "keys_read": float(np.mean(a["read"])),
                       "read_fraction": float(np.mean(a["read"])) / (n + steps),
                       "p50_ms": float(np.median(a["ms"])), "p99_ms": float(np.percentile(a["ms"], 99))}
        r = rows[label]
        log(f"  {label:>30}: err {r['rel_err']:.3e} mass {r['mass']:.4f} read {r['keys_read']:.0f} "
            f"p50 {r['p50_ms']:.3f} ms")
    return {"trace": "store65k", "heads": H, "kv_heads": K.shape[0], "dim": E, "n": n + steps, "steps": steps,
            "segment": segment, "query_seed": seed, "configs": rows}


def write_report(path: Path, meta: dict, res: dict) -> None:
    lines = ["# KVCache tail estimate (store65k trace)", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['machine']}; numba threads {meta['numba_threads']}; {res['steps']} decode steps, cache of "
             f"{res['n']:,} keys at the last step, {res['heads']} heads, E = {res['dim']}, segment "
             f"{res['segment']}.", "",
             "rel. error: mean over heads and steps of ||o - o*|| / ||o*|| against float64 exact attention "
             "over every key; mass: mean exp(lse - lse*) (plain: softmax mass read; with a tail: estimated "
             "over true denominator); keys read per query include the tail samples.", "",
             "| config | rel. error | rel. error p99 | mass | keys read / query | read % | p50 ms | p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in res["configs"].items():
        lines.append(f"| {label} | {r['rel_err']:.3e} | {r['rel_err_p99']:.3e} | {r['mass']:.4f} | "
                     f"{r['keys_read']:.0f} | {100 * r['read_fraction']:.2f} | {r['p50_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int_arg(1, 4096), default=32, help="decode steps (1-4096), default 32")
    ap.add_argument("--segment", type=int, default=4096, help="KVCache segment (multiple of 16), default 4096")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="seed choosing the held-out queries, default 0")
    ap.add_argument("--out", default=str(HERE / "results" / "cache-tail.json"),
                    help="JSON output path (the .md goes next to it)")
    args = ap.parse_args(argv)
    if args.segment < 16 or args.segment % 16:
        ap.error(f"--segment must be a positive multiple of 16 (the page size); got {args.segment}.")
    out = Path(args.out)
    if out.suffix != ".json":
        ap.error(f"--out must end in .json; got {args.out}.")
    if not (TRACE_DIR / "manifest.json").is_file():
        ap.error(f"the store65k trace is missing: expected {TRACE_DIR / 'manifest.json'} (see sparseattn.data).")
    import numba

    meta = {"command": " ".join(["python", "benchmarks/bench_cache_tail.py", *sys.argv[1:]]
                                if argv is None else ["python", "benchmarks/bench_cache_tail.py", *argv]),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
            "numba_threads": numba.get_num_threads()}
    res = run(args.steps, args.segment, args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "result": res}, indent=1) + "\n")
    write_report(out.with_suffix(".md"), meta, res)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
