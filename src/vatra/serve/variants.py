"""One served alias: its current version, its batcher, and the watcher that hot-swaps it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from vatra.serve.batcher import MicroBatcher
from vatra.serve.source import ModelSource, Slot


class Variant:
    """An alias of the split (``champion``), the version it serves now, and its batcher.

    :meth:`watch` polls the source for the version the alias points at; when it moves, the new
    version is loaded in a background thread while the old one keeps serving, then ``slot`` is
    replaced in one assignment. The batcher reads ``slot`` once per batch, so every request is
    answered by exactly one version, and none waits for the load."""

    def __init__(
        self,
        alias: str,
        slot: Slot,
        *,
        max_batch: int,
        max_wait_s: float,
        observe: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.alias = alias
        self.slot = slot
        self.batcher = MicroBatcher(
            lambda: self.slot,
            max_batch=max_batch,
            max_wait_s=max_wait_s,
            name=alias,
            observe=observe,
        )

    async def watch(
        self,
        source: ModelSource,
        poll_s: float,
        on_swap: Callable[[str, str, str], None],
        log: Callable[[str], None],
    ) -> None:
        """Poll every ``poll_s`` seconds until cancelled. A version that fails to load is logged
        once and skipped until the alias moves again; the current one keeps serving."""
        failed: str | None = None
        last_problem = ""
        while True:
            await asyncio.sleep(poll_s)
            version: str | None = None
            try:
                version = await asyncio.to_thread(source.version, self.alias)
                if version in (self.slot.version, failed):
                    continue
                model = await asyncio.to_thread(source.load, self.alias, version)
            except Exception as err:
                failed = version
                problem = f"{self.alias}: keeps serving {self.slot.version}: {err}".splitlines()[0]
                if problem != last_problem:
                    log(problem)
                    last_problem = problem
                continue
            old, self.slot = self.slot.version, Slot(version, model)
            failed, last_problem = None, ""
            on_swap(self.alias, old, version)
