"""Where rank 0 runs the ensemble: in a forked helper process (default on Linux) or inline.

Judging a window (features, detector scores, vote, learning) is ~0.1 ms of numpy and Python in
isolation, but inside a training run it costs several times that — the training step has taken
the CPU caches — and on the one-process digits step (≈ 1.2 ms) it was ≈ 40 µs a step, the largest
part of full monitoring's cost. A thread does not help (the judge holds the GIL the loop needs).

``monitor.judge_in = "process"``: rank 0 forks a helper at the start of the run (torch, numpy and
the detectors are already imported: a fork, not an interpreter start) and the :class:`Ensemble`
lives there. A window goes out as one small pickle when it is ready, and its verdicts are read two
steps later, in submission order, so the verdicts are exactly those of the inline ensemble, at
fixed steps. The helper is not niced (the loop reads its answers) and fits the learned detectors
in its own helper, so a fit never delays a verdict. If the helper cannot start or dies, the
windows not answered yet and all later ones are judged inline by a fresh ensemble, with a warning.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
import warnings
from collections import deque
from typing import Any

from vatra.config._monitor import MonitorConfig
from vatra.monitor._fitproc import ForkedHelper, _can_fork, _fork_helper, end_helper
from vatra.monitor.ensemble import Alarm, Ensemble

Window = tuple[list[int], list[float], list[float]]  # steps, mean losses, gradient norms
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.02  # the helper's pause between looks at its job pipe


def _write_frame(fd: int, obj: Any) -> None:
    """One length-prefixed pickle, written whole."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_frame(fd: int) -> Any:
    """One length-prefixed pickle; EOFError when the other end has closed."""

    def exactly(n: int) -> bytes:
        parts = []
        while n:
            chunk = os.read(fd, n)
            if not chunk:
                raise EOFError("the other end of the judge's pipe is gone")
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)

    (size,) = struct.unpack("<Q", exactly(8))
    return pickle.loads(exactly(size))


def _serve(jobs: int, results: int) -> None:
    """The judge helper's loop: a setup message, then one window in and its verdicts out, until EOF.

    It polls the job pipe between short sleeps instead of blocking on it: a reader blocked on a
    pipe must be woken by the writer, and that wake-up, paid by the training loop on every window,
    cost more than the pickling (≈ 74 µs a window inside a run). The sleep is a twentieth of the
    shortest of the last few times between windows (0.2–20 ms): the loop reads an answer two steps,
    a fifth of a 10-step window, after it sent the window, so the answer is ready long before (a
    long pause, such as an evaluation, does not stretch the sleep).
    """
    import torch

    torch.set_num_threads(1)
    ensemble: Ensemble | None = None
    out: tuple[bool, Any]
    gaps: deque[float] = deque(maxlen=4)  # the last times between jobs
    pause, last = POLL_MIN_S, time.monotonic()
    while True:
        if not select.select([jobs], [], [], 0)[0]:
            time.sleep(pause)
            continue
        now = time.monotonic()
        gaps.append(now - last)
        pause, last = min(max(min(gaps) / 20, POLL_MIN_S), POLL_MAX_S), now
        try:
            kind, payload = _read_frame(jobs)
        except EOFError:
            return
        try:
            if kind == "setup":
                ensemble, out = Ensemble(*payload), (True, None)
            else:
                assert ensemble is not None, "the judge helper was not set up"
                out = (True, ensemble.observe_window(*payload))
        except Exception as exc:
            out = (False, f"{type(exc).__name__}: {exc}")
        try:
            _write_frame(results, out)
        except BrokenPipeError:  # the training process is gone
            return


class InlineJudge:
    """The ensemble in this process: ``collect`` judges the oldest submitted window."""

    def __init__(self, cfg: MonitorConfig, seed: int) -> None:
        self.ensemble = Ensemble(cfg, seed=seed)
        self.queue: deque[Window] = deque()

    def submit(self, steps: list[int], losses: list[float], grad_norms: list[float]) -> None:
        self.queue.append((steps, losses, grad_norms))

    def collect(self) -> list[Alarm | None]:
        return self.ensemble.observe_window(*self.queue.popleft())

    def close(self, wait: bool = True) -> None:
        self.ensemble.close(wait)


class HelperJudge:
    """The ensemble in a forked helper: ``submit`` sends a window, ``collect`` reads the verdicts
    of the oldest one (blocking until the helper has judged it, normally long done)."""

    def __init__(self, cfg: MonitorConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.sent: deque[Window] = deque()  # submitted, not collected: re-judged inline if the helper dies
        self.inline: InlineJudge | None = None
        self.proc: ForkedHelper | None = None
        try:
            self.proc = _fork_helper(_serve)
            self._send("setup", (cfg, seed))
            self._receive()
        except Exception as exc:
            self._fail(exc)

    def _send(self, kind: str, payload: tuple[Any, ...]) -> None:
        assert self.proc is not None
        _write_frame(self.proc.stdin.fileno(), (kind, payload))

    def _receive(self) -> Any:
        assert self.proc is not None
        ok, value = _read_frame(self.proc.stdout.fileno())  # EOFError if the helper is gone
        if not ok:
            raise RuntimeError(value)
        return value

    def _fail(self, exc: BaseException) -> None:
        warnings.warn(
            f"monitor: the judge helper process failed ({type(exc).__name__}: {exc}); "
            "judging in the training process from now on, with detectors that start learning again",
            stacklevel=3,
        )
        self._stop(kill=True)
        self.inline = InlineJudge(self.cfg, self.seed)
        self.inline.queue.extend(self.sent)  # unanswered windows: judged inline, in order
        self.sent.clear()

    def submit(self, steps: list[int], losses: list[float], grad_norms: list[float]) -> None:
        if self.inline is not None:
            self.inline.submit(steps, losses, grad_norms)
            return
        self.sent.append((steps, losses, grad_norms))
        try:
            self._send("window", self.sent[-1])
        except Exception as exc:  # BrokenPipeError: the helper is gone
            self._fail(exc)

    def collect(self) -> list[Alarm | None]:
        if self.inline is None:
            try:
                verdicts: list[Alarm | None] = self._receive()
                self.sent.popleft()
                return verdicts
            except Exception as exc:
                self._fail(exc)
        assert self.inline is not None
        return self.inline.collect()

    def _stop(self, kill: bool) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        end_helper(proc)  # EOF: the helper's loop ends, and with it its own fit helper

    def close(self, wait: bool = True) -> None:
        """Stop the helper (a fit in flight in its own helper is dropped with it)."""
        self._stop(kill=False)
        if self.inline is not None:
            self.inline.close(wait)


Judge = InlineJudge | HelperJudge


def build_judge(cfg: MonitorConfig, seed: int) -> Judge:
    """The helper where forking is safe (Linux, main thread) and asked for; else inline."""
    if cfg.judge_in == "process" and _can_fork():
        return HelperJudge(cfg, seed)
    return InlineJudge(cfg, seed)
