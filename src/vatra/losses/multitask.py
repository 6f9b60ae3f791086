"""Multi-task loss: named heads with fixed or learned (uncertainty) weights, plus penalty terms."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor, nn

from vatra.data._base import DatasetSpec
from vatra.errors import ConfigError
from vatra.losses._base import Loss, default_loss, load_loss
from vatra.registry import describe, import_object

if TYPE_CHECKING:
    from vatra.config._sections import MultitaskConfig, TrainConfig

HeadKind = Literal["classification", "multilabel", "regression"]
Penalty = Callable[[Any, Any], Tensor]  # (output, target) -> scalar


class Head(NamedTuple):
    """One head: its loss, what it predicts, and its weight (``weighting = "fixed"``)."""

    loss: nn.Module
    kind: HeadKind
    weight: float = 1.0


class MultiTask(Loss):
    """Σ over heads of weighted head losses, plus Σ of weighted penalties.

    ``output`` and ``target`` are dicts keyed by head name (the target may hold more keys, for
    penalties). ``weighting = "fixed"``: Σ w_i·L_i. ``"uncertainty"`` (Kendall, Gal & Cipolla 2018):
    a learned log-variance s_i per head (``log_vars[i]``, starting at 0) gives regression heads
    0.5·exp(−s_i)·L_i + 0.5·s_i and classification/multilabel heads exp(−s_i)·L_i + 0.5·s_i, so a
    noisier task is weighted down (the heads' fixed weights are then unused); ``log_vars`` must be
    optimised with the model, and under data parallelism its gradient averaged like the model's.
    """

    scale: Tensor

    def __init__(
        self,
        heads: Mapping[str, Head | tuple[nn.Module, HeadKind, float]],
        weighting: Literal["fixed", "uncertainty"] = "fixed",
        penalties: Sequence[tuple[Penalty, float]] = (),
    ) -> None:
        super().__init__()
        if not heads:
            raise ValueError("MultiTask needs at least one head")
        if weighting not in ("fixed", "uncertainty"):
            raise ValueError(f"MultiTask weighting is 'fixed' or 'uncertainty', not {weighting!r}")
        parsed = {name: Head(*head) for name, head in heads.items()}
        for name, head in parsed.items():
            if head.kind not in get_args(HeadKind):
                raise ValueError(f"MultiTask head {name!r}: {head.kind!r} is not one of {get_args(HeadKind)}")
        self.losses = nn.ModuleDict({name: head.loss for name, head in parsed.items()})
        self.kinds: dict[str, HeadKind] = {name: head.kind for name, head in parsed.items()}
        self.fixed: dict[str, float] = {name: float(head.weight) for name, head in parsed.items()}
        self.weighting = weighting
        self.penalties = list(penalties)
        self.log_vars = nn.Parameter(torch.zeros(len(parsed))) if weighting == "uncertainty" else None
        # 0.5 for regression heads (Gaussian likelihood), 1 otherwise; a buffer so it follows .to()
        scale = [0.5 if head.kind == "regression" else 1.0 for head in parsed.values()]
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, spec: DatasetSpec) -> MultiTask:
        return cls.from_config(cfg.multitask, spec)

    @classmethod
    def from_config(cls, cfg: MultitaskConfig, spec: DatasetSpec) -> MultiTask:
        """Heads from ``[train.multitask.heads.<name>]`` (built-in head losses with their defaults),
        penalties from ``[[train.multitask.penalties]]`` import strings."""
        if not cfg.heads:
            raise ConfigError(
                "train.multitask.heads: a multitask loss needs heads; add [train.multitask.heads.<name>]"
            )
        heads: dict[str, Head] = {}
        for name, head in cfg.heads.items():
            key = f"train.multitask.heads.{name}"
            if spec.heads and name not in spec.heads:
                raise ConfigError(f"{key}: the data has no target {name!r}; it has: {', '.join(spec.heads)}")
            loss_name = default_loss(head.task) if head.loss == "auto" else head.loss
            if loss_name == "multitask":
                raise ConfigError(f"{key}.loss: a head's loss cannot itself be multitask")
            heads[name] = Head(load_loss(loss_name, f"{key}.loss"), head.task, head.weight)
        penalties: list[tuple[Penalty, float]] = []
        for i, penalty in enumerate(cfg.penalties):
            key = f"train.multitask.penalties[{i}].fn"
            fn = import_object(penalty.fn, key)
            if not callable(fn):
                raise ConfigError(f"{key}: {penalty.fn!r} is {describe(fn)}, not a function (output, target)")
            penalties.append((fn, penalty.weight))
        return cls(heads, cfg.weighting, penalties)

    def head_losses(self, output: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Tensor]:
        """Each head's own (unweighted) loss."""
        if not isinstance(output, Mapping) or not isinstance(target, Mapping):
            raise ValueError(
                "multitask: the model's output and the target must be dicts {head: tensor}, got "
                f"{describe(output)} and {describe(target)}"
            )
        for name in self.losses:
            for side, held in (("output", output), ("target", target)):
                if name not in held:
                    raise ValueError(
                        f"multitask: head {name!r} is missing from the {side}; it has: {sorted(held)}"
                    )
        return {name: loss(output[name], target[name]) for name, loss in self.losses.items()}

    def combine(self, losses: Mapping[str, Tensor], output: Any, target: Any) -> Tensor:
        """The total from the head losses: weighted sum plus weighted penalties."""
        stacked = torch.stack([losses[name] for name in self.losses])  # (H,)
        if self.log_vars is None:
            weights = torch.tensor(list(self.fixed.values()), dtype=stacked.dtype, device=stacked.device)
            total = (weights * stacked).sum()
        else:
            total = (self.scale * torch.exp(-self.log_vars) * stacked + 0.5 * self.log_vars).sum()
        for fn, weight in self.penalties:
            total = total + weight * fn(output, target)
        return total

    def forward(self, output: Mapping[str, Any], target: Mapping[str, Any]) -> Tensor:
        return self.combine(self.head_losses(output, target), output, target)

    def weights(self) -> dict[str, float]:
        """Each head's effective multiplier now: w_i (fixed), or scale_i·exp(−s_i) (uncertainty).

        NOTE: reads the learned log-variances to the host (a sync point); call it per log line.
        """
        if self.log_vars is None:
            return dict(self.fixed)
        values = (self.scale * torch.exp(-self.log_vars.detach())).tolist()
        return dict(zip(self.losses, values, strict=True))
