"""Write ranking.parquet beside this file: a small generated learning-to-rank set.

    python examples/ranking/make_data.py

300 queries with 5 to 30 candidate documents each; 12 features per (query, document); a
relevance grade 0..3 from a hidden linear score of the features plus noise, cut at quantiles
inside each query (as human graders rate documents relative to the query).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

QUERIES, FEATURES, SEED = 300, 12, 7


def main() -> Path:
    rng = np.random.default_rng(SEED)
    w = rng.normal(size=FEATURES)  # the hidden relevance direction
    qid, feats, rel = [], [], []
    for q in range(QUERIES):
        n = int(rng.integers(5, 31))
        x = rng.normal(size=(n, FEATURES)) + rng.normal(scale=0.5, size=FEATURES)  # a query's own offset
        score = x @ w + rng.normal(scale=1.0, size=n)
        grades = np.searchsorted(np.quantile(score, [0.5, 0.8, 0.95]), score)  # 0..3
        qid += [q] * n
        feats.append(x)
        rel.append(grades.astype(np.float64))
    x_all = np.concatenate(feats)
    columns = {
        "qid": qid,
        **{f"f{i}": x_all[:, i] for i in range(FEATURES)},
        "relevance": np.concatenate(rel),
    }
    out = Path(__file__).with_name("ranking.parquet")
    pq.write_table(pa.table(columns), out)
    print(f"wrote {out} ({len(qid)} rows, {QUERIES} queries)")
    return out


if __name__ == "__main__":
    main()
