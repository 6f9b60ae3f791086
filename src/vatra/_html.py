"""Pieces every self-contained HTML page shares (run report, study report, drift report): the
style sheet, figures embedded as PNG and how a value is printed. Below every feature package, so a
data or tune page does not import the run monitor for them."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import math
import warnings
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def quiet_matplotlib() -> Iterator[None]:
    """No matplotlib message on the console while a page is drawn: its log lines (a first use builds
    the font cache and says so after 5 s, which a loaded machine reaches) and its warnings are
    about the drawing, not the run the page shows."""
    log = logging.getLogger("matplotlib")
    level, log.level = log.level, logging.ERROR
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="matplotlib")
            yield
    finally:
        log.setLevel(level)


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the Agg backend (no display: render to PNG only). Imported on first
    use: matplotlib costs about a second and only the report commands need it."""
    with quiet_matplotlib():
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def png(fig: Any) -> str:
    """``fig`` as base64 PNG for an ``<img src='data:image/png;base64,…'>``; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def fmt(v: Any) -> str:
    """A value as a table cell shows it: 4 significant digits for floats, JSON for containers."""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(v, dict | list):
        return json.dumps(v, default=str)
    return str(v)


CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1560px}
h1{margin-bottom:4px} .sub{color:#666;margin-top:0}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(640px,1fr));gap:12px}
.grid img{width:100%;border:1px solid #ddd;border-radius:4px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
table.kv th{background:#f4f4f4} table.events td.ev{font-family:monospace;font-size:11px;max-width:720px;
word-break:break-all} .cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:20px}
"""
