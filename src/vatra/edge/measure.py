"""What a variant costs and keeps: file size, p50/p95 latency on one thread, accuracy on validation rows.

Latency is measured on the written model folder as ``vatra.load`` runs it (a torch module, or an
ONNX Runtime session), on one intra-op thread, after warm-up calls; each call's wall time counts,
percentiles over the calls. The figures are this machine's: compare variants measured in one run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vatra.data import BatchedDataset, DataContext, build_dataset
from vatra.errors import ConfigError
from vatra.serve.predict import Runner
from vatra.serve.weights import RunModel

VAL_ROWS = 2048  # validation rows scored (accuracy) and used to calibrate static quantization
WARMUP = 5


@dataclass
class Rows:
    """Model inputs (``x`` and maybe ``ids``) and targets of the run's validation rows."""

    inputs: dict[str, np.ndarray]
    targets: np.ndarray

    def head(self, n: int) -> dict[str, np.ndarray]:
        return {k: v[:n] for k, v in self.inputs.items()}


def validation_rows(rm: RunModel, run_dir: Path, limit: int = VAL_ROWS) -> Rows:
    """Up to ``limit`` of the run's validation rows, built by the training data code."""
    cfg = rm.cfg
    heads = {name: h.task for name, h in cfg.train.multitask.heads.items()}
    ctx = DataContext(seed=cfg.run.seed, run_dir=run_dir, task=cfg.train.task, head_tasks=heads)
    val = build_dataset(cfg.data, ctx, cfg.train.task).val
    if val is None or len(val) == 0:  # type: ignore[arg-type]
        raise ConfigError(
            f"vatra edge: the run {run_dir} has no validation rows to calibrate and measure on; "
            "train with a validation split"
        )
    idx = np.arange(min(len(val), limit))  # type: ignore[arg-type]
    if isinstance(val, BatchedDataset):
        inputs, targets = val.get_batch(idx)
    else:  # a map-style dataset (an image folder: each item decoded): its items stacked
        items = [val[int(i)] for i in idx]
        inputs, targets = (
            torch.stack([x for x, _ in items]),
            torch.stack([torch.as_tensor(y) for _, y in items]),
        )
    if not isinstance(targets, torch.Tensor):
        raise ConfigError("vatra edge: measures models with one target (not multitask) for now")
    named = {k: v.numpy() for k, v in inputs.items()} if isinstance(inputs, dict) else {"x": inputs.numpy()}
    return Rows(named, targets.numpy())


def score(outputs: np.ndarray, targets: np.ndarray, task: str) -> dict[str, float]:
    """Accuracy (classification: argmax; multilabel: every label's sign) or RMSE (regression)."""
    if task == "classification" or (task == "auto" and targets.dtype.kind in "iu"):
        return {"accuracy": float(np.mean(outputs.argmax(axis=-1) == targets))}
    if task == "multilabel":
        return {"accuracy": float(np.mean((outputs > 0) == (targets > 0.5)))}
    return {"rmse": float(np.sqrt(np.mean((outputs.reshape(targets.shape) - targets) ** 2)))}


def latency_ms(run: Runner, inputs: dict[str, np.ndarray], calls: int) -> dict[str, float]:
    """p50 and p95 wall time of ``calls`` calls on ``inputs`` (after warm-up), on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ONNX Runtime sessions are opened with one thread by the caller
    try:
        for _ in range(WARMUP):
            run(inputs)
        times = np.empty(calls)
        for i in range(calls):
            start = time.perf_counter()
            run(inputs)
            times[i] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return {"p50": float(np.percentile(times, 50) * 1e3), "p95": float(np.percentile(times, 95) * 1e3)}


def measure(
    run: Runner,
    rows: Rows,
    task: str,
    size_bytes: int,
    *,
    batch: int,
    calls: int,
    reference: np.ndarray | None,
) -> dict[str, Any]:
    """One variant's report row: size, latency at batch 1 and at ``batch``, the validation score,
    and the largest difference of its outputs from the fp32 model's (``reference``)."""
    outputs = run(rows.inputs)
    row: dict[str, Any] = {
        "size_bytes": size_bytes,
        "size_mb": size_bytes / 1e6,
        "latency_ms_batch1": latency_ms(run, rows.head(1), calls),
        f"latency_ms_batch{batch}": latency_ms(run, _tiled(rows, batch), max(1, calls // 4)),
        **score(outputs, rows.targets, task),
    }
    if reference is not None:
        row["max_abs_diff_vs_fp32"] = float(np.max(np.abs(outputs - reference)))
    return row


def _tiled(rows: Rows, batch: int) -> dict[str, np.ndarray]:
    """``batch`` rows: the validation rows, repeated when there are fewer."""
    n = len(rows.targets)
    idx = np.arange(batch) % n
    return {k: np.ascontiguousarray(v[idx]) for k, v in rows.inputs.items()}
