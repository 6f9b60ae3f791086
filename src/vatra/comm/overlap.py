"""``BucketWorker``: one background thread per DDP hook, so a bucket's communication overlaps the rest
of backward while every rank still issues its collectives in the same order.

DDP hands its buckets to the hook in the same order on every rank. A hook that started each bucket's
collectives as soon as it was called, from whatever thread, could interleave two buckets' messages
differently on two ranks (torch's PowerSGD hook did, and hung on gloo with several buckets). One
thread running the buckets' work first-in first-out keeps the order, and the autograd thread goes on
computing the next gradients meanwhile. DDP waits for every bucket's future at the end of backward,
so the worker is idle whenever the training thread reads the hook's state (metrics, checkpoints).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

import torch

Work = Callable[[], torch.Tensor]
_Job = tuple[Work, "torch.futures.Future[torch.Tensor]"]


class BucketWorker:
    """Runs submitted bucket work one job after another on a daemon thread, started on first use.

    After a job fails, the ones queued behind it fail too without running: their collectives would
    no longer line up with the other ranks'. :meth:`close` ends the thread (and that state); so does
    collecting the worker, since the thread holds nothing but its queue.
    """

    def __init__(self, name: str = "vatra-comm") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        self._stop: weakref.finalize | None = None

    def submit(self, work: Work) -> torch.futures.Future[torch.Tensor]:
        """Queue ``work``; the future completes with its result, or fails with its exception."""
        if self._jobs is None:
            jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            self._thread = threading.Thread(target=_serve, args=(jobs,), name=self.name, daemon=True)
            self._thread.start()
            self._stop = weakref.finalize(self, jobs.put, None)
            self._jobs = jobs
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._jobs.put((work, done))
        # DDP reads a failed Python future as a value it cannot cast to a tensor; a callback that
        # raises marks the chained future failed at the C++ level, so backward raises the job's own
        # error (type, message and the worker's traceback).
        return done.then(_result)

    def close(self, wait: bool = True) -> None:
        """Stop the thread once its queue is done; with ``wait``, wait for that (up to 10 s)."""
        if self._stop is None or self._thread is None:
            return
        self._stop()
        if wait:
            self._thread.join(10.0)
        self._jobs = self._thread = self._stop = None


def run_bucket(worker: BucketWorker | None, work: Work) -> torch.futures.Future[torch.Tensor]:
    """A hook's return value: ``work`` queued on ``worker``, or without one run here, its future done."""
    if worker is not None:
        return worker.submit(work)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(work())
    return done


def _result(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.wait()


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    failed = ""  # the first failure, as text: an exception object would keep its frames alive
    while (job := jobs.get()) is not None:
        work, done = job
        del job  # a job holds the hook's state: nothing here may keep it alive while idle
        # set_exception: torch types its argument as the future's result type
        if failed:
            skipped = RuntimeError(f"not run: an earlier bucket's communication failed ({failed})")
            done.set_exception(skipped)  # type: ignore[arg-type]
        else:
            try:
                with torch.no_grad():
                    result = work()
            except Exception as err:
                failed = f"{type(err).__name__}: {err}"
                done.set_exception(err)  # type: ignore[arg-type]
            else:
                done.set_result(result)
                del result
        del work, done
