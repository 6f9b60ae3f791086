"""Raise data prefetch when ranks wait for data: batches are prepared ahead in a thread pool."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from vatra.config import Config
from vatra.data import ShardSampler
from vatra.resilience.heal._base import Action, Policy, register

if TYPE_CHECKING:
    from vatra.engine import Trainer
    from vatra.monitor.plugin import Verdict

Batch = tuple[torch.Tensor, torch.Tensor]


class Prefetcher:
    """Prepares the next ``depth`` batches in background threads, in exactly the sampler's order.

    The trainer's sampler still advances one batch per call, so its state (and a checkpoint's)
    stays exact; a shadow copy of it looks ahead. If the real sampler jumps (a rollback or a
    resume), the queue no longer matches, is dropped, and the shadow restarts from the new place.
    """

    def __init__(self, trainer: Trainer, depth: int) -> None:
        self.trainer = trainer
        self.depth = depth
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="vatra-prefetch")
        self.queue: deque[tuple[np.ndarray, Future[Batch]]] = deque()
        self.shadow: ShardSampler | None = None

    def _resync(self) -> None:
        real = self.trainer.sampler
        self.shadow = ShardSampler(real.indices, real.batch_size, seed=real.seed, shuffle=real.shuffle)
        self.shadow.load_state_dict(real.state_dict())
        self.queue.clear()

    def next_batch(self) -> Batch:
        idx = self.trainer.sampler.next_batch()
        if self.queue and np.array_equal(self.queue[0][0], idx):
            batch = self.queue.popleft()[1].result()
        else:
            self._resync()
            batch = self.trainer.train_split.batch(idx)
        assert self.shadow is not None
        while len(self.queue) < self.depth:
            ahead = self.shadow.next_batch()
            self.queue.append((ahead, self.pool.submit(self.trainer.train_split.batch, ahead)))
        device = self.trainer.dist.device
        return batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@register("prefetch")
class Prefetch(Policy):
    """When the monitor sees a rank spend more than ``data_wait_share`` of its step waiting for
    data in two windows in a row, double the prefetch depth (1, 2, 4, … up to ``max_prefetch``).

    One window is not enough: on a busy machine a single descheduled data fetch makes a window of
    cheap steps look data-bound, and prefetch threads only cost time when loading is cheap.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.prefetcher: Prefetcher | None = None
        self.waited = False  # the previous window was data-bound

    def on_step_end(self, trainer: Trainer, verdict: Verdict | None) -> Action | None:
        if verdict is None:
            return None
        waiting = verdict.data_share > self.cfg.data_wait_share
        confirmed, self.waited = waiting and self.waited, waiting
        if not confirmed:
            return None
        depth = self.prefetcher.depth if self.prefetcher else 0
        if depth >= self.cfg.max_prefetch:
            return None
        new = min(max(1, 2 * depth), self.cfg.max_prefetch)
        reason = f"data wait is {verdict.data_share:.0%} of step time; prefetch {depth} → {new} batches"
        self.waited = False  # the next raise needs two more data-bound windows at the new depth
        return Action(
            self.name, "prefetch", reason, {"data_share": verdict.data_share, "depth": new}, capped=False
        )

    def apply(self, trainer: Trainer, action: Action) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.prefetcher = Prefetcher(trainer, int(action.evidence["depth"]))
        trainer.next_batch = self.prefetcher.next_batch  # type: ignore[method-assign]

    def close(self, trainer: Trainer) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
            del trainer.next_batch  # the class's method again
