"""Write three hospitals' own CSV files, a held-out file for the server, and all sites in one table.

    python examples/fl_owners/make_data.py

scikit-learn's bundled breast-cancer data (569 rows, 30 measurements, the diagnosis), split by a
seeded shuffle into 3 sites of unequal size (the data owners) and 15 % held out for the server.
``data/all_sites.csv`` holds the sites' rows with a ``site`` column: a simulation can split it into
the same owners with ``federated.partition.method = "column"``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
from sklearn.datasets import load_breast_cancer

SHARES = (0.5, 0.3, 0.2)  # of the owners' rows: one large hospital, two smaller ones


def main() -> Path:
    bunch = load_breast_cancer()
    columns = {name.replace(" ", "_"): bunch.data[:, i] for i, name in enumerate(bunch.feature_names)}
    columns["diagnosis"] = [str(bunch.target_names[t]) for t in bunch.target]
    table = pa.table(columns)
    order = np.random.default_rng(0).permutation(table.num_rows)
    held = int(0.15 * len(order))
    out = Path(__file__).with_name("data")
    out.mkdir(exist_ok=True)
    pcsv.write_csv(table.take(order[:held]), out / "held_out.csv")
    owners = order[held:]
    cuts = np.cumsum([int(s * len(owners)) for s in SHARES[:-1]])
    parts = []
    for site, rows in enumerate(np.split(owners, cuts)):
        part = table.take(np.sort(rows))
        pcsv.write_csv(part, out / f"site_{site}.csv")
        parts.append(part.append_column("site", pa.array([f"site_{site}"] * part.num_rows)))
    pcsv.write_csv(pa.concat_tables(parts), out / "all_sites.csv")
    sizes = [p.num_rows for p in parts]
    malignant = [int(pc.sum(pc.equal(p["diagnosis"], "malignant")).as_py()) for p in parts]
    print(f"wrote {out}: sites of {sizes} rows ({malignant} malignant), {held} held out for the server")
    return out


if __name__ == "__main__":
    main()
