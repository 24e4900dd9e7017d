"""Study: which decode index finds the keys that matter at the fewest bytes read per step.

A scratch prototype (numpy + one Numba read kernel), not library code: one head, d = 64, keys laid out as
the decode cache lays them out (sinks + window exact; every other key in 4,096-key segments, each
clustered on its own by spherical k-means of its centred keys, :class:`sparseattn.index.cluster.ClusterIndex`),
and for every design and budget, per decode query:

* planted-key recall (passkey workloads: :func:`sparseattn.data.passkey`, the keys planted for the query),
* recall@64 of the exact top-64 (float64 scores), softmax mass of the keys read (float64),
* bytes read per step per head (index scan + exact reads of keys and values, float32 K and V: 512 B a key),
  and index bytes / KV bytes.

Designs:

(a) ``mean``: clusters ranked by the score of their mean key (today's routing), ``n_probe`` read.
(b) ``ball``: ranked by the upper bound ``q.mu_c + |q| r_c`` (r_c: largest distance of a member to its mean);
    ``pcabox``: ranked by the bound ``q.mu_c + sum_j max(q'_j lo_cj, q'_j hi_cj) + |q_perp| e_c`` with
    ``q' = U_s^T q`` in the segment's top-8 principal directions of the residuals ``k - mu_c``, per-cluster
    box [lo, hi] of the members' projections and e_c the largest residual norm off that subspace.
(c) ``outlier x%``: the x % of keys farthest from their cluster mean (per segment) scanned exactly, the rest
    routed by mean (means recomputed without them).
(d) ``sketch``: every key coded (int8 or 4-bit per dimension of the segment-centred key; or 1-bit:
    RaBitQ-style signs of the randomly rotated residual from the segment mean or from the key's cluster
    mean, plus one float16 factor per key), the whole code scanned, the top R by estimated score
    re-scored exactly (read: K and V of R keys).
(f) (a) or the ball bound of (b) picks a fraction 1/F of the clusters, only their keys' 1-bit residual codes
    (d) are scanned, the top R re-scored exactly.
(g) cascade: (f) with the ball bound, the top R1 of the 1-bit scan re-ranked by their int4 or int8 codes
    (d) or by their exact float32 keys (no extra index), the top R2 of those read exactly.
(e) ``fine`` (16-key clusters, flat routing: RetroInfer's layout) and ``2level`` (16-key clusters grouped
    into super-clusters of 16 by k-means of their means; the top S super-clusters by mean score are opened
    and their clusters ranked by mean score).

The speed floor: a Numba kernel that sums the bytes of an array (contiguous, and 512-byte rows gathered at
random) gives the time of a pure read, scaled to 8 heads, against torch SDPA's decode step (measured here at
131,072 keys, 8 heads, d 64; DESIGN.md's 245 ms at 1,048,576).

Run: ``PYTHONPATH=. python benchmarks/study_decode_index.py`` (about 10 minutes on 2 busy cores); writes
``benchmarks/results/decode-index-study.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
D = 64
SCALE = 1.0 / np.sqrt(D)
SINKS, WINDOW, SEGMENT = 4, 64, 4096
KV_BYTES = 2 * D * 4  # float32 key + value per key read exactly
MEAN_BYTES = D + 4  # int8 routing vector + float32 scale per cluster
SDPA_MS_1M = 245.0  # DESIGN.md, 2026-12-01: torch SDPA decode step, (1, 8, 1048576, 64) float32
SDPA_MS_131K = 29.0  # DESIGN.md, same run, (1, 8, 131072, 64)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def _positive_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        print(f"error: {flag} must be a comma list of positive integers; got {text!r}", file=sys.stderr)
        raise SystemExit(2)
    return out


# ------------------------------------------------------------------------------------------ workloads
def workload(kind: str, n: int, nq: int, seed: int) -> dict:
    from sparseattn import data

    if kind.startswith("passkey"):
        bg = kind.split("-", 1)[1]
        w = data.passkey(n, D, heads=1, n_planted=4, n_queries=nq, background=bg, seed=seed)
        return {"k": w.keys[0], "q": w.queries[0], "planted": w.positions[0]}
    q, k, _ = data.clustered(n, D, n_queries=nq, dv=1, seed=seed)
    return {"k": k, "q": q, "planted": None}


# ------------------------------------------------------------------------------------------ index layout
def kmeans_labels(x: np.ndarray, c: int, seed: int) -> np.ndarray:
    from sparseattn.index.cluster import ClusterIndex

    c = max(1, min(c, x.shape[0]))
    if c == 1:
        return np.zeros(x.shape[0], np.int64)
    idx = ClusterIndex(n_clusters=c, n_probe=1, n_iter=5, seed=seed, spherical=True, assign="ip", n_threads=1)
    return idx.labels(np.ascontiguousarray(x, dtype=np.float32))


def build(k: np.ndarray, cluster_size: int) -> dict:
    """Segments of the routed region [SINKS, n - WINDOW), clusters of ~cluster_size keys in each: per key
    its global cluster id (-1: exact), segment id; per cluster mean, count, segment."""
    n = k.shape[0]
    cid = np.full(n, -1, np.int64)
    seg_of_key = np.full(n, -1, np.int64)
    lo, hi = SINKS, n - WINDOW
    nc = 0
    for s, a in enumerate(range(lo, hi, SEGMENT)):
        b = min(a + SEGMENT, hi)
        lab = kmeans_labels(k[a:b], (b - a) // cluster_size, seed=s)
        _, lab = np.unique(lab, return_inverse=True)
        cid[a:b] = nc + lab
        seg_of_key[a:b] = s
        nc += int(lab.max()) + 1
    routed = cid >= 0
    counts = np.bincount(cid[routed], minlength=nc)
    sums = np.zeros((nc, D))
    np.add.at(sums, cid[routed], k[routed].astype(np.float64))
    means = sums / counts[:, None]
    seg_of_cluster = np.zeros(nc, np.int64)
    seg_of_cluster[cid[routed]] = seg_of_key[routed]
    return {"cid": cid, "seg": seg_of_key, "counts": counts, "means": means, "cseg": seg_of_cluster, "nc": nc}


def spread_stats(k: np.ndarray, ix: dict, rank: int = 8) -> dict:
    """Per cluster: ball radius; per segment top-``rank`` principal directions of the residuals; per cluster
    the box of member projections on them and the largest residual norm off them."""
    cid, routed = ix["cid"], ix["cid"] >= 0
    res = np.zeros_like(k, dtype=np.float64)
    res[routed] = k[routed] - ix["means"][cid[routed]]
    rn = np.linalg.norm(res, axis=1)
    nc = ix["nc"]
    radius = np.zeros(nc)
    np.maximum.at(radius, cid[routed], rn[routed])
    nseg = int(ix["seg"].max()) + 1
    U = np.zeros((nseg, D, rank))
    proj = np.zeros((k.shape[0], rank))
    for s in range(nseg):
        m = ix["seg"] == s
        _, _, vt = np.linalg.svd(res[m], full_matrices=False)
        U[s] = vt[:rank].T
        proj[m] = res[m] @ U[s]
    perp = np.sqrt(np.maximum(rn ** 2 - (proj ** 2).sum(1), 0.0))
    lo = np.full((nc, rank), np.inf)
    hi = np.full((nc, rank), -np.inf)
    np.minimum.at(lo, cid[routed], proj[routed])
    np.maximum.at(hi, cid[routed], proj[routed])
    e = np.zeros(nc)
    np.maximum.at(e, cid[routed], perp[routed])
    return {"resnorm": rn, "radius": radius, "U": U, "lo": lo, "hi": hi, "e": e}


# ------------------------------------------------------------------------------------------ oracle
def truth(k: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax weights (n,) and exact top-64 positions of one query: the one oracle."""
    s = k.astype(np.float64) @ q.astype(np.float64) * SCALE
    w = np.exp(s - s.max())
    w /= w.sum()
    return w, np.argpartition(-s, 64)[:64]


