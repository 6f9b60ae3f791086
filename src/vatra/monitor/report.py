"""``report.html``: one self-contained page of plots, events and the summary for a run folder.

Generic over the x axis: training runs log ``step``, federated runs ``round``; every panel plots
the keys it finds and is skipped when none are present, and numeric keys no panel claims get
small plots of their own, so new features show up without touching this file.
"""

from __future__ import annotations

import html
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vatra._html import CSS, fmt, png, pyplot, quiet_matplotlib
from vatra._io import atomic_write
from vatra.errors import ConfigError, VatraError
from vatra.monitor.progress import headline
from vatra.monitor.rca_report import section as rca_section
from vatra.rundir import read_jsonl

if TYPE_CHECKING:
    from matplotlib.axes import Axes

plt = pyplot()  # Agg: no display, render to PNG only

MAX_EVENT_ROWS = 300
MAX_EXTRA_PANELS = 12


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    log_y: bool = False
    smooth: bool = False  # rolling median: per-step timings are noisy
    stacked: bool = False
    marks: bool = True  # draw anomalies and actions


PANELS = (
    Panel("Loss", ("loss", "val_loss", "train_loss"), log_y=True),
    Panel("Validation accuracy", ("val_accuracy", "accuracy"), marks=False),
    Panel("Gradient norm (before clipping)", ("grad_norm",), log_y=True),
    Panel("Learning rate", ("lr",), marks=False),
    Panel("Throughput (samples/s, rolling median)", ("samples_per_s",), smooth=True),
    Panel(
        "Step time breakdown (s, rolling median)",
        ("data_time_s", "fwd_bwd_time_s", "optim_time_s"),
        smooth=True,
        stacked=True,
        marks=False,
    ),
    Panel("Per-rank step time (s, window mean)", ("rank_step_time_s",), marks=False),
    Panel("Per-rank compute time (s, window mean): stragglers stand out", ("rank_compute_time_s",)),
    Panel("Pipeline bubble per stage: share of the schedule waiting", ("pp_stage_bubble",), marks=False),
    Panel("Per-rank batch size (balance)", ("rank_batch_size",), marks=False),
    Panel("Per-rank utilisation: busy / wall (balance windows)", ("rank_utilisation",), marks=False),
    Panel(
        "Adaptive batch: global batch and gradient noise scale (samples)",
        ("global_batch", "noise_scale"),
        log_y=True,
        marks=False,
    ),
    Panel("Adaptive batch: LR multiplier and peak memory per step (GB)", ("lr_scale", "peak_memory_gb")),
    Panel("Process CPU (%) and memory (MB)", ("cpu_percent", "rss_mb"), marks=False),
    Panel("GPU (NVML)", ("gpu_util_percent", "gpu_mem_mb", "gpu_temp_c"), marks=False),
    Panel("Power (W, all ranks, over each energy window)", ("power_w",), marks=False),
    Panel("Energy (J, all ranks, since the start)", ("energy_j",), marks=False),
    Panel("Bytes per round", ("bytes_up", "bytes_down"), marks=False),
    Panel("Round time (s)", ("round_time_s", "fit_time_s", "client_time_s"), marks=False),
)
SKIP_EXTRA = {
    "step", "round", "skipped", "step_time_s", "compute_time_s", "slowest_rank", "attempt",
    "server_examples", "evaluated_clients", "evaluated_examples", "batch_size", "busy_time_s",
    "evaluate_asked",
}  # fmt: skip
EVENT_STYLE = {  # event -> (colour, line style, label)
    "anomaly": ("tab:red", ":", "anomaly"),
    "skip_update": ("tab:gray", "--", "skipped update"),
    "rollback": ("tab:orange", "-", "rollback"),
    "lr_restore": ("tab:green", "--", "LR back on schedule"),
    "chaos": ("tab:purple", "-.", "injected fault"),
    "straggler": ("tab:brown", "--", "straggler named"),
    "prefetch": ("tab:cyan", "--", "prefetch raised"),
    "restart": ("black", "-", "restart"),
}


