"""``vatra report RUN_DIR``: (re)write the run's self-contained report.html."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra._extras import require
from vatra.cli.app import app


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="Run folder, e.g. runs/digits-20260101-120000-4242."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the page here instead of RUN_DIR/report.html."
    ),
) -> None:
    """Write report.html: loss, accuracy, gradient norm, throughput, step-time and per-rank plots,
    anomalies and healing actions on the curves, the summary and the events (opens offline)."""
    require("matplotlib", "report", "vatra report")
    from vatra.monitor.report import write_report  # matplotlib: imported only by this command

    print(f"vatra: report written to {write_report(run_dir, out=out)}")
