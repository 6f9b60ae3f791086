"""A study's outputs: ``study.json`` (every trial), ``report.html`` (history, importances, the adaptive
region, the best trial's curves), and reading them back for ``vatra tune show`` / ``best``."""

from __future__ import annotations

import html
import json
import math
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra._html import CSS, png, pyplot
from vatra._io import atomic_write
from vatra.errors import ConfigError
from vatra.rundir import read_jsonl

if TYPE_CHECKING:
    import optuna

    from vatra.tune.study import Study


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Every trial as plain data: state, value, params, duration, run folder, error."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "value": t.value,
                "params": t.params,
                "duration_s": t.duration.total_seconds() if t.duration is not None else None,
                "started_at": t.datetime_start.timestamp() if t.datetime_start is not None else None,
                "completed_at": t.datetime_complete.timestamp() if t.datetime_complete is not None else None,
                "run_dir": t.user_attrs.get("run_dir"),
                "threads": (t.user_attrs.get("worker") or {}).get("threads"),
                "error": t.user_attrs.get("error"),
                "retry_of": t.user_attrs.get("retry_of"),
                "last_step": steps[-1] if steps else None,
                "intermediate": [[s, t.intermediate_values[s]] for s in steps],
            }
        )
    return rows


def importances(study: optuna.Study) -> dict[str, float]:
    """optuna's parameter importances (PED-ANOVA by default); {} until there are enough trials."""
    import optuna

    try:
        with warnings.catch_warnings():  # "few trials in some regimes": a small study's importances are rough
            warnings.simplefilter("ignore", UserWarning)
            found = optuna.importance.get_param_importances(study)
        return {k: float(v) for k, v in found.items()}
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


def write_study_json(study: optuna.Study, run: Study) -> Path:
    """``<study folder>/study.json``, rewritten whole (atomically) each time."""
    from vatra.tune._secret import redact

    rows = trial_rows(study)
    done = ranked({"trials": rows, "direction": run.cfg.tune.direction})
    best = done[0] if done else None
    payload = {
        "study": run.name,
        "objective": run.cfg.tune.objective,
        "direction": run.cfg.tune.direction,
        "storage": redact(run.url),
        "written": time.time(),
        "best": best,
        "importances": importances(study) if len(done) >= 2 else {},
        "trials": rows,
    }
    # not durable: rewritten as trials finish, and drawn again from the study's storage
    return atomic_write(run.folder / "study.json", json.dumps(payload, indent=2, default=str))


def find_study(given: str, out_dir: str = "runs") -> tuple[Path, dict[str, Any]]:
    """A study folder (a path, or a name under ``out_dir``) and its study.json."""
    for folder in (Path(given), Path(out_dir) / given):
        if (folder / "study.json").is_file():
            return folder, json.loads((folder / "study.json").read_text())
    raise ConfigError(
        f"study {given!r}: no study.json in {given} or {Path(out_dir) / given}; pass a study folder "
        "(runs/<study>) or its name, as written by 'vatra tune CONFIG'"
    )


def ranked(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Complete trials, best first."""
    done = [t for t in data["trials"] if t["state"] == "COMPLETE" and t["value"] is not None]
    return sorted(done, key=lambda t: t["value"], reverse=data["direction"] == "maximize")


def state_counts(data: dict[str, Any]) -> dict[str, int]:
    """How many trials of study.json are in each state, by state name."""
    return dict(sorted(Counter(t["state"] for t in data["trials"]).items()))


def _history(data: dict[str, Any]) -> str:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    done = [t for t in data["trials"] if t["state"] == "COMPLETE"]
    pruned = [t for t in data["trials"] if t["state"] == "PRUNED" and t["intermediate"]]
    ax.scatter([t["number"] for t in done], [t["value"] for t in done], s=14, label="complete", color="C0")
    ax.scatter(
        [t["number"] for t in pruned],
        [t["intermediate"][-1][1] for t in pruned],
        s=14,
        marker="x",
        label="pruned (last value)",
        color="C3",
    )
    best: list[float] = []
    pick = max if data["direction"] == "maximize" else min
    for t in sorted(done, key=lambda t: t["number"]):
        best.append(t["value"] if not best else pick(best[-1], t["value"]))
    ax.step([t["number"] for t in sorted(done, key=lambda t: t["number"])], best, where="post", label="best")
    ax.set_title("Optimisation history", fontsize=11)
    ax.set_xlabel("trial")
    ax.set_ylabel(data["objective"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def _importances(data: dict[str, Any]) -> str | None:
    if not data["importances"]:
        return None
    plt = pyplot()

    items = sorted(data["importances"].items(), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(7.2, 0.4 * len(items) + 1.2))
    ax.barh([k for k, _ in items], [v for _, v in items], color="C2")
    ax.set_title("Parameter importances (optuna, PED-ANOVA)", fontsize=11)
    ax.grid(alpha=0.3, axis="x")
    return png(fig)


def _regions(events: list[dict[str, Any]]) -> str | None:
    """The adaptive sampler's numeric regions over trials, one line pair per parameter."""
    moves = [e for e in events if e.get("event") == "adaptive"]
    series: dict[str, list[tuple[float, float, float]]] = {}
    for e in moves:
        region = e.get("new_region")  # {"low", "high", "log"}, {"frozen": v} or {"choices": [...]}
        if not isinstance(region, dict):
            continue
        if isinstance(region.get("low"), int | float) and isinstance(region.get("high"), int | float):
            low, high = float(region["low"]), float(region["high"])
        elif isinstance(region.get("frozen"), int | float) and not isinstance(region["frozen"], bool):
            low = high = float(region["frozen"])
        else:
            continue  # a categorical region: listed in the moves table only
        series.setdefault(str(e.get("param")), []).append((float(e.get("trial", 0)), low, high))
    if not series:
        return None
    plt = pyplot()

    fig, axes = plt.subplots(len(series), 1, figsize=(7.2, 1.8 * len(series) + 0.6), squeeze=False)
    for ax, (param, pts) in zip(axes[:, 0], sorted(series.items()), strict=True):
        xs, lo, hi = zip(*sorted(pts), strict=True)
        ax.fill_between(xs, lo, hi, step="post", alpha=0.3, color="C1")
        ax.step(xs, lo, where="post", color="C1")
        ax.step(xs, hi, where="post", color="C1")
        if all(v > 0 for v in lo) and max(hi) / min(lo) > 100:
            ax.set_yscale("log")
        ax.set_ylabel(param, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("Adaptive search region over trials", fontsize=11)
    axes[-1, 0].set_xlabel("trial")
    return png(fig)


def _moves_table(events: list[dict[str, Any]]) -> str:
    moves = [e for e in events if e.get("event") == "adaptive"]
    if not moves:
        return "<p>No reshaping events (the sampler is not adaptive, or it has not reshaped yet).</p>"
    head = "<tr><th>trial</th><th>move</th><th>param</th><th>old</th><th>new</th><th>reason</th></tr>"
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(e.get(k, '')))}</td>" for k in
                         ("trial", "move", "param", "old_region", "new_region", "reason")) + "</tr>"
        for e in moves[-200:]
    )  # fmt: skip
    return f"<table class='events'>{head}{body}</table>"


