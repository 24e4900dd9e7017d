"""Tail estimate on real attention: output error at equal keys read, with and without ``tail=``.

Run:  python benchmarks/bench_tail.py [--queries 512] [--stores store,store65k@~/.cache/sparseattn/traces]

For every head of each real MiniLM key store (the shipped 16,384-key ``store``; a generated 65,536-key
store if present, made by ``sparseattn trace store --n-keys 65536 --n-queries 65536 --heads 0,5 --name
store65k --out ~/.cache/sparseattn/traces``), ``--queries`` evenly spaced queries attend (non-causal, the
traces' scale) through ``sparse_attention`` with a selector and ``tail=`` samples (``sparseattn.Tail(samples, shrink=...)``).  Reported per (store,
head, selector, k, samples): keys read per query (selected + sampled), mean output relative error
``|o - o_ref| / |o_ref|`` against float64 dense attention, the softmax mass the *selected* keys hold, and
the median wall time of 3 calls.  Results: ``results/tail.json`` and ``results/tail.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

import sparseattn as sa
from sparseattn.tools.args import OneLineParser, positive_int
from sparseattn.tools.bench import iter_workloads

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = [  # (selector, k, tail samples, shrink)
    ("topk", 64, None, 0), ("topk", 32, 32, 0), ("topk", 32, 32, 64), ("topk", 16, 48, 64),
    ("topk", 128, None, 0), ("topk", 64, 64, 0), ("topk", 64, 64, 64),
    ("topk", 256, None, 0), ("topk", 64, 192, 0), ("topk", 64, 192, 64), ("topk", 128, 128, 64),
    ("window+sinks", 64, None, 0), ("window+sinks", 32, 32, 0), ("window+sinks", 32, 32, 64),
]


def _dense64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    s = q @ k.T * scale
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    den = w.sum(axis=1, keepdims=True)
    return (w @ v) / den, m[:, 0] + np.log(den[:, 0])


def _mass(q: np.ndarray, k: np.ndarray, scale: float, lse: np.ndarray, pattern: sa.SparsePattern) -> float:
    kept = []
    for i in range(q.shape[0]):
        ids = pattern.row(i)
        kept.append(np.exp(q[i] @ k[ids].T * scale - lse[i]).sum())
    return float(np.mean(kept))


def run(stores: list[str], n_queries: int, repeats: int) -> list[dict]:
    rows = []
    for _, name, tr in iter_workloads(stores):  # "store", "window" or "NAME@DIR"; q, k, v (heads, n, E)
        scale = float(tr.scale) if tr.scale is not None else tr.k.shape[-1] ** -0.5
        for h in range(tr.k.shape[0]):
            sel = np.linspace(0, tr.q.shape[1] - 1, n_queries).astype(np.int64)
            q = np.ascontiguousarray(tr.q[h, sel], np.float32)
            k = np.ascontiguousarray(tr.k[h], np.float32)
            v = np.ascontiguousarray(tr.v[h], np.float32)
            ref, ref_lse = _dense64(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale)
            for spec, kk, m, shrink in CONFIGS:
                tail = None if m is None else sa.Tail(m, seed=0, shrink=shrink)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    res = sa.sparse_attention_result(q, k, v, spec, k=kk, scale=scale, tail=tail)
                    times.append(time.perf_counter() - t0)
                err = np.linalg.norm(res.output - ref, axis=1) / np.linalg.norm(ref, axis=1)
                pat = res.patterns[0]
                read = pat.nnz + (res.tail_patterns[0].nnz if res.tail_patterns else 0)
                row = {"store": name.split("@")[0], "n_keys": int(k.shape[0]), "head": h, "selector": spec,
                       "k": kk, "tail": m, "shrink": shrink, "keys_read": read / q.shape[0], "rel_error": float(err.mean()),
                       "mass_selected": _mass(q.astype(np.float64), k.astype(np.float64), scale, ref_lse, pat),
                       "seconds": statistics.median(times)}
                rows.append(row)
                print(f"{row['store']:>9} h{h} {spec:>12} k={kk:<4} tail={m!s:<5} shrink={shrink:<3} read={row['keys_read']:7.1f} "
                      f"err={row['rel_error']:.3f} mass={row['mass_selected']:.3f} t={row['seconds']:.3f}s",
                      flush=True)
    return rows


def write(rows: list[dict], out: str, cmd: str) -> None:
    with open(out + ".json", "w") as f:
        json.dump({"command": cmd, "rows": rows}, f, indent=1)
    lines = [f"Tail estimate on real keys (`{cmd}`): mean output relative error vs float64 dense; keys read = "
             "selected + sampled per query; mass = softmax mass of the selected keys.", "",
             "| store | keys | head | selector | k | tail | shrink | keys read | rel. error | mass selected | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['store']} | {r['n_keys']:,} | {r['head']} | {r['selector']} | {r['k']} | "
                     f"{r['tail'] or '-'} | {r['shrink'] if r['tail'] else '-'} | {r['keys_read']:.0f} | {r['rel_error']:.3f} | {r['mass_selected']:.3f} | "
                     f"{r['seconds']:.3f} |")
    # equal keys read: plain top-k vs top-k with a tail
    lines += ["", "Equal keys read (error with tail / error without, per store and head):", "",
              "| store | head | selector | keys read | plain error | tail config | tail error | ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["tail"] is not None:
            continue
        for t in rows:
            if (t["store"], t["head"], t["selector"]) == (r["store"], r["head"], r["selector"]) and \
                    t["tail"] is not None and t["k"] + t["tail"] == r["k"]:
                lines.append(f"| {r['store']} | {r['head']} | {r['selector']} | {r['k']} | {r['rel_error']:.3f} | "
                             f"k={t['k']}+{t['tail']} shrink {t['shrink']} | {t['rel_error']:.3f} | "
                             f"{t['rel_error'] / r['rel_error']:.2f} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=positive_int, default=512, help="queries per head (evenly spaced)")
    ap.add_argument("--stores", default="store,store65k@~/.cache/sparseattn/traces")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tail"))
    args = ap.parse_args()
    if not [s for s in args.stores.split(",") if s.strip()]:
        ap.error("--stores must name at least one store, e.g. store or store65k@~/.cache/sparseattn/traces")
    cmd = f"python benchmarks/bench_tail.py --queries {args.queries} --stores {args.stores}"
    rows = run(args.stores.split(","), args.queries, args.repeats)
    write(rows, args.out, cmd)
    print(f"wrote {args.out}.json, {args.out}.md")


if __name__ == "__main__":
    main()
