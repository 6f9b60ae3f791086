"""Adaptation at the edge: the meta-learned initialisation fine-tuned on K labelled examples of a
new task, and the accuracy curve against K.

``vatra meta`` leaves the initialisation in its run folder as ``meta/init.pt`` (rank 0, at the end
of the run): the model's weights, the inner loop's LRs and what the inner loop adapts. For each K,
:func:`accuracy_curve` draws ``repeats`` support sets of K rows per class from the new data, adapts
a copy of the weights with the inner loop (the same steps and LRs as meta-training, unless told
otherwise) and scores the rows not drawn. :func:`adapt_once` is that curve's first draw at one K,
its weights kept: the model ``vatra meta adapt --save`` writes.
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


@dataclass
class Adapted:
    """One adaptation: the weights after the inner loop on ``support`` (row indices of the new data),
    and the accuracy on the ``scored`` rows not drawn."""

    weights: dict[str, torch.Tensor]
    support: np.ndarray
    accuracy: float
    scored: int


class _NewTask:
    """The new task ``(x, y)`` ready to adapt to: the initialisation's parameters, LRs and inner
    loop, and the rows of each class; checks the labels and K against the data."""

    def __init__(
        self,
        model: nn.Module,
        loss: Any,
        init: dict[str, Any],
        x: torch.Tensor,
        y: np.ndarray,
        shots: list[int],
        steps: int | None,
        lr: float | None,
    ) -> None:
        self.classes = np.unique(y)
        ways = int(init["ways"]) or len(self.classes)
        if len(self.classes) > ways or int(self.classes.max()) >= ways:
            raise ConfigError(
                f"the new data has classes {self.classes.tolist()}, but the initialisation was meta-learned "
                f"for {ways}-way tasks (labels 0..{ways - 1}); give at most {ways} classes, encoded "
                f"0..{ways - 1}"
            )
        self.rows = {int(c): np.flatnonzero(y == c) for c in self.classes}
        fewest = min(len(r) for r in self.rows.values())
        too_many = [k for k in shots if k >= fewest]
        if too_many:
            raise ConfigError(
                f"--shots {too_many[0]}: the new data has only {fewest} rows of its smallest class, and "
                f"some must remain to score; give --shots below {fewest}"
            )
        model.load_state_dict(init["weights"])
        self.x, self.y = x, y
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        self.lrs = {n: (torch.tensor(lr) if lr is not None else a) for n, a in init["lrs"].items()}
        inner = steps if steps is not None else int(init["inner_steps"])
        self.loop = InnerLoop("maml", inner, tuple(self.lrs), ways)
        self.task_loss = TaskLoss(model, loss, ways)

    def accuracy(self, params: dict[str, torch.Tensor], rows: np.ndarray | slice) -> float:
        with torch.no_grad():
            _, acc = self.task_loss.with_accuracy(params, self.x[rows], torch.as_tensor(self.y[rows]))
        return float(acc)

    def draw(self, k: int, seed: int, repeat: int) -> Adapted:
        """Adapt on the ``repeat``-th seeded support set of ``k`` rows per class; score the rest."""
        rng = np.random.default_rng([seed, k, repeat])
        support = np.concatenate([rng.choice(self.rows[int(c)], k, replace=False) for c in self.classes])
        rest = np.setdiff1d(np.arange(len(self.y)), support)
        sy = torch.as_tensor(self.y[support])
        fast = adapt(self.task_loss, self.params, self.lrs, self.x[support], sy, self.loop)
        return Adapted(fast, support, self.accuracy(fast, rest), len(rest))


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
    task = _NewTask(model, loss, init, x, y, shots, steps, lr)
    before = task.accuracy(task.params, slice(None))
    points = []
    for k in shots:
        accs = [task.draw(k, seed, r).accuracy for r in range(repeats)]
        points.append(CurvePoint(k, float(np.mean(accs)), float(np.std(accs)), before, repeats))
    return points


def adapt_once(
    model: nn.Module,
    loss: Any,
    init: dict[str, Any],
    x: torch.Tensor,
    y: np.ndarray,
    shots: int,
    *,
    steps: int | None = None,
    lr: float | None = None,
    seed: int = 0,
) -> Adapted:
    """``model`` adapted on one support set of ``shots`` rows per class of ``(x, y)``: the curve's
    first draw at that K (same seed, same rows, same inner loop), its weights loaded into ``model``
    (buffers as meta-trained) in eval mode."""
    task = _NewTask(model, loss, init, x, y, [shots], steps, lr)
    done = task.draw(shots, seed, 0)
    with torch.no_grad():
        model.load_state_dict({**init["weights"], **{n: t.detach() for n, t in done.weights.items()}})
    model.eval()
    return done
