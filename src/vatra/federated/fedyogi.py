"""FedYogi (Reddi et al., 2021): FedAdam with Yogi's additive second moment (grows slower on spikes)."""

from __future__ import annotations

import numpy as np

from vatra.federated.fedadam import FedAdam


class FedYogi(FedAdam):
    """``v ← v − (1−β₂)·Δ²·sign(v − Δ²)``: v changes by at most (1−β₂)Δ² per round."""

    name = "fedyogi"

    def second_moment(self, delta: np.ndarray) -> np.ndarray:
        sq = delta**2
        return self.v - (1 - self.cfg.server_beta2) * sq * np.sign(self.v - sq)
