"""Estimation of unread clusters and the mass-driven budget of cluster:mode=block, on real MiniLM keys.

Run:  python benchmarks/bench_estimate.py [--repeats 3] [--quality-rows 2048] [--skip-65k] [--equal-error-only]

Data: the shipped 16,384-key store (every head: 0-3, all 2,048 queries) and the 65,536-key store
``store65k`` in ``~/.cache/sparseattn/traces`` when present (heads 0 and 5; timing over all 65,536
queries, quality on ``--quality-rows`` evenly spaced ones; see ``bench_cluster_goals.py`` for how to
generate it).  Index: ``ClusterIndex`` defaults (C = round(sqrt(S)), spherical k-means, routed by mean).

Per head and n_probe, with ``estimate`` off (0) and on (-1: every unread cluster):

* keys read per query (``stats["keys_read"]``), output relative error ``||o - o*|| / ||o*||`` against
  float64 dense attention (mean over rows), softmax mass of the keys read exactly (``exp(lse - lse*)``
  of the estimate-off run, which reads the same keys), attend time (median of ``--repeats``).
* estimation cost: attend time with estimate=-1 minus with estimate=0, relative to the latter.

``top_p`` in 0.9 (``max_keys`` = S, no cap; and the default cap), 0.95, 0.98: fraction of rows whose
exactly read keys hold >= 0.9 of the true softmax mass, mean keys read, and the fixed budgets (smallest
n_probe of a sweep) reaching the same mean mass, the same share of rows >= 0.9, and 95 % of rows >= 0.9,
with their keys read.

Row-level error against mass kept (:func:`sparseattn.metrics.mass_error_profile`): the rows of every head
and every fixed budget and top_p run above (estimate off and on), pooled per store, binned by the true mass
kept.

Equal output error: for estimate on (-1) at n_probe 4 and 8, the smallest n_probe of ``EQUAL_ERROR_GRID``
(capped at C) whose mean error with the estimate off is <= the error on, and the time of both (median
wall and process CPU seconds of ``--repeats`` interleaved rounds over every query): how much time the
estimate saves at equal error.  ``--equal-error-only`` runs this section alone and writes
``results/estimate-equal-error.json`` / ``.md`` (``--out``).

Results: ``results/estimate.json`` (all numbers) and ``results/estimate.md`` (tables).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import sparseattn as sa
from sparseattn.attention.routed import routed_attention
from sparseattn.index import ClusterIndex
from sparseattn.metrics import mass_error_profile
from sparseattn.tools.args import OneLineParser, positive_int

TRACE_DIR = os.path.expanduser("~/.cache/sparseattn/traces")
SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
EQUAL_ERROR_ON = (4, 8)
EQUAL_ERROR_GRID = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def dense_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 dense attention (output (L, Ev), lse (L,)), in chunks of rows."""
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    outs, lses = [], []
    for a in range(0, q.shape[0], 256):
        s = q[a:a + 256].astype(np.float64) @ k64.T * scale
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        z = w.sum(axis=1)
        outs.append((w @ v64) / z[:, None])
        lses.append(m[:, 0] + np.log(z))
    return np.concatenate(outs), np.concatenate(lses)


def rel_err(o: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(o.astype(np.float64) - ref, axis=1) / np.linalg.norm(ref, axis=1)


def timed(fns: dict, repeats: int) -> dict:
    """name -> (median wall s, min wall s, median process CPU s, min process CPU s) of each function, run interleaved
    ``repeats`` rounds.  On a shared, loaded machine interleaving keeps the cases comparable, and the
    CPU time of this process (all its threads) is far less sensitive to other processes than wall time."""
    ts: dict = {name: [] for name in fns}
    cpu: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: (float(np.median(ts[name])), float(np.min(ts[name])), float(np.median(cpu[name])),
                   float(np.min(cpu[name]))) for name in fns}


