"""Checks of the first micro-batch against the model and a user's loss, so a mismatch is one clear
error before the first optimizer step instead of a TypeError or a run that quietly learns nothing."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from vatra.errors import ConfigError

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_inputs(model: nn.Module, inputs: Any) -> None:
    """A dict of inputs is passed as keyword arguments: its keys must be ``model.forward``'s parameters."""
    if not isinstance(inputs, dict):
        return
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C extension): the call itself will say
        return
    named = [p.name for p in params if p.kind in _NAMED]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    unknown = [] if takes_any else [k for k in inputs if k not in named]
    missing = [p.name for p in params if p.kind in _NAMED and p.default is p.empty and p.name not in inputs]
    if unknown or missing:
        raise ConfigError(
            f"model: the inputs are a dict with keys {sorted(map(str, inputs))}, passed as keyword "
            f"arguments, but {type(model).__name__}.forward takes ({', '.join(named)}); name the dict's "
            "keys after forward's parameters"
        )


def check_loss_shapes(output: Any, target: Any) -> None:
    """A float target whose shape broadcasts with the output's into a larger one: ``(B, 1)`` against
    ``(B,)`` makes an elementwise loss compare every output with every target, (B, B) pairs."""
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        return
    if output.shape == target.shape or not target.is_floating_point():
        return
    try:
        joint = torch.broadcast_shapes(output.shape, target.shape)
    except RuntimeError:
        return
    if joint not in (output.shape, target.shape):
        raise ConfigError(
            f"loss: the model's output has shape {tuple(output.shape)} and the target {tuple(target.shape)}; "
            f"an elementwise loss would broadcast them to {tuple(joint)}; make the model return the "
            f"target's shape (e.g. output.squeeze(-1)) or reshape one of them in the loss"
        )
