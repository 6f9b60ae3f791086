"""Self-healing: policies that act on anomalies (skip, roll back, name stragglers, prefetch)."""

from vatra.resilience.heal._base import POLICIES, Action, Policy, register
from vatra.resilience.heal.cap import ActionCap, HealingFailed
from vatra.resilience.heal.plugin import Healer
from vatra.resilience.heal.prefetch import Prefetch, Prefetcher
from vatra.resilience.heal.rollback import Rollback, Snapshot
from vatra.resilience.heal.skip_spike import SkipSpike
from vatra.resilience.heal.straggler import Straggler

__all__ = [
    "POLICIES",
    "Action",
    "ActionCap",
    "Healer",
    "HealingFailed",
    "Policy",
    "Prefetch",
    "Prefetcher",
    "Rollback",
    "SkipSpike",
    "Snapshot",
    "Straggler",
    "register",
]
