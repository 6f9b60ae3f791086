"""``vatra ckpt``: list, show, verify, roll back and prune a run's checkpoint versions."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
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

ckpt_app = typer.Typer(
    rich_markup_mode=None, help="Inspect and manage a run's checkpoint store.", no_args_is_help=True
)
app.add_typer(ckpt_app, name="ckpt")

RUN_DIR = typer.Argument(..., help="Run folder (runs/<run-id>).")
SUB = typer.Option(
    "",
    "--sub",
    help="A store of its own inside the run's: async/server-<s> holds parameter server s's shards.",
)


def _store(run_dir: Path, sub: str = "") -> CheckpointStore:
    """The store the run's own config.toml names (its store section), or its ``sub`` folder's."""
    from vatra.resilience import open_store  # torch: imported only by the ckpt commands

    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise ConfigError(f"{run_dir}: not a run folder (no config.toml); pass runs/<run-id>")
    return open_store(load_config(rd.config).store, rd.checkpoints, sub=sub)


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


@ckpt_app.command("list")
def ckpt_list(run_dir: Path = RUN_DIR, sub: str = SUB) -> None:
    """Versions, oldest first, with step, parent, tags, size and metrics."""
    scan = _store(run_dir, sub).scan()
    tags: dict[str, list[str]] = {}
    for tag, version in scan.tags.items():
        tags.setdefault(version, []).append(tag)
    table = Table("version", "step", "saved (UTC)", "parent", "tags", "MB", "loss", "reason")
    for m in scan.manifests:
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
    if scan.problems:
        print(
            f"warning: {len(scan.problems)} manifest(s) or tag(s) cannot be read; see 'vatra ckpt verify'",
            file=sys.stderr,
        )


@ckpt_app.command("show")
def ckpt_show(
    run_dir: Path = RUN_DIR, version: str = typer.Argument(..., help="Version id or tag."), sub: str = SUB
) -> None:
    """One version's manifest (JSON), with the tags that point at it now."""
    store = _store(run_dir, sub)
    manifest = store.manifest(version)
    manifest["current_tags"] = sorted(t for t, v in store.tags().items() if v == manifest["version"])
    print(json.dumps(manifest, indent=2))


@ckpt_app.command("rollback")
def ckpt_rollback(
    run_dir: Path = RUN_DIR,
    version: str = typer.Argument(..., help="Version id or tag to return to."),
    sub: str = SUB,
) -> None:
    """Point 'latest' at VERSION (after verifying it): the next resume starts there."""
    from vatra.resilience import LATEST

    store = _store(run_dir, sub)
    with RunDir(run_dir).lock("vatra ckpt rollback"):  # a running job would move 'latest' again
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
    sub: str = SUB,
) -> None:
    """Check every manifest, tag and object (and shard checksums); exit 1 on any problem."""
    store = _store(run_dir, sub)
    if repair:
        repaired, failed = store.repair()
        for line in repaired:
            print(f"repaired: {line}")
        for line in failed:
            print(f"unrepairable: {line}")
    scan = store.scan()
    for line in scan.problems:
        print(f"UNREADABLE {line}")
    bad = 0
    for m in scan.manifests:
        problems = store.verify(m["version"])
        bad += bool(problems)
        print(f"{m['version']}: {'ok' if not problems else 'DAMAGED'}")
        for p in problems:
            print(f"  {p}")
    counts = (
        (bad, "damaged version(s)"),
        (len(scan.unreadable), "unreadable manifest(s) or tag(s)"),
        (len(scan.dangling), "tag(s) naming a missing version"),
    )
    found = [f"{n} {what}" for n, what in counts if n]
    if found:
        raise VatraError(f"{', '.join(found)} in {store.backend.describe()}")


def remove_work_leftovers(run_dir: Path) -> bool:
    """Remove ``<run>/checkpoints/.work``, the local staging of saves and restores that died.

    Only safe while no job uses the run folder (the checkpoint plugin stages its saves there):
    ``ckpt gc`` calls it under the run folder's lock.
    Returns whether there was anything to remove.
    """
    work = RunDir(run_dir).checkpoints / ".work"
    if not work.exists():
        return False
    shutil.rmtree(work)
    return True


@ckpt_app.command("gc")
def ckpt_gc(
    run_dir: Path = RUN_DIR,
    keep: int = typer.Option(..., "--keep", help="Newest versions to keep (tagged ones are always kept)."),
    sub: str = SUB,
) -> None:
    """Delete old versions, the objects no kept version references, and leftovers of dead saves.

    Deletes nothing when a manifest or tag cannot be read (see 'vatra ckpt verify').
    """
    store = _store(run_dir, sub)
    with RunDir(run_dir).lock("vatra ckpt gc"):  # a running job's staged save is no leftover
        deleted, objects = store.gc(keep)
        staged = remove_work_leftovers(run_dir)
    print(
        f"deleted {len(deleted)} version(s) and {objects} object(s)"
        + (f": {', '.join(deleted)}" if deleted else "")
        + ("; removed the staging folder checkpoints/.work" if staged else "")
    )
