"""Byzantine-robust aggregation (median, trimmed mean, Krum) and the screening of updates before it.

FedAvg moves by the weighted mean, so one client that uploads a scaled or sign-flipped update, or
claims a huge sample count, steers the global model wherever it likes. The strategies here bound
what a minority of clients can do:

- ``median``: the coordinate-wise median of the updates; a coordinate moves outside the honest
  range only if at least half of the round's updates are poisoned.
- ``trimmed_mean``: per coordinate, drop the ⌊β·n⌋ largest and smallest values and average the rest
  (β = ``federated.robust.trim_ratio``); tolerates up to β·n poisoned updates per round.
- ``krum`` (Blanchard et al., NeurIPS 2017): score each update by the sum of squared distances to its
  n − f − 2 nearest neighbours (f = ``federated.robust.byzantine``) and take the lowest-scored one;
  multi-Krum (``krum_m`` = m > 1) averages the m lowest-scored. Needs n > 2f + 2.

All three ignore ``num_samples``: a count is a claim the server cannot verify, and weighting by it
would hand a liar the aggregate back. They need every client's own update, so they refuse secure
aggregation (which hands the server the sum only). Cost: the round's updates are stacked, n·d
float32 (a copy of the read-only views); Krum adds n(n − 1)/2 distance passes over d floats.

:func:`screen` runs before any strategy, robust or not: updates above ``max_update_norm`` are
clipped or rejected, sample counts are capped, and a count that contradicts the one the server
knows is rejected. Screening bounds a single liar's pull on FedAvg; it does not make FedAvg robust.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from vatra.errors import ConfigError
from vatra.federated._base import Failure, FitRes, Strategy

if TYPE_CHECKING:
    from vatra.config import FederatedConfig
    from vatra.config._robust import RobustConfig
    from vatra.federated.params import ParamLayout


def finite_or_none(weights: np.ndarray) -> np.ndarray | None:
    """``weights`` when every value is finite, else None (keep the previous model)."""
    return weights if bool(np.isfinite(weights).all()) else None


def screen(
    results: Sequence[FitRes], cfg: RobustConfig, known_samples: dict[int, int] | None = None
) -> tuple[list[FitRes], list[Failure]]:
    """(results to aggregate, rejected ones as failures) under ``federated.robust``'s limits.

    Results are never modified in place (their updates are read-only views of the messages): a
    clipped update or a capped count comes back as a new ``FitRes``.
    """
    kept: list[FitRes] = []
    failures: list[Failure] = []
    for r in results:
        known = (known_samples or {}).get(r.client_id)
        if known is not None and r.num_samples != known:
            failures.append(
                Failure(r.client_id, f"num_samples {r.num_samples} differs from the {known} it declared")
            )
            continue
        if cfg.max_num_samples and r.num_samples > cfg.max_num_samples:
            r = dataclasses.replace(r, num_samples=cfg.max_num_samples)
        if cfg.max_update_norm:
            norm = float(np.linalg.norm(r.update.astype(np.float64)))  # float64: 1e30 values do not overflow
            if not np.isfinite(norm):
                failures.append(Failure(r.client_id, "update norm is not finite"))
                continue
            if norm > cfg.max_update_norm:
                if cfg.norm_action == "reject":
                    limit = f"federated.robust.max_update_norm = {cfg.max_update_norm:g}"
                    failures.append(Failure(r.client_id, f"update norm {norm:.4g} exceeds {limit}"))
                    continue
                scaled = r.update.astype(np.float64) * (cfg.max_update_norm / norm)
                r = dataclasses.replace(r, update=scaled.astype(np.float32))
        kept.append(r)
    return kept, failures


class RobustStrategy(Strategy):
    """Base of the robust strategies: ``w ← w + robust_update(stacked updates)``; weights ignored."""

    name = "robust"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        super().__init__(cfg, layout)
        if cfg.secure_aggregation.enabled:
            raise ConfigError(
                f"federated.strategy = {self.name!r} needs each client's own update, but secure "
                "aggregation gives the server only their sum; turn one of them off"
            )
        self.robust = cfg.robust

    def robust_update(self, updates: np.ndarray) -> np.ndarray:
        """The round's update, float64 (d,), from the stacked client updates, float32 (n, d)."""
        raise NotImplementedError

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        if not results:
            return None
        updates = np.stack([r.update for r in results])  # (n, d): one copy of the read-only views
        with np.errstate(over="ignore"):  # a huge (unscreened) update overflows float32: keep the model
            moved = (self.weights.astype(np.float64) + self.robust_update(updates)).astype(np.float32)
        new = finite_or_none(moved)
        if new is not None:
            self.weights = new
        return new


class Median(RobustStrategy):
    """Coordinate-wise median of the updates (the mean of the middle two when n is even)."""

    name = "median"

    def robust_update(self, updates: np.ndarray) -> np.ndarray:
        return np.median(updates, axis=0).astype(np.float64)


class TrimmedMean(RobustStrategy):
    """Per coordinate: sort the n values, drop ⌊β·n⌋ from each end, average the rest in float64."""

    name = "trimmed_mean"

    def robust_update(self, updates: np.ndarray) -> np.ndarray:
        n = updates.shape[0]
        k = min(int(self.robust.trim_ratio * n), (n - 1) // 2)  # at least one value survives
        ordered = np.sort(updates, axis=0)  # (n, d), each column sorted
        return ordered[k : n - k].mean(axis=0, dtype=np.float64)


class Krum(RobustStrategy):
    """(Multi-)Krum: the update(s) closest to their n − f − 2 nearest neighbours.

    ``federated.robust.byzantine`` = 0 assumes the most Krum tolerates, f = ⌊(n − 3)/2⌋; a larger
    configured f is lowered to that for a round with fewer results. ``selected`` holds the client
    ids picked in the last round.
    """

    name = "krum"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        super().__init__(cfg, layout)
        if self.robust.krum_m > cfg.clients:
            raise ConfigError(
                f"federated.robust.krum_m = {self.robust.krum_m} exceeds federated.clients = {cfg.clients}"
            )
        self.selected: list[int] = []  # client ids Krum picked in the last round
        self._best: list[int] = []  # their positions among that round's results

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        new = super().aggregate(rnd, results, failures)
        self.selected = sorted(results[i].client_id for i in self._best) if results else []
        return new

    def scores(self, updates: np.ndarray) -> np.ndarray:
        """Krum score of each of the n updates: Σ squared distances to its n − f − 2 nearest."""
        n = updates.shape[0]
        most = max((n - 3) // 2, 0)
        f = min(self.robust.byzantine or most, most)
        neighbours = max(n - f - 2, min(n - 1, 1))
        d2 = np.zeros((n, n), dtype=np.float64)
        for i in range(n):  # one pair at a time: O(d) memory, not an (n, n, d) difference tensor
            for j in range(i + 1, n):
                diff = updates[i].astype(np.float64) - updates[j]
                d2[i, j] = d2[j, i] = float(diff @ diff)
        np.fill_diagonal(d2, np.inf)  # a point is not its own neighbour
        return np.sort(d2, axis=1)[:, :neighbours].sum(axis=1)

    def robust_update(self, updates: np.ndarray) -> np.ndarray:
        m = min(self.robust.krum_m, updates.shape[0])
        best = np.argsort(self.scores(updates), kind="stable")[:m]
        self._best = best.tolist()
        return updates[best].mean(axis=0, dtype=np.float64)
