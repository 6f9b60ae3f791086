"""The records of an A/B analysis: how it is judged (:class:`ABConfig`), the test at one moment
(:class:`Evidence`), a guardrail, the decision and the whole result."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from vatra.errors import ConfigError
from vatra.serve.ab.sequential import Metric, SequentialStats

Action = Literal["promote", "rollback", "stop", "continue"]


@dataclass(frozen=True)
class ABConfig:
    """How the experiment is judged.

    ``metric``: ``binary`` (outcome values 0/1, a conversion rate) or ``continuous``.
    ``alpha``: the error rate of every sequential test (primary and each guardrail).
    ``mde``: the minimum effect of interest on the metric's scale (challenger - champion, in the
    better direction); when set, the experiment stops for futility once the confidence sequence
    rules out an improvement that large. ``horizon``: the total outcomes expected; the confidence
    sequence is tightest there. ``min_n``: outcomes (or requests) per arm before any rule fires.
    ``higher_is_better``: the direction of the primary metric. ``champion``/``challenger``: the
    variant names in the log (the challenger defaults to the one other variant).
    ``error_margin``: how much higher the challenger's error rate may be before the guardrail trips.
    ``latency_ms``: the latency guardrail's line; default the champion's p95 over its first
    ``latency_burn_in`` requests, which are then left out of the test."""

    metric: Metric = "binary"
    alpha: float = 0.05
    mde: float | None = None
    horizon: int = 5000
    min_n: int = 100
    higher_is_better: bool = True
    champion: str = "champion"
    challenger: str | None = None
    error_margin: float = 0.0
    latency_ms: float | None = None
    latency_burn_in: int = 200

    def __post_init__(self) -> None:
        if self.metric not in ("binary", "continuous"):
            raise ConfigError(f"metric must be binary or continuous, got {self.metric!r}")
        if not 0.0 < self.alpha < 0.5:
            raise ConfigError(f"alpha must be in (0, 0.5), got {self.alpha}: 0.05 is usual")
        if self.mde is not None and not self.mde > 0:
            raise ConfigError(f"mde must be > 0 (an improvement on the metric's scale), got {self.mde}")
        if self.horizon < 1 or self.min_n < 2:
            raise ConfigError(f"horizon must be >= 1 and min_n >= 2, got {self.horizon}, {self.min_n}")
        if self.error_margin < 0 or (self.latency_ms is not None and not self.latency_ms > 0):
            raise ConfigError("error_margin must be >= 0 and latency_ms > 0")
        if self.latency_burn_in < 1:
            raise ConfigError(f"latency_burn_in must be >= 1, got {self.latency_burn_in}")


@dataclass(frozen=True)
class Evidence:
    """The test at one moment: outcomes per arm, each arm's mean, the effect (challenger -
    champion), its confidence sequence and the always-valid p-value."""

    t: float
    n_champion: int
    n_challenger: int
    mean_champion: float
    mean_challenger: float
    effect: float
    lo: float
    hi: float
    p: float


@dataclass(frozen=True)
class Guardrail:
    """One guardrail: the challenger's rate of harm against the champion's, and when it tripped."""

    name: str
    description: str
    champion: float
    challenger: float
    now: Evidence | None
    tripped: Evidence | None = None


@dataclass(frozen=True)
class Decision:
    """What to do and why: ``rule`` names the rule that fired, ``evidence`` is the test then."""

    action: Action
    rule: str
    reason: str
    evidence: Evidence | None


@dataclass
class ABResult:
    """The whole analysis: what the report prints and the HTML draws."""

    config: ABConfig
    champion: str
    challenger: str
    traffic: dict[str, int]
    versions: dict[str, dict[str, int]]
    latest: dict[str, str]
    skipped: dict[str, int]
    primary: Evidence | None
    series: SequentialStats | None
    series_t: NDArray[np.float64] | None
    guardrails: list[Guardrail]
    decision: Decision
    notes: list[str] = field(default_factory=list)

    def evidence_dict(self) -> dict[str, object]:
        """The decision's evidence as strict-JSON values (the registry's alias history keeps it):
        an interval not yet bounded or a mean of no outcome is null, not Infinity or NaN."""
        return _finite(
            {
                "rule": self.decision.rule,
                "reason": self.decision.reason,
                "metric": self.config.metric,
                "alpha": self.config.alpha,
                "mde": self.config.mde,
                "champion": {"variant": self.champion, "version": self.latest.get(self.champion)},
                "challenger": {"variant": self.challenger, "version": self.latest.get(self.challenger)},
                "at_decision": asdict(self.decision.evidence) if self.decision.evidence else None,
                "now": asdict(self.primary) if self.primary else None,
                "guardrails": {g.name: asdict(g.tripped) if g.tripped else None for g in self.guardrails},
                "traffic": dict(self.traffic),
                "notes": list(self.notes),
                "skipped_lines": dict(self.skipped),
            }
        )


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
