"""Model registry: one builder per ``model.name``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from vatra.config import ModelConfig
from vatra.data import DatasetSpec
from vatra.errors import ConfigError
from vatra.models.cnn import build_cnn
from vatra.models.gpt import build_gpt
from vatra.models.mlp import build_mlp

ModelBuilder = Callable[[ModelConfig, DatasetSpec], nn.Module]

MODELS: dict[str, ModelBuilder] = {"cnn": build_cnn, "gpt": build_gpt, "mlp": build_mlp}


def build_model(cfg: ModelConfig, spec: DatasetSpec) -> nn.Module:
    """The model ``cfg.name`` for inputs and outputs described by ``spec``; init follows torch's RNG."""
    try:
        builder = MODELS[cfg.name]
    except KeyError:
        raise ConfigError(
            f"model.name: unknown model {cfg.name!r}; choose one of: {', '.join(sorted(MODELS))}"
        ) from None
    return builder(cfg, spec)
