"""The report's section on why the run failed or misbehaved, and where its wall time went."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from vatra.monitor.ettr import PARTS, ettr_of_run
from vatra.monitor.rca import WORDS, diagnosis

MAX_ROWS = 50


def _ettr_table(run: Path, summary: dict[str, Any] | None) -> str:
    figures = summary if summary and isinstance(summary.get("ettr_parts"), dict) else ettr_of_run(run)
    parts = figures["ettr_parts"]
    wall = parts.get("wall") or 0.0
    if not wall or not parts.get("productive"):  # a federated run's rounds are not training steps
        return "<p>No launch or training step recorded: no effective training time.</p>"
    rows = "".join(
        f"<tr><th>{p.replace('_', ' ')}</th><td>{parts.get(p, 0.0):.2f} s</td>"
        f"<td>{parts.get(p, 0.0) / wall:.1%}</td></tr>"
        for p in PARTS
    )
    head = (
        f"<p>ETTR <b>{figures['ettr']:.3f}</b>: productive step time over {wall:.1f} s of wall time, "
        "every launch of this run folder counted (docs/root-cause.md).</p>"
    )
    return f"{head}<table class='kv'>{rows}</table>"


def _causes_table(events: list[dict[str, Any]]) -> str:
    found = [e for e in events if isinstance(e.get("cause"), dict)][:MAX_ROWS]
    if not found:
        return "<p>No failure or anomaly was recorded.</p>"
    verdict = diagnosis(events)
    assert verdict is not None
    lead = (
        f"<p>Most likely cause: <b>{html.escape(WORDS.get(verdict['kind'], verdict['kind']))}</b> "
        f"(confidence {verdict['confidence']:.2g}, {html.escape(str(verdict['event']))} at step "
        f"{html.escape(str(verdict.get('step')))}).</p>"
    )
    cells = ("step", "event", "rank", "cause", "confidence", "evidence", "action")
    head = "<tr>" + "".join(f"<th>{c}</th>" for c in cells) + "</tr>"
    body = "".join(_row(e, e["cause"]) for e in found)
    return f"{lead}<table class='events'>{head}{body}</table>"


def _row(e: dict[str, Any], c: dict[str, Any]) -> str:
    rank = e.get("straggler_rank", e.get("rank", ""))  # a straggler event: the slow rank, not the logger
    cells = [
        html.escape(str(e.get("step", ""))),
        html.escape(str(e["event"])),
        html.escape(str(rank)),
        f"<b>{html.escape(WORDS.get(c['kind'], c['kind']))}</b>",
        f"{c['confidence']:.2g}",
        html.escape("; ".join(map(str, c.get("evidence") or []))),
        html.escape(str(c.get("action", ""))),
    ]
    return "<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>"


def section(run: Path, events: list[dict[str, Any]], summary: dict[str, Any] | None) -> str:
    """``<h2>`` sections: root causes (every event with a ``cause``), effective training time."""
    return (
        f"<h2>Root causes</h2>{_causes_table(events)}"
        f"<h2>Effective training time</h2>{_ettr_table(run, summary)}"
    )
