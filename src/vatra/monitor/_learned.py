"""Shared machinery of the learned detectors: a clean-row buffer and fits in a background thread."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np
import torch

from vatra.config._monitor import MonitorConfig
from vatra.monitor._base import Detector, calibrated_threshold

MAX_TRAIN_ROWS = 512


class LearnedDetector(Detector):
    """Fits on the first ``warmup_steps`` clean rows, then again every ``refit_every`` clean rows.

    Subclasses implement ``_fit(X) -> model`` and ``_score(model, X) -> scores``. Every fit runs in
    a daemon thread; the new model replaces the old one at the first ``ready`` check after the
    thread finishes (so the detector is not ready until its first fit is done).
    """

    window_scoring = True  # the model only changes at a `ready` check (see `_swap`)

    def __init__(self, cfg: MonitorConfig, n_features: int) -> None:
        super().__init__(cfg, n_features)
        self.buffer: deque[np.ndarray] = deque(maxlen=MAX_TRAIN_ROWS)
        self.model: Any = None
        self._threshold = float("inf")
        self._since_fit = 0
        self._thread: threading.Thread | None = None
        self._pending: tuple[Any, float] | None = None
        self.fits = 0

    def _fit(self, x: np.ndarray) -> Any:
        raise NotImplementedError

    def _score(self, model: Any, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _fit_and_calibrate(self, x: np.ndarray) -> tuple[Any, float]:
        model = self._fit(x)
        thr = calibrated_threshold(self._score(model, x), self.cfg.score_quantile, self.margin())
        return model, thr

    def margin(self) -> float:
        return self.cfg.score_margin

    def _swap(self) -> None:
        if self._pending is not None:
            self.model, self._threshold = self._pending
            self._pending = None
            self.fits += 1

    @property
    def ready(self) -> bool:
        self._swap()
        return self.model is not None

    def score(self, x: np.ndarray) -> float:
        return float(self.score_many(x[None, :])[0])

    def score_many(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._score(self.model, x), dtype=np.float64)

    def threshold(self) -> float:
        return self._threshold

    def learn(self, x: np.ndarray) -> None:
        self.buffer.append(x)
        self._since_fit += 1
        due = self.model is None and self.fits == 0 and len(self.buffer) >= self.cfg.warmup_steps
        due |= self.model is not None and self.cfg.refit_every > 0 and self._since_fit >= self.cfg.refit_every
        if due and (self._thread is None or not self._thread.is_alive()) and self._pending is None:
            rows = np.stack(self.buffer)
            self._since_fit = 0
            self._thread = threading.Thread(target=self._work, args=(rows,), name=f"vatra-fit-{self.name}")
            self._thread.daemon = True
            self._thread.start()

    def _work(self, rows: np.ndarray) -> None:
        # One intra-op thread, set for this thread only (OpenMP's setting is per thread): a fit must
        # not compete with the training step for cores.
        torch.set_num_threads(1)
        self._pending = self._fit_and_calibrate(rows)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._swap()
