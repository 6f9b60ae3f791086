"""What the monitor tells the healing policies: the robust z-score of a stream and the ``Verdict``.

The monitor computes its features with :class:`RobustZ` and delivers a :class:`Verdict` in
``trainer.state.extras["monitor"]``; the healing policies read that verdict and act on it. This module
is no plugin, so healing imports it without importing the monitor's plugin (plugins never import each
other's plugin modules). It imports nothing of vatra.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# The monitor's streams, in the order of its feature vector: the mean loss over ranks, the global
# gradient norm before clipping, and the step's change in mean loss.
STREAMS = ("loss", "grad_norm", "loss_change")
LOSS_STREAMS = ("loss", "loss_change")  # alarms here, without the loss coming back, roll back


class RobustZ:
    """One stream: centre = EWMA of the values, scale = a high quantile of the recent absolute deviations.

    The scale is the ``quantile`` (default 0.9) of |r − median(r)| over the last ``window``
    residuals r; the MAD is the 0.5 quantile. Per-batch loss and gradient norm are heavy-tailed
    (late in training most batches give tiny gradients, a few give large ones), and measured on
    the digits runs the MAD made ordinary batches look like 30σ spikes while the 0.9 quantile kept
    every clean step under 6 and every injected fault above 100 (bench/monitor_detection.py).

    Updates are winsorised: once the stream is ready a residual counts at most ``clip`` scales, so a
    spike barely moves the centre while a lasting shift is followed within tens of steps (instead
    of freezing the baseline and alarming forever). ``scale_floor`` keeps a nearly constant stream
    from turning tiny noise into huge z values.
    """

    def __init__(
        self,
        alpha: float,
        window: int = 128,
        min_count: int = 20,
        quantile: float = 0.9,
        scale_floor: float = 1e-6,
        clip: float = 3.0,
    ) -> None:
        self.alpha = alpha
        self.quantile = quantile
        self.clip = clip
        self.residuals: deque[float] = deque(maxlen=window)
        self.min_count = min_count
        self.scale_floor = scale_floor
        self.center: float | None = None
        self._scale: float | None = None  # cached for `refresh` updates
        self._since_scale = 0
        self.refresh = 16

    @property
    def ready(self) -> bool:
        return len(self.residuals) >= self.min_count

    def scale(self) -> float:
        # Recomputed every `refresh` updates: the spread of 128 residuals moves slowly, and two
        # order statistics per step would cost more than the rest of the monitor together.
        if self._scale is None or self._since_scale >= self.refresh:
            r = np.fromiter(self.residuals, dtype=np.float64)
            spread = 0.0
            if len(r):
                dev = np.abs(r - np.partition(r, len(r) // 2)[len(r) // 2])  # |r − median|
                k = min(len(dev) - 1, int(self.quantile * len(dev)))
                spread = float(np.partition(dev, k)[k])
            self._scale = max(spread, self.scale_floor)
            self._since_scale = 0
        return self._scale

    def z(self, value: float) -> float:
        if self.center is None or not self.ready:
            return 0.0
        return (value - self.center) / self.scale()

    def limit(self, threshold: float) -> float:
        """The value whose z is ``threshold``: above it a value is a spike (inf until ready)."""
        if self.center is None or not self.ready:
            return math.inf
        return self.center + threshold * self.scale()

    def z_then_update(self, value: float) -> float:
        """``z(value)``, then ``update(value)``: the per-step path (the scale is computed once, cached)."""
        z = self.z(value)
        self.update(value)
        return z

    def z_then_update_many(self, values: list[float]) -> list[float]:
        """``z_then_update`` of each value in turn, in one call and with one ``scale`` lookup per
        value (a window's 10 values × 3 streams were 30 calls through ``z``, ``scale``, ``ready`` and
        ``update``, the largest part of judging a window)."""
        out: list[float] = []
        for value in values:
            ready = self.ready  # then the centre is set too
            scale = self.scale() if ready else 0.0
            out.append((value - self.center) / scale if ready and self.center is not None else 0.0)
            if math.isfinite(value):
                self._absorb(value, ready, scale)
        return out

    def update(self, value: float) -> None:
        if math.isfinite(value):
            ready = self.ready
            self._absorb(value, ready, self.scale() if ready else 0.0)

    def _absorb(self, value: float, ready: bool, scale: float) -> None:
        """Move the baseline to a finite ``value``; ``scale`` is the current one when ``ready``."""
        if self.center is None:
            self.center = value
            return
        r = value - self.center
        if ready:
            bound = self.clip * scale
            r = min(max(r, -bound), bound)
        self.residuals.append(r)
        self.center += self.alpha * r
        self._since_scale += 1
        if len(self.residuals) <= self.min_count:
            self._scale = None  # still filling: keep the scale exact


def stream_mask(streams: list[str]) -> int:
    """An alarmed step as one integer (it travels in the verdict's float64 broadcast): bit 0 says
    the step alarmed, bit i + 1 that ``STREAMS[i]`` is among the streams it is blamed on."""
    return 1 + sum(2 << i for i, name in enumerate(STREAMS) if name in streams)


@dataclass
class Verdict:
    """What rank 0 concluded from a gathered window; identical on every rank (broadcast).

    Healing policies read it from ``trainer.state.extras["monitor"]`` at the step it is delivered
    (None at other steps): at the window's last step alone, two steps later with peers.

    An alarm is blamed on the streams whose robust z exceeds ``monitor.zscore_threshold`` (for a
    NaN/Inf value, the stream that is not finite); an alarm the learned detectors voted for without
    any stream that far out is counted in ``alarms`` and ``alarm_steps`` but blamed on none.
    """

    step: int  # the step this verdict was delivered at
    steps: list[int]  # the window's steps, in order
    loss: list[float]  # mean loss over ranks per step of the window
    alarms: int  # ensemble alarms in the window
    straggler_ratio: float  # slowest rank's compute time over the median of the other ranks'
    slowest_rank: int
    data_share: float  # the largest rank's share of step time spent waiting for data
    alarm_steps: list[int] = field(default_factory=list)
    # per stream (a name of STREAMS), the window's steps whose alarm is blamed on it; absent = none
    stream_alarms: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_masks(
        cls,
        step: int,
        steps: list[int],
        loss: list[float],
        masks: list[int],
        *,
        straggler_ratio: float,
        slowest_rank: int,
        data_share: float,
    ) -> Verdict:
        """A verdict from one :func:`stream_mask` per step of the window (0 = no alarm)."""
        alarm_steps = [s for s, m in zip(steps, masks, strict=True) if m]
        stream_alarms = {
            name: hits
            for i, name in enumerate(STREAMS)
            if (hits := [s for s, m in zip(steps, masks, strict=True) if m >> (i + 1) & 1])
        }
        return cls(
            step=step,
            steps=steps,
            loss=loss,
            alarms=len(alarm_steps),
            straggler_ratio=straggler_ratio,
            slowest_rank=slowest_rank,
            data_share=data_share,
            alarm_steps=alarm_steps,
            stream_alarms=stream_alarms,
        )

    def alarmed_on(self, streams: tuple[str, ...]) -> list[int]:
        """The window's steps whose alarm is blamed on any of ``streams``, in order."""
        return sorted({s for name in streams for s in self.stream_alarms.get(name, ())})

    def then(self, later: Verdict) -> Verdict:
        """This verdict and a later one delivered at the same step, as one (the end of a run)."""
        names = [n for n in STREAMS if n in self.stream_alarms or n in later.stream_alarms]
        return Verdict(
            step=later.step,
            steps=self.steps + later.steps,
            loss=self.loss + later.loss,
            alarms=self.alarms + later.alarms,
            straggler_ratio=later.straggler_ratio,
            slowest_rank=later.slowest_rank,
            data_share=later.data_share,
            alarm_steps=self.alarm_steps + later.alarm_steps,
            stream_alarms={n: self.stream_alarms.get(n, []) + later.stream_alarms.get(n, []) for n in names},
        )
