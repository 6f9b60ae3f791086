"""Regression losses: mean squared error and Huber, over every output of every sample."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from torch.nn import functional as F

from vatra.data._base import DatasetSpec
from vatra.losses._base import Loss, align

if TYPE_CHECKING:
    from vatra.config._sections import TrainConfig


class MSE(Loss):
    """Mean squared error of outputs (B,) / (B, 1) / (B, K) against targets (B,) / (B, K)."""

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        pred, y = align(output, target, "mse")
        return F.mse_loss(pred, y.to(pred.dtype))


class Huber(Loss):
    """Mean Huber loss: squared below ``delta``, linear beyond it (robust to outlying targets)."""

    def __init__(self, delta: float = 1.0) -> None:
        super().__init__()
        self.delta = delta

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, spec: DatasetSpec) -> Huber:
        return cls(cfg.huber_delta)

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        pred, y = align(output, target, "huber")
        return F.huber_loss(pred, y.to(pred.dtype), delta=self.delta)

    def extra_repr(self) -> str:
        return f"delta={self.delta}"
