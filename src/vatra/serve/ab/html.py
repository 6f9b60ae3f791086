"""The A/B report as one self-contained HTML page: the decision and its evidence, the effect and
its confidence sequence over time and the p-values as inline SVG, the traffic split and the
guardrails. No script, no external file: it opens offline and in a mail attachment. Every string
from the log (variant and version names) is escaped: the log's content comes from clients."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np

from vatra._html import CSS, fmt
from vatra.serve.ab._records import ABResult, Evidence

W, H, PAD = 720, 260, 48
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _scale(lo: float, hi: float, a: float, b: float) -> tuple[float, float]:
    """``(slope, offset)`` mapping ``[lo, hi]`` onto ``[a, b]`` (a degenerate range is widened)."""
    if not hi > lo:
        lo, hi = lo - 1.0, hi + 1.0
    k = (b - a) / (hi - lo)
    return k, a - k * lo


def _path(xs: np.ndarray, ys: np.ndarray) -> str:
    return " ".join(
        f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(zip(xs, ys, strict=True))
    )


def _chart(
    chart_id: str,
    title: str,
    x: np.ndarray,
    lines: Sequence[tuple[str, np.ndarray, str]],
    band: tuple[np.ndarray, np.ndarray] | None = None,
    hlines: Sequence[tuple[float, str]] = (),
    vline: float | None = None,
    log: bool = False,
) -> str:
    """An SVG line chart: ``lines`` are ``(css class, y, colour)``, ``band`` a shaded interval,
    ``hlines`` dashed reference lines ``(y, label)``, ``vline`` the decision's x; ``log`` draws
    ``log10(y)`` (floored at 1e-6) and labels the axis in y. The y range leaves out the first tenth
    of the band, whose early width would flatten the rest; what falls outside is clipped."""
    if log:
        lines = [(c, np.log10(np.maximum(y, 1e-6)), col) for c, y, col in lines]
        hlines = [(math.log10(h), label) for h, label in hlines]
    ys = (
        [y for _, y, _ in lines]
        + [b[len(b) // 10 :] for b in band or ()]
        + [np.array([h for h, _ in hlines])]
    )
    finite = np.concatenate([y[np.isfinite(y)] for y in ys])
    y_lo, y_hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    kx, bx = _scale(float(x.min()), float(x.max()), PAD, W - 12)
    ky, by = _scale(y_lo, y_hi, H - 28, 12)
    parts = [
        f'<svg id="{chart_id}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img">',
        f"<title>{_e(title)}</title>",
        f'<clipPath id="{chart_id}-area"><rect x="{PAD}" y="8" width="{W - 12 - PAD}" '
        f'height="{H - 36}"/></clipPath>',
        f'<g clip-path="url(#{chart_id}-area)">',
    ]
    if band is not None:
        ok = np.isfinite(band[0]) & np.isfinite(band[1])
        if ok.any():
            xb = x[ok] * kx + bx
            top, bot = band[1][ok] * ky + by, band[0][ok] * ky + by
            pts = " ".join(
                f"{a:.1f},{b:.1f}" for a, b in zip(np.r_[xb, xb[::-1]], np.r_[top, bot[::-1]], strict=True)
            )
            parts.append(f'<polygon class="ci-band" points="{pts}" fill="#1f77b4" fill-opacity="0.18"/>')
    for h, label in hlines:
        yy = h * ky + by
        parts.append(
            f'<line class="ref" x1="{PAD}" x2="{W - 12}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#888" '
            f'stroke-dasharray="4 3"/><text x="{W - 14}" y="{yy - 3:.1f}" font-size="10" '
            f'text-anchor="end" fill="#555">{_e(label)}</text>'
        )
    for cls, ys_, color in lines:
        ok = np.isfinite(ys_)
        if ok.any():
            d = _path(x[ok] * kx + bx, ys_[ok] * ky + by)
            parts.append(f'<path class="{cls}" d="{d}" fill="none" stroke="{color}" stroke-width="1.8"/>')
    parts.append("</g>")
    if vline is not None:
        xx = vline * kx + bx
        parts.append(
            f'<line class="decision" x1="{xx:.1f}" x2="{xx:.1f}" y1="8" y2="{H - 28}" stroke="#d62728"/>'
        )
    for v, anchor, xx in ((x.min(), "start", PAD), (x.max(), "end", W - 12)):
        parts.append(
            f'<text x="{xx}" y="{H - 10}" font-size="11" text-anchor="{anchor}">{fmt(float(v))}</text>'
        )
    for v in (y_lo, y_hi):
        label = fmt(float(10**v if log else v))
        parts.append(f'<text x="4" y="{v * ky + by + 4:.1f}" font-size="11">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _evidence_rows(ev: Evidence, champion: str, challenger: str) -> str:
    cells = [
        (f"n ({champion})", ev.n_champion),
        (f"n ({challenger})", ev.n_challenger),
        (f"mean ({champion})", ev.mean_champion),
        (f"mean ({challenger})", ev.mean_challenger),
        ("effect (challenger - champion)", ev.effect),
        ("interval", f"[{fmt(ev.lo)}, {fmt(ev.hi)}]"),
        ("always-valid p", ev.p),
    ]
    return "".join(f"<tr><th>{_e(k)}</th><td>{_e(fmt(v))}</td></tr>" for k, v in cells)


def _traffic(result: ABResult) -> str:
    total = sum(result.traffic.values()) or 1
    x, bars, rows = 0.0, [], []
    for i, (name, n) in enumerate(result.traffic.items()):
        w = 600.0 * n / total
        color = COLORS[i % len(COLORS)]
        bars.append(f'<rect class="split" x="{x:.1f}" y="0" width="{w:.1f}" height="22" fill="{color}"/>')
        versions = ", ".join(f"{v} ({c})" for v, c in sorted(result.versions.get(name, {}).items()))
        rows.append(
            f"<tr><td>{_e(name)}</td><td>{n}</td><td>{n / total:.1%}</td><td>{_e(versions)}</td></tr>"
        )
        x += w
    svg = f'<svg id="traffic-split" viewBox="0 0 600 22" width="600" height="22">{"".join(bars)}</svg>'
    head = "<tr><th>variant</th><th>requests</th><th>share</th><th>versions (requests)</th></tr>"
    return f'{svg}<table id="traffic">{head}{"".join(rows)}</table>'


def _guardrails(result: ABResult) -> str:
    head = (
        "<tr><th>guardrail</th><th>what</th><th>champion</th><th>challenger</th>"
        "<th>interval (challenger - champion)</th><th>always-valid p</th><th>status</th></tr>"
    )
    rows = []
    for g in result.guardrails:
        ev = g.tripped or g.now
        interval = f"[{fmt(ev.lo)}, {fmt(ev.hi)}]" if ev else "-"
        p = fmt(ev.p) if ev else "-"
        status = f"TRIPPED at n={ev.n_champion}+{ev.n_challenger}" if g.tripped and ev else "ok"
        rows.append(
            f'<tr class="guardrail"><td>{_e(g.name)}</td><td>{_e(g.description)}</td>'
            f"<td>{fmt(g.champion)}</td><td>{fmt(g.challenger)}</td><td>{interval}</td><td>{p}</td><td>{status}</td></tr>"
        )
    return f'<table id="guardrails">{head}{"".join(rows)}</table>'


def render(result: ABResult, name: str) -> str:
    """The page for one experiment on model ``name``."""
    d, cfg = result.decision, result.config
    cards = [
        ("decision", d.action),
        ("rule", d.rule),
        ("metric", cfg.metric),
        ("alpha", fmt(cfg.alpha)),
        ("mde", fmt(cfg.mde) if cfg.mde is not None else "-"),
    ]
    body = [
        f"<h1>A/B test: {_e(name)}</h1>",
        f'<p class="sub">champion <b>{_e(result.champion)}</b> vs challenger <b>{_e(result.challenger)}</b>; '
        "mSPRT with a normal mixing prior: the p-value and the interval stay valid however often "
        "this page is looked at.</p>",
        '<div class="cards">'
        + "".join(f'<div class="card" id="card-{k}">{k}<b>{_e(v)}</b></div>' for k, v in cards)
        + "</div>",
        f'<p id="reason">{_e(d.reason)}</p>',
    ]
    if d.evidence is not None and d.rule != "none":
        what = (
            "requests, harm rate per arm" if d.rule.startswith("guardrail:") else "outcomes, metric per arm"
        )
        body.append(
            f'<h2>Evidence when the rule fired ({what})</h2><table class="kv" id="evidence">'
            f"{_evidence_rows(d.evidence, result.champion, result.challenger)}</table>"
        )
    if result.primary is not None:
        body.append(
            f'<h2>Now</h2><table class="kv" id="now">'
            f"{_evidence_rows(result.primary, result.champion, result.challenger)}</table>"
        )
    s = result.series
    if s is not None:
        n = s.n_a + s.n_b
        hl = [(0.0, "0")]
        if cfg.mde is not None:
            hl.append(((1 if cfg.higher_is_better else -1) * cfg.mde, "mde"))
        primary_rule = d.evidence is not None and d.rule in ("win", "lose", "futility")
        vline = (
            float(d.evidence.n_champion + d.evidence.n_challenger) if primary_rule and d.evidence else None
        )
        body.append("<h2>Effect and its confidence sequence over outcomes</h2>")
        body.append(
            _chart("effect-chart", "effect", n, [("effect", s.effect, "#1f77b4")], (s.lo, s.hi), hl, vline)
        )
        body.append("<h2>p-value over outcomes (log scale)</h2>")
        lines = [("p-seq", s.p, "#1f77b4"), ("p-fixed", s.z_p, "#ff7f0e")]
        body.append(
            _chart(
                "p-chart",
                "p-values",
                n,
                lines,
                None,
                [(cfg.alpha, f"alpha {fmt(cfg.alpha)}")],
                vline,
                log=True,
            )
        )
        body.append(
            '<p class="sub">blue: always-valid p (mSPRT); orange: a fixed-horizon z-test, valid only '
            "at one look planned in advance (shown for contrast).</p>"
        )
    body += ["<h2>Traffic split</h2>", _traffic(result), "<h2>Guardrails</h2>", _guardrails(result)]
    if result.notes or result.skipped:
        items = [*result.notes, *(f"{why}: {n} lines skipped" for why, n in sorted(result.skipped.items()))]
        body.append('<h2>Notes</h2><ul id="notes">' + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>")
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>A/B {_e(name)}</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>"
    )
