"""Versions to and from a real MLflow registry (a local SQLite store)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import vatra_in_process
from tests.test_serve_registry import META, digests, model_folder

from vatra.serve.registry import Registry

pytest.importorskip("mlflow")


@pytest.mark.slow(20)
def test_mlflow_round_trip_keeps_the_id_files_and_alias(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Prepare: a version promoted to champion in one registry
    from vatra.serve.registry.mlflow_io import export_version, import_version

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = Registry(tmp_path / "a", cache_dir=tmp_path / "cache")
    mv = first.register(model_folder(tmp_path, b"\x03" * 4096), "churn", META)
    first.promote("churn", mv.id, "champion", "best so far")
    # Execute: export it (twice: the second finds the first), import into an empty registry
    out = export_version(first, "churn@champion", uri, artifact_location=str(tmp_path / "artifacts"))
    again = export_version(first, f"churn@{mv.short}", uri, artifact_location=str(tmp_path / "artifacts"))
    code, said, _ = vatra_in_process(
        capsys,
        "model",
        "import-mlflow",
        "churn@champion",
        "--tracking-uri",
        uri,
        "--registry",
        str(tmp_path / "b"),
    )
    second = Registry(tmp_path / "b", cache_dir=tmp_path / "cache")
    # Assert: MLflow holds one version with vatra's tags and alias; vatra gets the same id and bytes
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("churn", "champion")
    assert (out.version, again.version, str(version.version)) == ("1", "1", "1")
    assert version.tags["vatra.id"] == mv.id and version.tags["vatra.data_version"] == "3"
    assert client.get_run(out.run_id).data.metrics == {"val_accuracy": 0.9}
    assert code == 0 and f"registered churn@{mv.short} (id {mv.id}); aliases champion" in said
    assert second.aliases("churn") == {"champion": mv.id}
    assert second.history("churn")[0].reason.startswith("imported from MLflow churn/1")
    assert digests(second.resolve("churn@champion")) == digests(tmp_path / "m")
    # A version made in MLflow (not from vatra): its files, with the run's params and metrics as lineage
    run = client.create_run(client.get_experiment_by_name("vatra-registry").experiment_id)
    client.log_param(run.info.run_id, "lr", "0.01")
    client.log_metric(run.info.run_id, "auc", 0.7)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "w.bin").write_bytes(b"\x09" * 32)
    client.log_artifacts(run.info.run_id, str(tmp_path / "theirs"), artifact_path="model")
    client.create_registered_model("theirs")
    client.create_model_version("theirs", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    theirs, moved = import_version(second, "theirs/1", uri, name="imported")
    assert moved == [] and digests(second.resolve("imported")) == {
        "w.bin": digests(tmp_path / "theirs")["w.bin"]
    }
    assert theirs.meta["config"] == {"lr": "0.01"} and theirs.meta["metrics"] == {"auc": 0.7}
    assert theirs.meta["mlflow"] == {"name": "theirs", "version": "1", "run_id": run.info.run_id}
