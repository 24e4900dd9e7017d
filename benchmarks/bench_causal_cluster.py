"""Strictly causal cluster routing (the causal index) against routing over one global index, on real
MiniLM keys.

Run:  python benchmarks/bench_causal_cluster.py [--repeats 3] [--rows 2048] [--skip-65k]

Data: the shipped 16,384-key store (heads 0-3, its 2,048 queries) and, when present, the 65,536-key store
``store65k`` in ``~/.cache/sparseattn/traces`` (heads 0 and 5, ``--rows`` of its queries).  Query i sits at
position ``round((i + 1) * S / L) - 1``: the queries are spread over the sequence, so prefixes of every
length from S / L to S occur.  Causal: key j is visible to query i iff j <= its position.

Per head, for ``cluster:mode=block`` (defaults: C = round(sqrt(S)), n_probe = 8):

* ``global``: ``ClusterSelector(mode="block", strict_causal=False)``: one ClusterIndex over all S keys,
  routed attention masked to each query's visible keys: which past keys a row reads depends on later keys
  (k-means, centring and routing vectors see them);
* ``causal``: ``ClusterSelector(mode="block").attend(..., is_causal=True)``: the strictly causal path, one
  :class:`~sparseattn.index.causal.CausalClusterIndex` (rows seeing at most its ``prefix_budget()`` keys
  exact, longer ones through the prefix index of their band, a codebook of keys they see);

and for ``cluster`` (top-k mode, k = 64) ``global`` (``ClusterIndex.search(..., is_causal=True)``) against the
selector's causal ``query`` (``causal``).  Reported: mean keys read per query, recall@64 of the exact
causal top-64 among them, mean output relative error against float64 dense causal attention, mean softmax
mass of the keys read (``exp(lse - lse*)``), and time (build + attend / query, median of ``--repeats``,
one process).

Results: ``results/causal-cluster.json`` and ``results/causal-cluster.md``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import sparseattn as sa
from sparseattn.index import ClusterIndex
from sparseattn.selectors.cluster import ClusterSelector
from sparseattn.tools.args import OneLineParser, positive_int

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def dense_causal(q, k, v, scale, qpos, chunk=256):
    """float64 causal attention: (out (L, Ev), lse (L,), exact top-64 ids (L, 64))."""
    L = q.shape[0]
    out = np.empty((L, v.shape[1]))
    lse = np.empty(L)
    top = np.empty((L, 64), dtype=np.int64)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for a in range(0, L, chunk):
        b = min(L, a + chunk)
        s = q[a:b].astype(np.float64) @ k64.T * scale
        s[np.arange(k.shape[0])[None, :] > qpos[a:b, None]] = -np.inf
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        z = w.sum(axis=1)
        out[a:b] = (w @ v64) / z[:, None]
        lse[a:b] = m[:, 0] + np.log(z)
        top[a:b] = np.argsort(-s, axis=1, kind="stable")[:, :64]
    return out, lse, top


def rel_err(o, ref):
    return float(np.mean(np.linalg.norm(o - ref, axis=1) / np.linalg.norm(ref, axis=1)))


def timed(fn, repeats):
    ts, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), res


def run_head(label, h, q, k, v, scale, repeats):
    q, k, v = (np.ascontiguousarray(x, dtype=np.float32) for x in (q, k, v))
    S, L = k.shape[0], q.shape[0]
    qpos = (np.round((np.arange(L) + 1) * S / L) - 1).astype(np.int64)
    ref, ref_lse, top = dense_causal(q, k, v, scale, qpos)
    rows = []

    def recall_of(pat):
        return float(np.mean([np.isin(top[i][:min(64, qpos[i] + 1)], pat.row(i)).mean() for i in range(L)]))

    def sel_block(strict):
        def run():
            sel = ClusterSelector(mode="block", strict_causal=strict).build(k)
            o, lse = sel.attend(q, v, scale=scale, is_causal=True, query_positions=qpos)
            return o, lse, sel.last_keys_read_, sel

        def pattern(sel):
            return sel.query(q, 64, is_causal=True, query_positions=qpos)
        return run, pattern

    def glob_topk():
        return ClusterIndex().build(k).search(q, 64, is_causal=True, query_positions=qpos)

    def causal_topk():
        return ClusterSelector().build(k).query(q, 64, is_causal=True, query_positions=qpos)

    block = {"global": sel_block(False), "causal": sel_block(True)}
    for name, (fn, pattern) in block.items():
        t, (o, lse, kr, obj) = timed(fn, repeats)
        rows.append({"store": label, "head": h, "mode": "block", "index": name, "keys_read": float(kr.mean()),
                     "rel_err": rel_err(o, ref), "mass": float(np.mean(np.exp(lse.astype(np.float64) - ref_lse))),
                     "recall64": recall_of(pattern(obj)), "time_s": t})
    for name, fn in (("global", glob_topk), ("causal", causal_topk)):
        t, pat = timed(fn, repeats)
        got = pat.to_padded(64)
        recall = float(np.mean([np.intersect1d(got[i][got[i] >= 0], top[i][top[i] <= qpos[i]]).size
                                / min(64, qpos[i] + 1) for i in range(L)]))
        o, lse = sa.sparse_attention(q, k, v, pat, scale=scale, is_causal=True, query_positions=qpos,
                                     return_lse=True)
        rows.append({"store": label, "head": h, "mode": "topk", "index": name, "keys_read": 64.0,
                     "rel_err": rel_err(o, ref), "mass": float(np.mean(np.exp(lse.astype(np.float64) - ref_lse))),
                     "recall64": recall, "time_s": t})
    for r in rows[-4:]:
        print(json.dumps(r), flush=True)
    return rows


def markdown(meta, rows):
    lines = ["# Strictly causal cluster routing: the causal index vs one global index", "",
             f"`{meta['command']}` ({meta['date']}; {meta['cores']} cores, load average at the end "
             f"{meta['load_end']:.1f}).", "",
             "Queries spread over the sequence (query i at position round((i+1) S / L) - 1), key j visible iff "
             "j <= that position. `global`: one k-means index over all S keys, masked to the visible keys "
             "(not strictly causal: the routing depends on later keys). `causal`: the selector's strictly causal "
             "path (rows seeing at most its prefix budget exact, longer ones through the prefix index of their "
             "band, a codebook of keys they see). Error: mean "
             "||o - o*|| / ||o*|| against float64 dense causal attention; mass: mean exp(lse - lse*); time: "
             "build + attend (block) or build + query (topk), median of "
             f"{meta['repeats']}.", "",
             "| store | head | mode | index | keys read | rel. error | mass | recall@64 | time s |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        rec = f"{r['recall64']:.3f}" if "recall64" in r else ""
        lines.append(f"| {r['store']} | {r['head']} | {r['mode']} | {r['index']} | {r['keys_read']:.0f} | "
                     f"{r['rel_err']:.4f} | {r['mass']:.3f} | {rec} | {r['time_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--rows", type=positive_int, default=2048, help="queries of the 65k store")
    ap.add_argument("--skip-65k", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "causal-cluster"))
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rows = []
    t16 = sa.data.load("store")
    for h in range(t16.q.shape[0]):
        rows += run_head("16k", int(t16.meta["heads"][h]), t16.q[h], t16.k[h], t16.v[h], t16.scale, args.repeats)
    d65 = os.path.expanduser("~/.cache/sparseattn/traces")
    if not args.skip_65k and os.path.exists(os.path.join(d65, "manifest.json")):
        t65 = sa.data.load("store65k", data_dir=d65)
        pick = np.linspace(0, t65.q.shape[1] - 1, args.rows).astype(np.int64)
        for h in range(t65.q.shape[0]):
            rows += run_head("65k", int(t65.meta["heads"][h]), np.ascontiguousarray(t65.q[h][pick]), t65.k[h],
                             t65.v[h], t65.scale, args.repeats)
    meta = {"command": "python benchmarks/bench_causal_cluster.py" + (" " + " ".join(argv) if argv else ""),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cores": os.cpu_count(),
            "load_end": os.getloadavg()[0], "repeats": args.repeats}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
