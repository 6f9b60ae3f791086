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
    from vatra.serve.registry.mlflow_io import export_version

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
