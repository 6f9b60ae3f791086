"""``vatra energy schedule``: run in the cheapest or cleanest hours of a price or intensity profile."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from vatra.cli.app import app
from vatra.config import Config, load_config
from vatra.errors import ConfigError
from vatra.rundir import new_run_id

if TYPE_CHECKING:
    from vatra.monitor.energy.profile import Profile
    from vatra.monitor.energy.schedule import Window

SET_HELP = "Override a config value: section.key=value (repeatable)."

energy_app = typer.Typer(
    rich_markup_mode=None, help="Energy and carbon: when to run a training job.", no_args_is_help=True
)
app.add_typer(energy_app, name="energy")


@energy_app.command("schedule")
def schedule(
    config: Path = typer.Argument(..., help="TOML config of the run to schedule."),
    profile: Path = typer.Option(
        ...,
        "--profile",
        help="Prices or grid intensity over time: an Electricity Maps CSV, the UK Carbon Intensity "
        "API's JSON, or a CSV of time and value (a price, or gCO2/kWh).",
    ),
    duration: str | None = typer.Option(
        None,
        "--duration",
        help="How long the run takes (90m, 2h, 1h30m, seconds); default: measured from the newest "
        "finished run of this config's run.name, scaled to train.steps.",
    ),
    deadline: str | None = typer.Option(
        None,
        "--deadline",
        help="Finish by this time (ISO 8601, UTC unless it says) or this long after the start (12h); "
        "default: the profile's end, at least a day.",
    ),
    start: str | None = typer.Option(
        None, "--start", help="Plan from this time instead of now (ISO 8601): for a past profile."
    ),
    pause_resume: bool = typer.Option(
        False,
        "--pause-resume",
        help="Run in the cheapest hours wherever they fall, pausing through a checkpoint between them, "
        "instead of in one window.",
    ),
    dry_run: bool = typer.Option(
        True,
        "--dry-run/--run",
        help="Print the plan only (default), or wait for each window and run vatra train in it.",
    ),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Pick the cheapest or cleanest window of a price or intensity profile for a run and print it,
    or wait for it and train then. Or split the run into the cheapest hours before the deadline,
    each chunk resuming from the previous one's checkpoint."""
    # imported here: vatra.monitor's package is not needed by the other commands' start-up
    from vatra.monitor.energy.profile import read_profile
    from vatra.monitor.energy.schedule import Pieces, cheapest_chunks, cheapest_window, parse_duration

    cfg = load_config(config, set_, run="train")
    prof = read_profile(profile)
    if start is not None and not dry_run:
        raise ConfigError("--start plans from another time than now; --run waits from now: drop one")
    if pause_resume and not dry_run and not cfg.checkpoint.enabled:
        raise ConfigError("--pause-resume resumes from checkpoints; set checkpoint.enabled = true")
    earliest = _time(start, "--start") if start is not None else time.time()
    run_s, how = (parse_duration(duration), "given") if duration else _measured(cfg)
    end = _deadline(deadline, earliest)
    now = Pieces(prof, earliest, earliest + run_s).window(earliest, earliest + run_s)
    one = cheapest_window(prof, run_s, earliest, end)
    chunks = cheapest_chunks(prof, run_s, earliest, end) if pause_resume else [one]
    _print_plan(prof, run_s, how, now, one, chunks, pause_resume)
    if dry_run:
        print("dry run: nothing started; --run waits for the window(s) and runs vatra train")
        return
    code = _execute(config, set_, cfg, chunks)
    if code:
        raise typer.Exit(code)


def _time(text: str, option: str) -> float:
    from vatra.monitor.energy.profile import parse_time

    try:
        return parse_time(text)
    except ValueError:
        raise ConfigError(f"{option} {text!r}: write an ISO 8601 time, e.g. 2026-12-06T22:00Z") from None


def _deadline(text: str | None, earliest: float) -> float | None:
    from vatra.monitor.energy.profile import parse_time
    from vatra.monitor.energy.schedule import parse_duration

    if text is None:
        return None
    try:
        return parse_time(text)
    except ValueError:
        return earliest + parse_duration(text)


def _measured(cfg: Config) -> tuple[float, str]:
    """The run's length from the newest finished run of the same name: its wall time per step ×
    train.steps."""
    runs = sorted(
        Path(cfg.run.out_dir).glob(f"{cfg.run.name}-*/summary.json"), key=lambda p: p.stat().st_mtime
    )
    for path in reversed(runs):
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):  # a torn or unreadable summary: try an older run
            continue
        if isinstance(summary, dict) and summary.get("steps") and summary.get("wall_s"):
            per_step = summary["wall_s"] / summary["steps"]
            return per_step * cfg.train.steps, f"measured: {path.parent}, {per_step:.3g} s a step"
    raise ConfigError(
        f"no finished run named {cfg.run.name!r} under {cfg.run.out_dir} to measure; give --duration"
    )


def _print_plan(
    prof: Profile, run_s: float, how: str, now: Window, one: Window, chunks: list[Window], split: bool
) -> None:
    from vatra.monitor.energy.schedule import plan_mean, utc

    print(f"profile: {prof.path} ({prof.unit}), {utc(prof.starts[0])} to {utc(prof.ends[-1])}")
    print(f"run: {run_s / 3600:.2f} h ({how})")
    print(f"starting now, {utc(now.start)}: mean {now.mean:.4g}")
    saved = f"{(one.mean / now.mean - 1) * 100:+.0f} %" if now.mean else "n/a"
    print(f"cheapest window: {utc(one.start)} to {utc(one.end)}, mean {one.mean:.4g} ({saved} against now)")
    if split:
        mean = plan_mean(chunks)
        vs = f"{(mean / now.mean - 1) * 100:+.0f} %" if now.mean else "n/a"
        print(f"pause-resume plan: {len(chunks)} chunks, mean {mean:.4g} ({vs} against now)")
        for i, c in enumerate(chunks, 1):
            print(f"  {i}. {utc(c.start)} to {utc(c.end)}  {c.hours:.2f} h  mean {c.mean:.4g}")


def _execute(config: Path, sets: list[str], cfg: Config, chunks: list[Window]) -> int:
    """Wait for each chunk and run ``vatra train`` in it, one run folder for all; a chunk still
    training at its end gets SIGTERM (a checkpoint, then exit) and the next chunk resumes it."""
    from vatra.monitor.energy.schedule import utc

    run_dir = Path(cfg.run.out_dir) / new_run_id(cfg.run.name)
    argv = [sys.executable, "-m", "vatra", "train", str(config), "--run-dir", str(run_dir)]
    argv += [a for s in sets for a in ("--set", s)]
    code = 0
    for i, chunk in enumerate(chunks, 1):
        if (wait := chunk.start - time.time()) > 0:
            print(f"chunk {i}/{len(chunks)}: waiting {wait / 3600:.2f} h for {utc(chunk.start)}", flush=True)
            time.sleep(wait)
        proc = subprocess.Popen(argv)
        try:
            code = proc.wait(timeout=max(0.0, chunk.end - time.time()) if i < len(chunks) else None)
            return code  # the run ended inside its chunk: finished, or failed
        except subprocess.TimeoutExpired:
            print(f"chunk {i}/{len(chunks)} over: pausing the run (SIGTERM, checkpoint)", flush=True)
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    return code
