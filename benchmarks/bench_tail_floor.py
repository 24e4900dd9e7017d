"""Oracle floor for sample-based tail estimates: the least output error any estimator reading B keys per query
(exact top-k' plus B - k' sampled keys) can reach on real attention, when it samples with the true weights.

Run:  python benchmarks/bench_tail_floor.py [--queries 512] [--budgets 64,128,256] [--draws 8]
      [--stores store,store65k@~/.cache/sparseattn/traces]

For every head of each real MiniLM key store (the shipped 16,384-key ``store``; the 65,536-key ``store65k``
when present, made by ``sparseattn trace store --n-keys 65536 --n-queries 65536 --heads 0,5 --name store65k
--out ~/.cache/sparseattn/traces``), ``--queries`` evenly spaced queries attend non-causally with the
traces' scale.  Per query, in float64: weights ``w_j = exp(s_j - max s)``, true output ``o = sum w v / sum w``.
For a budget B (keys read per query) and a split k' in {0, B/4, B/2, 3B/4, B}: the top-k' keys by score are
read exactly (``N_sel = sum w v``, ``D_sel = sum w`` over them) and m = B - k' keys are drawn i.i.d., with
replacement, from the rest (the tail) with probabilities p_j; the ratio (self-normalised importance
sampling) estimate is

    o_hat = (N_sel + N_hat) / (D_sel + D_hat),  N_hat = (1/m) sum_i w_i v_i / p_i,  D_hat = (1/m) sum_i w_i / p_i

with the proposals ``weights`` (p_j proportional to w_j: the true attention restricted to the tail),
``optimal`` (p_j proportional to w_j ||v_j - o||, the asymptotically variance-optimal proposal of a
self-normalised estimator, Hesterberg 1995) and, for reference, ``uniform`` (p_j = 1/|tail|, what a sampler
without knowledge of the weights does).  m = 0 (k' = B) is plain top-B.  Both oracle proposals use the
true softmax weights, which no real sampler has, so their error is a floor for sample-based estimators at
that budget.  Error: ``||o_hat - o|| / ||o||``, mean over queries and ``--draws`` seeded draws.

Results: ``results/tail-floor.json`` and ``results/tail-floor.md`` (``--out``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

import numpy as np

from sparseattn.tools.args import OneLineParser, int_list_arg, nonnegative_int, positive_int
from sparseattn.tools.bench import iter_workloads

HERE = os.path.dirname(os.path.abspath(__file__))
PROPOSALS = ("weights", "optimal", "uniform")
ORACLES = ("weights", "optimal")
BLOCK = 32  # queries per block (one seeded generator per (store, head, block))


def splits(budget: int) -> list[int]:
    """The exact-key counts k' tried for a budget B: 0, B/4, B/2, 3B/4, B (rounded down), without duplicates."""
    return sorted({budget * i // 4 for i in range(5)})


def _check_config(budget: int, split: int, proposal: str, draws: int) -> None:
    if not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget must be a positive int (keys read per query); got {budget!r}")
    if not isinstance(split, (int, np.integer)) or not 0 <= split <= budget:
        raise ValueError(f"split must be an int in [0, budget={budget}] (exactly read keys); got {split!r}")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}; got {proposal!r}")
    if not isinstance(draws, (int, np.integer)) or draws < 1:
        raise ValueError(f"draws must be a positive int (independent sample draws); got {draws!r}")


def query_estimates(scores: np.ndarray, v: np.ndarray, configs: Iterable[tuple[int, int, str]],
                    rng: np.random.Generator, draws: int) -> tuple[np.ndarray, dict]:
    """Estimates of one query's attention output for each (budget, split, proposal) in ``configs``.

    Parameters
    ----------
    scores : (S,) float64, the query's scaled scores ``q . k_j * scale``.
    v : (S, E) float64 values.
    configs : (budget B, split k', proposal) triples; m = B - k' samples (none when k' >= S: every key is
        then read exactly).
    rng : generator the samples are drawn from (in the order of ``configs``).
    draws : independent draws of the m samples.

    Returns
    -------
    o : (E,) float64 true output.
    est : dict config -> dict with ``out`` (draws, E) estimates, ``n_hat`` (draws, E), ``d_hat`` (draws,),
        ``n_tail`` (E,) and ``d_tail`` (float) the true tail sums ``sum w v``, ``sum w`` over the tail,
        ``n_sel`` (E,), ``d_sel`` the exact part.
    """
    configs = list(configs)
    for b, kp, prop in configs:
        _check_config(b, kp, prop, draws)
    w = np.exp(scores - scores.max())
    nw = w @ v
    o = nw / w.sum()
    dist = np.linalg.norm(v - o, axis=1)
    return o, _estimates(scores, w, nw, dist, v, configs, rng, draws)


def _estimates(scores: np.ndarray, w: np.ndarray, nw: np.ndarray, dist: np.ndarray, v: np.ndarray,
               configs: list[tuple[int, int, str]], rng: np.random.Generator, draws: int) -> dict:
    """:func:`query_estimates` given the query's weights w (S,), ``nw = w @ v`` (E,) and ``dist`` (S,) =
    ``||v_j - o||`` (all float64)."""
    S = scores.shape[0]
    W = w.sum()
    kmax = min(S, max(kp for _, kp, _ in configs)) if configs else 0
    # key order: the top kmax by score (sorted, best first), then the rest in any order
    if 0 < kmax < S:
        top = np.argpartition(-scores, kmax - 1)[:kmax]
        top = top[np.argsort(-scores[top], kind="stable")]
        rest = np.ones(S, bool)
        rest[top] = False
        order = np.concatenate([top, np.flatnonzero(rest)])
    else:
        order = np.argsort(-scores, kind="stable")
    ws = w[order]
    # suffix sums of each proposal's mass over the sorted order, accumulated from the end (smallest
    # tail keys first): crev[p][j] = sum of the last j + 1 entries
    need = {prop for b, kp, prop in configs if b > kp and kp < S}
    mass: dict = {}
    if "weights" in need:
        mass["weights"] = ws
    if "optimal" in need:
        mass["optimal"] = ws * dist[order]
    crev = {prop: np.cumsum(a[::-1]) for prop, a in mass.items()}
    est: dict = {}
    for b, kp, prop in configs:
        kp_eff = min(kp, S)
        T = S - kp_eff  # tail size
        m = b - kp if T > 0 else 0
        sel = order[:kp_eff]
        n_sel = ws[:kp_eff] @ v[sel]
        d_sel = float(ws[:kp_eff].sum())
        n_tail = nw - n_sel  # the tail's sums: everything minus the exact part
        d_tail = float(W - d_sel)
        E = v.shape[1]
        if m == 0:
            n_hat, d_hat = np.zeros((draws, E)), np.zeros(draws)
        elif prop == "uniform":
            pos = kp_eff + rng.integers(0, T, size=(draws, m))
            r = ws[pos] * T  # w / p with p = 1 / T
            n_hat = np.einsum("dm,dme->de", r, v[order[pos]]) / m
            d_hat = r.mean(axis=1)
        else:
            c = crev[prop]
            total = c[T - 1]  # mass of the tail (the last T entries)
            if total <= 0.0:  # every tail weight underflows: the tail holds no mass
                n_hat, d_hat = np.zeros((draws, E)), np.zeros(draws)
            else:
                x = rng.random((draws, m)) * total
                j = np.minimum(np.searchsorted(c[:T], x, side="right"), T - 1)
                pos = S - 1 - j
                p = mass[prop][pos] / total  # > 0: a key of zero mass is never drawn
                r = np.divide(ws[pos], p, out=np.zeros_like(p), where=p > 0)
                n_hat = np.einsum("dm,dme->de", r, v[order[pos]]) / m
                d_hat = r.mean(axis=1)
        out = (n_sel + n_hat) / (d_sel + d_hat)[:, None]
        est[(b, kp, prop)] = {"out": out, "n_hat": n_hat, "d_hat": d_hat, "n_tail": n_tail, "d_tail": d_tail,
                              "n_sel": n_sel, "d_sel": d_sel}
    return est


def oracle_errors_many(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                       configs: Iterable[tuple[int, int, str]], rng: np.random.Generator,
                       draws: int) -> dict:
    """Relative output errors ``||o_hat - o|| / ||o||`` of each config for queries q (L, E) over keys k (S, E)
    and values v (S, Ev) (any float dtype; computed in float64): config -> (L, draws) float64."""
    configs = list(configs)
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    out = {c: np.empty((q64.shape[0], draws)) for c in configs}
    for c in configs:
        _check_config(*c, draws)
    v2 = np.einsum("se,se->s", v64, v64)
    for a in range(0, q64.shape[0], BLOCK):
        s = q64[a:a + BLOCK] @ k64.T * scale
        w = np.exp(s - s.max(axis=1, keepdims=True))
        nw = w @ v64
        o = nw / w.sum(axis=1, keepdims=True)
        # ||v_j - o||^2 = |v_j|^2 - 2 v_j . o + |o|^2 for the whole block at once
        dist = np.sqrt(np.maximum(v2[None, :] - 2.0 * (o @ v64.T) + np.einsum("le,le->l", o, o)[:, None], 0.0))
        for i in range(s.shape[0]):
            est = _estimates(s[i], w[i], nw[i], dist[i], v64, configs, rng, draws)
            no = np.linalg.norm(o[i])
            for c in configs:
                out[c][a + i] = np.linalg.norm(est[c]["out"] - o[i], axis=1) / no
    return out


def oracle_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, budget: int, split: int,
                  proposal: str, rng: np.random.Generator, draws: int) -> np.ndarray:
    """(L, draws) float64 relative errors of one (budget, split, proposal) estimate; see the module docstring."""
    return oracle_errors_many(q, k, v, scale, [(budget, split, proposal)], rng, draws)[(budget, split, proposal)]


