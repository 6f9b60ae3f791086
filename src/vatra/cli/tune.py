"""``vatra tune CONFIG`` (a study of runs on optuna), ``vatra tune show STUDY``, ``vatra tune best STUDY``."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from vatra.cli.app import app
from vatra.cli.train import SET_HELP
from vatra.config import Config, config_from_dict, dump_toml, load_config
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import optuna


def trial_overrides(path: Path) -> list[str]:
    """What every trial's config gets on top of the base: no display, TensorBoard or report, and no
    monitor, healing or checkpoints unless the file turns them on itself (each costs a trial time)."""
    raw = tomllib.loads(path.read_text(encoding="utf-8"))

    def said_on(section: str) -> bool:
        table = raw.get(section)
        return isinstance(table, dict) and table.get("enabled") is True

    out = ["run.progress=off", "run.tensorboard=false", "monitor.report=false"]
    if not said_on("monitor"):
        out += ["monitor.enabled=false", "heal.enabled=false"]
    if not said_on("checkpoint"):
        out.append("checkpoint.enabled=false")
    return out


class Progress:
    """Trials finished out of ``tune.trials``: a rich bar on a terminal, else one line per trial.

    The count on each line goes up by one per finished trial, so no number is shown twice: trials
    a resumed study finished before are counted once, up front, and a trial whose worker stopped
    (it is retried under a new number) is shown without a count."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.seen: set[int] | None = None  # trial numbers shown (or finished before this command)
        self.done = 0  # finished trials counted so far
        self.bar: Any = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.description}"),
            )  # fmt: skip
            self.task = self.bar.add_task("", total=cfg.tune.trials)
            self.bar.start()

    def __call__(self, study: optuna.Study, final: bool) -> None:
        from optuna.trial import TrialState

        from vatra.tune.study import counts

        trials = study.get_trials(deepcopy=False)
        finished, running = counts(trials)
        if self.seen is None:  # the first look: what a resumed study had finished already
            before = [t for t in trials if t.state not in (TrialState.RUNNING, TrialState.WAITING)]
            self.seen, self.done = {t.number for t in before}, counts(before)[0]
            if before and self.bar is None:
                print(
                    f"vatra tune: resuming: {self.done} of {self.cfg.tune.trials} trials finished before",
                    flush=True,
                )
        best = _best(study)
        tail = f" · best {self.cfg.tune.objective} {best:.4g}" if best is not None else ""
        if self.bar is not None:
            done = min(finished, self.cfg.tune.trials)
            self.bar.update(self.task, completed=done, description=f"running {running}{tail}")
            if final:
                self.bar.stop()
            return
        for t in trials:
            if t.number in self.seen or t.state in (TrialState.RUNNING, TrialState.WAITING):
                continue
            self.seen.add(t.number)
            if t.state == TrialState.FAIL and "error" not in t.user_attrs:  # counts(): not finished
                print(f"vatra tune: trial {t.number} stopped with its worker; retried", flush=True)
                continue
            self.done += 1
            what = f"{t.value:.4g}" if t.value is not None else t.user_attrs.get("error", "")
            count = f"[{self.done}/{self.cfg.tune.trials}]"
            print(f"vatra tune: trial {t.number} {t.state.name.lower()} {what} {count}{tail}", flush=True)


def _best(study: optuna.Study) -> float | None:
    try:
        return float(study.best_value)
    except ValueError:  # no complete trial yet
        return None


