"""One rank's energy meter: NVML's energy counter, RAPL's powercap counters, or an estimate.

Each meter answers :meth:`EnergyMeter.read_j`, the joules this rank has drawn since the meter was
made, and names its ``source``: ``nvml`` and ``rapl`` are measurements, ``estimated`` is not (it is
CodeCarbon's fallback when it cannot measure: the CPU's TDP × this process's share of the CPUs).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from vatra.config._energy import WATTS_PER_THREAD, EnergyConfig
from vatra.errors import ConfigError

SOURCES = ("nvml", "rapl", "estimated")  # best first: a run's label is its ranks' worst


class EnergyMeter:
    """Base: ``read_j()`` → joules since the meter was made (monotonic); ``poll_s``: the longest a
    caller may leave between reads (a counter that wraps needs a read per wrap period), or None."""

    source: str = ""
    poll_s: float | None = None

    def read_j(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        return None


class NvmlMeter(EnergyMeter):
    """NVML's total-energy counter of one GPU (``nvmlDeviceGetTotalEnergyConsumption``: mJ since the
    driver loaded, 64 bits, Volta and newer). It counts the GPU board only, not the host's CPU."""

    source = "nvml"

    def __init__(self, index: int) -> None:
        import pynvml  # the optional nvidia-ml-py package; the caller turns ImportError into a fallback

        pynvml.nvmlInit()
        self.nvml: Any = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.start_mj = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def read_j(self) -> float:
        return (int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)) - self.start_mj) / 1000.0

    def close(self) -> None:
        self.nvml.nvmlShutdown()


@dataclass
class _Zone:
    path: Path  # its energy_uj file
    max_uj: int  # max_energy_range_uj: the counter goes back to 0 past it
    last_uj: int
    total_uj: int = 0


def rapl_zones(root: Path) -> list[Path]:
    """The powercap zones that together are the host's energy without overlap: every package
    (``intel-rapl:N``; AMD's packages appear under the same name) and each package's ``dram``
    subzone, which lies outside the package. ``psys`` (the whole platform, which includes the
    packages) is left out where packages exist."""
    tops = sorted(p for p in root.glob("intel-rapl:*") if re.fullmatch(r"intel-rapl:\d+", p.name))
    names = {p: _name(p) for p in tops}
    packages = [p for p in tops if names[p] != "psys"] or tops
    drams = [s for p in packages for s in sorted(p.glob(f"{p.name}:*")) if _name(s) == "dram"]
    return packages + drams


def _name(zone: Path) -> str:
    try:
        return (zone / "name").read_text().strip()
    except OSError:
        return ""


class RaplMeter(EnergyMeter):
    """The host's RAPL counters under ``root`` (``/sys/class/powercap``), in µJ.

    Each zone's ``energy_uj`` wraps to 0 past ``max_energy_range_uj`` (≈ 262 kJ on many CPUs: about
    45 minutes at 100 W), so a read must come at least once per wrap period: ``poll_s`` asks for one a
    second. RAPL measures the whole host, not a process: on a host with several ranks only one
    (``counts``: local rank 0) reports it and the others report 0, so the sum over ranks is the sum
    over hosts. Since 2020 (the PLATYPUS attack) ``energy_uj`` is readable by root only on most
    distributions; :func:`open_meter` then falls back to the estimate.
    """

    source = "rapl"
    poll_s = 1.0

    def __init__(self, root: Path, counts: bool = True) -> None:
        paths = rapl_zones(root)
        if not paths:
            raise OSError(f"no RAPL zones (intel-rapl:N) under {root}")
        self.counts = counts
        self.zones = [_Zone(p / "energy_uj", int((p / "max_energy_range_uj").read_text()), 0) for p in paths]
        for z in self.zones:
            z.last_uj = int(z.path.read_text())  # raises PermissionError where root only may read

    def read_j(self) -> float:
        for z in self.zones:
            now = int(z.path.read_text())
            # past the top the counter starts again at 0: what was left to the top, then now
            z.total_uj += now - z.last_uj if now >= z.last_uj else z.max_uj - z.last_uj + now
            z.last_uj = now
        return sum(z.total_uj for z in self.zones) / 1e6 if self.counts else 0.0


class EstimateMeter(EnergyMeter):
    """Not a measurement: ``watts_per_cpu`` × the CPU seconds of this process and its children
    (DataLoader workers), as CodeCarbon estimates a CPU it cannot measure. ``watts_per_cpu`` is the
    CPU's TDP over its logical CPUs (``energy.cpu_tdp_w``; 0: CodeCarbon's 4 W per logical CPU).

    Children are found by a scan of the process table (~5 ms here), at most every ``rescan_s``; a
    finished child that was waited for counts through this process's ``children_*`` times.
    """

    source = "estimated"
    rescan_s = 10.0

    def __init__(self, tdp_w: float = 0.0) -> None:
        cpus = psutil.cpu_count() or 1
        self.watts_per_cpu = tdp_w / cpus if tdp_w > 0 else WATTS_PER_THREAD
        self.proc = psutil.Process()
        self.children: list[psutil.Process] = []
        self.scanned = -float("inf")
        self.start_s = self.cpu_s()

    def cpu_s(self) -> float:
        """CPU seconds of this process, its waited-for children and its live ones."""
        if time.monotonic() - self.scanned >= self.rescan_s:
            self.scanned = time.monotonic()
            try:
                self.children = self.proc.children(recursive=True)
            except psutil.Error:
                self.children = []
        t = self.proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in self.children:
            try:
                c = child.cpu_times()
            except psutil.Error:  # gone: once waited for, its time is in children_* above
                continue
            total += c.user + c.system
        return float(total)

    def read_j(self) -> float:
        return self.watts_per_cpu * max(0.0, self.cpu_s() - self.start_s)


def open_meter(cfg: EnergyConfig, device_type: str, device_index: int, local_rank: int) -> EnergyMeter:
    """The best meter this rank can read (``energy.source = "auto"``), or the one named; a named
    source that cannot be read is a config error naming why."""
    wanted = cfg.source
    if wanted in ("auto", "nvml") and device_type == "cuda":
        try:
            return NvmlMeter(device_index)
        except Exception as err:  # no package, an old GPU or driver: NVML's counter is optional
            if wanted == "nvml":
                raise ConfigError(
                    f"energy.source = 'nvml': NVML's energy counter is not readable ({err}); install "
                    "nvidia-ml-py on a Volta or newer GPU, or set energy.source = 'auto'"
                ) from None
    elif wanted == "nvml":
        raise ConfigError("energy.source = 'nvml' needs a CUDA device; set energy.source = 'auto'")
    if wanted in ("auto", "rapl"):
        try:
            return RaplMeter(Path(cfg.powercap_root), counts=local_rank == 0)
        except (OSError, ValueError) as err:
            if wanted == "rapl":
                raise ConfigError(
                    f"energy.source = 'rapl': {err}; RAPL needs /sys/class/powercap readable (root on "
                    "most systems: chmod o+r .../energy_uj), or set energy.source = 'auto'"
                ) from None
    return EstimateMeter(cfg.cpu_tdp_w)


def worst_source(counts: dict[str, int]) -> str:
    """A sum's label: the least measured of its ranks' sources (one estimated rank makes the whole
    run's figure an estimate)."""
    present = [s for s in SOURCES if counts.get(s)]
    return present[-1] if present else "estimated"
