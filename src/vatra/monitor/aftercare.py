"""Work after training that must never fail the run: the report, an exporter's shutdown.

Training is done and its figures are in ``metrics.jsonl`` and ``summary.json`` by then, so an
error here is logged (a ``<what>_failed`` event with the error, and one warning line) and the run
keeps its exit status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def best_effort(
    what: str, fn: Callable[[], object], log_event: Callable[..., None] | None, *, retry: str = ""
) -> bool:
    """``fn()``; on an exception, a ``<what>_failed`` event and one warning line (``retry`` says how to
    do it again). True when ``fn`` succeeded."""
    try:
        fn()
        return True
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        if log_event is not None:
            with contextlib.suppress(OSError):  # a full disk: the warning line still says it
                log_event(f"{what}_failed", error=error)
        print(f"vatra: warning: {what} failed: {error}{retry}", flush=True)
        return False


def report_after_training(
    run_dir: Path, summary: dict[str, Any] | None, log_event: Callable[..., None]
) -> bool:
    """``report.html`` once training is over (``summary`` None: summary.json if written), best
    effort (:func:`best_effort`)."""

    def write() -> None:
        from vatra.monitor.report import write_report  # matplotlib: only where a report is made

        write_report(run_dir, summary=summary)

    return best_effort("report", write, log_event, retry=f"; `vatra report {run_dir}` writes it again")
