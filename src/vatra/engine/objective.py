"""What the trainer optimises: the batch contract's model call, a model with a loss of its own
parameters as one module, and the seeding that makes runs repeat exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from vatra.errors import ConfigError
from vatra.losses import FunctionLoss


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """Distinct, reproducible per-rank seed (dropout, sampler order)."""
    return seed * 100_003 + rank


def call_model(model: nn.Module, inputs: Any) -> Any:
    """The batch contract: a dict of inputs is passed as keyword arguments, anything else as one."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


class Objective(nn.Module):
    """The model and a loss with learned parameters (multitask uncertainty weights) as one module,
    so DDP averages the loss's gradients too and checkpoints hold both."""

    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, inputs: Any, target: Any) -> torch.Tensor:
        return self.loss(call_model(self.model, inputs), target)


def as_loss_module(loss: Any) -> nn.Module:
    """A loss given as a function ``(output, target) -> Tensor`` or a module, as a module."""
    if isinstance(loss, nn.Module):
        return loss
    if callable(loss):
        return FunctionLoss(loss)
    raise ConfigError(f"loss: expected a function (output, target) -> Tensor or an nn.Module, not {loss!r}")
