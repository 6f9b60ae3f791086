"""``RootCause``: the cause of a rank's own failure, on the trainer's ``failure`` event."""

from __future__ import annotations

import os
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

from vatra.engine import Plugin
from vatra.monitor.rca import Evidence, classify, line
from vatra.monitor.rca_evidence import machine_state, since_attempt, tail_records
from vatra.rundir import ERRORS_ENV, RunDir

if TYPE_CHECKING:
    from vatra.engine import Trainer

RECENT = 8  # metrics records kept for the evidence: the steps just before a failure


class RootCause(Plugin):
    """Keeps the last steps' loss and gradient norm; on a failure, classifies the exception with
    them, the run's events since the attempt began, and the disk's and memory's state
    (:func:`vatra.monitor.rca.classify`), and the trainer writes the result as the ``cause`` of
    its ``failure`` event. Under a launcher the launcher prints the cause's line (it sees every
    rank's exit, and what it does about it); alone, this rank prints it."""

    def __init__(self, run_dir: RunDir | None) -> None:
        self.run_dir = run_dir
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.recent.append({k: metrics.get(k) for k in ("step", "loss", "grad_norm", "step_time_s")})

    def explain(self, trainer: Trainer, exc: BaseException) -> dict[str, Any] | None:
        events: list[dict[str, Any]] = []
        disk = memory = None
        if self.run_dir is not None:
            events = since_attempt(tail_records(self.run_dir.events, limit=200, nbytes=1 << 18))
            disk, memory = machine_state(self.run_dir.path)
        ev = Evidence(
            rank=trainer.dist.rank,
            exit_code=getattr(exc, "exit_code", None)
            if isinstance(getattr(exc, "exit_code", None), int)
            else None,
            error=f"{type(exc).__name__}: {exc}".strip(),
            traceback="".join(traceback.format_exception(exc, limit=-8)),
            recent=list(self.recent),
            events=events,
            disk_free_frac=disk,
            mem_available_frac=memory,
        )
        if ev.exit_code == 1:
            ev.exit_code = None  # vatra's ordinary failure code says nothing more
        cause = classify(ev)
        if os.environ.get(ERRORS_ENV) is None and not _peer_lost(cause):
            print(
                f"vatra: {line(cause, trainer.dist.rank if trainer.dist.distributed else None)}", flush=True
            )
        return cause


def _peer_lost(cause: dict[str, Any]) -> bool:
    """Only a peer went away: the dead rank's own failure is the one to tell."""
    return cause["kind"] == "dead_node" and cause["confidence"] < 0.6
