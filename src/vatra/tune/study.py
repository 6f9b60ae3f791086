"""A study on optuna: its storage, sampler and pruner from ``[tune]``, the trials it counts, stale
trials of dead workers, and the runner behind ``vatra tune`` (workers, progress, outputs)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from vatra._extras import require
from vatra.config import Config, TuneConfig, dump_toml
from vatra.errors import ConfigError, VatraError
from vatra.rundir import append_jsonl
from vatra.tune._secret import PASSWORD_ENV, redact, split_password

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

# RDB storages (many machines): a running trial's worker writes a heartbeat this often; a trial
# whose heartbeat is older than the grace period is failed by the next worker that asks, and retried.
HEARTBEAT_S = 5
GRACE_S = 20
# A RUNNING trial that names no worker this long after it started was asked for by a worker killed
# before it could name itself (kill -9 between ask and set_user_attr, milliseconds apart): no one
# will ever finish it, so it is failed and retried like a dead worker's trial.
ORPHAN_GRACE_S = 20.0
POLL_S = 0.5  # how often the runner and idle workers look at the storage


def study_dir(cfg: Config, name: str | None = None) -> Path:
    return Path(cfg.run.out_dir) / (name or study_name(cfg))


def study_name(cfg: Config) -> str:
    return cfg.tune.study or cfg.run.name


def storage_url(cfg: Config, folder: Path) -> str:
    """``tune.storage``, or the journal file in the study folder ("" = embedded, one machine)."""
    return cfg.tune.storage or str((folder / "journal.log").resolve())


def open_storage(
    url: str, *, on_stale: Callable[..., None] | None = None, password: str | None = None
) -> optuna.storages.BaseStorage:
    """A journal file (a path), or an RDB storage (``postgresql://…``, with a heartbeat so that a
    dead machine's trial is failed and retried). ``password`` goes to the driver, never into ``url``;
    without it libpq reads PGPASSWORD, PGPASSFILE or ~/.pgpass itself."""
    optuna = require("optuna", "tune", "vatra tune")
    if "://" not in url:
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url))
    scheme, _, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        require("psycopg", "tune", f"storage {scheme}://")
        url = f"postgresql+psycopg://{rest}"  # SQLAlchemy's default driver would be psycopg2
    elif not scheme.startswith(("postgresql+", "mysql", "sqlite")):
        raise ConfigError(
            f"tune.storage {url!r}: expected '' (journal file) or postgresql://user@host:port/db"
        )
    try:
        with warnings.catch_warnings():  # the heartbeat is "experimental" since optuna 2.9
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url,
                heartbeat_interval=HEARTBEAT_S,
                grace_period=GRACE_S,
                heartbeat_stale_trial_callback=on_stale,
                engine_kwargs={"pool_pre_ping": True}
                | ({"connect_args": {"password": password}} if password is not None else {}),
            )
    except Exception as err:  # sqlalchemy's OperationalError: no server, bad credentials
        why = redact(str(err).splitlines()[0])
        raise VatraError(f"tune.storage: cannot open {redact(url)}: {why}") from None


def make_sampler(
    tune: TuneConfig, seed: int, log: Callable[[dict[str, Any]], None] | None = None
) -> optuna.samplers.BaseSampler:
    optuna = require("optuna", "tune", "vatra tune")
    if tune.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if tune.sampler == "gp":
        # a conditional parameter is sampled independently (GP models the always-present ones)
        return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)
    if tune.sampler == "adaptive":
        from vatra.tune.adaptive import AdaptiveSampler

        return AdaptiveSampler("tpe", seed=seed, log=log)
    # group: conditional parameters are modelled with the parameters they appear with
    grouped = any(p.when for p in tune.space.values())
    with warnings.catch_warnings():  # group is "experimental" since optuna 2.8
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(multivariate=True, constant_liar=True, group=grouped, seed=seed)


def make_pruner(cfg: Config) -> optuna.pruners.BasePruner:
    """The pruner, sized in steps: intermediate values are reported at eval steps."""
    optuna = require("optuna", "tune", "vatra tune")
    tune, every, steps = cfg.tune, cfg.train.eval_every, cfg.train.steps
    if tune.pruner == "none":
        return optuna.pruners.NopPruner()
    if tune.epochs:  # trials report once per epoch (see TrialPruner): resources are epochs
        every, steps = 1, tune.epochs
    if tune.epochs == 1:
        raise ConfigError(
            f"tune.pruner = {tune.pruner!r} judges trials after each epoch, and tune.epochs = 1 ends them "
            "there; set tune.epochs ≥ 2 or tune.pruner = 'none'"
        )
    if not every or every >= steps:
        raise ConfigError(
            f"tune.pruner = {tune.pruner!r} judges trials at their eval steps, and train.eval_every = "
            f"{every} evaluates only at the end; set train.eval_every below train.steps ({cfg.train.steps})"
        )
    if tune.pruner == "median":
        # reports are numbered in steps, or in epochs with tune.epochs: warm up over that share of them
        warmup = math.floor(tune.pruner_warmup * steps / every) * every
        return optuna.pruners.MedianPruner(
            n_startup_trials=tune.pruner_startup, n_warmup_steps=warmup, interval_steps=1
        )
    if tune.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=every, reduction_factor=3)
    return optuna.pruners.HyperbandPruner(min_resource=every, max_resource=steps, reduction_factor=3)


def retry(study: optuna.Study, trial: FrozenTrial) -> None:
    """A trial whose worker died is run again, with the same values (a new number)."""
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})


def counts(trials: Sequence[FrozenTrial]) -> tuple[int, int]:
    """(finished, running): finished = complete, pruned, or failed by its own error; a trial
    failed because its worker died does not count (it is retried)."""
    from optuna.trial import TrialState

    finished = sum(
        t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and "error" in t.user_attrs)
        for t in trials
    )
    running = sum(t.state == TrialState.RUNNING for t in trials)
    return finished, running


def worker_identity() -> dict[str, Any]:
    """What tells a trial's worker apart from a later process with the same pid."""
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "pid_start": me.create_time()}


