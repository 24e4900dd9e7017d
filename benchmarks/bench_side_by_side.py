"""This tree against another git revision, side by side on the same machine in one run.

Run:  python benchmarks/bench_side_by_side.py --base REV [--head REV] [--repeats 7] [--rounds 2] [--quick]
      [--only TEXT]

Why: a refactor must not cost speed, and two runs of the same code on this VM differ by 10-20 %, so a
before/after ratio is only honest when both sides are timed in one run, alternating.  The base
revision is checked out into a temporary git worktree; every case runs in fresh worker processes
(``PYTHONPATH`` = that tree or this one), base and head alternating (ABAB... over ``--rounds``), each
worker warming up once (Numba compile/cache load) and then timing ``--repeats`` calls.  Inputs are made
once by this process and shared as ``.npy`` files, so both sides read the same bytes.  Only public
calls that both revisions accept are timed: ``sparse_attention(q, k, v, pattern_or_spec, k=64,
is_causal=...)``, ``scaled_dot_product_attention(q, k, v, is_causal=...)`` and one decode step
``KVCache(num_heads=8, head_dim=64, selector=..., ...).attend(q)`` over a cache filled by ``append``.

Reported per case: the median of all timings per side, the spread (min-max of the per-worker medians)
and head / base.  Results: ``results/side-by-side-<base>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_WORKER = r"""
import json, sys, time
import numpy as np
import sparseattn as sa
d = sys.argv[1]
case = json.loads(sys.argv[2])
repeats = int(sys.argv[3])
q, k, v = (np.load(f"{d}/{n}.npy") for n in "qkv")
op = case["op"]
causal = case["causal"]
if op == "sparse-spec":
    def run():
        return sa.sparse_attention(q, k, v, case["spec"], k=64, is_causal=causal)
elif op == "sparse-random":
    L, S = q.shape[0], k.shape[0]
    rng = np.random.default_rng(0)
    ids = np.sort(rng.random((L, S)).argpartition(64, axis=1)[:, :64], axis=1) if S <= 8192 else \
        np.sort(np.stack([rng.choice(S, 64, replace=False) for _ in range(L)]), axis=1)
    pat = sa.SparsePattern.from_padded(ids, S)
    def run():
        return sa.sparse_attention(q, k, v, pat)
elif op == "sparse-window":
    pat = sa.SparsePattern.window(q.shape[0], k.shape[0], 64, is_causal=True)
    def run():
        return sa.sparse_attention(q, k, v, pat)
elif op == "decode":
    # one decode step of a KVCache holding the keys of every head (head h: the keys rolled by h * 997)
    H = 8
    K = np.stack([np.roll(k, h * 997, axis=0) for h in range(H)])
    V = np.stack([np.roll(v, h * 997, axis=0) for h in range(H)])
    try:  # grouped options where the revision has them; flat keywords before
        from sparseattn.cache import group_options
    except ImportError:
        group_options = dict
    cache = sa.KVCache(num_heads=H, head_dim=k.shape[1], **group_options(case["cache"]))
    cache.append(K, V)
    qs = np.stack([q[-1 - h] for h in range(H)])[:, None, :].astype(np.float32)
    def run():
        return cache.attend(qs)
elif op == "dense":
    def run():
        return sa.scaled_dot_product_attention(q, k, v, is_causal=causal)
else:
    raise SystemExit(f"unknown op {op}")