# ------------------------------------------------------------------------------------------ evaluation
class Acc:
    """Per-(design, budget) accumulator of per-query metrics."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[str, list[float]]] = {}
        self.meta: dict[tuple[str, str], dict] = {}

    def add(self, design: str, budget: str, *, planted: float | None, recall: float, mass: float,
            keys: float, nbytes: float, index_ratio: float) -> None:
        r = self.rows.setdefault((design, budget), {"planted": [], "recall64": [], "mass": [], "keys": [],
                                                    "bytes": []})
        if planted is not None:
            r["planted"].append(planted)
        r["recall64"].append(recall)
        r["mass"].append(mass)
        r["keys"].append(keys)
        r["bytes"].append(nbytes)
        self.meta[(design, budget)] = {"index_ratio": index_ratio}

    def table(self) -> list[dict]:
        out = []
        for (design, budget), r in self.rows.items():
            out.append({"design": design, "budget": budget,
                        "planted_recall": float(np.mean(r["planted"])) if r["planted"] else None,
                        "planted_recall_min": float(np.min(r["planted"])) if r["planted"] else None,
                        "recall64": float(np.mean(r["recall64"])), "recall64_min": float(np.min(r["recall64"])),
                        "mass": float(np.mean(r["mass"])), "keys_read": float(np.mean(r["keys"])),
                        "bytes_per_step_head": float(np.mean(r["bytes"])), **self.meta[(design, budget)]})
        return out


def eval_ranked(acc: Acc, design: str, budgets: list[int], rank_of_cluster: np.ndarray, ix: dict,
                w: np.ndarray, top: np.ndarray, planted: np.ndarray | None, exact: np.ndarray,
                scan_bytes: float, index_ratio: float, members: np.ndarray | None = None,
                extra_keys: int = 0) -> None:
    """Clusters read in the order ``rank_of_cluster`` (0 = first; >= nc: never), the first P for P in
    ``budgets``; ``exact`` marks keys always read (their cluster id is ignored)."""
    cid = ix["cid"] if members is None else members
    nc = rank_of_cluster.size
    order = np.argsort(rank_of_cluster, kind="stable")
    routed = (cid >= 0) & ~exact
    cmass = np.bincount(cid[routed], weights=w[routed], minlength=nc)
    ccount = np.bincount(cid[routed], minlength=nc)
    cum_mass = np.cumsum(cmass[order])
    cum_keys = np.cumsum(ccount[order])
    ex_mass, ex_keys = float(w[exact].sum()), int(exact.sum())

    def key_rank(ids: np.ndarray) -> np.ndarray:
        r = np.full(ids.size, -1, np.int64)
        c = cid[ids]
        ok = (c >= 0) & ~exact[ids]
        r[ok] = rank_of_cluster[c[ok]]
        return r  # -1: read exactly

    tr, pr = key_rank(top), key_rank(planted.ravel()) if planted is not None else None
    n_open = int(np.count_nonzero(rank_of_cluster < nc))
    for P in budgets:
        P_ = min(P, n_open)
        if P_ <= 0:
            continue
        rec = float(np.mean((tr < P_) & (tr < nc) | (tr < 0)))
        pl = None if pr is None else float(np.mean(((pr < P_) & (pr < nc)) | (pr < 0)))
        keys = ex_keys + int(cum_keys[P_ - 1]) + extra_keys
        acc.add(design, str(P), planted=pl, recall=rec, mass=ex_mass + float(cum_mass[P_ - 1]), keys=keys,
                nbytes=scan_bytes + keys * KV_BYTES, index_ratio=index_ratio)


def quantize(kc: np.ndarray, bits: int) -> np.ndarray:
    """Dequantised per-dimension symmetric codes of centred keys (scale per dimension and segment)."""
    levels = 2 ** (bits - 1) - 1
    sc = np.abs(kc).max(axis=0) / levels
    sc[sc == 0] = 1.0
    return (np.clip(np.rint(kc / sc), -levels, levels) * sc).astype(np.float32)


def run_case(kind: str, n: int, nq: int, seed: int, probes: list[int], cands: list[int],
             fine_designs: bool = True) -> dict:
    t0 = time.perf_counter()
    wl = workload(kind, n, nq, seed)
    k, Q, planted = wl["k"], wl["q"], wl["planted"]
    log(f"[{kind} n={n}] data {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    ix = build(k, 64)
    sp = spread_stats(k, ix)
    fine = build(k, 16 if fine_designs else SEGMENT)
    log(f"[{kind} n={n}] clusters {ix['nc']} (fine {fine['nc']}) {time.perf_counter() - t0:.1f}s")
    kv_total = n * KV_BYTES
    exact = np.zeros(n, bool)
    exact[:SINKS] = True
    exact[n - WINDOW:] = True
    nc = ix["nc"]
    # (e) super-clusters: k-means of the fine clusters' means within each segment, ~16 per super-cluster
    t0 = time.perf_counter()
    fsup = np.zeros(fine["nc"], np.int64)
    ns = 0
    for s in range(int(fine["cseg"].max()) + 1):
        members = np.flatnonzero(fine["cseg"] == s)
        lab = kmeans_labels(fine["means"][members].astype(np.float32), max(1, members.size // 16), seed=s)
        _, lab = np.unique(lab, return_inverse=True)
        fsup[members] = ns + lab
        ns += int(lab.max()) + 1
    sup_count = np.bincount(fsup, weights=fine["counts"], minlength=ns)
    sup_mean = np.zeros((ns, D))
    np.add.at(sup_mean, fsup, fine["means"] * fine["counts"][:, None])
    sup_mean /= sup_count[:, None]
    # (c) outliers by residual norm, per segment; means recomputed without them
    routed = ix["cid"] >= 0
    out_sets = {}
    for frac in (0.01, 0.02, 0.05):
        o = np.zeros(n, bool)
        for s in range(int(ix["seg"].max()) + 1):
            m = np.flatnonzero(ix["seg"] == s)
            cnt = max(1, int(round(frac * m.size)))
            o[m[np.argpartition(-sp["resnorm"][m], cnt - 1)[:cnt]]] = True
        keep = routed & ~o
        cnt = np.bincount(ix["cid"][keep], minlength=nc)
        sums = np.zeros((nc, D))
        np.add.at(sums, ix["cid"][keep], k[keep].astype(np.float64))
        out_sets[frac] = (o, sums / np.maximum(cnt, 1)[:, None], cnt)
    # (d) sketches of centred keys (segment mean subtracted: exact for softmax within a segment's
    # ranking only up to q.mean_s, which is added back)
    seg = ix["seg"]
    nseg = int(seg.max()) + 1
    seg_mean = np.zeros((nseg, D))
    for s in range(nseg):
        seg_mean[s] = k[seg == s].mean(0)
    kc = k.astype(np.float64).copy()
    kc[routed] -= seg_mean[seg[routed]]
    sk = {}
    for bits in (8, 4):
        deq = np.zeros((n, D), np.float32)
        for s in range(nseg):
            m = seg == s
            deq[m] = quantize(kc[m], bits)
        sk[f"int{bits}"] = (deq, n * (D * bits / 8) + nseg * D * 4)
    # 1-bit (RaBitQ-style, without its error bound): a random rotation P, then per key the signs b of
    # P r and one factor f = |r|^2 / |r|_1, so that q.r ~ (Pq).b * f (exact when r is along b); r is the
    # key minus its segment mean ("1bit seg") or minus its 64-key cluster's mean ("1bit resid")
    P, _ = np.linalg.qr(np.random.default_rng(12).standard_normal((D, D)))
    resid = np.zeros((n, D))
    resid[routed] = k[routed] - ix["means"][ix["cid"][routed]]
    for name, r in (("1bit seg", kc), ("1bit resid", resid)):
        rr = r @ P.T
        f = (rr ** 2).sum(1) / np.maximum(np.abs(rr).sum(1), 1e-30)
        sk[name] = ((np.where(rr >= 0, 1.0, -1.0) * f[:, None]) @ P).astype(np.float32), n * (D / 8 + 2)
    del resid
    log(f"[{kind} n={n}] index variants {time.perf_counter() - t0:.1f}s")

    acc = Acc()
    t0 = time.perf_counter()
    for t in range(Q.shape[0]):
        q = Q[t].astype(np.float64)
        w, top = truth(k, Q[t])
        pl = planted[t] if planted is not None else None
        qn = np.linalg.norm(q)
        ms = ix["means"] @ q
        # (a) mean routing
        rk = np.empty(nc, np.int64)
        rk[np.argsort(-ms, kind="stable")] = np.arange(nc)
        eval_ranked(acc, "a mean", probes, rk, ix, w, top, pl, exact, nc * MEAN_BYTES, nc * MEAN_BYTES / kv_total)
        # (b) ball bound and PCA-box bound
        b1 = ms + qn * sp["radius"]
        rk[np.argsort(-b1, kind="stable")] = np.arange(nc)
        eval_ranked(acc, "b ball bound", probes, rk, ix, w, top, pl, exact, nc * (MEAN_BYTES + 4),
                    nc * (MEAN_BYTES + 4) / kv_total)
        qp = np.einsum("sdr,d->sr", sp["U"], q)[ix["cseg"]]  # (nc, r)
        qperp = np.sqrt(np.maximum(qn ** 2 - (qp ** 2).sum(1), 0.0))
        b2 = ms + np.maximum(qp * sp["lo"], qp * sp["hi"]).sum(1) + qperp * sp["e"]
        box_bytes = nc * (MEAN_BYTES + 2 * 8 * 2 + 4) + nseg * D * 8 * 2  # fp16 box, fp16 basis
        rk[np.argsort(-b2, kind="stable")] = np.arange(nc)
        eval_ranked(acc, "b pca-box bound", probes, rk, ix, w, top, pl, exact, box_bytes, box_bytes / kv_total)
        # (c) outliers exact + mean routing
        for frac, (o, om, ocnt) in out_sets.items():
            s2 = om @ q
            s2[ocnt == 0] = -np.inf
            rk[np.argsort(-s2, kind="stable")] = np.arange(nc)
            ex = exact | o
            eval_ranked(acc, f"c outliers {frac:.0%} + mean", probes, rk, ix, w, top, pl, ex,
                        nc * MEAN_BYTES, nc * MEAN_BYTES / kv_total)
        # (d) sketch scan + exact re-score of the top R
        base = np.zeros(n)
        base[routed] = seg_mean[seg[routed]] @ q
        cbase = np.zeros(n)
        cbase[routed] = ms[ix["cid"][routed]]
        for name, (deq, code_bytes) in sk.items():
            est = deq @ Q[t] + (cbase if name == "1bit resid" else base)
            est[exact] = np.inf
            order = np.argsort(-est, kind="stable")
            rank = np.empty(n, np.int64)
            rank[order] = np.arange(n)
            cm = np.cumsum(w[order])
            ne = int(exact.sum())
            for R in cands:
                lim = ne + R
                rec = float(np.mean(rank[top] < lim))
                pr = None if pl is None else float(np.mean(rank[pl] < lim))
                acc.add(f"d sketch {name} + rescore", str(R), planted=pr, recall=rec, mass=float(cm[lim - 1]),
                        keys=lim, nbytes=code_bytes + lim * KV_BYTES, index_ratio=code_bytes / kv_total)
            if name == "1bit resid":
                est_resid = est
            if name == "int8":
                est8 = est
            if name == "int4":
                est4 = est
        # (f) 1-bit residual codes scanned only in the clusters routing ranks first (a fraction F of them),
        # then the top R re-scored exactly
        for route, score, rb in (("mean", ms, MEAN_BYTES), ("ball", b1, MEAN_BYTES + 4)):
            corder = np.argsort(-score, kind="stable")
            for F in (16, 8, 4):
                scanned = np.zeros(nc, bool)
                scanned[corder[:max(1, nc // F)]] = True
                keep = exact | (routed & scanned[np.maximum(ix["cid"], 0)])
                est = np.where(keep, est_resid, -np.inf)
                order = np.argsort(-est, kind="stable")
                rank = np.empty(n, np.int64)
                rank[order] = np.arange(n)
                cm = np.cumsum(w[order])
                n_scan = int(keep.sum())
                for R in cands:
                    lim = min(ne + R, n_scan)
                    rec = float(np.mean(rank[top] < lim))
                    pr = None if pl is None else float(np.mean(rank[pl] < lim))
                    nbytes = nc * rb + n_scan * (D / 8 + 2) + lim * KV_BYTES
                    acc.add(f"f {route} top 1/{F} clusters, 1bit resid + rescore", str(R), planted=pr,
                            recall=rec, mass=float(cm[lim - 1]), keys=lim, nbytes=nbytes,
                            index_ratio=(nc * rb + n * (D / 8 + 2)) / kv_total)
                if route != "ball" or F == 16:
                    continue
                # (g) cascade: the top R1 of the 1-bit scan re-ranked by a finer code (int4 or int8 of every
                # key) or by their exact float32 keys, the top R2 of those read exactly
                for stage, e2, per_key, extra in (("int4", est4, D // 2, D // 2), ("int8", est8, D, D),
                                                  ("K fp32", None, KV_BYTES // 2, 0)):
                    for R1 in (4096, 16384):
                        c1 = order[:min(ne + R1, n_scan)]
                        sc2 = (k[c1] @ Q[t]).astype(np.float64) if e2 is None else e2[c1]
                        for R2 in (256, 1024):
                            take = c1[np.argsort(-sc2, kind="stable")[:ne + R2]]
                            got = np.zeros(n, bool)
                            got[take] = True
                            # K fp32: the R2 keys' K were read in stage 2, only their V now
                            last = take.size * (KV_BYTES // 2 if e2 is None else KV_BYTES)
                            nbytes = nc * rb + n_scan * (D / 8 + 2) + c1.size * per_key + last
                            acc.add(f"g ball top 1/{F}, 1bit -> R1 {stage} -> R2 exact", f"{R1}/{R2}",
                                    planted=None if pl is None else float(np.mean(got[pl])),
                                    recall=float(np.mean(got[top])), mass=float(w[got].sum()),
                                    keys=int(take.size), nbytes=nbytes,
                                    index_ratio=(nc * rb + n * (D / 8 + 2 + extra)) / kv_total)
        if not fine_designs:
            continue
        # (e) fine clusters flat, and two-level
        fms = fine["means"] @ q
        rkf = np.empty(fine["nc"], np.int64)
        rkf[np.argsort(-fms, kind="stable")] = np.arange(fine["nc"])
        fb = fine["nc"] * MEAN_BYTES
        eval_ranked(acc, "e fine16 flat", [4 * p for p in probes], rkf, fine, w, top, pl, exact, fb,
                    fb / kv_total)
        sup_s = sup_mean @ q
        for S in (64, 256, 1024):
            if S >= ns:
                continue
            opened = np.zeros(ns, bool)
            opened[np.argpartition(-sup_s, S - 1)[:S]] = True
            f2 = np.where(opened[fsup], fms, -np.inf)
            rkf[np.argsort(-f2, kind="stable")] = np.arange(fine["nc"])
            rkf[~opened[fsup]] = fine["nc"]  # never read
            sb = ns * MEAN_BYTES + int(np.bincount(fsup, minlength=ns)[opened].sum()) * MEAN_BYTES
            eval_ranked(acc, f"e 2level S={S}", [4 * p for p in probes], rkf, fine, w, top, pl, exact, sb,
                        (ns + fine["nc"]) * MEAN_BYTES / kv_total)
    log(f"[{kind} n={n}] {Q.shape[0]} queries evaluated {time.perf_counter() - t0:.1f}s")
    return {"workload": kind, "n": n, "queries": int(Q.shape[0]), "clusters": nc, "fine_clusters": fine["nc"],
            "super_clusters": ns, "rows": acc.table()}


# ------------------------------------------------------------------------------------------ speed floor
def read_floor() -> dict:
    """GB/s of a pure read (Numba sum of float32s on all of Numba's threads): contiguous, and 512-byte rows
    gathered at random; and the time of a 1-bit code scan (8 byte lookups a key, d 64) over 131,072 and
    1,048,576 keys of one head."""
    import numba

    @numba.njit(cache=False, fastmath=True, parallel=True)
    def sum_all(a):  # pragma: no cover - jitted
        m = a.size // 4096
        s = np.float32(0.0)
        for b in numba.prange(m):
            t = np.float32(0.0)
            for i in range(b * 4096, (b + 1) * 4096):
                t += a[i]
            s += t
        return s

    @numba.njit(cache=False, fastmath=True, parallel=True)
    def sum_rows(a, rows):  # pragma: no cover - jitted
        s = np.float32(0.0)
        for i in numba.prange(rows.size):
            t = np.float32(0.0)
            r = rows[i]
            for j in range(a.shape[1]):
                t += a[r, j]
            s += t
        return s

    @numba.njit(cache=False, fastmath=True, parallel=True)
    def lut_scan(codes, fac, base, lut, est):  # pragma: no cover - jitted
        # 1-bit codes, 8 bytes a key (d 64): q'.b from 8 byte-indexed tables of partial sums
        for i in numba.prange(codes.shape[0]):
            t = np.float32(0.0)
            for j in range(codes.shape[1]):
                t += lut[j, codes[i, j]]
            est[i] = base[i] + fac[i] * t

    out = {}
    m = 1 << 20
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (m, D // 8), dtype=np.uint8)
    fac, base, est = (rng.random(m, dtype=np.float32) for _ in range(3))
    lut = rng.standard_normal((D // 8, 256)).astype(np.float32)
    lut_scan(codes[:16], fac[:16], base[:16], lut, est[:16])
    for mk in (131072, m):
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            lut_scan(codes[:mk], fac[:mk], base[:mk], lut, est[:mk])
            ts.append(time.perf_counter() - t0)
        out[f"lut_scan_1bit_{mk}keys_ms"] = 1e3 * float(np.median(ts))
    del codes, fac, base, est
    big = np.random.default_rng(0).standard_normal(64 * 2 ** 20, dtype=np.float32)  # 256 MB
    sum_all(big[:16])
    for mb in (1, 4, 16, 64, 256):
        a = big[:mb * 2 ** 18]
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            sum_all(a)
            ts.append(time.perf_counter() - t0)
        out[f"contiguous_{mb}MB_GBps"] = a.nbytes / np.median(ts) / 1e9
    rows = big.reshape(-1, 128)  # 512-byte rows (a key + a value, float32, d 64)
    for nr in (4096, 65536):
        idx = np.random.default_rng(1).choice(rows.shape[0], nr, replace=False)
        sum_rows(rows, idx[:4])
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            sum_rows(rows, idx)
            ts.append(time.perf_counter() - t0)
        out[f"gather_{nr}rows_GBps"] = nr * 512 / np.median(ts) / 1e9
    return out


def sdpa_step_ms(n: int, heads: int = 8, reps: int = 5) -> float:
    import torch

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, heads, n, D, generator=g)
    v = torch.randn(1, heads, n, D, generator=g)
    q = torch.randn(1, heads, 1, D, generator=g)
    torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


# ------------------------------------------------------------------------------------------ report
def write_md(path: Path, res: dict) -> None:
    fl = res["floor"]
    bw = fl["contiguous_256MB_GBps"]
    L = ["# Decode index study: recall per byte read (one head, d 64)", "",
         f"Generated by `benchmarks/study_decode_index.py` ({res['date']}; read rates and SDPA step "
         f"{res.get('floor_date', res['date'])}); {res['queries']} decode queries "
         "per case. Bytes: per step per head, index scan + K and V of every key read exactly (float32, "
         "512 B a key); sinks + window (68 keys) included, the cache's exact tail (about open_step / 2 + "
         "window keys on average) not. `floor 8h ms`: those bytes for 8 heads at the measured contiguous "
         f"read rate ({bw:.1f} GB/s, a Numba sum); `x SDPA` against SDPA's decode step "
         f"({res['sdpa_ms'].get('131072', SDPA_MS_131K):.1f} ms at 131,072, 8 heads; {SDPA_MS_1M} ms at 1,048,576 "
         "from DESIGN.md). `KV/read`: the bytes of K and V over the bytes read, the speed-up over a "
         "bandwidth-bound dense step if the step ran at the same read rate (SDPA's decode step is "
         "bandwidth bound, ~18 GB/s on this machine class when not shared). Timing on a shared 2-core "
         "machine: indicative.", "",
         "Read rates (GB/s) and 1-bit scan times (ms, one head, all threads): "
         + ", ".join(f"{k} {v:.2f}" for k, v in fl.items()), ""]
    for case in res["cases"]:
        n = case["n"]
        sdpa = res["sdpa_ms"].get(str(n), {1048576: SDPA_MS_1M, 131072: SDPA_MS_131K}.get(n, float("nan")))
        L += [f"## {case['workload']}, n = {n:,} ({case['clusters']} clusters of ~64, {case['fine_clusters']} "
              f"of ~16, {case['super_clusters']} super-clusters)", "",
              "| design | budget | planted recall (min) | recall@64 (min) | mass | keys read | KB/step/head | "
              "index/KV | KV/read | floor 8h ms | x SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in case["rows"]:
            ms = 8 * r["bytes_per_step_head"] / bw / 1e6
            pr = "-" if r["planted_recall"] is None else f"{r['planted_recall']:.3f} ({r['planted_recall_min']:.2f})"
            L.append(f"| {r['design']} | {r['budget']} | {pr} | {r['recall64']:.3f} ({r['recall64_min']:.2f}) | "
                     f"{r['mass']:.3f} | {r['keys_read']:.0f} | {r['bytes_per_step_head'] / 1024:.0f} | "
                     f"{r['index_ratio']:.3f} | {n * KV_BYTES / r['bytes_per_step_head']:.0f} | {ms:.2f} | {sdpa / ms:.0f} |")
        L.append("")
    L += ["## Cheapest budget per design meeting planted recall >= 0.99 and recall@64 >= 0.95", "",
          "| workload | n | design | budget | KB/step/head | KV/read | floor 8h ms | x SDPA |",
          "|---|---|---|---|---|---|---|---|"]
    for w in res["best"]:
        L.append(f"| {w['workload']} | {w['n']:,} | {w['design']} | {w['budget']} | {w['kb']:.0f} | "
                 f"{w['kv_over_read']:.0f} | {w['floor_ms']:.2f} | {w['x_sdpa']:.0f} |")
    path.write_text("\n".join(L) + "\n", encoding="utf-8")


def best_rows(res: dict) -> list[dict]:
    bw = res["floor"]["contiguous_256MB_GBps"]
    out = []
    for case in res["cases"]:
        n = case["n"]
        sdpa = res["sdpa_ms"].get(str(n), {1048576: SDPA_MS_1M, 131072: SDPA_MS_131K}.get(n, float("nan")))
        by: dict[str, dict] = {}
        for r in case["rows"]:
            ok = r["recall64"] >= 0.95 and (r["planted_recall"] is None or r["planted_recall"] >= 0.99)
            if ok and (r["design"] not in by or r["bytes_per_step_head"] < by[r["design"]]["bytes_per_step_head"]):
                by[r["design"]] = r
        for d_, r in sorted(by.items(), key=lambda x: x[1]["bytes_per_step_head"]):
            ms = 8 * r["bytes_per_step_head"] / bw / 1e6
            out.append({"workload": case["workload"], "n": n, "design": d_, "budget": r["budget"],
                        "kb": r["bytes_per_step_head"] / 1024,
                        "kv_over_read": n * KV_BYTES / r["bytes_per_step_head"], "floor_ms": ms, "x_sdpa": sdpa / ms})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--workloads", default="passkey-clustered,clustered,passkey-gaussian")
    ap.add_argument("--queries", default="32")
    ap.add_argument("--probes", default="16,32,64,128,256,512,1024,2048")
    ap.add_argument("--candidates", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA step measurement at 131,072")
    ap.add_argument("--no-fine", action="store_true", help="skip designs (e) (their k-means is the slow part)")
    ap.add_argument("--out", default=str(HERE / "results" / "decode-index-study.json"))
    ap.add_argument("--floor-only", action="store_true",
                    help="re-measure the read rates and SDPA's step only, and rewrite the report of --out")
    a = ap.parse_args(argv)
    if a.floor_only:
        out = Path(a.out)
        if not out.is_file():
            print(f"error: --floor-only needs an existing --out results file; {a.out!r} does not exist",
                  file=sys.stderr)
            return 2
        res = json.loads(out.read_text(encoding="utf-8"))
        res["floor"] = read_floor()
        res["sdpa_ms"] = {} if a.no_sdpa else {"131072": sdpa_step_ms(131072)}
        res["floor_date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        log("read floor", res["floor"], "sdpa", res["sdpa_ms"])
        res["best"] = best_rows(res)
        out.write_text(json.dumps(res, indent=1), encoding="utf-8")
        write_md(out.with_suffix(".md"), res)
        return 0
    lengths = _positive_list(a.lengths, "--lengths")
    if min(lengths) < SEGMENT + SINKS + WINDOW:
        print(f"error: --lengths must each be >= {SEGMENT + SINKS + WINDOW}; got {a.lengths!r}", file=sys.stderr)
        return 2
    nq = _positive_list(a.queries, "--queries")[0]
    probes = _positive_list(a.probes, "--probes")
    cands = _positive_list(a.candidates, "--candidates")
    kinds = [x.strip() for x in a.workloads.split(",") if x.strip()]
    allowed = ("passkey-clustered", "passkey-gaussian", "clustered")
    bad = [x for x in kinds if x not in allowed]
    if not kinds or bad:
        print(f"error: --workloads must be a comma list of {allowed}; got {a.workloads!r}", file=sys.stderr)
        return 2
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "queries": nq, "cases": []}
    res["floor"] = read_floor()
    log("read floor", res["floor"])
    res["sdpa_ms"] = {} if a.no_sdpa else {"131072": sdpa_step_ms(131072)}
    log("sdpa", res["sdpa_ms"])
    for n in lengths:
        for kind in kinds:
            res["cases"].append(run_case(kind, n, nq, seed=0, probes=probes, cands=cands,
                                         fine_designs=not a.no_fine))
            res["best"] = best_rows(res)
            out = Path(a.out)
            out.write_text(json.dumps(res, indent=1), encoding="utf-8")
            write_md(out.with_suffix(".md"), res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
