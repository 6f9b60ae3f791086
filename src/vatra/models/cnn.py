"""Small convolutional classifier for image-shaped inputs (digits)."""

from __future__ import annotations

from torch import Tensor, nn

from vatra.config import ModelConfig
from vatra.data import DatasetSpec
from vatra.errors import ConfigError


class CNN(nn.Module):
    """conv3x3 + ReLU (+ 2x2 max-pool while the map is ≥ 2 wide) per width, global average pool, linear.

    No BatchNorm: its running buffers would make replicas differ between ranks unless synced,
    which breaks exact equality checks against a single-process reference.
    """

    def __init__(
        self, image_shape: tuple[int, int, int], channels: list[int], num_classes: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.image_shape = image_shape
        c, h, w = image_shape
        layers: list[nn.Module] = []
        for out in channels:
            layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.ReLU()]
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(c, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)  # (B, 64) -> (B, C, H, W)
        return self.net(x)  # (B, num_classes)


def build_cnn(cfg: ModelConfig, spec: DatasetSpec) -> CNN:
    if spec.kind != "classification" or spec.image_shape is None:
        raise ConfigError(
            "model.name: 'cnn' needs image inputs (digits); use mlp for synthetic or gpt for text"
        )
    return CNN(spec.image_shape, cfg.channels, spec.num_classes, cfg.dropout)
