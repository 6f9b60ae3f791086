"""The evidence root-cause analysis reads: the run folder's records and the machine's state.

Used where a failure is seen: a rank's own exception (:class:`~vatra.monitor.rca_plugin.RootCause`)
and the launcher's report of a worker that exited (:func:`worker_failure_cause`), whose only
evidence of its own is the exit code or signal; the dead rank's ``failure`` event, its one-line
error and the metrics before it fill in the rest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vatra.monitor.rca import Evidence, classify

TAIL_BYTES = 1 << 16  # the end of metrics.jsonl / events.jsonl read for the last records


def machine_state(path: Path) -> tuple[float | None, float | None]:
    """(free fraction of the disk holding ``path``, available fraction of the machine's memory)."""
    disk: float | None = None
    memory: float | None = None
    try:
        usage = shutil.disk_usage(path)
        disk = usage.free / usage.total if usage.total else None
    except OSError:
        pass
    try:
        import psutil

        vm = psutil.virtual_memory()
        memory = vm.available / vm.total if vm.total else None
    except (ImportError, OSError):
        pass
    return disk, memory


def tail_records(path: Path, limit: int = 20, nbytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The last ``limit`` whole JSON lines of ``path`` (a torn or damaged line is skipped)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - nbytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = data.splitlines()[1 if size > nbytes else 0 :]  # the first may be cut
    out = []
    for text in lines[-limit:]:
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def since_attempt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events after the latest ``attempt_start`` (all of them without one)."""
    last = max((i for i, e in enumerate(events) if e.get("event") == "attempt_start"), default=-1)
    return events[last + 1 :]


def worker_failure_cause(
    run: Path,
    rank: int,
    exit_code: int,
    signal: str | None,
    errors: Path | None,
    action: str | None = None,
) -> dict[str, Any]:
    """The cause of a worker's exit as the launcher saw it (``exit_code``; ``signal`` when killed):
    with the rank's own ``failure`` event of this attempt and its one-line error (left in
    ``errors``, not taken: the launcher reports it later), the metrics before, disk and memory."""
    events = since_attempt(tail_records(run / "events.jsonl", limit=200, nbytes=1 << 18))
    own = [e for e in events if e.get("event") == "failure" and e.get("rank") == rank]
    said = ""
    if errors is not None:
        try:
            said = str(json.loads((errors / f"rank{rank:05d}.json").read_text()).get("message", ""))
        except (OSError, ValueError, AttributeError):
            said = ""
    error = said or (str(own[-1].get("error", "")) if own else "")
    disk, memory = machine_state(run)
    ev = Evidence(
        rank=rank,
        exit_code=exit_code,
        signal=signal,
        error=error,
        traceback=str(own[-1].get("traceback", "")) if own else "",
        recent=[m for m in tail_records(run / "metrics.jsonl", limit=8) if isinstance(m.get("step"), int)],
        events=events,
        disk_free_frac=disk,
        mem_available_frac=memory,
    )
    cause = classify(ev, action)
    how = f"killed by {signal}" if signal else f"exit code {exit_code}"
    cause["evidence"] = [
        f"rank {rank} {how}",
        *[x for x in cause["evidence"] if not x.startswith(f"rank {rank} ")],
    ]
    return cause
