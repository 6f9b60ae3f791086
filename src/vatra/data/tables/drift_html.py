"""``vatra data drift``'s page: one self-contained HTML file with the statistics and plots of a report.

Plots are numpy histograms rendered by matplotlib into PNGs embedded as base64 (the run report's
helpers), drifted columns first, at most ``MAX_PLOTS``: a 1 M-row table costs a histogram pass per
plotted column, not a plotting library's per-row work. matplotlib is imported when a page is written,
so importing ``vatra.data.tables`` stays cheap.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vatra._html import CSS, fmt, png, pyplot
from vatra._io import atomic_write
from vatra.data.tables.drift import ColumnDrift, DriftReport, category_counts, numeric_values
from vatra.errors import write_failed

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MAX_PLOTS = 40
HIST_BINS = 50
MAX_BARS = 15
STAT_COLUMNS = ("psi", "ks", "ks_pvalue", "wasserstein", "chi2_pvalue", "jensen_shannon")
PAGE_CSS = (
    "tr.drifted td{background:#fde8e8} .grid{grid-template-columns:repeat(auto-fill,minmax(720px,1fr))}"
)


def _hist(ax: Axes, series: dict[str, np.ndarray], title: str) -> None:
    """Shares of rows per bin, bins shared by every series (log-spaced when positive values span
    more than two decades, as a unit change does)."""
    lo = min(float(np.quantile(x, 0.001)) for x in series.values())
    hi = max(float(np.quantile(x, 0.999)) for x in series.values())
    if lo > 0.0 and hi / lo > 100.0:
        bins = np.geomspace(lo, hi, HIST_BINS + 1)
        ax.set_xscale("log")
    else:
        bins = np.linspace(lo, hi, HIST_BINS + 1) if hi > lo else np.linspace(lo - 0.5, hi + 0.5, 3)
    for i, (label, x) in enumerate(series.items()):
        share = np.histogram(x, bins)[0] / len(x)
        ax.stairs(share, bins, label=label, fill=i == 0, alpha=0.35 if i == 0 else 0.9, color=f"C{i}")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("share of rows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _changed(col: ColumnDrift, cur: np.ndarray, ref: np.ndarray, sources: np.ndarray | None) -> np.ndarray:
    """The current values with the rows a unit change covers mapped back to the reference's units.
    Per source: that source's rows; whole column: every row; a subset: the rows outside the
    reference's range whose mapped-back value falls inside it."""
    out = cur.copy()
    lo, hi = np.nanmin(ref), np.nanmax(ref)
    for u in col.units:
        back = (cur - u.offset) / u.factor
        if u.source is not None and sources is not None:
            rows = sources == u.source
        elif u.fraction >= 0.999:
            rows = np.ones(len(cur), bool)
        else:
            rows = ((cur < lo) | (cur > hi)) & (back >= lo) & (back <= hi)
        out[rows] = back[rows]
    return out


def _numeric_plot(
    col: ColumnDrift, reference: pa.Table, current: pa.Table, sources: np.ndarray | None
) -> Any:
    plt = pyplot()

    ref, cur = numeric_values(reference[col.column]), numeric_values(current[col.column])
    finite_r, finite_c = ref[~np.isnan(ref)], cur[~np.isnan(cur)]
    fig, axes = plt.subplots(
        1, 2 if col.units else 1, figsize=(11.0 if col.units else 6.4, 3.0), squeeze=False
    )
    _hist(
        axes[0, 0], {"reference": finite_r, "current": finite_c}, f"{col.column}: {col.reason or 'no drift'}"
    )
    if col.units:
        if sum(u.fraction for u in col.units) < 0.1:
            axes[0, 0].set_yscale("log")  # a few % of rows at ×100 would be a flat line
        back = _changed(col, cur, ref, sources)
        names = ", ".join(u.name for u in col.units[:3])
        _hist(
            axes[0, 1],
            {"reference": finite_r, f"current, {names} undone": back[~np.isnan(back)]},
            "mapped back",
        )
    return fig


