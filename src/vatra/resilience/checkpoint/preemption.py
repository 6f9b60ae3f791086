"""Preemption: every rank agrees on the same step to save at, then the worker exits.

A notice is SIGTERM, or one from :mod:`.notice`'s watcher (metadata endpoint, file). Either only
records the notice; the training loop acts at its next step boundary, where the ranks agree (an
async MAX all-reduce) so that all of them save the same step.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from vatra.errors import VatraError
from vatra.resilience.checkpoint.notice import Notice
from vatra.rundir import ERRORS_ENV

LEAVING = "node-leaving"  # in the launcher's errors folder: this node's workers saw a notice


def mark_node_leaving() -> None:
    """Tell this node's elastic agent (through the folder its workers leave errors in) that they
    saw a preemption notice and will exit 143: until they have, a group re-forming on the other
    nodes must not make the agent restart them here (:class:`vatra.launch.elastic.PreemptionAgent`)."""
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / LEAVING).touch()


def node_leaving() -> bool:
    """Whether a worker of this launcher marked the node as leaving (:func:`mark_node_leaving`)."""
    folder = os.environ.get(ERRORS_ENV)
    return folder is not None and (Path(folder) / LEAVING).exists()


class Preempted(VatraError):
    """A preemption notice arrived; a checkpoint was written and the worker exits (128 + SIGTERM, as a
    shell does: the launcher restarts or resumes the run elsewhere, as after a SIGTERM)."""

    exit_code = 143


class PeerPreempted(Preempted):
    """Another node got the notice; this rank saved the same step with it and exits so that the
    elastic agent re-forms the group on the nodes left (75, EX_TEMPFAIL: this machine stays)."""

    exit_code = 75


SOURCES = ("sigterm", "file", "url")  # coded 1, 2, 3 in the agreement: MAX picks one for all ranks


class StopAgreement:
    """Whether any rank got a preemption notice, agreed on by every rank at the same step boundary.

    Call order: ``install`` at fit start, ``agree`` once per step, ``drain`` before the group is
    left, ``uninstall`` at the end (whatever happened). ``request`` may be called from any thread.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s  # what a SIGTERM leaves (spot.notice_s, else the provider's)
        self.notice: Notice | None = None
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

    def request(self, notice: Notice) -> None:
        """Record a notice (the first one counts); acted on at the next step boundary."""
        if self.notice is None:
            self.notice = notice

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        now = time.time()  # a handler must stay tiny
        self.request(Notice("sigterm", now, now + self.window_s, "SIGTERM"))

    def agree(self, group: dist.ProcessGroup | None) -> Notice | None:
        """The notice, on every rank at the same step, once any rank got one; else None.

        Distributed (``group`` set): an async MAX all-reduce of (source, −seen, −deadline), started
        each step and read one step later, so the loop never waits for it; all ranks read the same
        reduction at the same boundary, which carries the earliest notice and deadline of any rank.
        """
        if group is None:
            return self.notice
        agreed = None
        if self.stop_work is not None:
            self.stop_work.wait()
            assert self.stop_flag is not None
            code, neg_seen, neg_deadline = self.stop_flag.tolist()
            if code > 0:
                detail = self.notice.detail if self.notice is not None else "seen by another rank"
                agreed = Notice(SOURCES[int(code) - 1], -neg_seen, -neg_deadline, detail)
        n = self.notice
        local = (
            [0.0, -math.inf, -math.inf]
            if n is None
            else [SOURCES.index(n.source) + 1.0, -n.seen_at, -n.deadline]
        )
        self.stop_flag = torch.tensor(local, dtype=torch.float64)
        self.stop_work = dist.all_reduce(self.stop_flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        return agreed

    def node_noticed(self, group: dist.ProcessGroup | None) -> bool:
        """Whether a rank of this node (torchrun's ``GROUP_RANK``) saw the notice itself, i.e. this
        machine is the one going away; collective on ``group``. Only local rank 0 watches the
        endpoint and file, so the other ranks of its node learn it here."""
        node = os.environ.get("GROUP_RANK", "0")
        if group is None:
            return self.notice is not None
        seen: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, (node, self.notice is not None), group=group)
        return any(other == node and noticed for other, noticed in seen)

    def drain(self) -> None:
        """Wait for the reduction in flight, if any."""
        if self.stop_work is not None:
            self.stop_work.wait()
            self.stop_work = None
