"""Who died, when, at which step — and how long the group took to get going again.

A SIGKILLed worker cannot log its own death, so two witnesses record it:

* every rank keeps ``<run>/.ranks/rank<r>.json`` up to date with its last completed step
  (a fixed-width in-place write per step, a few microseconds);
* the launcher process, which hosts torch's elastic agent, listens to the agent's failure
  report (exit code or signal, pid, local rank) and appends a ``worker_failed`` event to
  ``events.jsonl`` with that rank's last completed step from its progress file.

After the restart, rank 0 of the new attempt reads these to log ``recovered`` (version resumed,
steps lost, seconds from the dead rank's last completed step to the first completed step after
the resume: an upper bound of the time since the death, by at most one step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vatra.monitor.rca import line
from vatra.monitor.rca_evidence import worker_failure_cause
from vatra.rundir import RunDir, read_jsonl

PROGRESS_WIDTH = 160
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def progress_path(run_dir: Path, rank: int) -> Path:
    return run_dir / ".ranks" / f"rank{rank}.json"


class ProgressFile:
    """This rank's last completed step, rewritten in place (no allocation, no rename) every step."""

    def __init__(self, run_dir: Path, rank: int, attempt: int) -> None:
        path = progress_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.rank, self.attempt, self.pid = rank, attempt, os.getpid()

    def update(self, step: int) -> None:
        record = {
            "rank": self.rank,
            "step": step,
            "attempt": self.attempt,
            "pid": self.pid,
            "time": time.time(),
        }
        os.pwrite(self.fd, json.dumps(record).ljust(PROGRESS_WIDTH).encode(), 0)

    def close(self) -> None:
        os.close(self.fd)


def read_progress(run_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads(progress_path(run_dir, rank).read_text()))
    except (OSError, ValueError):
        return None


def signal_name(exit_code: int) -> str | None:
    """``SIGKILL`` for exit code -9 (killed by a signal), None for an ordinary exit code."""
    if exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


class _FailureRecorder(logging.Handler):
    """Turns the elastic agent's failure report into a ``worker_failed`` event in the run folder.

    torch's process context reports the first failed worker of a group as
    ``logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", ...)`` — the
    record's args carry the exit code, local rank and pid as values, read here without parsing text.
    """

    def __init__(self, run_dir: RunDir, rank_offset: int, max_restarts: int) -> None:
        super().__init__(logging.ERROR)
        self.run_dir = run_dir
        self.rank_offset = rank_offset
        self.restarts_left = max_restarts

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or not isinstance(record.args, tuple):
            return
        exit_code, local_rank, pid = (int(str(a)) for a in record.args[:3])
        rank = self.rank_offset + local_rank
        progress = read_progress(self.run_dir.path, rank) or {}
        sig = signal_name(exit_code)
        if self.restarts_left > 0:
            action = (
                f"restarting the worker group from the last checkpoint ({self.restarts_left} restart(s) left)"
            )
        else:
            action = None  # the run stops: the cause's recommendation is what to do
        self.restarts_left -= 1
        try:  # root-cause analysis: why, and what now; never in the way of the failure's record
            found = worker_failure_cause(self.run_dir.path, rank, exit_code, sig, self.run_dir.errors, action)
            print(f"vatra: {line(found, rank)}", flush=True)
        except Exception:
            found = None
        self.run_dir.log_event(
            "worker_failed",
            rank=rank,
            exit_code=exit_code,
            signal=sig,
            pid=pid,
            step=progress.get("step"),
            last_step_time=progress.get("time"),  # the rank was alive then: death came after
            attempt=progress.get("attempt"),
            source="elastic agent",
            cause=found,
        )


@contextlib.contextmanager
def record_worker_failures(
    run_dir: RunDir | None, rank_offset: int = 0, max_restarts: int = 0
) -> Iterator[None]:
    """While the agent runs, log every worker-group failure it reports into ``run_dir``'s events,
    each with its cause (:mod:`vatra.monitor.rca`) and one console line."""
    if run_dir is None:
        yield
        return
    logger = logging.getLogger(_AGENT_LOGGER)
    handler = _FailureRecorder(run_dir, rank_offset, max_restarts)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # recorded here; vatra prints its own line
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def previous_attempts(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if e.get("event") == "attempt_start")


def failures_since_last_attempt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``worker_failed`` events logged after the latest ``attempt_start``."""
    last = max((i for i, e in enumerate(events) if e.get("event") == "attempt_start"), default=-1)
    return [e for e in events[last + 1 :] if e.get("event") == "worker_failed"]


def last_progress(run_dir: Path) -> int | None:
    """Highest step any rank of the previous attempt completed (None when no rank recorded one).

    Every progress file in the folder counts, whatever the world size now (it may have changed),
    but only those of the newest attempt among them: a rank the last attempt did not have left an
    older file. Without a shared filesystem these are the ranks of this host only.
    """
    found = []
    for path in (run_dir / ".ranks").glob("rank*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    newest = max((int(p.get("attempt", 0)) for p in found), default=0)
    steps = [int(p["step"]) for p in found if int(p.get("attempt", 0)) == newest]
    return max(steps) if steps else None


def totals(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(restarts, steps lost) over every recovery this run folder has seen."""
    recoveries = [e for e in events if e.get("event") in ("recovered", "resumed")]
    return len(recoveries), sum(int(e.get("steps_lost") or 0) for e in recoveries)


def read_events(run_dir: RunDir) -> list[dict[str, Any]]:
    try:
        return read_jsonl(run_dir.events)
    except ValueError:  # a torn last line from a killed writer: keep the readable ones
        lines = run_dir.events.read_text().splitlines()
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out
