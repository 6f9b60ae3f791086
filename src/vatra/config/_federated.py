"""The ``federated`` section: strategy, client selection, partitions, simulation and deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from vatra.config._privacy import PrivacyConfig, SecureAggregationConfig
from vatra.config._sections import Section
from vatra.registry import COMPRESSORS, IMPORT_FORM, SELECTORS, STRATEGIES

SHIFTS = ("identity", "rot90", "rot180", "rot270", "invert", "low_contrast", "flip")


def _per_tensor_compressor(value: str) -> str:
    """``federated.compression``: a compressor that works tensor by tensor (not powersgd)."""
    if value == "powersgd":
        raise ValueError(
            "powersgd is a DDP hook, not a per-tensor compressor; choose one of: "
            + ", ".join(n for n in COMPRESSORS.names() if n != "powersgd")
            + f", or {IMPORT_FORM}"
        )
    return COMPRESSORS.check(value)


class PartitionConfig(Section):
    """How the training set is split among clients (labels, inputs and sizes can all differ)."""

    method: Literal["iid", "dirichlet", "label_skew"] = Field(
        "dirichlet", description="Label split: iid, dirichlet (alpha) or label_skew (classes_per_client)."
    )
    alpha: float = Field(0.3, gt=0.0, description="dirichlet: concentration; small = strong label skew.")
    classes_per_client: int = Field(2, ge=1, description="label_skew: classes each client holds.")
    size_skew: float = Field(
        0.0, ge=0.0, description="iid: sigma of log-normal client sizes; 0 = equal sizes."
    )
    feature_shift: list[str] = Field(
        [],
        description=f"Input transform of client c: entry c mod len; [] = none. Choices: {', '.join(SHIFTS)}.",
    )

    @model_validator(mode="after")
    def _check(self) -> PartitionConfig:
        bad = [s for s in self.feature_shift if s not in SHIFTS]
        if bad:
            raise ValueError(f"unknown feature_shift {bad}; choose from {', '.join(SHIFTS)}")
        return self


class FederatedConfig(Section):
    strategy: str = Field(
        "fedavg",
        description="Aggregation strategy: fedavg, fedprox, fedadam, fedyogi, clustered, personalized, or "
        "an import string 'package.module:Class' naming a vatra.federated.Strategy subclass "
        "(called as Class(federated section, parameter layout)).",
    )
    rounds: int = Field(20, ge=1, description="Federated rounds.")
    clients: int = Field(10, ge=1, description="Number of clients (data owners).")
    clients_per_round: int = Field(0, ge=0, description="Clients trained per round; 0 = all.")
    selection: str = Field(
        "random",
        description="Client selector: random, adaptive, all, or an import string 'package.module:Class' "
        "naming a vatra.federated.Selector subclass (called as Class(federated section, seed)).",
    )
    local_steps: int = Field(10, ge=1, description="Local optimizer steps per client per round.")
    mu: float = Field(
        0.0, ge=0.0, description="Proximal weight μ (fedprox; also clustered: the hybrid clustered+proximal)."
    )
    clusters: int = Field(3, ge=1, description="clustered: number of cluster models (IFCA).")
    cluster_init_noise: float = Field(
        0.05, ge=0.0, description="clustered: relative noise that separates the cluster models at start."
    )
    personal_layers: int = Field(
        2, ge=1, description="personalized: trailing parameter tensors kept per client (the head)."
    )
    server_lr: float = Field(0.05, gt=0.0, description="fedadam/fedyogi: server learning rate.")
    server_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="fedadam/fedyogi: first-moment decay.")
    server_beta2: float = Field(0.99, ge=0.0, lt=1.0, description="fedadam/fedyogi: second-moment decay.")
    server_tau: float = Field(1e-3, gt=0.0, description="fedadam/fedyogi: adaptivity (epsilon).")
    exploration: float = Field(0.2, ge=0.0, le=1.0, description="adaptive: share of picks spent exploring.")
    preferred_time_s: float = Field(
        0.0, ge=0.0, description="adaptive: round duration beyond which slow clients are penalised; 0 = auto."
    )
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    compression: str = Field(
        "none",
        description="Client update compression with a vatra.comm compressor ([comm] ratio, levels): none, "
        "fp16, bf16, topk, randomk, onebit, qsgd, or an import string 'package.module:Class' naming a "
        "vatra.comm.Compressor subclass.",
    )
    workers: int = Field(2, ge=1, description="Simulation: client processes (a process pool).")
    step_time_s: float = Field(
        0.0,
        ge=0.0,
        description="Simulation: modelled device seconds per local step of a median client; 0 = measure.",
    )
    speed_sigma: float = Field(
        0.0, ge=0.0, description="Simulation: sigma of log-normal client slowness (heterogeneous devices)."
    )
    target_accuracy: float = Field(0.85, gt=0.0, le=1.0, description="Summary: rounds to this accuracy.")
    # deployment
    min_clients: int = Field(1, ge=1, description="Deployment: results needed for a round to count.")
    round_deadline_s: float = Field(120.0, gt=0.0, description="Deployment: seconds a round may take.")
    join_timeout_s: float = Field(120.0, gt=0.0, description="Deployment: wait this long for min_clients.")
    heartbeat_s: float = Field(2.0, gt=0.0, description="Deployment: client heartbeat period.")
    heartbeat_misses: int = Field(5, ge=1, description="Deployment: missed heartbeats before a drop-out.")
    secure_aggregation: SecureAggregationConfig = Field(default_factory=SecureAggregationConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)

    _strategy = field_validator("strategy")(lambda v: STRATEGIES.check(v))
    _selection = field_validator("selection")(lambda v: SELECTORS.check(v))
    _compression = field_validator("compression")(_per_tensor_compressor)

    @model_validator(mode="after")
    def _check(self) -> FederatedConfig:
        if self.clients_per_round > self.clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) > clients ({self.clients}); lower it"
            )
        return self
