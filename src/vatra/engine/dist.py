"""Process-group set-up and the facts about this process's place in the job."""

from __future__ import annotations

import atexit
import gc
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from vatra.config import DistConfig
from vatra.errors import ConfigError


def pick_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend: 'nccl' needs CUDA and none is present; use 'gloo' or 'auto'")
    return requested


@dataclass
class DistContext:
    """Rank, world size and device of this process; ``world_size == 1`` needs no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    owns_group: bool = False  # this context created the default group (and destroys it)
    # False: one of world_size ranks that share no process group (an asynchronous worker): it trains
    # its own share of the data and runs no collectives
    collective: bool = True

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and self.collective

    @property
    def is_main(self) -> bool:
        """Whether this rank writes the run's records: rank 0, or a rank without collectives (it
        keeps its own run folder)."""
        return self.rank == 0 or not self.collective

    @classmethod
    def from_env(cls, cfg: DistConfig) -> DistContext:
        """Join the job described by torchrun-style env vars (RANK, WORLD_SIZE, ...), if any."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if world_size == 1:
            return cls(device=_device(local_rank))
        return cls.init(cfg, rank=int(os.environ["RANK"]), world_size=world_size, init_method="env://")

    @classmethod
    def init(cls, cfg: DistConfig, *, rank: int, world_size: int, init_method: str) -> DistContext:
        """Create the default process group (env:// or file:// rendezvous)."""
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = pick_backend(cfg.backend)
        device = _device(local_rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        owns = not dist.is_initialized()  # a caller's own process group is used, and left to it
        if owns:
            # Once per process, at exit: after the main code has returned (its frames, and the
            # trainer they held, are gone) and before interpreter shutdown begins.
            atexit.unregister(release_process_groups)
            atexit.register(release_process_groups)
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=cfg.timeout_s),
            )
        return cls(rank, world_size, local_rank, local_world, device, backend, owns)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def destroy(self) -> None:
        """Destroy every process group (when this context created them), then
        :func:`release_process_groups`."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            release_process_groups()


def release_process_groups() -> None:
    """Free unreachable process groups and let gloo's worker threads go idle, while the
    interpreter is fully alive; :meth:`DistContext.init` registers it to run again at exit.

    gloo runs collectives on worker threads that live until their process group is freed, and
    ``destroy_process_group`` does not stop them. A worker that finishes a collective then drops
    the tensors it was given, which takes the GIL. If it gets the GIL only once interpreter shutdown
    has begun (it was descheduled, or the process exited a few ms after its last collective),
    Python ends the thread inside that destructor and the process aborts with "terminate called
    without an active exception" (SIGABRT), after a run that succeeded.

    - Collecting the unreachable groups (they sit in cycles: trainer, plugins) joins their workers.
      A group freed through DDP's reducer is destroyed with the GIL held, and its destructor waits
      for its workers: one still waiting for the GIL to drop its last collective's tensors would
      never get it (a hang seen in the tests). So the workers settle first, then the collection.
    - DDP keeps the default group alive to the end, so its workers cannot be joined: this waits,
      with the GIL free, until no worker is runnable twice in a row (at most 2 s), before and after.
    """
    _settle_gloo_workers()
    gc.collect()
    _settle_gloo_workers()


def _settle_gloo_workers() -> None:
    """Sleep in 2 ms steps, the GIL free, until no gloo worker is runnable twice in a row (≤ 2 s)."""
    deadline = time.monotonic() + 2.0
    calm = 0
    while calm < 2 and time.monotonic() < deadline:
        time.sleep(0.002)  # the GIL is free: a worker waiting for it takes it now
        calm = 0 if _gloo_worker_runnable() else calm + 1


def _gloo_worker_runnable() -> bool:
    """Whether a thread of this process named like torch's gloo workers is running or runnable
    (Linux; elsewhere, or if torch renames them, False: the sleeps above still free the GIL)."""
    for task in Path("/proc/self/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() != "pt_gloo_runloop":
                continue
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        if stat[stat.rindex(")") + 2] == "R":  # the state follows the name, which may hold spaces
            return True
    return False


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