out = run()  # warm-up: compile or load the cache, first-touch the buffers
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "checksum": float(np.abs(np.asarray(out, np.float64)).sum())}))
"""


def _cases(quick: bool) -> list[dict]:
    syn = "synthetic:n={n},d=64,kind={kind},seed=0"
    block = "cluster:mode=block"
    out = [
        {"name": "cluster block 4,096 clustered", "data": syn.format(n=4096, kind="clustered"),
         "op": "sparse-spec", "spec": block, "causal": False},
        {"name": "cluster block 4,096 clustered causal", "data": syn.format(n=4096, kind="clustered"),
         "op": "sparse-spec", "spec": block, "causal": True},
        {"name": "cluster topk 4,096 clustered", "data": syn.format(n=4096, kind="clustered"),
         "op": "sparse-spec", "spec": "cluster", "causal": False},
        {"name": "topk 4,096 gaussian causal", "data": syn.format(n=4096, kind="gaussian"),
         "op": "sparse-spec", "spec": "topk", "causal": True},
        {"name": "faiss-hnsw 4,096 gaussian", "data": syn.format(n=4096, kind="gaussian"),
         "op": "sparse-spec", "spec": "faiss-hnsw", "causal": False},
        {"name": "angular-lsh 4,096 gaussian", "data": syn.format(n=4096, kind="gaussian"),
         "op": "sparse-spec", "spec": "angular-lsh", "causal": False},
        {"name": "random pattern k=64, 16,384", "data": syn.format(n=16384, kind="gaussian"),
         "op": "sparse-random", "causal": False},
        {"name": "window 64 causal, 16,384", "data": syn.format(n=16384, kind="gaussian"),
         "op": "sparse-window", "causal": True},
        {"name": "dense reference causal 4,096", "data": syn.format(n=4096, kind="gaussian"),
         "op": "dense", "causal": True},
    ]
    dec = syn.format(n=16384, kind="clustered")
    out += [
        {"name": "decode step 8x16,384 cluster f32", "data": dec, "op": "decode", "causal": False,
         "cache": {"selector": "cluster"}},
        {"name": "decode step 8x16,384 cluster top_p=0.9", "data": dec, "op": "decode", "causal": False,
         "cache": {"selector": "cluster", "top_p": 0.9}},
        {"name": "decode step 8x16,384 cluster float16", "data": dec, "op": "decode", "causal": False,
         "cache": {"selector": "cluster", "dtype": "float16"}},
        {"name": "decode step 8x16,384 cluster bfloat16", "data": dec, "op": "decode", "causal": False,
         "cache": {"selector": "cluster", "dtype": "bfloat16"}},
    ]
    if not quick:
        out += [
            {"name": "decode step 8x131,072 cluster f32", "data": syn.format(n=131072, kind="clustered"),
             "op": "decode", "causal": False, "cache": {"selector": "cluster"}},
            {"name": "cluster block 65,536 clustered", "data": syn.format(n=65536, kind="clustered"),
             "op": "sparse-spec", "spec": block, "causal": False},
            {"name": "cluster block 65,536 clustered causal", "data": syn.format(n=65536, kind="clustered"),
             "op": "sparse-spec", "spec": block, "causal": True},
            {"name": "random pattern k=64, 65,536", "data": syn.format(n=65536, kind="gaussian"),
             "op": "sparse-random", "causal": False},
        ]
    return out


def _worktree(rev: str, where: str, name: str = "base") -> str:
    path = os.path.join(where, name)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-f", path, rev], check=True,
                   capture_output=True)
    return path


def _worker(tree: str, data_dir: str, case: dict, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    res = subprocess.run([sys.executable, "-c", _WORKER, data_dir, json.dumps(case), str(repeats)],
                         env=env, capture_output=True, text=True, cwd=tree)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"rc {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    sys.path.insert(0, ROOT)  # this working tree's sparseattn, whatever is installed
    from sparseattn.tools.args import OneLineParser, positive_int

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare against (e.g. a commit id)")
    ap.add_argument("--repeats", type=positive_int, default=7, help="timed calls per worker process")
    ap.add_argument("--head", default=None,
                    help="git revision for the head side (default: this working tree, uncommitted changes included)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="worker processes per side (alternating)")
    ap.add_argument("--quick", action="store_true", help="only the n <= 16,384 cases")
    ap.add_argument("--only", default=None, help="only the cases whose name contains this text (e.g. 'cluster')")
    ap.add_argument("--out", default=None, help="output path without extension")
    args = ap.parse_args()
    from sparseattn import data as data_mod

    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base], check=True,
                         capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.head or "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = args.head is None and bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--",
                                                       "sparseattn"], capture_output=True, text=True).stdout.strip())
    out = args.out or os.path.join(HERE, "results", f"side-by-side-{rev}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = _worktree(args.base, tmp)
        head_tree = _worktree(args.head, tmp, "head") if args.head else ROOT
        try:
            for case in _cases(args.quick):
                if args.only and args.only not in case["name"]:
                    continue
                d = os.path.join(tmp, "inputs")
                os.makedirs(d, exist_ok=True)
                q, k, v = data_mod.synthetic(case["data"])
                for name, arr in zip("qkv", (q, k, v), strict=True):
                    np.save(os.path.join(d, f"{name}.npy"), np.ascontiguousarray(arr, np.float32))
                runs: dict[str, list[dict]] = {"base": [], "head": []}
                for _ in range(args.rounds):
                    for side, tree in (("base", base_tree), ("head", head_tree)):
                        runs[side].append(_worker(tree, d, case, args.repeats))
                row = {"case": case}
                for side in ("base", "head"):
                    errs = [r["error"] for r in runs[side] if "error" in r]
                    if errs:
                        row[side] = {"error": errs[0]}
                        continue
                    times = [t for r in runs[side] for t in r["times"]]
                    meds = [statistics.median(r["times"]) for r in runs[side]]
                    row[side] = {"median_s": statistics.median(times), "worker_medians_s": meds,
                                 "checksum": runs[side][0]["checksum"]}
                if "median_s" in row["base"] and "median_s" in row["head"]:
                    row["head_over_base"] = row["head"]["median_s"] / row["base"]["median_s"]
                rows.append(row)
                b, h = row["base"], row["head"]
                print(f"{case['name']:42s} base {b.get('median_s', float('nan')):.4f} s  head "
                      f"{h.get('median_s', float('nan')):.4f} s  head/base {row.get('head_over_base', float('nan')):.3f}"
                      + (f"  base error: {b['error']}" if "error" in b else "")
                      + (f"  head error: {h['error']}" if "error" in h else ""), flush=True)
        finally:
            for tree in {base_tree, head_tree} - {ROOT}:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = {"base": rev, "head": head, "head_has_uncommitted_changes": dirty, "repeats": args.repeats,
            "rounds": args.rounds, "cpu_count": os.cpu_count()}
    with open(out + ".json", "w") as f:
        json.dump({"schema": "sparseattn.side-by-side/1", "meta": meta, "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(f"Base {rev} vs head {head}{' (+ uncommitted changes)' if dirty else ''}: medians of "
                f"{args.rounds} x {args.repeats} calls per side, workers alternating; spread = min-max of "
                f"the per-worker medians.\n\n")
        f.write("| case | base s | base spread | head s | head spread | head / base |\n|---|---|---|---|---|---|\n")
        for row in rows:
            cells = []
            for side in ("base", "head"):
                s = row[side]
                if "error" in s:
                    cells += ["error", s["error"][:60]]
                else:
                    cells += [f"{s['median_s']:.4f}",
                              f"{min(s['worker_medians_s']):.4f}-{max(s['worker_medians_s']):.4f}"]
            ratio = row.get("head_over_base")
            tail = f" | {ratio:.3f} |\n" if ratio is not None else " | - |\n"
            f.write(f"| {row['case']['name']} | " + " | ".join(cells) + tail)
    print(f"wrote {out}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
