"""The ``federated`` section: strategy, client selection, partitions, simulation and deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from vatra.config._edgesync import EdgeSyncConfig
from vatra.config._privacy import PrivacyConfig, SecureAggregationConfig
from vatra.config._robust import RobustConfig
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

    method: Literal["iid", "dirichlet", "label_skew", "column", "file"] = Field(
        "dirichlet",
        description="Simulation split of the training rows: iid, dirichlet (alpha), label_skew "
        "(classes_per_client), column (one client per value of a table column: natural owners) or "
        "file (a JSON list of per-client row-index lists, reproduced exactly).",
    )
    column: str = Field(
        "", description="column: the table column whose values name the owners (e.g. a site id)."
    )
    file: str = Field(
        "",
        description="file: JSON list with one list of training-row indices per client (every run "
        "folder's partition.json has this form); relative paths are from the config file's folder.",
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
        if self.method == "column" and not self.column:
            raise ValueError("method = 'column' needs column = the table column that names each owner")
        if self.method == "file" and not self.file:
            raise ValueError("method = 'file' needs file = a JSON list of per-client row-index lists")
        return self


class FederatedConfig(Section):
    strategy: str = Field(
        "fedavg",
        description="Aggregation strategy: fedavg, fedprox, fedadam, fedyogi, clustered, personalized, "
        "perfedavg (federated meta-learning), or "
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
    inner_lr: float = Field(
        0.0,
        ge=0.0,
        description="perfedavg: α, the LR of the personalisation step on one batch inside each local "
        "step, and of the step a client takes on its own rows before it is scored.",
    )
    local_epochs: int = Field(
        0,
        ge=0,
        description="Local epochs per round instead of local_steps (FedAvg's E): each client makes "
        "ceil(n_c / batch_size) steps per epoch on its n_c training rows, so larger owners do more "
        "work; 0 = use local_steps.",
    )
    val_fraction: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Simulation: share of each client's rows it holds out to evaluate on (its own "
        "validation split); 0 = clients hold out nothing and only the server evaluates.",
    )
    evaluate_every: int = Field(
        1,
        ge=0,
        description="Clients evaluate the global model every this many rounds (and after the last); "
        "0 = never.",
    )
    evaluate_clients: int | float = Field(
        100,
        gt=0,
        description="Clients asked to evaluate on an evaluation round, drawn uniformly (seeded) from the "
        "available ones: a count (an integer; all when fewer are available) or a fraction in (0, 1] "
        "(at least one), as Flower's min_evaluate_clients / fraction_evaluate.",
    )
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
    client_data: str = Field(
        "",
        description="Simulation: each client's rows from its own source instead of a partition of "
        "[data], read only when it is selected: an import string 'package.module:fn' called as fn(cid) "
        "returning its (train, val) datasets, or a folder of one data file per owner (client c = the "
        "c-th file by name). [data] still gives the input spec and the server's held-out data.",
    )
    compression: str = Field(
        "none",
        description="Client update compression with a vatra.comm compressor ([comm] ratio, levels): none, "
        "fp16, bf16, int8 (per-row scales), topk, randomk, onebit, qsgd, or an import string "
        "'package.module:Class' naming a vatra.comm.Compressor subclass.",
    )
    workers: int = Field(
        1,
        ge=1,
        description="Simulation: client processes; 1 = every client in the server process (fastest for "
        "small models: a pool pays only when a client's round costs far more than passing it the model).",
    )
    backend: Literal["inprocess", "ray"] = Field(
        "inprocess",
        description="Simulation: where a round's clients run: inprocess (this process, or a pool of "
        "`workers` processes) or ray (one actor per worker on a Ray cluster, one per CPU of the "
        "cluster when workers = 1; needs vatra[ray]). A seed gives the same results on either.",
    )
    ray_address: str = Field(
        "",
        description="backend = ray: the cluster to join ('auto', or the head's host:port from "
        "`ray start --head`); empty = start a local Ray for this run and stop it after.",
    )
    step_time_s: float = Field(
        0.0,
        ge=0.0,
        description="Simulation: modelled device seconds per local step of a median client; 0 = measure.",
    )
    speed_sigma: float = Field(
        0.0, ge=0.0, description="Simulation: sigma of log-normal client slowness (heterogeneous devices)."
    )
    target_accuracy: float = Field(
        0.85, gt=0.0, le=1.0, description="Summary: rounds_to_target's threshold when target_value is unset."
    )
    target_metric: str = Field(
        "auto",
        min_length=1,
        description="Summary: the metric rounds_to_target watches (global_<metric>): auto = the task's main "
        "metric (accuracy, ndcg@k, r2, perplexity, else loss), or any the task reports (rmse, mae, macro_f1, "
        "<head>_accuracy, ...); loss, perplexity, mae and rmse count as reached at or below the threshold.",
    )
    target_value: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Summary: rounds_to_target's threshold for target_metric; unset = target_accuracy.",
    )
    # deployment
    min_clients: int = Field(1, ge=1, description="Deployment: results needed for a round to count.")
    round_deadline_s: float = Field(120.0, gt=0.0, description="Deployment: seconds a round may take.")
    join_timeout_s: float = Field(120.0, gt=0.0, description="Deployment: wait this long for min_clients.")
    heartbeat_s: float = Field(2.0, gt=0.0, description="Deployment: client heartbeat period.")
    heartbeat_misses: int = Field(5, ge=1, description="Deployment: missed heartbeats before a drop-out.")
    max_message_mb: float = Field(
        64.0,
        gt=0.0,
        description="Deployment: gRPC message cap while the server does not know the model's size "
        "(no --eval-data file: the first client's join tells it); with it, about twice the model.",
    )
    secure_aggregation: SecureAggregationConfig = Field(default_factory=SecureAggregationConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    robust: RobustConfig = Field(default_factory=RobustConfig)
    edge: EdgeSyncConfig = Field(default_factory=EdgeSyncConfig)

    _strategy = field_validator("strategy")(lambda v: STRATEGIES.check(v))
    _selection = field_validator("selection")(lambda v: SELECTORS.check(v))
    _compression = field_validator("compression")(_per_tensor_compressor)

    @model_validator(mode="after")
    def _check(self) -> FederatedConfig:
        if isinstance(self.evaluate_clients, float) and self.evaluate_clients > 1:
            raise ValueError(
                f"evaluate_clients = {self.evaluate_clients}: a fraction must lie in (0, 1]; "
                "give a count as an integer (e.g. 100)"
            )
        if self.clients_per_round > self.clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) > clients ({self.clients}); lower it"
            )
        if self.edge.error_feedback and (self.workers > 1 or self.backend == "ray"):
            pool = "backend = 'ray'" if self.backend == "ray" else f"workers = {self.workers}"
            raise ValueError(
                "federated.edge.error_feedback keeps each client's residual in the process that trains "
                f"it, but {pool} runs a client in any of several; set workers = 1 (backend = 'inprocess')"
            )
        sa = self.secure_aggregation
        if sa.enabled:  # a threshold that is no majority, or a ring too small, fails here, not in round 1
            n = self.clients_per_round or self.clients
            sa.threshold_for(sa.holders_for(n))
            sa.check_ring(n, weighted=self.privacy.mode != "client")
        return self
