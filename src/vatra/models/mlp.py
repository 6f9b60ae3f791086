"""Multi-layer perceptron over flattened inputs."""

from __future__ import annotations

import math

from torch import Tensor, nn

from vatra.config import ModelConfig
from vatra.data import DatasetSpec
from vatra.errors import ConfigError


class MLP(nn.Module):
    """Linear + ReLU (+ Dropout) per hidden width, then a linear classifier."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, *input_shape) -> (B, num_classes)


def build_mlp(cfg: ModelConfig, spec: DatasetSpec) -> MLP:
    if spec.kind != "classification":
        raise ConfigError(
            "model.name: 'mlp' needs a classification dataset (digits, synthetic); use gpt for text"
        )
    return MLP(math.prod(spec.input_shape), cfg.hidden, spec.num_classes, cfg.dropout)
