"""The profiler window: torch.profiler on steps A..B of every rank, one Chrome trace per rank.

Each rank writes ``trace-rank<r>.json`` into the run folder: torch.profiler's trace (CPU ops, the
``gloo:*`` collectives on gloo's threads, CUDA kernels when CUDA is there) with one
``vatra.step#N`` span per profiled step on the training thread and a ``vatra`` header: the rank,
the world size, the window and ``wall_offset_us``, what turns the trace's clock into Unix time in
microseconds (measured here around a marker op, so every rank's trace lines up with the others').
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from vatra._io import atomic_write
from vatra.config._monitor import profile_window
from vatra.engine import Plugin

if TYPE_CHECKING:
    from vatra.config import Config
    from vatra.engine.trainer import Trainer
    from vatra.rundir import RunDir

CLOCK_MARK = "vatra.clock"


def rank_trace(folder: Path, rank: int) -> Path:
    return folder / f"trace-rank{rank}.json"


class TraceWindow(Plugin):
    """Profiles steps ``monitor.profile_steps`` = A..B (inclusive) on this rank.

    The window opens at the end of step A − 1 (at the start of the run when A = 1) and closes at
    the end of step B: placed last among the plugins, a step's span holds everything the step does,
    the other plugins' work and a checkpoint save included. A run that stops inside the window
    (failure, early stop) writes what it recorded.
    """

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        self.first, self.last = profile_window(cfg.monitor.profile_steps)
        self.folder = run_dir.path
        self.prof: profile | None = None
        self.span: record_function | None = None
        self.wall_us = 0.0  # Unix time (µs) of the clock marker
        self.steps: list[int] = []
        self.done = False  # one window per run, even when healing rolls the steps back into it

    def on_fit_start(self, trainer: Trainer) -> None:
        if self.first - 1 <= trainer.state.step < self.last and not self.done:
            self._start(trainer)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.state.step
        if self.prof is not None:
            self._close_span()
            if step >= self.last:
                self._stop(trainer)
                return
            self._open_span(step + 1)
        elif self.first - 1 <= step < self.last and not self.done:
            self._start(trainer)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._stop(trainer)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._stop(trainer, wait=False)  # the other ranks may be gone: no barrier

    def _start(self, trainer: Trainer) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities)
        self.prof.start()
        # the clock: the marker op's trace time against Unix time sampled around it
        before = time.time_ns()
        with record_function(CLOCK_MARK):
            after = time.time_ns()
        self.wall_us = (before + after) / 2000
        self._open_span(trainer.state.step + 1)

    def _open_span(self, step: int) -> None:
        self.span = record_function(f"vatra.step#{step}")
        self.span.__enter__()
        self.steps.append(step)

    def _close_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def _stop(self, trainer: Trainer, *, wait: bool = True) -> None:
        if self.prof is None:
            return
        self._close_span()
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        path = rank_trace(self.folder, trainer.dist.rank)
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        mark = next(e for e in trace["traceEvents"] if e.get("name") == CLOCK_MARK)
        trace["vatra"] = {
            "rank": trainer.dist.rank,
            "world_size": trainer.dist.world_size,
            "steps": [self.steps[0], self.steps[-1]] if self.steps else [],
            "wall_offset_us": self.wall_us - (mark["ts"] + mark.get("dur", 0) / 2),
            "grad_accum": trainer.cfg.train.grad_accum,
        }
        atomic_write(path, json.dumps(trace))
        if wait and trainer.dist.distributed:  # every rank's trace is on disk before any launcher reads them
            torch.distributed.barrier()