def run_head(name: str, head: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, probes: list[int],
             repeats: int, quality_rows: int, top_p_repeats: int = 1) -> dict:
    S = k.shape[0]
    rows = np.unique(np.linspace(0, q.shape[0] - 1, min(quality_rows, q.shape[0])).astype(np.int64))
    qq = q[rows]
    ref, lse_full = dense_ref(qq, k, v, scale)
    res: dict = {"data": name, "head": head, "S": S, "L_time": int(q.shape[0]), "L_quality": int(rows.size),
                 "fixed": [], "top_p": [], "_rows": {"off": [], "on": [], "ref": []}}
    t0 = time.perf_counter()
    ClusterIndex().build(k)
    res["build_s"] = time.perf_counter() - t0
    sweep: dict[int, dict] = {}
    C = ClusterIndex().sizes(S)[0]
    for p in sorted(set(SWEEP) | set(probes)):
        if p > C:
            continue
        idx = ClusterIndex(n_probe=p).build(k)  # same seed: the same clusters for every n_probe
        st: dict = {}
        o0, l0 = routed_attention(idx, qq, v, scale=scale, stats=st)
        mass = np.exp(l0.astype(np.float64) - lse_full)
        sweep[p] = {"n_probe": p, "keys_read": float(st["keys_read"].mean()), "mass_mean": float(mass.mean()),
                    "rows_mass_ge_0.9": float(np.mean(mass >= 0.9)), "err_off": float(rel_err(o0, ref).mean())}
        if p not in probes:
            continue
        row = dict(sweep[p])
        o1, _ = routed_attention(idx, qq, v, scale=scale, estimate=-1)
        res["_rows"]["off"].append((o0, mass))
        res["_rows"]["on"].append((o1, mass))
        res["_rows"]["ref"].append(ref)
        row["err_on"] = float(rel_err(o1, ref).mean())
        o8, _ = routed_attention(idx, qq, v, scale=scale, estimate=8)
        row["err_on_next8"] = float(rel_err(o8, ref).mean())
        row["err_ratio"] = row["err_on"] / row["err_off"]
        routed_attention(idx, q[:64], v, scale=scale, estimate=-1)  # warm-up (JIT)
        tm = timed({"off": lambda idx=idx: routed_attention(idx, q, v, scale=scale),
                    "on": lambda idx=idx: routed_attention(idx, q, v, scale=scale, estimate=-1),
                    "next8": lambda idx=idx: routed_attention(idx, q, v, scale=scale, estimate=8),
                    "off_1t": lambda idx=idx: routed_attention(idx, q, v, scale=scale, n_threads=1),
                    "on_1t": lambda idx=idx: routed_attention(idx, q, v, scale=scale, estimate=-1, n_threads=1)},
                   repeats)
        for case, (med, mn, cpu, cpu_mn) in tm.items():
            row[f"time_{case}_s"] = med
            row[f"time_{case}_min_s"] = mn
            row[f"cpu_{case}_s"] = cpu
            row[f"cpu_{case}_min_s"] = cpu_mn
        # the estimate's own CPU time, timed inside routed_attention (stats["estimate_cpu_s"]): steadier
        # than the difference of two loaded-machine totals
        split, split1 = [], []
        for _ in range(repeats):
            for n_threads, acc in ((None, split), (1, split1)):
                st2: dict = {}
                c0 = time.process_time()
                routed_attention(idx, q, v, scale=scale, estimate=-1, stats=st2, n_threads=n_threads)
                acc.append((st2["estimate_cpu_s"], time.process_time() - c0))
        row["est_split_cpu_s"] = float(np.median([a for a, _ in split]))
        row["est_split_call_cpu_s"] = float(np.median([b for _, b in split]))
        row["est_split_share"] = row["est_split_cpu_s"] / row["cpu_off_s"]
        # one thread, least-disturbed repeat: the estimate's own CPU (min) over the CPU time off (min)
        row["est_split_1t_min_s"] = float(min(a for a, _ in split1))
        row["est_split_share_1t_min"] = row["est_split_1t_min_s"] / row["cpu_off_1t_min_s"]
        row["est_cost_frac_1t"] = (row["time_on_1t_min_s"] - row["time_off_1t_min_s"]) / row["time_off_1t_min_s"]
        row["est_cost_frac_cpu"] = (row["cpu_on_s"] - row["cpu_off_s"]) / row["cpu_off_s"]
        row["est_cost_frac_cpu_1t"] = (row["cpu_on_1t_s"] - row["cpu_off_1t_s"]) / row["cpu_off_1t_s"]
        row["est_cost_frac"] = (row["time_on_s"] - row["time_off_s"]) / row["time_off_s"]
        row["est_cost_frac_min"] = (row["time_on_min_s"] - row["time_off_min_s"]) / row["time_off_min_s"]
        res["fixed"].append(row)
        print(f"{name} h{head} n_probe={p}: keys {row['keys_read']:.0f} mass {row['mass_mean']:.3f} err off "
              f"{row['err_off']:.4f} on {row['err_on']:.4f} (x{row['err_ratio']:.2f}; next8 {row['err_on_next8']:.4f}) "
              f"time off {row['time_off_s']:.4f} on {row['time_on_s']:.4f} (+{100 * row['est_cost_frac']:.1f} %; "
              f"min {row['time_off_min_s']:.4f} / {row['time_on_min_s']:.4f}: +{100 * row['est_cost_frac_min']:.1f} %; "
              f"1 thread min {row['time_off_1t_min_s']:.4f} / {row['time_on_1t_min_s']:.4f}: "
              f"+{100 * row['est_cost_frac_1t']:.1f} %; CPU s {row['cpu_off_s']:.4f} / {row['cpu_on_s']:.4f}: "
              f"+{100 * row['est_cost_frac_cpu']:.1f} %, 1 thread {row['cpu_off_1t_s']:.4f} / {row['cpu_on_1t_s']:.4f}: "
              f"+{100 * row['est_cost_frac_cpu_1t']:.1f} %; estimate's own CPU {row['est_split_cpu_s']:.4f} s = "
              f"{100 * row['est_split_share']:.1f} % of the CPU time off; 1 thread min {row['est_split_1t_min_s']:.4f} "
              f"s = {100 * row['est_split_share_1t_min']:.1f} %)",
              flush=True)
    res["sweep"] = list(sweep.values())
    res["n_clusters"] = C
    idx = ClusterIndex().build(k)
    for top_p, cap_name, cap in ((0.9, "S", S), (0.9, "default", None), (0.95, "S", S), (0.98, "S", S)):
        st: dict = {}
        o0, l0 = routed_attention(idx, qq, v, scale=scale, top_p=top_p, max_keys=cap, stats=st)
        mass = np.exp(l0.astype(np.float64) - lse_full)
        o1, _ = routed_attention(idx, qq, v, scale=scale, top_p=top_p, max_keys=cap, estimate=-1)
        res["_rows"]["off"].append((o0, mass))
        res["_rows"]["on"].append((o1, mass))
        res["_rows"]["ref"].append(ref)
        kr = st["keys_read"]
        reach = [s for s in sweep.values() if s["mass_mean"] >= mass.mean()]
        fixed = min(reach, key=lambda s: s["keys_read"]) if reach else None
        frac = float(np.mean(mass >= 0.9))
        reach = [s for s in sweep.values() if s["rows_mass_ge_0.9"] >= frac]
        fixed_rows = min(reach, key=lambda s: s["keys_read"]) if reach else None
        reach = [s for s in sweep.values() if s["rows_mass_ge_0.9"] >= 0.95]
        fixed_95 = min(reach, key=lambda s: s["keys_read"]) if reach else None
        row = {"top_p": top_p, "max_keys": cap if cap is not None else 4 * idx.prefix_budget(),
               "cap": cap_name, "keys_read_mean": float(kr.mean()),
               "keys_read_p10": float(np.percentile(kr, 10)), "keys_read_p90": float(np.percentile(kr, 90)),
               "mass_mean": float(mass.mean()), "rows_mass_ge_0.9": float(np.mean(mass >= 0.9)),
               "err_off": float(rel_err(o0, ref).mean()), "err_on": float(rel_err(o1, ref).mean()),
               "fixed_same_mass": fixed, "fixed_same_rows": fixed_rows, "fixed_95": fixed_95}
        row["time_s"], _, row["cpu_s"], _ = timed({"t": lambda cap=cap, top_p=top_p: routed_attention(
            idx, q, v, scale=scale, top_p=top_p, max_keys=cap, estimate=-1)}, top_p_repeats)["t"]
        res["top_p"].append(row)
        fx = (f"fixed n_probe={fixed['n_probe']} keys {fixed['keys_read']:.0f} mass {fixed['mass_mean']:.3f}"
              if fixed else "no fixed budget reaches it")
        if fixed_rows:
            fx += (f"; rows>=0.9 as often: fixed n_probe={fixed_rows['n_probe']} keys "
                   f"{fixed_rows['keys_read']:.0f} ({fixed_rows['rows_mass_ge_0.9']:.3f})")
        if fixed_95:
            fx += f"; 95 % of rows >= 0.9: fixed n_probe={fixed_95['n_probe']} keys {fixed_95['keys_read']:.0f}"
        print(f"{name} h{head} top_p={top_p} cap={row['max_keys']}: keys {row['keys_read_mean']:.0f} "
              f"(p10 {row['keys_read_p10']:.0f}, p90 {row['keys_read_p90']:.0f}) mass {row['mass_mean']:.3f} "
              f"rows>=0.9 {row['rows_mass_ge_0.9']:.3f} err off {row['err_off']:.4f} on {row['err_on']:.4f}; {fx}",
              flush=True)
    return res