def _alive(worker: dict[str, Any]) -> bool:
    try:
        return bool(psutil.Process(int(worker["pid"])).create_time() == worker.get("pid_start"))
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _orphaned(trial: FrozenTrial) -> bool:
    """A RUNNING trial that names no worker ``ORPHAN_GRACE_S`` after it started (see there)."""
    start = trial.datetime_start  # optuna's local time, as datetime.now() gives it
    return start is None or (datetime.now() - start).total_seconds() > ORPHAN_GRACE_S


def fail_stale(study: optuna.Study) -> list[int]:
    """Fail RUNNING trials whose worker is gone, and queue them again; returns their numbers.

    On this machine a dead worker is seen at once (its pid is gone, or is another process now);
    on an RDB storage optuna's heartbeat catches the trials of other machines' dead workers. A
    trial that names no worker is failed after ``ORPHAN_GRACE_S``, on any storage.
    """
    import optuna
    from optuna.storages._heartbeat import is_heartbeat_enabled
    from optuna.trial import TrialState

    host = socket.gethostname()
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if not isinstance(worker, dict):
            if not _orphaned(t):
                continue
        elif worker.get("host") != host or _alive(worker):
            continue
        try:
            study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another process got there first
        retry(study, t)
        failed.append(t.number)
    if is_heartbeat_enabled(study._storage):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
    return failed


class StudyStopped(KeyboardInterrupt):
    """Ctrl-C stopped the study's workers after ``finished`` trials (the same command resumes)."""

    def __init__(self, finished: int) -> None:
        super().__init__(finished)
        self.finished = finished


