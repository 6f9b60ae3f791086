"""FedProx (Li et al., 2020): FedAvg whose clients add μ/2·‖w − w_global‖² to their local objective."""

from __future__ import annotations

from typing import Any

from vatra.config import FederatedConfig
from vatra.errors import ConfigError
from vatra.federated.fedavg import FedAvg
from vatra.federated.params import ParamLayout


class FedProx(FedAvg):
    """Server side as FedAvg; the proximal term is applied by the client (``client.ProximalTerm``)."""

    name = "fedprox"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        if cfg.mu <= 0:
            raise ConfigError("federated.mu: fedprox needs mu > 0 (e.g. federated.mu = 0.01)")
        super().__init__(cfg, layout)

    def fit_config(self) -> dict[str, Any]:
        return {**super().fit_config(), "mu": self.cfg.mu}