def equal_error_head(name: str, head: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                     repeats: int, quality_rows: int, on_probes: tuple[int, ...] = EQUAL_ERROR_ON,
                     grid: tuple[int, ...] = EQUAL_ERROR_GRID) -> list[dict]:
    """Estimate on (-1) at each of ``on_probes`` against the smallest estimate-off n_probe of ``grid`` (capped at
    the number of clusters C) with a mean output error <= the error on; both timed over every query of q
    (L, E) with :func:`timed`.  k (S, E), v (S, Ev) float32.  One dict per on n_probe."""
    S = k.shape[0]
    rows = np.unique(np.linspace(0, q.shape[0] - 1, min(quality_rows, q.shape[0])).astype(np.int64))
    qq = q[rows]
    ref, _ = dense_ref(qq, k, v, scale)
    C = ClusterIndex().sizes(S)[0]
    steps = sorted({min(g, C) for g in grid})
    idx_of: dict[int, ClusterIndex] = {}
    off: dict[int, tuple[float, float]] = {}  # n_probe -> (mean error, mean keys read) with the estimate off

    def index(p: int) -> ClusterIndex:
        if p not in idx_of:
            idx_of[p] = ClusterIndex(n_probe=p).build(k)  # same seed: the same clusters for every n_probe
        return idx_of[p]

    def err_off(p: int) -> tuple[float, float]:
        if p not in off:
            st: dict = {}
            o0, _ = routed_attention(index(p), qq, v, scale=scale, stats=st)
            off[p] = (float(rel_err(o0, ref).mean()), float(st["keys_read"].mean()))
        return off[p]

    out = []
    for p_on in on_probes:
        if p_on > C:
            continue
        st: dict = {}
        o1, _ = routed_attention(index(p_on), qq, v, scale=scale, estimate=-1, stats=st)
        e_on, keys_on = float(rel_err(o1, ref).mean()), float(st["keys_read"].mean())
        p_off, reached = steps[-1], False
        for p in steps:
            if err_off(p)[0] <= e_on:
                p_off, reached = p, True
                break
        e_off, keys_off = err_off(p_off)
        i_on, i_off = index(p_on), index(p_off)
        routed_attention(i_on, q[:64], v, scale=scale, estimate=-1)  # warm-up (JIT)
        routed_attention(i_off, q[:64], v, scale=scale)
        tm = timed({"on": lambda i_on=i_on: routed_attention(i_on, q, v, scale=scale, estimate=-1),
                    "off": lambda i_off=i_off: routed_attention(i_off, q, v, scale=scale)}, repeats)
        row = {"data": name, "head": head, "S": S, "n_clusters": C, "L_time": int(q.shape[0]),
               "L_quality": int(rows.size), "on_n_probe": p_on, "on_err": e_on, "on_keys_read": keys_on,
               "on_wall_s": tm["on"][0], "on_cpu_s": tm["on"][2], "off_n_probe": p_off, "off_reached": reached,
               "off_err": e_off, "off_keys_read": keys_off, "off_wall_s": tm["off"][0], "off_cpu_s": tm["off"][2],
               "off_errors_tried": {str(p): off[p][0] for p in sorted(off)}}
        row["wall_ratio"] = row["off_wall_s"] / row["on_wall_s"]
        row["cpu_ratio"] = row["off_cpu_s"] / row["on_cpu_s"]
        # when no grid value reaches the error on, the ratios are lower bounds (the off budget needed is
        # larger): below 1.5 the answer is then unknown (None)
        row["meets_1.5x"] = True if row["cpu_ratio"] >= 1.5 else (False if reached else None)
        out.append(row)
        gt = "" if reached else ">"
        print(f"{name} h{head} equal error: on n_probe={p_on} err {e_on:.4f} keys {keys_on:.0f} wall "
              f"{row['on_wall_s']:.4f} CPU {row['on_cpu_s']:.4f} | off n_probe={gt}{p_off} err {e_off:.4f} keys "
              f"{keys_off:.0f} wall {row['off_wall_s']:.4f} CPU {row['off_cpu_s']:.4f} | off/on wall "
              f"{gt}{row['wall_ratio']:.2f} CPU {gt}{row['cpu_ratio']:.2f}", flush=True)
    return out


