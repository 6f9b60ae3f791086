"""Write cancer.parquet beside this file from scikit-learn's bundled breast-cancer data set.

    python examples/tabular/make_data.py

569 rows: 30 numeric measurements and the diagnosis ("malignant" or "benign"), the target.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_breast_cancer


def main() -> Path:
    bunch = load_breast_cancer()
    columns = {name.replace(" ", "_"): bunch.data[:, i] for i, name in enumerate(bunch.feature_names)}
    columns["diagnosis"] = [str(bunch.target_names[t]) for t in bunch.target]
    out = Path(__file__).with_name("cancer.parquet")
    pq.write_table(pa.table(columns), out)
    print(f"wrote {out} ({len(bunch.target)} rows, {len(columns) - 1} features)")
    return out


if __name__ == "__main__":
    main()
