"""FedAvg (McMahan et al., 2017): the global model moves by the sample-weighted mean update."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vatra.federated._base import Failure, FitRes, Strategy, weighted_mean


class FedAvg(Strategy):
    """``w ← w + Σ nᵢ Δᵢ / Σ nᵢ`` over the clients that returned; a round without results keeps ``w``."""

    name = "fedavg"

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        if not results:
            return None
        self.weights = (self.weights.astype(np.float64) + weighted_mean(results)).astype(np.float32)
        return self.weights
