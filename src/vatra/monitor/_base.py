"""``Detector``: the base class of online anomaly detectors, and their registry by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from vatra.config._monitor import MonitorConfig

DETECTORS: dict[str, type[Detector]] = {}


def register(name: str) -> Callable[[type[Detector]], type[Detector]]:
    def deco(cls: type[Detector]) -> type[Detector]:
        cls.name = name
        DETECTORS[name] = cls
        return cls

    return deco


def build_detector(name: str, cfg: MonitorConfig, n_features: int) -> Detector:
    if name not in DETECTORS:
        raise KeyError(f"unknown detector {name!r}; known: {', '.join(sorted(DETECTORS))}")
    return DETECTORS[name](cfg, n_features)


def calibrated_threshold(scores: np.ndarray, quantile: float, margin: float) -> float:
    """``q + margin·(q − median)`` of the clean training scores: scale-free, robust to a few outliers."""
    q = float(np.quantile(scores, quantile))
    return q + margin * max(q - float(np.median(scores)), 1e-12)


class Detector:
    """Scores one feature vector per step; higher is more anomalous.

    Call order, once per step and in step order (rank 0 only; not thread-safe):
    ``score(x)`` → the ensemble decides → ``learn(x)`` only if the step was judged clean, so an
    anomaly never becomes part of the model of normal. ``ready`` is False until the detector has
    seen enough clean steps; a detector that is not ready never alarms. Learned detectors fit in a
    background thread and swap the new model in when it is done (refits stay off the step's path).
    """

    name: ClassVar[str] = ""
    # True when ``learn`` leaves ``score`` unchanged until the next ``ready`` check (a fitted model
    # swapped in between windows): the ensemble may then score a whole window in one call.
    window_scoring: ClassVar[bool] = False
    # Relative cost of scoring; the ensemble asks cheaper detectors first and skips the others
    # once the vote is decided.
    cost: ClassVar[int] = 1

    def __init__(self, cfg: MonitorConfig, n_features: int) -> None:
        self.cfg = cfg
        self.n_features = n_features

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    def score(self, x: np.ndarray) -> float:
        """Anomaly score of one finite feature vector ``x`` of shape (F,)."""
        raise NotImplementedError

    def score_many(self, x: np.ndarray) -> np.ndarray:
        """Scores of the rows of ``x`` (n, F); detectors with ``window_scoring`` do it in one call."""
        return np.array([self.score(row) for row in x], dtype=np.float64)

    def threshold(self) -> float:
        """Scores above this alarm."""
        raise NotImplementedError

    def learn(self, x: np.ndarray) -> None:
        """Take a clean vector into the model of normal."""
        raise NotImplementedError

    def learn_many(self, rows: np.ndarray) -> None:
        """``learn`` each row of ``rows`` (n, F) in order; detectors may do it in one go."""
        for x in rows:
            self.learn(x)

    def close(self, wait: bool = True) -> None:
        """Wait for any background fit (``wait``), or abandon it (the end of a run)."""
