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


def mean_cost(costs: list[float]) -> float:
    """The checkpoint cost C: the moving average of the last three saves' blocking times."""
    return sum(costs[-3:]) / len(costs[-3:])


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's interval sqrt(2 · C · MTBF), in seconds of training between two saves."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def young_daly_steps(costs: list[float], step_s: float, mtbf_s: float) -> int:
    """Steps until the next save: :func:`young_daly_s` in steps of ``step_s``, C from :func:`mean_cost`."""
    return max(1, round(young_daly_s(mean_cost(costs), mtbf_s) / max(step_s, 1e-9)))


def interval_report(steps: int, step_s: float, cost_s: float, mtbf_s: float) -> dict[str, float]:
    """What an interval of ``steps`` costs: the share of time spent saving (C / T), the work a
    failure loses on average (half an interval, T / 2), and both together as a share of time
    (C / T + T / (2 · MTBF), the quantity Young/Daly's interval minimises)."""
    interval_s = steps * step_s
    overhead = cost_s / interval_s if interval_s > 0 else 0.0
    return {
        "interval_steps": steps,
        "interval_s": interval_s,
        "step_s": step_s,
        "cost_s": cost_s,
        "mtbf_s": mtbf_s,
        "overhead": overhead,
        "expected_lost_s": interval_s / 2.0,
        "expected_waste": overhead + interval_s / (2.0 * mtbf_s),
    }


class StepClock:
    """The recent time per step: an exponential moving average of the steps' own times (so a
    resume, a slower world size or a warm-up does not skew it as a whole-run mean would)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.step_s: float | None = None

    def observe(self, step_time_s: float) -> None:
        if not math.isfinite(step_time_s) or step_time_s <= 0:
            return
        prev = self.step_s
        self.step_s = step_time_s if prev is None else prev + self.weight * (step_time_s - prev)


def observed_mtbf(run_dir: RunDir, prior_s: float) -> float:
    """The mean time between failures seen in this run folder: the time since its first event over
    the restarts (a preemption counts: a resume follows it); ``prior_s`` until one is seen
    (``spot.mtbf_s``, else ``checkpoint.mtbf_s``)."""
    events = recovery.read_events(run_dir)
    restarts, _ = recovery.totals(events)
    if restarts == 0 or not events:
        return prior_s
    return (time.time() - float(events[0]["time"])) / restarts