def equal_error_md(rows: list[dict]) -> list[str]:
    """Markdown lines of the equal-output-error section."""
    lines = ["## Equal output error: estimate on against the estimate-off budget reaching the same error", "",
             f"Estimate on (-1: every unread cluster) at n_probe {', '.join(map(str, EQUAL_ERROR_ON))}; off: the "
             f"smallest n_probe of {{{', '.join(map(str, EQUAL_ERROR_GRID))}}} (capped at C) whose mean error is "
             '<= the error on ("not reached": none is; the largest is shown and the ratios, marked ">", are lower '
             "bounds). Error on the quality rows; time over every query (median of interleaved repeats, wall and "
             'process CPU seconds). "meets >= 1.5x": CPU off / on >= 1.5.', "",
             "| data | head | C | on n_probe | on err | on keys/q | on wall s | on CPU s | off n_probe needed | "
             "off err | off keys/q | off wall s | off CPU s | wall off/on | CPU off/on | meets >= 1.5x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gt = "" if r["off_reached"] else ">"
        need = f"{r['off_n_probe']}" if r["off_reached"] else f"not reached (> {r['off_n_probe']})"
        meets = {True: "yes", False: "no", None: "unknown (lower bound < 1.5)"}[r["meets_1.5x"]]
        lines.append(f"| {r['data']} | {r['head']} | {r['n_clusters']} | {r['on_n_probe']} | {r['on_err']:.4f} | "
                     f"{r['on_keys_read']:.0f} | {r['on_wall_s']:.4f} | {r['on_cpu_s']:.4f} | {need} | "
                     f"{r['off_err']:.4f} | {r['off_keys_read']:.0f} | {r['off_wall_s']:.4f} | {r['off_cpu_s']:.4f} | "
                     f"{gt}{r['wall_ratio']:.2f} | {gt}{r['cpu_ratio']:.2f} | {meets} |")
    return lines


def profiles(results: list[dict]) -> dict:
    """Per store and estimate off / on: :func:`mass_error_profile` of the pooled fixed-budget rows."""
    out: dict = {}
    for data in dict.fromkeys(r["data"] for r in results):
        rs = [r for r in results if r["data"] == data]
        ref = np.concatenate([x for r in rs for x in r["_rows"]["ref"]])
        for case in ("off", "on"):
            o = np.concatenate([x[0] for r in rs for x in r["_rows"][case]])
            m = np.concatenate([x[1] for r in rs for x in r["_rows"][case]])
            prof = mass_error_profile(o, ref, np.clip(m, 0.0, 1.0))
            out[f"{data} estimate {case}"] = {k: v.tolist() for k, v in prof.items()}
    return out


def write_md(results: list[dict], path: str, command: str, prof: dict | None = None,
             equal: list[dict] | None = None) -> None:
    lines = ["# Estimation of unread clusters and the mass-driven budget (cluster:mode=block)", "",
             f"Command: `{command}`. Real MiniLM keys (layer 3); error vs float64 dense attention (mean over "
             "rows); mass = true softmax mass of the keys read exactly; time = attend over every query "
             "(median of interleaved repeats, wall and CPU seconds of this process; the machine is shared, so "
             "the CPU-time ratio is the steadier measure of the estimation's own cost). `estimate=-1`: every unread cluster estimated; `next8`: the next 8 clusters. "
             "\"estimate's own CPU\": `stats[\"estimate_cpu_s\"]` of an `estimate=-1` call (the per-call value "
             "statistics, the estimated weights and value sums; median of the repeats), as a share of the CPU time "
             "of the call with the estimate off; and the same with one thread, least-disturbed repeat (min) of each.", "",
             "## Fixed budget (n_probe), estimate off / on", "",
             "| data | head | C | n_probe | keys/q | mass | err off | err on | on/off | err next8 | "
             "time off s | time on s | est. cost (wall) | CPU off s | CPU on s | est. cost (CPU) | "
             "CPU 1 thread off s | on s | est. cost (CPU, 1 thread) | estimate's own CPU s | share of CPU off | "
             "1 thread, min: estimate's own CPU s | CPU off s | share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for f in r["fixed"]:
            lines.append(f"| {r['data']} | {r['head']} | {r['n_clusters']} | {f['n_probe']} | {f['keys_read']:.0f} | "
                         f"{f['mass_mean']:.3f} | {f['err_off']:.4f} | {f['err_on']:.4f} | {f['err_ratio']:.2f} | "
                         f"{f['err_on_next8']:.4f} | {f['time_off_s']:.4f} | {f['time_on_s']:.4f} | "
                         f"{100 * f['est_cost_frac']:+.1f} % | {f['cpu_off_s']:.4f} | {f['cpu_on_s']:.4f} | "
                         f"{100 * f['est_cost_frac_cpu']:+.1f} % | {f['cpu_off_1t_s']:.4f} | "
                         f"{f['cpu_on_1t_s']:.4f} | {100 * f['est_cost_frac_cpu_1t']:+.1f} % | "
                         f"{f['est_split_cpu_s']:.4f} | {100 * f['est_split_share']:.1f} % | "
                         f"{f['est_split_1t_min_s']:.4f} | {f['cpu_off_1t_min_s']:.4f} | "
                         f"{100 * f['est_split_share_1t_min']:.1f} % |")
    lines += ["", "## top_p against the fixed budgets reaching the same mean mass / the same share of rows "
              "with mass >= 0.9", "",
              "| data | head | top_p | max_keys | keys/q mean (p10-p90) | mass | rows mass >= 0.9 | err off | err on | "
              "time s | fixed n_probe | fixed keys/q | fixed mass | fixed n_probe (rows) | keys/q | rows >= 0.9 | "
              "fixed n_probe (95 % rows >= 0.9) | keys/q |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for t in r["top_p"]:
            fx = t["fixed_same_mass"]
            fxs = (f"{fx['n_probe']} | {fx['keys_read']:.0f} | {fx['mass_mean']:.3f}" if fx else "- | - | -")
            fr = t["fixed_same_rows"]
            fxs += (f" | {fr['n_probe']} | {fr['keys_read']:.0f} | {fr['rows_mass_ge_0.9']:.3f}" if fr
                    else " | - | - | -")
            f9 = t.get("fixed_95")
            fxs += f" | {f9['n_probe']} | {f9['keys_read']:.0f}" if f9 else " | - | -"
            lines.append(f"| {r['data']} | {r['head']} | {t['top_p']} | {t['max_keys']} | {t['keys_read_mean']:.0f} "
                         f"({t['keys_read_p10']:.0f}-{t['keys_read_p90']:.0f}) | {t['mass_mean']:.3f} | "
                         f"{t['rows_mass_ge_0.9']:.3f} | {t['err_off']:.4f} | {t['err_on']:.4f} | {t['time_s']:.4f} | {fxs} |")
    if prof:
        lines += ["", "## Output error against the mass kept (rows of every head, fixed budget and top_p run, pooled)", "",
                  "`sparseattn.metrics.mass_error_profile(out, ref, mass_kept)`: rows binned by the true softmax "
                  "mass of the keys read exactly; median / p90 of the row relative error.", "",
                  "| data | estimate | mass bin | rows | mean mass | median err | p90 err |", "|---|---|---|---|---|---|---|"]
        for name, pr in prof.items():
            data, case = name.split(" estimate ")
            for b in range(len(pr["rows"])):
                if pr["rows"][b]:
                    lines.append(f"| {data} | {case} | [{pr['lo'][b]:.2f}, {pr['hi'][b]:.2f}) | {pr['rows'][b]} | "
                                 f"{pr['mean_mass'][b]:.3f} | {pr['median_err'][b]:.4f} | {pr['p90_err'][b]:.4f} |")
    if equal:
        lines += [""] + equal_error_md(equal)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _stores(args: argparse.Namespace):
    """(data name, head id, q, k, v, scale) of every head the benchmark uses."""
    t = sa.data.load("store", dtype=np.float32)
    for h in [int(x) for x in args.heads16k.split(",")]:
        yield "store16k", int(t.meta.get("heads", [0, 1, 2, 3])[h]), t.q[h], t.k[h], t.v[h], t.scale
    if not args.skip_65k and os.path.exists(os.path.join(TRACE_DIR, "manifest.json")):
        t = sa.data.load("store65k", data_dir=TRACE_DIR, dtype=np.float32)
        heads = t.meta.get("heads", list(range(t.q.shape[0])))
        for h in range(t.q.shape[0]):
            yield "store65k", int(heads[h]), t.q[h], t.k[h], t.v[h], t.scale
    elif not args.skip_65k:
        print(f"store65k not found in {TRACE_DIR}: skipped")


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--quality-rows", type=positive_int, default=2048)
    ap.add_argument("--skip-65k", action="store_true")
    ap.add_argument("--heads16k", default="0,1,2,3")
    ap.add_argument("--top-p-repeats", type=positive_int, default=1)
    ap.add_argument("--equal-error-only", action="store_true",
                    help="run only the equal-output-error section (default --out results/estimate-equal-error)")
    ap.add_argument("--out", default=None, help="output path without extension (default results/estimate, or "
                    "results/estimate-equal-error with --equal-error-only)")
    args = ap.parse_args()
    try:
        heads16k = [int(x) for x in args.heads16k.split(",")]
    except ValueError:
        heads16k = []
    if not heads16k or any(h < 0 or h > 3 for h in heads16k):
        ap.error(f"--heads16k must be comma-separated head indices of the shipped store (0-3); got {args.heads16k!r}")
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "estimate-equal-error" if args.equal_error_only else "estimate")
    command = "python benchmarks/bench_estimate.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items() if k not in ("out",) and v is not False)
    if args.equal_error_only:
        equal = [r for data in _stores(args) for r in equal_error_head(*data, args.repeats, args.quality_rows)]
        with open(args.out + ".json", "w") as f:
            json.dump({"command": command, "equal_error": equal}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(["# Estimation of unread clusters at equal output error (cluster:mode=block)", "",
                                f"Command: `{command}`. Real MiniLM keys (layer 3); error vs float64 dense "
                                "attention (mean over rows).", ""] + equal_error_md(equal)) + "\n")
        print(f"wrote {args.out}.json and .md")
        return
    results, equal = [], []
    for data in _stores(args):
        results.append(run_head(*data, [4, 8, 16], args.repeats, args.quality_rows, args.top_p_repeats))
        equal += equal_error_head(*data, args.repeats, args.quality_rows)
    prof = profiles(results)
    for r in results:
        r.pop("_rows")
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command, "results": results, "mass_error_profile": prof, "equal_error": equal},
                  f, indent=1)
    write_md(results, args.out + ".md", command, prof, equal)
    print(f"wrote {args.out}.json and .md")

if __name__ == "__main__":
    main()
