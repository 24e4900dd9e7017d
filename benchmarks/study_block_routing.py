"""Study: how many keys per query block-mode cluster routing must read for recall@64 >= 0.9, by cluster
granularity and routing rule, on real and clustered keys.

A scratch study (numpy on top of :class:`sparseattn.index.cluster.ClusterIndex`), not library code, and
no timing: it counts keys.  For each workload group (head) and each cluster count C (multiples of the
default ``round(sqrt(S))``), the index is built as block mode builds it (spherical k-means of the centred
keys, clusters represented by the mean of their keys), the exact top-64 of ``--queries`` evenly spaced
queries is found in float64, and the clusters are ranked per query by:

* ``mean``: ``q . mu_c`` (block mode's routing today);
* ``spread a``: ``q . mu_c + a |q| sigma_c`` with ``sigma_c`` the root mean per-dimension variance of the
  cluster's keys (an isotropic bound term: a cluster whose keys spread widely can hold a key far along q
  although its mean scores low);
* ``oracle``: by how many of the query's true top-64 each cluster holds (no router can do better with
  these clusters; it reads the true top-64).

For P = 1 .. C probes the recall@64 of the keys in the first P clusters and the keys read per query are
recorded (up to a quarter of the keys); the table gives, per (group, C, rule), the keys per query at the first P whose recall reaches
0.9 (0.95), as a share of the keys.  The speed of block mode is about proportional to the keys read at a
fixed C (its per-cluster GEMMs), plus costs that grow with C and P (k-means, routing, one partial per
(query, cluster) pair merged per query): see ``benchmarks/results/block-profile.md`` for those.

Run: ``python benchmarks/study_block_routing.py --data store store65k@~/.cache/sparseattn/traces
synthetic:n=65536,d=64,kind=clustered,seed=0`` (a few minutes); writes
``benchmarks/results/block-routing-study.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from sparseattn.index.cluster import ClusterIndex
from sparseattn.tools import bench
from sparseattn.tools.args import OneLineParser, positive_int

HERE = Path(__file__).resolve().parent
K_TOP = 64
TARGETS = (0.9, 0.95)
SPREADS = (1.0, 1.5)
MAX_SHARE = 0.25  # curves are kept up to this share of the keys read


def group_curves(keys: np.ndarray, queries: np.ndarray, factor: int) -> dict[str, dict]:
    """Recall@64 and keys read per query for P = 1 .. C probes under each rule, C = factor * sqrt(S)."""
    S, E = keys.shape
    C = int(min(max(round(float(np.sqrt(S))) * factor, 1), S))
    index = ClusterIndex(n_clusters=C).build(keys)
    C = index.n_clusters_
    kptr, perm = index.cluster_ptr_, index.perm_
    label = np.empty(S, np.int64)
    for c in range(C):
        label[perm[kptr[c]:kptr[c + 1]]] = c
    count = np.diff(kptr)
    centred = (keys[perm] - index.mean_).astype(np.float64)
    mu = np.zeros((C, E))
    sigma = np.zeros(C)
    for c in range(C):
        if count[c]:
            block = centred[kptr[c]:kptr[c + 1]]
            mu[c] = block.mean(axis=0)
            sigma[c] = np.sqrt(block.var(axis=0).mean())
    q = queries.astype(np.float64)
    scores = q @ keys.astype(np.float64).T
    top = np.argpartition(-scores, K_TOP, axis=1)[:, :K_TOP]
    hits = np.zeros((q.shape[0], C))
    np.add.at(hits, (np.repeat(np.arange(q.shape[0]), K_TOP), label[top].ravel()), 1.0)
    base = q @ mu.T
    qn = np.sqrt((q * q).sum(axis=1, keepdims=True))
    rules = {"mean": base}
    for a in SPREADS:
        rules[f"spread {a:g}"] = base + a * qn * sigma[None, :]
    rules["oracle"] = hits + 1e-9 * base  # ties among equal counts broken by the mean score
    out = {}
    for name, rank in rules.items():
        order = np.argsort(-rank, axis=1, kind="stable")
        recall = np.cumsum(np.take_along_axis(hits, order, axis=1), axis=1).mean(axis=0) / K_TOP
        keys_read = np.cumsum(count[order], axis=1).mean(axis=0)
        n = int(np.searchsorted(keys_read, MAX_SHARE * S)) + 1  # the curve up to a quarter of the keys
        out[name] = {"recall": recall[:n].round(5).tolist(), "keys": keys_read[:n].round(1).tolist()}
    return {"C": C, "S": S, "default_probes": min(8, C), "rules": out}


def first_reaching(curve: dict, target: float) -> tuple[int, float] | None:
    """(probes, keys per query) at the first P whose recall reaches ``target``; None if none does."""
    for p, (r, k) in enumerate(zip(curve["recall"], curve["keys"], strict=True)):
        if r >= target - 1e-12:
            return p + 1, k
    return None


def write_md(result: dict, path: Path) -> None:
    lines = [f"Command: `{result['command']}` ({result['created']}).", "",
             "Keys read per query (and share of the keys) at the first probe count whose recall@64 reaches the "
             "target; `-` = not reached.  Block mode's default is the first C of each group (round(sqrt(S))) "
             "with 8 probes and the `mean` rule: its recall@64 is in the `8 probes` column.", ""]
    for d in result["data"]:
        lines += [f"## {d['data']}", "",
                  "| group | C (keys/cluster) | rule | 8 probes: recall@64, keys/q | "
                  + " | ".join(f"recall {t:g}: P, keys/q (share)" for t in TARGETS) + " |",
                  "|---|---|---|---|" + "---|" * len(TARGETS)]
        for g in d["groups"]:
            for cur in g["curves"]:
                S, C = cur["S"], cur["C"]
                for name, curve in cur["rules"].items():
                    p = min(cur["default_probes"], C)
                    at_default = f"{curve['recall'][p - 1]:.3f}, {curve['keys'][p - 1]:,.0f}"
                    cells = []
                    for t in TARGETS:
                        hit = first_reaching(curve, t)
                        cells.append("-" if hit is None else f"{hit[0]}, {hit[1]:,.0f} ({hit[1] / S:.1%})")
                    lines.append(f"| {g['group']} | {C} ({S / C:.0f}) | {name} | {at_default} | "
                                 + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Queries per group: {result['queries']} (evenly spaced); exact top-64 in float64.")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=["store"])
    ap.add_argument("--factors", default="1,2,4", help="cluster counts as multiples of round(sqrt(S))")
    ap.add_argument("--queries", type=positive_int, default=1024)
    ap.add_argument("--max-groups", type=positive_int, default=4)
    ap.add_argument("--out", default=str(HERE / "results" / "block-routing-study"))
    args = ap.parse_args()
    try:
        factors = [int(x) for x in args.factors.split(",")]
        if not factors or min(factors) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--factors must be a comma list of positive integers; got {args.factors!r}")
    result = {"command": "python benchmarks/study_block_routing.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
        if k != "out"), "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "queries": args.queries, "data": []}
    for spec in args.data:
        wl = bench.load_workload(spec, max_groups=args.max_groups)
        groups = []
        for gi in range(wl.k.shape[0]):
            keys = np.ascontiguousarray(wl.k[gi], np.float32)
            qs = wl.q[gi]
            pick = np.linspace(0, qs.shape[0] - 1, min(args.queries, qs.shape[0])).round().astype(int)
            curves = [group_curves(keys, np.asarray(qs[pick], np.float32), f) for f in factors]
            groups.append({"group": gi, "curves": curves})
            print(f"{spec} group {gi}: done", flush=True)
        result["data"].append({"data": wl.description, "groups": groups})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result) + "\n", encoding="utf-8")
    write_md(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
