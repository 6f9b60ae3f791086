"""Energy per run: the meters (RAPL on a fake powercap tree, the labelled estimate), grid profiles,
and the summary keys of a real run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tests._dist import train_ranks

import vatra
from vatra.config import EnergyConfig
from vatra.engine import Plugin, Trainer
from vatra.errors import ConfigError
from vatra.monitor.energy import EstimateMeter, RaplMeter, open_meter, read_profile
from vatra.monitor.energy.meters import worst_source
from vatra.monitor.energy.profile import parse_time
from vatra.monitor.report import write_report
from vatra.rundir import read_jsonl


def fake_powercap(root: Path, package_uj: int, max_uj: int, dram_uj: int = 0) -> Path:
    """A powercap tree as Linux lays it out: a package with core and dram subzones, and psys."""
    zones = {
        "intel-rapl:0": ("package-0", package_uj),
        "intel-rapl:0/intel-rapl:0:0": ("core", 123),
        "intel-rapl:0/intel-rapl:0:1": ("dram", dram_uj),
        "intel-rapl:1": ("psys", 999),
    }
    for rel, (name, uj) in zones.items():
        z = root / rel
        z.mkdir(parents=True)
        (z / "name").write_text(name + "\n")
        (z / "energy_uj").write_text(f"{uj}\n")
        (z / "max_energy_range_uj").write_text(f"{max_uj}\n")
    # sysfs also links each subzone at the top level
    for sub in ("intel-rapl:0:0", "intel-rapl:0:1"):
        (root / sub).symlink_to(root / "intel-rapl:0" / sub)
    return root


def set_uj(root: Path, zone: str, uj: int) -> None:
    (root / zone / "energy_uj").write_text(f"{uj}\n")


def test_rapl_counts_package_and_dram_across_a_wrap_and_leaves_psys_and_core_out(tmp_path: Path) -> None:
    # Prepare: the package counter 1 J below its top
    root = fake_powercap(tmp_path, package_uj=9_000_000, max_uj=10_000_000, dram_uj=100)
    meter = RaplMeter(root)
    # Execute: +0.5 J, then past the top to 2 J (1 J to the top and 2 J after it); dram +0.25 J
    set_uj(root, "intel-rapl:0", 9_500_000)
    first = meter.read_j()
    set_uj(root, "intel-rapl:0", 2_000_000)
    set_uj(root, "intel-rapl:0/intel-rapl:0:1", 250_100)
    set_uj(root, "intel-rapl:1", 5)  # psys wrapping too: not counted beside the packages
    second = meter.read_j()
    # Assert
    assert first == pytest.approx(0.5)
    assert second == pytest.approx(0.5 + 0.5 + 2.0 + 0.25)
    assert meter.source == "rapl"
    assert RaplMeter(root, counts=False).read_j() == 0.0  # another local rank: the host counts once


def test_open_meter_takes_rapl_where_readable_and_else_a_labelled_estimate(tmp_path: Path) -> None:
    root = fake_powercap(tmp_path / "pc", 0, 10**9)
    assert open_meter(EnergyConfig(powercap_root=str(root)), "cpu", 0, 0).source == "rapl"
    missing = EnergyConfig(powercap_root=str(tmp_path / "none"))
    assert open_meter(missing, "cpu", 0, 0).source == "estimated"
    with pytest.raises(ConfigError, match=r"energy\.source = 'rapl'.*set energy\.source = 'auto'"):
        open_meter(missing.model_copy(update={"source": "rapl"}), "cpu", 0, 0)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        open_meter(EnergyConfig(source="nvml"), "cpu", 0, 0)
    assert worst_source({"nvml": 3, "estimated": 1}) == "estimated"  # one estimated rank: an estimate
    assert worst_source({"nvml": 2, "rapl": 1}) == "rapl"


def test_the_estimate_is_tdp_per_cpu_times_this_processs_cpu_seconds() -> None:
    # Prepare: a 64 W CPU spread over this machine's logical CPUs
    meter = EstimateMeter(tdp_w=64.0)
    cpu0 = time.process_time()
    # Execute: ~0.3 s of CPU
    x = torch.randn(256, 256)
    while time.process_time() - cpu0 < 0.3:
        x = x @ x.T / x.norm()
    used = time.process_time() - cpu0
    joules = meter.read_j()
    # Assert: the CPU clock ticks 10 ms at a time (psutil and process_time read it differently)
    assert meter.source == "estimated"
    assert joules == pytest.approx(64.0 / (psutil.cpu_count() or 1) * used, abs=64.0 * 0.03)
    assert EstimateMeter().watts_per_cpu == 4.0  # energy.cpu_tdp_w = 0: CodeCarbon's 4 W per thread


class BumpRapl(Plugin):
    """Adds 1 J to the fake package counter after every step (wrapping at its top), as a CPU would."""

    def __init__(self, root: Path, max_uj: int) -> None:
        self.zone, self.max_uj = root / "intel-rapl:0" / "energy_uj", max_uj

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        now = int(self.zone.read_text())
        self.zone.write_text(f"{(now + 1_000_000) % self.max_uj}\n")


def _fit(tmp_path: Path, energy: dict[str, Any], plugins: tuple[Plugin, ...] = ()) -> vatra.FitResult:
    cfg = {
        "run": {"progress": "off", "tensorboard": False},
        "monitor": {"enabled": False, "report": False},
        "checkpoint": {"enabled": False},
        "data": {"name": "synthetic", "samples": 400, "n_features": 8, "informative": 4, "classes": 3},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"steps": 12, "batch_size": 16, "eval_every": 0},
        "energy": energy,
    }
    return vatra.fit(cfg, run_dir=tmp_path / "run", plugins=plugins)


def test_a_run_sums_the_measured_joules_into_its_summary_and_metrics(tmp_path: Path) -> None:
    # Prepare: a fake RAPL package that wraps every 5 J, and 1 J drawn per step (4 J between reads)
    root = fake_powercap(tmp_path / "pc", 0, 5_000_000)
    energy = {"source": "rapl", "powercap_root": str(root), "every": 4, "grid_g_per_kwh": 200.0}
    # Execute
    result = _fit(tmp_path, energy, (BumpRapl(root, 5_000_000),))
    # Assert: 12 J over 12 steps, the counter wrapped twice on the way
    s = result.summary
    assert s["energy_source"] == "rapl" and s["energy_ranks"] == {"rapl": 1}
    assert s["energy_kwh"] == pytest.approx(12 / 3.6e6)
    assert s["co2_kg"] == pytest.approx(12 / 3.6e6 * 0.2)
    assert "grid_g_per_kwh = 200" in s["co2_intensity"]
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    # at step 4 the 4th step's joule is not drawn yet (the bump comes after the meter in the step)
    assert [(r["step"], r["energy_j"]) for r in rows if "energy_j" in r] == [(4, 3.0), (8, 7.0), (12, 11.0)]
    assert all(r["power_w"] > 0 for r in rows if "power_w" in r)
    on_disk = json.loads((result.run_dir / "summary.json").read_text())
    assert on_disk["energy_kwh"] == pytest.approx(12 / 3.6e6)
    page = write_report(result.run_dir).read_text()
    assert "energy (rapl)<b>0.00333 Wh" in page and "CO2<b>0.000667 g" in page


def test_without_a_meter_the_summary_says_estimated_and_prices_co2_by_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "flat.csv"
    hours = "\n".join(f"2024-01-01 {h:02d}:00:00,300" for h in range(24))
    profile.write_text(f"datetime,carbon_intensity_avg\n{hours}\n")
    result = _fit(tmp_path, {"powercap_root": str(tmp_path / "none"), "intensity_csv": str(profile)})
    s = result.summary
    assert s["energy_source"] == "estimated" and s["energy_kwh"] > 0
    assert s["co2_kg"] == pytest.approx(s["energy_kwh"] * 0.3)
    assert "hour-of-day means" in s["co2_intensity"]  # the run is not on 2024-01-01


def test_a_bad_intensity_file_stops_the_run_before_training_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("zone,value\nGB,12\n")
    with pytest.raises(ConfigError, match=r"bad.csv: not a price or intensity profile \(no time column"):
        _fit(tmp_path, {"intensity_csv": str(bad)})
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


ELECTRICITY_MAPS = (
    "Datetime (UTC),Country,Zone Name,Zone Id,Carbon Intensity gCO₂eq/kWh (direct),"
    "Carbon Intensity gCO₂eq/kWh (Life cycle),Data Source\n"
    "2024-01-01 00:00:00,Germany,Germany,DE,410.5,450.1,entsoe.eu\n"
    "2024-01-01 01:00:00,Germany,Germany,DE,380.0,420.0,entsoe.eu\n"
    "2024-01-01 02:00:00,Germany,Germany,DE,,430.0,entsoe.eu\n"
    "2024-01-01 03:00:00,Germany,Germany,DE,300.0,340.0,entsoe.eu\n"
)

UK_API = {
    "data": [
        {
            "from": "2024-03-01T00:00Z",
            "to": "2024-03-01T00:30Z",
            "intensity": {"forecast": 150, "actual": 140},
        },
        {
            "from": "2024-03-01T00:30Z",
            "to": "2024-03-01T01:00Z",
            "intensity": {"forecast": 160, "actual": None},
        },
    ]
}


def test_electricity_maps_csv_reads_the_direct_column_hourly(tmp_path: Path) -> None:
    path = tmp_path / "DE_2024_hourly.csv"
    path.write_text(ELECTRICITY_MAPS, encoding="utf-8")
    p = read_profile(path)
    t0 = parse_time("2024-01-01T00:00:00+00:00")
    assert p.unit == "Carbon Intensity gCO₂eq/kWh (direct)"
    assert p.values == (410.5, 380.0, 300.0)  # the hour without a value is a gap
    assert p.value_at(t0 + 1800) == 410.5 and p.value_at(t0 + 3 * 3600 + 10) == 300.0
    # the gap and times outside: that hour of the day's mean (here one day: the hour itself, or all)
    assert p.value_at(t0 + 86400 + 3600) == 380.0
    assert p.value_at(t0 + 2 * 3600 + 5) == pytest.approx((410.5 + 380.0 + 300.0) / 3)


def test_uk_carbon_intensity_json_takes_actual_else_forecast(tmp_path: Path) -> None:
    path = tmp_path / "uk.json"
    path.write_text(json.dumps(UK_API))
    p = read_profile(path)
    assert p.values == (140.0, 160.0)
    assert p.ends[-1] - p.starts[0] == 3600.0
    regional = tmp_path / "regional.json"
    regional.write_text(json.dumps({"data": [{"regionid": 13, "shortname": "London", **UK_API}]}))
    assert read_profile(regional).values == (140.0, 160.0)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"data": [{"from": "2024-03-01T00:00Z"}]}', "no 'intensity' key"),
        ("time,price\n2024-01-01 00:00,abc\n", "line 2"),
        ("time,price\n2024-01-01 00:00,nan\n", "not a finite number"),
        ("time,a,b\n2024-01-01 00:00,1,2\n", "no value column"),
        ("time,price\n", "no rows"),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_problem(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "p.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says) as err:
        read_profile(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.slow(20)  # two spawned ranks loading digits: the only test of the sum over ranks
def test_two_ranks_sum_their_energy_into_rank_0s_summary(tmp_path: Path) -> None:
    # Prepare / Execute: vatra train's two workers, each with its own estimate
    sets = ("train.steps=10", "energy.every=5", "energy.source=estimated", "checkpoint.enabled=false")
    summary = train_ranks(tmp_path / "run", *sets)
    # Assert: both ranks' meters took part in each sum
    assert summary["energy_ranks"] == {"estimated": 2} and summary["energy_source"] == "estimated"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    sums = [r["energy_j"] for r in rows if "energy_j" in r]
    assert len(sums) == 2 and 0 < sums[0] <= sums[1] <= summary["energy_kwh"] * 3.6e6


def test_nvml_counts_a_gpus_work() -> None:
    """Runs where a GPU and nvidia-ml-py are present (bench/gpu_check.py's energy part uses it too)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    meter = open_meter(EnergyConfig(), "cuda", 0, 0)
    x = torch.randn(4096, 4096, device="cuda")
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:  # NVML's counter moves every ~100 ms: work long enough
        for _ in range(50):
            x = x @ x / x.norm()
        torch.cuda.synchronize()
    joules = meter.read_j()
    meter.close()
    assert meter.source == "nvml" and joules > 0
