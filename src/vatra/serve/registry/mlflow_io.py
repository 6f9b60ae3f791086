"""Move versions between the vatra registry and an MLflow model registry (the ``mlflow`` extra).

Export: one MLflow run per version holds the model folder's files under ``model/`` and the vatra
version record as ``vatra-version.json``, with the version's metrics logged; a registered model
version points at ``model/`` and carries tags (``vatra.id``, ``vatra.parent``, data table and
version, code version), and the vatra aliases that name the version are set on it. Exporting the
same version again returns the MLflow version made the first time.

Import: the model version's ``model/`` files are registered in vatra. A version that came from
vatra brings its record, so it gets back its own content id; any other gets lineage from MLflow
(the run's params as config, its metrics, the source). Its MLflow aliases are promoted in vatra.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vatra._extras import require
from vatra.serve.registry._records import ModelVersion, RegistryError, RegistryUsageError, check_model_name
from vatra.serve.registry.core import Registry

RECORD = "vatra-version.json"
EXPERIMENT = "vatra-registry"


@dataclass(frozen=True)
class MlflowVersion:
    name: str
    version: str
    run_id: str
    aliases: tuple[str, ...]


def _client(tracking_uri: str) -> Any:
    require("mlflow", "mlflow", "vatra model export-mlflow / import-mlflow")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per file otherwise
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _experiment(client: Any, name: str, artifact_location: str | None) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    return str(client.create_experiment(name, artifact_location=artifact_location))


def _exported(client: Any, name: str, version_id: str) -> Any | None:
    """The MLflow model version an earlier export of ``version_id`` made, if any."""
    for mv in client.search_model_versions(f"name='{name}'"):
        if mv.tags.get("vatra.id") == version_id:
            return mv
    return None


def export_version(
    registry: Registry,
    ref: str,
    tracking_uri: str,
    *,
    mlflow_name: str | None = None,
    experiment: str = EXPERIMENT,
    artifact_location: str | None = None,
) -> MlflowVersion:
    """Copy the version ``ref`` names into MLflow as a registered model version with vatra's tags."""
    mv = registry.get(ref)
    name = check_model_name(mlflow_name or mv.name)
    aliases = tuple(sorted(a for a, v in registry.aliases(mv.name).items() if v == mv.id))
    folder = registry.resolve(mv.ref)
    client = _client(tracking_uri)
    from mlflow.exceptions import MlflowException

    try:
        existing = _exported(client, name, mv.id) if _has_model(client, name) else None
        if existing is None:
            existing = _log(client, mv, folder, name, _experiment(client, experiment, artifact_location))
        for alias in aliases:
            client.set_registered_model_alias(name, alias, existing.version)
    except MlflowException as err:
        raise RegistryError(f"MLflow at {tracking_uri}: {err.message}") from None
    return MlflowVersion(name, str(existing.version), str(existing.run_id), aliases)


def _has_model(client: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return True
    except MlflowException:
        return False


def _log(client: Any, mv: ModelVersion, folder: Path, name: str, experiment_id: str) -> Any:
    data = mv.meta.get("data") or {}
    tags = {
        "vatra.id": mv.id,
        "vatra.name": mv.name,
        "vatra.parent": mv.parent or "",
        "vatra.run": str(mv.meta.get("run") or ""),
        "vatra.data_table": str(data.get("table") or ""),
        "vatra.data_version": "" if data.get("version") is None else str(data["version"]),
        "vatra.code_version": str(mv.meta.get("code_version") or ""),
        "vatra.registered_by": mv.user,
    }
    run = client.create_run(experiment_id, run_name=mv.ref, tags=tags)
    run_id = run.info.run_id
    for key, value in (mv.meta.get("metrics") or {}).items():
        client.log_metric(run_id, key, float(value))
    client.log_artifacts(run_id, str(folder), artifact_path="model")
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / RECORD
        record.write_text(json.dumps(mv.record(), indent=1, sort_keys=True))
        client.log_artifact(run_id, str(record))
    client.set_terminated(run_id)
    if not _has_model(client, name):
        client.create_registered_model(name, description="Versions exported from a vatra model registry.")
    return client.create_model_version(
        name, source=f"{run.info.artifact_uri}/model", run_id=run_id, tags=tags, description=mv.ref
    )


def import_version(
    registry: Registry, source: str, tracking_uri: str, *, name: str | None = None, aliases: bool = True
) -> tuple[ModelVersion, list[str]]:
    """Register ``MODEL/VERSION`` or ``MODEL@alias`` of an MLflow registry in vatra; returns the
    version and the aliases promoted."""
    model, sep, which = source.replace("@", "/@", 1).partition("/")
    if not sep or not which.strip("@"):
        raise RegistryUsageError(f"{source!r}: name an MLflow model version as MODEL/VERSION or MODEL@alias")
    client = _client(tracking_uri)
    from mlflow.exceptions import MlflowException

    try:
        if which.startswith("@"):
            found = client.get_model_version_by_alias(model, which[1:])
        else:
            found = client.get_model_version(model, which)
        with tempfile.TemporaryDirectory(prefix="vatra-import-") as tmp:
            folder, record = _download(client, found, Path(tmp))
            meta = record.get("meta") if isinstance(record.get("meta"), dict) else _lineage(client, found)
            target = check_model_name(name or str(record.get("name") or model))
            mv = registry.register(folder, target, meta)
        moved = []
        for alias in found.aliases if aliases else []:
            if registry.aliases(target).get(alias) != mv.id:
                registry.promote(
                    target, mv.id, alias, f"imported from MLflow {model}/{found.version} at {tracking_uri}"
                )
                moved.append(alias)
    except MlflowException as err:
        raise RegistryError(f"MLflow at {tracking_uri}: {err.message}") from None
    return mv, moved


def _download(client: Any, found: Any, dest: Path) -> tuple[Path, dict[str, Any]]:
    """The model files under ``dest/model`` and vatra's own record when the version came from vatra."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    folder = Path(
        mlflow.artifacts.download_artifacts(artifact_uri=found.source, dst_path=str(dest / "files"))
    )
    record: dict[str, Any] = {}
    if found.run_id:
        try:
            got = client.download_artifacts(found.run_id, RECORD, str(dest / "record"))
            record = json.loads(Path(got).read_text())
        except (MlflowException, OSError, ValueError):  # not from vatra: lineage from MLflow instead
            record = {}
    if record and record.get("version") and not _same_files(folder, record):
        raise RegistryError(
            f"MLflow {found.name}/{found.version}: its files differ from the vatra record beside them"
        )
    return folder, record


def _same_files(folder: Path, record: dict[str, Any]) -> bool:
    from vatra.resilience.store import sha256

    files = record.get("files") or {}
    present = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    return set(present) == set(files) and all(
        sha256(present[n].read_bytes()) == e.get("sha256") for n, e in files.items()
    )


def _lineage(client: Any, found: Any) -> dict[str, Any]:
    run = client.get_run(found.run_id) if found.run_id else None
    return {
        "config": dict(run.data.params) if run else {},
        "metrics": dict(run.data.metrics) if run else {},
        "mlflow": {"name": found.name, "version": str(found.version), "run_id": found.run_id or ""},
    }
