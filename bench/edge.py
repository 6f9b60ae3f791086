"""Edge models: size, latency and accuracy of fp32, PTQ int8 (torchao, ONNX Runtime), QAT and pruned variants.

  python bench/edge.py [--calls 200] [--only digits|cancer]

Two models, each trained in this process: the digits MLP (64 → 256 → 256 → 10, scikit-learn's 8×8
digits) and an MLP (30 → 64 → 64 → 2) on the tabular example's breast-cancer table. Per model, runs:
fp32; QAT (``edge.qat = "int8"``, float warm-up for the first half); magnitude pruning to 80 %
trained in (gradual schedule over the first half); 80 % pruned + QAT. Each is exported with ``vatra edge
export`` and measured as loaded (one thread; p50/p95 of ``--calls`` calls at batch 1; the
validation rows' accuracy):

* PyTorch fp32 (``pt2``: torch.export of the float model): the baseline a user has;
* ONNX Runtime fp32, int8 dynamic, int8 static (calibrated on the validation rows);
* torchao int8 dynamic and static (``pt2``);
* structured pruning one-shot at export (50 / 80 / 90 % of hidden neurons removed, no fine-tuning);
* the QAT and pruned runs as ORT int8 dynamic (and QAT as torchao int8).

Size: the weights file; ``gz``: the file gzip-compressed (what unstructured zeros save on the wire
or on disk, as a dense file keeps them). "recovered": torchao's measure for QAT, the share of the
PTQ accuracy drop QAT wins back, (QAT − PTQ) / (fp32 − PTQ); n/a when PTQ lost nothing.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from _common import print_table, write_result

STEPS = {"digits": 200, "cancer": 100}


def data_config(name: str, folder: Path) -> dict[str, Any]:
    if name == "digits":
        return {"data": {"name": "digits"}, "model": {"name": "mlp", "hidden": [256, 256]}}
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()  # the table examples/tabular/make_data.py writes
    columns = {n.replace(" ", "_"): bunch.data[:, i] for i, n in enumerate(bunch.feature_names)}
    columns["diagnosis"] = [str(bunch.target_names[t]) for t in bunch.target]
    pq.write_table(pa.table(columns), folder / "cancer.parquet")
    data = {
        "name": "table",
        "path": str(folder / "cancer.parquet"),
        "target": "diagnosis",
        "val_fraction": 0.2,
    }
    return {"data": data, "model": {"name": "mlp", "hidden": [64, 64]}}


def train(name: str, folder: Path, edge: dict[str, Any]) -> Path:
    import vatra

    steps = STEPS[name]
    cfg = {
        "run": {"progress": "off", "tensorboard": False, "out_dir": str(folder / "runs")},
        **data_config(name, folder),
        "train": {"steps": steps, "batch_size": 64, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.003},
        "monitor": {"report": False},
        "edge": edge,
    }
    return vatra.fit(cfg).run_dir


def variants(run: Path, out: Path, target: str, quant: str, prune: str, sparsity: float, calls: int) -> list:
    from vatra.edge import Recipe, edge_export

    _, report = edge_export(run, out, target, Recipe(quant, prune, sparsity), calls=calls)
    for v in report["variants"]:
        v["gz_bytes"] = None
    chosen = out / ("model.onnx" if target == "onnx" else "model.pt2")
    report["variants"][-1]["gz_bytes"] = len(gzip.compress(chosen.read_bytes()))
    return report["variants"]


def bench_model(name: str, calls: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vatra-edge-bench-") as tmp:
        folder = Path(tmp)
        data_config(name, folder)  # writes the table once
        half = STEPS[name] // 2
        pruned = {"prune": "magnitude", "sparsity": 0.8, "prune_end_step": half}
        runs = {
            "fp32": train(name, folder, {}),
            "qat": train(name, folder, {"qat": "int8", "qat_start_step": half}),
            "mag80": train(name, folder, pruned),
            "mag80+qat": train(name, folder, {**pruned, "qat": "int8", "qat_start_step": half}),
        }
        n = iter(range(1000))

        def add(
            label: str, run: str, target: str, quant: str = "none", prune: str = "none", s: float = 0.0
        ) -> None:
            got = variants(runs[run], folder / f"out{next(n)}", target, quant, prune, s, calls)
            row = got[-1]  # the asked-for variant (fp32 first)
            row["label"], row["run"], row["backend"] = label, run, target
            rows.append(row)

        add("PyTorch fp32", "fp32", "pt2")
        add("ORT fp32", "fp32", "onnx")
        add("ORT int8 dynamic", "fp32", "onnx", "dynamic")
        add("ORT int8 static", "fp32", "onnx", "static")
        add("torchao int8 dynamic", "fp32", "pt2", "dynamic")
        add("torchao int8 static", "fp32", "pt2", "static")
        add("QAT → torchao int8", "qat", "pt2", "dynamic")
        add("QAT → ORT int8", "qat", "onnx", "dynamic")
        for s in (0.5, 0.8, 0.9):
            add(f"structured {int(s * 100)} % (one-shot) ORT fp32", "fp32", "onnx", "none", "structured", s)
        add("magnitude 80 % (trained) ORT fp32", "mag80", "onnx")
        add("magnitude 80 % + QAT → ORT int8", "mag80+qat", "onnx", "dynamic")
        add("magnitude 80 % + QAT → torchao int8", "mag80+qat", "pt2", "dynamic")
    for r in rows:
        r["model"] = name
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--only", choices=sorted(STEPS), default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    all_rows: list[dict[str, Any]] = []
    for name in [args.only] if args.only else list(STEPS):
        rows = bench_model(name, args.calls)
        all_rows += rows
        torch_fp32, ort_fp32 = rows[0], rows[1]
        by = {r["label"]: r for r in rows}
        ptq, qat = by["torchao int8 dynamic"]["accuracy"], by["QAT → torchao int8"]["accuracy"]
        drop = torch_fp32["accuracy"] - ptq
        recovered = f"{100 * (qat - ptq) / drop:.0f} %" if drop > 0 else "n/a (PTQ lost nothing)"
        print(f"\n{name}: QAT recovered {recovered} of the PTQ drop (fp32 {torch_fp32['accuracy']:.4f}, "
              f"PTQ {ptq:.4f}, QAT {qat:.4f})")  # fmt: skip
        heads = [
            "variant",
            "KB",
            "gz KB",
            "size vs ORT fp32",
            "p50 ms",
            "p95 ms",
            "vs PyTorch",
            "vs ORT",
            "accuracy",
        ]
        table = []
        for r in rows:
            lat = r["latency_ms_batch1"]
            table.append([
                r["label"], r["size_bytes"] / 1e3, (r["gz_bytes"] or 0) / 1e3,
                f"{r['size_bytes'] / ort_fp32['size_bytes']:.2f}", lat["p50"], lat["p95"],
                f"{torch_fp32['latency_ms_batch1']['p50'] / lat['p50']:.2f}x",
                f"{ort_fp32['latency_ms_batch1']['p50'] / lat['p50']:.2f}x", f"{r['accuracy']:.4f}",
            ])  # fmt: skip
        print_table(heads, table)
    wall = time.perf_counter() - start
    print(f"\nwall {wall:.0f} s")
    write_result("edge", {"calls": args.calls, "rows": all_rows, "wall_s": wall})


if __name__ == "__main__":
    main()
