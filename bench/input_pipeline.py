"""Streaming Parquet through vatra's loader vs pyarrow's own read rate of the same file.

    python bench/input_pipeline.py [--rows 2000000] [--reps 3] [--batch 1024]

Writes a Parquet table once (``--rows`` rows: 16 float32 features and an int64 class label, row
groups of 65,536 rows, pyarrow's default snappy compression). Each rep then times, in this one
process, in a rotating order:

- ``pyarrow``: ``ParquetFile.read_row_group`` of every row group (the needed columns, pyarrow's
  threads), then ``to_numpy`` of each column: the file decoded into arrays, one row group at a time.
  (``read_table`` of the whole file is no faster, and its rate swings 2-19 M rows/s here with the
  page faults of materialising 150 MB at once.)
- ``vatra, workers=W``: one epoch of the train split of ``data.name = "table"`` with
  ``data.streaming = true`` (every training row once: standardised, shuffled, cut into batches of
  tensors) through the trainer's own loader (``StreamBatches``, a torch DataLoader with W workers).

The split holds out 10% of the rows (hashed), so vatra's rows/s count the rows it yields. Reports
rows/s and the ratio to pyarrow per rep; the target is >= 0.7.
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
import torch

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.data import DataContext, build_dataset
from vatra.data.loader import StreamBatches

FEATURES = 16


def write_table(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    cols = {f"f{i}": rng.normal(size=rows).astype(np.float32) for i in range(FEATURES)}
    cols["label"] = rng.integers(0, 10, rows)
    pq.write_table(pa.table(cols), path, row_group_size=65_536)


def pyarrow_rate(path: Path) -> float:
    columns = [*(f"f{i}" for i in range(FEATURES)), "label"]
    t0 = time.perf_counter()
    pf = pq.ParquetFile(path)
    rows = 0
    for g in range(pf.num_row_groups):
        arrays = [c.to_numpy() for c in pf.read_row_group(g, columns=columns).columns]
        rows += len(arrays[0])
    return rows / (time.perf_counter() - t0)


def vatra_rate(path: Path, workers: int, batch: int, run_dir: Path) -> float:
    cfg = config_from_dict(
        {
            "data": {
                "name": "table",
                "path": str(path),
                "target": "label",
                "streaming": True,
                "val_fraction": 0.1,
                "workers": workers,
            },
            "train": {"batch_size": batch, "task": "classification"},
        }
    )
    # The fitted standardisation is saved on the first build and reused: the rate is the epoch's.
    train, _, _ = build_dataset(cfg.data, DataContext(seed=0, run_dir=run_dir))
    batches = StreamBatches(
        train, rank=0, world_size=1, batch_size=batch, seed=0, workers=workers, prefetch_factor=2,
        device=torch.device("cpu"),
    )  # fmt: skip
    steps = train.rows_per_epoch() // batch
    t0 = time.perf_counter()
    rows = 0
    for _ in range(steps):
        _, target = batches.next()
        rows += len(target)
    elapsed = time.perf_counter() - t0
    batches.close()
    return rows / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "table.parquet"
        write_table(path, args.rows)
        mb = path.stat().st_size / 2**20
        run_dir = Path(tmp) / "run"
        vatra_rate(path, 0, args.batch, run_dir)  # fit and save the preprocessing; warm the page cache
        names = ["pyarrow", "workers=0", "workers=2"]
        rows = []
        for rep in range(args.reps):
            order = names[rep % 3 :] + names[: rep % 3]
            rate: dict[str, float] = {}
            for name in order:
                if name == "pyarrow":
                    rate[name] = pyarrow_rate(path)
                else:
                    rate[name] = vatra_rate(path, int(name.split("=")[1]), args.batch, run_dir)
            rows.append(
                {
                    "rep": rep,
                    **{f"{k}_rows_per_s": v for k, v in rate.items()},
                    "ratio_workers0": rate["workers=0"] / rate["pyarrow"],
                    "ratio_workers2": rate["workers=2"] / rate["pyarrow"],
                }
            )
    print_table(
        ["rep", "pyarrow rows/s", "vatra w=0 rows/s", "vatra w=2 rows/s", "ratio w=0", "ratio w=2"],
        [
            [r["rep"], r["pyarrow_rows_per_s"], r["workers=0_rows_per_s"], r["workers=2_rows_per_s"],
             r["ratio_workers0"], r["ratio_workers2"]]
            for r in rows
        ],
    )  # fmt: skip
    med0 = statistics.median(r["ratio_workers0"] for r in rows)
    med2 = statistics.median(r["ratio_workers2"] for r in rows)
    print(f"file {mb:.0f} MB; median ratio to pyarrow: workers=0 {med0:.3f}, workers=2 {med2:.3f}")
    write_result(
        "input_pipeline",
        {"rows": args.rows, "batch": args.batch, "file_mb": mb, "reps": rows, "median_ratio_workers0": med0,
         "median_ratio_workers2": med2},
    )  # fmt: skip


if __name__ == "__main__":
    main()
