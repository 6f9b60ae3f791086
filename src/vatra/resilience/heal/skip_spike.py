"""Skip the update of a step whose gradient norm is non-finite or a spike on the monitor's gradient stream."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from vatra.config import Config
from vatra.monitor.signals import RobustZ
from vatra.resilience.heal._base import Action, Policy

if TYPE_CHECKING:
    from vatra.engine import Trainer

NO_LIMIT = sys.float_info.max  # every finite norm passes; NaN and Inf do not (`<=` is False for them)


class SkipSpike(Policy):
    """Drops the update when the global gradient norm is NaN/Inf or a spike on the monitor's
    gradient stream: its robust z there exceeds ``monitor.zscore_threshold``, where the z-score
    detector alarms on it.

    A skip must be decided on the step itself, before the optimizer step, while the monitor's
    verdict on that step comes at the end of its window. So every rank runs the monitor's gradient
    stream itself: the same robust z (:class:`~vatra.monitor.signals.RobustZ`, ``monitor.ewma_alpha``)
    fed the same norms in the same order as rank 0's ensemble feeds its ``grad_norm`` stream, which
    gives it the ensemble's state, and "z > threshold" is one comparison of the norm with a limit
    that moves with the baseline. After the monitor's warm-up, as the ensemble's alarms. A limit
    shipped with each verdict instead lagged the baseline by a window and skipped clean steps while
    the norm trended up early in a run.

    The norm is the pre-clip norm of the already all-reduced gradients, identical on every rank,
    so every rank decides alike without a collective; a loss spike on one rank reaches every rank
    through that gradient. A spike joins the baseline winsorised, so a lasting change of level is
    followed instead of skipped forever (the rollback policy escalates repeated skips).
    """

    name = "skip_spike"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.z = RobustZ(alpha=self.monitor.ewma_alpha)
        self.seen = 0  # finite norms in the baseline
        self.limit = NO_LIMIT  # norms above it are spikes; none during the warm-up

    def after_backward(self, trainer: Trainer, grad_norm: float) -> Action | None:
        if grad_norm <= self.limit:  # the common case: False for NaN and Inf
            self._absorb(grad_norm)
            return None
        step = trainer.state.step + 1  # the step being taken (state.step counts it after the update)
        if not math.isfinite(grad_norm):  # the ensemble leaves it out of its baselines too
            evidence: dict[str, Any] = {"at_step": step, "grad_norm": grad_norm}
            return Action(self.name, "skip_update", "non-finite gradient norm", evidence)
        evidence = {
            "at_step": step,
            "grad_norm": grad_norm,
            "z": self.z.z(grad_norm),
            "baseline": self.z.center,
        }
        self._absorb(grad_norm)
        return Action(self.name, "skip_update", "gradient-norm spike", evidence)

    def _absorb(self, grad_norm: float) -> None:
        self.z.update(grad_norm)  # winsorised: a spike moves the baseline a few scales at most
        self.seen += 1
        if self.seen >= self.monitor.warmup_steps:
            limit = self.z.limit(self.monitor.zscore_threshold)
            self.limit = limit if math.isfinite(limit) else NO_LIMIT

    def apply(self, trainer: Trainer, action: Action) -> None:
        trainer.state.skip_update = True
        trainer.state.healthy = False
