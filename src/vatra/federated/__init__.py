"""Federated learning: strategies, client selection, simulation on one machine, deployment over gRPC."""

from __future__ import annotations

from vatra.config import FederatedConfig
from vatra.federated import _requires  # noqa: F401  (before the rest: one line without the fl extra)
from vatra.federated._base import (
    Combiner,
    EvalRes,
    Executor,
    Failure,
    FitIns,
    FitRes,
    RoundSum,
    Selector,
    StageRunner,
    Strategy,
    UploadHook,
    aggregate_client_metrics,
    weighted_mean,
)
from vatra.federated.adaptive import AdaptiveSelector
from vatra.federated.clustered import Clustered
from vatra.federated.fedadam import FedAdam
from vatra.federated.fedavg import FedAvg
from vatra.federated.fedprox import FedProx
from vatra.federated.fedyogi import FedYogi
from vatra.federated.params import ParamLayout
from vatra.federated.personalized import Personalized
from vatra.federated.selection import AllSelector, RandomSelector
from vatra.registry import SELECTORS, STRATEGIES


def build_strategy(cfg: FederatedConfig, layout: ParamLayout) -> Strategy:
    """The strategy ``federated.strategy`` names: a built-in or a user's :class:`Strategy` subclass."""
    cls: type[Strategy] = STRATEGIES.load_class(cfg.strategy, Strategy)
    return cls(cfg, layout)


def build_selector(cfg: FederatedConfig, seed: int) -> Selector:
    """The selector ``federated.selection`` names: a built-in or a user's :class:`Selector` subclass."""
    cls: type[Selector] = SELECTORS.load_class(cfg.selection, Selector)
    return cls(cfg, seed)


__all__ = [
    "AdaptiveSelector",
    "AllSelector",
    "Clustered",
    "Combiner",
    "EvalRes",
    "Executor",
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
    "RoundSum",
    "Selector",
    "StageRunner",
    "Strategy",
    "UploadHook",
    "aggregate_client_metrics",
    "build_selector",
    "build_strategy",
    "weighted_mean",
]
