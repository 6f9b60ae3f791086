"""A profiled run folder read back: the merged trace, each rank's breakdown, the engine's clocks
for the same steps, and (where it applies) Holistic Trace Analysis' temporal breakdown."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vatra.monitor.profile.breakdown import PARTS, rank_breakdown
from vatra.monitor.profile.trace import load_rank_traces, write_merged
from vatra.rundir import read_jsonl

ENGINE_CLOCKS = ("data_time_s", "fwd_bwd_time_s", "optim_time_s")


def analyse(folder: Path) -> dict[str, Any]:
    """``trace.json`` written into ``folder`` (the run folder), and what the traces say: per rank
    (``ranks``), the mean over ranks (``mean``), the engine's clocks (``engine``) and HTA's view
    (``hta``, or why it was not used: ``reader``)."""
    traces = load_rank_traces(folder)
    merged = write_merged(folder, traces)
    ranks = [rank_breakdown(t) for t in traces]
    window = traces[0]["vatra"]["steps"]
    gpu = any(e.get("cat") == "kernel" for t in traces for e in t["traceEvents"])
    out: dict[str, Any] = {
        "steps": window,
        "world_size": traces[0]["vatra"]["world_size"],
        "trace": merged.name,
        "rank_traces": [f"trace-rank{r['rank']}.json" for r in ranks],
        "ranks": ranks,
        "mean": {p: statistics.fmean(r["shares"][p] for r in ranks) for p in PARTS},
        "step_s": statistics.fmean(r["step_s"] for r in ranks),
        "engine": engine_clocks(folder, window),
        "reader": "vatra",
    }
    if gpu:
        out.update(_hta(folder, [r["rank"] for r in ranks]))
    return out


def engine_clocks(folder: Path, window: list[int]) -> dict[str, float]:
    """Rank 0's own clocks (metrics.jsonl) over the window's steps: mean seconds per step."""
    path = folder / "metrics.jsonl"
    if not window or not path.exists():
        return {}
    rows = [m for m in read_jsonl(path) if window[0] <= m.get("step", 0) <= window[1] and "step_time_s" in m]
    if not rows:
        return {}
    keys = ("step_time_s", *ENGINE_CLOCKS)
    return {k: statistics.fmean(float(m.get(k, 0.0)) for m in rows) for k in keys}


def _hta(folder: Path, ranks: list[int]) -> dict[str, Any]:
    """HTA's temporal breakdown (GPU compute, non-compute, idle per rank) and its communication/
    computation overlap, for traces with GPU kernels; HTA is not a dependency of vatra."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return {"reader": "vatra (GPU kernels traced, HTA not installed: pip install HolisticTraceAnalysis)"}
    try:
        analysis = TraceAnalysis(trace_files={r: f"trace-rank{r}.json" for r in ranks}, trace_dir=str(folder))
        temporal = analysis.get_temporal_breakdown(visualize=False)
        overlap = analysis.get_comm_comp_overlap(visualize=False)
    except Exception as err:  # HTA's own failure must not cost the profile
        return {"reader": f"vatra (HTA failed: {type(err).__name__}: {err})"}
    return {
        "reader": "hta",
        "hta": {"temporal": temporal.to_dict("records"), "comm_comp_overlap": overlap.to_dict("records")},
    }
