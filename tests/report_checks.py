"""Checks of the compare report shared by the tests: every plotted coordinate is a number of the table
(imported as ``from report_checks import ...``)."""

from __future__ import annotations

from sparseattn.tools import report


def table_numbers(result, column):
    """{row label: the cell in ``column`` of the compare table} for the rows where it is a number."""
    header, rows = report.table_rows(result)
    i = header.index(column)
    out = {}
    for row in rows:
        try:
            float(row[i].rstrip("*"))
        except ValueError:
            continue
        out[row[0]] = row[i].rstrip("*")
    return out


def shows(value, cell):
    """``value`` is what the table cell shows: equal to it up to half a unit of its last printed digit."""
    decimals = len(cell.partition(".")[2])
    return abs(float(value) - float(cell)) <= 0.5 * 10.0 ** -decimals * (1 + 1e-9)


def assert_plots_match_the_table(result):
    """Read every plotted coordinate back from the figures and find it in the table, and the reverse."""
    figs = report.compare_figures(result)
    try:
        assert set(figs) == {"compare_pareto.png", "compare_time.png"}
        vs_sdpa = bool(result["dense"].get("sdpa_s"))
        xs = table_numbers(result, "x SDPA" if vs_sdpa else "x dense")
        err = table_numbers(result, "out err")
        totals = table_numbers(result, "total s")
        # pareto: one point per table row, at (x SDPA, out err) as printed (the table rounds to 2-3 digits)
        ax = figs["compare_pareto.png"].axes[0]
        points = {c.get_label(): tuple(map(float, c.get_offsets()[0])) for c in ax.collections}
        assert all(len(c.get_offsets()) == 1 for c in ax.collections)
        assert set(points) == {label for label in xs if float(xs[label]) > 0 and label in err}
        for label, (x, y) in points.items():
            assert shows(x, xs[label]) and shows(y, err[label]), (label, (x, y), (xs[label], err[label]))
        # time: one bar per selector of the table, its length the total seconds; the baselines as lines
        ax = figs["compare_time.png"].axes[0]
        ticks = [t.get_text() for t in ax.get_yticklabels()]
        widths = {ticks[list(ax.get_yticks()).index(round(p.get_y() + p.get_height() / 2))]: p.get_width()
                  for p in ax.patches}
        selectors = {label: t for label, t in totals.items() if label not in ("dense (ours, exact)",
                                                                              "torch SDPA (exact)")}
        assert set(widths) == set(selectors)
        for label, width in widths.items():
            assert shows(width, selectors[label]), (label, width, selectors[label])
        lines = {line.get_label().split(" ")[0] + " " + line.get_label().split(" ")[1]: line.get_xdata()[0]
                 for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert shows(lines["our dense"], totals["dense (ours, exact)"])
        if vs_sdpa:
            assert shows(lines["torch SDPA"], totals["torch SDPA (exact)"])
    finally:
        import matplotlib.pyplot as plt

        for fig in figs.values():
            plt.close(fig)
