"""When the checkpoint plugin saves: every ``checkpoint.every_steps`` steps, or the Young/Daly interval.

With ``every_steps = "auto"`` the first save comes at step ``AUTO_FIRST_STEP`` after the start and
measures the checkpoint cost C; after that the interval is ``sqrt(2 · MTBF · C)``, the one that
minimises the expected time lost to failures plus the time spent saving.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Literal

from vatra.resilience import recovery

if TYPE_CHECKING:
    from vatra.rundir import RunDir

AUTO_FIRST_STEP = 10  # every_steps = "auto": the first save, which measures the checkpoint cost C


def first_save_step(every: int | Literal["auto"], step: int) -> int:
    """The first step to save at when training starts (or resumes) at ``step``; 0: never."""
    return step + AUTO_FIRST_STEP if every == "auto" else fixed_next_step(every, step)


def fixed_next_step(every: int, step: int) -> int:
    """The next multiple of ``every`` after ``step``; 0: never."""
    return (step // every + 1) * every if every else 0


def young_daly_steps(costs: list[float], step_s: float, mtbf_s: float) -> int:
    """Steps until the next save: sqrt(2 · MTBF · C) in steps, C the mean of the last three costs."""
    cost = sum(costs[-3:]) / len(costs[-3:])
    return max(1, round(math.sqrt(2.0 * mtbf_s * cost) / max(step_s, 1e-9)))


def observed_mtbf(run_dir: RunDir, default_s: float) -> float:
    """Observed mean time between failures in this run folder, else ``default_s`` (``checkpoint.mtbf_s``)."""
    events = recovery.read_events(run_dir)
    restarts, _ = recovery.totals(events)
    if restarts == 0 or not events:
        return default_s
    return (time.time() - float(events[0]["time"])) / restarts
