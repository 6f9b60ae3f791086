"""Fault injection on purpose (the ``chaos`` section), one hook per fault: training faults through
model and gradient hooks (:mod:`.training`), a worker killed at chosen steps (:mod:`.kill`), and
damage to saved checkpoints (:mod:`.storage`). Each fault is logged in ``events.jsonl`` as it fires."""

from __future__ import annotations

from vatra.resilience.chaos._base import fired_steps
from vatra.resilience.chaos.kill import KillInjector
from vatra.resilience.chaos.storage import CheckpointCorruptor, corrupt_version, truncate_manifest
from vatra.resilience.chaos.training import TrainingFaults

__all__ = [
    "CheckpointCorruptor",
    "KillInjector",
    "TrainingFaults",
    "corrupt_version",
    "fired_steps",
    "truncate_manifest",
]
