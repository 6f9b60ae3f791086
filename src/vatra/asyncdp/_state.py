"""Per-rank state of the modes in checkpoints: each rank's own parameters and optimizer state.

Between synchronisations the ranks' parameters differ, but a checkpoint's model (DCP) holds one copy
of each replicated tensor; so the mode plugins put every rank's own parameters and optimizer state
in ``trainer.state.rank_states`` (flat ``{key: tensor or value}`` parts), loaded after the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def named(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's trained parameters by name (detached views of the live tensors)."""
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def copy_into(live: dict[str, torch.Tensor], saved: dict[str, Any], what: str) -> None:
    """Copy saved tensors into the live ones of the same names; a missing name is an error."""
    missing = sorted(set(live) - set(saved))
    if missing:
        raise ValueError(f"the checkpoint's {what} lacks {', '.join(missing[:3])}")
    with torch.no_grad():
        for name, t in live.items():
            t.copy_(saved[name])


def flat_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's ``state_dict`` as one flat dict: ``"<param index>.<key>"`` → value, and
    ``"param_groups"`` → the groups' hyperparameters (their ``params`` lists are indices)."""
    sd = optimizer.state_dict()
    flat: dict[str, Any] = {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items()}
    flat["param_groups"] = sd["param_groups"]
    return flat


def load_flat_optimizer_state(optimizer: torch.optim.Optimizer, flat: dict[str, Any]) -> None:
    """The inverse of :func:`flat_optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if key == "param_groups":
            continue
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": flat["param_groups"]})
