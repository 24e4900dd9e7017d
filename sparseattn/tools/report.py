"""Reports from benchmark results: tables (terminal, Markdown, HTML), JSON and plots.

Results are produced as plain dicts by :mod:`sparseattn.tools.bench` (and suites by :mod:`sparseattn.tools.suite`);
everything here only renders them.  The command-line handlers live in :mod:`sparseattn.tools.cli`.
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

#: Selector colours, assigned in this order to the sorted distinct specs of a result (or a suite), so a
#: selector has the same colour in every plot of a report.  Ten tab10 hues, then ten darker / lighter ones.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#e6a93a", "#637939", "#843c39", "#7b4173", "#3182bd",
           "#31a354", "#fd8d3c", "#969696", "#9c9ede")
#: Markers, cycled independently of the colours (9 is coprime with 20: 180 distinct pairs).
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
#: Time phases of the time plot, in greys so they never read as selector colours.
PHASES = (("build_s", "build", "#d0d0d0"), ("select_s", "select", "#8a8a8a"), ("kernel_s", "kernel", "#303030"))
LABEL_WIDTH = 40


def _get(row: dict[str, Any], path: str) -> Any:
    cur: Any = row
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def format_value(value: Any) -> str:
    """A table cell: ``-`` for None, ``0`` for 0.0, other floats with no decimals from 100 up, 2 from 1 up,
    3 below (``1234.5`` -> ``"1234"``, ``2.345`` -> ``"2.35"``, ``0.01234`` -> ``"0.012"``), anything
    else through ``str``.  Shared by every table of the tools."""
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


# --------------------------------------------------------------------------------- selector labels
def _default_params(name: str) -> dict[str, str]:
    """``{param: value}`` of a selector's default spec string; empty for an unknown or unavailable one."""
    from ..selectors import get_selector, spec_string

    try:
        spec = spec_string(get_selector(name))
    except (KeyError, ValueError, TypeError, ImportError):
        return {}
    params = spec.partition(":")[2]
    return dict(tok.partition("=")[::2] for tok in params.split(",")) if params else {}


def selector_label(spec: str, width: int = LABEL_WIDTH) -> str:
    """A short label of a selector spec: each part's name and its non-default parameters.

    ``mode`` is shown by its value (``cluster:block``); parameters at their default are left out
    (``faiss-hnsw:M=32,ef_construction=80,...`` -> ``faiss-hnsw``, ``faiss-hnsw:M=16,...`` ->
    ``faiss-hnsw:M=16``); union parts are joined by ``+``.  A label longer than ``width`` is cut at a
    parameter or part boundary and ends in ``…``: never inside a parameter.  The full spec goes in the
    report's selector table.
    """
    parts = []
    for part in spec.split("+"):
        name, _, params = part.partition(":")
        defaults = _default_params(name)
        kept: list[str] = []
        for tok in params.split(",") if params else []:
            key, _, val = tok.partition("=")
            if key == "mode":
                kept.insert(0, val)
            elif not defaults or defaults.get(key) != val:
                kept.append(tok)
        parts.append(f"{name}:{','.join(kept)}" if kept else name)
    label = "+".join(parts)
    if len(label) <= width:
        return label
    cut = max(label.rfind(sep, 0, width) for sep in (",", "+", ":"))
    return (label[:cut] if cut > 0 else label.partition(":")[0]) + "…"


def selector_labels(specs: list[str], width: int = LABEL_WIDTH) -> dict[str, str]:
    """Unique short labels (:func:`selector_label`) of distinct specs; clashes get ``#2``, ``#3``, ..."""
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    for spec in dict.fromkeys(specs):
        label = selector_label(spec, width)
        seen[label] = seen.get(label, 0) + 1
        out[spec] = label if seen[label] == 1 else f"{label}#{seen[label]}"
    return out


def selector_styles(specs: list[str]) -> dict[str, tuple[str, str]]:
    """``{spec: (colour, marker)}``: the sorted distinct specs take :data:`PALETTE` and :data:`MARKERS` in order.

    Built once per report (or suite) from every spec in it, so one selector has one colour in all plots.
    """
    return {spec: (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)])
            for i, spec in enumerate(sorted(set(specs)))}