def _categorical_plot(col: ColumnDrift, reference: pa.Table, current: pa.Table) -> Any:
    plt = pyplot()

    r, c = category_counts(reference[col.column]), category_counts(current[col.column])
    nr, nc = max(sum(r.values()), 1), max(sum(c.values()), 1)
    cats = sorted(r.keys() | c.keys(), key=lambda k: -max(r.get(k, 0) / nr, c.get(k, 0) / nc))[:MAX_BARS]
    x = np.arange(len(cats))
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.bar(x - 0.2, [r.get(k, 0) / nr for k in cats], 0.4, label="reference", alpha=0.6)
    ax.bar(x + 0.2, [c.get(k, 0) / nc for k in cats], 0.4, label="current", alpha=0.9)
    ax.set_xticks(x, [f"{k} (new)" if k not in r else k for k in cats], rotation=45, ha="right", fontsize=8)
    ax.set_title(f"{col.column}: {col.reason or 'no drift'}", fontsize=10)
    ax.set_ylabel("share of rows")
    ax.legend(fontsize=8)
    return fig


def _table(report: DriftReport) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "column",
            "kind",
            "rows (ref / cur)",
            "null share (ref / cur)",
            *STAT_COLUMNS,
            "decided by",
            "drifted",
            "why",
        )
    )
    body = []
    for c in report.columns:
        stats = "".join(f"<td>{fmt(c.stats[k]) if k in c.stats else ''}</td>" for k in STAT_COLUMNS)
        nulls = f"{c.stats['null_share_reference']:.3g} / {c.stats['null_share_current']:.3g}"
        body.append(
            f"<tr class='{'drifted' if c.drifted else ''}'><td><b>{html.escape(c.column)}</b></td>"
            f"<td>{c.kind}</td>"
            f"<td>{c.rows[0]:,} / {c.rows[1]:,}</td><td>{nulls}</td>{stats}<td>{c.method}</td>"
            f"<td>{'yes' if c.drifted else 'no'}</td><td>{html.escape(c.reason)}</td></tr>"
        )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def write_html(
    report: DriftReport, reference: pa.Table, current: pa.Table, path: Path, *, title: str
) -> Path:
    """Write the report's page to ``path`` (atomically) and return it."""

    sources = None
    if report.source_column and report.source_column in current.column_names:
        sources = pc.cast(current[report.source_column], pa.string()).to_numpy(zero_copy_only=False)
    order = [c for c in report.columns if c.drifted] + [c for c in report.columns if not c.drifted]
    images = []
    for col in order[:MAX_PLOTS]:
        fig = (
            _numeric_plot(col, reference, current, sources)
            if col.kind == "numeric"
            else _categorical_plot(col, reference, current)
        )
        images.append(f"<img alt='{html.escape(col.column)}' src='data:image/png;base64,{png(fig)}'>")
    more = len(order) - MAX_PLOTS
    note = f"<p class='sub'>{more} more columns not plotted (at most {MAX_PLOTS}).</p>" if more > 0 else ""
    skipped = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in report.skipped.items()
    )
    cards = (
        ("columns compared", len(report.columns)),
        ("drifted", len(report.drifted)),
        ("unit changes", len(report.unit_changes)),
        ("skipped", len(report.skipped)),
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}{PAGE_CSS}</style></head><body>
<h1>{html.escape(title)}</h1><p class="sub">{html.escape(report.summary_line())}</p>
<div class="cards">{"".join(f"<div class='card'>{k}<b>{v}</b></div>" for k, v in cards)}</div>
<h2>Columns</h2>{_table(report)}
{f"<h2>Skipped</h2><table class='kv'>{skipped}</table>" if skipped else ""}
<h2>Distributions</h2><p class="sub">Reference against current, shares of rows per bin; for a unit
change also the current rows it covers mapped back to the reference's units.</p>{note}
<div class="grid">{"".join(images)}</div>
</body></html>
"""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, page)  # not durable: a report, drawn again by vatra data drift
    except OSError as err:
        raise write_failed(err, path) from None
    return path
