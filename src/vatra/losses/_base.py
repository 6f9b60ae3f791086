"""Task kinds, the base classes of losses and metrics, shape alignment, building a run's loss."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast, get_args

import torch
from torch import Tensor, nn

from vatra.data._base import DatasetSpec, TaskKind
from vatra.errors import ConfigError
from vatra.registry import LOSSES, call_with, describe

if TYPE_CHECKING:
    from vatra.config._sections import TrainConfig

TASKS: tuple[str, ...] = get_args(TaskKind)
_DEFAULT_LOSS: dict[str, str] = {
    "classification": "cross_entropy",
    "lm": "cross_entropy",
    "multilabel": "bce",
    "regression": "mse",
    "ranking": "listnet",
    "multitask": "multitask",
}


class Loss(nn.Module):
    """Base of the built-in losses: ``loss(output, target)`` is a scalar tensor, the batch mean.

    A built-in is an ``nn.Module`` so that ``.to(device)`` moves its buffers (class weights) and
    learned weights (multitask log-variances) are parameters the optimizer sees.
    ``from_train_config`` builds it from ``[train]`` (``build_loss`` calls it for built-in names).
    """

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, spec: DatasetSpec) -> Loss:
        return cls()


class FunctionLoss(nn.Module):
    """A user's loss function ``fn(output, target, **kwargs) -> scalar`` as an ``nn.Module``."""

    def __init__(self, fn: Callable[..., Tensor], kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.kwargs = dict(kwargs or {})

    def forward(self, output: Any, target: Any) -> Tensor:
        return self.fn(output, target, **self.kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def resolve_task(task: str, spec: DatasetSpec) -> TaskKind:
    """The run's task: ``"auto"`` is what the data says (``spec.kind``), anything else is kept."""
    if task == "auto":
        return spec.kind
    if task not in TASKS:
        raise ConfigError(f"train.task: unknown task {task!r}; choose one of: auto, {', '.join(TASKS)}")
    return task  # type: ignore[return-value]


def default_loss(task: str) -> str:
    """The built-in loss name a task uses when ``train.loss = "auto"``."""
    if task not in _DEFAULT_LOSS:
        raise ConfigError(f"train.task: unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    return _DEFAULT_LOSS[task]


def load_loss(name: str, key: str, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """A loss from a built-in name or an import string, as an ``nn.Module``.

    A class is instantiated with ``kwargs`` (an ``nn.Module`` instance is kept, another callable is
    wrapped); a function is wrapped so that it is called as ``fn(output, target, **kwargs)``.
    """
    kwargs = dict(kwargs or {})
    obj = LOSSES.load(name, key)
    if inspect.isclass(obj):
        made = call_with(obj, kwargs, {}, key)
        if isinstance(made, nn.Module):
            return made
        if callable(made):
            return FunctionLoss(made)
        raise ConfigError(f"{key}: {name!r} made {describe(made)}; expected a callable loss")
    if callable(obj):
        try:
            inspect.signature(obj).bind(None, None, **kwargs)
        except TypeError as err:
            raise ConfigError(f"{key}: cannot call {name!r} as fn(output, target, **kwargs): {err}") from None
        except ValueError:  # no signature to check against
            pass
        return FunctionLoss(obj, kwargs)
    raise ConfigError(f"{key}: {name!r} is {describe(obj)}, not a loss function or class")


def build_loss(cfg: TrainConfig, spec: DatasetSpec) -> nn.Module:
    """The run's loss: ``train.loss`` (``auto`` = the task's default) configured from ``[train]``."""
    name = default_loss(resolve_task(cfg.task, spec)) if cfg.loss == "auto" else cfg.loss
    if not LOSSES.is_builtin(name):
        return load_loss(name, "train.loss", cfg.loss_kwargs)
    if cfg.loss_kwargs:
        raise ConfigError(
            f"train.loss_kwargs: only for an import-string train.loss; the built-in {name!r} takes its "
            "settings from [train] (label_smoothing, class_weights, huber_delta, multitask)"
        )
    cls = cast(type[Loss], LOSSES.load_class(name, Loss, "train.loss"))
    return cls.from_train_config(cfg, spec)


def class_weights(cfg: TrainConfig, expected: int, what: str) -> Tensor | None:
    """``train.class_weights`` as a tensor (None when empty), checked against the data's width."""
    if not cfg.class_weights:
        return None
    if expected and len(cfg.class_weights) != expected:
        raise ConfigError(
            f"train.class_weights: {len(cfg.class_weights)} weights, but the data has {expected} {what}; "
            "give one weight for each"
        )
    return torch.tensor(cfg.class_weights, dtype=torch.float32)


def align(output: Tensor, target: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """``(output, target)`` with equal shapes: a (B, 1) side against a (B,) side is squeezed to (B,)."""
    if output.shape == target.shape:
        return output, target
    if output.dim() == 2 and output.shape[1] == 1 and target.shape == output.shape[:1]:
        return output[:, 0], target
    if target.dim() == 2 and target.shape[1] == 1 and output.shape == target.shape[:1]:
        return output, target[:, 0]
    raise ValueError(
        f"{what}: output shape {tuple(output.shape)} does not match target shape {tuple(target.shape)}; "
        "expected equal shapes, or (B, 1) against (B,)"
    )


def flatten_tokens(output: Tensor, target: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """Logits (..., C) and integer targets (...) as (N, C) and (N,): lm (B, T, V) becomes (B*T, V)."""
    if output.dim() < 2 or output.shape[:-1] != target.shape:
        raise ValueError(
            f"{what}: output shape {tuple(output.shape)} does not match target shape {tuple(target.shape)}; "
            "expected logits (B, C) against (B,), or (B, T, V) against (B, T)"
        )
    if output.dim() == 2:
        return output, target
    return output.reshape(-1, output.shape[-1]), target.reshape(-1)


class Metrics:
    """Evaluation metrics of one task, accumulated as sums so that ranks merge them exactly.

    Call order: set ``num_classes`` when the spec does not know it (0) → ``update(output, target)``
    once per evaluation batch → ``state()`` → the trainer all-reduces the state with SUM across ranks
    → ``compute(state)`` gives plain names (``loss``, ``accuracy``, ...) that the trainer prefixes.

    Every entry of the state is a sum (float64), and its length depends only on the config and the
    spec (``num_classes``), never on the data seen. With ``num_classes = 0`` it is taken from the
    first output's last dimension, so ``state()`` then needs at least one ``update`` first; a rank
    that may see no batch needs ``num_classes`` set beforehand. Accumulators live on the first
    output's device (``to(device)`` says where they live before that) and ``update`` never syncs
    with the host. The loss is ``loss(output, target)`` weighted by the batch's first dimension.
    Not thread-safe: one instance per evaluation pass of one rank.
    """

    sized_by_classes = False  # whether size() depends on num_classes

    def __init__(self, loss: nn.Module, num_classes: int = 0) -> None:
        self.loss = loss
        self.num_classes = num_classes
        self.device = torch.device("cpu")
        self._sums: Tensor | None = None

    def size(self) -> int:
        """Length of ``state()``: the loss sum, the sample count and the task's own sums."""
        return 2 + self.task_size()

    def task_size(self) -> int:
        return 0

    def width(self, output: Tensor) -> int:
        """The ``num_classes`` a batch's output implies (its last dimension)."""
        return int(output.shape[-1])

    def to(self, device: torch.device | str) -> Metrics:
        self.device = torch.device(device)
        if self._sums is not None:
            self._sums = self._sums.to(self.device)
        return self

    def update(self, output: Any, target: Any) -> None:
        """Accumulate one batch."""
        with torch.no_grad():
            self.accumulate(output, target, self.loss(output, target))

    def accumulate(self, output: Any, target: Any, loss: Tensor) -> None:
        """Accumulate one batch whose loss is already known (multitask passes each head's)."""
        if self.sized_by_classes:
            width = self.width(output)
            if not self.num_classes:
                self.num_classes = width
            elif width != self.num_classes:
                raise ValueError(
                    f"{type(self).__name__}: the output has width {width} (shape {tuple(output.shape)}), "
                    f"expected {self.num_classes} (the data's num_classes)"
                )
        if self._sums is None:
            self.device = output.device
            self._sums = torch.zeros(self.size(), dtype=torch.float64, device=self.device)
        n = target.shape[0]
        self._sums[0] += loss.detach().double() * n
        self._sums[1] += n
        self.add(self._sums[2:], output, target)

    def add(self, sums: Tensor, output: Tensor, target: Tensor) -> None:
        """Add one batch's task sums into ``sums`` (a view of the state, in place)."""

    def state(self) -> Tensor:
        """This rank's sums, a 1-D float64 tensor of ``size()`` entries (a copy)."""
        if self._sums is not None:
            return self._sums.clone()
        if self.sized_by_classes and not self.num_classes:
            raise RuntimeError(
                f"{type(self).__name__}: the number of classes is unknown (spec.num_classes = 0) and no "
                "batch was seen; set metrics.num_classes before evaluating"
            )
        return torch.zeros(self.size(), dtype=torch.float64, device=self.device)

    def compute(self, state: Tensor) -> dict[str, float]:
        """Metric values from a (summed) state; NaN where nothing was counted."""
        s = state.detach().to("cpu", torch.float64)
        n = float(s[1])
        return {"loss": ratio(float(s[0]), n), **self.summarise(s[2:], n)}

    def summarise(self, sums: Tensor, n: float) -> dict[str, float]:
        """The task's metrics from its sums and the sample count."""
        return {}


def ratio(num: float, den: float) -> float:
    """``num / den``, NaN when nothing was counted."""
    return num / den if den else float("nan")
