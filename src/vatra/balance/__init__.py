"""Mixed hardware at full use: uneven per-rank batches with exactly weighted gradients, and the
balancer that sizes them from each rank's measured compute (see docs/balance.md)."""

from vatra.balance._base import POLICIES, BalancePolicy, build_policy
from vatra.balance.plugin import Balancer, ComputeClock
from vatra.balance.proportional import ProportionalPolicy
from vatra.balance.split import (
    TimeModel,
    equal_time_split,
    fit_time_model,
    predicted_step,
    proportional_split,
)
from vatra.balance.static import StaticPolicy

__all__ = [
    "POLICIES",
    "BalancePolicy",
    "Balancer",
    "ComputeClock",
    "ProportionalPolicy",
    "StaticPolicy",
    "TimeModel",
    "build_policy",
    "equal_time_split",
    "fit_time_model",
    "predicted_step",
    "proportional_split",
]
