"""Skip the update of a step whose gradient norm is non-finite or a spike."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from vatra.config import Config
from vatra.monitor.zscore import RobustZ
from vatra.resilience.heal._base import Action, Policy

if TYPE_CHECKING:
    from vatra.engine import Trainer

NO_LIMIT = sys.float_info.max  # every finite norm passes; NaN and Inf do not (`<=` is False for them)


class SkipSpike(Policy):
    """Drops the update when the global gradient norm is NaN/Inf or its robust z exceeds the bound.

    The decision uses the pre-clip norm of the already all-reduced gradients, identical on every
    rank, so no extra collective is needed. A loss spike on one rank reaches every rank through
    that gradient.

    The per-step path is one comparison: "z > ``monitor.zscore_threshold``" is "norm > centre +
    threshold × scale", and that limit is recomputed when the baseline moves, which it does in
    batches of ``BATCH`` norms (the EWMA centre and the residual spread drift over tens of steps; a
    batch lags them by at most ``BATCH`` steps). Spikes join the batch too, winsorised by the
    baseline, so a lasting change of level is followed instead of skipped forever (the rollback
    policy escalates repeated skips).
    """

    name = "skip_spike"
    BATCH = 16

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.z = RobustZ(alpha=self.monitor.ewma_alpha)
        self.seen = 0  # finite norms absorbed into the baseline
        self.pending: list[float] = []  # finite norms not absorbed yet
        self.limit = NO_LIMIT  # norms above it are spikes; no limit during the warm-up

    def after_backward(self, trainer: Trainer, grad_norm: float) -> Action | None:
        if grad_norm <= self.limit:  # the common case: False for NaN and Inf
            self.pending.append(grad_norm)
            if len(self.pending) >= self.BATCH:
                self._absorb()
            return None
        if not math.isfinite(grad_norm):
            return Action(self.name, "skip_update", "non-finite gradient norm", {"grad_norm": grad_norm})
        baseline = self.z.center
        z = self.z.z(grad_norm)
        self.pending.append(grad_norm)
        evidence = {"grad_norm": grad_norm, "z": z, "baseline": baseline}
        return Action(self.name, "skip_update", "gradient-norm spike", evidence)

    def _absorb(self) -> None:
        for value in self.pending:
            self.z.update(value)  # winsorised: a spike moves the baseline a few scales at most
        self.seen += len(self.pending)
        self.pending.clear()
        if self.seen > self.monitor.warmup_steps and self.z.ready and self.z.center is not None:
            self.limit = self.z.center + self.monitor.zscore_threshold * self.z.scale()

    def apply(self, trainer: Trainer, action: Action) -> None:
        trainer.state.skip_update = True
        trainer.state.healthy = False
