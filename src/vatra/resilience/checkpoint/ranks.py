"""What keeps the ranks of a checkpoint in step: small collectives on the checkpoint plugin's own gloo
groups, and a failed save turned into one line that every rank raises alike.

A rank that raises on its own while its peers enter a collective leaves them waiting until the
process group's timeout. So everything that may fail on one rank only (a store read on rank 0, a
download, a full disk) is first agreed on — gathered or broadcast — and then raised everywhere.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from vatra.resilience._base import StoreError

T = TypeVar("T")


class RankGroups:
    """The checkpoint plugin's two gloo groups (both None in one process).

    ``data``: DCP's collectives and the upload thread's gather and broadcast; ``ctl``: the training
    thread's own (the SIGTERM flag, version proposals, agreements). Separate from the default group,
    so they never interleave with DDP's all-reduce, and from each other, so the upload thread and the
    training thread never share one.
    """

    def __init__(self) -> None:
        self.data: dist.ProcessGroup | None = None
        self.ctl: dist.ProcessGroup | None = None

    def create(self) -> None:
        """Collective on the default group: every rank makes both groups, in the same order."""
        self.data = dist.new_group(backend="gloo")
        self.ctl = dist.new_group(backend="gloo")

    @property
    def is_main(self) -> bool:
        return self.ctl is None or dist.get_rank() == 0

    def bcast(self, obj: Any, group: dist.ProcessGroup | None = None) -> Any:
        """Rank 0's ``obj`` on every rank (over ``group``, else ``ctl``)."""
        group = group or self.ctl
        if group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0, in rank order, over ``data``; [] on the other ranks."""
        if self.data is None:
            return [obj]
        out: list[Any] | None = [None] * dist.get_world_size(self.data) if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.data)
        return out or []

    def agree(self, problem: T | None) -> T | None:
        """The lowest rank's problem, on every rank (None when no rank has one), over ``ctl``."""
        if self.ctl is None:
            return problem
        every: list[T | None] = [None] * dist.get_world_size(self.ctl)
        dist.all_gather_object(every, problem, group=self.ctl)
        return next((p for p in every if p is not None), None)

    def on_main(self, fn: Callable[[], T]) -> T:
        """Rank 0 runs ``fn`` and every rank gets its result — or its error: raised as it is on rank
        0 and as a :class:`StoreError` with its message on the others."""
        outcome: tuple[bool, Any] | None = None
        err: Exception | None = None
        if self.is_main:
            try:
                outcome = (True, fn())
            except Exception as e:
                err, outcome = e, (False, str(e))
        outcome = self.bcast(outcome)
        assert outcome is not None
        ok, value = outcome
        if ok:
            return cast("T", value)
        if err is not None:
            raise err
        raise StoreError(str(value))


class CheckpointWriteError(StoreError):
    """A save failed on some rank (a full disk, an unreachable store): every rank stops with the
    same line; the versions already in the store are intact."""


def first_failure(err: CheckpointException) -> BaseException:
    """The lowest rank's exception inside DCP's wrapper of every rank's failures."""
    failures = err.failures
    return failures[min(failures)][0] if failures else err


def disk_full(folder: Path) -> bool:
    """Whether the filesystem holding ``folder`` has (next to) no space left: under 1 MiB free.

    torch's writer reports a short write as a RuntimeError ("unexpected pos"), not as ENOSPC:
    a write that failed on a full disk is recognised by the disk instead.
    """
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        stat = os.statvfs(folder)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < 1 << 20


def save_failure(err: BaseException, folder: Path, full: bool) -> str:
    """One line for what failed in a rank's part of a save (``folder``: its staging folder;
    ``full``: its disk was full when it failed)."""
    if isinstance(err, CheckpointException):
        err = first_failure(err)
    if full or (isinstance(err, OSError) and err.errno == errno.ENOSPC):
        where = err.filename if isinstance(err, OSError) and err.filename else folder
        return (
            f"no space left on the device holding {where}; free space there (or point store.url at "
            "a larger store)"
        )
    return str(err) or type(err).__name__
