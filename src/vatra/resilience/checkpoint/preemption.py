"""SIGTERM: every rank agrees on the same step to save at, then the worker exits.

The handler only records the time; the training loop acts at its next step boundary, where the
ranks agree (an async MAX all-reduce of the flag) so that all of them save the same step.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from vatra.errors import VatraError


class Preempted(VatraError):
    """SIGTERM arrived; a checkpoint was written and the worker exits (128 + SIGTERM, like a shell)."""

    exit_code = 143


class StopAgreement:
    """Whether any rank got SIGTERM, agreed on by every rank at the same step boundary.

    Call order: ``install`` at fit start, ``agree`` once per step, ``drain`` before the group is
    left, ``uninstall`` at the end (whatever happened).
    """

    def __init__(self) -> None:
        self.sigterm_at: float | None = None
        self.stop_flag: torch.Tensor | None = None
        self.stop_work: Any = None
        self.old_handler: Any = None

    def install(self) -> None:
        """Catch SIGTERM (only the main thread can install a signal handler)."""
        if threading.current_thread() is threading.main_thread():
            self.old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self) -> None:
        if self.old_handler is not None:
            signal.signal(signal.SIGTERM, self.old_handler)
            self.old_handler = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.sigterm_at = time.time()  # acted on at the next step boundary; a handler must stay tiny

    def agree(self, group: dist.ProcessGroup | None) -> bool:
        """True on every rank at the same step once any rank got SIGTERM.

        Distributed (``group`` set): an async MAX all-reduce of the flag, started each step and read
        one step later, so the loop never waits for it; all ranks read the same reduction at the
        same boundary.
        """
        local = self.sigterm_at is not None
        if group is None:
            return local
        stop = False
        if self.stop_work is not None:
            self.stop_work.wait()
            stop = bool(self.stop_flag is not None and self.stop_flag.item())
        self.stop_flag = torch.tensor([int(local)], dtype=torch.int32)
        self.stop_work = dist.all_reduce(self.stop_flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        return stop

    def drain(self) -> None:
        """Wait for the reduction in flight, if any."""
        if self.stop_work is not None:
            self.stop_work.wait()
            self.stop_work = None
