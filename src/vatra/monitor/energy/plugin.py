"""``EnergyPlugin``: each rank's energy, summed over ranks every few steps and for the run, and its CO₂."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vatra.config import Config
from vatra.engine import Plugin
from vatra.monitor.energy.meters import SOURCES, EnergyMeter, open_meter, worst_source
from vatra.monitor.energy.profile import Profile, read_profile

if TYPE_CHECKING:
    from vatra.engine import Trainer

J_PER_KWH = 3.6e6


class EnergyPlugin(Plugin):
    """Per rank a meter (:func:`~vatra.monitor.energy.meters.open_meter`); every ``energy.every``
    steps one all-reduce of 4 float64 (the rank's joules since the last sum and a one-hot of its
    source) on a gloo group of its own, so rank 0's metrics for that step get ``energy_j`` (all
    ranks, since the start) and ``power_w`` (all ranks, over the window). At the end the summary gets
    ``energy_kwh``, ``energy_source`` (the ranks' least measured source), ``energy_ranks`` (ranks
    per source) and ``co2_kg`` (each window's energy at its time's grid intensity).

    Cost per step: one clock read, and where the meter asks for it (RAPL's wrapping counters) one
    read of a few sysfs files a second; per window a meter read (the estimate: one psutil call, a
    process-table scan every 10 s) and, with peers, the all-reduce.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg.energy
        # read now, while the run is assembled: a bad file fails the start, not the end
        self.profile: Profile | None = (
            read_profile(self.cfg.intensity_csv) if self.cfg.intensity_csv else None
        )
        self.meter: EnergyMeter | None = None
        self.group: Any = None
        self.sent_j = 0.0  # this rank's joules included in the sums so far
        self.total_j = 0.0  # rank 0: all ranks' joules so far
        self.counts: dict[str, int] = {}
        self.windows: list[tuple[float, float, float]] = []  # rank 0: (start, end unix s, joules)
        self.window_start = 0.0
        self.polled = 0.0

    def on_fit_start(self, trainer: Trainer) -> None:
        d = trainer.dist
        self.meter = open_meter(self.cfg, d.device.type, d.device.index or 0, d.local_rank)
        if d.distributed:  # collective: every rank builds its plugins alike
            self.group = dist.new_group(backend="gloo")  # CPU tensors, beside NCCL or gloo's DDP
        self.window_start = self.polled = time.time()

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.meter is None:
            return
        if metrics["step"] % self.cfg.every == 0:
            self._sum(trainer, metrics)
        elif self.meter.poll_s is not None and time.time() - self.polled >= self.meter.poll_s:
            self.meter.read_j()  # keeps a wrapping counter's count
            self.polled = time.time()

    def _sum(self, trainer: Trainer, out: dict[str, Any]) -> None:
        assert self.meter is not None
        joules = self.meter.read_j()
        self.polled = now = time.time()
        box = torch.zeros(1 + len(SOURCES), dtype=torch.float64)
        box[0] = joules - self.sent_j
        box[1 + SOURCES.index(self.meter.source)] = 1.0
        self.sent_j = joules
        if self.group is not None:
            dist.all_reduce(box, group=self.group)
        if not trainer.dist.is_main:
            return
        window_j = float(box[0])
        self.total_j += window_j
        self.counts = {s: int(box[1 + i]) for i, s in enumerate(SOURCES) if box[1 + i] > 0}
        self.windows.append((self.window_start, now, window_j))
        if now > self.window_start:
            out["power_w"] = window_j / (now - self.window_start)
        out["energy_j"] = self.total_j
        self.window_start = now

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.meter is None:
            return
        last: dict[str, Any] = {}
        self._sum(trainer, last)
        self.meter.close()
        self.meter = None
        if not trainer.dist.is_main:
            return
        summary["energy_kwh"] = self.total_j / J_PER_KWH
        summary["energy_source"] = worst_source(self.counts)
        summary["energy_ranks"] = dict(self.counts)
        grams, where = self._co2_g()
        summary["co2_kg"] = grams / 1000.0
        summary["co2_intensity"] = where

    def _co2_g(self) -> tuple[float, str]:
        """Grams of CO₂eq of the windows so far, and where the intensity came from."""
        if self.profile is None:
            g = self.cfg.grid_g_per_kwh
            return self.total_j / J_PER_KWH * g, f"energy.grid_g_per_kwh = {g:g} gCO2/kWh"
        grams = sum(j / J_PER_KWH * self.profile.value_at((a + b) / 2) for a, b, j in self.windows)
        inside = all(self.profile.covers((a + b) / 2) for a, b, _ in self.windows)
        how = "the profile's slots" if inside else "its hour-of-day means (the run is outside its dates)"
        return grams, f"{self.profile.path} ({self.profile.unit}): {how}"

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        if self.meter is not None:
            self.meter.close()
            self.meter = None
