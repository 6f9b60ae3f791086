"""Trial workers: long-lived processes that loop ask → train → tell on one study.

``python -m vatra.tune.workers serve CONFIG --storage URL --study NAME ...`` is one worker (started
by ``vatra tune``); ``... rank CONFIG --run-dir DIR ...`` is one rank of a distributed trial
(``tune.trial_nproc > 1``), started through vatra's launcher by a worker.

A worker imports torch once and keeps the datasets of a data config between trials, so a trial
costs its training and little more: no interpreter, no display, TensorBoard or report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.config import Config, config_from_dict, dump_toml, load_config
from vatra.errors import VatraError
from vatra.rundir import RunDir, append_jsonl
from vatra.tune.space import apply, order, suggest
from vatra.tune.study import (
    POLL_S,
    counts,
    fail_stale,
    make_pruner,
    make_sampler,
    open_storage,
    retry,
    worker_identity,
)

if TYPE_CHECKING:
    import optuna

    from vatra.data import Datasets


class DataCache:
    """The datasets of the last few data configs: trials that vary the model or the optimiser
    train on the same tensors, built once per worker."""

    def __init__(self, folder: Path, size: int = 2) -> None:
        self.folder = folder  # fitted preprocessing state lives here, shared by the study's trials
        self.size = size
        self.entries: dict[str, Datasets] = {}

    def get(self, cfg: Config) -> Datasets:
        from vatra.data import DataContext, build_dataset

        heads = {name: h.task for name, h in cfg.train.multitask.heads.items()}
        key = json.dumps(
            [cfg.data.model_dump(mode="json"), cfg.run.seed, cfg.train.task, heads], sort_keys=True
        )
        if key not in self.entries:
            if len(self.entries) >= self.size:
                self.entries.pop(next(iter(self.entries)))
            ctx = DataContext(seed=cfg.run.seed, run_dir=self.folder, task=cfg.train.task, head_tasks=heads)
            self.entries[key] = build_dataset(cfg.data, ctx, cfg.train.task)
        return self.entries[key]


def by_epochs(cfg: Config, rows: int) -> Config:
    """``cfg`` with ``train.steps`` for ``tune.epochs`` epochs of ``rows`` training rows at the trial's
    batch size (on every rank), and one evaluation per epoch; unchanged when ``tune.epochs`` is 0."""
    epochs = cfg.tune.epochs
    if not epochs:
        return cfg
    per_epoch = max(1, math.ceil(rows / (cfg.train.batch_size * cfg.tune.trial_nproc)))
    train = cfg.train.model_copy(update={"steps": epochs * per_epoch, "eval_every": per_epoch})
    return cfg.model_copy(update={"train": train})


def train_here(cfg: Config, run_dir: RunDir, trial: optuna.Trial, cache: DataCache) -> dict[str, Any]:
    """One trial in this process: the engine's Trainer on cached data, seeded as ``vatra.fit`` is."""
    from vatra.assembly import build_plugins, prepare_run
    from vatra.engine import DistContext, Trainer
    from vatra.engine.trainer import rank_seed, seed_everything
    from vatra.models import build_model
    from vatra.tune.pruning import TrialPruner

    cfg, run_dir = prepare_run(cfg, DistContext(), run_dir.path, data_given=True)  # the cache's data
    train, val, spec = cache.get(cfg)
    seed_everything(cfg.run.seed)  # the same initial weights as `vatra train` with this config
    model = build_model(cfg.model, spec, {name: h.size for name, h in cfg.train.multitask.heads.items()})
    seed_everything(rank_seed(cfg.run.seed, 0))
    plugins = build_plugins(cfg, run_dir, [TrialPruner(cfg.tune.objective, trial)])
    trainer = Trainer(cfg, model, train, val, spec, plugins=plugins, run_dir=run_dir)
    return trainer.fit()


def train_ranks(cfg: Config, run_dir: RunDir, trial: optuna.Trial, url: str, study: str) -> dict[str, Any]:
    """One trial as a ``tune.trial_nproc``-rank run through vatra's launcher; its summary.json."""
    from vatra.launch import LaunchSpec, launch

    nproc = cfg.tune.trial_nproc
    cfg = cfg.model_copy(update={"dist": cfg.dist.model_copy(update={"nproc": nproc})})
    run_dir.config.write_text(dump_toml(cfg))
    args = ["-u", "-m", "vatra.tune.workers", "rank", str(run_dir.config), "--run-dir", str(run_dir.path)]
    args += ["--storage", url, "--study", study, "--trial-id", str(trial._trial_id)]
    launch(LaunchSpec(nproc=nproc), args, run_dir)
    return dict(json.loads(run_dir.summary.read_text()))


