"""A rank's step time, phase by phase, read off its trace (the reader used without HTA).

Each moment of a profiled step on the training thread counts once, in this order: ``checkpoint``
(inside ``vatra.checkpoint``), ``data_wait`` (``vatra.data_wait``), ``comm_exposed`` (a collective
runs — ``gloo:*`` on gloo's threads, ``nccl:*`` or an NCCL kernel — while the training thread runs
no op: it waits for the collective), ``forward`` / ``backward`` / ``optimizer`` (inside their
labels), ``other`` (ops outside the labels: clipping, evaluation, plugins), ``idle`` (no op, no
label, no collective: Python between ops, sleeps). ``comm_overlapped`` is collective time hidden
under the training thread's ops; it is not part of the step's sum.
"""

from __future__ import annotations

import statistics
from typing import Any

from vatra.monitor.profile.trace import Intervals, intersect, length, subtract, union

PARTS = ("data_wait", "forward", "backward", "comm_exposed", "optimizer", "checkpoint", "other", "idle")
COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel", "mpi:")
NOT_COMPUTE = ("c10d::", "gloo:", "nccl:", "vatra.", "ProfilerStep", "record_param_comms")


def _span(e: dict[str, Any]) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))


def rank_breakdown(trace: dict[str, Any]) -> dict[str, Any]:
    """Seconds per part over the window (``parts``), their shares of the step time (``shares``),
    the steps' mean time and the ops' counts (``ops_per_step``, ``median_op_us``) of one rank."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith("vatra.step#")]
    if not steps:
        raise ValueError(f"rank {trace['vatra']['rank']}: the trace holds no vatra.step# span")
    main = steps[0]["tid"]
    on_main = [e for e in events if e["tid"] == main]
    window = union([_span(e) for e in steps])

    def label(name: str) -> Intervals:
        return intersect(union([_span(e) for e in on_main if e.get("name") == f"vatra.{name}"]), window)

    ops = [
        e
        for e in on_main
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
        and not str(e.get("name", "")).startswith(NOT_COMPUTE)
        and not str(e.get("name", "")).startswith(("DistributedDataParallel.", "Optimizer."))
    ]
    busy = intersect(union([_span(e) for e in ops]), window)
    comm = intersect(
        union([_span(e) for e in events if str(e.get("name", "")).startswith(COMM_PREFIXES)]), window
    )
    checkpoint = label("checkpoint")
    data = subtract(label("data_wait"), checkpoint)
    taken = union(checkpoint + data)
    exposed = subtract(subtract(comm, busy), taken)
    taken = union(taken + exposed)
    parts: dict[str, float] = {"checkpoint": length(checkpoint), "data_wait": length(data)}
    parts["comm_exposed"] = length(exposed)
    for name in ("forward", "backward", "optimizer"):
        mine = subtract(label(name), taken)
        parts[name] = length(mine)
        taken = union(taken + mine)
    other = subtract(busy, taken)
    parts["other"] = length(other)
    parts["idle"] = length(subtract(window, union(taken + other)))
    total = length(window)
    # top-level ops of the compute phases: how many a step runs, and how long the typical one takes
    phases = union(label("forward") + label("backward") + label("optimizer"))
    top = [e for e in ops if e.get("cat") == "cpu_op" and intersect([_span(e)], phases)]
    top = _outermost(top)
    return {
        "rank": int(trace["vatra"]["rank"]),
        "steps": len(steps),
        "step_s": total / len(steps) / 1e6,
        "parts": {name: parts[name] / 1e6 for name in PARTS},
        "shares": {name: (parts[name] / total if total else 0.0) for name in PARTS},
        "comm_overlapped": length(intersect(comm, busy)) / 1e6,
        "comm_total": length(comm) / 1e6,
        "ops_per_step": len(top) / len(steps),
        "median_op_us": statistics.median(float(e.get("dur", 0.0)) for e in top) if top else 0.0,
        "op_share_of_compute": length(intersect(busy, phases)) / length(phases) if phases else 0.0,
    }


def _outermost(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ops not nested inside another (what the Python code called, not their internals)."""
    out: list[dict[str, Any]] = []
    end = -1.0
    for e in sorted(ops, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
        start, stop = _span(e)
        if start >= end:
            out.append(e)
            end = stop
    return out