# ------------------------------------------------------------------------------- keys-per-query notes
def keys_per_query_notes(result: dict[str, Any]) -> dict[str, str]:
    """Why a selector's mean keys per query differs from k: ``{spec: sentence}`` for those rows only.

    Any difference that shows in the table (0.005 keys or more) is explained.  The reasons are those of the selector families
    (positional windows cut at the sequence ends, causal prefixes, unions, candidate-limited indexes,
    block-mode cluster routing); window figures are recomputed from :meth:`SparsePattern.window`.
    """
    k, causal = int(result["k"]), bool(result["is_causal"])
    L, S = int(result["workload"]["L"]), int(result["workload"]["S"])
    notes: dict[str, str] = {}
    for r in result["results"]:
        kpq = r.get("keys_per_query")
        if kpq is None or abs(kpq - k) < 0.005:
            continue
        notes[r["selector"]] = _keys_reason(r, k, causal, L, S)
    return notes


def _keys_reason(r: dict[str, Any], k: int, causal: bool, L: int, S: int) -> str:
    name, params = r.get("name", ""), r.get("params") or {}
    kpq = float(r["keys_per_query"])
    prefix = (f"causal: query i may see only its i + 1 first keys, so the first {k - 1} queries have fewer "
              f"than k = {k} (mean of min(i + 1, k) over {L} rows: "
              f"{sum(min(i + 1, S, k) for i in range(L)) / max(L, 1):.2f}). ") if causal and kpq < k else ""
    if name == "window":
        from ..pattern import SparsePattern

        w, d = params.get("width") or k, int(params.get("dilation") or 1)
        mean = SparsePattern.window(L, S, w, is_causal=causal, dilation=d).nnz / max(L, 1)
        where = (f"the {w} positions ending at the query, so the first {w - 1} queries see fewer" if causal else
                 f"{w // 2} keys before and {w - 1 - w // 2} after the query, cut at the sequence ends: the "
                 f"first {w // 2} and the last {w - 1 - w // 2} queries lose the keys past the ends")
        return (f"a window of w = {'width' if params.get('width') else 'k'} = {w} keys, {where}; positional "
                f"selectors never top a row up to k (mean over the {L} x {S} sequence: {mean:.2f}).")
    if name == "union":
        return (prefix + "a union counts a key chosen by several parts once, and its positional parts (window, "
                "sinks, random) are not topped up to k: window parts are cut at the sequence ends.")
    if name in ("sinks", "random", "pages"):
        return prefix + f"{name} chooses keys by position, not k per query: its own parameters set the count."
    if name == "cluster" and params.get("mode") == "block":
        return (prefix + "block mode attends to every key of the n_probe routed clusters (about n_probe x S / "
                "n_clusters keys, causal: the visible ones), whatever k: more keys than k, read exactly.")
    if kpq < k:
        return (prefix + "an index query returns fewer than k keys when its candidates run out (LSH probes, "
                "IVF lists or routed clusters holding fewer than k keys for that query).")
    return prefix.strip() or "the selector returns more keys than k per query."