@dataclass
class Study:
    """One ``vatra tune`` invocation: the base config, its study folder, storage and workers.

    A password in ``tune.storage`` is taken out of it here (``password``): the config written to
    the study folder, and so every trial's, and the workers' command lines hold the URL without it;
    the workers get it as PGPASSWORD.
    """

    cfg: Config
    workers: int
    join: bool = False

    def __post_init__(self) -> None:
        self.name = study_name(self.cfg)
        self.folder = study_dir(self.cfg)
        self.url, self.password = split_password(storage_url(self.cfg, self.folder))
        if self.password is not None:
            tune = self.cfg.tune.model_copy(update={"storage": self.url})
            self.cfg = self.cfg.model_copy(update={"tune": tune})

    def open(self) -> optuna.Study:
        """Create the study (or load it: the same command resumes); ``join`` needs it to exist."""
        optuna = require("optuna", "tune", "vatra tune")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if "://" not in self.url:  # the journal file lives in the study folder
            self.folder.mkdir(parents=True, exist_ok=True)
        storage = open_storage(self.url, on_stale=retry, password=self.password)
        direction = self.cfg.tune.direction
        if self.join:
            try:
                study = optuna.load_study(study_name=self.name, storage=storage)
            except KeyError:
                raise ConfigError(
                    f"--join {self.name}: no such study in {redact(self.url)}; start it with "
                    f"'vatra tune CONFIG --storage URL' (tune.study = {self.name!r}) first"
                ) from None
        else:
            study = optuna.create_study(
                study_name=self.name, storage=storage, direction=direction, load_if_exists=True
            )
        if study.direction.name.lower() != direction:
            raise ConfigError(
                f"tune.direction = {direction!r}, but study {self.name!r} in {redact(self.url)} "
                f"{study.direction.name.lower()}s; use another tune.study or the same direction"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        return study

    def run(self, overrides: list[str], show: Callable[[optuna.Study, bool], None]) -> optuna.Study:
        """Start the workers, show progress until they are done, write study.json and report.html.

        ``overrides``: what each trial's config gets on top of the base (the lean trial settings).
        A worker that dies takes only its own trial down: the trial is failed and queued again.
        """
        study = self.open()
        resumed = fail_stale(study)
        if resumed:
            append_jsonl(
                self.folder / "events.jsonl", {"time": time.time(), "event": "resume", "retried": resumed}
            )
        (self.folder / "config.toml").write_text(dump_toml(self.cfg))
        deadline = time.time() + self.cfg.tune.timeout_s if self.cfg.tune.timeout_s else 0.0
        show(study, False)  # before any worker: what a resumed study had finished already
        procs = [self._spawn(i, overrides, deadline) for i in range(self.workers)]
        try:
            while any(p.poll() is None for p in procs):
                show(study, False)
                time.sleep(POLL_S)
            show(study, True)
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
            show(study, True)  # the trials that finished meanwhile, then the display ends
            raise StudyStopped(counts(study.get_trials(deepcopy=False))[0]) from None
        finally:
            from vatra.tune.report import write_study_json

            write_study_json(study, self)
        bad = [p.returncode for p in procs if p.returncode]
        if bad and not counts(study.get_trials(deepcopy=False))[0] >= self.cfg.tune.trials:
            raise VatraError(f"{len(bad)} trial worker(s) failed (exit codes {bad}); see the lines above")
        return study

    def _spawn(self, index: int, overrides: list[str], deadline: float) -> subprocess.Popen[bytes]:
        args = [
            sys.executable, "-m", "vatra.tune.workers", "serve", str(self.folder / "config.toml"),
            "--storage", self.url, "--study", self.name, "--index", str(index),
            "--deadline", str(deadline), "--parent", str(os.getpid()),
        ]  # fmt: skip
        for item in overrides:
            args += ["--set", item]
        env = dict(os.environ)
        if self.password is not None:  # libpq reads it there; a command line is visible in ps
            env[PASSWORD_ENV] = self.password
        # W workers each using every core would oversubscribe the CPU (as torchrun does for ranks)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.workers)))
        return subprocess.Popen(args, env=env)
