"""Scoring a flat weight vector on held-out rows: the server's own data, or a client's own split.

Both sides use the task's metrics from :mod:`vatra.losses` (accuracy and loss for classification,
MSE/MAE for regression, ...), so a federated run reports what a centralised one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate

from vatra.config import Config
from vatra.data import DatasetSpec
from vatra.engine.trainer import call_model
from vatra.federated.params import ParamLayout
from vatra.losses import build_metrics, resolve_task


def batch_fetcher(dataset: Any) -> Callable[[np.ndarray], Any]:
    """A function from row indices to one batch: ``get_batch`` when it has one, else collated items."""
    fetch = getattr(dataset, "get_batch", None)
    if fetch is not None:
        return fetch
    return lambda idx: default_collate([dataset[int(j)] for j in idx])


def row_batches(dataset: Any, rows: np.ndarray, batch_size: int) -> Iterator[tuple[Any, Any]]:
    """``dataset``'s ``rows`` in order, ``batch_size`` at a time."""
    fetch = batch_fetcher(dataset)
    for i in range(0, len(rows), batch_size):
        yield fetch(rows[i : i + batch_size])


class Scorer:
    """The task's metrics of a weight vector on some rows of a dataset (one model, reused)."""

    def __init__(self, cfg: Config, model: nn.Module, spec: DatasetSpec, loss: nn.Module) -> None:
        self.cfg = cfg
        self.model = model
        self.layout = ParamLayout.of(model)
        self.spec = spec
        self.loss = loss
        self.task = resolve_task(cfg.train.task, spec)

    def metric_names(self) -> list[str]:
        """The names :meth:`score` reports (``loss``, ``mae``, ``rmse``, ``r2``, ...), known before any
        scoring: the task's metrics computed on an empty state (an unknown width counts as one class)."""
        metrics = build_metrics(self.task, self.cfg.train, self.spec, self.loss)
        for part in [metrics, *getattr(metrics, "heads", {}).values()]:
            part.num_classes = part.num_classes or 1
        return list(metrics.compute(metrics.state()))

    def score(self, vec: np.ndarray | None, dataset: Any, rows: np.ndarray) -> dict[str, float]:
        """Metrics of weights ``vec`` (None: the model as loaded) on ``dataset[rows]``."""
        return self.score_parts(vec, [(dataset, rows)])

    @torch.no_grad()
    def score_parts(self, vec: np.ndarray | None, parts: list[tuple[Any, np.ndarray]]) -> dict[str, float]:
        """Metrics of ``vec`` over several (dataset, rows) parts together ({} when there are no rows)."""
        if not sum(len(rows) for _, rows in parts):
            return {}
        if vec is not None:
            self.layout.load(self.model, vec)
        was_training = self.model.training
        self.model.eval()
        metrics = build_metrics(self.task, self.cfg.train, self.spec, self.loss)
        for dataset, rows in parts:
            for inputs, target in row_batches(dataset, rows, self.cfg.train.eval_batch_size):
                metrics.update(call_model(self.model, inputs), target)
        self.model.train(was_training)
        return {k: float(v) for k, v in metrics.compute(metrics.state()).items()}

    @torch.no_grad()
    def loss_of(self, vec: np.ndarray, dataset: Any, rows: np.ndarray) -> float:
        """Mean loss of ``vec`` on ``dataset[rows]`` (one batch: a probe)."""
        self.layout.load(self.model, vec)
        was_training = self.model.training
        self.model.eval()
        inputs, target = next(row_batches(dataset, rows, len(rows)))
        loss = float(self.loss(call_model(self.model, inputs), target))
        self.model.train(was_training)
        return loss


class ServerEvaluator:
    """The server's own held-out data (``vatra fl server --eval-data``: every row of it; a
    simulation's validation split); ``score`` gives ``server_<metric>`` of the global model.

    ``data`` is one map-style dataset, or several (a file read as train and val splits).
    """

    def __init__(self, scorer: Scorer, data: Any | None) -> None:
        self.scorer = scorer
        sets = [d for d in (data if isinstance(data, list | tuple) else [data]) if d is not None]
        self.parts = [(d, np.arange(len(d))) for d in sets]
        self.examples = sum(len(rows) for _, rows in self.parts)

    def score(self, models: list[np.ndarray]) -> dict[str, Any]:
        if not self.examples or not models:
            return {}
        out: dict[str, Any] = {
            f"server_{k}": v for k, v in self.scorer.score_parts(models[0], self.parts).items()
        }
        out["server_examples"] = self.examples
        return out
