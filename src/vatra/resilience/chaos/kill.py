"""``chaos.kill_at_steps``: a process SIGKILLs itself at chosen steps, once per run folder — a
training rank after those steps (:class:`KillInjector`), or a parameter server after that many
updates of its shard (:class:`StepKill`, which the server calls with its own count)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
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


class StepKill:
    """A process that counts its own steps (a parameter server: its shard's version) and
    SIGKILLs itself when the count reaches one of ``steps``; ``rank`` names it in the event.

    :meth:`skip_fired` once at start (a restarted process does not die at a step already fired),
    then :meth:`at` with each new count. Thread-safe enough for the server's link threads: each
    count is reached by one update only."""

    def __init__(self, steps: Iterable[int], run_dir: RunDir, rank: int) -> None:
        self.pending = set(steps)
        self.run_dir = run_dir
        self.rank = rank

    def skip_fired(self) -> None:
        if self.pending:  # read events.jsonl only when a kill is asked for
            self.pending -= fired_steps(self.run_dir, "chaos_kill")

    def at(self, step: int) -> None:
        if step in self.pending:
            self.run_dir.log_event("chaos_kill", rank=self.rank, step=step, signal="SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
