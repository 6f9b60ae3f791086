"""What every injected fault shares: the ``events.jsonl`` line logged as it fires.

Each injected fault is logged in ``events.jsonl`` *before* it happens (or, for damage done to a
saved version, right after the version is published); that line is also the record that it fired,
so a resumed run that passes the same step again does not repeat it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vatra.resilience.recovery import read_events

if TYPE_CHECKING:
    from vatra.rundir import RunDir


def fired_steps(run_dir: RunDir, kind: str) -> set[int]:
    """The steps at which faults of ``kind`` (an event name) already fired in this run folder."""
    return {int(e["step"]) for e in read_events(run_dir) if e.get("event") == kind}
