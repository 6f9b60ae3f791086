"""``vatra meta adapt RUN --save DIR``: the initialisation adapted to the new data, written as a model
folder that ``vatra.load``, ``vatra predict``, ``vatra serve`` and ``vatra model register`` read.

The CLI joins the two layers (``vatra.meta`` adapts, ``vatra.serve`` writes the folder; neither
imports the other). The new data is read through a stand-in run folder holding a copy of the run's
fitted preprocessing: a table run's scaling and class encoding are reused as in meta-training, and
a fresh fit (a run trained on another source) lands there, never in the run folder, so the model
folder carries the exact preprocessing the adapted model was fed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.data import DatasetSpec
from vatra.errors import ConfigError

SAVE = ("vatra meta adapt", "--save")
PREPROCESS = Path("data") / "preprocess.json"


def stand_in(run: Path, folder: Path) -> Path:
    """``folder`` made a stand-in run folder for reading the new data: the run's fitted
    preprocessing copied in (if it has one)."""
    if (run / PREPROCESS).is_file():
        (folder / PREPROCESS).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run / PREPROCESS, folder / PREPROCESS)
    return folder


@dataclass
class NewTask:
    """What ``meta adapt`` read: the config pointed at the new data, its rows (training split then
    validation split) and the spec and stand-in folder they were read with."""

    cfg: Config
    x: Any  # torch.Tensor (n, ...)
    y: np.ndarray  # (n,) labels 0..ways-1
    spec: DatasetSpec
    folder: Path


def save_adapted(
    run: Path,
    task: NewTask,
    init: dict[str, Any],
    model: Any,
    loss: Any,
    *,
    shots: int,
    steps: int | None,
    lr: float | None,
    seed: int,
    save: Path,
    fmt: str,
) -> tuple[Path, Any]:
    """Adapt ``model`` on one support set of ``shots`` rows per class (the curve's first draw at
    that K) and write it as the model folder ``save``; returns the folder and the adaptation."""
    from torch import nn

    from vatra.meta.adapt import INIT_FILE, adapt_once, model_spec
    from vatra.serve.export import signature_of, write_folder
    from vatra.serve.lineage import lineage
    from vatra.serve.weights import RunModel

    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.modules()):
        raise ConfigError(
            "vatra meta adapt --save: the model has batch norm, whose running statistics meta-training "
            "never updates (the inner loop normalises with each batch's); a saved model would score "
            "with them: meta-train a model without batch norm"
        )
    pre, standardize = _fitted(task.folder)
    ways = int(init["ways"])
    rm = RunModel(task.cfg, model, model_spec(init, task.spec), pre, standardize, {}, ways or None)
    source = task.cfg.data.name
    try:
        signature_of(rm, source)  # a label for each of the task's outputs, before any work
    except ConfigError as err:
        raise ConfigError(
            f"vatra meta adapt --save: {err}; give rows of {ways} classes, or meta-train for fewer ways"
        ) from None
    done = adapt_once(model, loss, init, task.x, task.y, shots, steps=steps, lr=lr, seed=seed)
    rest = np.setdiff1d(np.arange(len(task.y)), done.support)
    rm.checkpoint = {"meta_init": str(INIT_FILE), "algorithm": init["algorithm"]}
    record = lineage(run, task.cfg, rm.checkpoint)
    record["adaptation"] = {
        "run": str(run.resolve()),
        "data": task.cfg.data.path or task.cfg.data.name,
        "shots": shots,
        "ways": ways,
        "seed": seed,
        "support_rows": len(done.support),
        # positions among the new data's rows as read: its training split, then its validation split
        "support_index": done.support.tolist(),
        "inner_steps": steps if steps is not None else int(init["inner_steps"]),
        "inner_lr": lr,  # None: the meta-learned (or meta-trained) inner LRs
        "accuracy": done.accuracy,
        "scored_rows": done.scored,
    }
    check = {"x": task.x[rest[:2048]].numpy()}  # the rows it was not adapted on
    folder = write_folder(rm, save, fmt, record, check, source, SAVE)
    return folder, done


def _fitted(folder: Path) -> tuple[Any, dict[str, list[float]] | None]:
    """The preprocessing the new data was read with: a table's, or array inputs' mean and std."""
    path = folder / PREPROCESS
    if not path.is_file():
        return None, None
    raw = json.loads(path.read_text())
    if "format" in raw:
        from vatra.data.tabular import Preprocess

        return Preprocess.load(path), None
    if {"mean", "std"} <= set(raw):
        return None, {"mean": list(raw["mean"]), "std": list(raw["std"])}
    return None, None
