"""The exported model of a finished run, logged to its MLflow run (``monitor.mlflow_uri``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from vatra.monitor.aftercare import best_effort
from vatra.rundir import RunDir
from vatra.serve.export import export_run


def log_model(uri: str, run_id: str, run_dir: RunDir, fmt: str = "safetensors") -> bool:
    """Export the run's model (:func:`export_run`) and log the folder as the MLflow run's ``model/``
    artifacts; best effort (one warning line, an ``mlflow_model_failed`` event). True when logged."""

    def log() -> None:
        from mlflow.tracking import MlflowClient

        with tempfile.TemporaryDirectory(prefix="vatra-mlflow-") as tmp:
            folder = export_run(run_dir.path, Path(tmp) / "model", fmt)
            MlflowClient(tracking_uri=uri).log_artifacts(run_id, str(folder), artifact_path="model")

    return best_effort(
        "mlflow_model",
        log,
        run_dir.log_event,
        retry=f"; `vatra export {run_dir.path}` writes the model folder",
    )