def _x_key(rows: list[dict[str, Any]]) -> str:
    return "round" if rows and "round" in rows[0] and "step" not in rows[0] else "step"


def _series(rows: list[dict[str, Any]], x: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r[x], r[key]) for r in rows if x in r and isinstance(r.get(key), int | float)]
    if not pts:
        return np.empty(0), np.empty(0)
    xs, ys = zip(*pts, strict=True)
    return np.asarray(xs, float), np.asarray(ys, float)


def _rolling_median(y: np.ndarray, width: int) -> np.ndarray:
    if len(y) < width or width < 2:
        return y
    pad = np.pad(y, (width // 2, width - 1 - width // 2), mode="edge")
    return np.median(np.lib.stride_tricks.sliding_window_view(pad, width), axis=1)


def _plot_timeline(ax: Axes, xs: np.ndarray, ys: np.ndarray, **style: Any) -> None:
    """A rollback sends the step back: the steps it undid are drawn faint, the kept timeline solid."""
    cuts = [0, *(np.nonzero(np.diff(xs) < 0)[0] + 1).tolist(), len(xs)]
    faint = {**style, "label": None, "alpha": 0.3, "linestyle": "--"}
    solid = np.ones(len(xs), bool)
    for a, b in itertools.pairwise(cuts[:-1]):  # every segment a rollback ended
        solid[a:b] &= xs[a:b] < xs[b]  # the steps at or after the restored one were undone
    start = 0
    for i in range(1, len(xs) + 1):
        if i == len(xs) or solid[i] != solid[start] or i in cuts:
            ax.plot(xs[start:i], ys[start:i], **(style if solid[start] else faint))
            if solid[start]:
                style = {**style, "label": None}  # one legend entry per series
            start = i


def _event_kind(e: dict[str, Any]) -> str:
    return str(e.get("action") or e["event"])


def _mark(ax: Axes, events: list[dict[str, Any]], x: str, seen: set[str]) -> None:
    for e in events:
        kind = _event_kind(e)
        if kind not in EVENT_STYLE or x not in e:
            continue
        colour, style, label = EVENT_STYLE[kind]
        at = e.get("at_step", e[x]) if kind == "chaos" else e[x]
        ax.axvline(
            at,
            color=colour,
            linestyle=style,
            linewidth=1.0,
            alpha=0.7,
            label=None if label in seen else label,
        )
        seen.add(label)


def _per_rank(rows: list[dict[str, Any]], x: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """A per-rank list metric as (points,) x values and a (points, ranks) matrix. A run resumed on
    another world size logs lists of another length: a rank absent at a point is NaN there (a gap
    in its line), as is a value that is not a number."""
    per = [(r[x], r[key]) for r in rows if isinstance(r.get(key), list) and x in r]
    ranks = max((len(values) for _, values in per), default=0)
    mat = np.full((len(per), ranks), np.nan)
    for i, (_, values) in enumerate(per):
        mat[i, : len(values)] = [v if isinstance(v, int | float) else np.nan for v in values]
    return np.asarray([p[0] for p in per], float), mat


def _plot_panel(panel: Panel, rows: list[dict[str, Any]], events: list[dict[str, Any]], x: str) -> str | None:
    present = [k for k in panel.keys if any(r.get(k) is not None for r in rows)]  # null all along: no line
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    width = max(1, len(rows) // 50)
    if panel.stacked:
        xs = np.asarray([r[x] for r in rows if x in r], float)
        ys = [
            _rolling_median(np.asarray([float(r.get(k, 0.0)) for r in rows if x in r]), width)
            for k in present
        ]
        ax.stackplot(xs, ys, labels=[k.removesuffix("_s").replace("_", " ") for k in present], alpha=0.8)
    elif isinstance(next(r[present[0]] for r in rows if present[0] in r), list):
        xs, mat = _per_rank(rows, x, present[0])
        for rank in range(mat.shape[1]):
            style = {
                "marker": ".",
                "markersize": 3,
                "linewidth": 1.2,
                "label": f"rank {rank}",
                "color": f"C{rank}",
            }
            _plot_timeline(ax, xs, mat[:, rank], **style)
    else:
        twin = None
        for i, key in enumerate(present):
            xk, yk = _series(rows, x, key)
            if panel.smooth:
                yk = _rolling_median(yk, width)
            target = ax
            if i == 1 and key == "rss_mb":  # different units: second axis
                twin = ax.twinx()
                target = twin
            dots = key.startswith("val_") or len(xk) < 40
            _plot_timeline(
                target,
                xk,
                yk,
                linewidth=1.2,
                label=key,
                color=f"C{i}",
                marker="o" if dots else None,
                markersize=4,
            )
        if twin is not None:
            twin.set_ylabel("rss_mb")
            ax.set_ylabel(present[0])
    if panel.log_y and all((_series(rows, x, k)[1] > 0).all() for k in present if not panel.stacked):
        ax.set_yscale("log")
    if panel.marks:
        _mark(ax, events, x, set())
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel(x)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return png(fig)


FEDERATED_SIDES = ("global", "server", "client", "mean_client", "worst_client")


def federated_panels(rows: list[dict[str, Any]]) -> list[Panel]:
    """One panel per task metric of a federated run (accuracy, r2, rmse, ndcg@k, a head's, ...), so
    the server's, the clients' weighted, their mean and worst figures of one metric share an axis."""
    names: list[str] = []
    for r in rows:
        for k in r:
            side = next((s for s in ("server", "client") if k.startswith(f"{s}_")), None)
            name = k.removeprefix(f"{side}_") if side else None
            if (
                name
                and name not in names
                and name not in ("examples", "time_s", "data", "num_examples", "model")
            ):
                names.append(name)
    main = [n for n in names if f"global_{n}" in rows[-1]] if rows else []
    return [
        Panel(
            f"Federated {name}: the server's data, the clients' weighted, their mean and worst",
            tuple(f"{side}_{name}" for side in FEDERATED_SIDES),
            log_y=name.endswith("loss"),
            marks=False,
        )
        for name in [*main, *(n for n in names if n not in main)]
    ]


def _extra_keys(rows: list[dict[str, Any]], panels: Sequence[Panel]) -> list[str]:
    claimed = {k for p in panels for k in p.keys} | SKIP_EXTRA
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            numeric = isinstance(v, int | float) and not isinstance(v, bool)
            if numeric and k not in claimed and k not in keys:
                keys.append(k)
    return keys[:MAX_EXTRA_PANELS]


def _table(rows: Sequence[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(fmt(v))}</td></tr>" for k, v in rows)
    return f"<table class='kv'>{cells}</table>"


def _events_table(events: list[dict[str, Any]], x: str) -> str:
    shown = [e for e in events if e["event"] not in ("prometheus",)][:MAX_EVENT_ROWS]
    if not shown:
        return "<p>No events: no anomalies, faults or actions were recorded.</p>"
    head = f"<tr><th>{x}</th><th>event</th><th>rank</th><th>what</th><th>evidence</th></tr>"
    body = []
    for e in shown:
        what = e.get("reason") or e.get("fault") or ", ".join(e.get("detectors", [])) or e.get("error", "")
        rest = {
            k: v
            for k, v in e.items()
            if k not in {"time", "event", "rank", x, "reason", "fault", "detectors"}
        }
        colour = EVENT_STYLE.get(_event_kind(e), ("#444", "", ""))[0].removeprefix("tab:")
        body.append(
            f"<tr><td>{html.escape(fmt(e.get(x, '')))}</td>"
            f"<td style='color:{colour}'><b>{html.escape(_event_kind(e))}</b></td>"
            f"<td>{html.escape(fmt(e.get('rank', '')))}</td><td>{html.escape(str(what))}</td>"
            f"<td class='ev'>{html.escape(fmt(rest))}</td></tr>"
        )
    more = len(events) - len(shown)
    note = f"<p>{more} more events in events.jsonl.</p>" if more > 0 else ""
    return f"<table class='events'>{head}{''.join(body)}</table>{note}"


def write_report(
    run_dir: str | Path, *, summary: dict[str, Any] | None = None, out: Path | None = None
) -> Path:
    """Render ``<run_dir>/report.html`` (or ``out``) from metrics.jsonl, events.jsonl and the summary."""
    run = Path(run_dir)
    metrics_path = run / "metrics.jsonl"
    if not run.is_dir() or not metrics_path.is_file():
        raise ConfigError(f"{run}: not a run folder (no metrics.jsonl); pass a folder under runs/")
    try:
        rows = read_jsonl(metrics_path)
        events = read_jsonl(run / "events.jsonl")
    except (json.JSONDecodeError, VatraError) as exc:
        raise ConfigError(f"{run}: unreadable metrics or events file ({exc})") from None
    if summary is None and (run / "summary.json").is_file():
        summary = json.loads((run / "summary.json").read_text())
    x = _x_key(rows)
    panels = [*PANELS, *(federated_panels(rows) if x == "round" else [])]
    with quiet_matplotlib():  # the console is the run's: no plotting library's notes in it
        images = [img for p in panels if (img := _plot_panel(p, rows, events, x))]
        for key in _extra_keys(rows, panels):
            img = _plot_panel(Panel(key, (key,)), rows, events, x)
            if img:
                images.append(img)
    counts: dict[str, int] = {}
    for e in events:
        counts[_event_kind(e)] = counts.get(_event_kind(e), 0) + 1
    # steps taken, not lines: a rollback or a resume logs the steps it replays again
    taken = len({r[x] for r in rows if x in r})
    cards: list[tuple[str, object]] = [(f"{x}s", taken), *sorted(counts.items())]
    if len(rows) > taken:
        cards.insert(1, (f"{x}s replayed", len(rows) - taken))
    shown = headline(summary) if summary else None
    if shown:
        cards.insert(0, (f"val {shown[0]}", f"{shown[1]:.4f}"))
    elif summary and isinstance(fed := summary.get(f"global_{summary.get('main_metric')}"), int | float):
        cards.insert(0, (f"global {summary['main_metric']}", f"{fed:.4f}"))
    if summary and isinstance(kwh := summary.get("energy_kwh"), int | float):
        cards.append((f"energy ({summary.get('energy_source')})", f"{kwh * 1000:.3g} Wh"))
        cards.append(("CO2", f"{summary.get('co2_kg', 0.0) * 1000:.3g} g"))
    card_html = "".join(
        f"<div class='card'>{html.escape(str(k))}<b>{html.escape(str(v))}</b></div>" for k, v in cards
    )
    imgs = "".join(f"<img alt='plot' src='data:image/png;base64,{b}'>" for b in images)
    summary_html = (
        _table(sorted((summary or {}).items())) if summary else "<p>No summary (the run did not finish).</p>"
    )
    title = f"vatra report: {html.escape(run.name)}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{CSS}</style></head><body>
<h1>vatra run report</h1><p class="sub">{html.escape(str(run.resolve()))}</p>
<div class="cards">{card_html}</div>
<h2>Curves</h2><p class="sub">Vertical lines: red dotted = anomaly, orange = rollback, grey dashed = skipped
update, purple = injected fault, brown = straggler named.</p><div class="grid">{imgs}</div>
<h2>Summary</h2>{summary_html}
{rca_section(run, events, summary)}
<h2>Events</h2>{_events_table(events, x)}
</body></html>
"""
    target = out or run / "report.html"
    return atomic_write(target, page)  # not durable: vatra report draws it again from the run folder
