"""Decode recall harness: does each KVCache setting read the keys that carry the attention, and at what speed?

Run:  python benchmarks/bench_decode_recall.py [--lengths 16384,65536,131072,262144] [--heads 8]
          [--workloads passkey-clustered,passkey-gaussian,passkey-real,clustered] [--queries 16]
          [--settings default,top_p,estimate,n_probe,hnsw,topk] [--heads-1m 1] [--hnsw-max 65536]

Workloads (H heads, d = 64; ``passkey-real``: d = 32, the shipped MiniLM store's 16,384 keys per head, its
4 heads, so only n = 16,384 and H <= 4):

* ``passkey-<bg>``: :func:`sparseattn.data.passkey` with ``n_planted`` (default 4) keys per query planted
  anywhere in the cache (depth 0-100 %), holding >= 0.5 of the query's float64 softmax mass, over a
  ``clustered``, norm-matched ``gaussian`` or ``real`` background;
* ``clustered``: :func:`sparseattn.data.clustered` keys and its own queries (no planted keys).

For each workload and length the keys and values are appended to a fresh cache per setting (public API
only: ``KVCache(...)``, ``append``, ``attend``, ``selected_slots``, ``stats``), then each decode query (one
per head) is attended; in the same loop, timed back to back: the setting's ``attend`` and torch's
``scaled_dot_product_attention`` on (1, H, 1, d) / (1, H, n, d) tensors over the same keys and values.

Accuracy, per query and head (the oracle: :func:`oracle`, float64 attention over every key):

* planted recall: the share of the query's planted keys among the slots the step reads (``selected_slots``);
  the planted keys' slots are the cache's exact top-``n_planted`` slots (``selected_slots(...,
  selector="topk")``), which the harness checks hold the planted keys by their scores;
* recall@64: the share of the exact top-64 slots (``selected_slots(..., k=64, selector="topk")``) read;
* mass: ``exp(lse - lse*)`` of the step's log-sum-exp against the oracle's (with ``estimate`` it counts the
  estimated clusters too, marked);
* output error ``||o - o*|| / ||o*||`` against float64 dense, next to the error of exact top-64 attention
  (float64) and their ratio;
* keys read per step (``stats["keys_read_per_query"]``), index bytes / KV bytes, append us per token.

Settings: ``default`` (``KVCache(num_heads, head_dim)``: the ``sketch`` selector; the sign codes of every
clustered key scanned, the best 3 % re-ranked by their 4-bit codes, the best 1/128 of those (at least 1,024)
read exactly), ``sketch-1pct`` (``selector="sketch:fraction=0.01"``: 1 % read exactly), ``sketch-lean``
(``selector="sketch:candidates=1024,shortlist=0.01"``: 1 % re-ranked, 1,024 read), ``sketch-seg1024`` (the
default with ``Layout(segment=1024)``: segments of 1,024 keys, so the exact tail stays below 512 + window
keys instead of 2,048 + window), ``cluster`` (``selector="cluster"``: whole clusters by their mean key,
32 probes), ``top_p`` / ``estimate`` / ``n_probe`` (``cluster`` with ``top_p=0.9``, ``estimate=32``,
``n_probe=128``), ``hnsw`` (``selector="faiss-hnsw:M=16"``, lengths up to ``--hnsw-max``, default 65,536: its
build took ~1 ms per key and head on the shared machine), ``topk`` (``selector="topk"``: exact top-64, reads
every key).

``--gqa R``: ``R`` query heads per kv head (``--heads`` then counts kv heads); torch SDPA runs with
``enable_gqa=True`` on the same tensors.

1,048,576 keys (when listed) runs with ``--heads-1m`` heads (default 1): 8 heads of float32 K and V are
4 GB before the cache's own copy.  Timing is indicative: the machine is shared; ratios are of medians taken
in one loop.  Writes benchmarks/results/decode-recall.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

import sparseattn  # noqa: F401  (before torch: it makes idle OpenMP threads sleep, not spin, in torch's pool too)

HERE = Path(__file__).resolve().parent
PAUSE = 0.002  # seconds between the timed calls (see run_case)
WORKLOADS = ("passkey-clustered", "passkey-gaussian", "passkey-real", "clustered")
SETTINGS = {
    "default": {},
    "sketch-1pct": {"selector": "sketch:fraction=0.01"},
    "sketch-lean": {"selector": "sketch:candidates=1024,shortlist=0.01"},
    "sketch-seg1024": {"selector": "sketch", "segment": 1024},
    "cluster": {"selector": "cluster"},
    "top_p": {"selector": "cluster", "top_p": 0.9},
    "estimate": {"selector": "cluster", "estimate": 32},
    "n_probe": {"selector": "cluster", "n_probe": 128},
    "hnsw": {"selector": "faiss-hnsw:M=16"},
    "topk": {"selector": "topk"},
}
LABELS = {"default": "default (sketch)", "sketch-1pct": "sketch:fraction=0.01",
          "sketch-lean": "sketch:candidates=1024,shortlist=0.01", "sketch-seg1024": "sketch, segment=1024",
          "cluster": "cluster",
          "top_p": "cluster, top_p=0.9", "estimate": "cluster, estimate=32", "n_probe": "cluster, n_probe=128",
          "hnsw": "faiss-hnsw:M=16", "topk": "topk (exact top-64)"}
REAL_N = 16384


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"bench_decode_recall: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _fail(msg: str) -> None:
    print(f"bench_decode_recall: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        _fail(f"{flag} must be a comma list of positive integers; got {text!r}")
    return out


def _names(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if not out or bad:
        _fail(f"{flag} must be a comma list of {', '.join(allowed)}; got {text!r}")
    return out


# ------------------------------------------------------------------------------------------ data and oracle
def make_workload(kind: str, n: int, heads: int, nq: int, n_planted: int, seed: int) -> dict:
    """keys (H, n, d), values (H, n, d), queries (H, nq, d), planted positions (H, nq, n_planted) or None."""
    from sparseattn import data

    if kind == "clustered":
        K = np.empty((heads, n, 64), np.float32)
        V = np.empty_like(K)
        Q = np.empty((heads, nq, 64), np.float32)
        for h in range(heads):
            Q[h], K[h], V[h] = data.clustered(n, 64, n_queries=nq, seed=seed + h)
        return {"k": K, "v": V, "q": Q, "planted": None, "scale": 1 / 8.0}
    if kind == "passkey-real":
        store = data.load("store", dtype="float32")
        bg = store.k[:heads, :n]
        w = data.passkey(n, bg.shape[-1], heads=heads, n_planted=n_planted, n_queries=nq, background=bg,
                         seed=seed)
    else:
        w = data.passkey(n, 64, heads=heads, n_planted=n_planted, n_queries=nq, background=kind.split("-")[1],
                         seed=seed)
    return {"k": w.keys, "v": w.values, "q": w.queries, "planted": w.positions, "scale": w.scale,
            "planted_mass": float(w.mass.mean())}


def oracle(K: np.ndarray, V: np.ndarray, q: np.ndarray, scale: float, rep: int = 1) -> dict:
    """float64 attention of one query per query head (H = rep x kv heads; head h reads kv head h // rep) over
    every key: output (H, dv), lse (H,), the exact top-64 attention's output (H, dv), and the top-n scores'
    positions in descending order (H, 64)."""
    H = q.shape[0]
    out = np.empty((H, V.shape[-1]))
    top_out = np.empty_like(out)
    lse = np.empty(H)
    order = np.empty((H, 64), np.int64)
    for h in range(H):
        Kh, Vh = K[h // rep], V[h // rep]
        s = Kh.astype(np.float64) @ q[h].astype(np.float64) * scale
        m = s.max()
        w = np.exp(s - m)
        z = w.sum()
        out[h] = w @ Vh.astype(np.float64) / z
        lse[h] = m + np.log(z)
        t = np.argpartition(-s, 64)[:64]
        t = t[np.argsort(-s[t], kind="stable")]
        order[h] = t
        wt = np.exp(s[t] - s[t].max())
        top_out[h] = wt @ Vh[t].astype(np.float64) / wt.sum()
    return {"out": out, "lse": lse, "top_out": top_out, "top": order}


# ------------------------------------------------------------------------------------------ one case
def run_case(kind: str, n: int, heads: int, nq: int, n_planted: int, settings: list[str], hnsw_max: int,
             seed: int, chunk: int = 8192, gqa: int = 1) -> dict:
    """One workload and length: every setting's cache filled, then ``nq`` decode steps measured.  With
    ``gqa`` > 1 the cache has ``heads`` kv heads and ``gqa x heads`` query heads (query head g x gqa + i of
    step t asks the generator's query t x gqa + i of kv head g)."""
    import torch

    from sparseattn.cache import KVCache, group_options

    t0 = time.perf_counter()
    wl = make_workload(kind, n, heads, nq * gqa, n_planted, seed)
    K, V, scale = wl["k"], wl["v"], wl["scale"]
    hq = heads * gqa
    # per step t: (hq, d) queries and (hq, n_planted) planted positions, query head h from kv head h // gqa
    Q = wl["q"].reshape(heads, nq, gqa, -1).transpose(0, 2, 1, 3).reshape(hq, nq, -1)
    planted = None if wl["planted"] is None else \
        wl["planted"].reshape(heads, nq, gqa, -1).transpose(0, 2, 1, 3).reshape(hq, nq, -1)
    d = K.shape[-1]
    log(f"{kind} n={n} H={hq} (kv {heads}): data {time.perf_counter() - t0:.1f}s")
    orc = [oracle(K, V, Q[:, t], scale, gqa) for t in range(nq)]
    if planted is not None:  # the planted keys are each query's exact top-n_planted (generator's margin)
        for t in range(nq):
            for h in range(hq):
                if set(orc[t]["top"][h, :n_planted]) != set(planted[h, t]):
                    raise RuntimeError(f"{kind} n={n}: the planted keys of query {t}, head {h} are not its "
                                       f"exact top-{n_planted}; the recall measurement would be wrong")
    kt, vt = torch.from_numpy(K)[None], torch.from_numpy(V)[None]
    res = {"workload": kind, "n": n, "heads": hq, "kv_heads": heads, "dim": d, "queries": nq,
           "n_planted": n_planted if planted is not None else None, "planted_mass": wl.get("planted_mass"),
           "top64_rel_err": float(np.mean([np.linalg.norm(o["top_out"] - o["out"], axis=1)
                                            / np.linalg.norm(o["out"], axis=1) for o in orc])),
           "settings": {}}
    for name in settings:
        kw = SETTINGS[name]
        if name == "hnsw" and n > hnsw_max:
            res["settings"][name] = {"skipped": f"n > --hnsw-max {hnsw_max}"}
            continue
        cache = KVCache(num_heads=hq, num_kv_heads=heads, head_dim=d, scale=scale, **group_options(kw))
        t0 = time.perf_counter()
        for a in range(0, n, chunk):
            cache.append(K[:, a:a + chunk], V[:, a:a + chunk])
        t_app = time.perf_counter() - t0
        akw = {"k": 64}
        cache.attend(Q[:, 0][:, None], **akw)  # warm-up (JIT)
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(Q[:, :1])[None], kt, vt,
                                                             enable_gqa=gqa > 1)
        ts, tt = [], []
        acc: dict[str, list[float]] = {"err": [], "mass": [], "recall64": [], "planted": [], "read": []}
        steps = []
        # first every timed pair, then the accuracy checks: the checks' exact scans (selected_slots with
        # "topk") run between two pairs slowed the next SDPA call by ~1.8x (19 -> 34 ms at 131,072 keys)
        for t in range(nq):
            q = np.ascontiguousarray(Q[:, t])
            qt = torch.from_numpy(q)[None, :, None, :]
            order = (t % 2 == 0)
            for first in (order, not order):  # the two timed calls back to back, order alternating
                time.sleep(PAUSE)  # the other runtime's idle threads asleep: neither call is slowed by the other
                if first:
                    a0 = time.perf_counter()
                    out, lse = cache.attend(q[:, None], return_lse=True, **akw)
                    ts.append(time.perf_counter() - a0)
                else:
                    a0 = time.perf_counter()
                    with torch.no_grad():
                        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa > 1)
                    tt.append(time.perf_counter() - a0)
            acc["read"].append(cache.stats["keys_read_per_query"])
            steps.append((q, out, lse))
        for t, (q, out, lse) in enumerate(steps):
            o = orc[t]
            out64 = out[:, 0].astype(np.float64)
            acc["err"].append(float(np.mean(np.linalg.norm(out64 - o["out"], axis=1)
                                            / np.linalg.norm(o["out"], axis=1))))
            acc["mass"].append(float(np.mean(np.exp(np.minimum(lse[:, 0].astype(np.float64) - o["lse"], 0.0)))))
            rec, pl = [], []
            for h in range(hq):
                sel = cache.selected_slots(q[h], h, **akw)
                top = cache.selected_slots(q[h], h, k=64, selector="topk")
                rec.append(np.isin(top, sel).mean())
                if planted is not None:
                    ps = cache.selected_slots(q[h], h, k=n_planted, selector="topk")
                    pl.append(np.isin(ps, sel).mean())
            acc["recall64"].append(float(np.mean(rec)))
            if pl:
                acc["planted"].append(float(np.mean(pl)))
        st = cache.stats
        r = {"label": LABELS[name], "kwargs": {k: str(v) for k, v in kw.items()},
             "rel_err": float(np.mean(acc["err"])), "rel_err_max": float(np.max(acc["err"])),
             "mass": float(np.mean(acc["mass"])), "mass_includes_estimates": bool(kw.get("estimate")),
             "recall64": float(np.mean(acc["recall64"])), "recall64_min": float(np.min(acc["recall64"])),
             "planted_recall": float(np.mean(acc["planted"])) if acc["planted"] else None,
             "planted_recall_min": float(np.min(acc["planted"])) if acc["planted"] else None,
             "keys_read": float(np.mean(acc["read"])), "read_fraction": float(np.mean(acc["read"])) / n,
             "p50_ms": 1e3 * float(np.median(ts)), "p99_ms": 1e3 * float(np.percentile(ts, 99)),
             "sdpa_p50_ms": 1e3 * float(np.median(tt)),
             "index_over_kv": st["index_nbytes"] / st["kv_nbytes"], "append_us_per_token": 1e6 * t_app / n}
        r["x_sdpa"] = r["sdpa_p50_ms"] / r["p50_ms"]
        r["err_over_top64"] = r["rel_err"] / res["top64_rel_err"]
        res["settings"][name] = r
        pr = "-" if r["planted_recall"] is None else f"{r['planted_recall']:.3f}"
        log(f"  {kind} n={n} {r['label']:>20}: planted {pr} recall@64 {r['recall64']:.3f} mass {r['mass']:.3f} "
            f"err {r['rel_err']:.3f} (top-64 {res['top64_rel_err']:.3f}) read {r['keys_read']:.0f} "
            f"p50 {r['p50_ms']:.2f} ms sdpa {r['sdpa_p50_ms']:.2f} ms x{r['x_sdpa']:.1f} "
            f"append {r['append_us_per_token']:.1f} us/tok")
        del cache
        gc.collect()
    return res