def run(stores: list[str], n_queries: int, budgets: list[int], draws: int, seed: int) -> list[dict]:
    rows = []
    for si, name, tr in iter_workloads(stores):  # q, k, v (heads, n, E)
        base = name.partition("@")[0]  # the store's label in the results
        scale = float(tr.scale) if tr.scale is not None else tr.k.shape[-1] ** -0.5
        S = tr.k.shape[1]
        bs = [b for b in budgets if b < S]
        if len(bs) < len(budgets):
            print(f"{name}: budgets >= {S} keys skipped (plain top-B is exact there)", flush=True)
        configs = [(b, kp, prop) for b in bs for kp in splits(b) if kp < b for prop in PROPOSALS]
        configs += [(b, b, "weights") for b in bs]  # m = 0: plain top-B
        for h in range(tr.k.shape[0]):
            t0 = time.perf_counter()
            sel = np.linspace(0, tr.q.shape[1] - 1, n_queries).astype(np.int64)
            q = np.ascontiguousarray(tr.q[h, sel], np.float64)
            k = np.ascontiguousarray(tr.k[h], np.float64)
            v = np.ascontiguousarray(tr.v[h], np.float64)
            errs = {c: [] for c in configs}
            for bi, a in enumerate(range(0, q.shape[0], BLOCK)):
                rng = np.random.default_rng([seed, si, h, bi])
                part = oracle_errors_many(q[a:a + BLOCK], k, v, scale, configs, rng, draws)
                for c in configs:
                    errs[c].append(part[c])
            mean = {c: float(np.concatenate(errs[c]).mean()) for c in configs}
            for b in bs:
                plain = mean[(b, b, "weights")]
                by_split = [{"split": kp, "samples": b - kp,
                             **({p: mean[(b, kp, p)] for p in PROPOSALS} if kp < b else {p: plain for p in PROPOSALS})}
                            for kp in splits(b)]
                cands = [(r[p], r["split"], p if r["samples"] else "none") for r in by_split for p in ORACLES]
                best, best_split, best_prop = min(cands)
                uni = next(r["uniform"] for r in by_split if r["split"] == best_split)
                row = {"store": base, "n_keys": int(S), "head": h, "budget": b, "queries": int(q.shape[0]),
                       "draws": draws, "plain_topB": plain, "best_oracle": best, "best_split": best_split,
                       "best_samples": b - best_split, "best_proposal": best_prop, "ratio": best / plain,
                       "meets_half": bool(best / plain <= 0.5), "uniform_at_best_split": uni,
                       "best_uniform": min(r["uniform"] for r in by_split), "splits": by_split}
                rows.append(row)
                print(f"{base:>9} h{h} B={b:<4} plain {plain:.4f} best oracle {best:.4f} (k'={best_split}, "
                      f"{best_prop}) ratio {row['ratio']:.3f} uniform at k' {uni:.4f}", flush=True)
            print(f"{base} h{h}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def write(rows: list[dict], out: str, cmd: str) -> None:
    head = (f"Oracle floor of sample-based tail estimates on real keys (`{cmd}`). Per query (float64): "
            "w_j = exp(s_j - max s), true output o; the top-k' keys by score read exactly (N_sel, D_sel), "
            "m = B - k' keys drawn i.i.d. with replacement from the rest with probability p_j; "
            "o_hat = (N_sel + N_hat) / (D_sel + D_hat), N_hat = (1/m) sum w_i v_i / p_i, "
            "D_hat = (1/m) sum w_i / p_i. Proposals: `weights` p_j ~ w_j; `optimal` p_j ~ w_j ||v_j - o|| "
            "(Hesterberg 1995); `uniform` p_j = 1/|tail| (reference). The oracle proposals use the true "
            "softmax weights, which no real sampler has, so their error is a floor for sample-based "
            "estimators reading B keys per query. Error: ||o_hat - o|| / ||o||, mean over queries and draws; "
            "splits k' in {0, B/4, B/2, 3B/4, B}; k' = B is plain top-B.")
    lines = [head, "",
             "| store | keys | head | B | plain top-B | best oracle | k' | samples | proposal | oracle / plain | "
             "<= 0.5 | uniform at that k' | best uniform (any k', k' = B is plain) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['store']} | {r['n_keys']:,} | {r['head']} | {r['budget']} | {r['plain_topB']:.4f} | "
                     f"{r['best_oracle']:.4f} | {r['best_split']} | {r['best_samples']} | {r['best_proposal']} | "
                     f"{r['ratio']:.3f} | {'yes' if r['meets_half'] else 'no'} | {r['uniform_at_best_split']:.4f} | "
                     f"{r['best_uniform']:.4f} |")
    lines += ["", "Every split (error; k' = B is plain top-B):", "",
              "| store | head | B | k' | samples | weights | optimal | uniform |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for s in r["splits"]:
            lines.append(f"| {r['store']} | {r['head']} | {r['budget']} | {s['split']} | {s['samples']} | "
                         f"{s['weights']:.4f} | {s['optimal']:.4f} | {s['uniform']:.4f} |")
    with open(out + ".json", "w") as f:
        json.dump({"command": cmd, "description": head, "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=positive_int, default=512, help="queries per head (evenly spaced)")
    ap.add_argument("--budgets", type=int_list_arg(1, "64,128,256"), default=[64, 128, 256],
                    help="keys read per query, comma-separated")
    ap.add_argument("--draws", type=positive_int, default=8, help="seeded sample draws per query")
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    ap.add_argument("--stores", default="store,store65k@~/.cache/sparseattn/traces")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tail-floor"))
    args = ap.parse_args()
    budgets = sorted(set(args.budgets))
    stores = [s for s in args.stores.split(",") if s.strip()]
    if not stores:
        ap.error("--stores must name at least one store, e.g. store or store65k@~/.cache/sparseattn/traces")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        ap.error(f"--out directory {out_dir} does not exist; create it or pass another --out")
    cmd = (f"python benchmarks/bench_tail_floor.py --queries {args.queries} --budgets {','.join(map(str, budgets))} "
           f"--draws {args.draws} --seed {args.seed} --stores {args.stores}")
    rows = run(stores, args.queries, budgets, args.draws, args.seed)
    write(rows, args.out, cmd)
    print(f"wrote {args.out}.json, {args.out}.md")


if __name__ == "__main__":
    main()