# ---------------------------------------------------------------------------------------- tables
def _label_map(result: dict[str, Any]) -> dict[str, str]:
    return selector_labels([r["selector"] for r in result["results"]])


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of a compare result (dense baselines first).

    Selectors appear by their short label (:func:`selector_labels`); a keys/q value marked ``*`` differs
    from k, for the reason given by :func:`keys_per_query_notes`.
    """
    header = [c[0] for c in COLUMNS]
    rows: list[list[str]] = []
    dense = result["dense"]
    rows.append(["dense (ours, exact)", "all", "-", "-", "-", format_value(dense.get("dense_s")), "1.00",
                 format_value(dense["sdpa_s"] / dense["dense_s"]) if dense.get("sdpa_s") else "-", "1", "1", "0", "0"])
    if dense.get("sdpa_s"):
        rows.append(["torch SDPA (exact)", "all", "-", "-", "-", format_value(dense["sdpa_s"]),
                     format_value(dense["dense_s"] / dense["sdpa_s"]), "1.00", "1", "1", "0", "0"])
    labels = _label_map(result)
    notes = keys_per_query_notes(result)
    for r in result["results"]:
        if "error" in r:
            rows.append([labels[r["selector"]], f"error: {r['error']}"] + [""] * (len(COLUMNS) - 2))
            continue
        cells = [format_value(_get(r, path)) for _, path in COLUMNS]
        cells[0] = labels[r["selector"]]
        if r["selector"] in notes:
            cells[1] += "*"
        rows.append(cells)
    return header, rows


def _spec_lines(result: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """``(label, full spec, keys/q note or None)`` of every selector of a result, in table order."""
    labels = _label_map(result)
    notes = keys_per_query_notes(result)
    return [(labels[r["selector"]], r["selector"], notes.get(r["selector"])) for r in result["results"]]


def render_text(result: dict[str, Any]) -> str:
    """A compare result (:func:`sparseattn.tools.bench.compare`) as a fixed-width terminal table.

    Selectors are shown by short labels; the lines under the table give each label's full spec and why a
    keys/q value marked ``*`` differs from k.
    """
    header, rows = table_rows(result)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    out = [_title(result), line(header), line(["-" * w for w in widths])]
    out += [line(r) if not r[1].startswith("error") else f"{r[0]}  {r[1]}" for r in rows]
    out.append(_footnote(result))
    if fairness_line(result):
        out.append(fairness_line(result))
    specs = _spec_lines(result)
    if any(note for _, _, note in specs):
        out.append("keys/q *: why a selector reads a different number of keys than k per query:")
        out += [f"  {label}: {note}" for label, _, note in specs if note]
    out.append("selectors (label = full spec):")
    out += [f"  {label} = {spec}" for label, spec, _ in specs]
    return "\n".join(out)


def title_line(command: str, result: dict[str, Any], details: list[str]) -> str:
    """The title of a report of ``sparseattn <command>``: the data's description, then ``details`` and the
    thread count (``{threads} thread(s)``), joined by commas."""
    threads = f"{result['machine']['threads']} thread(s)"
    return f"sparseattn {command}: {result['workload']['description']} — {', '.join([*details, threads])}"


def _title(result: dict[str, Any]) -> str:
    w = result["workload"]
    return title_line("compare", result, [f"{w['groups']} group(s) x L={w['L']} queries x S={w['S']} keys",
                                          f"E={w['E']}", f"k={result['k']}", f"causal={result['is_causal']}"]
                      ) + f", medians of {result['repeats']}"


def _footnote(result: dict[str, Any]) -> str:
    return ("x dense: speed-up of build+select+kernel over our exact dense attention, same run; x SDPA: over "
            "torch SDPA on the same inputs, the faster of its time in this run and in a fresh process (see "
            "the fairness line); "
            "recall@k: share of the exact top-k found (tie-aware); mass: dense softmax mass on the selected "
            "keys; out err: relative Frobenius error of the output; keys/q: mean keys read per query (marked * "
            "where it differs from k, see the notes). Selectors are labelled by their non-default parameters; "
            "the full specs are listed below the table.")


def render_markdown(result: dict[str, Any], plots: list[str] | None = None) -> str:
    """A compare result as a Markdown page: title, table, footnotes, label -> spec table, machine, plots."""
    header, rows = table_rows(result)
    esc = lambda c: c.replace("|", "\\|")  # noqa: E731
    lines = [f"# {_title(result)}", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    lines += ["", _footnote(result), ""]
    if fairness_line(result):
        lines += [fairness_line(result), ""]
    specs = _spec_lines(result)
    if any(note for _, _, note in specs):
        lines += ["Keys per query marked *:", ""]
        lines += [f"* `{label}`: {esc(note)}" for label, _, note in specs if note]
        lines.append("")
    lines += ["| label | full selector spec |", "|---|---|"]
    lines += [f"| `{label}` | `{spec}` |" for label, spec, _ in specs]
    lines += ["", f"Machine: {machine_line(result)}", ""]
    for p in plots or []:
        lines.append(f"![{os.path.basename(p)}]({os.path.basename(p)})")
    return "\n".join(lines) + "\n"


def fairness_line(result: dict[str, Any]) -> str | None:
    """The SDPA baseline check of a result (``result["fairness"]``, when the harness recorded one)."""
    fair = result.get("fairness")
    if not isinstance(fair, dict) or not fair.get("reason"):
        return None
    state = {True: "ok", False: "FLAGGED", None: "not checked"}.get(fair.get("ok"), "not checked")
    return f"SDPA baseline check: {state} ({fair['reason']})."


def machine_line(result: dict[str, Any]) -> str:
    """One line naming the machine and library versions of a result (``result["machine"]``)."""
    m = result["machine"]
    libs = ", ".join(f"{k} {m[k]}" for k in ("numpy", "numba", "faiss", "datasketch", "scipy", "torch") if m.get(k))
    return f"{m['cpu']}, {m['cores']} cores, {m['threads']} thread(s), Python {m['python']}; {libs}"


# The style sheet of every HTML report of the tools (compare, decode).
HTML_CSS = ("body{font-family:sans-serif;margin:1.5em;font-size:14px}"
        "table{border-collapse:collapse;margin:0.5em 0}"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
        "th{background:#f4f4f4}td:first-child,th:first-child{text-align:left;white-space:nowrap}"
        ".sw{display:inline-block;width:0.8em;height:0.8em;margin-right:0.4em;border:1px solid #555}"
        "table.specs td,table.specs th{text-align:left}table.specs td:last-child{font-family:monospace;font-size:12px;"
        "overflow-wrap:anywhere;white-space:normal}"
        "p,ul{max-width:75em}img{max-width:100%}")


def render_html(result: dict[str, Any], plots: list[str] | None = None) -> str:
    """A compare result as a standalone HTML page (same content as :func:`render_markdown`).

    Selectors appear by short labels with their plot colour (the full spec is the cell's tooltip and is
    listed, wrapping, in a table below), so the accuracy columns fit a 1,280 px window.
    """
    header, rows = table_rows(result)
    labels = _label_map(result)
    styles = selector_styles([r["selector"] for r in result["results"] if "total_s" in r])
    by_label = {labels[spec]: spec for spec in labels}
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)

    def first_cell(c: str) -> str:
        spec = by_label.get(c)
        if spec is None:
            return f"<td>{html.escape(c)}</td>"
        sw = f'<span class="sw" style="background:{styles[spec][0]}"></span>' if spec in styles else ""
        return f'<td title="{html.escape(spec)}">{sw}{html.escape(c)}</td>'

    body = "".join("<tr>" + first_cell(r[0]) + "".join(f"<td>{html.escape(c)}</td>" for c in r[1:]) + "</tr>"
                   for r in rows)
    specs = _spec_lines(result)
    notes = "".join(f"<li><b>{html.escape(label)}</b>: {html.escape(note)}</li>" for label, _, note in specs if note)
    notes_html = f"<p>Keys per query marked *:</p><ul>{notes}</ul>" if notes else ""
    spec_rows = "".join(f"<tr><td>{html.escape(label)}</td><td>{html.escape(spec)}</td></tr>"
                        for label, spec, _ in specs)
    fair = fairness_line(result)
    fair_html = f"<p>{html.escape(fair)}</p>" if fair else ""
    imgs = "".join(f'<p><img src="{html.escape(os.path.basename(p))}"></p>' for p in plots or [])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>sparseattn compare</title>"
            f"<style>{HTML_CSS}</style></head><body><h2>{html.escape(_title(result))}</h2>"
            f"<table><tr>{th}</tr>{body}</table>"
            f"<p>{html.escape(_footnote(result))}</p>{fair_html}{notes_html}"
            f"<table class='specs'><tr><th>label</th><th>full selector spec</th></tr>{spec_rows}</table>"
            f"<p>Machine: {html.escape(machine_line(result))}</p>"
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


def plot_title(result: dict[str, Any]) -> str:
    """Two-line plot title: the data (description and spec), n keys, queries, groups, k and causal."""
    w = result["workload"]
    return (f"{w['description']} ({result['data']})\n"
            f"n = {w['S']:,} keys, {w['L']:,} queries x {w['groups']} group(s), d = {w['E']}, k = {result['k']}, "
            f"causal = {'yes' if result['is_causal'] else 'no'}")


def compare_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The plots of a compare result as matplotlib Figures by file name, not saved:
    ``compare_pareto.png`` (output error vs speed-up) and ``compare_time.png`` (time per selector).

    Every point and bar shows a number of :func:`table_rows` (same labels): the pareto plot puts each row
    at (its x SDPA, or x dense without an SDPA time; its out err), the time plot draws each selector's total
    seconds and marks those of the two dense baselines.  Every selector has one colour and marker in both
    plots (:func:`selector_styles`) and its short label (:func:`selector_labels`) in a legend or on the
    axis, never as text next to a point.  Empty when matplotlib is missing or no selector ran.
    """
    plt = pyplot()
    if plt is None:
        return {}
    ok = [r for r in result["results"] if "total_s" in r]
    if not ok:
        return {}
    labels = _label_map(result)
    styles = selector_styles([r["selector"] for r in ok])
    return {"compare_pareto.png": _pareto_figure(plt, result, ok, labels, styles),
            "compare_time.png": _time_figure(plt, result, ok, labels, styles)}


