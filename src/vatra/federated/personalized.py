"""Personalized FL (FedPer-style): the body is averaged, each client's head never leaves the client.

The last ``personal_layers`` parameter tensors (for the MLP: the classifier's weight and bias)
are the head. The server sends and aggregates only the body; a client combines it with its own
head, trains both, uploads the body's update and keeps the head. There is no global head, so the
server scores nothing on its own data: each client evaluates the body with its own head on its own
held-out rows, and ``global_accuracy`` is the mean of those figures weighted by validation rows (a
client that has not trained yet uses the initial head).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vatra.config import FederatedConfig
from vatra.errors import ConfigError
from vatra.federated._base import Failure, FitIns, FitRes, Strategy, weighted_mean
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

    def update_size(self) -> int:
        return self.body

    def configure_round(self, rnd: int, selected: Sequence[int]) -> dict[int, FitIns]:
        conf = {**self.fit_config(), "mu": self.cfg.mu, "personal_layers": self.cfg.personal_layers}
        return {c: FitIns(c, rnd, [self.weights[: self.body]], conf) for c in selected}

    def server_models(self) -> list[np.ndarray]:
        return []  # no global head: only clients can score a personalized model

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> dict[int, FitIns]:
        """Each client scores the shared body with its own head (its personalized model)."""
        return self.configure_round(rnd, clients)

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        if not results:
            return None
        body = self.weights[: self.body].astype(np.float64) + weighted_mean(results)
        self.weights = np.concatenate([body.astype(np.float32), self.weights[self.body :]])
        return self.weights

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {}, {"weights": self.weights}

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.weights = arrays["weights"]