def run_trial(
    study: optuna.Study,
    trial: optuna.Trial,
    cfg: Config,
    base: dict[str, Any],
    names: list[str],
    folder: Path,
    cache: DataCache,
    url: str,
) -> None:
    """Suggest (``names``: the space in suggestion order), apply to ``base`` (``cfg`` as raw data),
    train, tell. A run that raises is told FAIL with its error and the loop goes on."""
    from optuna.trial import TrialState

    tune = cfg.tune
    run_dir = RunDir(folder / f"trial-{trial.number}").create()
    import torch

    # one storage write (each is an fsync on a journal); the thread count is what a rerun needs to
    # repeat the trial exactly (float sums depend on it)
    trial.set_user_attr("worker", worker_identity() | {"threads": torch.get_num_threads()})
    trial.set_user_attr("run_dir", str(run_dir.path))
    try:
        params = suggest(trial, tune.space, names)
        trial_cfg = config_from_dict(apply(base, params))
        if tune.epochs:  # the steps follow the batch size this trial drew (the data is cached)
            trial_cfg = by_epochs(trial_cfg, len(cache.get(trial_cfg).train))  # type: ignore[arg-type]
        run_dir.config.write_text(dump_toml(trial_cfg))
        if tune.trial_nproc > 1:
            summary = train_ranks(trial_cfg, run_dir, trial, url, study.study_name)
        else:
            summary = train_here(trial_cfg, run_dir, trial, cache)
        if summary.get("pruned"):
            study.tell(trial, state=TrialState.PRUNED)
            return
        value = summary.get(tune.objective)
        if not isinstance(value, int | float) or not math.isfinite(value):
            has = ", ".join(k for k, v in summary.items() if isinstance(v, int | float))
            raise VatraError(
                f"tune.objective {tune.objective!r} is {value!r} in summary.json (numbers there: {has})"
            )
        study.tell(trial, float(value))
    except Exception as err:  # not SystemExit / KeyboardInterrupt: a stopped worker's trial is retried
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        trial.set_user_attr("error", f"{type(err).__name__}: {text}" if text else type(err).__name__)
        study.tell(trial, state=TrialState.FAIL)


def serve(
    cfg: Config,
    *,
    url: str,
    name: str,
    index: int = 0,
    deadline: float = 0.0,
) -> None:
    """The worker loop: until the study has ``tune.trials`` finished trials (or the deadline), ask
    for a trial, train it, tell its result. When every remaining trial is running elsewhere the
    worker waits: a trial whose worker dies is queued again and this one may take it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tune = cfg.tune
    folder = Path(cfg.run.out_dir) / name
    seed = (tune.seed if tune.seed is not None else cfg.run.seed) + index  # workers explore apart
    events = folder / "events.jsonl"

    def log(record: dict[str, Any]) -> None:
        append_jsonl(events, {**record, "time": time.time(), "event": "adaptive", "worker": index})

    study = optuna.load_study(
        study_name=name,
        storage=open_storage(url, on_stale=retry),
        sampler=make_sampler(tune, seed, log),
        pruner=make_pruner(cfg),
    )
    cache = DataCache(folder)
    base, names = cfg.model_dump(mode="json", exclude_none=True), order(tune.space)
    warm = False
    while True:
        if deadline and time.time() >= deadline:
            return
        fail_stale(study)
        finished, running = counts(study.get_trials(deepcopy=False))
        if finished >= tune.trials:
            return
        if finished + running >= tune.trials:
            time.sleep(POLL_S)
            continue
        if not warm:  # torch, the data and the plugins' modules, before the first trial's clock starts
            cache.get(cfg)
            import vatra.assembly  # noqa: F401

            warm = True
            continue  # the study may have moved on meanwhile
        with warnings.catch_warnings():  # "heartbeat is meant for optimize()": we run it ourselves
            warnings.simplefilter("ignore", UserWarning)
            trial = study.ask()
        heartbeat = _heartbeat(study, trial)
        try:
            run_trial(study, trial, cfg, base, names, folder, cache, url)
        finally:
            heartbeat.join()


def _heartbeat(study: optuna.Study, trial: optuna.Trial) -> Any:
    """optuna's heartbeat for this trial on an RDB storage (a no-op thread on a journal file):
    how other machines' workers tell this trial from a dead worker's."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    thread = get_heartbeat_thread(trial._trial_id, study._storage)
    thread.start()
    return thread


def _watch_parent(parent: int) -> None:
    """Exit when ``vatra tune`` is gone (killed with -9 included): no orphan keeps training. Its
    running trial stays RUNNING in the storage; the next ``vatra tune`` fails and retries it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="vatra-tune-parent").start()


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a distributed trial: ``vatra.fit`` with the pruner; rank 0 talks to optuna."""
    from vatra.api import fit
    from vatra.tune.pruning import TrialPruner

    cfg = load_config(args.config)
    trial = None
    if int(os.environ.get("RANK", "0")) == 0:
        import optuna

        study = optuna.load_study(
            study_name=args.study, storage=open_storage(args.storage), pruner=make_pruner(cfg)
        )
        trial = optuna.trial.Trial(study, args.trial_id)
    fit(cfg, run_dir=args.run_dir, plugins=[TrialPruner(cfg.tune.objective, trial)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vatra.tune.workers", description=__doc__)
    parser.add_argument("role", choices=["serve", "rank"])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=0.0)
    parser.add_argument("--parent", type=int, default=0)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--trial-id", type=int, default=0)
    args = parser.parse_args(argv)
    if args.role == "rank":
        try:
            rank_main(args)
        except VatraError as err:  # the launcher reports the group's first line
            RunDir(Path(args.run_dir)).write_error(int(os.environ.get("RANK", "0")), str(err), err.exit_code)
            return err.exit_code
        return 0
    try:
        if args.parent:
            _watch_parent(args.parent)
        cfg = load_config(args.config, args.overrides)
        serve(cfg, url=args.storage, name=args.study, index=args.index, deadline=args.deadline)
    except VatraError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
