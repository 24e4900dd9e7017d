"""The cluster-routing selector against exact attention at the sizes issue 3 sets goals for.

Run:  python benchmarks/bench_cluster_goals.py [--repeats 3] [--skip-large] [--causal-only] [--real NAME@DIR]

Goals (end to end = build + select + attention, against torch SDPA measured in the same case):
>= 10x at n = 65,536 with recall@64 >= 0.9 on real keys; >= 30x at 262,144; faster than SDPA from 4,096.

Cases: synthetic clustered keys at n = 4,096, 16,384 and 65,536 (causal and not) and
262,144; norm-matched Gaussian keys at 65,536 (the adversarial case: no cluster structure); real MiniLM
keys from a 65,536-key trace when it exists (not shipped: ``sparseattn trace store --n-keys 65536
--n-queries 65536 --heads 0,5 --name store65k --out ~/.cache/sparseattn/traces``, 77 s).  Each case is
one :func:`sparseattn.tools.bench.compare` run: medians over ``--repeats``, recall and softmax mass on 2,048
evenly spaced query rows.  Results: ``results/cluster-goals.json`` (all numbers) and ``.md`` (table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from sparseattn.tools import bench
from sparseattn.tools.args import OneLineParser, positive_int

_SYN = "synthetic:n={n},d=64,kind={kind},seed=0"
_BLOCK = "cluster:mode=block"


def cases(real: str | None, skip_large: bool) -> list[dict]:
    out = [
        {"data": _SYN.format(n=4096, kind="clustered"), "causal": False, "probes": [None, 6]},
        {"data": _SYN.format(n=4096, kind="clustered"), "causal": True, "probes": [None, 6]},
        {"data": _SYN.format(n=16384, kind="clustered"), "causal": False, "probes": [None, 6]},
        {"data": _SYN.format(n=16384, kind="clustered"), "causal": True, "probes": [None, 6]},
        {"data": _SYN.format(n=65536, kind="clustered"), "causal": False, "probes": [None, 6, 4]},
        {"data": _SYN.format(n=65536, kind="clustered"), "causal": True, "probes": [None, 6]},
        {"data": _SYN.format(n=65536, kind="gaussian"), "causal": False, "probes": [None, 32]},
    ]
    if real:
        out.insert(0, {"data": real, "causal": False, "probes": [None, 9, 10, 12], "max_groups": 1})
    if not skip_large:
        out.append({"data": _SYN.format(n=262144, kind="clustered"), "causal": False, "probes": [None, 6, 4]})
    return out


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--skip-large", action="store_true", help="skip n = 262,144 (SDPA alone takes ~80 s)")
    default_real = os.path.expanduser("~/.cache/sparseattn/traces")
    ap.add_argument("--real", default=f"store65k@{default_real}",
                    help="real-key trace NAME@DIR (skipped when its manifest is missing)")
    ap.add_argument("--causal-only", action="store_true", help="only the causal cases")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cluster-goals"))
    args = ap.parse_args()
    real = args.real
    if real and not os.path.exists(os.path.join(real.partition("@")[2], "manifest.json")):
        print(f"real trace {real!r} not found: skipped (see this script's docstring to generate it)")
        real = None
    results = []
    for case in cases(real, args.skip_large):
        if args.causal_only and not case["causal"]:
            continue
        specs = [_BLOCK if p is None else f"{_BLOCK},n_probe={p}" for p in case["probes"]]
        t0 = time.perf_counter()
        res = bench.compare(case["data"], specs, k=64, is_causal=case["causal"], repeats=args.repeats,
                            max_groups=case.get("max_groups"))
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        d = res["dense"]
        print(f"{case['data']} causal={case['causal']}: SDPA {d.get('sdpa_s', float('nan')):.3f} s, "
              f"dense {d['dense_s']:.3f} s", flush=True)
        for row in res["results"]:
            if "error" in row:
                print(f"  {row['selector']}: error {row['error']}")
                continue
            q = row["quality"]
            print(f"  {row['selector'][:40]:40s} {row['total_s']:.4f} s  {row.get('speedup_vs_sdpa') or 0:6.2f}x SDPA"
                  f"  recall {q['recall_mean']:.3f}  mass {q['mass_recall_mean']:.3f}  keys/q "
                  f"{row['keys_per_query']:.0f}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"schema": "sparseattn.cluster-goals/1", "cases": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("| data | causal | SDPA s | selector | keys/q | total s | x SDPA | recall@64 | mass |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for res in results:
            for row in res["results"]:
                if "error" in row:
                    continue
                q = row["quality"]
                f.write(f"| {res['data'].split('@')[0].replace('synthetic:', '')} | {res['is_causal']} | "
                        f"{res['dense'].get('sdpa_s', float('nan')):.3f} | {row['selector'].split(',n_iter')[0]} | "
                        f"{row['keys_per_query']:.0f} | {row['total_s']:.4f} | {row.get('speedup_vs_sdpa') or 0:.2f} | "
                        f"{q['recall_mean']:.3f} | {q['mass_recall_mean']:.3f} |\n")
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    sys.exit(main())
