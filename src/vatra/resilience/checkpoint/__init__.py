"""Full-state checkpoints of a training run: the plugin and its parts (schedule, writer, loader,
SIGTERM agreement)."""

from __future__ import annotations

from vatra.resilience.checkpoint.plugin import CheckpointPlugin
from vatra.resilience.checkpoint.preemption import Preempted

__all__ = ["CheckpointPlugin", "Preempted"]
