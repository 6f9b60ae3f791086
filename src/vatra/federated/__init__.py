"""Federated learning: strategies, client selection, simulation on one machine, deployment over gRPC."""

from __future__ import annotations

from vatra.config import FederatedConfig
from vatra.errors import ConfigError
from vatra.federated._base import Failure, FitIns, FitRes, Selector, Strategy, UploadHook, weighted_mean
from vatra.federated.adaptive import AdaptiveSelector
from vatra.federated.clustered import Clustered
from vatra.federated.fedadam import FedAdam
from vatra.federated.fedavg import FedAvg
from vatra.federated.fedprox import FedProx
from vatra.federated.fedyogi import FedYogi
from vatra.federated.params import ParamLayout
from vatra.federated.personalized import Personalized
from vatra.federated.selection import AllSelector, RandomSelector

STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (FedAvg, FedProx, FedAdam, FedYogi, Clustered, Personalized)
}
SELECTORS: dict[str, type[Selector]] = {s.name: s for s in (AllSelector, RandomSelector, AdaptiveSelector)}


def build_strategy(cfg: FederatedConfig, layout: ParamLayout) -> Strategy:
    if cfg.strategy not in STRATEGIES:
        raise ConfigError(f"federated.strategy: unknown {cfg.strategy!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[cfg.strategy](cfg, layout)


def build_selector(cfg: FederatedConfig, seed: int) -> Selector:
    if cfg.selection not in SELECTORS:
        raise ConfigError(
            f"federated.selection: unknown {cfg.selection!r}; choose one of {sorted(SELECTORS)}"
        )
    return SELECTORS[cfg.selection](cfg, seed)


__all__ = [
    "SELECTORS",
    "STRATEGIES",
    "AdaptiveSelector",
    "AllSelector",
    "Clustered",
    "Failure",
    "FedAdam",
    "FedAvg",
    "FedProx",
    "FedYogi",
    "FitIns",
    "FitRes",
    "ParamLayout",
    "Personalized",
    "RandomSelector",
    "Selector",
    "Strategy",
    "UploadHook",
    "build_selector",
    "build_strategy",
    "weighted_mean",
]
