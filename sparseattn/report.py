"""Reports from benchmark results: tables (terminal, Markdown, HTML), JSON and plots, plus the CLI
subcommands ``compare``, ``bench`` and ``trace``.

Results are produced as plain dicts by :mod:`sparseattn.bench`; everything here only renders them.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
from typing import Any

COLUMNS = [
    ("selector", "selector"),
    ("keys/q", "keys_per_query"),
    ("build s", "build_s"),
    ("select s", "select_s"),
    ("kernel s", "kernel_s"),
    ("total s", "total_s"),
    ("x dense", "speedup_vs_dense"),
    ("x SDPA", "speedup_vs_sdpa"),
    ("recall@k", "quality.recall_mean"),
    ("mass", "quality.mass_recall_mean"),
    ("out err", "quality.rel_error_overall"),
    ("empty", "empty_rows"),
]


def _get(row: dict[str, Any], path: str) -> Any:
    cur: Any = row
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of a compare result (dense baselines first)."""
    header = [c[0] for c in COLUMNS]
    rows: list[list[str]] = []
    dense = result["dense"]
    rows.append(["dense (ours, exact)", "all", "-", "-", "-", _fmt(dense.get("dense_s")), "1.00",
                 _fmt(dense["sdpa_s"] / dense["dense_s"]) if dense.get("sdpa_s") else "-", "1", "1", "0", "0"])
    if dense.get("sdpa_s"):
        rows.append(["torch SDPA (exact)", "all", "-", "-", "-", _fmt(dense["sdpa_s"]),
                     _fmt(dense["dense_s"] / dense["sdpa_s"]), "1.00", "1", "1", "0", "0"])
    for r in result["results"]:
        if "error" in r:
            rows.append([r["selector"], f"error: {r['error']}"] + [""] * (len(COLUMNS) - 2))
            continue
        rows.append([_fmt(_get(r, path)) for _, path in COLUMNS])
    return header, rows


