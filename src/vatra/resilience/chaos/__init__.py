"""Fault injection on purpose (the ``chaos`` section), one hook per fault: training faults through
model and gradient hooks (:mod:`.training`), a worker or a parameter server killed at chosen steps
(:mod:`.kill`), damage to saved checkpoints (:mod:`.storage`), and federated clients that drop out
of secure aggregation mid-round (:mod:`.dropout`). The hooks take plain values and callables, so
the feature packages call them and this package imports none of them. Each fault of a training
run is logged in ``events.jsonl`` as it fires."""

from __future__ import annotations

from vatra.resilience.chaos._base import fired_steps
from vatra.resilience.chaos.dropout import ClientDropout
from vatra.resilience.chaos.kill import KillInjector, StepKill
from vatra.resilience.chaos.storage import CheckpointCorruptor, corrupt_version, truncate_manifest
from vatra.resilience.chaos.training import TrainingFaults

__all__ = [
    "CheckpointCorruptor",
    "ClientDropout",
    "KillInjector",
    "StepKill",
    "TrainingFaults",
    "corrupt_version",
    "fired_steps",
    "truncate_manifest",
]
