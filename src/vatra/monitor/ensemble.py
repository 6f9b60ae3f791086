"""The ensemble: turns each step's metrics into a feature vector, asks every detector, decides."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vatra.config._monitor import MonitorConfig
from vatra.monitor._base import Detector, build_detector
from vatra.monitor._fitproc import build_fitter
from vatra.monitor._learned import LearnedDetector
from vatra.monitor.signals import STREAMS, RobustZ

FEATURES = tuple(f"{name}_z" for name in STREAMS)  # ("loss_z", "grad_norm_z", "loss_change_z")


@dataclass
class Alarm:
    """One anomalous step: which detectors fired, their scores and thresholds, the raw values, and
    the streams it is blamed on (see :class:`~vatra.monitor.signals.Verdict`)."""

    step: int
    detectors: list[str]
    scores: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    features: dict[str, float] = field(default_factory=dict)
    streams: list[str] = field(default_factory=list)

    def as_event(self) -> dict[str, Any]:
        return {
            "detectors": self.detectors,
            "streams": self.streams,
            "scores": self.scores,
            "thresholds": self.thresholds,
            "values": self.values,
            "features": self.features,
        }


class FeatureBuilder:
    """Robust z values of the loss, the gradient norm and the step's change in loss.

    Each stream has its own EWMA centre and MAD scale (:class:`RobustZ`), so the features are
    stationary while the raw values trend down all run: a detector fitted early still fits late,
    and the same threshold means the same thing in step 50 and step 5,000.
    """

    def __init__(self, alpha: float) -> None:
        self.streams = [RobustZ(alpha) for _ in FEATURES]
        self.prev_loss: float | None = None

    def step(self, loss: float, grad_norm: float) -> np.ndarray:
        """This step's feature vector, then the baselines move (winsorised, so an anomalous step
        moves them by a few scales at most)."""
        return self.window([loss], [grad_norm])[0]

    def window(self, losses: list[float], grad_norms: list[float]) -> np.ndarray:
        """The feature vectors (n, F) of consecutive steps: ``step`` for each in turn, stream by
        stream (the streams are independent, so the order across them does not matter)."""
        before = [losses[0] if self.prev_loss is None else self.prev_loss, *losses[:-1]]
        changes = [loss - prev for prev, loss in zip(before, losses, strict=True)]  # the first step's: 0
        self.prev_loss = losses[-1]
        columns = zip(self.streams, (losses, grad_norms, changes), strict=True)
        return np.array([s.z_then_update_many(values) for s, values in columns]).T


class Ensemble:
    """Runs the configured detectors on every step's (loss, grad norm); ``vote`` of them must agree.

    A non-finite loss or gradient norm is always an alarm (detector ``nonfinite``). Until
    ``warmup_steps`` steps have been seen nothing else alarms: every step is learned as normal.
    Learned detectors learn only from steps that did not alarm; the feature baselines always move
    (winsorised), so a lasting change of level stops alarming after a while instead of forever.
    """

    def __init__(self, cfg: MonitorConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.builder = FeatureBuilder(cfg.ewma_alpha)
        self.detectors: list[Detector] = [
            build_detector(value, cfg, len(FEATURES), f"monitor.detectors[{i}]")
            for i, value in enumerate(cfg.detectors)
        ]
        self.fitter = build_fitter(cfg.fit_in)  # one helper process for all learned detectors
        for d in self.detectors:
            if isinstance(d, LearnedDetector):
                d.seed, d.fitter = seed, self.fitter
        self.seen = 0

    def observe(self, step: int, loss: float, grad_norm: float) -> Alarm | None:
        return self.observe_window([step], [loss], [grad_norm])[0]

    def observe_window(
        self, steps: list[int], losses: list[float], grad_norms: list[float]
    ) -> list[Alarm | None]:
        """Judge a window of consecutive steps, in step order; one verdict per step.

        Same decisions as one ``observe`` per step, but cheaper:

        - each learned detector scores the rows of the window in one call (a forest or network
          evaluated per row cost ~0.5 ms a step); their models are swapped in at window boundaries
          only, which delays a refit by < one window;
        - detectors are asked cheapest first, and only about rows whose vote is still open: once
          ``vote`` have fired, or too few are left to reach it, the rest are not asked. On a clean
          run the robust z and the autoencoder agree that a step is normal and the forest is never
          walked. An alarm still records every detector's score (they are filled in for it).
        """
        verdicts: list[Alarm | None] = [None] * len(steps)
        finite: list[int] = []  # positions in the window of the finite steps
        for j, (loss, grad_norm) in enumerate(zip(losses, grad_norms, strict=True)):
            if math.isfinite(loss) and math.isfinite(grad_norm):
                finite.append(j)
            else:
                values = {"loss": loss, "grad_norm": grad_norm}
                streams = [name for name, v in values.items() if not math.isfinite(v)]
                verdicts[j] = Alarm(steps[j], ["nonfinite"], values=values, streams=streams)
        if not finite:
            return verdicts
        # the baselines move on every finite step
        window = self.builder.window([losses[j] for j in finite], [grad_norms[j] for j in finite])  # (n, F)
        ready = [d for d in self.detectors if d.ready]
        need = min(self.cfg.vote, len(ready))
        n = len(finite)
        # Rows judged at all: past the warm-up (counted per finite row, as `observe` would).
        first_judged = max(0, self.cfg.warmup_steps - self.seen)
        self.seen += n
        batch = sorted((d for d in ready if d.window_scoring), key=lambda d: d.cost)
        one_by_one = [d for d in ready if not d.window_scoring]
        # Plain lists, not numpy: a window has ~10 rows, and inside a training run (caches cold
        # from the step) each small numpy call costs ~6x what it costs in a loop on its own.
        scores: dict[str, list[float]] = {d.name: [math.nan] * n for d in batch}
        fired = [0] * n
        left = len(ready)
        open_rows = list(range(first_judged, n)) if ready else []
        for d in batch:
            left -= 1  # detectors after this one
            open_rows = [i for i in open_rows if fired[i] < need and fired[i] + 1 + left >= need]
            if open_rows:
                rows = window if len(open_rows) == n else window[open_rows]
                column, threshold = scores[d.name], d.threshold()
                for i, score in zip(open_rows, d.score_many(rows).tolist(), strict=True):
                    column[i] = score
                    fired[i] += score > threshold
        # rows that may alarm; the others are learned as normal
        extra = len(one_by_one)
        open_vote = [False] * n
        if ready:
            for i in range(first_judged, n):
                open_vote[i] = fired[i] + extra >= need
        if not any(open_vote):  # the usual window: every row is learned as normal, in one call each
            for d in self.detectors:
                d.learn_many(window)
            return verdicts
        clean: list[int] = []  # rows to learn at the end (every detector scores windows at once)
        for i, (j, x) in enumerate(zip(finite, window, strict=True)):
            alarm = None
            if open_vote[i]:
                row = {name: v[i] for name, v in scores.items()}
                for d in one_by_one:  # scored here, after the rows before have been learned
                    row[d.name] = d.score(x)
                if sum(row[d.name] > d.threshold() for d in one_by_one) + fired[i] >= need:
                    alarm = self._alarm(steps[j], ready, row, x, losses[j], grad_norms[j])
            if alarm is None:
                if one_by_one:
                    for d in self.detectors:
                        d.learn(x)
                else:
                    clean.append(i)
            verdicts[j] = alarm
        if clean:
            for d in self.detectors:
                d.learn_many(window[clean])
        return verdicts

    def _alarm(
        self,
        step: int,
        ready: list[Detector],
        row: dict[str, float],
        x: np.ndarray,
        loss: float,
        grad_norm: float,
    ) -> Alarm:
        """The alarm's record, with the scores of the detectors the vote did not need to ask, blamed
        on the streams whose z exceeds ``zscore_threshold``."""
        scores = {
            d.name: row[d.name]
            if math.isfinite(row.get(d.name, math.nan))
            else float(d.score_many(x[None])[0])
            for d in ready
        }
        thresholds = {d.name: d.threshold() for d in ready}
        fired = [name for name in scores if scores[name] > thresholds[name]]
        values = {"loss": loss, "grad_norm": grad_norm}
        z = x.tolist()
        streams = [name for name, zi in zip(STREAMS, z, strict=True) if zi > self.cfg.zscore_threshold]
        return Alarm(
            step, fired, scores, thresholds, values, dict(zip(FEATURES, z, strict=True)), streams=streams
        )

    def close(self, wait: bool = True) -> None:
        """Wait for fits in flight (or, without ``wait``, abandon them), then stop the helper process;
        a later fit starts a new one."""
        for d in self.detectors:
            d.close(wait)
        self.fitter.close(wait)