@app.command()
def tune(
    target: str = typer.Argument(
        ..., help="A TOML config with a [tune] section; or 'show' / 'best' followed by a study."
    ),
    study: str | None = typer.Argument(None, help="show/best: the study folder (runs/<study>) or its name."),
    workers: int | None = typer.Option(None, "--workers", help="Trial worker processes here (tune.workers)."),
    storage: str | None = typer.Option(
        None,
        "--storage",
        help="'' = journal file in the study folder, or postgresql://user@host:port/db (password: "
        "PGPASSWORD or ~/.pgpass).",
    ),
    join: str | None = typer.Option(None, "--join", help="Join this existing study (on --storage)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    config_out: Path | None = typer.Option(None, "--config-out", help="best: write the best config here."),
    top: int = typer.Option(10, "--top", help="show: how many trials."),
) -> None:
    """Search hyper-parameters: each trial is a run of the config with the [tune.space] values set.

    vatra tune CONFIG [--workers W] [--storage URL] runs (or resumes) the study; vatra tune CONFIG
    --join STUDY --storage URL adds this machine's workers to it; vatra tune show STUDY prints the
    best trials; vatra tune best STUDY --config-out best.toml writes a config vatra train runs.
    """
    if target in ("show", "best"):
        if study is None:
            raise ConfigError(f"vatra tune {target} STUDY: name the study (runs/<study> or its name)")
        (_show if target == "show" else _write_best)(study, top, config_out)
        return
    if study is not None:
        raise ConfigError(f"vatra tune {target} {study}: one config only (or: vatra tune show|best STUDY)")
    _run(Path(target), workers, storage, join, set_)


def _run(path: Path, workers: int | None, storage: str | None, join: str | None, set_: list[str]) -> None:
    cfg = load_config(path, set_)
    updates: dict[str, Any] = {}
    if workers is not None:
        if workers < 1:
            raise ConfigError(f"--workers {workers}: must be ≥ 1 (trial worker processes on this machine)")
        updates["workers"] = workers
    if storage is not None:
        updates["storage"] = storage
    if join is not None:
        updates["study"] = join
    cfg = cfg.model_copy(update={"tune": cfg.tune.model_copy(update=updates)})
    from vatra.tune.space import check_space
    from vatra.tune.study import Study, make_pruner, make_sampler

    check_space(cfg, cfg.model_dump(mode="json", exclude_none=True, exclude={"tune"}))
    make_pruner(cfg)  # its usage errors before any worker starts
    make_sampler(cfg.tune, 0)
    run = Study(cfg, cfg.tune.workers, join=join is not None)
    if run.password is not None:
        print(
            "vatra: the password in tune.storage is kept out of the study's files and the workers' "
            "command lines (they get it as PGPASSWORD); set PGPASSWORD or use ~/.pgpass to keep it "
            "out of your config and command line too",
            file=sys.stderr,
            flush=True,
        )
    print(f"vatra: study {run.name} in {run.folder} ({cfg.tune.workers} worker(s))", flush=True)
    from vatra.tune.study import StudyStopped

    try:
        result = run.run(trial_overrides(path), Progress(cfg))
    except StudyStopped as stop:  # Ctrl-C: what is done is kept in the study
        print(
            f"vatra tune: stopped after {stop.finished} of {cfg.tune.trials} trials; the same command "
            f"resumes study {run.name} ({run.folder})",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(130) from None
    if cfg.monitor.report:  # the study's report.html; the trials write none (a trial's time)
        _report(run.folder)
    best = _best(result)
    if best is not None:
        print(f"vatra: best {cfg.tune.objective} {best:.4g}: {result.best_params}", flush=True)


def _report(folder: Path) -> None:
    from vatra._extras import MissingExtra

    try:
        from vatra.tune.report import write_report

        print(f"vatra: report {write_report(folder)}", flush=True)
    except MissingExtra as err:
        print(f"vatra: no report.html: {err}", flush=True)


def _show(given: str, top: int, _out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from vatra.tune.report import find_study, ranked, state_counts

    folder, data = find_study(given)
    rows = ranked(data)[:top]
    names = sorted({k for t in rows for k in t["params"]})
    table = Table(
        title=f"study {data['study']}: best {len(rows)} by {data['objective']} ({data['direction']})"
    )
    header = ["trial", data["objective"], "time (s)", *names]
    body = [
        [str(t["number"]), f"{t['value']:.4g}", f"{t['duration_s'] or 0:.1f}"]
        + [_cell(t["params"].get(n)) for n in names]
        for t in rows
    ]
    for col in header:
        table.add_column(col)
    for cells in body:
        table.add_row(*cells)
    console = Console()
    # wide enough for every column whole (a narrow terminal or a pipe would cut values to "0.9…")
    widths = [max(len(c) for c in column) for column in zip(header, *body, strict=True)]
    console.width = max(console.width, sum(widths) + 3 * len(widths) + 1)
    console.print(table)
    console.print(", ".join(f"{v} {k.lower()}" for k, v in state_counts(data).items()) + f" · {folder}")


def _cell(v: Any) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _write_best(given: str, _top: int, out: Path | None) -> None:
    from vatra.tune.report import find_study, ranked
    from vatra.tune.space import apply

    if out is None:
        raise ConfigError("vatra tune best STUDY: pass --config-out best.toml (where to write the config)")
    folder, data = find_study(given)
    best = ranked(data)
    if not best:
        raise ConfigError(f"study {data['study']}: no complete trial yet, so no best config")
    base = load_config(folder / "config.toml")
    raw = apply(base.model_dump(mode="json", exclude_none=True, exclude={"tune"}), best[0]["params"])
    if base.tune.epochs:  # the trial's steps came from its batch size: train as long as it did
        ran = _trial_config(best[0])
        raw["train"] |= {"steps": ran.train.steps, "eval_every": ran.train.eval_every}
    threads = best[0].get("threads")
    head = f"# trial {best[0]['number']} of study {data['study']}: {data['objective']} {best[0]['value']:.6g}"
    if threads:  # float sums depend on the thread count: the same count repeats the trial exactly
        head += f"\n# trained with {threads} torch thread(s): OMP_NUM_THREADS={threads} vatra train {out}"
    out.write_text(head + "\n" + dump_toml(config_from_dict(raw)))
    print(
        f"vatra: trial {best[0]['number']} ({data['objective']} {best[0]['value']:.4g}) → {out}", flush=True
    )


def _trial_config(trial: dict[str, Any]) -> Config:
    """The config a trial ran (its run folder's config.toml)."""
    path = Path(trial.get("run_dir") or "") / "config.toml"
    if not trial.get("run_dir") or not path.is_file():
        raise ConfigError(
            f"trial {trial['number']}: its run folder has no config.toml ({path}), so the steps it "
            "trained under tune.epochs are unknown; copy the study folder whole, trials included"
        )
    return load_config(path)
