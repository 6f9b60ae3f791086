"""``vatra ckpt``: list, show, verify, roll back and prune a run's checkpoint versions."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from vatra.cli.app import app
from vatra.config import load_config
from vatra.errors import ConfigError, VatraError
from vatra.rundir import RunDir

if TYPE_CHECKING:
    from vatra.resilience import CheckpointStore

ckpt_app = typer.Typer(help="Inspect and manage a run's checkpoint store.", no_args_is_help=True)
app.add_typer(ckpt_app, name="ckpt")

RUN_DIR = typer.Argument(..., help="Run folder (runs/<run-id>).")


def _store(run_dir: Path) -> CheckpointStore:
    """The store the run's own config.toml names (its store section)."""
    from vatra.resilience import open_store  # torch: imported only by the ckpt commands

    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise ConfigError(f"{run_dir}: not a run folder (no config.toml); pass runs/<run-id>")
    return open_store(load_config(rd.config).store, rd.checkpoints)


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


@ckpt_app.command("list")
def ckpt_list(run_dir: Path = RUN_DIR) -> None:
    """Versions, oldest first, with step, parent, tags, size and metrics."""
    store = _store(run_dir)
    tags: dict[str, list[str]] = {}
    for tag, version in store.tags().items():
        tags.setdefault(version, []).append(tag)
    table = Table("version", "step", "saved (UTC)", "parent", "tags", "MB", "loss", "reason")
    for m in store.versions():
        loss = m["metrics"].get("loss")
        table.add_row(
            m["version"],
            str(m["step"]),
            _when(m["time"]),
            m.get("parent") or "-",
            ",".join(sorted(tags.get(m["version"], []))),
            f"{sum(e['size'] for e in m['files'].values()) / 1e6:.2f}",
            f"{loss:.4f}" if isinstance(loss, float) else "-",
            m.get("reason", "-"),
        )
    Console(width=160).print(table)


@ckpt_app.command("show")
def ckpt_show(run_dir: Path = RUN_DIR, version: str = typer.Argument(..., help="Version id or tag.")) -> None:
    """One version's manifest (JSON), with the tags that point at it now."""
    store = _store(run_dir)
    manifest = store.manifest(version)
    manifest["current_tags"] = sorted(t for t, v in store.tags().items() if v == manifest["version"])
    print(json.dumps(manifest, indent=2))


@ckpt_app.command("rollback")
def ckpt_rollback(
    run_dir: Path = RUN_DIR, version: str = typer.Argument(..., help="Version id or tag to return to.")
) -> None:
    """Point 'latest' at VERSION (after verifying it): the next resume starts there."""
    from vatra.resilience import LATEST

    store = _store(run_dir)
    target = store.resolve(version)
    problems = store.verify(target)
    if problems:
        raise VatraError(f"{target} is damaged, not rolling back: {problems[0]}")
    store.set_tag(LATEST, target)
    RunDir(run_dir).log_event("rollback", version=target, source="vatra ckpt rollback")
    step = store.manifest(target)["step"]
    print(f"latest → {target} (step {step}); resume with: vatra train CONFIG --run-dir {run_dir}")


@ckpt_app.command("verify")
def ckpt_verify(
    run_dir: Path = RUN_DIR,
    repair: bool = typer.Option(False, "--repair", help="Rewrite lost or corrupt erasure-coded shards."),
) -> None:
    """Check every object's sha256 (and shard checksums); exit 1 when a version is damaged."""
    store = _store(run_dir)
    if repair:
        repaired, failed = store.repair()
        for line in repaired:
            print(f"repaired: {line}")
        for line in failed:
            print(f"unrepairable: {line}")
    bad = 0
    for m in store.versions():
        problems = store.verify(m["version"])
        bad += bool(problems)
        print(f"{m['version']}: {'ok' if not problems else 'DAMAGED'}")
        for p in problems:
            print(f"  {p}")
    if bad:
        raise VatraError(f"{bad} damaged version(s) in {store.backend.describe()}")


@ckpt_app.command("gc")
def ckpt_gc(
    run_dir: Path = RUN_DIR,
    keep: int = typer.Option(..., "--keep", help="Newest versions to keep (tagged ones are always kept)."),
) -> None:
    """Delete old versions and the objects no kept version references."""
    deleted, objects = _store(run_dir).gc(keep)
    print(
        f"deleted {len(deleted)} version(s) and {objects} object(s)"
        + (f": {', '.join(deleted)}" if deleted else "")
    )
