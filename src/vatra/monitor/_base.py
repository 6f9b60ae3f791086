"""``Detector``: the base class of online anomaly detectors, and ``build_detector`` by name."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from vatra.config._monitor import MonitorConfig
from vatra.registry import DETECTORS


def build_detector(
    value: str, cfg: MonitorConfig, n_features: int, key: str = "monitor.detectors"
) -> Detector:
    """The detector ``value`` names (a built-in or a user's subclass) as ``cls(cfg, n_features)``.

    A class that sets no ``name`` in its body is named by ``value``, the import string: the
    ensemble's scores, alarms and the run's logs show detectors by name.
    """
    cls: type[Detector] = DETECTORS.load_class(value, Detector, key)
    detector = cls(cfg, n_features)
    if not vars(cls).get("name"):
        detector.name = value
    return detector


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

    A user's subclass named by import string (``monitor.detectors = ["pkg.mod:MyDetector"]``) works
    like a built-in: the ensemble builds it as ``MyDetector(monitor_config, n_features)`` and runs
    it in the same order, named by its ``name`` or else by the import string.
    """

    name: str = ""  # set in each class body; the ensemble's scores and alarms are keyed by it
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