def plot_compare(result: dict[str, Any], out_dir: str) -> list[str]:
    """Write the :func:`compare_figures` of a result into ``out_dir``; return the paths."""
    return [save_figure(fig, out_dir, name) for name, fig in compare_figures(result).items()]


_MARKER_SCALE = {"*": 2.0, "P": 1.3, "X": 1.3, "h": 1.2}  # these look smaller at the same area


def _rgba(colour: str, alpha: float) -> tuple[float, float, float, float]:
    from matplotlib.colors import to_rgba

    return to_rgba(colour, alpha)


def _pareto_figure(plt: Any, result: dict[str, Any], ok: list[dict[str, Any]], labels: dict[str, str],
                   styles: dict[str, tuple[str, str]]) -> Any:
    dense = result["dense"]
    vs_sdpa = bool(dense.get("sdpa_s"))
    fig, ax = plt.subplots(figsize=(10, 5.2))
    for r in ok:
        x = r.get("speedup_vs_sdpa") if vs_sdpa else r.get("speedup_vs_dense")
        y = _get(r, "quality.rel_error_overall")
        if x is None or y is None or x <= 0:
            continue
        colour, marker = styles[r["selector"]]
        # translucent fill, opaque coloured edge: markers at (nearly) the same point stay visible
        ax.scatter([x], [y], s=80 * _MARKER_SCALE.get(marker, 1.0), marker=marker, facecolors=_rgba(colour, 0.35),
                   edgecolors=colour, linewidths=1.6, label=labels[r["selector"]], zorder=3)
    base = dense["sdpa_s"] / dense["dense_s"] if vs_sdpa else 1.0  # the dense row's x SDPA in the table
    ax.scatter([base], [0.0], s=90, color="black", marker="*", label="dense (ours, exact)", zorder=3)
    if vs_sdpa:
        ax.scatter([1.0], [0.0], s=60, facecolors="white", edgecolors="black", marker="o",
                   label="torch SDPA (exact)", zorder=3)
    pareto_axes(ax, f"speed-up over {'torch SDPA' if vs_sdpa else 'our dense attention'}, end to end "
                "(build + select + kernel), log scale", "output relative error vs exact (0 = exact; lower is better)")
    ax.set_ylim(bottom=-0.02 * max([1.0] + [float(_get(r, "quality.rel_error_overall") or 0.0) for r in ok]))
    ax.set_title(plot_title(result), fontsize=9)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False, borderaxespad=0.0)
    return fig


