"""``build_model``: a built-in model by name, or a user's builder by import string."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from vatra.config import ModelConfig
from vatra.data import DatasetSpec
from vatra.registry import MODELS, call_with, check_returned


def build_model(cfg: ModelConfig, spec: DatasetSpec, heads: Mapping[str, int] | None = None) -> nn.Module:
    """The model ``cfg.name`` for inputs and outputs described by ``spec``; init follows torch's RNG.

    Built-ins are sized from the spec (``heads``: multitask head sizes the config sets). A user's
    builder (``model.name = "pkg.module:build"``) is called with ``[model.kwargs]``, plus ``spec`` when
    it declares that argument, and must return an ``nn.Module``.
    """
    fn = MODELS.load_callable(cfg.name)
    if MODELS.is_builtin(cfg.name):
        if cfg.name == "mlp":
            return fn(cfg, spec, heads)
        return fn(cfg, spec)
    model = call_with(fn, dict(cfg.kwargs), {"spec": spec}, "model.kwargs")
    return check_returned(model, nn.Module, cfg.name, "model.name", "a torch.nn.Module")
