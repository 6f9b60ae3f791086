"""``vatra train`` with ``resilience.live = true``: a torchft lighthouse and one replica group per
process, where a dead group is restarted alone and heals from a live peer.

The launcher hosts the lighthouse (torchft's ``LighthouseServer``, with the ``live_*`` keys) and
forks one process per group from vatra's forkserver (:mod:`vatra.launch.forked`), so a restarted
group starts in well under a second instead of importing torch again. It watches them:

- a group that exits 0 reached ``train.steps``; the run succeeds when every group has;
- a group that dies (a signal, a crash) gets a ``worker_failed`` event with its last step, and is
  started again (``live_max_restarts`` in all) while the others keep training; it heals from a
  live peer at its first quorum. Only a group restarted while no other is alive resumes from
  vatra's checkpoint (group 0 saves them) instead;
- a config error (exit 2) or a death after another group finished (no live peer is left to heal
  from) ends the run with the group's one line.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from vatra._extras import check
from vatra.config import Config, dump_toml
from vatra.errors import ConfigError
from vatra.launch import WorkerFailure
from vatra.launch.forked import cap_threads
from vatra.launch.ledger import launch_record
from vatra.monitor.rca import Evidence, classify
from vatra.resilience.recovery import read_progress, signal_name
from vatra.rundir import ERRORS_ENV, RunDir

POLL_S = 0.05  # how soon a dead group is seen and restarted


def lighthouse(cfg: Config) -> Any:
    """torchft's lighthouse on a free local port, with the ``live_*`` keys as its options."""
    from torchft.coordination import LighthouseServer

    r = cfg.resilience
    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=r.live_min_replicas,
        join_timeout_ms=r.live_join_timeout_ms,
        quorum_tick_ms=r.live_quorum_tick_ms,
        heartbeat_timeout_ms=r.live_heartbeat_ms,
    )


def check_groups(cfg: Config, groups: int, nnodes: str) -> None:
    """What the launch can refuse before any process starts: the node and group counts, torchft."""
    if nnodes != "1":
        raise ConfigError(
            f"--nnodes {nnodes}: resilience.live = true runs its replica groups on this node only; "
            "drop --nnodes, or set resilience.live = false"
        )
    if groups < 2:
        raise ConfigError(
            "resilience.live = true needs at least 2 replica groups to keep one alive: pass --nproc 2 "
            "or more (dist.nproc)"
        )
    if groups < cfg.resilience.live_min_replicas:
        raise ConfigError(
            f"resilience.live_min_replicas = {cfg.resilience.live_min_replicas} is more than the "
            f"{groups} replica groups (--nproc); lower it or raise --nproc"
        )
    check("torchft", "ft", "resilience.live = true")  # not imported here: see vatra.worker.preload


def launch_live(cfg: Config, rd: RunDir, groups: int, nnodes: str = "1") -> None:
    """Train ``rd``'s config on ``groups`` replica groups of one process each; raise
    :class:`WorkerFailure` when the run cannot finish."""
    check_groups(cfg, groups, nnodes)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's per-step INFO lines (see vatra.worker.preload)
    server = lighthouse(cfg)
    address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    cap_threads(groups)
    errors = tempfile.mkdtemp(prefix="vatra-errors-")
    before = os.environ.get(ERRORS_ENV)
    os.environ[ERRORS_ENV] = errors
    try:
        with launch_record(rd, nproc=groups, live=True):  # launch_start/_end: the run's ETTR
            Supervisor(cfg, rd, groups, address).run()
    finally:
        server.shutdown()
        if before is None:
            os.environ.pop(ERRORS_ENV, None)
        else:
            os.environ[ERRORS_ENV] = before
        shutil.rmtree(errors, ignore_errors=True)


class Supervisor:
    """Starts the groups, restarts a dead one, and says why the run ended."""

    def __init__(self, cfg: Config, rd: RunDir, groups: int, lighthouse: str) -> None:
        self.cfg, self.rd, self.groups, self.lighthouse = cfg, rd, groups, lighthouse
        self.mp = multiprocessing.get_context("forkserver")
        self.procs: dict[int, BaseProcess] = {}
        self.attempts = dict.fromkeys(range(groups), 0)
        self.finished: set[int] = set()
        self.restarts = 0
        self.stop_signal: int | None = None
        self.heal_written = False

    def start(self, group: int, *, resume: bool) -> None:
        from vatra.live.replica import main

        config = str(self.rd.config if resume else self._healing_config())
        argv = [config, str(self.rd.path), str(group), str(self.groups), self.lighthouse]
        proc = self.mp.Process(
            target=main, args=(dict(os.environ), [*argv, str(self.attempts[group])]), name=f"group{group}"
        )
        proc.start()
        self.procs[group] = proc
        self.rd.log_event(
            "live_group_started", group=group, pid=proc.pid, attempt=self.attempts[group], resume=resume
        )

    def _healing_config(self) -> Path:
        """The run's config without checkpoint resume: a group restarted beside live peers takes
        their state, not an older checkpoint's (which would count steps as lost that are not)."""
        path = self.rd.path / ".live" / "heal.toml"
        if not self.heal_written:  # once per launch: a rerun may have changed the config
            healing = self.cfg.model_copy(deep=True)
            healing.checkpoint.resume = False
            path.parent.mkdir(exist_ok=True)
            path.write_text(dump_toml(healing))
            self.heal_written = True
        return path

    def run(self) -> None:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for group in range(self.groups):
                self.start(group, resume=True)
            while self.procs:
                if self.stop_signal is not None:
                    raise WorkerFailure(
                        f"stopped by {signal.Signals(self.stop_signal).name}", 128 + self.stop_signal
                    )
                time.sleep(POLL_S)
                for group, proc in list(self.procs.items()):
                    if proc.exitcode is not None:
                        del self.procs[group]
                        self._exited(group, proc)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self._stop_all()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _exited(self, group: int, proc: BaseProcess) -> None:
        code = int(proc.exitcode or 0)
        if code == 0:
            self.finished.add(group)
            return
        said = self.rd.take_errors()
        progress = read_progress(self.rd.path, group) or {}
        evidence = Evidence(
            rank=group, exit_code=code, signal=signal_name(code), error=said[0]["message"] if said else ""
        )
        self.rd.log_event(
            "worker_failed",
            rank=group,
            group=group,
            exit_code=code,
            signal=signal_name(code),
            pid=proc.pid,
            step=progress.get("step"),
            last_step_time=progress.get("time"),
            attempt=self.attempts[group],
            source="live launcher",
            cause=classify(evidence, "the group restarts and heals from a live peer; the others go on"),
        )
        how = said[0]["message"] if said else f"group {group} exit code {code}"
        if said and int(said[0]["exit_code"]) == 2:  # a config error: the same on every restart
            raise WorkerFailure(said[0]["message"], 2)
        if self.finished:
            raise WorkerFailure(
                f"{how}, after group(s) {sorted(self.finished)} finished: no live peer is left to heal "
                "from; run the same command with --run-dir to resume from the last checkpoint",
                1,
            )
        if self.restarts >= self.cfg.resilience.live_max_restarts:
            raise WorkerFailure(
                f"{how}; resilience.live_max_restarts = {self.cfg.resilience.live_max_restarts} restarts "
                "are used up",
                1,
            )
        print(
            f"vatra: group {group} died ({signal_name(code) or f'exit code {code}'}) after step "
            f"{progress.get('step', 0)}; restarting it while the others train on",
            flush=True,
        )
        self.restarts += 1
        self.attempts[group] += 1
        self.start(group, resume=not self.procs)  # no live peer: from the checkpoint

    def _stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + 10.0
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
