"""Built-in models (mlp, cnn, gpt), their registry and the shared loss and accuracy."""

from __future__ import annotations

from vatra.models._common import count_correct, loss_fn
from vatra.models.cnn import CNN
from vatra.models.gpt import GPT
from vatra.models.mlp import MLP
from vatra.models.registry import MODELS, build_model

__all__ = ["CNN", "GPT", "MLP", "MODELS", "build_model", "count_correct", "loss_fn"]
