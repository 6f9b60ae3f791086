"""Synthetic spot price traces with a daily cycle, written as AWS's describe-spot-price-history JSON.

Each zone's price is ``mean * (1 + amplitude * sin(2π (hour - peak + 6) / 24))`` times slow
noise, with rare spikes toward the on-demand price; a row is written when the price changes,
as AWS records it. Used by the tests and by ``examples/spot_seed`` (documented as synthetic).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np


def synthetic_prices(
    zones: dict[str, float],
    days: float,
    start: float = 1_790_000_000.0 // 86400 * 86400,
    instance_type: str = "p4d.24xlarge",
    amplitude: float = 0.3,
    peak_hour: float = 15.0,
    spikes_per_day: float = 0.3,
    cap: float | None = None,
    seed: int = 0,
) -> dict[str, list[dict[str, str]]]:
    """Hourly prices per zone (``zone -> mean USD per hour``) as describe-spot-price-history's JSON."""
    rng = np.random.default_rng(seed)
    rows = []
    hours = int(days * 24)
    for k, (zone, mean) in enumerate(sorted(zones.items())):
        walk = 0.0
        shift = 2.0 * k  # zones peak a couple of hours apart
        spike_left = 0
        for h in range(hours):
            hour = h % 24
            walk = 0.9 * walk + rng.normal(0.0, 0.03)
            price = (
                mean
                * (1 + amplitude * math.sin(2 * math.pi * (hour - peak_hour - shift + 6) / 24))
                * (1 + walk)
            )
            if spike_left == 0 and rng.random() < spikes_per_day / 24:
                spike_left = int(rng.integers(1, 4))
            if spike_left:
                price *= 1.8
                spike_left -= 1
            price = min(max(price, 0.2 * mean), cap or math.inf)
            t = datetime.fromtimestamp(start + h * 3600 + float(rng.integers(0, 300)), tz=UTC)
            rows.append({
                "AvailabilityZone": zone,
                "InstanceType": instance_type,
                "ProductDescription": "Linux/UNIX",
                "SpotPrice": f"{price:.6f}",
                "Timestamp": t.isoformat().replace("+00:00", "Z"),
            })  # fmt: skip
    rows.sort(key=lambda r: r["Timestamp"], reverse=True)  # newest first, as AWS lists them
    return {"SpotPriceHistory": rows}


def write_seed_traces(folder: Path) -> None:
    """The shipped example's traces: three us-east-1 zones of p4d.24xlarge over 30 days, and its
    Spot Advisor bucket. Synthetic: generated here with seed 0, not downloaded."""
    folder.mkdir(parents=True, exist_ok=True)
    zones = {"us-east-1a": 11.5, "us-east-1b": 12.5, "us-east-1c": 13.5}
    history = synthetic_prices(zones, days=30, cap=32.77, seed=0)
    rows = ",\n".join(json.dumps(r) for r in history["SpotPriceHistory"])  # one price change a line
    (folder / "prices.json").write_text('{"SpotPriceHistory": [\n' + rows + "\n]}\n", encoding="utf-8")
    (folder / "advisor.csv").write_text(
        "instance_type,region,interruption\np4d.24xlarge,us-east-1,>20%\n", encoding="utf-8"
    )


if __name__ == "__main__":  # python -m vatra.cost.sim.synth examples/spot_seed
    import sys

    write_seed_traces(Path(sys.argv[1]))
