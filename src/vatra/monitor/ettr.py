"""Effective training time ratio (ETTR): productive step time over the wall time of every launch.

A run folder may see several launches (a rerun after a preemption or a full disk, with the same
``--run-dir``) and, inside one launch, several attempts (the elastic agent restarting the worker
group after a death). The launcher records ``launch_start`` and ``launch_end`` events in
``events.jsonl``; the checkpoint plugin records ``attempt_start`` as each attempt's trainer begins;
the agent records ``worker_failed``; every step line of ``metrics.jsonl`` carries ``step_time_s``
(and ``checkpoint_s`` where the loop was blocked by a save). From these, in seconds:

- ``wall``: Σ over launches of end − start (the launcher process's start, its imports included; a
  launch killed before its ``launch_end`` ends at the last thing it recorded);
- ``productive``: Σ ``step_time_s`` of the final trajectory, the last record of each step;
- ``recomputed``: Σ ``step_time_s`` of the records a later one of the same step replaced (work a
  restart or a rollback threw away and did again);
- ``checkpoint_stall``: Σ ``checkpoint_s``, the loop blocked by saves;
- ``startup``: the first launch's start to its first ``attempt_start`` (imports, spawning the
  ranks, the rendezvous, data and model);
- ``restart``: for every later attempt, its ``attempt_start`` minus the moment the one before it
  ended (the agent's ``worker_failed`` report, or the launch's start for a rerun);
- ``other``: the rest of the wall time (evaluation, loading the checkpoint on resume, the final
  save, the report, the time between a rank's death and the agent seeing it).

``ettr = productive / wall``; the parts other than ``wall`` add up to ``wall``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vatra.rundir import read_jsonl

PARTS = ("productive", "startup", "restart", "recomputed", "checkpoint_stall", "other")


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [r for r in read_jsonl(path) if isinstance(r, dict)]
    except (OSError, ValueError):
        return []


def _launches(events: list[dict[str, Any]], end_of_record: float) -> list[tuple[float, float, int]]:
    """(start, end, index of the launch_start event) of each launch; a folder written without the
    launcher (``vatra.fit`` in one process) counts its first event as the start."""
    out: list[tuple[float, float, int]] = []
    starts = [i for i, e in enumerate(events) if e.get("event") == "launch_start"]
    for n, i in enumerate(starts):
        stop = starts[n + 1] if n + 1 < len(starts) else len(events)
        mine = events[i:stop]
        ends = [float(e["time"]) for e in mine if e.get("event") == "launch_end"]
        if ends:
            end = ends[-1]
        else:  # killed outright: its last record; the metrics' end for the last launch
            end = max(float(e.get("time", 0.0)) for e in mine)
            if stop == len(events):
                end = max(end, end_of_record)
        start = events[i].get("started", events[i]["time"])  # the launcher process's own start
        out.append((float(start), end, i))
    if not out and events:
        out.append((float(events[0].get("time", 0.0)), end_of_record, 0))
    return out


def ettr_of_run(run_dir: str | Path, *, now: float | None = None) -> dict[str, Any]:
    """``{"ettr": float, "ettr_parts": {wall, productive, startup, restart, recomputed,
    checkpoint_stall, other}}`` of the run folder (see the module); ``now``: the end of a launch
    still running (default: its last record)."""
    run = Path(run_dir)
    events = [e for e in _lines(run / "events.jsonl") if isinstance(e.get("time"), int | float)]
    metrics = _lines(run / "metrics.jsonl")
    last_event = max((float(e["time"]) for e in events), default=0.0)
    launches = _launches(events, max(last_event, now or 0.0))
    wall = sum(max(0.0, end - start) for start, end, _ in launches)

    final: dict[int, float] = {}
    recomputed = stall = 0.0
    for m in metrics:
        step, seconds = m.get("step"), m.get("step_time_s")
        if isinstance(step, int) and isinstance(seconds, int | float):
            recomputed += final.get(step, 0.0)  # replaced: that run of the step was thrown away
            final[step] = float(seconds)
        if isinstance(m.get("checkpoint_s"), int | float):
            stall += float(m["checkpoint_s"])
    productive = sum(final.values())

    startup = restart = 0.0
    bounds = [i for _, _, i in launches] + [len(events)]
    for n, (start, _, first) in enumerate(launches):
        previous = start  # when the time before this launch's first attempt began
        for e in events[first : bounds[n + 1]]:
            kind = e.get("event")
            if kind == "attempt_start":
                gap = max(0.0, float(e["time"]) - previous)
                if n == 0 and previous == start:
                    startup += gap
                else:
                    restart += gap
                previous = float("inf")  # until the attempt ends, the time is the attempt's
            elif kind == "worker_failed" and previous == float("inf"):
                previous = float(e["time"])
    other = max(0.0, wall - productive - recomputed - stall - startup - restart)
    parts = {
        "wall": wall,
        "productive": productive,
        "startup": startup,
        "restart": restart,
        "recomputed": recomputed,
        "checkpoint_stall": stall,
        "other": other,
    }
    covered = sum(parts[p] for p in PARTS)
    if covered > wall > 0:  # clocks of several processes: never a part beyond the wall time
        parts["wall"] = wall = covered
    return {"ettr": productive / wall if wall > 0 else 0.0, "ettr_parts": parts}
