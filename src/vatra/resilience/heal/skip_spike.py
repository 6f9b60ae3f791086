"""Skip the update of a step whose gradient norm is non-finite or a spike."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from vatra.config import Config
from vatra.monitor.zscore import RobustZ
from vatra.resilience.heal._base import Action, Policy, register

if TYPE_CHECKING:
    from vatra.engine import Trainer


@register("skip_spike")
class SkipSpike(Policy):
    """Drops the update when the global gradient norm is NaN/Inf or its robust z exceeds the bound.

    The decision uses the pre-clip norm of the already all-reduced gradients, identical on every
    rank, so no extra collective is needed. A loss spike on one rank reaches every rank through
    that gradient.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.z = RobustZ(alpha=self.monitor.ewma_alpha)
        self.seen = 0

    def after_backward(self, trainer: Trainer, grad_norm: float) -> Action | None:
        if not math.isfinite(grad_norm):
            return Action(self.name, "skip_update", "non-finite gradient norm", {"grad_norm": grad_norm})
        self.seen += 1
        baseline = self.z.center
        z = self.z.z_then_update(grad_norm)  # winsorised: a spike moves the baseline a few scales at most
        if self.seen > self.monitor.warmup_steps and z > self.monitor.zscore_threshold:
            evidence = {"grad_norm": grad_norm, "z": z, "baseline": baseline}
            return Action(self.name, "skip_update", "gradient-norm spike", evidence)
        return None

    def apply(self, trainer: Trainer, action: Action) -> None:
        trainer.state.skip_update = True
        trainer.state.healthy = False