def _best_curves(best: dict[str, Any] | None) -> list[str]:
    from vatra.monitor.report import PANELS, _plot_panel

    if not best or not best.get("run_dir") or not (Path(best["run_dir"]) / "metrics.jsonl").is_file():
        return []
    run = Path(best["run_dir"])
    rows = read_jsonl(run / "metrics.jsonl")
    events = read_jsonl(run / "events.jsonl") if (run / "events.jsonl").is_file() else []
    return [img for p in PANELS[:2] if (img := _plot_panel(p, rows, events, "step"))]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def write_report(folder: Path) -> Path:
    """``<study folder>/report.html`` from study.json, events.jsonl and the best trial's run folder."""
    from vatra._extras import require

    require("matplotlib", "report", "the study report")

    data = json.loads((folder / "study.json").read_text())
    events = read_jsonl(folder / "events.jsonl") if (folder / "events.jsonl").is_file() else []
    images = [img for img in (_history(data), _importances(data), _regions(events)) if img]
    curves = _best_curves(data["best"])
    cards: list[tuple[str, object]] = [("trials", len(data["trials"])), *state_counts(data).items()]
    if data["best"]:
        cards.insert(0, (f"best {data['objective']}", _fmt(data["best"]["value"])))
    card_html = "".join(
        f"<div class='card'>{html.escape(str(k))}<b>{html.escape(str(v))}</b></div>" for k, v in cards
    )
    top = ranked(data)[:10]
    names = sorted({k for t in top for k in t["params"]})
    head = "<tr><th>trial</th><th>value</th>" + "".join(f"<th>{html.escape(n)}</th>" for n in names) + "</tr>"
    body = "".join(
        f"<tr><td>{t['number']}</td><td>{_fmt(t['value'])}</td>"
        + "".join(f"<td>{html.escape(_fmt(t['params'].get(n, '')))}</td>" for n in names)
        + "</tr>"
        for t in top
    )
    failed = [t for t in data["trials"] if t.get("error")]
    fail_html = "".join(
        f"<tr><td>{t['number']}</td><td>{html.escape(str(t['error']))}</td></tr>" for t in failed
    )
    img = "".join(f"<img alt='plot' src='data:image/png;base64,{b}'>" for b in images + curves)
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>vatra study: {html.escape(data["study"])}</title><style>{CSS}</style></head><body>
<h1>vatra study report: {html.escape(data["study"])}</h1>
<p class="sub">{html.escape(data["direction"])} {html.escape(data["objective"])} · storage
{html.escape(data["storage"])}</p><div class="cards">{card_html}</div>
<h2>Plots</h2><p class="sub">History, importances, the adaptive region, then the best trial's curves.</p>
<div class="grid">{img}</div>
<h2>Best trials</h2><table>{head}{body}</table>
<h2>Failed trials</h2>{f"<table>{fail_html}</table>" if failed else "<p>None.</p>"}
<h2>Search-space reshaping</h2>{_moves_table(events)}
</body></html>
"""
    return atomic_write(folder / "report.html", page)  # not durable: drawn again with study.json
