"""Adaptive micro-batching: concurrent requests to one variant share one model call.

Requests join a queue; one batcher task per variant takes the oldest, adds whatever else is
queued, and waits for more only while the latency budget (``max_wait_s`` since the oldest request
arrived) lasts, the recent request rate says another request is likely to come in time, *and*
recent batches held several requests. The last condition matters for clients that wait for their
answer before sending again: a lone such client sends often, but never while its own request
waits, so waiting would only add latency. Under load requests pile up while the model runs,
batches grow, and then waiting fills them up to ``max_batch`` rows. The model
runs in a worker thread of its own (one call at a time), so the event loop keeps accepting requests
while it runs; the variant's :class:`~vatra.serve.source.Slot` is read once per batch, which is
where a hot swap takes effect.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vatra.errors import VatraError
from vatra.serve.source import Slot

Rows = list[dict[str, Any]]
_WAIT_FILL = 1.5  # wait for company only once recent batches average this many requests


class RowsRefused(Exception):
    """The model refused a request's rows (a missing column, an unseen category): a 4xx."""


class ModelError(Exception):
    """The model failed on rows it should take: a 5xx, counted against the variant."""


@dataclass
class Answer:
    """A request's share of a batch: the version that scored it and one output per row."""

    version: str
    outputs: Rows
    batch_rows: int


@dataclass
class _Request:
    rows: Rows
    arrived: float
    future: asyncio.Future[Answer] = field(repr=False)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _as_error(err: Exception) -> Exception:
    if isinstance(err, VatraError | ValueError | KeyError | TypeError):
        return RowsRefused(_one_line(err))
    return ModelError(f"the model failed: {type(err).__name__}: {_one_line(err)}")


def run_batch(slot: Slot, requests: list[Rows]) -> list[Answer | Exception]:
    """Score the requests' rows in one model call. If that call fails, score each request alone,
    so that only the request at fault gets the error."""
    rows = [row for rs in requests for row in rs]
    try:
        outputs = slot.model.predict(rows)
        if len(outputs) != len(rows):
            raise ModelError(f"the model returned {len(outputs)} outputs for {len(rows)} rows")
    except Exception as err:
        if len(requests) == 1:
            return [err if isinstance(err, ModelError) else _as_error(err)]
        return [run_batch(slot, [rs])[0] for rs in requests]
    answers: list[Answer | Exception] = []
    start = 0
    for rs in requests:
        answers.append(Answer(slot.version, outputs[start : start + len(rs)], len(rows)))
        start += len(rs)
    return answers


class MicroBatcher:
    """Batches one variant's requests; :meth:`run` is the batcher task, :meth:`predict` its client."""

    def __init__(
        self,
        slot: Callable[[], Slot],
        *,
        max_batch: int,
        max_wait_s: float,
        name: str = "model",
        observe: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self._slot = slot
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._observe = observe  # (requests, rows, seconds) per model call
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._held: _Request | None = None  # the request that did not fit the last batch
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"vatra-serve-{name}")
        self._gap = math.inf  # moving average of the time between requests, seconds
        self._last: float | None = None
        self._fill = 1.0  # moving average of requests per batch

    async def predict(self, rows: Rows) -> Answer:
        """Queue the rows and wait for their share of a batch."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._last is not None:
            gap = now - self._last
            self._gap = gap if math.isinf(self._gap) else 0.8 * self._gap + 0.2 * gap
        self._last = now
        request = _Request(rows, now, loop.create_future())
        self._queue.put_nowait(request)
        return await request.future

    async def run(self) -> None:
        """The batcher task: collect, score in the worker thread, answer; until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = await self._collect(loop)
                slot = self._slot()  # read once per batch: a swap lands between batches
                started = loop.time()
                try:
                    answers = await loop.run_in_executor(
                        self._executor, run_batch, slot, [r.rows for r in batch]
                    )
                except Exception as err:  # run_batch catches the model's errors; this is a bug
                    answers = [ModelError(f"batching failed: {_one_line(err)}")] * len(batch)
                self._fill = 0.9 * self._fill + 0.1 * len(batch)
                if self._observe is not None:
                    rows = sum(len(r.rows) for r in batch)
                    self._observe(len(batch), rows, loop.time() - started)
                for request, answer in zip(batch, answers, strict=True):
                    if request.future.done():  # the client went away
                        continue
                    if isinstance(answer, Exception):
                        request.future.set_exception(answer)
                    else:
                        request.future.set_result(answer)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _collect(self, loop: asyncio.AbstractEventLoop) -> list[_Request]:
        first = self._held or await self._queue.get()
        self._held = None
        batch, rows = [first], len(first.rows)
        deadline = first.arrived + self.max_wait_s
        while rows < self.max_batch:
            if self._queue.empty():
                remaining = deadline - loop.time()
                if remaining <= 0 or self._gap > remaining or self._fill < _WAIT_FILL:
                    break  # nobody is likely to come in time
                try:
                    request = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                request = self._queue.get_nowait()
            if rows + len(request.rows) > self.max_batch:
                self._held = request
                break
            batch.append(request)
            rows += len(request.rows)
        return batch
