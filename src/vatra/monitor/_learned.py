"""Shared machinery of the learned detectors: a clean-row buffer and fits off the training loop."""

from __future__ import annotations

import warnings
from collections import deque
from concurrent.futures import Future
from typing import Any

import numpy as np

from vatra.config._monitor import MonitorConfig
from vatra.monitor._base import Detector, calibrated_threshold
from vatra.monitor._fitproc import Fitter, ProcessFitter, ThreadFitter, build_fitter

MAX_TRAIN_ROWS = 512


class LearnedDetector(Detector):
    """Fits on the first ``warmup_steps`` clean rows, then again every ``refit_every`` clean rows.

    Subclasses implement ``_fit(X) -> model`` and ``_score(model, X) -> scores``; the model must
    pickle (numpy arrays, not live torch modules). Every fit runs on a :class:`Fitter` (the
    ensemble's helper process by default, see ``_fitproc``); the new model replaces the old one at
    the first ``ready`` check after the fit finishes, so the detector is not ready until its first
    fit is done. A failed fit keeps the previous model, warns, and is retried when the next is due.
    """

    window_scoring = True  # the model only changes at a `ready` check (see `_swap`)

    def __init__(self, cfg: MonitorConfig, n_features: int, seed: int = 0) -> None:
        super().__init__(cfg, n_features)
        self.seed = seed  # + the number of fits so far: each fit's own random state
        self.buffer: deque[np.ndarray] = deque(maxlen=MAX_TRAIN_ROWS)
        self.model: Any = None
        self._threshold = float("inf")
        self._since_fit = 0
        self._future: Future[tuple[Any, float]] | None = None
        self.fitter: Fitter | None = None  # set by the ensemble; else one of its own, built on demand
        self._own_fitter = False
        self.fits = 0
        self.fit_error: str | None = None
        self._helper_failed = False

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
        if self._future is None or not self._future.done():
            return
        future, self._future = self._future, None
        try:
            self.model, self._threshold = future.result()
            self.fits += 1
        except Exception as exc:
            self.fit_error = f"{type(exc).__name__}: {exc}"
            self._since_fit = 0  # the next try waits for warmup_steps more clean rows
            where = "keeping the last model"
            if isinstance(self.fitter, ProcessFitter):  # the helper cannot be relied on: fit here
                self.fitter, self._own_fitter, self._helper_failed = ThreadFitter(), True, True
                where += "; fitting in a thread from now on"
            warnings.warn(f"{self.name} detector: fit failed ({self.fit_error}); {where}", stacklevel=2)

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
        retry_ok = self.fit_error is None or self._since_fit >= self.cfg.warmup_steps
        due = self.model is None and len(self.buffer) >= self.cfg.warmup_steps and retry_ok
        due |= self.model is not None and self.cfg.refit_every > 0 and self._since_fit >= self.cfg.refit_every
        if due and self._future is None:
            if self.fitter is None:
                kind = "thread" if self._helper_failed else self.cfg.fit_in
                self.fitter, self._own_fitter = build_fitter(kind), True
            self._since_fit = 0
            args = (type(self), self.cfg, self.n_features, self.seed, self.fits)
            self._future = self.fitter.submit(_fit_job, *args, np.stack(self.buffer))

    def learn_many(self, rows: np.ndarray) -> None:
        """``learn`` each row in order; in one go when no fit can become due within these rows (one
        is in flight, or the next refit is more rows away), which is nearly always."""
        refit = self.cfg.refit_every
        quiet = self._future is not None or (
            self.model is not None and (refit <= 0 or self._since_fit + len(rows) < refit)
        )
        if not quiet:
            super().learn_many(rows)
            return
        self.buffer.extend(rows)
        self._since_fit += len(rows)

    def close(self, wait: bool = True) -> None:
        """Wait for a fit in flight and take its model; or, without ``wait`` (the run is over), drop it."""
        if self._future is not None and wait:
            self._future.exception()  # waits; a failure is reported by _swap
            self._swap()
        self._future = None
        if self._own_fitter and self.fitter is not None:
            self.fitter.close(wait)
            self.fitter, self._own_fitter = None, False


def _fit_job(
    cls: type[LearnedDetector], cfg: MonitorConfig, n_features: int, seed: int, fits: int, rows: np.ndarray
) -> tuple[Any, float]:
    """One fit, wherever the fitter runs it: a fresh detector with the same settings fits ``rows``."""
    det = cls(cfg, n_features, seed)
    det.fits = fits
    return det._fit_and_calibrate(rows)
