"""Personalized FL (FedPer-style): the body is averaged, each client's head never leaves the client.

The last ``personal_layers`` parameter tensors (for the MLP: the classifier's weight and bias)
are the head. The server sends and aggregates only the body; a client combines it with its own
head, trains both, uploads the body's update and keeps the head. There is no global head, so
clients report their accuracy on their own test distribution with their own model
(``local_accuracy``), and ``global_accuracy`` is the sample-weighted mean of those figures; a client
that has not trained yet is scored by the server with the initial head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vatra.config import FederatedConfig
from vatra.errors import ConfigError
from vatra.federated._base import Failure, FitIns, FitRes, Strategy, weighted_mean
from vatra.federated.evaluate import Evaluator
from vatra.federated.params import ParamLayout


class Personalized(Strategy):
    name = "personalized"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        super().__init__(cfg, layout)
        if cfg.personal_layers >= len(layout.names):
            raise ConfigError(
                f"federated.personal_layers: {cfg.personal_layers} leaves no shared body in a model of "
                f"{len(layout.names)} parameter tensors; use at most {len(layout.names) - 1}"
            )
        self.body = layout.size - layout.head_size(cfg.personal_layers)
        self.local_acc = np.full(cfg.clients, np.nan)  # last reported, per client

    def update_size(self) -> int:
        return self.body

    def configure_round(self, rnd: int, selected: Sequence[int]) -> dict[int, FitIns]:
        conf = {
            "local_steps": self.cfg.local_steps,
            "mu": self.cfg.mu,
            "personal_layers": self.cfg.personal_layers,
        }
        return {c: FitIns(c, rnd, [self.weights[: self.body]], conf) for c in selected}

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        for r in results:
            if "local_accuracy" in r.metrics and r.client_id >= 0:
                self.local_acc[r.client_id] = float(r.metrics["local_accuracy"])
        if not results:
            return None
        body = self.weights[: self.body].astype(np.float64) + weighted_mean(results)
        self.weights = np.concatenate([body.astype(np.float32), self.weights[self.body :]])
        return self.weights

    def evaluate(self, rnd: int, evaluator: Evaluator) -> dict[str, Any]:
        acc = self.local_acc.copy()
        unseen = np.isnan(acc)
        if unseen.any():
            fresh, _ = evaluator.client_scores([self.weights])  # body + the initial head
            acc[unseen] = fresh[unseen, 0]
        return evaluator.summarize(acc, acc)

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {}, {"weights": self.weights, "local_acc": self.local_acc}

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.weights, self.local_acc = arrays["weights"], arrays["local_acc"]
