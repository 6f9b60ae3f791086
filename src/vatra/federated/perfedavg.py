"""Per-FedAvg (Fallah et al., 2020), first order: federated meta-learning with clients as tasks.

Each local step of a client is a first-order MAML step on its own data: a personalisation step of
LR α on one batch D, ``w̃ = w − α ∇L_D(w)``, then the gradient of the next batch D' taken at w̃,
``∇L_D'(w̃)``, applied to w by the client's optimizer. The server averages the updates as FedAvg.
The global model is then an initialisation: a client (or a new owner with few labels) personalises
it with one step of α on its own rows, and is scored after that step (:func:`personalise`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vatra.config import FederatedConfig
from vatra.errors import ConfigError
from vatra.federated.fedavg import FedAvg
from vatra.federated.params import ParamLayout

Loss = Callable[[Any, Any], torch.Tensor]


class PerFedAvg(FedAvg):
    """Server side as FedAvg; the clients take first-order MAML steps (``federated.inner_lr``)."""

    name = "perfedavg"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        if cfg.inner_lr <= 0:
            raise ConfigError(
                "federated.inner_lr: perfedavg needs the personalisation step's LR α > 0 "
                "(e.g. federated.inner_lr = 0.05)"
            )
        if cfg.local_epochs:
            raise ConfigError(
                "federated.local_epochs: a perfedavg step reads two batches, so epochs do not count its "
                "steps; set federated.local_epochs = 0 and federated.local_steps"
            )
        super().__init__(cfg, layout)

    def fit_config(self) -> dict[str, Any]:
        return {**super().fit_config(), "inner_lr": self.cfg.inner_lr}


def personalise(model: nn.Module, loss_of: Callable[[], torch.Tensor], alpha: float) -> torch.Tensor:
    """One SGD step of LR ``alpha`` on ``loss_of()`` applied to ``model`` in place; returns that loss
    (detached)."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_of()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.sub_(g, alpha=alpha)
    return loss.detach()


def meta_gradient(
    model: nn.Module, first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor], alpha: float
) -> torch.Tensor:
    """Per-FedAvg's first-order meta-gradient into the parameters' ``.grad``: ``∇L_D'(w̃)`` with
    ``w̃ = w − α ∇L_D(w)``; the parameters are w again on return. Returns the loss on D at w."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    loss = personalise(model, first, alpha)
    second().backward()  # the gradient at w̃, into .grad
    with torch.no_grad():
        for p, w in zip(params, start, strict=True):
            p.copy_(w)
    return loss
