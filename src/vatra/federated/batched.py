"""Several simulated clients trained at once: ``torch.func.vmap`` over their stacked parameters.

A round of a cross-device simulation is many tiny trainings of one architecture (a few steps of a
small model each). Looping over them pays Python and dispatch overhead per client per step;
stacking the clients' weights on a leading axis ``C`` and vmapping one functional step
(``functional_call`` + ``grad``) makes each step a handful of batched kernels for the whole group,
which is how JAX simulators reach their speed.

The batched step is exactly the per-client one — the same batches from each client's own seeded
sampler, torch's SGD update (momentum, weight decay) at the same learning rate schedule — so the
updates agree with clients trained one by one up to float summation order
(``tests/test_federated_scale.py``). What it cannot express falls back to the loop
(:func:`batchable`): Adam, gradient clipping, plugins (FedProx's term, DP-SGD), random layers
(dropout), local epochs (unequal step counts), several candidate models or personal heads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from vatra.config import Config
from vatra.engine.optim import lr_factor
from vatra.federated.params import ParamLayout

_RANDOM_OR_STATEFUL = (nn.Dropout, nn.modules.batchnorm._BatchNorm)


def batchable(cfg: Config, conf: dict[str, Any], model: nn.Module, models_sent: int, plugins: int) -> bool:
    """Whether a round's clients can train as one vmapped group (else they train one by one)."""
    return (
        cfg.optim.name == "sgd"
        and not cfg.train.clip_grad_norm
        and float(conf.get("mu", 0.0)) == 0.0
        and int(conf.get("local_epochs", 0)) == 0
        and int(conf.get("personal_layers", 0)) == 0
        and models_sent == 1
        and plugins == 0
        and not any(isinstance(m, _RANDOM_OR_STATEFUL) for m in model.modules())
    )


class GroupTrainer:
    """Trains ``C`` copies of one model, each from its own weights on its own batches, in one vmap."""

    def __init__(self, cfg: Config, model: nn.Module, loss: nn.Module, layout: ParamLayout) -> None:
        self.cfg = cfg.optim
        self.model = model
        self.layout = layout

        def one_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss(functional_call(model, params, (x,)), y)

        self.step = vmap(grad_and_value(one_loss))  # (C, ...) params, (C, B, ...) x, (C, B) y

    def stack(self, starts: np.ndarray) -> dict[str, torch.Tensor]:
        """(C, P) flat vectors → ``{name: (C, *shape)}`` tensors."""
        flat = torch.from_numpy(np.ascontiguousarray(starts, dtype=np.float32))
        parts = torch.split(flat, self.layout.sizes, dim=1)
        return {
            name: part.reshape(len(starts), *shape).clone()
            for name, shape, part in zip(self.layout.names, self.layout.shapes, parts, strict=True)
        }

    @torch.no_grad()
    def train(self, starts: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """``steps`` SGD steps for each of ``C`` clients; x: (steps, C, B, ...), y: (steps, C, B).

        Returns the trained weights (C, P) and each step's loss (C, steps).
        """
        steps = x.shape[0]
        params = self.stack(starts)
        momentum, decay = self.cfg.momentum, self.cfg.weight_decay
        buffers: dict[str, torch.Tensor] = {}
        losses = torch.zeros(len(starts), steps, dtype=torch.float64)
        self.model.train()
        for i in range(steps):
            with torch.enable_grad():
                grads, loss = self.step(params, x[i], y[i])
            lr = self.cfg.lr * lr_factor(i, steps, self.cfg)  # the LambdaLR schedule of the loop
            for name, p in params.items():
                d = grads[name] if not decay else grads[name].add(p, alpha=decay)
                if momentum:  # torch.optim.SGD: the first step's buffer is the gradient itself
                    buf = buffers.get(name)
                    d = buffers[name] = d.clone() if buf is None else buf.mul_(momentum).add_(d)
                p.sub_(d, alpha=lr)
            losses[:, i] = loss.detach()
        trained = torch.cat([params[n].reshape(len(starts), -1) for n in self.layout.names], dim=1)
        return trained.numpy(), losses.numpy()