# ------------------------------------------------------------------------------------------ report
def write_md(path: Path, res: dict) -> None:
    L = ["# Decode recall: accuracy next to speed, per KVCache setting", "",
         f"Generated by `benchmarks/bench_decode_recall.py` ({res['date']}; {res['argv']}). d = 64 (real: 32), "
         "float32. Timing is indicative only: a shared 2-core machine; `x SDPA` is the ratio of medians of "
         "the setting's `attend` and torch SDPA's decode step timed back to back in one loop. Planted recall "
         "and recall@64 are the shares of the query's planted keys / exact top-64 slots that the step reads; "
         "`err` is the output error against float64 dense attention, `top-64 err` that of exact top-64 "
         "attention (float64) on the same queries. Mass marked * includes the estimated clusters.", ""]
    for c in res["cases"]:
        extra = f", {c['n_planted']} planted keys/query holding {c['planted_mass']:.2f} of the mass" \
            if c["n_planted"] else ""
        kv = c.get("kv_heads", c["heads"])
        heads = f"{c['heads']} heads" if kv == c["heads"] else f"{c['heads']} query / {kv} kv heads (GQA)"
        L += [f"## {c['workload']}, n = {c['n']:,}, {heads}{extra}; exact top-64 err "
              f"{c['top64_rel_err']:.3f}", "",
              "| setting | planted recall (min) | recall@64 (min) | mass | err | err / top-64 err | keys read "
              "| p50 ms | p99 ms | SDPA p50 ms | x SDPA | index/KV | append us/tok |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in c["settings"].items():
            if "skipped" in r:
                L.append(f"| {LABELS[name]} | skipped: {r['skipped']} |||||||||||| ")
                continue
            pr = "-" if r["planted_recall"] is None else f"{r['planted_recall']:.3f} ({r['planted_recall_min']:.2f})"
            L.append(f"| {r['label']} | {pr} | {r['recall64']:.3f} ({r['recall64_min']:.2f}) | {r['mass']:.3f}"
                     f"{'*' if r['mass_includes_estimates'] else ''} | {r['rel_err']:.3f} | "
                     f"{r['err_over_top64']:.2f} | {r['keys_read']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{r['sdpa_p50_ms']:.2f} | {r['x_sdpa']:.1f} | {r['index_over_kv']:.3f} | "
                     f"{r['append_us_per_token']:.1f} |")
        L.append("")
    path.write_text("\n".join(L) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="16384,65536,131072,262144")
    ap.add_argument("--heads", default="8", help="heads below 1,048,576 keys")
    ap.add_argument("--heads-1m", default="1", help="heads at 1,048,576 keys and above")
    ap.add_argument("--gqa", default="1", help="query heads per kv head (the heads above are kv heads)")
    ap.add_argument("--workloads", default="passkey-clustered,passkey-gaussian,passkey-real,clustered")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--queries", default="16", help="decode queries per head and case")
    ap.add_argument("--n-planted", default="4")
    ap.add_argument("--hnsw-max", default="65536", help="largest n for the faiss-hnsw setting")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--out", default=str(HERE / "results" / "decode-recall.json"))
    a = ap.parse_args(argv)
    lengths = _int_list(a.lengths, "--lengths")
    heads = _int_list(a.heads, "--heads")[0]
    heads_1m = _int_list(a.heads_1m, "--heads-1m")[0]
    gqa = _int_list(a.gqa, "--gqa")[0]
    nq = _int_list(a.queries, "--queries")[0]
    n_planted = _int_list(a.n_planted, "--n-planted")[0]
    hnsw_max = _int_list(a.hnsw_max, "--hnsw-max")[0]
    try:
        seed = int(a.seed)
    except ValueError:
        seed = -1
    if seed < 0:
        _fail(f"--seed must be an integer >= 0; got {a.seed!r}")
    if min(lengths) < 256:
        _fail(f"--lengths must each be >= 256 (the exact top-64 needs more keys than the window); got {a.lengths!r}")
    if n_planted > 16:
        _fail(f"--n-planted must be in 1..16; got {n_planted}")
    workloads = _names(a.workloads, "--workloads", WORKLOADS)
    settings = _names(a.settings, "--settings", tuple(SETTINGS))
    out = Path(a.out)
    if out.suffix != ".json":
        _fail(f"--out must name a .json file (the .md goes next to it); got {a.out!r}")
    if not out.parent.is_dir():
        _fail(f"--out directory {str(out.parent)!r} does not exist; create it or pick another path")
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "argv": " ".join(argv if argv is not None else sys.argv[1:]) or "defaults", "cases": []}
    for n in lengths:
        h = heads_1m if n >= 1048576 else heads
        for kind in workloads:
            hk = h
            if kind == "passkey-real":
                if n != REAL_N:
                    continue  # the shipped store holds 16,384 keys per head
                hk = min(h, 4)  # and 4 heads
            res["cases"].append(run_case(kind, n, hk, nq, n_planted, settings, hnsw_max, seed, gqa=gqa))
            out.write_text(json.dumps(res, indent=1), encoding="utf-8")
            write_md(out.with_suffix(".md"), res)
            gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