def _time_figure(plt: Any, result: dict[str, Any], ok: list[dict[str, Any]], labels: dict[str, str],
                 styles: dict[str, tuple[str, str]]) -> Any:
    dense = result["dense"]
    n = len(ok)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 0.34 * n + 2.0), sharey=True,
                                  gridspec_kw={"width_ratios": [3, 1.3]})
    ys = list(range(n))[::-1]  # first selector at the top, as in the table
    totals = [float(r["total_s"]) for r in ok]
    ax.barh(ys, totals, color=[styles[r["selector"]][0] for r in ok], edgecolor="black", linewidth=0.4, height=0.7)
    for y, t in zip(ys, totals, strict=True):
        ax.annotate(f"{t:.3g} s", (t, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    if dense.get("sdpa_s"):
        ax.axvline(dense["sdpa_s"], color="black", ls="--", lw=1, label=f"torch SDPA {dense['sdpa_s']:.3g} s")
    ax.axvline(dense["dense_s"], color="black", ls=":", lw=1.2, label=f"our dense {dense['dense_s']:.3g} s")
    positive = [t for t in totals if t > 0] + [dense["dense_s"]] + ([dense["sdpa_s"]] if dense.get("sdpa_s") else [])
    ax.set_xscale("log")
    ax.set_xlim(min(positive) / 2, max(positive) * 4)  # room for the value labels
    ax.set_yticks(ys, [labels[r["selector"]] for r in ok], fontsize=8)
    ax.set_xlabel("seconds, build + select + kernel (median), log scale")
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(fontsize=7, loc="lower right")
    left = [0.0] * n
    for key, name, colour in PHASES:
        share = [float(r.get(key) or 0.0) / max(sum(float(r.get(p) or 0.0) for p, _, _ in PHASES), 1e-300)
                 for r in ok]
        ax2.barh(ys, share, left=left, color=colour, edgecolor="black", linewidth=0.3, height=0.7, label=name)
        left = [a + b for a, b in zip(left, share, strict=True)]
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("share of the time")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08 - 0.6 / max(n, 1)), ncol=3,
               frameon=False)
    fig.suptitle(plot_title(result), fontsize=9)
    return fig


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
