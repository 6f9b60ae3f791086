"""Self-healing: policies that act on anomalies (skip, roll back, name stragglers, prefetch)."""

from vatra.resilience.heal._base import Action, Policy, build_policy
from vatra.resilience.heal.cap import ActionCap, HealingFailed
from vatra.resilience.heal.plugin import Healer
from vatra.resilience.heal.prefetch import Prefetch
from vatra.resilience.heal.rollback import Rollback, Snapshot
from vatra.resilience.heal.skip_spike import SkipSpike
from vatra.resilience.heal.straggler import Straggler

__all__ = [
    "Action",
    "ActionCap",
    "Healer",
    "HealingFailed",
    "Policy",
    "Prefetch",
    "Rollback",
    "SkipSpike",
    "Snapshot",
    "Straggler",
    "build_policy",
]
