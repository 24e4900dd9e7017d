"""Reports from benchmark results: tables (terminal, Markdown, HTML), JSON and plots.

Results are produced as plain dicts by :mod:`sparseattn.bench` (and suites by :mod:`sparseattn.suite`);
everything here only renders them.  The command-line handlers live in :mod:`sparseattn.cli`.
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

from .bench import json_default

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
    """A compare result (:func:`sparseattn.bench.compare`) as a fixed-width terminal table."""
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
    """A compare result as a Markdown page: title, table, footnote, machine line, plot images."""
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
    """A compare result as a standalone HTML page (same content as :func:`render_markdown`)."""
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


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def pareto_axes(ax: Any, xlabel: str, ylabel: str) -> None:
    """Axes of a recall vs speed-up plot: log speed-up axis, dashed line at speed-up 1, light grid."""
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def save_figure(fig: Any, out_dir: str, filename: str) -> str:
    """Lay out a figure, write it as ``out_dir/filename`` (110 dpi) and close it; return the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, filename)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_compare(result: dict[str, Any], out_dir: str) -> list[str]:
    """Pareto plot (mass recall vs speed-up over dense) and a stacked time bar chart; PNG paths."""
    plt = pyplot()
    if plt is None:
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
    pareto_axes(ax, "speed-up over exact attention (x SDPA if installed, else x our dense), end to end",
                "softmax mass recall (1 = exact)")
    ax.set_title(f"{result['data']}: accuracy vs speed (k={result['k']}, causal={result['is_causal']})", fontsize=9)
    paths.append(save_figure(fig, out_dir, "compare_pareto.png"))

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
    paths.append(save_figure(fig, out_dir, "compare_time.png"))
    return paths


def write_compare(result: dict[str, Any], out_dir: str, formats: list[str]) -> list[str]:
    """Write the requested formats (json, md, html; plots go with md/html) into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if "json" in formats:
        path = os.path.join(out_dir, "compare.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=json_default)
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
