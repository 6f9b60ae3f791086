"""What a launcher writes about itself into the run folder: when it started and ended, and the
run's effective training time ratio once it ends.

A rerun of the same command with the same ``--run-dir`` (after a preemption or a full disk) adds
its own ``launch_start`` / ``launch_end`` pair, so :func:`vatra.monitor.ettr.ettr_of_run` counts
every launch's wall time. Nothing here may fail the run: a run folder that cannot take a line (a
full disk) only loses the figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import psutil

from vatra.errors import VatraError
from vatra.monitor.ettr import ettr_of_run
from vatra.monitor.rca import Evidence, classify
from vatra.rundir import RunDir


def _note(run_dir: RunDir, kind: str, **fields: Any) -> None:
    with contextlib.suppress(OSError, VatraError):
        run_dir.log_event(kind, **fields)


def update_summary_ettr(run_dir: RunDir) -> None:
    """Put the run's ETTR (``ettr``, ``ettr_parts``) into summary.json, when there is one."""
    with contextlib.suppress(OSError, ValueError, VatraError):
        summary = json.loads(run_dir.summary.read_text())
        if isinstance(summary, dict):
            summary.update(ettr_of_run(run_dir.path))
            run_dir.write_summary(summary)


@contextlib.contextmanager
def launch_record(run_dir: RunDir | None, *, started: float | None = None, **fields: Any) -> Iterator[None]:
    """``launch_start`` before the block, ``launch_end`` (with ``ok``) after it, then the summary's
    ETTR. ``started``: when the launch began (default: this process's start, so the imports before
    this call count as start-up). ``run_dir`` None (a node launcher without a run folder of its
    own): nothing."""
    if run_dir is None:
        yield
        return
    if started is None:
        started = psutil.Process().create_time()
    _note(run_dir, "launch_start", pid=os.getpid(), host=socket.gethostname(), started=started, **fields)
    ok = False
    try:
        yield
        ok = True
    finally:
        error = sys.exc_info()[1]
        end: dict[str, Any] = {"ok": ok, "error": None if error is None else str(error)[:300]}
        if error is not None:  # why the launch stopped, as its own error says (a preemption's SIGTERM)
            code = getattr(error, "exit_code", None)
            end["cause"] = classify(Evidence(error=str(error), exit_code=code if code != 1 else None))
        _note(run_dir, "launch_end", **end)
        update_summary_ettr(run_dir)