def render_text(result: dict[str, Any]) -> str:
    header, rows = table_rows(result)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    widths[0] = min(widths[0], 48)
    line = lambda cells: "  ".join(c[:w].ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    out = [_title(result), line(header), line(["-" * w for w in widths])]
    out += [line(r) if not r[1].startswith("error") else f"{r[0]}  {r[1]}" for r in rows]
    out.append(_footnote(result))
    return "\n".join(out)


def _title(result: dict[str, Any]) -> str:
    w = result["workload"]
    return (f"sparseattn compare: {w['description']} — {w['groups']} group(s) x L={w['L']} queries x "
            f"S={w['S']} keys, E={w['E']}, k={result['k']}, causal={result['is_causal']}, "
            f"{result['machine']['threads']} thread(s), medians of {result['repeats']}")


def _footnote(result: dict[str, Any]) -> str:
    return ("x dense / x SDPA: speed-up of build+select+kernel over exact attention measured in the same run; "
            "recall@k: share of the exact top-k found (tie-aware); mass: dense softmax mass on the selected "
            "keys; out err: relative Frobenius error of the output.")


def render_markdown(result: dict[str, Any], plots: list[str] | None = None) -> str:
    header, rows = table_rows(result)
    lines = [f"# {_title(result)}", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    lines += ["", _footnote(result), "", f"Machine: {_machine_line(result)}", ""]
    for p in plots or []:
        lines.append(f"![{os.path.basename(p)}]({os.path.basename(p)})")
    return "\n".join(lines) + "\n"


def _machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    libs = ", ".join(f"{k} {m[k]}" for k in ("numpy", "numba", "faiss", "datasketch", "scipy", "torch") if m.get(k))
    return f"{m['cpu']}, {m['cores']} cores, {m['threads']} thread(s), Python {m['python']}; {libs}"


def render_html(result: dict[str, Any], plots: list[str] | None = None) -> str:
    header, rows = table_rows(result)
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    imgs = "".join(f'<p><img src="{html.escape(os.path.basename(p))}" style="max-width:100%"></p>' for p in plots or [])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>sparseattn compare</title>"
            f"<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
            f"td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}"
            f"</style></head><body><h2>{html.escape(_title(result))}</h2><table><tr>{th}</tr>{body}</table>"
            f"<p>{html.escape(_footnote(result))}</p><p>Machine: {html.escape(_machine_line(result))}</p>"
            f"{imgs}</body></html>\n")


def plot_compare(result: dict[str, Any], out_dir: str) -> list[str]:
    """Pareto plot (mass recall vs speed-up over dense) and a stacked time bar chart; PNG paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [r for r in result["results"] if "total_s" in r]
    if not ok:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in ok:
        x = r.get("speedup_vs_sdpa") or r.get("speedup_vs_dense")
        y = _get(r, "quality.mass_recall_mean")
        ax.scatter(x, y, s=40)
        label = "+".join(part.split(",")[0] for part in r["selector"].split("+"))[:40]
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("speed-up over exact attention (x SDPA if installed, else x our dense), end to end")
    ax.set_ylabel("softmax mass recall (1 = exact)")
    ax.set_title(f"{result['data']}: accuracy vs speed (k={result['k']}, causal={result['is_causal']})", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "compare_pareto.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.35 * len(ok) + 1.5))
    names = [r["selector"][:40] for r in ok]
    left = [0.0] * len(ok)
    for part, color in (("build_s", "#8da0cb"), ("select_s", "#fc8d62"), ("kernel_s", "#66c2a5")):
        vals = [r[part] for r in ok]
        ax.barh(names, vals, left=left, color=color, label=part[:-2])
        left = [a + b for a, b in zip(left, vals, strict=True)]
    if result["dense"].get("sdpa_s"):
        ax.axvline(result["dense"]["sdpa_s"], color="k", ls="--", lw=1, label="torch SDPA")
    ax.axvline(result["dense"]["dense_s"], color="grey", ls=":", lw=1, label="our dense")
    ax.set_xlabel("seconds (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "compare_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_compare(result: dict[str, Any], out_dir: str, formats: list[str]) -> list[str]:
    """Write the requested formats (json, md, html; plots go with md/html) into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if "json" in formats:
        path = os.path.join(out_dir, "compare.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=_json_default)
        written.append(path)
    plots = plot_compare(result, out_dir) if ("md" in formats or "html" in formats) else []
    written += plots
    if "md" in formats:
        path = os.path.join(out_dir, "compare.md")
        with open(path, "w") as f:
            f.write(render_markdown(result, plots))
        written.append(path)
    if "html" in formats:
        path = os.path.join(out_dir, "compare.html")
        with open(path, "w") as f:
            f.write(render_html(result, plots))
        written.append(path)
    return written


def _json_default(o: Any) -> Any:
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ------------------------------------------------------------------------------------------------ CLI
_FORMATS = ("table", "json", "md", "html")


def _progress_printer(total: int):
    state = {"i": 0}

    def say(msg: str) -> None:
        state["i"] += 1
        print(f"[{state['i']}/{total}] {msg}", file=sys.stderr, flush=True)

    return say


def _cmd_compare(args: argparse.Namespace) -> int:
    from . import bench
    from .threads import threads

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = sorted(set(formats) - set(_FORMATS))
    if bad:
        raise ValueError(f"--format: unknown {bad}; choose from {', '.join(_FORMATS)}.")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1; got {args.k}.")
    with threads(args.threads or _default_threads()):
        wl_groups = args.max_groups
        n_sel = len(args.selectors) if args.selectors else len(bench.default_selectors(None))
        result = bench.compare(args.data, args.selectors, k=args.k, is_causal=args.causal, repeats=args.repeats,
                               max_groups=wl_groups, progress=_progress_printer(n_sel + 1))
    if "table" in formats:
        print(render_text(result))
    written = write_compare(result, args.out, formats)
    for p in written:
        print(f"wrote {p}")
    return 0 if all("error" not in r for r in result["results"]) else 1


def _default_threads() -> int:
    from .threads import get_num_threads
    return get_num_threads()


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import suite
    return suite.main_from_args(args)


def _cmd_trace(args: argparse.Namespace) -> int:
    from . import traces
    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.kind == "window":
        kwargs["n_windows"] = args.n_windows
    else:
        kwargs.update(n_keys=args.n_keys, n_queries=args.n_queries, layer=args.layer)
        if args.heads is not None:
            try:
                kwargs["heads"] = [int(h) for h in args.heads.split(",")]
            except ValueError:
                raise SystemExit(f"sparseattn trace: --heads must be a comma list of integers such as 0,1; "
                                 f"got {args.heads!r}.") from None
    out = traces.generate_traces(args.out, args.kind, name=args.name, **kwargs)
    print(f"wrote {out}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``compare``, ``bench`` and ``trace`` on the ``sparseattn`` parser."""
    p = sub.add_parser("compare", help="compare selectors against dense attention (accuracy and speed)",
                       description="Run selectors and exact attention side by side on one workload and "
                                   "report speed and accuracy. Default: the shipped real MiniLM traces.")
    p.add_argument("--data", default="window",
                   help="window | store | NAME@DIR (a trace written by `sparseattn trace --name NAME --out DIR`) | "
                        "synthetic:n=65536,d=64,kind=gaussian|clustered|correlated (default window)")
    p.add_argument("--selectors", nargs="+", default=None,
                   help="selector specs, e.g. topk window:width=64 'window+sinks+faiss-hnsw:M=32' (default: a "
                        "representative set; see `sparseattn selectors`)")
    p.add_argument("--k", type=int, default=64, help="keys per query for top-k selectors (default 64)")
    p.add_argument("--causal", action="store_true", help="causal attention (keys up to the query's position)")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats; medians are reported (default 3)")
    p.add_argument("--max-groups", type=int, default=12,
                   help="for real traces: evaluate this many evenly spaced (window, layer, head) groups (default 12)")
    p.add_argument("--threads", type=int, default=None, help="threads for Numba/FAISS/BLAS (default: all cores)")
    p.add_argument("--out", default="sparseattn-report", help="output directory (default ./sparseattn-report)")
    p.add_argument("--format", default="table,json,md,html", help="comma list of table,json,md,html")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("bench", help="run the benchmark suite (time vs n, accuracy vs speed, recall vs k)")
    p.add_argument("--suite", default="quick", choices=["quick", "full"], help="quick (minutes) or full sweep")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="output directory")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None, help="override the suite's repeats")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("trace", help="capture real Q/K/V traces from MiniLM (needs the 'traces' extra)")
    p.add_argument("kind", choices=["window", "store"])
    p.add_argument("--out", default="data")
    p.add_argument("--n-windows", type=int, default=2)
    p.add_argument("--n-keys", type=int, default=16384)
    p.add_argument("--n-queries", type=int, default=2048)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--heads", default=None, help="store: comma list of heads (default all 12)")
    p.add_argument("--name", default=None, help="file stem and manifest name (default: the kind); load it "
                   "with `sparseattn compare --data NAME@OUT`")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_trace)
