"""Start worker processes through torch.distributed's elastic agent (the engine behind torchrun)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from vatra.errors import ConfigError, VatraError
from vatra.launch.elastic import preemption_agent
from vatra.launch.forked import cap_threads
from vatra.launch.forked import start as start_forkserver
from vatra.launch.forked import stop as stop_forkserver
from vatra.launch.incidents import host_name, record_launch, review
from vatra.launch.ledger import launch_record
from vatra.monitor.rca import Evidence, classify, line
from vatra.resilience.recovery import record_worker_failures
from vatra.rundir import ERRORS_ENV, RunDir


class WorkerFailure(VatraError):
    """One or more workers exited non-zero: the lowest rank's own error line when it left one,
    with its exit code (2 for a config error), else which ranks failed how."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to 0); the small race is acceptable for local runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:4"`` → (1, 4)."""
    try:
        lo, _, hi = text.partition(":")
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(
            f"--nnodes {text!r}: expected N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4"
        ) from None
    if not 1 <= nmin <= nmax:
        raise ConfigError(f"--nnodes {text!r}: need 1 ≤ MIN ≤ MAX")
    return nmin, nmax


@dataclass
class LaunchSpec:
    """What torchrun's flags say: processes per node, nodes, rendezvous and restarts."""

    nproc: int = 1
    nnodes: str = "1"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "vatra"
    rdzv_backend: str = "c10d"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    node_rank: int | None = None
    local_addr: str | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1  # torchrun's: how soon the agent sees the ranks exit

    def launch_config(self) -> LaunchConfig:
        if self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc}: must be ≥ 1")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be ≥ 0")
        nmin, nmax = parse_nnodes(self.nnodes)
        multi = nmax > 1
        if multi and not self.rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        conf: dict[str, object] = dict(self.rdzv_conf)
        if self.node_rank is not None:
            conf.setdefault("rank", self.node_rank)
            # c10d decides who hosts the store by matching the endpoint to the hostname, which fails in
            # network namespaces (every namespace resolves its hostname to 127.0.0.1): node 0 hosts.
            conf.setdefault("is_host", self.node_rank == 0)
        if "is_host" in conf:
            conf["is_host"] = str(conf["is_host"]).lower() in ("1", "true", "yes")
        return LaunchConfig(
            min_nodes=nmin,
            max_nodes=nmax,
            nproc_per_node=self.nproc,
            run_id=self.rdzv_id,
            rdzv_backend=self.rdzv_backend,
            rdzv_endpoint=self.rdzv_endpoint or f"127.0.0.1:{free_port()}",
            rdzv_configs=conf,
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            local_addr=self.local_addr,
            start_method="spawn",
        )


Entry = Callable[[dict[str, str], list[str]], None]


def launch_workers(spec: LaunchSpec, worker_args: list[str], forked: tuple[Entry, list[str]]) -> None:
    """Run the worker entry of ``forked`` = (entry, preload) with ``worker_args`` on every local
    rank, each forked from a forkserver that imported ``preload`` once (``vatra train`` passes
    ``vatra.worker.forked_main``); raise on failure."""
    run_dir = (
        RunDir(Path(worker_args[worker_args.index("--run-dir") + 1])) if "--run-dir" in worker_args else None
    )
    launch(spec, worker_args, run_dir, forked=forked)


def launch(
    spec: LaunchSpec,
    python_args: list[str],
    run_dir: RunDir | None,
    *,
    forked: tuple[Entry, list[str]] | None = None,
) -> None:
    """Run ``python *python_args`` on every local rank through the elastic agent; raise on failure.
    ``forked`` = (entry, preload): each rank instead runs ``entry(launcher's environment,
    python_args)`` forked from a forkserver that imported ``preload`` once.

    Workers inherit this process's stdout/stderr, so rank 0's progress bar sees the terminal. The
    agent's failure reports (exit code, signal, rank) go to ``run_dir``'s events.jsonl: a SIGKILLed
    worker cannot log its own death.
    """
    config = spec.launch_config()
    cap_threads(spec.nproc)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # "Terminating process N via signal SIGTERM": the others of a failed group, which the one line
    # the launcher prints already accounts for
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    if spec.max_restarts > 0 or config.min_nodes < config.max_nodes:
        # The agent's shared TCPStore outlives a restart (or a re-formed group after another node's
        # preemption), and the new group would read the dead group's gloo addresses from it (hang,
        # or "connection refused"): a fresh store per attempt.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rank_offset = (spec.node_rank or 0) * spec.nproc
    if run_dir is not None:
        run_dir.take_errors()  # left by an earlier attempt: not this one's
    # The workers' error lines go to a folder of this launcher's, off the run folder: a run folder
    # on a full disk cannot take them, and then the one line that says why would be lost.
    errors = tempfile.mkdtemp(prefix="vatra-errors-")
    before = os.environ.get(ERRORS_ENV)
    os.environ[ERRORS_ENV] = errors
    # node 0 alone keeps the launch ledger: a shared run folder counts the job's wall time once
    ledger = run_dir if rank_offset == 0 else None
    host, began = host_name(spec.local_addr), time.time()
    for decision in review([host]):  # this host's incident history (launch.incidents)
        print(f"vatra: {decision.line()}", flush=True)
    try:
        with launch_record(ledger, nproc=spec.nproc, max_restarts=spec.max_restarts):
            if forked is not None:
                entry, preload = forked
                start_forkserver(preload, spec.nproc)  # unless already running
                config.start_method = "forkserver"
                try:
                    _launch(config, entry, (dict(os.environ), python_args), run_dir, rank_offset)
                finally:
                    stop_forkserver()
            else:
                _launch(config, sys.executable, tuple(python_args), run_dir, rank_offset)
    finally:
        if run_dir is not None:
            record_launch(run_dir.path, host, began)
        if before is None:
            os.environ.pop(ERRORS_ENV, None)
        else:
            os.environ[ERRORS_ENV] = before
        shutil.rmtree(errors, ignore_errors=True)


def _launch(
    config: LaunchConfig, entry: Any, args: tuple[Any, ...], run_dir: RunDir | None, rank_offset: int
) -> None:
    try:
        with record_worker_failures(run_dir, rank_offset, config.max_restarts), preemption_agent():
            elastic_launch(config, entry)(*args)
    except SignalException as err:  # told to stop (a spot machine's SIGTERM), or its workers' notice
        said = run_dir.take_errors() if run_dir is not None else []
        words = said[0]["message"] if said else f"stopped by {err.sigval.name}"
        cause = classify(Evidence(signal=err.sigval.name, exit_code=128 + int(err.sigval), error=words))
        print(f"vatra: {line(cause)}", flush=True)  # root-cause analysis (the workers' failure events)
        if said:  # the workers' own account: "SIGTERM at step N: saved checkpoint ..."
            raise WorkerFailure(said[0]["message"], int(said[0]["exit_code"])) from None
        raise WorkerFailure(f"stopped by {err.sigval.name}", 128 + int(err.sigval)) from None
    except ChildFailedError as err:
        codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
        exit_code = 2 if 2 in codes.values() else 1
        detail = ", ".join(f"rank {r} exit code {c}" for r, c in sorted(codes.items()))
        said = run_dir.take_errors() if run_dir is not None else []
        if said:
            raise WorkerFailure(said[0]["message"], int(said[0]["exit_code"])) from None
        raise WorkerFailure(f"worker(s) failed: {detail}", exit_code) from None
