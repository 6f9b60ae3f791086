"""Reading the ranks' traces: interval algebra over trace events, and the merged ``trace.json``.

Intervals are ``(start_us, end_us)`` pairs; a list of them is made disjoint and sorted by
:func:`union` before the set operations, which all take and return such lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vatra._io import atomic_write

Intervals = list[tuple[float, float]]


def union(spans: Intervals) -> Intervals:
    out: Intervals = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def intersect(a: Intervals, b: Intervals) -> Intervals:
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    out: Intervals = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def length(a: Intervals) -> float:
    return sum(end - start for start, end in a)


def load_rank_traces(folder: Path) -> list[dict[str, Any]]:
    """The ``trace-rank<r>.json`` files of a run folder, in rank order (each with its ``vatra``
    header); ValueError when there is none or one is not a trace this profiler wrote."""
    traces = []
    for path in sorted(folder.glob("trace-rank*.json")):
        try:
            trace = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable Chrome trace ({err})") from None
        if not isinstance(trace, dict) or "vatra" not in trace or "traceEvents" not in trace:
            raise ValueError(f"{path}: not a trace written by `vatra profile` (no 'vatra' header)")
        traces.append(trace)
    if not traces:
        raise ValueError(f"{folder}: no trace-rank<r>.json (did the run reach the profiled steps?)")
    return sorted(traces, key=lambda t: int(t["vatra"]["rank"]))


def merge(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace of every rank: rank r is process r (named "rank r", sorted by rank), and
    every timestamp is Unix time in µs less the earliest rank's window start, so the ranks' steps
    sit one under another in Perfetto or chrome://tracing."""
    shifted = [(t, float(t["vatra"]["wall_offset_us"])) for t in traces]
    starts = [min(e["ts"] for e in t["traceEvents"] if e.get("ph") == "X") + off for t, off in shifted]
    zero = min(starts)
    events: list[dict[str, Any]] = []
    for trace, off in shifted:
        rank = int(trace["vatra"]["rank"])
        tids: dict[Any, int] = {}
        for e in trace["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") in (
                "process_name",
                "process_labels",
                "process_sort_index",
            ):
                continue  # replaced below: one process per rank
            e = dict(e, pid=rank)
            if "ts" in e:
                e["ts"] = round(float(e["ts"]) + off - zero, 3)
            if "tid" in e:  # thread ids stay distinct per rank but short
                e["tid"] = tids.setdefault(e["tid"], len(tids))
            if "id" in e:  # flow arrows (forward → backward) stay within their rank
                e["id"] = f"{rank}:{e['id']}"
            events.append(e)
        events += [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"vatra": {"ranks": [t["vatra"] for t in traces], "unix_time_zero_us": zero}},
    }


def write_merged(folder: Path, traces: list[dict[str, Any]]) -> Path:
    path = folder / "trace.json"
    atomic_write(path, json.dumps(merge(traces)))
    return path
