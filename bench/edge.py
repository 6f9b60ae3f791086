"""Edge models: size, latency and accuracy of fp32, PTQ (torchao, ORT, ExecuTorch), QAT, structured pruning.

  python bench/edge.py [--calls 200] [--only digits|images|cancer] [--no-executorch]

Three models, each trained in this process: the digits MLP (64 → 256 → 256 → 10, scikit-learn's
8×8 digits), a small CNN (conv 16 → conv 32 → global pool → 10) on an image folder of PNG files
decoded with PIL (``data.name = "images"``; the bench writes the digits as 8×8 grayscale PNGs,
one folder per class, as no image set ships), and an MLP (30 → 64 → 64 → 2) on the tabular
example's breast-cancer table. Runs per model: fp32; QAT int8 (``edge.qat = "int8"``) and QAT
int4w (torchao's QATConfig), both after a float warm-up of half the steps; structured pruning of
80 % of the hidden neurons or channels, gradual over the first half and fine-tuned after; 80 %
structured + QAT int8; and 50 / 80 / 90 % structured one-shot at export from the fp32 run (no
fine-tuning: what the cut alone costs). Each variant is written as ``vatra edge export`` writes it (the
structured runs with their zeroed neurons removed) and measured as loaded: weights file size (gz:
gzip-compressed), p50/p95 of ``--calls`` calls at batch 1 on one thread, validation accuracy.
"recovered": torchao's measure, (QAT − PTQ) / (fp32 − PTQ), n/a when PTQ lost nothing.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from _common import print_table, write_result

STEPS = {"digits": 150, "images": 100, "cancer": 100}
HALF = {k: v // 2 for k, v in STEPS.items()}


def write_images(folder: Path) -> Path:
    """scikit-learn's digits as 8×8 grayscale PNGs, ``root/<digit>/<i>.png``."""
    from PIL import Image

    from vatra.data.stratify import bundled_digits

    x, y = bundled_digits()  # (1797, 64) in [0, 16], (1797,)
    root = folder / "digits-png"
    for i, (pixels, label) in enumerate(zip(x, y, strict=True)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        img = Image.fromarray((pixels.reshape(8, 8) * (255 / 16)).astype(np.uint8), mode="L")
        img.save(root / str(label) / f"{i}.png")
    return root


def data_config(name: str, folder: Path) -> dict[str, Any]:
    if name == "digits":
        return {"data": {"name": "digits"}, "model": {"name": "mlp", "hidden": [256, 256]}}
    if name == "images":
        data = {
            "name": "images",
            "path": str(folder / "digits-png"),
            "image_size": [8, 8],
            "image_mode": "L",
        }
        return {"data": data | {"val_fraction": 0.2}, "model": {"name": "cnn", "channels": [16, 32]}}
    data = {
        "name": "table",
        "path": str(folder / "cancer.parquet"),
        "target": "diagnosis",
        "val_fraction": 0.2,
    }
    return {"data": data, "model": {"name": "mlp", "hidden": [64, 64]}}


def write_table(folder: Path) -> None:
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()  # the table examples/tabular/make_data.py writes
    columns = {n.replace(" ", "_"): bunch.data[:, i] for i, n in enumerate(bunch.feature_names)}
    columns["diagnosis"] = [str(bunch.target_names[t]) for t in bunch.target]
    pq.write_table(pa.table(columns), folder / "cancer.parquet")


def train(name: str, folder: Path, edge: dict[str, Any]) -> Path:
    import vatra

    cfg = {
        "run": {"progress": "off", "tensorboard": False, "out_dir": str(folder / "runs")},
        **data_config(name, folder),
        "train": {"steps": STEPS[name], "batch_size": 64, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.003},
        "monitor": {"report": False},
        "edge": edge,
    }
    return vatra.fit(cfg).run_dir


def measure_variant(run: Path, folder: Path, target: str, quant: str, sparsity: float, calls: int) -> dict:
    """One variant written as ``vatra edge export`` writes it, measured as loaded."""
    from vatra.edge.export import Recipe, variant_runner, write_variant
    from vatra.edge.measure import measure, validation_rows
    from vatra.serve.folder import WEIGHTS
    from vatra.serve.weights import load_run_model

    rm = load_run_model(run)
    rows = validation_rows(rm, run)
    recipe = Recipe(quant, "structured" if sparsity else "none", sparsity)
    start = time.perf_counter()
    out = write_variant(rm, run, recipe, target, rows, folder)
    written = time.perf_counter() - start
    weights = out / WEIGHTS[target]
    size = weights.stat().st_size
    row = measure(variant_runner(out), rows, rm.cfg.train.task, size, batch=32, calls=calls, reference=None)
    import json

    edge = json.loads((out / "vatra-model.json").read_text())["edge"]
    return row | {"gz_bytes": len(gzip.compress(weights.read_bytes())), "write_s": written} | edge


def bench_model(name: str, calls: int, executorch: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vatra-edge-bench-") as tmp:
        folder = Path(tmp)
        if name == "images":
            write_images(folder)
        if name == "cancer":
            write_table(folder)
        half = HALF[name]

        def structured(s: float) -> dict[str, Any]:
            return {"prune": "structured", "sparsity": s, "prune_end_step": half, "prune_every": 10}

        start = time.perf_counter()
        runs = {
            "fp32": train(name, folder, {}),
            "qat8": train(name, folder, {"qat": "int8", "qat_start_step": half}),
            "qat4": train(name, folder, {"qat": "int4w", "qat_start_step": half}),
            "s80": train(name, folder, structured(0.8)),
            "s80+qat8": train(name, folder, {**structured(0.8), "qat": "int8", "qat_start_step": half}),
        }
        train_s = time.perf_counter() - start
        sparsity = {"s80": 0.8, "s80+qat8": 0.8}
        n = iter(range(1000))

        def add(
            label: str, run: str, target: str, quant: str = "none", stage: str = "", cut: float = 0.0
        ) -> None:
            s = cut or sparsity.get(run, 0.0)
            row = measure_variant(runs[run], folder / f"v{next(n)}", target, quant, s, calls)
            rows.append(row | {"label": label, "run": run, "backend": target, "stage": stage, "model": name})

        add("PyTorch fp32 (pt2)", "fp32", "pt2", stage="fp32")
        add("ORT fp32", "fp32", "onnx", stage="fp32")
        add("ORT int8 dynamic (PTQ)", "fp32", "onnx", "dynamic", "PTQ")
        add("ORT int8 static (PTQ)", "fp32", "onnx", "static", "PTQ")
        add("torchao int8 dynamic (PTQ, pt2)", "fp32", "pt2", "dynamic", "PTQ")
        add("torchao int4w (PTQ, pt2)", "fp32", "pt2", "int4w", "PTQ")
        add("QAT int8 → torchao int8", "qat8", "pt2", "dynamic", "QAT")
        add("QAT int8 → ORT int8", "qat8", "onnx", "dynamic", "QAT")
        add("QAT int4w → torchao int4w", "qat4", "pt2", "int4w", "QAT")
        for cut in (0.5, 0.8, 0.9):
            add(
                f"structured {cut:.0%} one-shot, no fine-tuning, ORT fp32",
                "fp32",
                "onnx",
                stage="pruned",
                cut=cut,
            )
        add("structured 80% gradual + fine-tuned ORT fp32", "s80", "onnx", stage="pruned")
        add("structured 80% + QAT int8 → ORT int8", "s80+qat8", "onnx", "dynamic", "pruned + QAT")
        if executorch:
            add("ExecuTorch fp32 (XNNPACK)", "fp32", "executorch", stage="fp32")
            add("ExecuTorch int8 dynamic (PTQ)", "fp32", "executorch", "dynamic", "PTQ")
            add("QAT int4w → ExecuTorch int4w", "qat4", "executorch", "int4w", "QAT")
            add(
                "structured 80 % + QAT int8 → ExecuTorch int8",
                "s80+qat8",
                "executorch",
                "dynamic",
                "pruned + QAT",
            )
        for r in rows:
            r["train_s_all_runs"] = train_s
    return rows


def recovered(rows: list[dict[str, Any]], ptq: str, qat: str) -> str:
    by = {r["label"]: r["accuracy"] for r in rows}
    drop = by["PyTorch fp32 (pt2)"] - by[ptq]
    if drop == 0:
        return "n/a (PTQ lost nothing)"
    return f"{100 * (by[qat] - by[ptq]) / drop:.0f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--only", choices=sorted(STEPS), default=None)
    parser.add_argument("--no-executorch", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    all_rows: list[dict[str, Any]] = []
    for name in [args.only] if args.only else list(STEPS):
        rows = bench_model(name, args.calls, not args.no_executorch)
        all_rows += rows
        torch_fp32, ort_fp32 = rows[0], rows[1]
        int8 = recovered(rows, "torchao int8 dynamic (PTQ, pt2)", "QAT int8 → torchao int8")
        int4 = recovered(rows, "torchao int4w (PTQ, pt2)", "QAT int4w → torchao int4w")
        print(f"\n{name} (fp32 accuracy {torch_fp32['accuracy']:.4f}; training all 5 runs "
              f"{rows[0]['train_s_all_runs']:.0f} s): QAT recovered {int8} of the int8 PTQ drop, "
              f"{int4} of the int4w one")  # fmt: skip
        heads = ["variant", "params", "KB", "gz KB", "size vs ORT fp32", "p50 ms", "p95 ms", "vs PyTorch",
                 "vs ORT", "accuracy"]  # fmt: skip
        table = []
        for r in rows:
            lat = r["latency_ms_batch1"]
            table.append([
                r["label"], r["parameters"], r["size_bytes"] / 1e3, r["gz_bytes"] / 1e3,
                f"{r['size_bytes'] / ort_fp32['size_bytes']:.2f}", lat["p50"], lat["p95"],
                f"{torch_fp32['latency_ms_batch1']['p50'] / lat['p50']:.2f}x",
                f"{ort_fp32['latency_ms_batch1']['p50'] / lat['p50']:.2f}x", f"{r['accuracy']:.4f}",
            ])  # fmt: skip
        print_table(heads, table)
    wall = time.perf_counter() - start
    print(f"\nwall {wall:.0f} s")
    write_result(
        f"edge-{args.only}" if args.only else "edge", {"calls": args.calls, "rows": all_rows, "wall_s": wall}
    )


if __name__ == "__main__":
    main()
