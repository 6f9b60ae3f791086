"""``chaos.kill_at_steps``: a worker SIGKILLs itself at chosen steps, once per run folder."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

from vatra.engine import Plugin
from vatra.errors import ConfigError
from vatra.resilience.chaos._base import fired_steps

if TYPE_CHECKING:
    from vatra.config import ChaosConfig
    from vatra.engine import Trainer
    from vatra.rundir import RunDir


class KillInjector(Plugin):
    """``chaos.kill_at_steps``: rank ``chaos.kill_rank`` SIGKILLs itself after completing those steps."""

    def __init__(self, chaos: ChaosConfig, run_dir: RunDir) -> None:
        self.chaos = chaos
        self.run_dir = run_dir
        self.pending: set[int] = set()

    def on_fit_start(self, trainer: Trainer) -> None:
        if not self.chaos.kill_at_steps:
            return
        if self.chaos.kill_rank >= trainer.dist.world_size:
            raise ConfigError(
                f"chaos.kill_rank {self.chaos.kill_rank} does not exist in a run of "
                f"{trainer.dist.world_size} rank(s); use --nproc 2 or more, or chaos.kill_rank=0"
            )
        if trainer.dist.rank == self.chaos.kill_rank:
            self.pending = set(self.chaos.kill_at_steps) - fired_steps(self.run_dir, "chaos_kill")

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.state.step
        if step in self.pending:
            trainer.log_event("chaos_kill", signal="SIGKILL", pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
