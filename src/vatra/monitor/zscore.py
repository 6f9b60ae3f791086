"""The robust z-score detector: the largest upward z of the features (:class:`RobustZ` values)."""

from __future__ import annotations

import numpy as np

from vatra.monitor._base import Detector


class ZScoreDetector(Detector):
    """The largest upward robust z among the features (the ensemble's features already are robust
    z values, :class:`~vatra.monitor.signals.RobustZ`, see :class:`~vatra.monitor.ensemble.FeatureBuilder`).

    Stateless beyond those baselines, so it is ready as soon as the warm-up is over.
    """

    name = "zscore"
    window_scoring = True  # stateless: a row's score does not depend on the rows before it
    cost = 0

    @property
    def ready(self) -> bool:
        return True

    def score(self, x: np.ndarray) -> float:
        return float(x.max())

    def score_many(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x.max(axis=1), dtype=np.float64)

    def threshold(self) -> float:
        return self.cfg.zscore_threshold

    def learn(self, x: np.ndarray) -> None:
        return None

    def learn_many(self, rows: np.ndarray) -> None:
        return None
