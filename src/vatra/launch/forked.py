"""Ranks forked from a forkserver that imported torch and vatra once, instead of one fresh
interpreter per rank.

A fresh ``python -m vatra.worker`` spends ~3 s of CPU importing torch and vatra before its first
step, on every rank and again on every elastic restart; forked from a forkserver (a clean process
the launcher starts once, holding no threads, so as safe as ``spawn``) a rank starts in
milliseconds. The forkserver keeps the environment of its start: :func:`adopt` gives a rank the
launcher's environment of the launch instead, with the elastic agent's per-rank variables on top,
and unbuffered output as ``python -u`` gives.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.forkserver
import os
import sys

# the variables the elastic agent sets for each rank (the rest of a rank's environment is the launcher's)
_AGENT = {
    *("LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE"),
    *("GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


_started = False  # whether the running forkserver is the one start() began (the launcher's own)


def _running() -> bool:
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None) is not None


def stop() -> None:
    """Stop the forkserver the launcher started, after its launch: the next launch starts one that
    holds the launcher's stdout, stderr and environment of then (a forkserver keeps those of its
    start, and a program may launch again with its output redirected, as ``vatra.cli.main`` called
    twice does). One the program started itself (for its own processes) is left running."""
    global _started
    if not _started:
        return
    _started = False
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    halt = getattr(server, "_stop", None)  # CPython's own; absent elsewhere: the server then stays
    if halt is not None:
        halt()


def start(preload: list[str], nproc: int) -> None:
    """Start the forkserver now, importing ``preload`` (~2.5 s of CPU) while the launcher goes on
    with its own imports, the run folder and the rendezvous, instead of after them. Its environment
    is the launcher's of now: ``OMP_NUM_THREADS`` is set first, as the launch would set it."""
    global _started
    cap_threads(nproc)
    if _running():  # the program's own (its preload stands): the ranks import the rest themselves
        return
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()
    _started = True


def cap_threads(nproc: int) -> None:
    """Like torchrun: ``nproc`` processes each using every core would oversubscribe the CPU."""
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


def adopt(environ: dict[str, str]) -> None:
    """In a forked rank: the launcher's ``environ`` with the agent's variables on top; stdout and
    stderr unbuffered."""
    agent = {k: v for k, v in os.environ.items() if k in _AGENT or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(agent)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, line_buffering=True)
        setattr(sys, name, stream)
