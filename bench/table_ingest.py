"""Ingest with validation against a plain Delta write of the same frame.

  python bench/table_ingest.py [--rows 1000000] [--repeats 3]

A 20-column table (15 float, 3 integer, 2 category columns) of ``--rows`` rows is written once as
a Parquet file. Each repeat, side by side in this process:

* ``plain``: ``deltalake.write_deltalake`` of the frame (already in memory) into a fresh table;
* ``first ingest``: ``vatra.data.tables.ingest`` of the file into a fresh table (read the file,
  infer and pin the schema, write, record the commit);
* ``validated ingest``: the same file appended again to that table, validated against the pinned
  schema first (the path every later ingest takes).

Reported: median seconds and rows/s of each, and each ingest's rows/s as a ratio of ``plain``'s
(target ≥ 0.5 for the validated ingest), plus the validation alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from _common import print_table, write_result


def frame(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, object] = {f"f{i}": rng.normal(i, 1 + i / 10, rows) for i in range(15)}
    cols.update({f"n{i}": rng.integers(0, 1000 * (i + 1), rows) for i in range(3)})
    cols["site"] = pa.array(rng.choice([f"site-{k}" for k in range(12)], rows))
    cols["grade"] = pa.array(rng.choice(["a", "b", "c", "d"], rows))
    return pa.table(cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from deltalake import write_deltalake

    from vatra.data.tables.delta import Table, read_file
    from vatra.data.tables.writer import ingest

    times: dict[str, list[float]] = {
        "plain": [],
        "first ingest": [],
        "validated ingest": [],
        "validate only": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        data = frame(args.rows)
        src = Path(tmp) / "batch.parquet"
        pq.write_table(data, src)
        for r in range(args.repeats):
            t0 = time.perf_counter()
            write_deltalake(f"{tmp}/plain{r}", data)
            times["plain"].append(time.perf_counter() - t0)
            table = Table.at(f"{tmp}/vatra{r}")
            t0 = time.perf_counter()
            ingest(table, [str(src)])
            times["first ingest"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            done = ingest(table, [str(src)])
            times["validated ingest"].append(time.perf_counter() - t0)
            assert done.version == 1 and not done.forced
            schema = table.schema()
            assert schema is not None
            batch = read_file(str(src))
            t0 = time.perf_counter()
            assert schema.validate(batch) == []
            times["validate only"].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        [name, med[name], args.rows / med[name], med["plain"] / med[name] if name != "validate only" else "-"]
        for name in times
    ]
    print(f"{args.rows:,} rows x 20 columns, {args.repeats} repeats (median)")
    print_table(["path", "seconds", "rows/s", "rows/s vs plain write"], rows)
    write_result(
        "table_ingest",
        {
            "rows": args.rows,
            "columns": 20,
            "repeats": args.repeats,
            "seconds": times,
            "median_s": med,
            "ratio_validated_vs_plain": med["plain"] / med["validated ingest"],
            "ratio_first_vs_plain": med["plain"] / med["first ingest"],
        },
    )


if __name__ == "__main__":
    main()
