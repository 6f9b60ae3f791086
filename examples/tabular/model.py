"""A user's own model: vatra calls ``build(spec, **[model.kwargs])`` and trains what it returns."""

from __future__ import annotations

from torch import Tensor, nn

from vatra.data import DatasetSpec


class TabularNet(nn.Module):
    """Two hidden layers with dropout; one logit per class."""

    def __init__(self, features: int, classes: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, features) -> (B, classes)


def build(spec: DatasetSpec, hidden: int = 64, dropout: float = 0.1) -> nn.Module:
    """``spec`` says what the table holds: input_shape = (features,), num_classes = classes."""
    return TabularNet(spec.input_shape[0], spec.num_classes, hidden, dropout)
