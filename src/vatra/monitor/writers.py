"""Rank 0's metric sinks: metrics.jsonl and summary.json, and TensorBoard scalars."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import IO, TYPE_CHECKING, Any

from vatra.engine import Plugin
from vatra.errors import write_failed
from vatra.monitor.ettr import ettr_of_run
from vatra.rundir import RunDir, cut_torn_tail

if TYPE_CHECKING:
    from vatra.engine import Trainer


class JsonlWriter(Plugin):
    """One JSON object per step in metrics.jsonl; summary.json at the end. Rank 0 only."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.file: IO[str] | None = None
        self.good = 0  # metrics.jsonl's size after the last whole line written

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if not trainer.dist.is_main:
            return
        path = self.run_dir.metrics
        try:
            if self.file is None:
                # Kept open for the run (an open/close per line cost ~0.1 ms a step); each line is
                # flushed, so a crashed process leaves every line it finished.
                cut_torn_tail(path)
                self.file = path.open("a", encoding="utf-8")
                self.good = self.file.tell()
            self.file.write(json.dumps(metrics, default=float) + "\n")
            self.file.flush()
            self.good = self.file.tell()
        except OSError as err:  # a full disk: leave no half line for the resumed run to trip on
            self._undo()
            raise write_failed(err, path) from None

    def _undo(self) -> None:
        """Drop what the failed write left after the last whole line, and close."""
        file, self.file = self.file, None
        if file is None:
            return
        with contextlib.suppress(OSError):
            os.truncate(self.run_dir.metrics, self.good)
        with contextlib.suppress(OSError):
            file.close()  # flushing the rest of the buffer may fail again; the truncate stands
        with contextlib.suppress(OSError):
            os.truncate(self.run_dir.metrics, self.good)

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._close()
        if trainer.dist.is_main:
            # so far (this launch still running): the launcher writes the final figures when it ends
            summary.update(ettr_of_run(self.run_dir.path, now=time.time()))
            self.run_dir.write_summary(summary)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._close()


class TensorBoardWriter(Plugin):
    """Scalars under <run>/tb. Rank 0 only.

    Metrics every step carries (loss, lr, timings, ...) are written every ``every`` steps and at
    the last step; sparse ones (validation, system samples, gathers) whenever they appear. An
    event costs ~65 µs per scalar here, which on a small model's step is a visible share;
    metrics.jsonl keeps every step anyway.
    """

    def __init__(self, run_dir: RunDir, every: int = 1) -> None:
        self.run_dir = run_dir
        self.every = every
        self.writer: Any = None
        self.dense: set[str] | None = None  # the keys of the first step: present on every step

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.dist.is_main:
            from torch.utils.tensorboard import SummaryWriter  # heavy import; only where used

            self.writer = SummaryWriter(log_dir=str(self.run_dir.tb), flush_secs=10)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        step = metrics["step"]
        if self.dense is None:
            self.dense = set(metrics)
        all_keys = step % self.every == 0 or step >= trainer.cfg.train.steps
        for key, value in metrics.items():
            if not all_keys and key in self.dense:
                continue
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                group = "val" if key.startswith("val_") else "train"
                self.writer.add_scalar(f"{group}/{key}", value, step)

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._close()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._close()
