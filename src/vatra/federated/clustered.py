"""Clustered FL (IFCA, Ghosh et al., 2020) plus a size- and quality-weighted global model.

Every round each selected client receives all K cluster models, scores them on its own data and
trains the one with the lowest loss (``FitRes.metrics["model"]``); each cluster model moves by the
sample-weighted mean update of its members. With ``federated.mu > 0`` the clients also add the
proximal term towards the cluster model they picked: the hybrid clustered + proximal approach.

The global model integrates the clusters: ``w = Σₖ aₖ wₖ`` with ``aₖ ∝ nₖ · qₖ``, where ``nₖ`` is
the samples the cluster's members last trained on and ``qₖ = 1 / (1 + ℓₖ)`` a data-quality score
from the members' sample-weighted loss after training (clusters whose data fit well count more).
The clusters start as one shared initialisation plus small independent noise
(``cluster_init_noise`` × the weights' standard deviation) so their average stays meaningful.

A client's cluster choice and loss are checked before they are used (:meth:`Clustered.check_result`,
:meth:`Clustered.check_eval`): ``model`` must name one of the K clusters and ``loss_after`` (sent
when K > 1) must lie in [0, float32's largest], so qₖ stays in (0, 1]; the server drops a client
whose report does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vatra.config import FederatedConfig
from vatra.federated._base import (
    MAX_REPORTED,
    EvalRes,
    Failure,
    FitIns,
    FitRes,
    Strategy,
    check_range,
    weighted_mean,
)
from vatra.federated.params import ParamLayout


class Clustered(Strategy):
    name = "clustered"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        super().__init__(cfg, layout)
        k = cfg.clusters
        self.clusters = np.zeros((k, layout.size), dtype=np.float32)  # (K, P)
        self.samples = np.zeros(k)  # nₖ
        self.quality = np.ones(k)  # qₖ

    def initialize(self, weights: np.ndarray, seed: int) -> None:
        scale = self.cfg.cluster_init_noise * float(np.std(weights))
        for k in range(self.cfg.clusters):
            noise = np.random.default_rng([seed, 3, k]).standard_normal(weights.shape)
            self.clusters[k] = weights + scale * noise
        self.weights = self._integrate()

    def _integrate(self) -> np.ndarray:
        a = self.samples * self.quality
        a = a / a.sum() if a.sum() > 0 else np.full(len(a), 1.0 / len(a))
        return (a @ self.clusters.astype(np.float64)).astype(np.float32)

    def fit_config(self) -> dict[str, Any]:
        return {**super().fit_config(), "mu": self.cfg.mu}

    def configure_round(self, rnd: int, selected: Sequence[int]) -> dict[int, FitIns]:
        models = list(self.clusters)
        return {c: FitIns(c, rnd, models, self.fit_config()) for c in selected}

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        if not results:
            return None
        for k in range(self.cfg.clusters):
            members = [r for r in results if int(r.metrics["model"]) == k]
            if not members:
                continue
            n = np.array([r.num_samples for r in members], dtype=np.float64)
            loss = np.array([float(r.metrics.get("loss_after", 0.0)) for r in members])  # K = 1: none
            self.clusters[k] = (self.clusters[k].astype(np.float64) + weighted_mean(members)).astype(
                np.float32
            )
            self.samples[k] = n.sum()
            self.quality[k] = 1.0 / (1.0 + float(n @ loss / n.sum()))
        self.weights = self._integrate()
        return self.weights

    def _check_model(self, metrics: dict[str, Any], required: bool) -> str | None:
        """``model``: the index of one of the K cluster models (an int: ``1.0`` is not one)."""
        if "model" in metrics and type(metrics["model"]) is not int:
            return f"metric 'model' = {metrics['model']!r} is not an integer"
        return check_range(metrics, "model", 0, self.cfg.clusters - 1, required=required)

    def check_result(self, res: FitRes) -> str | None:
        """The cluster the client trained and, with several to choose from, its loss after training."""
        return self._check_model(res.metrics, True) or check_range(
            res.metrics, "loss_after", 0.0, MAX_REPORTED, required=self.cfg.clusters > 1
        )

    def check_eval(self, rep: EvalRes) -> str | None:
        """The cluster model the client scored, when it says (one of the K)."""
        return self._check_model(rep.metrics, False)

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> dict[int, FitIns]:
        """Clients score the cluster model with the lowest loss on their data (as in training)."""
        return self.configure_round(rnd, clients)

    def aggregate_evaluate(self, rnd: int, results: Sequence[EvalRes]) -> dict[str, Any]:
        out = super().aggregate_evaluate(rnd, results)
        picks = [int(r.metrics["model"]) for r in results if "model" in r.metrics]
        out["cluster_sizes"] = np.bincount(picks, minlength=self.cfg.clusters).tolist()
        return out

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        arrays = {"weights": self.weights, "clusters": self.clusters, "samples": self.samples}
        return {}, {**arrays, "quality": self.quality}

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.weights, self.clusters = arrays["weights"], arrays["clusters"]
        self.samples, self.quality = arrays["samples"], arrays["quality"]
