"""Raise data prefetch when ranks wait for data: the trainer's loader reads further ahead.

With loader workers (``data.workers`` > 0) each worker prepares more batches; without them a
pool of threads fetches the next batches of the sampler's order (a stream: one thread reads
ahead). Either way batches arrive in exactly the order they would have, and the data position a
checkpoint saves stays exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vatra.config import Config
from vatra.resilience.heal._base import Action, Policy

if TYPE_CHECKING:
    from vatra.engine import Trainer
    from vatra.monitor.signals import Verdict


class Prefetch(Policy):
    """When the monitor sees a rank spend more than ``data_wait_share`` of its step waiting for
    data in two windows in a row, double the prefetch depth (1, 2, 4, … up to ``max_prefetch``).

    One window is not enough: on a busy machine a single descheduled data fetch makes a window of
    cheap steps look data-bound, and prefetch threads only cost time when loading is cheap.
    """

    name = "prefetch"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.base = cfg.data.prefetch  # the configured read-ahead: raised from, returned to
        self.depth = self.base  # batches read ahead beyond the loader's default
        self.waited = False  # the previous window was data-bound

    def on_step_end(self, trainer: Trainer, verdict: Verdict | None) -> Action | None:
        if verdict is None:
            return None
        waiting = verdict.data_share > self.cfg.data_wait_share
        confirmed, self.waited = waiting and self.waited, waiting
        if not confirmed:
            return None
        depth = self.depth
        if depth >= self.cfg.max_prefetch:
            return None
        new = min(max(1, 2 * depth), self.cfg.max_prefetch)
        reason = f"data wait is {verdict.data_share:.0%} of step time; prefetch {depth} → {new} batches"
        self.waited = False  # the next raise needs two more data-bound windows at the new depth
        return Action(
            self.name, "prefetch", reason, {"data_share": verdict.data_share, "depth": new}, capped=False
        )

    def apply(self, trainer: Trainer, action: Action) -> None:
        self.depth = int(action.evidence["depth"])
        trainer.batches.prefetch(self.depth)

    def close(self, trainer: Trainer) -> None:
        if self.depth != self.base:
            self.depth = self.base
            trainer.batches.prefetch(self.base)
