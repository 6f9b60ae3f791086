"""Three monthly sensor exports from three suppliers, for the Delta table walk-through in README.md.

  python examples/delta/make_data.py [--rows 1500]

Each row is one machine-day: temperature (°C), vibration (mm/s), load (%), hours in service, the
supplier whose sensors sent it, and whether the machine failed within a week (the target). January
and February come from the same process. In March one supplier ("acme") silently switched its
temperature export to °F: the schema pinned in January refuses the file, and ``vatra data drift``
names the unit change and the supplier.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

HERE = Path(__file__).resolve().parent
SUPPLIERS = ("acme", "borealis", "castor")


def month(rows: int, seed: int, fahrenheit: str = "") -> pa.Table:
    rng = np.random.default_rng(seed)
    supplier = rng.choice(SUPPLIERS, rows)
    temp = rng.normal(62.0, 7.0, rows)
    vibration = rng.gamma(4.0, 0.8, rows)
    load = rng.uniform(15.0, 95.0, rows)
    hours = rng.integers(0, 20_000, rows)
    risk = 0.12 * (temp - 62) + 0.6 * (vibration - 3.2) + 0.03 * (load - 55) + hours / 20_000
    failed = (risk + rng.normal(0, 0.8, rows) > 1.0).astype(np.int64)
    if fahrenheit:
        temp = np.where(supplier == fahrenheit, temp * 9 / 5 + 32, temp)
    return pa.table(
        {
            "temperature": temp.round(2),
            "vibration": vibration.round(3),
            "load": load.round(1),
            "hours": hours,
            "supplier": supplier,
            "failed": failed,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1500)
    args = parser.parse_args()
    for name, seed, fahrenheit in (("jan", 1, ""), ("feb", 2, ""), ("mar", 3, "acme")):
        path = HERE / f"{name}.csv"
        pcsv.write_csv(month(args.rows, seed, fahrenheit), path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
