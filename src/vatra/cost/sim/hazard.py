"""Interruption hazard: the world's (what draws interruptions in the simulation) and a model of it
fitted with scikit-learn's logistic regression from time of day, price and recent interruptions.

The world: a spot node in zone z is reclaimed at rate ``base * scale * (price / median_z) ** e``
per hour, ``base = -ln(1 - f) / 730`` for a monthly frequency ``f`` (Spot Advisor's bucket).
Dear hours are riskier: a rising spot price is the market telling that capacity is short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vatra.cost.sim.traces import Interruptions, PriceTrace
from vatra.errors import ConfigError

HOUR = 3600.0
RECENT_H = 6  # hours of past interruptions a prediction looks at


@dataclass
class World:
    """The interruption process the simulation draws from (per node, per second)."""

    trace: PriceTrace
    base_per_h: float
    elasticity: float = 2.0
    scale: float = 1.0

    def rate(self, zone: str, t: float) -> float:
        ratio = self.trace.price(zone, t) / self.trace.medians[zone]
        return self.base_per_h * self.scale * ratio**self.elasticity / HOUR


def monthly_frequency(info: Interruptions, instance_type: str, zones: list[str]) -> float:
    """The Spot Advisor bucket for this instance type in the trace's region (a zone without its letter)."""
    regions = {z.rstrip("abcdefghijklmnopqrstuvwxyz") for z in zones} | set(zones)
    hits = [f for (kind, region), f in info.monthly.items() if kind == instance_type and region in regions]
    if not hits:
        hits = [f for (kind, _), f in info.monthly.items() if kind == instance_type]
    if not hits:
        raise ConfigError(
            f"no interruption frequency for {instance_type}: add its Spot Advisor row to the interruptions "
            "file or set world.interruptions_per_month"
        )
    return max(hits)


def base_rate(monthly: float) -> float:
    """Per-hour hazard whose chance of at least one interruption in a month (730 h) is ``monthly``."""
    return -math.log1p(-monthly) / 730.0


def features(trace: PriceTrace, zone: str, t: float, recent: float) -> list[float]:
    """(hour-of-day sine, cosine, log price / zone median, interruptions per node in the last hours)."""
    hour = (t % 86400.0) / HOUR
    ratio = trace.price(zone, t) / trace.medians[zone]
    return [math.sin(2 * math.pi * hour / 24), math.cos(2 * math.pi * hour / 24), math.log(ratio), recent]


@dataclass
class History:
    """Hourly bins per zone: features, interruptions ``k`` among ``n`` node-hours."""

    x: np.ndarray  # (bins, 4)
    k: np.ndarray  # (bins,)
    n: np.ndarray  # (bins,)


def observe(
    trace: PriceTrace,
    start: float,
    end: float,
    nodes: int,
    world: World | None = None,
    events: list[tuple[float, str]] | None = None,
    rng: np.random.Generator | None = None,
) -> History:
    """Interruptions of ``nodes`` nodes per zone in hourly bins over [start, end): drawn from the
    world, or counted from observed events (each reclaims one node)."""
    rows, ks = [], []
    for zone in trace.zones:
        past: list[float] = []
        zone_events = np.array(sorted(t for t, z in events or [] if z == zone))
        for t in np.arange(start, end - HOUR + 1e-6, HOUR):
            recent = sum(past[-RECENT_H:]) / nodes
            if events is not None:
                k = int(np.count_nonzero((zone_events >= t) & (zone_events < t + HOUR)))
            else:
                assert world is not None and rng is not None
                p = 1.0 - math.exp(-world.rate(zone, t + HOUR / 2) * HOUR)
                k = int(rng.binomial(nodes, p))
            rows.append(features(trace, zone, float(t), recent))
            ks.append(min(k, nodes))
            past.append(min(k, nodes))
    k_arr = np.array(ks, dtype=float)
    return History(np.array(rows).reshape(-1, 4), k_arr, np.full_like(k_arr, float(nodes)))


class HazardModel:
    """Per-node probability of an interruption in the next hour, from :func:`features`."""

    def __init__(self) -> None:
        from sklearn.linear_model import LogisticRegression

        self.clf = LogisticRegression(C=10.0, max_iter=1000)
        self.constant = 0.0
        self.fitted = False

    def fit(self, h: History) -> HazardModel:
        """Each bin is two weighted rows: k interrupted node-hours and n - k that were not. A
        history without an interruption (or with nothing else) cannot be fitted: the model is then
        the constant (k + 0.5) / (n + 1), and :attr:`fitted` is False."""
        if h.n.sum() == 0:
            raise ConfigError("the hazard model has no history: raise world.history_days above 0")
        self.constant = float(h.k.sum() / h.n.sum())
        self.fitted = 0 < h.k.sum() < h.n.sum()
        if not self.fitted:
            self.constant = float((h.k.sum() + 0.5) / (h.n.sum() + 1))
            return self
        x = np.vstack([h.x, h.x])
        y = np.concatenate([np.ones(len(h.k)), np.zeros(len(h.k))])
        self.clf.fit(x, y, sample_weight=np.concatenate([h.k, h.n - h.k]))
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(x)
        if not self.fitted:
            return np.full(len(x), self.constant)
        # predict_proba's own input checks cost a millisecond a call; the simulation calls it hourly
        z = x @ self.clf.coef_[0] + self.clf.intercept_[0]
        return np.asarray(1.0 / (1.0 + np.exp(-z)))


def log_loss(p: np.ndarray, h: History) -> float:
    """Mean log-loss per node-hour of predictions ``p`` on bins ``h``."""
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-(h.k * np.log(p) + (h.n - h.k) * np.log1p(-p)).sum() / h.n.sum())


def young_daly(checkpoint_s: float, mtbf_s: float) -> float:
    """Young/Daly's checkpoint interval √(2·C·MTBF) that minimises expected lost plus saving time."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)
