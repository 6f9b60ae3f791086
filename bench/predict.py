"""``vatra predict`` throughput against a hand-written scoring loop over the same model.

  python bench/predict.py [--rows 1000000] [--batch-rows 65536] [--repeats 3]

The tabular example (examples/tabular: scikit-learn's breast-cancer table, 30 numeric columns and
a string diagnosis; its own model, ``model:build``) is trained for 60 steps in this process. A
Parquet file of ``--rows`` new rows is made by resampling its rows with 1 % noise. Then, side by
side, each ``--repeats`` times, all reading the file in ``--batch-rows`` batches and writing a
Parquet file of predictions:

* ``vatra predict``: :func:`vatra.serve.stream.predict_file` (what the CLI runs, without the
  process start), input checks, the training preprocessing, labels and per-class probabilities;
* ``hand loop``: the loop a user writes over the same torch model: read a batch, standardise with
  the fitted means and standard deviations from ``data/preprocess.json``, forward, softmax, argmax,
  write labels and probabilities;
* ``vatra predict (onnx)``: the same command on the run exported with ``--format onnx`` (ONNX Runtime).

Reported: median seconds and rows/s, and each as a ratio of the hand loop's rows/s. The outputs of
all three are compared (labels equal, probabilities within 1e-4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]


def make_rows(rows: int, path: Path) -> pa.Table:
    """The example's 569 rows (features only) resampled to ``rows`` with 1 % multiplicative noise."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    names = [n.replace(" ", "_") for n in bunch.feature_names]
    rng = np.random.default_rng(0)
    picked = bunch.data[rng.integers(0, len(bunch.data), rows)]
    picked = picked * (1 + 0.01 * rng.standard_normal(picked.shape))
    table = pa.table({"id": np.arange(rows), **{n: picked[:, i] for i, n in enumerate(names)}})
    pq.write_table(table, path, row_group_size=131_072)
    return table


def train(folder: Path) -> Path:
    from sklearn.datasets import load_breast_cancer

    import vatra

    bunch = load_breast_cancer()  # the table examples/tabular/make_data.py writes
    columns = {name.replace(" ", "_"): bunch.data[:, i] for i, name in enumerate(bunch.feature_names)}
    columns["diagnosis"] = [str(bunch.target_names[t]) for t in bunch.target]
    data = folder / "cancer.parquet"
    pq.write_table(pa.table(columns), data)
    cfg = {
        "run": {"progress": "off", "tensorboard": False, "out_dir": str(folder / "runs"),
                "import_paths": [str(ROOT / "examples" / "tabular")]},
        "data": {"name": "table", "path": str(data), "target": "diagnosis", "val_fraction": 0.2},
        "model": {"name": "model:build", "kwargs": {"hidden": 64, "dropout": 0.1}},
        "train": {"steps": 60, "batch_size": 32, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.003},
        "monitor": {"report": False},
    }  # fmt: skip
    return vatra.fit(cfg).run_dir


def hand_loop(model: torch.nn.Module, run: Path, data: Path, out: Path, batch_rows: int) -> int:
    """What a user writes without vatra predict: the same model, standardised by hand."""
    pre = json.loads((run / "data" / "preprocess.json").read_text())
    features, classes = pre["features"], pre["classes"][pre["target"][0]]
    mean = np.asarray(pre["mean"], np.float32)
    scale = (1.0 / np.asarray(pre["std"], np.float64)).astype(np.float32)
    labels = pa.array(classes)
    writer, rows = None, 0
    for batch in pq.ParquetFile(data).iter_batches(batch_size=batch_rows, columns=features):
        x = np.column_stack([batch.column(f).to_numpy().astype(np.float32) for f in features])
        x = (x - mean) * scale
        with torch.inference_mode():
            proba = torch.softmax(model(torch.from_numpy(x)), dim=1).numpy()
        cols = {"prediction": labels.take(pa.array(proba.argmax(axis=1)))}
        cols.update({f"proba_{c}": proba[:, j] for j, c in enumerate(classes)})
        table = pa.table(cols)
        if writer is None:
            writer = pq.ParquetWriter(out, table.schema)
        writer.write_table(table)
        rows += batch.num_rows
    assert writer is not None
    writer.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-rows", type=int, default=65_536)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import vatra
    from vatra.serve import export_run
    from vatra.serve.stream import predict_file

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run = train(folder)
        data = folder / "rows.parquet"
        make_rows(args.rows, data)
        onnx_dir = export_run(run, folder / "onnx", "onnx")
        predictor, onnx = vatra.load(run), vatra.load(onnx_dir)
        model = predictor.model
        assert model is not None
        cases = {
            "vatra predict": lambda out: predict_file(
                predictor, data, out, batch_rows=args.batch_rows, progress=False
            )["rows"],
            "hand loop": lambda out: hand_loop(model, run, data, out, args.batch_rows),
            "vatra predict (onnx)": lambda out: predict_file(
                onnx, data, out, batch_rows=args.batch_rows, progress=False
            )["rows"],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, case in cases.items():
                start = time.perf_counter()
                rows = case(folder / f"{name}.parquet")
                times[name].append(time.perf_counter() - start)
                assert rows == args.rows
        ref = pq.read_table(folder / "hand loop.parquet")
        for name in ("vatra predict", "vatra predict (onnx)"):
            got = pq.read_table(folder / f"{name}.parquet")
            assert got.column("prediction").equals(ref.column("prediction")), name
            for col in ref.column_names[1:]:
                diff = np.abs(got.column(col).to_numpy() - ref.column(col).to_numpy()).max()
                assert diff <= 1e-4, (name, col, diff)
    hand = args.rows / statistics.median(times["hand loop"])
    rows_out = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rate = args.rows / median
        rows_out.append({"case": name, "seconds": median, "rows_per_s": rate, "vs_hand_loop": rate / hand})
    print(f"{args.rows:,} rows, batches of {args.batch_rows:,}, median of {args.repeats}")
    print_table(
        ["case", "seconds", "rows/s", "× hand loop"],
        [[r["case"], r["seconds"], r["rows_per_s"], r["vs_hand_loop"]] for r in rows_out],
    )
    write_result("predict", {"rows": args.rows, "batch_rows": args.batch_rows, "cases": rows_out})


if __name__ == "__main__":
    main()
