"""Built-in models (mlp, cnn, gpt) and ``build_model``, which also builds a user's model by import string."""

from __future__ import annotations

from vatra.models.cnn import CNN
from vatra.models.gpt import GPT
from vatra.models.mlp import MLP
from vatra.models.registry import build_model

__all__ = ["CNN", "GPT", "MLP", "build_model"]
