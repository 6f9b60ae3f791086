"""``monitor.mlflow_uri``: a run's config, metrics and (through ``vatra.fit``) its exported model in
MLflow tracking, for teams whose experiments already live there."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from vatra._extras import check
from vatra.engine import Plugin
from vatra.monitor.aftercare import best_effort

if TYPE_CHECKING:
    from vatra.config import Config
    from vatra.engine import Trainer
    from vatra.rundir import RunDir

RUN_ID = "mlflow_run_id"  # the trainer's state.extras key: the MLflow run, for logging the model after fit
_BATCH = 100  # MLflow takes at most 100 params per log_batch call (and 1,000 metrics)
_PARAM_VALUE = 6000  # longest param value MLflow stores


def flat_params(value: object, prefix: str = "") -> dict[str, str]:
    """A config as MLflow params: dotted keys, scalars as text, lists as JSON."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flat_params(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    text = json.dumps(value) if isinstance(value, list | tuple) else str(value)
    return {prefix: text[:_PARAM_VALUE]}


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class MlflowTracker(Plugin):
    """Logs the run to MLflow tracking on rank 0: the config as params when it starts, step and
    evaluation metrics batched and sent at most every ``monitor.mlflow_every_s`` seconds (one call
    to the tracking server per batch; nothing per step but a list append), the summary's figures
    at the end. An MLflow failure never fails the run: it is one warning line (and an
    ``mlflow_failed`` event), and the tracker stops sending for the rest of the run.
    """

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.client: Any = None
        self.active = False  # rank 0, and no MLflow call has failed yet
        self.run_id = ""
        self.pending: list[Any] = []
        self.last_flush = 0.0
        self.eval_step, self.eval_logged = -1, set[str]()  # the latest evaluation already logged

    def _try(self, trainer: Trainer, fn: Any) -> None:
        if self.active and not best_effort(
            "mlflow", fn, trainer.log_event, retry="; the run goes on without MLflow logging"
        ):
            self.active = False

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.dist.is_main:
            return
        check("mlflow", "mlflow", "monitor.mlflow_uri")
        from mlflow.tracking import MlflowClient

        uri = self.cfg.monitor.mlflow_uri

        def start() -> None:
            self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # may open the store
            name = self.cfg.monitor.mlflow_experiment
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
            tags = {"vatra.run_dir": str(self.run_dir.path.resolve()), "vatra.task": str(trainer.task)}
            run = self.client.create_run(experiment, run_name=self.run_dir.path.name, tags=tags)
            self.run_id = run.info.run_id
            self._params()
            trainer.state.extras[RUN_ID] = self.run_id
            trainer.log_event("mlflow", uri=uri, run_id=self.run_id)

        self.active = True
        self._try(trainer, start)
        self.last_flush = time.monotonic()

    def _params(self) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_params(self.cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def _add(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(k, v, now, step) for k, v in numbers(metrics).items()]

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        self.last_flush = time.monotonic()
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        step = trainer.state.step
        # an evaluation in this step's record was logged by on_eval_end already: once per step
        logged = self.eval_logged if self.eval_step == step else set()
        self._add({k: v for k, v in metrics.items() if k not in logged}, step)
        if time.monotonic() - self.last_flush >= self.cfg.monitor.mlflow_every_s:
            self._try(trainer, self._flush)

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.active:
            self._add(metrics, trainer.state.step)
            self.eval_step, self.eval_logged = trainer.state.step, set(metrics)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if not self.active:
            return

        def finish() -> None:
            self._add({f"summary.{k}": v for k, v in summary.items()}, trainer.state.step)
            self._flush()
            self.client.set_terminated(self.run_id, "FINISHED")

        self._try(trainer, finish)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        def fail() -> None:
            self._flush()
            self.client.set_terminated(self.run_id, "FAILED")

        self._try(trainer, fail)
