"""Classification losses: cross-entropy over classes (and lm tokens), binary cross-entropy over labels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from torch.nn import functional as F

from vatra.data._base import DatasetSpec
from vatra.losses._base import Loss, align, class_weights, flatten_tokens

if TYPE_CHECKING:
    from vatra.config._sections import TrainConfig


class CrossEntropy(Loss):
    """Mean cross-entropy of logits (B, C) against class ids (B,); lm (B, T, V) against (B, T) is
    flattened to every token. ``weight`` (C,) are class weights (a buffer), as in
    ``torch.nn.functional.cross_entropy`` (the weighted mean divides by the targets' weights)."""

    weight: Tensor | None

    def __init__(self, label_smoothing: float = 0.0, weight: Tensor | None = None) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing
        self.register_buffer("weight", weight)

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, spec: DatasetSpec) -> CrossEntropy:
        return cls(cfg.label_smoothing, class_weights(cfg, spec.num_classes, "classes"))

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        logits, labels = flatten_tokens(output, target, "cross_entropy")  # (N, C), (N,)
        return F.cross_entropy(logits, labels, weight=self.weight, label_smoothing=self.label_smoothing)

    def extra_repr(self) -> str:
        return f"label_smoothing={self.label_smoothing}"


class BCE(Loss):
    """Mean binary cross-entropy with logits (B, L) against 0/1 targets (B, L); a single label may be
    (B,) or (B, 1) on either side. ``pos_weight`` (L,) weighs each label's positives (a buffer)."""

    pos_weight: Tensor | None

    def __init__(self, pos_weight: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("pos_weight", pos_weight)

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, spec: DatasetSpec) -> BCE:
        return cls(class_weights(cfg, spec.num_classes, "labels"))

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        logits, labels = align(output, target, "bce")
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), pos_weight=self.pos_weight)
