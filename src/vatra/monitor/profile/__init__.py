"""``vatra profile``: torch.profiler windows on every rank, the merged trace, each rank's step
breakdown and a verdict with its evidence and safe fixes (docs/profiling.md)."""

from vatra.monitor.profile.analyse import analyse
from vatra.monitor.profile.breakdown import PARTS, rank_breakdown
from vatra.monitor.profile.console import format_report
from vatra.monitor.profile.driver import Measure, profile_run, window_overrides
from vatra.monitor.profile.verdict import Finding, judge
from vatra.monitor.profile.window import TraceWindow

__all__ = [
    "PARTS",
    "Finding",
    "Measure",
    "TraceWindow",
    "analyse",
    "format_report",
    "judge",
    "profile_run",
    "rank_breakdown",
    "window_overrides",
]
