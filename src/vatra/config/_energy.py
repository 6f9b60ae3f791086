"""The ``energy`` section: energy per run (NVML, RAPL or an estimate) and its carbon."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vatra.config._sections import Section

# CodeCarbon 3's figure for a CPU it cannot name: 4 W per logical CPU (energy.cpu_tdp_w = 0).
WATTS_PER_THREAD = 4.0
# World average grid intensity (gCO2eq/kWh, IEA 2019), CodeCarbon's default when the region is unknown.
WORLD_G_PER_KWH = 475.0


class EnergyConfig(Section):
    enabled: bool = Field(
        True,
        description="Measure each rank's energy (NVML on a GPU, RAPL where readable, else an estimate "
        "labelled 'estimated'); summary.json gets energy_kwh, energy_source and co2_kg.",
    )
    source: Literal["auto", "nvml", "rapl", "estimated"] = Field(
        "auto",
        description="auto = NVML's energy counter on a CUDA rank, else RAPL if readable, else the "
        "estimate; naming one refuses to start where it cannot be read (the estimate always can).",
    )
    every: int = Field(
        10,
        ge=1,
        description="Steps between sums over ranks (one all-reduce of 4 numbers); those steps' "
        "metrics get energy_j and power_w.",
    )
    cpu_tdp_w: float = Field(
        0.0,
        ge=0.0,
        description="estimated: the CPU's TDP in watts, spread over its logical CPUs; a process "
        "drawing one CPU's time all the time is charged TDP / logical CPUs. 0 = 4 W per logical CPU "
        "(CodeCarbon's figure for an unknown CPU).",
    )
    powercap_root: str = Field(
        "/sys/class/powercap",
        description="rapl: where the powercap zones (intel-rapl:N/energy_uj) are read from.",
    )
    intensity_csv: str = Field(
        "",
        description="Grid intensity profile for co2_kg: an Electricity Maps CSV export (Datetime (UTC), "
        "Carbon Intensity gCO2eq/kWh), the UK Carbon Intensity API's JSON, or a CSV of time and "
        "gCO2/kWh. A run outside its dates uses its hour-of-day means. '' = grid_g_per_kwh.",
    )
    grid_g_per_kwh: float = Field(
        WORLD_G_PER_KWH,
        ge=0.0,
        description="Constant grid intensity (gCO2eq/kWh) when intensity_csv is ''; the default is the "
        "world average (IEA, 475), as CodeCarbon uses for an unknown region.",
    )
