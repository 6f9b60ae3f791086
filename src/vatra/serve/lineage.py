"""Where a model comes from: its run, config, data (a Delta table's pinned version), metrics,
checkpoint version and code version."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from vatra.config import Config
from vatra.rundir import RunDir


def git_commit(folders: list[str]) -> str | None:
    """The commit checked out in the first of ``folders`` inside a git work tree (the run's import
    paths: where its model code lives), else of the current folder; None without git or a repository.
    The run does not record one, so this is the code at load or export time."""
    for folder in [*folders, "."]:
        try:
            out = subprocess.run(
                ["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def final_metrics(run_dir: Path) -> dict[str, Any]:
    """The run's summary (final loss and validation metrics), or {} when it did not finish."""
    try:
        summary = json.loads(RunDir(run_dir).summary.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in summary.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}


def lineage(run_dir: Path, cfg: Config, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The lineage record of a model loaded from ``run_dir``'s checkpoint ``checkpoint``."""
    data = cfg.data
    source: dict[str, Any] = {"name": data.name, "path": data.path or None}
    if data.name == "delta":
        source.update(table=data.path, version=data.version)
    return {
        "run": str(run_dir.resolve()),
        "config": cfg.model_dump(mode="json"),
        "data": source,
        "metrics": final_metrics(run_dir),
        "checkpoint": checkpoint,
        "git_commit": git_commit(list(cfg.run.import_paths)),
    }
