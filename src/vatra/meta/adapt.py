"""Adaptation at the edge: the meta-learned initialisation fine-tuned on K labelled examples of a
new task, and the accuracy curve against K.

``vatra meta`` leaves the initialisation in its run folder as ``meta/init.pt`` (rank 0, at the end
of the run): the model's weights, the inner loop's LRs and what the inner loop adapts. For each K,
:func:`accuracy_curve` draws ``repeats`` support sets of K rows per class from the new data, adapts
a copy of the weights with the inner loop (the same steps and LRs as meta-training, unless told
otherwise) and scores the rows not drawn.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vatra.data import DatasetSpec
from vatra.errors import ConfigError
from vatra.meta.algorithms import InnerLoop, TaskLoss, adapt

INIT_FILE = Path("meta") / "init.pt"


def save_init(
    path: Path, model: nn.Module, loop: InnerLoop, lrs: dict[str, torch.Tensor], spec: DatasetSpec
) -> None:
    """Write the initialisation an adaptation starts from (weights, inner LRs, adapted names, and
    the data's shape the model was built for)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "weights": {n: t.detach().cpu() for n, t in model.state_dict().items()},
        "lrs": {n: a.detach().cpu() for n, a in lrs.items()},
        "algorithm": loop.algorithm,
        "inner_steps": loop.steps,
        "ways": loop.ways,
        "input_shape": list(spec.input_shape),
        "outputs": spec.num_classes,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_init(run_dir: Path) -> dict[str, Any]:
    """A run's ``meta/init.pt`` (tensors and plain values only: ``weights_only`` refuses code)."""
    path = run_dir / INIT_FILE
    if not path.is_file():
        raise ConfigError(
            f"{run_dir}: no {INIT_FILE} (a finished 'vatra meta' run writes it); pass the run folder of one"
        )
    try:
        with warnings.catch_warnings():  # torch warns about a foreign pickle before refusing it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged or foreign file: one line, not a traceback
        first = (str(err).strip().splitlines() or [""])[0]  # torch's own message runs to many lines
        raise ConfigError(
            f"{path}: not a meta-learned initialisation ({type(err).__name__}: {first})"
        ) from None
    if not isinstance(state, dict) or not {"weights", "lrs", "inner_steps", "ways", "outputs"} <= set(state):
        raise ConfigError(f"{path}: not a meta-learned initialisation (keys missing); re-run 'vatra meta'")
    return state


def model_spec(init: dict[str, Any], spec: DatasetSpec) -> DatasetSpec:
    """The new data's spec with the meta-trained model's width: the model is built as it was
    meta-trained (its first ``ways`` outputs are a task's classes), whatever the new task's count."""
    if list(spec.input_shape) != list(init["input_shape"]):
        raise ConfigError(
            f"the new data's rows have shape {list(spec.input_shape)}, but the model was meta-trained on "
            f"{list(init['input_shape'])}; give the same feature columns (data.features) as meta-training"
        )
    return replace(spec, num_classes=int(init["outputs"]))


@dataclass
class CurvePoint:
    """Accuracy on the rows not drawn, after adapting to ``shots`` rows per class: mean and standard
    deviation over ``repeats`` draws, and before adaptation (the initialisation alone)."""

    shots: int
    accuracy: float
    accuracy_std: float
    before: float
    repeats: int


def accuracy_curve(
    model: nn.Module,
    loss: Any,
    init: dict[str, Any],
    x: torch.Tensor,
    y: np.ndarray,
    shots: list[int],
    *,
    repeats: int = 5,
    steps: int | None = None,
    lr: float | None = None,
    seed: int = 0,
) -> list[CurvePoint]:
    """The curve of accuracy against K (``shots``) on the new task ``(x, y)``: see the module."""
    classes = np.unique(y)
    ways = int(init["ways"]) or len(classes)
    if len(classes) > ways or int(classes.max()) >= ways:
        raise ConfigError(
            f"the new data has classes {classes.tolist()}, but the initialisation was meta-learned for "
            f"{ways}-way tasks (labels 0..{ways - 1}); give at most {ways} classes, encoded 0..{ways - 1}"
        )
    rows = {int(c): np.flatnonzero(y == c) for c in classes}
    fewest = min(len(r) for r in rows.values())
    too_many = [k for k in shots if k >= fewest]
    if too_many:
        raise ConfigError(
            f"--shots {too_many[0]}: the new data has only {fewest} rows of its smallest class, and some "
            "must "
            f"remain to score; give --shots below {fewest}"
        )
    model.load_state_dict(init["weights"])
    params = {n: p.detach() for n, p in model.named_parameters()}
    lrs = {n: (torch.tensor(lr) if lr is not None else a) for n, a in init["lrs"].items()}
    loop = InnerLoop("maml", steps if steps is not None else int(init["inner_steps"]), tuple(lrs), ways)
    task_loss = TaskLoss(model, loss, ways)
    with torch.no_grad():
        _, before = task_loss.with_accuracy(params, x, torch.as_tensor(y))
    points = []
    for k in shots:
        accs = []
        for r in range(repeats):
            rng = np.random.default_rng([seed, k, r])
            support = np.concatenate([rng.choice(rows[int(c)], k, replace=False) for c in classes])
            rest = np.setdiff1d(np.arange(len(y)), support)
            fast = adapt(task_loss, params, lrs, x[support], torch.as_tensor(y[support]), loop)
            with torch.no_grad():
                _, acc = task_loss.with_accuracy(fast, x[rest], torch.as_tensor(y[rest]))
            accs.append(float(acc))
        points.append(CurvePoint(k, float(np.mean(accs)), float(np.std(accs)), float(before), repeats))
    return points
