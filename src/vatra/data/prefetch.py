"""Reading batches ahead on background threads, in order: the trainer's prefetch without loader
workers (``Batches.prefetch``), where the DataLoader's own workers are not there to do it."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from vatra.data.sampler import GlobalBatchSampler, ShardSampler


class _Failed:
    def __init__(self, err: BaseException) -> None:
        self.err = err


class ReadAhead:
    """Pulls items from an iterator on a background thread, up to ``depth`` ahead, in order."""

    def __init__(self, it: Iterator[Any], depth: int) -> None:
        self.it = it
        self.items: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vatra-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.it:
                while not self.stopped.is_set():
                    try:
                        self.items.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if self.stopped.is_set():
                    return
        except BaseException as err:  # surfaced on the training thread by __next__
            self.items.put(_Failed(err))

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> Any:
        item = self.items.get()
        if isinstance(item, _Failed):
            raise item.err
        return item

    def close(self) -> None:
        self.stopped.set()
        while self.thread.is_alive():
            try:
                self.items.get(timeout=0.05)
            except queue.Empty:
                continue
        self.thread.join()


class Pooled:
    """Batches of a sampler's order fetched by ``depth`` threads, ``depth`` in flight, yielded in order."""

    def __init__(
        self, sampler: ShardSampler | GlobalBatchSampler, fetch: Callable[[np.ndarray], Any], depth: int
    ) -> None:
        self.sampler = sampler
        self.fetch = fetch
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="vatra-prefetch")
        self.queue: deque[Future[Any]] = deque(
            self.pool.submit(fetch, sampler.next_batch()) for _ in range(depth)
        )

    def __iter__(self) -> Pooled:
        return self

    def __next__(self) -> Any:
        result = self.queue.popleft().result()
        self.queue.append(self.pool.submit(self.fetch, self.sampler.next_batch()))
        return result

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
