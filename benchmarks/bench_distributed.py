"""Benchmark of sparseattn.distributed: a sharded key store on a local Dask cluster against one process.

What is measured, for key stores of 1M and 4M keys (E = Ev = 64, float32) over 1, 2 and 4 worker
processes of this machine:

* latency of one ``store.attend`` over a batch of 256 and 1024 queries (wall clock, client side), the
  throughput that gives, and the payload bytes moved per query (queries out, ``(output, lse)`` back);
* the same work in one clean process: the same shard code (``Shard``: selector built once, the selected
  keys gathered and attended) over all keys, no Dask, all cores.  Both run *interleaved*, one repeat of
  the baseline then one of the distributed path, so drifting load on a shared machine hits both; the
  overhead is the median over repeats of ``t_distributed / t_single - 1``;
* the split of a distributed call into the slowest shard's compute (timed inside the workers) and
  the rest (scheduling, serialisation, transfer, merge);
* the constants of the scaling model (round trip of an empty actor call, merge cost per query per shard,
  shard compute per key per query) and the model's prediction for 100M-1B keys;
* memory: a 4M-key store (2 GiB of keys and values) over 4 workers whose ``memory_limit`` is below the
  store's size answers queries, and one process whose address space (``RLIMIT_AS``) may grow by that
  same limit beyond what its imports took cannot even hold the keys and values.

Run: ``python benchmarks/bench_distributed.py`` (about 30-60 minutes on 2 busy cores);
``--quick`` for a 2-minute smoke run.  Writes ``benchmarks/results/distributed.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

E = EV = 64
SEED = 1234
CHUNK = 1 << 16
RESULTS = Path(__file__).resolve().parent / "results"


def make_block(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values of global rows [start, stop): Gaussian, the same whatever the block boundaries."""
    import numpy as np

    ks, vs = [], []
    for c in range(start // CHUNK, (stop - 1) // CHUNK + 1):
        rng = np.random.default_rng([SEED, c])
        kc = rng.standard_normal((CHUNK, E), dtype=np.float32)
        vc = rng.standard_normal((CHUNK, EV), dtype=np.float32)
        lo, hi = max(start, c * CHUNK) - c * CHUNK, min(stop, (c + 1) * CHUNK) - c * CHUNK
        ks.append(kc[lo:hi])
        vs.append(vc[lo:hi])
    return np.concatenate(ks), np.concatenate(vs)


def make_queries(n: int) -> np.ndarray:
    return np.random.default_rng([SEED, 999]).standard_normal((n, E), dtype=np.float32)


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


# ------------------------------------------------------------------------------------ single process
def baseline_server(n: int, selector: str, k: int, threads: int, chunk: int) -> None:
    """Clean process: build one shard over every key, then answer "attend B" lines with timings (JSON)."""
    from sparseattn.distributed import Shard

    t0 = time.perf_counter()
    shard = Shard(selector, n, 0, threads)
    shard.load(make_block, CHUNK)
    shard.finalize()
    build = time.perf_counter() - t0
    q_all = make_queries(4096)
    scale = 1.0 / np.sqrt(E)
    shard.attend(q_all[:8], k, False, np.arange(8), scale)  # compile / warm
    print(json.dumps({"ready": True, "build_s": build, "rss": rss()}), flush=True)
    for line in sys.stdin:
        b = int(line)
        q = q_all[:b]
        t0 = time.perf_counter()
        outs = [shard.attend(q[lo:lo + chunk], k, False, np.arange(lo, min(lo + chunk, b)), scale)
                for lo in range(0, b, chunk)]
        dt = time.perf_counter() - t0
        out = np.concatenate([o for o, _ in outs])
        print(json.dumps({"t": dt, "checksum": float(np.abs(out).sum()), "rss": rss()}), flush=True)


class Baseline:
    """The single-process baseline as a long-lived clean subprocess (so repeats interleave)."""

    def __init__(self, n: int, selector: str, k: int, threads: int, chunk: int) -> None:
        cmd = [sys.executable, __file__, "--role", "baseline", "--n", str(n), "--selector", selector,
               "--k", str(k), "--threads", str(threads), "--chunk", str(chunk)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"baseline process ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def attend(self, b: int) -> dict[str, Any]:
        self.proc.stdin.write(f"{b}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# -------------------------------------------------------------------------------------- distributed
def start_cluster(n_workers: int, threads: int, memory_limit: str | int = 0):
    import dask
    from distributed import Client, LocalCluster

    dask.config.set({"distributed.worker.memory.spill": False, "distributed.worker.memory.target": False,
                     "distributed.worker.memory.pause": False})
    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads, processes=True,
                           dashboard_address=None, silence_logs=logging.CRITICAL, memory_limit=memory_limit)
    return cluster, Client(cluster)


def empty_call_seconds(store, repeats: int = 30) -> float:
    """Median round trip of an actor call that does nothing (scheduling + comms floor)."""
    actor = store.actor(0)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        actor.busy_seconds().result()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def merge_seconds(p: int, b: int) -> float:
    import sparseattn as sa

    rng = np.random.default_rng(0)
    o = rng.standard_normal((p, b, EV), dtype=np.float32)
    lse = rng.standard_normal((p, b), dtype=np.float32)
    sa.merge_attention(o, lse)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        sa.merge_attention(o, lse)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_size(n: int, workers: list[int], batches: list[int], repeats: int, selector: str, k: int,
               cores: int, chunk: int) -> list[dict[str, Any]]:
    from sparseattn.distributed import ShardedKeyStore

    rows = []
    for w in workers:
        threads = max(1, cores // w)
        print(f"[{time.strftime('%H:%M:%S')}] n={n} workers={w} x {threads} threads", flush=True)
        base = Baseline(n, selector, k, cores, chunk)
        cluster, client = start_cluster(w, threads)
        try:
            t0 = time.perf_counter()
            store = ShardedKeyStore(client, make_block, n_keys=n, selector=selector, block_rows=CHUNK,
                                    batch_size=chunk)
            build = time.perf_counter() - t0
            q_all = make_queries(max(batches))
            store.attend(q_all[:8], k=k)  # compile / warm every worker
            empty = empty_call_seconds(store)
            mem = store.worker_memory()
            for b in batches:
                q = q_all[:b]
                t_single, t_dist, ratios, compute, bytes_q = [], [], [], [], []
                for r in range(repeats):
                    res = base.attend(b)
                    busy0 = store.busy_seconds()
                    stats0 = dict(store.stats)
                    t1 = time.perf_counter()
                    out, _ = store.attend(q, k=k)
                    td = time.perf_counter() - t1
                    busy = [a - c for a, c in zip(store.busy_seconds(), busy0, strict=True)]
                    moved = (store.stats["bytes_sent"] - stats0["bytes_sent"]
                             + store.stats["bytes_received"] - stats0["bytes_received"])
                    t_single.append(res["t"])
                    t_dist.append(td)
                    ratios.append(td / res["t"])
                    compute.append(max(busy))
                    bytes_q.append(moved / b)
                    print(f"   b={b} rep={r}: single {res['t']:.3f}s  distributed {td:.3f}s  "
                          f"(slowest shard computes {max(busy):.3f}s)", flush=True)
                row = {
                    "n_keys": n, "workers": w, "threads_per_worker": threads, "batch": b, "selector": selector,
                    "k": k, "shards": store.n_shards, "chunk": chunk, "repeats": repeats,
                    "single_s": statistics.median(t_single), "distributed_s": statistics.median(t_dist),
                    "overhead": statistics.median(ratios) - 1.0,
                    "ratios": ratios,
                    "throughput_qps": b / statistics.median(t_dist),
                    "single_throughput_qps": b / statistics.median(t_single),
                    "slowest_shard_compute_s": statistics.median(compute),
                    "non_compute_s": statistics.median([t - c for t, c in zip(t_dist, compute, strict=True)]),
                    "payload_bytes_per_query": statistics.median(bytes_q),
                    "empty_call_s": empty, "merge_s": merge_seconds(store.n_shards, b),
                    "store_build_s": build, "baseline_build_s": base.info["build_s"],
                    "worker_rss_bytes": mem, "baseline_rss_bytes": base.info["rss"],
                    "compute_per_key_query_s": statistics.median(compute) / (b * n / store.n_shards),
                }
                rows.append(row)
                print(f"   => overhead {row['overhead'] * 100:+.1f}%  (median of {repeats})", flush=True)
            store.close()
        finally:
            base.close()
            client.close()
            cluster.close()
    return rows


# --------------------------------------------------------------------------------------------- memory
def rlimit_probe(n: int, limit: int, selector: str) -> None:
    """Clean process: allow ``limit`` bytes of address space beyond the imports, then try to hold n keys."""
    import resource

    import sparseattn  # noqa: F401  (count the library's imports in the baseline, not in the allowance)
    from sparseattn.distributed import Shard

    def vm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    base = vm()
    resource.setrlimit(resource.RLIMIT_AS, (base + limit, base + limit))
    res: dict[str, Any] = {"n_keys": n, "vm_after_imports": base, "allowance": limit}
    try:
        shard = Shard(selector, n, 0, 1)
        shard.load(make_block, CHUNK)
        shard.finalize()
        shard.attend(make_queries(32), 64, False, np.arange(32), 1 / 8)
        res.update(ok=True, peak_vm=vm())
    except MemoryError as exc:
        res.update(ok=False, error=f"MemoryError: {exc}")
    print(json.dumps(res), flush=True)


def bench_memory(n: int, n_workers: int, limit: int, selector: str, chunk: int) -> dict[str, Any]:
    from sparseattn.distributed import ShardedKeyStore

    print(f"[{time.strftime('%H:%M:%S')}] memory: {n} keys over {n_workers} workers, limit {limit} B each",
          flush=True)
    cluster, client = start_cluster(n_workers, 1, memory_limit=limit)
    res: dict[str, Any] = {"n_keys": n, "workers": n_workers, "memory_limit_per_worker": limit,
                           "selector": selector, "chunk": chunk}
    try:
        client_rss0 = rss()
        store = ShardedKeyStore(client, make_block, n_keys=n, selector=selector, block_rows=CHUNK,
                                batch_size=chunk)
        q = make_queries(256)
        t0 = time.perf_counter()
        out, lse = store.attend(q, k=64)
        res.update(store_nbytes=store.nbytes, attend_256_s=time.perf_counter() - t0,
                   answered=bool(np.isfinite(lse).all()), worker_rss_bytes=store.worker_memory(),
                   client_rss_growth_bytes=rss() - client_rss0)
        res["max_worker_rss_fraction_of_limit"] = max(res["worker_rss_bytes"].values()) / limit
        store.close()
    finally:
        client.close()
        cluster.close()
    probes = []
    for m in (n, n // n_workers):  # the whole store, and one shard's worth as the control
        cmd = [sys.executable, __file__, "--role", "rlimit", "--n", str(m), "--limit", str(limit),
               "--selector", selector]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        probes.append(json.loads(lines[-1]) if lines else {"n_keys": m, "ok": False,
                                                           "error": f"exit {p.returncode}: {p.stderr[-300:]}"})
    res["single_process_rlimit"] = probes
    print("   ", json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------------------------------------- model
def scaling_model(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Constants from the measured rows and predicted latency of a 1024-query batch at 100M-1B keys."""
    c_key = statistics.median(r["compute_per_key_query_s"] for r in rows)
    empty = statistics.median(r["empty_call_s"] for r in rows)
    merge = statistics.median(r["merge_s"] / (r["shards"] * r["batch"]) for r in rows)
    per_call = statistics.median((r["non_compute_s"] - r["merge_s"]) / max(1, -(-r["batch"] // r["chunk"]))
                                 for r in rows)
    bytes_q = (E * 4 + 8) + (EV + 1) * 4  # per query per shard: query + position out, output + lse back
    bandwidth = 1.25e9  # bytes/s of a 10 Gbit/s link (the model's assumption, not measured here)
    shard_keys = 1 << 22  # 4M keys per worker: 2 GiB of float32 keys and values at E = Ev = 64
    preds = []
    for n in (100_000_000, 1_000_000_000):
        p = -(-n // shard_keys)
        b = 1024
        compute = c_key * b * shard_keys
        net = p * b * bytes_q / bandwidth
        preds.append({"n_keys": n, "shards": p, "batch": b, "compute_s": compute, "merge_s": merge * p * b,
                      "scheduling_s": per_call * -(-b // rows[0]["chunk"]), "network_s": net,
                      "total_s": compute + merge * p * b + per_call * -(-b // rows[0]["chunk"]) + net})
    return {"compute_per_key_query_s": c_key, "empty_call_s": empty, "merge_per_query_shard_s": merge,
            "non_compute_per_call_s": per_call, "payload_bytes_per_query_shard": bytes_q,
            "assumed_bandwidth_Bps": bandwidth, "keys_per_shard": shard_keys, "predictions": preds}


# --------------------------------------------------------------------------------------------- report
def write_markdown(result: dict[str, Any], path: Path) -> None:
    lines = ["# sparseattn.distributed benchmark", "",
             f"Machine: {result['machine']}; k={result['k']} keys per query per shard, E = Ev = 64 float32; "
             f"queries sent in calls of {result['chunk']}; medians over interleaved repeats (one process, then "
             f"distributed); overhead = median of the per-repeat ratios - 1; rest = wall - slowest shard's "
             f"compute (scheduling, serialisation, transfer, merge).", "",
             "| selector | keys | workers x threads | batch | one process (s) | distributed (s) | overhead | "
             "slowest shard compute (s) | rest (s) | rest / distributed | queries/s | payload B/query |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| `{r['selector']}` | {r['n_keys']:,} | {r['workers']} x {r['threads_per_worker']} | {r['batch']} | "
                     f"{r['single_s']:.3f} | {r['distributed_s']:.3f} | {r['overhead'] * 100:+.1f}% | "
                     f"{r['slowest_shard_compute_s']:.3f} | {r['non_compute_s']:.3f} | "
                     f"{r['non_compute_s'] / r['distributed_s'] * 100:.1f}% | "
                     f"{r['throughput_qps']:.0f} | {r['payload_bytes_per_query']:.0f} |")
    m = result.get("memory")
    if m:
        lines += ["", "## Memory limit", "",
                  f"Store: {m['n_keys']:,} keys, {m['store_nbytes'] / 2**30:.2f} GiB of keys + values over "
                  f"{m['workers']} workers with `memory_limit={m['memory_limit_per_worker'] / 2**30:.2f} GiB` "
                  f"each: answered 256 queries in {m['attend_256_s']:.2f} s; worker RSS "
                  + ", ".join(f"{v / 2**30:.2f}" for v in m["worker_rss_bytes"].values())
                  + f" GiB (max {m['max_worker_rss_fraction_of_limit'] * 100:.0f}% of the limit); client RSS grew "
                  f"{m['client_rss_growth_bytes'] / 2**20:.0f} MiB.", ""]
        for p in m["single_process_rlimit"]:
            verdict = "ran" if p.get("ok") else f"failed ({p.get('error', '')[:80]})"
            lines.append(f"* one process, RLIMIT_AS = address space after imports + "
                         f"{m['memory_limit_per_worker'] / 2**30:.2f} GiB, {p['n_keys']:,} keys: {verdict}")
    s = result.get("model")
    if s:
        lines += ["", "## Scaling model", "",
                  "latency(batch B, P shards) = max_p compute_p + merge + scheduling + network, with",
                  f"compute_p = c * B * S_p, c = {s['compute_per_key_query_s']:.3g} s per key per query "
                  f"(measured, exact top-k); merge = m * P * B, m = {s['merge_per_query_shard_s']:.3g} s; "
                  f"scheduling = r * ceil(B / chunk), r = {s['non_compute_per_call_s']:.3g} s per call "
                  f"(measured non-compute time per call; empty actor round trip {s['empty_call_s'] * 1e3:.1f} ms);"
                  f" network = P * B * {s['payload_bytes_per_query_shard']} B / bandwidth "
                  f"({s['assumed_bandwidth_Bps'] / 1e9:.2f} GB/s assumed).", "",
                  "| keys | shards of 4M | compute (s) | merge (s) | scheduling (s) | network (s) | total (s) |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for p in s["predictions"]:
            lines.append(f"| {p['n_keys']:,} | {p['shards']} | {p['compute_s']:.2f} | {p['merge_s']:.3f} | "
                         f"{p['scheduling_s']:.3f} | {p['network_s']:.3f} | {p['total_s']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text}")
    return value


def _int_list(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 256,1024; got "
                                         f"{text!r}")
    return [_positive_int(t) for t in items]


def main(argv: list[str] | None = None) -> None:
    ap = _Parser(prog="bench_distributed.py", description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="main", choices=["main", "baseline", "rlimit"])
    ap.add_argument("--sizes", type=_int_list, default=None,
                    help=f"store sizes in keys (default {1 << 20},{1 << 22}; --quick: {1 << 18})")
    ap.add_argument("--workers", type=_int_list, default=None, help="worker counts (default 1,2,4; --quick: 1,2)")
    ap.add_argument("--batches", type=_int_list, default=None, help="query batches (default 256,1024; --quick: 256)")
    ap.add_argument("--large-batches", type=_int_list, default=None,
                    help="batches for sizes above 1M (default: --batches)")
    ap.add_argument("--repeats", type=_positive_int, default=None, help="interleaved repeats (default 3; --quick: 2)")
    ap.add_argument("--selector", default="topk")
    ap.add_argument("--k", type=_positive_int, default=64)
    ap.add_argument("--chunk", type=_positive_int, default=128, help="queries per shard call (bounds score memory)")
    ap.add_argument("--cores", type=_positive_int, default=os.cpu_count() or 1)
    ap.add_argument("--memory-workers", type=_positive_int, default=4)
    ap.add_argument("--memory-limit", type=_positive_float, default=None,
                    help="GiB per worker in the memory test (default 1.5; --quick: 0.4)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="a small run: defaults --sizes, --workers, --batches, --repeats and the memory test to "
                         "small values (flags given explicitly are kept)")
    ap.add_argument("--append", action="store_true", help="add the rows to an existing --out file")
    ap.add_argument("--n", type=_positive_int)
    ap.add_argument("--threads", type=_positive_int, default=1)
    ap.add_argument("--limit", type=_positive_int)
    ap.add_argument("--out", default=str(RESULTS / "distributed.json"))
    a = ap.parse_args(argv)
    try:
        import sparseattn

        sparseattn.get_selector(a.selector)
    except (ValueError, TypeError) as exc:
        ap.error(f"argument --selector: {str(exc).splitlines()[0]}")
    if a.role != "main" and a.n is None:
        ap.error(f"argument --n: required with --role {a.role}")
    if a.role == "baseline":
        return baseline_server(a.n, a.selector, a.k, a.threads, a.chunk)
    if a.role == "rlimit":
        if a.limit is None:
            ap.error("argument --limit: required with --role rlimit")
        return rlimit_probe(a.n, a.limit, a.selector)
    quick = {"sizes": [1 << 18], "workers": [1, 2], "batches": [256], "repeats": 2, "memory_limit": 0.4}
    full = {"sizes": [1 << 20, 1 << 22], "workers": [1, 2, 4], "batches": [256, 1024], "repeats": 3,
            "memory_limit": 1.5}
    for name, value in (quick if a.quick else full).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    sizes, workers, batches = a.sizes, a.workers, a.batches
    rows = []
    large = a.large_batches or batches
    for n in sizes:
        rows += bench_size(n, workers, batches if n <= 1 << 20 else large, a.repeats, a.selector, a.k, a.cores,
                           a.chunk)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "selector": a.selector, "k": a.k, "chunk": a.chunk, "repeats": a.repeats, "rows": rows,
              "load_average_at_end": os.getloadavg()}
    out = Path(a.out)
    if a.append and out.exists():
        old = json.loads(out.read_text())
        old["rows"] += rows
        result = {**old, "load_average_at_end": result["load_average_at_end"]}
    result["model"] = scaling_model([r for r in result["rows"] if r["selector"] == "topk"] or result["rows"])
    if not a.skip_memory:
        n_mem = (1 << 18) if a.quick else (1 << 22)
        limit = int(a.memory_limit * 2**30)
        result["memory"] = bench_memory(n_mem, a.memory_workers, limit, a.selector, 32)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
