"""A version's lineage, read from the run folder it was trained in and the model folder exported from it.

What goes into the hashed metadata: the run's config (config.toml as written, with the Delta
table's version pinned), the data table and version, the run's quality metrics (summary.json:
final loss, validation and test figures; timings are left out: they differ between identical
runs), the model's input/output signature and format (the export's ``vatra-model.json``), and the
code version (the git commit the export recorded, else the run folder's repository's HEAD).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.serve.registry._records import ModelVersion, RegistryUsageError

if TYPE_CHECKING:
    from vatra.serve.registry.core import Registry

MODEL_MANIFEST = "vatra-model.json"
_METRIC_PREFIXES = ("val_", "test_", "final_")


def quality_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of a summary that say how good the model is (not how fast it trained)."""
    return {
        k: v
        for k, v in summary.items()
        if k.startswith(_METRIC_PREFIXES) and isinstance(v, int | float) and not isinstance(v, bool)
    }


def git_commit(folder: Path) -> str | None:
    """HEAD of the git repository ``folder`` lies in (with ``+dirty`` for uncommitted changes); None
    outside one or without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise RegistryUsageError(f"{path}: cannot be read as JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def run_lineage(run_dir: Path, model_dir: Path | None = None) -> dict[str, Any]:
    """The metadata ``vatra model register`` hashes into a version's id."""
    config_path = run_dir / "config.toml"
    try:
        config = tomllib.loads(config_path.read_text())
    except FileNotFoundError:
        raise RegistryUsageError(
            f"{run_dir}: not a run folder (no config.toml); pass runs/<run-id>"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise RegistryUsageError(f"{config_path}: cannot be read ({err})") from None
    data = config.get("data", {})
    delta = data.get("name") == "delta"
    manifest = _read_json(model_dir / MODEL_MANIFEST) if model_dir is not None else {}
    found = manifest.get("lineage")
    lineage: dict[str, Any] = found if isinstance(found, dict) else {}
    code = lineage.get("git_commit") or lineage.get("code_version") or git_commit(run_dir)
    return {
        "run": run_dir.resolve().name,
        "config": config,
        "data": {
            "name": data.get("name"),
            "table": data.get("path") if delta else None,
            "version": data.get("version") if delta else None,
        },
        "metrics": quality_metrics(_read_json(run_dir / "summary.json")),
        "signature": manifest.get("signature") or {},
        "format": weights.get("format") if isinstance(weights := manifest.get("weights"), dict) else None,
        "code_version": code,
    }


def register_run(registry: Registry, run_dir: Path, name: str, fmt: str = "safetensors") -> ModelVersion:
    """Export the run's model (:func:`vatra.serve.export.export_run`) into a temporary folder and
    register it with the run's lineage; the same run and format register as the same version."""
    from vatra.serve.export import export_run

    run_lineage(run_dir)  # a folder that is no run fails here, in one line, before the export
    with tempfile.TemporaryDirectory(prefix="vatra-register-") as tmp:
        folder = export_run(run_dir, Path(tmp) / "model", fmt)
        return registry.register(folder, name, run_lineage(run_dir, Path(folder)))


def folder_lineage(model_dir: Path) -> dict[str, Any]:
    """The metadata of a model folder registered as it is (``vatra export``, ``vatra meta adapt
    --save``): the same fields as :func:`run_lineage`, read from its manifest's lineage (every file
    checked against its SHA-256 first), plus an adapted model's ``adaptation`` record."""
    from vatra.errors import ConfigError
    from vatra.serve.folder import read_manifest

    try:
        manifest = read_manifest(model_dir)
    except ConfigError as err:
        raise RegistryUsageError(str(err).removeprefix("vatra.load: ")) from None
    found = manifest["lineage"]
    data = found.get("data") or {}
    meta = {
        "run": Path(str(found.get("run") or model_dir)).name,
        "config": found.get("config") or {},
        "data": {"name": data.get("name"), "table": data.get("table"), "version": data.get("version")},
        "metrics": quality_metrics(found.get("metrics") or {}),
        "signature": manifest["signature"],
        "format": manifest["weights"]["format"],
        "code_version": found.get("git_commit"),
    }
    if isinstance(found.get("adaptation"), dict):
        meta["adaptation"] = found["adaptation"]
    return meta


def register_folder(registry: Registry, model_dir: Path, name: str) -> ModelVersion:
    """Register a model folder as it is, with the lineage its manifest records."""
    return registry.register(model_dir, name, folder_lineage(model_dir))
