"""Energy and carbon per run: per-rank meters (NVML, RAPL, an estimate), grid profiles, the plugin."""

from vatra.monitor.energy.meters import EnergyMeter, EstimateMeter, NvmlMeter, RaplMeter, open_meter
from vatra.monitor.energy.plugin import EnergyPlugin
from vatra.monitor.energy.profile import Profile, read_profile

__all__ = [
    "EnergyMeter",
    "EnergyPlugin",
    "EstimateMeter",
    "NvmlMeter",
    "Profile",
    "RaplMeter",
    "open_meter",
    "read_profile",
]
