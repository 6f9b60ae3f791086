"""Mixed hardware at full use: uneven per-rank batches with exactly weighted gradients, and the
balancer that sizes them from each rank's measured compute (see docs/balance.md)."""

from vatra.balance.plugin import BalancePolicy, Balancer, ComputeClock
from vatra.balance.split import (
    TimeModel,
    equal_time_split,
    fit_time_model,
    predicted_step,
    proportional_split,
)

__all__ = [
    "BalancePolicy",
    "Balancer",
    "ComputeClock",
    "TimeModel",
    "equal_time_split",
    "fit_time_model",
    "predicted_step",
    "proportional_split",
]
