"""``monitor.mlflow_uri``: a run's config and metrics in a real MLflow tracking store (SQLite)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import small_config

import vatra

pytest.importorskip("mlflow")


def _run(tmp_path: Path, uri: str, checkpoint: bool = True) -> vatra.FitResult:
    cfg = small_config(
        train={"steps": 12, "batch_size": 8, "eval_every": 6},
        monitor={"enabled": False, "mlflow_uri": uri, "mlflow_every_s": 0.0, "mlflow_experiment": "digits"},
        checkpoint={"enabled": checkpoint},
    )
    return vatra.fit(cfg, run_dir=tmp_path / "run")


@pytest.mark.slow(20)
def test_a_run_logs_its_config_and_metrics_to_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: MLflow puts a new experiment's artifacts in ./mlruns
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # Execute
    result = _run(tmp_path, uri)
    # Assert: params are the config, every step's loss is there, eval and summary figures too, and
    # the exported model folder is the run's artifacts
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["optim.lr"] == "0.1" and run.data.params["model.hidden"] == "[32]"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 13))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [6, 12]
    assert run.data.metrics["summary.val_accuracy"] == pytest.approx(result.summary["val_accuracy"])
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/vatra-model.json", "model/model.safetensors"} <= logged


def test_an_mlflow_failure_is_one_warning_and_the_run_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a tracking URI whose database cannot be created (its folder is a file)
    (tmp_path / "blocked").write_text("")
    # Execute
    result = _run(tmp_path, f"sqlite:///{tmp_path / 'blocked' / 'mlflow.db'}", checkpoint=False)
    # Assert
    warnings = [line for line in capsys.readouterr().out.splitlines() if "mlflow failed" in line]
    assert result.summary["steps"] == 12
    assert len(warnings) == 1 and "the run goes on without MLflow logging" in warnings[0]
