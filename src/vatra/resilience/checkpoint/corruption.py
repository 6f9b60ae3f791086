"""``chaos.corrupt_checkpoint_at``: damage the version saved at chosen steps, once per run folder.

The fault is logged as ``chaos_corrupt`` right after the version is published; that line is also the
record that it fired, so a resumed run passing the same step again does not repeat it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vatra.resilience.faults import corrupt_version, fired_steps

if TYPE_CHECKING:
    from vatra.resilience.store import CheckpointStore, Manifest
    from vatra.rundir import RunDir


class CheckpointCorruptor:
    """Flips bytes in the largest object of the versions saved at ``steps`` (rank 0 only)."""

    def __init__(self, steps: Iterable[int], run_dir: RunDir) -> None:
        self.steps = set(steps)
        self.run_dir = run_dir

    def skip_fired(self) -> None:
        """Drop the steps whose fault a previous attempt in this run folder already injected."""
        self.steps -= fired_steps(self.run_dir, "chaos_corrupt")

    def after_publish(self, store: CheckpointStore, manifest: Manifest, step: int) -> None:
        if step in self.steps:
            self.steps.discard(step)
            self.run_dir.log_event(
                "chaos_corrupt",
                rank=0,
                step=step,
                version=manifest["version"],
                file=corrupt_version(store, manifest),
            )
