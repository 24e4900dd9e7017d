"""Decode-step benchmark of sparseattn.KVCache: per-step latency, append cost, index memory and accuracy.

Run:  python benchmarks/bench_decode.py [--lengths 16384,65536,131072,262144,1048576] [--steps 64]
                                        [--kinds clustered,gaussian] [--no-gqa] [--no-storage] [--no-real]

Setup: H = 8 heads, E = 64, float32 unless stated.  For each key kind and cache length n, every kv head's
keys come from ``sparseattn.data.synthetic("synthetic:n=<n + steps * stride + 4096>,d=64,kind=<kind>,seed=<head>")``
(``gaussian`` uses ``norm_profile=minilm``: Gaussian directions with the norms of a real MiniLM head), so
keys are appended in order; the first n are one prefill ``append`` (timed: the amortised append cost
includes the k-means of every segment), then each of ``--steps`` decode steps appends ``--stride`` tokens
one at a time (default 64: the 64 steps sample one whole segment cycle of 4,096 tokens, so the exact
tail's length runs through its range instead of sitting at one phase) and attends one query per head
(the generator's queries) at the last of them.

Per step, side by side in one loop (so machine load hits all alike; ratios are of medians), the timed
calls back to back in an order rotated by one each step (none always runs first, right after the
single-threaded accuracy reference):

* each selector's ``attend`` (cluster, pages, window, exact top-64) on its cache;
* our dense step (``attend(selector="dense")``: every key, the same Numba kernel);
* torch's ``scaled_dot_product_attention`` on a ``(1, H, 1, E)`` query over the cache's keys/values
  (``torch.set_num_threads`` = the machine's cores; the tensors share the cache's memory, no copy);
* accuracy against exact attention over the whole cache (float32 scores, float64 softmax): output
  relative error ``||o - o*|| / ||o*||``, softmax mass of the keys read (``exp(lse - lse*)``) and recall@64
  (the share of the exact top-64 keys the step read).

After the steps, each synthetic case's caches append one more segment (4,096 tokens) one token at a
time: the decode append cost, amortised over a whole cycle of segment clustering (the open segment's and
the closing one's k-means included), its clustering share and the largest single append.  Each cache
``reserve``s the whole run's tokens after its prompt, so no append reallocates.

Extra cases: GQA (32 query heads over 8 kv heads) at 131,072; float16 / bfloat16 storage at 131,072; the
streaming memory cap (``max_keys`` = n / 4) at 131,072; the real MiniLM store trace (``store65k``, 2 heads,
E = 32) when ``~/.cache/sparseattn/traces/manifest.json`` exists.

Writes benchmarks/results/decode.json, decode.md and decode_latency.png (log-log p50 latency vs n); with
``--out X/decode-NAME.json``: decode-NAME.md and decode_latency-NAME.png.

Memory-cap policies (``--cap-policies``, alone: ``python benchmarks/bench_decode.py --cap-policies
--steps 64``): on the real store65k trace (2 heads, E = 32), ``policy="streaming"`` against
``policy="h2o"`` at the same ``max_keys`` (``--cap-sizes``, default 4096,16384), with the ``dense`` and
the ``cluster`` selector.  Protocol: the first n = 65,536 - steps keys are appended in chunks of 256,
each chunk followed by an ``attend`` of 256 trace queries at the chunk's positions (so h2o accumulates
attention weights while the cache fills, as in a chunked prefill; streaming ignores them), then
``--steps`` decode steps each append one key and attend one held-out query.  Accuracy per step: output
relative error and softmax mass against exact attention over every key appended (no cap).  Writes
benchmarks/results/decode-cap.json and decode-cap.md.

``--top-p-store`` prints, on the same trace (all 65,536 keys, 64 random queries), keys read per query and
output error of ``selector="cluster"`` with ``n_probe = 32`` against ``top_p`` budgets (nothing written).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from sparseattn.data import SYNTHETIC_KINDS
from sparseattn.kernels.decode import EVICTED
from sparseattn.tools.args import OneLineParser, choice_list_arg, int_list_arg, positive_int
from sparseattn.tools.bench import decode_inputs as make_data
from sparseattn.tools.bench import log

HERE = Path(__file__).resolve().parent
TRACE_DIR = Path.home() / ".cache" / "sparseattn" / "traces"


CYCLE = 4096  # extra synthetic tokens: one segment (the default) appended one at a time after the steps


def exact_step(cache, q: np.ndarray):
    """Exact attention of (H, E) queries over every key of ``cache``: out (H, Ev), lse (H,), top-64 positions."""
    H = q.shape[0]
    rep = H // cache.num_kv_heads
    view = cache.debug_view()
    pos = view["positions"]
    out = np.empty((H, cache.value_dim))
    lse = np.empty(H)
    top = []
    keep = None
    if cache.max_keys is not None:
        keep = pos != EVICTED
    for h in range(H):
        g = h // rep
        Kg = view["keys"][g]
        Vg = view["values"][g]
        s = (Kg @ q[h]).astype(np.float64) * cache.scale
        if keep is not None:
            s[~keep[g]] = -np.inf
        m = s.max()
        w = np.exp(s - m)
        tot = w.sum()
        out[h] = (w.astype(np.float32) @ Vg).astype(np.float64) / tot
        lse[h] = m + np.log(tot)
        t64 = np.argpartition(-s, 64)[:64] if s.size > 64 else np.arange(s.size)
        top.append(pos[g, t64].astype(np.int64))
    return out, lse, top


def torch_step(torch, kt, vt, q: np.ndarray, gqa: bool):
    qt = torch.from_numpy(q)[None, :, None, :]
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)


def summarize(ts: list[float]) -> dict:
    a = np.asarray(ts) * 1e3
    return {"p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()),
            "steps": int(a.size)}


def run_phase(case: str, n: int, K, V, Q, steps: int, specs: list[tuple[str, dict, dict]], *,
              with_torch: bool, with_dense: bool, ref_label: str | None = None, stride: int = 1) -> dict:
    """Prefill each cache, then run ``steps`` decode steps side by side.

    specs: (label, KVCache kwargs, attend kwargs); labels sharing kwargs share one cache (same key).
    Before each step every cache appends ``stride`` tokens one at a time (the last is the step's own), so
    the steps sample ``steps * stride`` positions of a generation loop.  The timed calls of a step run
    back to back in an order rotated by one each step, so none of them always follows the untimed
    accuracy reference.
    """
    import torch

    from sparseattn.cache import KVCache, group_options
    from sparseattn.threads import single_threaded_blas

    H = Q.shape[0]
    hkv = K.shape[0]
    E = K.shape[2]
    caches: dict[str, KVCache] = {}
    prefill: dict[str, dict] = {}
    for label, ckw, _ in specs:
        key = json.dumps(ckw, sort_keys=True, default=str)
        if key in caches:
            continue
        c = KVCache(H, E, num_kv_heads=hkv, **group_options(ckw))
        t0 = time.perf_counter()
        c.append(K[:, :n], V[:, :n])
        dt = time.perf_counter() - t0
        c.reserve(K.shape[1] - n)  # the loop's length is known: no reallocation during the steps
        caches[key] = c
        st = c.stats
        prefill[label] = {"append_s": dt, "append_us_per_token": 1e6 * dt / n,
                          "cluster_s": st["cluster_seconds"], "segments": st["segments"],
                          "kv_bytes": st["kv_nbytes"], "index_bytes": st["index_nbytes"],
                          "index_over_kv": st["index_nbytes"] / st["kv_nbytes"]}
        log(f"  {case} n={n} prefill {label}: {dt:.1f} s ({1e6 * dt / n:.1f} us/token, clustering "
            f"{st['cluster_seconds']:.1f} s, {st['segments']} segments), index/KV = "
            f"{st['index_nbytes'] / st['kv_nbytes']:.3%}")
    cache_of = {label: caches[json.dumps(ckw, sort_keys=True, default=str)] for label, ckw, _ in specs}
    main = cache_of[ref_label or specs[0][0]]
    labels = [s[0] for s in specs]
    times: dict[str, list[float]] = {lab: [] for lab in labels}
    acc: dict[str, dict[str, list[float]]] = {lab: {"rel_err": [], "mass": [], "recall64": [], "read": []}
                                              for lab in labels}
    if with_dense:
        times["dense (ours)"] = []
    if with_torch:
        times["torch sdpa"] = []
    append_ts: list[float] = []
    # warm-up (JIT, caches)
    for label, _, akw in specs:
        cache_of[label].attend(Q[:, :1], **akw)
    timed = [("sel", label) for label in labels] + ([("dense", "dense (ours)")] if with_dense else []) \
        + ([("torch", "torch sdpa")] if with_torch else [])
    for s in range(steps):
        for j in range(n + s * stride, n + (s + 1) * stride):
            t0 = time.perf_counter()
            for c in caches.values():
                c.append(K[:, j:j + 1], V[:, j:j + 1])
            append_ts.append((time.perf_counter() - t0) / len(caches))
        q = np.ascontiguousarray(Q[:, s])
        # timed calls back to back, in an order rotated each step; the accuracy reference (BLAS) after them
        outs = {}
        kt = vt = None
        if with_torch:
            kt = torch.from_numpy(main.store.K[:, :main.store.slots])[None]
            vt = torch.from_numpy(main.store.V[:, :main.store.slots])[None]
        r = s % len(timed)
        for kind, label in timed[r:] + timed[:r]:
            if kind == "sel":
                c, akw = cache_of[label], specs[labels.index(label)][2]
                t0 = time.perf_counter()
                outs[label] = c.attend(q[:, None], return_lse=True, **akw)
                times[label].append(time.perf_counter() - t0)
                outs[label] += (c.stats["keys_read_per_query"],)
            elif kind == "dense":
                t0 = time.perf_counter()
                main.attend(q[:, None], selector="dense")
                times[label].append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                torch_step(torch, kt, vt, q, H != hkv)
                times[label].append(time.perf_counter() - t0)
        with single_threaded_blas():
            ref_out, ref_lse, ref_top = exact_step(main, q)
        for label, _, akw in specs:
            c = cache_of[label]
            out, lse, read = outs[label]
            out, lse = out[:, 0].astype(np.float64), lse[:, 0].astype(np.float64)
            a = acc[label]
            a["rel_err"].append(float(np.mean(np.linalg.norm(out - ref_out, axis=1)
                                              / np.linalg.norm(ref_out, axis=1))))
            a["mass"].append(float(np.mean(np.exp(np.minimum(lse - ref_lse, 0.0)))))
            a["read"].append(read)
            rec = []
            for h in range(H):
                sel = c.selected_slots(q[h], h, **akw)
                g = h // (H // hkv)
                rec.append(np.isin(ref_top[h], c.store.pos[g, sel]).mean())
            a["recall64"].append(float(np.mean(rec)))
    # append cost in a generation loop: one token at a time over a whole segment cycle (its clustering,
    # open and closing, included), on each cache after its steps
    cycle: dict[str, dict] = {}
    for key, c in caches.items():
        m = c.segment
        lo = n + steps * stride
        if K.shape[1] < lo + m:
            continue
        cs0, t_one = c.stats["cluster_seconds"], []
        t0 = time.perf_counter()
        for j in range(lo, lo + m):
            t1 = time.perf_counter()
            c.append(K[:, j:j + 1], V[:, j:j + 1])
            t_one.append(time.perf_counter() - t1)
        dt = time.perf_counter() - t0
        cycle[key] = {"cycle_append_us_per_token": 1e6 * dt / m, "cycle_tokens": m,
                      "cycle_cluster_us_per_token": 1e6 * (c.stats["cluster_seconds"] - cs0) / m,
                      "cycle_append_p50_us": 1e6 * float(np.median(t_one)),
                      "cycle_append_max_ms": 1e3 * float(np.max(t_one))}
        log(f"  {case} n={n} decode append over {m} tokens: {1e6 * dt / m:.1f} us/token "
            f"(clustering {cycle[key]['cycle_cluster_us_per_token']:.1f}, median single "
            f"{cycle[key]['cycle_append_p50_us']:.1f} us, max {cycle[key]['cycle_append_max_ms']:.1f} ms)")
    res = {"case": case, "n": n, "heads": H, "kv_heads": hkv, "dim": E, "steps": steps, "selectors": {}}
    for label in times:
        r = summarize(times[label])
        r["step_ms"] = [round(1e3 * x, 4) for x in times[label]]
        if label in acc:
            a = acc[label]
            r.update(rel_err=float(np.mean(a["rel_err"])), rel_err_p99=float(np.percentile(a["rel_err"], 99)),
                     mass=float(np.mean(a["mass"])), recall64=float(np.mean(a["recall64"])),
                     keys_read=float(np.mean(a["read"])), read_fraction=float(np.mean(a["read"])) / (n + stride * (steps + 1) / 2))
            r.update(prefill.get(label, {}))
            r.update(cycle.get(json.dumps(specs[labels.index(label)][1], sort_keys=True, default=str), {}))
        res["selectors"][label] = r
    res["decode_append_us_per_token"] = 1e6 * float(np.median(append_ts))
    base = res["selectors"]
    for r in base.values():
        if "torch sdpa" in base:
            r["speedup_vs_torch"] = base["torch sdpa"]["p50_ms"] / r["p50_ms"]
        if "dense (ours)" in base:
            r["speedup_vs_dense"] = base["dense (ours)"]["p50_ms"] / r["p50_ms"]
    for label, r in base.items():
        extra = (f" err {r['rel_err']:.2e} mass {r['mass']:.4f} recall {r['recall64']:.3f} read "
                 f"{r['keys_read']:.0f}") if "rel_err" in r else ""
        log(f"  {case} n={n} {label:>14}: p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms"
            f" x{r.get('speedup_vs_torch', float('nan')):.1f} vs torch{extra}")
    del caches, cache_of, main
    gc.collect()
    return res


def cap_policies(steps: int, caps: list[int], chunk: int = 256) -> dict:
    """streaming vs h2o at equal max_keys on the store65k trace (see the module docstring)."""
    import sparseattn as sa
    from sparseattn.cache import KVCache, Retention

    t = sa.data.load("store65k", data_dir=TRACE_DIR, dtype=np.float32)
    K, V, Qall = (np.ascontiguousarray(a) for a in (t.k, t.v, t.q))
    hkv, n_total, E = K.shape
    n = n_total - steps
    rng = np.random.default_rng(0)
    held = rng.choice(np.arange(n, Qall.shape[1]), steps, replace=False)  # decode queries: not used in prefill
    scale = 1.0 / np.sqrt(E)
    # exact attention over every key appended (float64), per decode step
    refs = []
    for s in range(steps):
        m = n + s + 1
        q = Qall[:, held[s]].astype(np.float64)
        sc = np.einsum("hke,he->hk", K[:, :m].astype(np.float64), q) * scale
        mx = sc.max(axis=1, keepdims=True)
        w = np.exp(sc - mx)
        refs.append((np.einsum("hk,hke->he", w, V[:, :m].astype(np.float64)) / w.sum(axis=1)[:, None],
                     mx[:, 0] + np.log(w.sum(axis=1))))
    rows = []
    for cap in caps:
        for selector in ("dense", "cluster"):
            for policy in ("streaming", "h2o"):
                c = KVCache(hkv, E, selector=selector, retention=Retention(max_keys=cap, policy=policy))
                t0 = time.perf_counter()
                for a in range(0, n, chunk):
                    b = min(a + chunk, n)
                    c.append(K[:, a:b], V[:, a:b])
                    c.attend(Qall[:, a:b])
                prefill_s = time.perf_counter() - t0
                errs, mass, read, ts = [], [], [], []
                for s in range(steps):
                    c.append(K[:, n + s:n + s + 1], V[:, n + s:n + s + 1])
                    t1 = time.perf_counter()
                    out, lse = c.attend(Qall[:, held[s]][:, None], return_lse=True)
                    ts.append(time.perf_counter() - t1)
                    ro, rl = refs[s]
                    o = out[:, 0].astype(np.float64)
                    errs.append(float(np.mean(np.linalg.norm(o - ro, axis=1) / np.linalg.norm(ro, axis=1))))
                    mass.append(float(np.mean(np.exp(np.minimum(lse[:, 0] - rl, 0.0)))))
                    read.append(c.stats["keys_read_per_query"])
                r = {"cap": cap, "selector": selector, "policy": policy, "n": n, "steps": steps,
                     "rel_err": float(np.mean(errs)), "rel_err_median": float(np.median(errs)),
                     "rel_err_p90": float(np.percentile(errs, 90)), "mass": float(np.mean(mass)),
                     "keys_read": float(np.mean(read)), "p50_ms": 1e3 * float(np.median(ts)),
                     "prefill_s": prefill_s, "len": len(c), "slots": c.stats["slots"],
                     "kv_bytes": c.kv_nbytes, "index_bytes": c.index_nbytes, "compactions": c.stats["compactions"]}
                rows.append(r)
                log(f"  cap {cap} {selector:>7} {policy:>9}: err {r['rel_err']:.3e} (median {r['rel_err_median']:.3e}) "
                    f"mass {r['mass']:.4f} read {r['keys_read']:.0f} p50 {r['p50_ms']:.3f} ms prefill "
                    f"{prefill_s:.1f} s slots {r['slots']}")
    return {"trace": "store65k", "heads": hkv, "dim": E, "n": n, "chunk": chunk, "rows": rows}


def top_p_store(n_queries: int = 64) -> None:
    """Prints, on the store65k trace, keys read per query and output error of the cluster selector with
    ``n_probe`` = 32 against the mass-driven budget ``top_p`` (with the default routed-key cap and without)."""
    import sparseattn as sa
    from sparseattn.cache import KVCache, group_options

    t = sa.data.load("store65k", data_dir=TRACE_DIR, dtype=np.float32)
    K, V, Q = (np.ascontiguousarray(a) for a in (t.k, t.v, t.q))
    hkv, n, E = K.shape
    rng = np.random.default_rng(0)
    qs = Q[:, rng.choice(Q.shape[1], n_queries, replace=False)]
    sc = np.einsum("hke,hqe->hqk", K.astype(np.float64), qs.astype(np.float64)) / np.sqrt(E)
    w = np.exp(sc - sc.max(axis=2, keepdims=True))
    ref = np.einsum("hqk,hke->hqe", w, V.astype(np.float64)) / w.sum(axis=2)[..., None]
    specs = [("n_probe=32", {})] + [(f"top_p={p}", {"top_p": p}) for p in (0.5, 0.9, 0.99)] + \
        [(f"top_p={p} no cap", {"top_p": p, "top_p_max_keys": n}) for p in (0.5, 0.9)]
    for label, kw in specs:
        c = KVCache(hkv, E, **group_options(kw))
        c.append(K, V)
        errs, reads = [], []
        for i in range(n_queries):
            o = c.attend(qs[:, i:i + 1])[:, 0].astype(np.float64)
            errs.append(np.mean(np.linalg.norm(o - ref[:, i], axis=1) / np.linalg.norm(ref[:, i], axis=1)))
            reads.append(c.stats["keys_read_per_query"])
        log(f"  store65k {label:>17}: rel. error mean {np.mean(errs):.3e} median {np.median(errs):.3e}; keys "
            f"read per query mean {np.mean(reads):,.0f} (min {np.min(reads):,.0f}, max {np.max(reads):,.0f}) "
            f"of {n:,}")


def write_cap_report(path: Path, meta: dict, res: dict) -> None:
    lines = ["# Memory cap: streaming vs h2o (sparseattn.KVCache, store65k trace)", "",
             f"Run {meta['started']} on {meta['cores']} cores (load average {meta['loadavg_start'][0]:.1f} at start; "
             f"the machine was shared).  Command: `python benchmarks/bench_decode.py --cap-policies --steps "
             f"{res['rows'][0]['steps']}`.  Keys/values: the real MiniLM store trace ({res['heads']} heads, "
             f"E = {res['dim']}); the first {res['n']:,} keys appended in chunks of {res['chunk']}, each chunk "
             f"attended by {res['chunk']} trace queries; then one key + one held-out query per decode step.  "
             f"Error: ||o - o*|| / ||o*|| against exact attention over every key appended (no cap), mean "
             f"over heads and steps; mass: softmax mass of the keys attended, exp(lse - lse*).", "",
             "| max_keys | selector | policy | rel. error mean | median | p90 | mass | keys read | p50 ms | "
             "slots held |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['cap']:,} | {r['selector']} | {r['policy']} | {r['rel_err']:.3e} | "
                     f"{r['rel_err_median']:.3e} | {r['rel_err_p90']:.3e} | {r['mass']:.4f} | {r['keys_read']:,.0f} | "
                     f"{r['p50_ms']:.3f} | {r['slots']:,} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


SPARSE = [
    ("cluster", {"selector": "cluster"}, {}),
    ("topk-64", {"selector": "cluster"}, {"selector": "topk", "k": 64}),
    ("window", {"selector": "cluster"}, {"selector": "window"}),
]
PAGES = [("pages", {"selector": "pages"}, {})]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int_list_arg(1, "16384,65536"), default=[16384, 65536, 131072, 262144, 1048576])
    ap.add_argument("--steps", type=positive_int, default=64, help="timed decode steps per case")
    ap.add_argument("--stride", type=positive_int, default=64,
                    help="tokens appended (one at a time) before each timed step; the default 64 x 64 steps "
                         "spreads the steps over one whole segment cycle of 4,096 tokens")
    ap.add_argument("--kinds", type=choice_list_arg(sorted(SYNTHETIC_KINDS)), default=["clustered", "gaussian"])
    ap.add_argument("--no-gqa", action="store_true")
    ap.add_argument("--no-storage", action="store_true")
    ap.add_argument("--no-cap", action="store_true")
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--no-estimate", action="store_true", help="skip the estimation-zone phases")
    ap.add_argument("--topk-max", type=positive_int, default=262144, help="largest n for the exact top-64 selector")
    ap.add_argument("--out", default=str(HERE / "results" / "decode.json"))
    ap.add_argument("--append", action="store_true", help="add to the results already in --out")
    ap.add_argument("--cap-policies", action="store_true",
                    help="only the streaming vs h2o comparison on store65k (writes decode-cap.json / .md)")
    ap.add_argument("--cap-sizes", type=int_list_arg(1, "4096,16384"), default=[4096, 16384], help="max_keys values of --cap-policies")
    ap.add_argument("--top-p-store", action="store_true",
                    help="only print the cluster selector's n_probe vs top_p budget on store65k")
    args = ap.parse_args(argv)

    import numba
    import torch

    import sparseattn as sa  # first: sets OpenMP's passive wait policy before torch starts its pool

    torch.set_num_threads(os.cpu_count() or 1)
    lengths, kinds = args.lengths, args.kinds
    steps, stride = args.steps, args.stride
    results: list[dict] = []
    if args.append and Path(args.out).is_file():
        results = json.loads(Path(args.out).read_text())["results"]
    meta = {"python": sys.version.split()[0], "numpy": np.__version__, "numba": numba.__version__,
            "torch": torch.__version__, "sparseattn": sa.__version__, "cpu": platform.processor(),
            "cores": os.cpu_count(), "numba_threads": numba.get_num_threads(),
            "torch_threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": steps, "stride": stride}

    if args.top_p_store:
        top_p_store()
        return 0
    if args.cap_policies:
        if not (TRACE_DIR / "manifest.json").is_file():
            raise SystemExit(f"--cap-policies needs the store65k trace in {TRACE_DIR}.")
        res = cap_policies(steps, args.cap_sizes)
        meta["loadavg_end"] = os.getloadavg()
        out = HERE / "results" / "decode-cap.json"
        out.write_text(json.dumps({"meta": meta, "results": res}, indent=1))
        write_cap_report(out, meta, res)
        return 0

    def save() -> None:
        meta["loadavg_end"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        write_report(Path(args.out), meta, results)

    for kind in kinds:
        for n in lengths:
            log(f"{kind} n={n}: generating")
            K, V, Q = make_data(kind, n + steps * stride + CYCLE, 8, 1, steps)
            specs = [s for s in SPARSE if not (s[0] == "topk-64" and n > args.topk_max)]
            results.append(run_phase(kind, n, K, V, Q, steps, specs, with_torch=True, with_dense=True, stride=stride))
            save()
            results.append(run_phase(kind + "/pages", n, K, V, Q, steps, PAGES, with_torch=True,
                                     with_dense=False, stride=stride))
            save()
            if kind == kinds[0] and n == 131072:
                if not args.no_storage:
                    specs = [("cluster f32", {"selector": "cluster"}, {}),
                             ("cluster f16", {"selector": "cluster", "dtype": np.float16}, {}),
                             ("cluster bf16", {"selector": "cluster", "dtype": "bfloat16"}, {})]
                    results.append(run_phase(kind + "/storage", n, K, V, Q, steps, specs, with_torch=False,
                                             with_dense=False, stride=stride))
                    save()
                if not args.no_estimate:
                    specs = [("cluster", {"selector": "cluster"}, {}),
                             ("cluster est64", {"selector": "cluster", "estimate": 64}, {}),
                             ("cluster est512", {"selector": "cluster", "estimate": 512}, {}),
                             ("cluster est4096", {"selector": "cluster", "estimate": 4096}, {})]
                    results.append(run_phase(kind + "/estimate", n, K, V, Q, steps, specs, with_torch=False,
                                             with_dense=False, stride=stride))
                    save()
                if not args.no_cap:
                    specs = [("cluster cap n/4", {"selector": "cluster", "max_keys": n // 4}, {}),
                             ("cluster", {"selector": "cluster"}, {})]
                    results.append(run_phase(kind + "/cap", n, K, V, Q, steps, specs, with_torch=False,
                                             with_dense=False, ref_label="cluster", stride=stride))
                    save()
            del K, V, Q
            gc.collect()
        if kind == kinds[0] and not args.no_gqa:
            n = 131072
            log(f"{kind} GQA 32/8 n={n}: generating")
            K, V, Q = make_data(kind, n + steps * stride + CYCLE, 8, 4, steps)
            specs = [("cluster", {"selector": "cluster"}, {})]
            results.append(run_phase(kind + "/gqa32x8", n, K, V, Q, steps, specs, with_torch=True,
                                     with_dense=True, stride=stride))
            save()
            del K, V, Q
            gc.collect()
    if not args.no_real and (TRACE_DIR / "manifest.json").is_file():
        t = sa.data.load("store65k", data_dir=TRACE_DIR, dtype=np.float32)
        nk = t.k.shape[1]
        n = nk - steps * stride
        if n < 1:
            raise SystemExit(f"--steps x --stride ({steps} x {stride}) must be below the trace's {nk} keys.")
        rng = np.random.default_rng(0)
        qi = rng.choice(t.q.shape[1], steps, replace=False)
        K, V = np.ascontiguousarray(t.k), np.ascontiguousarray(t.v)
        Q = np.ascontiguousarray(t.q[:, qi])
        for seg in (4096,):
            specs = [("cluster", {"selector": "cluster", "segment": seg}, {}),
                     ("cluster probe64", {"selector": "cluster", "segment": seg, "n_probe": 64}, {}),
                     ("cluster est64", {"selector": "cluster", "segment": seg, "estimate": 64}, {}),
                     ("cluster est512", {"selector": "cluster", "segment": seg, "estimate": 512}, {}),
                     ("topk-64", {"selector": "cluster", "segment": seg}, {"selector": "topk", "k": 64}),
                     ("window", {"selector": "cluster", "segment": seg}, {"selector": "window"})]
            results.append(run_phase("real-store65k", n, K, V, Q, steps, specs, with_torch=True,
                                     with_dense=True, stride=stride))
            save()
            results.append(run_phase("real-store65k/pages", n, K, V, Q, steps, PAGES, with_torch=True,
                                     with_dense=False, stride=stride))
            save()
    save()
    return 0


def write_report(path: Path, meta: dict, results: list[dict]) -> None:
    lines = ["# Decode-step benchmark (sparseattn.KVCache)", "",
             f"Run {meta['started']} on {meta['cores']} cores (load average {meta['loadavg_start'][0]:.1f} at "
             f"start, {meta.get('loadavg_end', (0,))[0]:.1f} at end; the machine was shared), numba threads "
             f"{meta['numba_threads']}, torch threads {meta['torch_threads']}.  Per-step latency of one decode "
             f"step (all heads, one query each), {meta.get('steps', '?')} steps with "
             f"{meta.get('stride', 1)} tokens appended before each (the timed calls in an order rotated each "
             f"step); accuracy per step against exact attention over the whole cache.",
             "",
             "| case | n | selector | p50 ms | p99 ms | x torch | x dense | keys read/head | rel. error | mass | "
             "recall@64 | prefill append us/token | decode append us/token | clustering us/token | "
             "max append ms | index/KV |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for label, r in res["selectors"].items():
            def f(key: str, fmt: str, r: dict = r) -> str:
                return format(r[key], fmt) if key in r else ""
            lines.append(f"| {res['case']} | {res['n']:,} | {label} | {f('p50_ms', '.3f')} | {f('p99_ms', '.3f')} | "
                         f"{f('speedup_vs_torch', '.1f')} | {f('speedup_vs_dense', '.1f')} | {f('keys_read', ',.0f')} | "
                         f"{f('rel_err', '.2e')} | {f('mass', '.4f')} | {f('recall64', '.3f')} | "
                         f"{f('append_us_per_token', '.1f')} | {f('cycle_append_us_per_token', '.1f')} | "
                         f"{f('cycle_cluster_us_per_token', '.1f')} | {f('cycle_append_max_ms', '.1f')} | "
                         f"{f('index_over_kv', '.2%')} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for kind in sorted({r["case"] for r in results if "/" not in r["case"] and not r["case"].startswith("real")}):
        series: dict[str, dict[int, float]] = {}
        for res in results:
            if res["case"] not in (kind, kind + "/pages"):
                continue
            for label, r in res["selectors"].items():
                if res["case"].endswith("/pages") and label == "torch sdpa":
                    continue
                series.setdefault(label, {})[res["n"]] = r["p50_ms"]
        for label, pts in series.items():
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=f"{kind}: {label}",
                    linestyle="--" if kind != "clustered" else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cache length (keys per head)")
    ax.set_ylabel("decode step p50 (ms), 8 heads, E = 64")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path.parent / (path.stem.replace("decode", "decode_latency", 1) + ".png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
