"""Name a straggler: the rank whose compute time stands out from the median rank's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vatra.config import Config
from vatra.resilience.heal._base import Action, Policy

if TYPE_CHECKING:
    from vatra.engine import Trainer
    from vatra.monitor.signals import Verdict


class Straggler(Policy):
    """Logs the slow rank once when it starts to straggle and once when it recovers.

    In synchronous training a slow rank makes every step slow; naming it is the action (the
    balancing that would move work away from it belongs to a later feature). A rank is named only
    when it is the slow one in two windows in a row: one slow window is what start-up (allocator,
    DDP's bucket rebuild) or a descheduled process on a busy machine looks like.
    """

    name = "straggler"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.current: int | None = None
        self.suspect: int | None = None  # slowest rank of the previous window, if it was slow

    def on_step_end(self, trainer: Trainer, verdict: Verdict | None) -> Action | None:
        if verdict is None or trainer.dist.world_size < 2:
            return None
        slow = verdict.straggler_ratio > self.cfg.straggler_ratio
        confirmed = slow and self.suspect == verdict.slowest_rank
        self.suspect = verdict.slowest_rank if slow else None
        evidence = {"rank": verdict.slowest_rank, "ratio_to_median": verdict.straggler_ratio}
        if confirmed and self.current != verdict.slowest_rank:
            self.current = verdict.slowest_rank
            reason = (
                f"rank {verdict.slowest_rank} computes {verdict.straggler_ratio:.1f}× the median rank's time"
            )
            return Action(self.name, "straggler", reason, evidence, capped=False)
        if not slow and self.current is not None:
            rank, self.current = self.current, None
            return Action(
                self.name, "straggler_recovered", f"rank {rank} is back in line", evidence, capped=False
            )
        return None

    def apply(self, trainer: Trainer, action: Action) -> None:
        trainer.state.extras.setdefault("heal", {})["straggler"] = self.current
