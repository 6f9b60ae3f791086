"""Where the learned detectors fit: a helper process (default) or a thread of the training process.

A fit is ~0.1 s of scikit-learn or ~0.1–1 s of small torch steps, nearly all of it holding the
GIL. In a thread of the training process it stalls the training loop for about that long: every
torch op releases the GIL, and getting it back waits on the fitting thread (up to the 5 ms switch
interval each time). Measured on the digits example, one warm-up fit cost the loop more than the
rest of the monitor's work over 1,500 steps. In a separate process the fit runs on another core
(niced, so training keeps priority) and the loop only pays for pickling a few hundred rows.

The helper is started on the first fit. On Linux, when that fit is submitted from the main thread
(the monitor judges there), it is a fork of the training process: torch, scikit-learn and vatra are
already imported, so it costs a fork (a few ms) instead of a fresh interpreter importing them
(≈ 3 s of CPU — measured on the 4-rank flagship on 2 cores, that import alone took the run from
0.97 to 0.83-0.90 of the throughput without monitoring). The forked helper closes every inherited
descriptor but its two pipes (it must not keep the parent's sockets open), restores the default
SIGTERM handling and uses one intra-op thread, as PyTorch's DataLoader workers do. Elsewhere, or
from another thread (forking while another thread may hold a lock is unsafe), it is a fresh
``python`` running :func:`serve`. Either way it reads pickled ``(function, args)`` jobs and writes
pickled ``(ok, result)``, and exits when its job pipe closes, so it never outlives the training
process, even after a kill -9.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO, Any


class Fitter:
    """Runs ``fn(*args)`` off the training loop and returns a Future of its result."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        raise NotImplementedError

    def close(self, wait: bool = True) -> None:
        """Release the worker: after the job in flight when ``wait``, else at once (its result is dropped)."""


class ThreadFitter(Fitter):
    """A daemon thread per fit, in this process (``monitor.fit_in = "thread"``)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()

        def work() -> None:
            import torch

            # One intra-op thread for this thread (OpenMP's setting is per thread): a fit must not
            # compete with the training step for cores.
            torch.set_num_threads(1)
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # the future carries it to whoever reads the result
                fut.set_exception(exc)

        threading.Thread(target=work, name="vatra-fit", daemon=True).start()
        return fut


class ForkedHelper:
    """The parent's handle on a forked helper, with the parts of ``subprocess.Popen`` used here."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"helper {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _can_fork() -> bool:
    return sys.platform == "linux" and threading.current_thread() is threading.main_thread()


def _fork_helper() -> ForkedHelper:
    """Fork a helper that runs :func:`serve` on two pipes (see the module's docstring)."""
    jobs_r, jobs_w = os.pipe()
    results_r, results_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the helper: never returns into the parent's code
        code = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's checkpoint-on-SIGTERM
            keep = {0, 1, 2, jobs_r, results_w}
            for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                if fd not in keep:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            serve(os.fdopen(jobs_r, "rb"), os.fdopen(results_w, "wb"))
            code = 0
        finally:
            os._exit(code)  # no atexit handlers or finalizers of the parent's objects
    os.close(jobs_r)
    os.close(results_w)
    return ForkedHelper(pid, os.fdopen(jobs_w, "wb"), os.fdopen(results_r, "rb"))


class ProcessFitter(Fitter):
    """One helper process, started on the first ``submit``; jobs run one at a time, in order."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | ForkedHelper | None = None
        self.lock = threading.Lock()  # one job on the pipe at a time
        # Bumped by close(): a job submitted before it and still waiting for the lock is dropped
        # instead of starting a new helper (which would make close wait for its imports and fit).
        self.generation = 0

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> subprocess.Popen[bytes] | ForkedHelper:
        if self.proc is not None and self._alive():
            return self.proc
        if _can_fork():
            self.proc = _fork_helper()
            return self.proc
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        # The same import path as this process (tests and scripts may extend sys.path).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from vatra.monitor._fitproc import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        return self.proc

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        generation = self.generation
        if not self._alive() and _can_fork():
            try:
                with self.lock:  # start it here, on the main thread, where forking is safe
                    self._start()
            except Exception as exc:  # this fit fails; the detector decides what to do next
                fut.set_exception(exc)
                return fut

        def work() -> None:
            try:
                with self.lock:
                    if generation != self.generation:
                        raise RuntimeError("the fitter was closed before this fit started")
                    proc = self._start()
                    assert proc.stdin is not None and proc.stdout is not None
                    pickle.dump((fn, args), proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                    proc.stdin.flush()
                    ok, value = pickle.load(proc.stdout)  # blocks without holding the GIL
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(RuntimeError(f"detector fit failed in the helper process: {value}"))
            except BaseException as exc:  # a dead helper (EOFError, BrokenPipeError) fails this fit
                fut.set_exception(exc)

        threading.Thread(target=work, name="vatra-fit-io", daemon=True).start()
        return fut

    def close(self, wait: bool = True) -> None:
        self.generation += 1  # jobs not started yet will not start
        if not wait and self.proc is not None:
            self.proc.kill()  # the I/O thread's read ends with EOFError; it releases the lock
        with self.lock:  # after any job in flight
            if self.proc is not None:
                end_helper(self.proc)
                self.proc = None


def end_helper(proc: subprocess.Popen[bytes] | ForkedHelper) -> None:
    """Close a helper's job pipe (EOF ends its loop; after a kill, a job may still be buffered:
    it is dropped), wait for it to exit (killed after 10 s) and close its result pipe."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def build_fitter(kind: str) -> Fitter:
    return ProcessFitter() if kind == "process" else ThreadFitter()


def serve(jobs: IO[bytes] | None = None, results: IO[bytes] | None = None) -> None:
    """The helper's loop: one pickled job in, one pickled ``(ok, result)`` out, until EOF.

    A fresh interpreter serves stdin/stdout; a forked helper its two pipes."""
    if jobs is None or results is None:
        jobs, results = sys.stdin.buffer, sys.stdout.buffer
        sys.stdout = sys.stderr  # stray prints must not corrupt the result stream
    if hasattr(os, "nice"):
        os.nice(10)  # fits can wait; the training processes on this machine cannot
    import torch

    torch.set_num_threads(1)
    while True:
        try:
            fn, args = pickle.load(jobs)
        except EOFError:
            return
        try:
            out = (True, fn(*args))
        except Exception as exc:
            out = (False, f"{type(exc).__name__}: {exc}")
        try:
            pickle.dump(out, results, protocol=pickle.HIGHEST_PROTOCOL)
            results.flush()
        except BrokenPipeError:  # the training process is gone, or no longer wants this fit
            return
