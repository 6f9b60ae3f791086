"""FedAdam (Reddi et al., 2021): the mean client update is a pseudo-gradient for a server-side Adam."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vatra.config import FederatedConfig
from vatra.federated._base import Failure, FitRes, Strategy, weighted_mean
from vatra.federated.params import ParamLayout


class FedAdam(Strategy):
    """``m ← β₁m + (1−β₁)Δ``, ``v`` by :meth:`second_moment`, ``w ← w + η·m / (√v + τ)``.

    Δ is the sample-weighted mean update (the negative pseudo-gradient). No bias correction, as in
    the paper; ``server_tau`` bounds the step where ``v`` is tiny.
    """

    name = "fedadam"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        super().__init__(cfg, layout)
        self.m = np.zeros(layout.size, dtype=np.float64)
        self.v = np.zeros(layout.size, dtype=np.float64)

    def second_moment(self, delta: np.ndarray) -> np.ndarray:
        b2 = self.cfg.server_beta2
        return b2 * self.v + (1 - b2) * delta**2

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        if not results:
            return None
        delta = weighted_mean(results)
        self.m = self.cfg.server_beta1 * self.m + (1 - self.cfg.server_beta1) * delta
        self.v = self.second_moment(delta)
        step = self.cfg.server_lr * self.m / (np.sqrt(self.v) + self.cfg.server_tau)
        self.weights = (self.weights.astype(np.float64) + step).astype(np.float32)
        return self.weights

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {}, {"weights": self.weights, "m": self.m, "v": self.v}

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.weights, self.m, self.v = arrays["weights"], arrays["m"], arrays["v"]
